"""The model called inside its own walk: a forward hook, a layer, a backward hook or a tensor hook
of one of its layers calling the same OffloadModel again (a "teacher" pass, a debugging hook). The
inner call is refused at once with a ``RuntimeError`` that says what to do, before it touches
anything of the engine's; where the hook catches it, the outer forward and backward equal the plain
model's bit for bit, and where it does not, the outer walk fails as with any layer's error and
training goes on exactly afterwards. The re-claims the rule allows (a non-reentrant checkpoint's
recompute of the whole model, several forwards before one backward) keep working, and an interrupt
never leaves the walk marked running (rule 4 of Note: [One walk at a time] in
``offload/walk/slice_walk.py``).
"""

from __future__ import annotations

import copy
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from offload import OffloadModel, OffloadOptimizer
from offload.model import engine_of
from offload.walk import claims as claims_module
from offload.walk import slice_walk as slice_walk_module

from .interrupt_points import LineEvents, traced

pytestmark = pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")

KWARGS = {"lr": 1e-2, "fused": True}
INNER = torch.randn(3, 6, generator=torch.Generator().manual_seed(99))
#: Every hook sits on a layer of slice 1 (the model's slices are layers 0-1, 2-4 and 5-7).
HOOKED = 2
FORWARD_SIDE = ["forward hook", "layer"]
BACKWARD_SIDE = ["backward hook", "tensor hook"]


