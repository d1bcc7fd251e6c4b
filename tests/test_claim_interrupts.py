"""Claims an interrupt left behind, and moves refused under the claim (rules 4 and 5 of Note: [One
walk at a time] in ``offload/walk/slice_walk.py``).

A ``KeyboardInterrupt`` injected at every call and line of every claim's taking and giving up (the
refresh's, the autograd Function's forward and backward, the walk's, a move's), as a signal handler
would raise it, may leave the engine held by the main thread. A backward on another thread (as a
CUDA device's autograd thread runs it) or a whole forward and backward there then takes that claim
over instead of being refused, and training equals the plain model's bit for bit. ``.to()`` and
``.double()`` from a hook inside the model's own walk, or from another thread while a walk runs, are
refused before anything moves, and the walk goes on exactly. Every thread is joined with a timeout.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer
from offload.autograd import function as function_module
from offload.model import engine_of
from offload import model as model_module
from offload.walk import claims as claims_module
from offload.walk import engine as engine_module
from offload.walk import slice_walk as slice_walk_module

from .interrupt_points import LineEvents, traced

pytestmark = pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")

TIMEOUT = 30  # seconds for any one thread; a call here takes well under one
KWARGS = {"lr": 1e-2, "fused": True}
OTHER = torch.randn(3, 6, generator=torch.Generator().manual_seed(99))
#: Hooks sit on a layer of slice 1 (the slices are layers 0-2, 3-4 and 5-7).
HOOKED = 3


class Gate(nn.Module):
    """The identity; armed, it stops the next run that reaches it until ``release`` is set. Its
    switch is not a plain attribute: a recompute runs with those its forward started with."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()
        self.armed = types.SimpleNamespace(on=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed.on:
            self.armed.on = False
            self.entered.set()
            assert self.release.wait(TIMEOUT), "the test never released the gate"
        return x


def layers(seed: int = 0) -> nn.Sequential:
    # No buffers: a forward an interrupt stopped part way leaves nothing behind to compare.
    torch.manual_seed(seed)
    return nn.Sequential(Gate(), nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.LayerNorm(16),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def twins():
    plain = layers()
    model = OffloadModel(layers(), device="cpu", num_slices=3)
    assert [s.names for s in engine_of(model).slices] == [["0", "1", "2"], ["3", "4"], ["5", "6", "7"]]
    return plain, torch.optim.AdamW(plain.parameters(), **KWARGS), model, OffloadOptimizer(
        model, torch.optim.AdamW, **KWARGS)


def batch(step: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(step))


def loss_of(net: nn.Module, step: int) -> torch.Tensor:
    return net(batch(step)).pow(2).mean()


def assert_same(plain: nn.Module, model: OffloadModel, opt: Any) -> None:
    opt.synchronize()
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q), name
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), name


def started(target: Callable[[], Any], name: str) -> dict:
    """Run ``target`` in a new thread; what it returned or raised lands in the dict once joined."""
    done: dict = {}

    def run() -> None:
        try:
            done["value"] = target()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            done["error"] = error

    done["thread"] = threading.Thread(target=run, name=name, daemon=True)
    done["thread"].start()
    return done


def joined(done: dict) -> dict:
    done["thread"].join(TIMEOUT)
    assert not done["thread"].is_alive(), f"thread {done['thread'].name} did not finish in {TIMEOUT} s"
    return done


def in_thread(target: Callable[[], Any], name: str) -> dict:
    """Run ``target`` in a new thread and join it: what it returned or raised."""
    return joined(started(target, name))


#: Where :func:`interrupted_everywhere` interrupts (``tests/interrupt_points.py``'s ``LineEvents``):
#: every claim's taking and giving up, the claim itself and each frame that holds one.
TRACED: dict[str, set[str] | None] = {
    claims_module.__file__: None,  # every function
    slice_walk_module.__file__: {"__enter__", "__exit__", "refuse_inside"},
    engine_module.__file__: {"refresh"},
    function_module.__file__: {"forward", "backward"},
    model_module.__file__: {"_apply"},
}


def _forward_without_autograd(model: OffloadModel) -> None:
    with torch.no_grad():
        model(OTHER)


#: The calls interrupted in the main thread, each of which claims the engine.
CALLS: dict[str, Callable[[OffloadModel], Any]] = {
    "forward and backward": lambda model: model(OTHER).pow(2).mean().backward(),
    "forward without autograd": _forward_without_autograd,
    "move": lambda model: model.to("cpu"),  # computes there already: the claim, and nothing moves
}


def interrupted_everywhere(model: OffloadModel, call: str, before: Callable[[int], None],
                           after: Callable[[int], None]) -> int:
    """Interrupt ``call`` at each of its events in turn, in the main thread, between ``before(at)``
    and ``after(at)``, and check that the engine is free after that; the number of interrupts that
    left it held by the main thread (a claim left behind)."""
    engine = engine_of(model)
    counted = LineEvents(TRACED)
    with traced(counted):
        CALLS[call](model)
    assert counted.count > 20
    left_held = 0
    for at in range(1, counted.count + 1):
        before(at)
        interrupted = LineEvents(TRACED, at)
        with traced(interrupted), pytest.raises(KeyboardInterrupt):
            CALLS[call](model)
        left_held += engine.walking is threading.main_thread()
        after(at)
        assert engine.walking is None and engine.walk_running is None, (at, interrupted.fired)
    return left_held


def forward_and_backward(net: nn.Module, step: int) -> torch.Tensor:
    loss = loss_of(net, step)
    loss.backward()
    return loss.detach()