class Probe(nn.Module):
    """The identity, a layer of slice 1; its forward calls ``act.fn`` where one is set. Not a plain
    attribute: a recompute runs with the attributes its forward started from (Note: [Attribute
    state])."""

    def __init__(self) -> None:
        super().__init__()
        self.act = types.SimpleNamespace(fn=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act.fn is not None:
            self.act.fn()
        return x


def layers(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.BatchNorm1d(16), Probe(),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def twins(activations: str = "checkpointed", update_in_backward: bool = False):
    plain = layers()
    model = OffloadModel(layers(), device="cpu", num_slices=3, checkpoint_activation=activations == "checkpointed")
    assert [s.names for s in engine_of(model).slices] == [["0", "1"], ["2", "3", "4"], ["5", "6", "7"]]
    plain_opt = torch.optim.AdamW(plain.parameters(), **KWARGS)
    opt = OffloadOptimizer(model, torch.optim.AdamW, update_in_backward=update_in_backward, **KWARGS)
    return plain, plain_opt, model, opt


def batch(step: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(step))


def train(model: nn.Module, opt: Any, step: int) -> torch.Tensor:
    opt.zero_grad()
    loss = model(batch(step)).pow(2).mean()
    loss.backward()
    opt.step()
    return loss.detach()


def assert_same(plain: nn.Module, model: OffloadModel, opt: Any = None) -> None:
    if opt is not None:
        opt.synchronize()
    for (name, a), b in zip(plain.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), name


def hook_on(net: nn.Module, where: str, act: Callable[[], None]) -> None:
    """Run ``act`` at ``where`` on a layer of slice 1 of ``net`` (the plain twin or the wrapped model)."""
    layer = net[HOOKED]
    if where == "forward hook":
        layer.register_forward_hook(lambda module, args, output: act())
    elif where == "layer":
        net[4].act.fn = act
    elif where == "backward hook":
        layer.register_full_backward_hook(lambda module, grad_input, grad_output: act())
    else:  # a tensor hook, set on the layer's output where forward builds a graph: fires in backward
        def on_output(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            if output.requires_grad:
                output.register_hook(lambda grad: act())
        layer.register_forward_hook(on_output)


def watch_engine(monkeypatch: pytest.MonkeyPatch, model: OffloadModel) -> list[str]:
    """A name for each touch of the engine's state a call makes as it starts: the refresh's look at
    the layers, the milestones, the slots."""
    engine = engine_of(model)
    touched: list[str] = []

    def spy(owner: Any, name: str) -> None:
        original = getattr(owner, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            touched.append(name)
            return original(*args, **kwargs)
        monkeypatch.setattr(owner, name, wrapped)

    for s in engine.slices:
        spy(s.storage, "registered_tensors_changed")
    for name in ("forward_started", "backward_started"):
        spy(engine.milestones, name)
    for name in ("forget_contents", "acquire", "prefetch"):
        spy(engine.slots, name)
    return touched


def assert_refused(message: str, walk: str) -> None:
    assert message.startswith(f"OffloadModel: the model was called inside its own {walk} walk, from a hook or a "
                              "layer"), message
    assert "refused before it touched anything" in message
    assert "after the walk returns" in message and "copy.deepcopy(model)" in message


class NestedCalls:
    """The wrapped model's ``act``: calls the model (with or without grad), catches the refusal and
    records its message, and checks that the call touched nothing of the engine's."""

    def __init__(self, model: OffloadModel, touched: list[str], inner_grad: bool) -> None:
        self.model, self.touched, self.inner_grad = model, touched, inner_grad
        self.messages: list[str] = []

    def __call__(self) -> None:
        before = len(self.touched)
        try:
            with torch.set_grad_enabled(self.inner_grad):
                self.model(INNER)
        except RuntimeError as error:
            self.messages.append(str(error))
        assert self.touched[before:] == []


@pytest.mark.parametrize("inner_grad", [True, False], ids=["inner-grad", "inner-no-grad"])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("activations", ["checkpointed", "kept"])
@pytest.mark.parametrize("where", FORWARD_SIDE + BACKWARD_SIDE)
def test_a_caught_nested_call_is_refused_and_the_outer_step_is_exact(monkeypatch, where, activations, mode,
                                                                      inner_grad):
    plain, plain_opt, model, opt = twins(activations)
    plain.train(mode == "train")
    model.train(mode == "train")
    act = NestedCalls(model, watch_engine(monkeypatch, model), inner_grad)
    hook_on(model, where, act)
    hook_on(plain, where, lambda: None)
    for step in range(2):
        assert torch.equal(train(model, opt, step), train(plain, plain_opt, step))
        assert_same(plain, model, opt)
    # A layer or forward hook of a checkpointed slice runs again in backward's recompute: refused there too.
    if where in FORWARD_SIDE:
        walks = ["forward", "backward"] if activations == "checkpointed" else ["forward"]
    else:
        walks = ["backward"]
    assert len(act.messages) == 2 * len(walks)
    for message, walk in zip(act.messages, walks * 2):
        assert_refused(message, walk)


@pytest.mark.parametrize("where", FORWARD_SIDE)
def test_a_caught_nested_call_in_a_forward_without_autograd_is_refused_and_its_output_exact(monkeypatch, where):
    plain, plain_opt, model, opt = twins()
    act = NestedCalls(model, watch_engine(monkeypatch, model), inner_grad=False)
    hook_on(model, where, act)
    hook_on(plain, where, lambda: None)
    with torch.no_grad():
        assert torch.equal(model(batch(0)), plain(batch(0)))  # training mode: BatchNorm's statistics move
    assert_same(plain, model)
    assert len(act.messages) == 1
    assert_refused(act.messages[0], "forward")
    assert torch.equal(train(model, opt, 1), train(plain, plain_opt, 1))
    assert_same(plain, model, opt)


def _refusal_goes_on(plain_act_error: list[int]) -> Callable[[], None]:
    """The plain twin's ``act`` where the wrapped model's refusal propagates: it raises at the same
    point, once (as the wrapped model's hook does before it is disarmed)."""
    def act() -> None:
        if plain_act_error:
            plain_act_error.pop()
            raise RuntimeError("refused")
    return act


@pytest.mark.parametrize("update_in_backward", [False, True], ids=["", "update-in-backward"])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("activations", ["checkpointed", "kept"])
@pytest.mark.parametrize("where", FORWARD_SIDE + BACKWARD_SIDE)
def test_a_refused_call_fails_the_outer_walk_and_training_goes_on_exactly(where, activations, mode,
                                                                          update_in_backward):
    plain, plain_opt, model, opt = twins(activations, update_in_backward)
    plain.train(mode == "train")
    model.train(mode == "train")
    assert torch.equal(train(model, opt, 0), train(plain, plain_opt, 0))
    armed = [1]

    def nested() -> None:
        if armed:
            armed.pop()
            model(INNER)
    hook_on(model, where, nested)
    hook_on(plain, where, _refusal_goes_on([1]))
    in_forward = where in FORWARD_SIDE
    for net, optimizer in ((model, opt), (plain, plain_opt)):
        optimizer.zero_grad()
        with pytest.raises(RuntimeError) as raised:
            net(batch(1)).pow(2).mean().backward()
        if net is model:
            refusal = raised.value
            assert_refused(str(refusal), "forward" if in_forward else "backward")
    # As the plain model after the same failure: parameters as they were, the running statistics
    # of the layers before the failing one updated, none of the later ones.
    assert engine_of(model).walking is None and engine_of(model).walk_running is None
    if update_in_backward and not in_forward:
        # Slice 2's update had started when slice 1's backward raised: the documented failure
        # (docs/api.md, Failures), which step() reports.
        if sys.version_info >= (3, 11):  # a note (PEP 678)
            assert "Reload the last checkpoint" in "".join(refusal.__notes__), refusal
        with pytest.raises(RuntimeError, match=r"slices? \[2\]"):
            opt.step()
        return
    if not in_forward:
        # The wrapped model leaves .grad untouched by a failed backward (docs/api.md, Failures); the
        # plain one keeps what its layers after the failing one accumulated.
        assert all(p.grad is None for p in model.parameters())
        plain_opt.zero_grad()
    assert_same(plain, model, opt)
    for step in range(2, 5):
        assert torch.equal(train(model, opt, step), train(plain, plain_opt, step))
        assert_same(plain, model, opt)


def test_a_nested_backward_inside_a_forward_is_refused():
    # A hook that runs backward on an earlier forward's loss: a backward walk inside a forward's.
    plain, plain_opt, model, opt = twins()
    earlier = model(batch(0)).pow(2).mean()
    plain_earlier = plain(batch(0)).pow(2).mean()
    messages: list[str] = []

    def run_backward() -> None:
        try:  # autograd runs the loss's own nodes before the model's: keep their saved tensors
            earlier.backward(retain_graph=True)
        except RuntimeError as error:
            messages.append(str(error))
    hook = model[HOOKED].register_forward_hook(lambda module, args, output: run_backward())
    opt.zero_grad()
    out = model(batch(1))
    hook.remove()
    plain_out = plain(batch(1))
    assert torch.equal(out, plain_out)
    assert len(messages) == 1
    assert_refused(messages[0], "forward")
    assert "(a backward," in messages[0]
    # The earlier graph was left as it was: its backward runs now, after the walk.
    opt.zero_grad()
    plain_opt.zero_grad()
    (earlier + out.pow(2).mean()).backward()
    (plain_earlier + plain_out.pow(2).mean()).backward()
    opt.step()
    plain_opt.step()
    assert_same(plain, model, opt)


REGIONS = {
    # Recomputed as autograd unpacks the loss's saved tensors: before the model's backward.
    "loss inside": lambda net, t: net(t).pow(2).mean() * 2,
    # Recomputed as autograd unpacks tanh's: after the model's backward.
    "layer before": lambda net, t: net(torch.tanh(t)),
}


@pytest.mark.parametrize("region", REGIONS)
def test_a_non_reentrant_checkpoint_of_the_whole_model_recomputes_it_exactly(region):
    # Its recompute calls the model again during backward, outside the model's own walks: allowed.
    plain, plain_opt, model, opt = twins()
    calls: list[bool] = []
    model.register_forward_pre_hook(lambda module, args: calls.append(torch.is_grad_enabled()))
    for step in range(3):
        for net, optimizer in ((model, opt), (plain, plain_opt)):
            optimizer.zero_grad()
            x = batch(step).requires_grad_()
            # Early stop off: with it, the plain recompute of "layer before" stops after tanh, short of
            # BatchNorm, where the wrapped model, whose saves are not the checkpoint's to count, runs
            # whole and moves the running statistics once more (a difference of its own).
            with torch.utils.checkpoint.set_checkpoint_early_stop(False):
                out = checkpoint(REGIONS[region], net, x, use_reentrant=False)
                out.pow(2).mean().backward()
            optimizer.step()
            assert x.grad is not None
        assert_same(plain, model, opt)
    assert len(calls) == 2 * 3  # each step's forward, then its recompute


def test_several_forwards_before_one_backward_are_exact():
    plain, plain_opt, model, opt = twins()
    for net, optimizer in ((model, opt), (plain, plain_opt)):
        optimizer.zero_grad()
        losses = [net(batch(s)).pow(2).mean() for s in range(3)]
        sum(losses).backward()
        optimizer.step()
    assert_same(plain, model, opt)


def test_a_copy_made_beforehand_can_be_called_from_a_hook():
    # What the message advises: a teacher copy has slots of its own.
    plain, plain_opt, model, opt = twins()
    teacher = copy.deepcopy(model)
    plain_teacher = copy.deepcopy(plain)
    outputs: dict[str, torch.Tensor] = {}

    def teach(net: nn.Module, key: str) -> Callable[[], None]:
        def act() -> None:
            with torch.no_grad():
                outputs[key] = net(INNER)
        return act
    hook_on(model, "forward hook", teach(teacher, "wrapped"))
    hook_on(plain, "forward hook", teach(plain_teacher, "plain"))
    assert torch.equal(train(model, opt, 0), train(plain, plain_opt, 0))
    assert torch.equal(outputs["wrapped"], outputs["plain"])
    assert_same(plain, model, opt)


#: Where the interrupt test interrupts (``tests/interrupt_points.py``'s ``LineEvents``): the calls
#: and lines of ``WalkClaim``'s and ``SliceWalk``'s ``__enter__``, ``__exit__`` and ``refuse_inside``,
#: and of the claim's ``take`` and its look for a claim left behind.
CLAIMING = {"__enter__", "__exit__", "refuse_inside", "take", "_left_behind"}
TRACED = {claims_module.__file__: CLAIMING, slice_walk_module.__file__: CLAIMING}


@pytest.mark.parametrize("training", [True, False], ids=["step", "no-grad-forward"])
def test_an_interrupt_anywhere_in_claiming_never_leaves_the_walk_marked_running(training):
    plain, plain_opt, model, opt = twins()
    engine = engine_of(model)

    def call() -> None:
        if training:
            train(model, opt, 0)
        else:
            with torch.no_grad():
                model(batch(0))
    counted = LineEvents(TRACED)
    with traced(counted):
        call()
    assert counted.count > 30
    left_marked = 0
    for at in range(1, counted.count + 1):
        interrupted = LineEvents(TRACED, at)
        with traced(interrupted), pytest.raises(KeyboardInterrupt):
            call()
        marked = engine.walk_running
        # The next call from this thread is not refused as one inside a walk: a walk an interrupt
        # left marked running (as its __exit__ started, say) is forgotten, and a claim an interrupt
        # left held (the walk's, the refresh's, the autograd Function's) taken over and given up
        # (rule 5; from another thread: tests/test_claim_interrupts.py).
        with torch.no_grad():
            model(INNER)
        assert engine.walking is None and engine.walk_running is None, (at, interrupted.fired)
        left_marked += marked is not None
    # The case this test is for: a walk without autograd holds the only claim. In a step, each walk
    # is inside the autograd Function's claim, which gives everything up as the interrupt leaves it.
    assert left_marked > 0 or training
    train(model, opt, 1)
    assert engine.walking is None and engine.walk_running is None