def plain_step(plain: nn.Module, plain_opt: torch.optim.Optimizer, step: int, wrapped_loss: torch.Tensor) -> None:
    plain_opt.zero_grad()
    loss = loss_of(plain, step)
    assert torch.equal(loss.detach(), wrapped_loss.detach())
    loss.backward()
    plain_opt.step()


@pytest.mark.parametrize("call", CALLS)
def test_a_backward_on_another_thread_takes_over_a_claim_an_interrupt_left(call):
    # As on a GPU: the backward of a forward made before the interrupt runs on autograd's device thread.
    plain, plain_opt, model, opt = twins()
    losses: list[torch.Tensor] = []

    def before(step: int) -> None:
        opt.zero_grad()
        losses.append(loss_of(model, step))

    def after(step: int) -> None:
        opt.zero_grad()  # what the interrupted backward may have left: the plain twin never ran it
        loss = losses.pop()
        backward = in_thread(loss.backward, "autograd device thread")
        assert "error" not in backward, backward["error"]
        plain_step(plain, plain_opt, step, loss)
        opt.step()
        assert_same(plain, model, opt)

    assert interrupted_everywhere(model, call, before, after) > 0  # the case this test is for


@pytest.mark.parametrize("call", CALLS)
def test_a_step_on_another_thread_takes_over_a_claim_an_interrupt_left(call):
    plain, plain_opt, model, opt = twins()

    def after(step: int) -> None:
        opt.zero_grad()
        trainer = in_thread(lambda: forward_and_backward(model, step), "trainer")
        assert "error" not in trainer, trainer["error"]
        plain_step(plain, plain_opt, step, trainer["value"])
        opt.step()
        assert_same(plain, model, opt)

    assert interrupted_everywhere(model, call, lambda step: None, after) > 0


#: Moves of a model that computes on the CPU: one that changes nothing, and one that converts the
#: host copies.
MOVES: dict[str, Callable[[OffloadModel], Any]] = {
    "to its own device": lambda model: model.to("cpu"),
    "to float64": lambda model: model.double(),
}


def train_step(model: nn.Module, opt: Any, step: int) -> torch.Tensor:
    opt.zero_grad()
    loss = loss_of(model, step)
    loss.backward()
    opt.step()
    return loss.detach()


def assert_unmoved(model: OffloadModel, engine: Any) -> None:
    assert engine_of(model) is engine and model.device == torch.device("cpu")
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("move", MOVES)
@pytest.mark.parametrize("where", ["forward hook", "backward hook", "forward hook without autograd"])
def test_a_move_from_a_hook_inside_the_walk_is_refused_before_anything_moves(where, move):
    plain, plain_opt, model, opt = twins()
    engine = engine_of(model)
    messages: list[str] = []

    def act() -> None:
        try:
            MOVES[move](model)
        except RuntimeError as error:
            messages.append(str(error))
    if where == "backward hook":
        model[HOOKED].register_full_backward_hook(lambda module, grad_input, grad_output: act())
    else:
        model[HOOKED].register_forward_hook(lambda module, args, output: act())
    if where == "forward hook without autograd":
        with torch.no_grad():
            assert torch.equal(model(batch(0)), plain(batch(0)))
    else:
        for step in range(2):  # the walks go on exactly
            assert torch.equal(train_step(model, opt, step), train_step(plain, plain_opt, step))
            assert_same(plain, model, opt)
    assert_unmoved(model, engine)
    assert messages
    walk = "backward" if where == "backward hook" else "forward"
    for message in messages[:1]:
        assert message.startswith(f"OffloadModel: the model was moved inside its own {walk} walk, from a hook or a "
                                  "layer (a move (.to(), .cuda(), .cpu(), .double(), ...), while"), message
        assert "refused before it changed anything" in message and "after the walk returns" in message
    # Outside the walk it moves, and training goes on exactly.
    assert model.to("cpu") is model
    assert torch.equal(train_step(model, opt, 2), train_step(plain, plain_opt, 2))
    assert_same(plain, model, opt)


@pytest.mark.parametrize("move", MOVES)
@pytest.mark.parametrize("blocked_in", ["forward", "backward"])
def test_a_move_from_another_thread_while_a_walk_runs_is_refused_before_anything_moves(monkeypatch, blocked_in,
                                                                                      move):
    plain, plain_opt, model, opt = twins()
    engine = engine_of(model)
    gate = model[0]
    settled: list[str] = []
    settle = model._settle
    monkeypatch.setattr(model, "_settle", lambda: (settled.append(threading.current_thread().name), settle()))
    opt.zero_grad()
    if blocked_in == "forward":  # in forward's run of slice 0
        gate.armed.on = True
        trainer = started(lambda: forward_and_backward(model, 0), "trainer")
    else:  # in backward's recompute of slice 0
        loss = loss_of(model, 0)
        gate.armed.on = True
        trainer = started(lambda: (loss.backward(), loss.detach())[1], "trainer")
    assert gate.entered.wait(TIMEOUT)
    mover = in_thread(lambda: MOVES[move](model), "mover")
    gate.release.set()
    assert "error" not in joined(trainer), trainer["error"]
    opt.step()
    assert torch.equal(train_step(plain, plain_opt, 0), trainer["value"])
    assert_same(plain, model, opt)
    assert_unmoved(model, engine)
    error = mover.get("error")
    assert isinstance(error, RuntimeError), mover
    assert str(error).startswith("OffloadModel: a move (.to(), .cuda(), .cpu(), .double(), ...) from another thread "
                                 "(thread 'mover') while thread 'trainer' runs a walk of this model"), error
    assert "mover" not in settled  # refused before it waited for anything
    for step in range(1, 3):
        assert torch.equal(train_step(model, opt, step), train_step(plain, plain_opt, step))
    assert_same(plain, model, opt)
