"""Review of OffloadOptimizer(update_in_backward=True): cases beside the specification in
tests/test_update_in_backward.py where the option once differed from training without it (Note:
[Update in backward] in ``offload/optimizing/in_backward.py``)."""

from __future__ import annotations

import copy
import gc
import time
import weakref

import pytest
import torch

import offload
from offload import OffloadActivations, OffloadModel, OffloadOptimizer
from offload.optimizing.in_backward import BackwardUpdates

from .test_optimizer import assert_same, batch, network

pytestmark = pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")

NUM_SLICES = 3


def _collected(ref: weakref.ref, seconds: float = 5.0) -> bool:
    """Whether ``ref``'s object goes once collected; the update worker may hold its last task a
    moment after it finished."""
    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        if ref() is None or time.monotonic() > deadline:
            return ref() is None
        time.sleep(0.01)


@pytest.mark.parametrize("update_in_backward", [False, True])
def test_an_optimizer_dropped_while_the_model_lives_is_freed(update_in_backward):
    """The model's walk holds the subscriber that starts updates from backward; were it to hold
    the optimizer, the optimizer and its state (two float32 copies of the model for AdamW) would
    live as long as the model."""
    model = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, update_in_backward=update_in_backward)
    for step in range(2):
        model(batch(step)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    ref = weakref.ref(optimizer)
    del optimizer
    assert _collected(ref)
    # ... and its subscriber goes with it: it holds the update worker.
    assert not [s for s in model._engine.milestones.subscribers if isinstance(s, BackwardUpdates)]
    # The model trains on with a new optimizer.
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, update_in_backward=update_in_backward)
    for step in range(2):
        model(batch(step)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


class _Flaky(torch.autograd.Function):
    """The identity, whose backward raises while ``FlakyLayer.failing`` is set."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if FlakyLayer.failing:
            raise ValueError("a failing backward")
        return grad


class FlakyLayer(torch.nn.Module):
    failing = False

    def forward(self, x):
        return _Flaky.apply(x)


def _flaky_network() -> torch.nn.Sequential:
    """``network()`` with a layer at the end whose backward can fail before any slice's gradients land."""
    return torch.nn.Sequential(*network(), FlakyLayer())


@pytest.mark.parametrize("failing_step", [0, 2], ids=["before-the-checked-step", "after-it"])
def test_training_goes_on_after_a_backward_that_failed_before_any_gradient_landed(failing_step):
    """A backward that raises before any slice's gradients reached the host leaves ``.grad`` and
    the parameters as they were, as autograd does; the user catches it and trains on. It did not
    add into ``.grad``, so it is not one of the accumulation's backwards: counted, the next
    ``step()`` refused "more backwards than declared" where the plain optimizer steps."""
    plain, model = _flaky_network(), OffloadModel(_flaky_network(), device="cpu", num_slices=NUM_SLICES)
    kwargs = {"lr": 0.1, "momentum": 0.9}
    plain_opt = torch.optim.SGD(plain.parameters(), **kwargs)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, update_in_backward=True, **kwargs)
    try:
        for step in range(4):
            for m, opt in ((plain, plain_opt), (model, optimizer)):
                if step == failing_step:
                    FlakyLayer.failing = True
                    with pytest.raises(ValueError, match="a failing backward"):
                        m(batch(100)).pow(2).mean().backward()
                    FlakyLayer.failing = False
                    opt.zero_grad()
                m(batch(step)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    finally:
        FlakyLayer.failing = False
    optimizer.synchronize()
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_gradients_and_hyperparameters_outside_the_model_may_change_before_step():
    """``step()`` steps the parameters outside the model with the ``.grad`` and hyperparameters it
    finds then, with or without the option: clipping their gradients, or setting their group's
    learning rate, between backward and ``step()`` changes nothing backward started, and is not
    refused."""
    plain, model = network(), OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    scales = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
    kwargs = {"lr": 0.1, "momentum": 0.9}
    plain_opt = torch.optim.SGD([{"params": plain.parameters()}, {"params": [scales[0]]}], **kwargs)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, [{"params": model.parameters()}, {"params": [scales[1]]}],
                                 update_in_backward=True, **kwargs)
    for step in range(4):
        for m, scale, opt in ((plain, scales[0], plain_opt), (model, scales[1], optimizer)):
            (m(batch(step)) * scale).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_([scale], 0.01)
            opt.param_groups[1]["lr"] = 0.1 / (step + 1)
            opt.step()
            opt.zero_grad()
        assert optimizer._in_backward.last_started == (set(range(NUM_SLICES)) if step > 0 else set())
    assert_same(plain, plain_opt, model, optimizer)
    torch.testing.assert_close(scales[1], scales[0], rtol=0, atol=0)


def test_parameters_read_between_backward_and_step_are_already_updated():
    """As docs/optimizer.md says: once the backward that ends an accumulation has started a slice's
    update, reads through the model (which wait for pending updates) see that slice updated, as
    the plain model's parameters look after step()."""
    plain, model = network(), OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=0.1, update_in_backward=True)
    for step in range(3):
        plain(batch(step)).pow(2).mean().backward()
        model(batch(step)).pow(2).mean().backward()
        plain_opt.step()
        plain_opt.zero_grad()
        if step > 0:  # the first step only checks: nothing starts in its backward
            for got, want in zip(model.parameters(), plain.parameters()):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
        optimizer.step()
        optimizer.zero_grad()
    assert_same(plain, plain_opt, model, optimizer)


@pytest.mark.parametrize("then", ["backward", "step"])
def test_a_backward_that_failed_after_starting_updates_makes_step_raise(then):
    """A backward that failed after some slices' updates started (their gradients landed first) has
    changed those slices' parameters with gradients the plain optimizer never steps: its error says
    so, and the next ``step()`` still refuses, naming the slices, instead of training on silently,
    whether another backward ran first or not; it says what happened, not that accumulation_steps
    is wrong. Training goes on after it."""
    layers = list(network())
    model = OffloadModel(torch.nn.Sequential(*layers[:5], FlakyLayer(), *layers[5:]), device="cpu",
                         num_slices=NUM_SLICES)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=0.1, update_in_backward=True)
    assert any("5" in names for names in model.partition[1:])  # the flaky layer lies past slice 0
    try:
        for step in range(3):
            if step == 2:
                FlakyLayer.failing = True
                with pytest.raises(ValueError, match="a failing backward") as failure:
                    model(batch(100)).pow(2).mean().backward()
                FlakyLayer.failing = False
                assert any("Reload the last checkpoint" in note for note in getattr(failure.value, "__notes__", []))
                optimizer.zero_grad()
                if then == "backward":
                    model(batch(step)).pow(2).mean().backward()
                with pytest.raises(RuntimeError, match=r"a backward since the last step\(\) raised after it had "
                                                       r"started updates .* The update of slices \[.*\] already ran") \
                        as refused:
                    optimizer.step()
                assert "accumulation_steps" not in str(refused.value)
                optimizer.zero_grad()
            model(batch(step)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        FlakyLayer.failing = False


class HookFailure(Exception):
    """The user's own error, raised by a gradient hook."""


@pytest.mark.parametrize("update_in_backward", [True, False], ids=["update-in-backward", "without"])
@pytest.mark.parametrize("kind", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_gradient_hook_that_raises_after_updates_started_says_so(kind, update_in_backward):
    """A parameter's gradient hook runs after backward returns, once the other slices' updates
    started (its own slice's waits for ``step()``): the user's own error comes back with the note
    a failure inside the walk gets (Note: [Hook errors after updates started] in
    ``offload/autograd/hook_errors.py``), once. Without the option nothing started, and the error
    is the hook's alone. Either way the hook is back as registered, and its handle removes it."""
    from offload.autograd.hook_errors import UPDATES_MAY_HAVE_RUN

    model = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=0.1, update_in_backward=update_in_backward)
    weight = model.get_submodule("2").weight  # slice 1 of 3: slices 0 and 2 start their updates
    calls = []

    def hook(arg):
        calls.append(arg)
        if len(calls) == 3:  # the third step's backward, after two steps that passed the checks
            raise HookFailure("a failing hook")

    handle = getattr(weight, kind)(hook)
    hooks = weight._backward_hooks if kind == "register_hook" else weight._post_accumulate_grad_hooks
    for step in range(2):
        model(batch(step)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    with pytest.raises(HookFailure, match="a failing hook") as failure:
        model(batch(2)).pow(2).mean().backward()
    if update_in_backward:
        assert optimizer._in_backward.started == {0, 2}
        assert getattr(failure.value, "__notes__", []) == [UPDATES_MAY_HAVE_RUN]
        assert "Reload the last checkpoint" in UPDATES_MAY_HAVE_RUN
        with pytest.raises(RuntimeError, match=r"a backward since the last step\(\) raised after it had started"):
            optimizer.step()
    else:
        assert not hasattr(failure.value, "__notes__")
    assert list(hooks.values()) == [hook] and all(v is hook for v in hooks.values())
    handle.remove()
    assert not hooks


def test_a_gradient_hook_left_noting_by_a_backward_that_failed_elsewhere_runs_as_registered():
    """A backward that fails outside the model after its hooks ran (a layer before the model)
    never reaches its end, where the hooks it wrapped to note their errors go back: the next call
    of such a hook puts it back, and it runs as registered, its result the gradient."""
    model = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=0.1, update_in_backward=True)
    weight = model.get_submodule("2").weight
    halved = []

    def hook(grad):
        halved.append(grad / 2)
        return halved[-1]

    weight.register_hook(hook)
    for step in range(3):
        x = batch(step).requires_grad_()
        FlakyLayer.failing = step == 2
        try:
            if step == 2:
                with pytest.raises(ValueError, match="a failing backward"):
                    model(FlakyLayer()(x)).pow(2).mean().backward()
            else:
                model(FlakyLayer()(x)).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
        finally:
            FlakyLayer.failing = False
    assert len(halved) == 3 and list(weight._backward_hooks.values()) != [hook]  # still wrapped
    weight.grad = None
    model(batch(3)).pow(2).mean().backward()
    assert len(halved) == 4 and weight.grad is not None and torch.equal(weight.grad, halved[-1])
    assert list(weight._backward_hooks.values()) == [hook]


def test_reloading_the_last_checkpoint_after_a_failed_backward_trains_on_as_if_it_had_not_run(tmp_path):
    """The failed backward's note advises reloading the last checkpoint: that load replaces what
    its updates wrote, and the steps after it are the run's that never failed, bit for bit."""
    from offload import load_checkpoint, save_checkpoint

    layers = list(network())
    runs = []
    for fails in (False, True):
        model = OffloadModel(torch.nn.Sequential(*copy.deepcopy(layers[:5]), FlakyLayer(),
                                                 *copy.deepcopy(layers[5:])), device="cpu", num_slices=NUM_SLICES)
        optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, update_in_backward=True)
        for step in range(2):
            model(batch(step)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        if fails:
            save_checkpoint(tmp_path / "step-2", model, optimizer)
            FlakyLayer.failing = True
            try:
                with pytest.raises(ValueError, match="a failing backward"):
                    model(batch(100)).pow(2).mean().backward()
            finally:
                FlakyLayer.failing = False
            optimizer.zero_grad()
            load_checkpoint(tmp_path / "step-2", model, optimizer)
        for step in range(2, 4):
            model(batch(step)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        optimizer.synchronize()
        runs.append([p.detach().clone() for p in model.parameters()])
    for mine, theirs in zip(*runs):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("when", ["before-the-checked-step", "after-it"])
def test_load_state_dict_between_backward_and_step_is_refused(when):
    """``load_state_dict()`` between the backward that started the updates and ``step()`` replaces
    the state those updates stepped: the plain optimizer steps the loaded state with these
    gradients; the updates that ran cannot. ``step()`` refuses, as it does for any change between
    them, rather than leave the loaded state one step behind the parameters, silently."""
    model = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, update_in_backward=True)
    failing_step = 0 if when == "before-the-checked-step" else 2
    for step in range(failing_step + 1):
        saved = copy.deepcopy(optimizer.state_dict())
        model(batch(step)).pow(2).mean().backward()
        if step < failing_step:
            optimizer.step()
            optimizer.zero_grad()
    optimizer.load_state_dict(saved)
    what_ran = "No update ran" if failing_step == 0 else r"The update of slices \[0, 1, 2\] already ran"
    with pytest.raises(RuntimeError, match=rf"load_state_dict\(\) between backward and step\(\).*{what_ran}"):
        optimizer.step()


def test_load_state_dict_between_steps_is_as_without_the_option():
    plain, model = network(), OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, update_in_backward=True)
    saved = {}
    for step in range(5):
        for m, opt in ((plain, plain_opt), (model, optimizer)):
            if step == 1:
                saved[id(opt)] = copy.deepcopy(opt.state_dict())
            if step == 3:
                opt.load_state_dict(saved[id(opt)])
            m(batch(step)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert optimizer._in_backward.last_started == set(range(NUM_SLICES))
    assert_same(plain, plain_opt, model, optimizer)


def test_an_optimizer_built_between_backward_and_step_is_refused():
    """Its step() would update again the slices the old one's backward updated; once the old
    one's step() has come, building one is fine."""
    plain, model = network(), OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    kwargs = {"lr": 0.1, "momentum": 0.9}
    plain_opt = torch.optim.SGD(plain.parameters(), **kwargs)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, update_in_backward=True, **kwargs)
    for step in range(3):
        for m in (plain, model):
            m(batch(step)).pow(2).mean().backward()
        if step == 2:
            with pytest.raises(RuntimeError, match="started the update of slices .* in the last backward, and its "
                                                   "step\\(\\) has not come"):
                OffloadOptimizer(model, torch.optim.SGD, update_in_backward=True, **kwargs)
        for opt in (plain_opt, optimizer):
            opt.step()
            opt.zero_grad()
    saved = optimizer.state_dict()
    optimizer = OffloadOptimizer(model, torch.optim.SGD, update_in_backward=True, **kwargs)
    optimizer.load_state_dict(saved)
    assert_same(plain, plain_opt, model, optimizer)


# -- what the review found exact: kept as regressions ------------------------------------------------


def _sparse_network() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(20, 6, sparse=True), torch.nn.Linear(6, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3))


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 20, (5,), generator=torch.Generator().manual_seed(step))


def _loss(m, x, divide=1):
    return m(x).pow(2).mean() / divide


def _train(plain, model, plain_opt, optimizer, one_step, steps=4):
    for step in range(steps):
        for m, opt in ((plain, plain_opt), (model, optimizer)):
            one_step(m, opt, step)
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 1)


def _accumulate(divide):
    def one_step(m, opt, step):
        for micro in range(divide):
            _loss(m, batch(10 * step + micro), divide).backward()
    return one_step


def _twice_two_backwards(m, opt, step):
    first, second = _loss(m, batch(step), 2), _loss(m, batch(step + 50), 2)
    second.backward()
    first.backward()


def _retained(m, opt, step):
    loss = _loss(m, batch(step))
    loss.backward(retain_graph=True)
    (loss / 2).backward()


def _groups_added(m, opt, step):
    if step == 2:
        opt.add_param_group({"params": list(m.parameters())[4:], "lr": 0.05})
    _loss(m, batch(step)).backward()


SCENARIOS = {
    # name: (network, model settings, accumulation_steps, first group's parameters, one step)
    "sparse-embedding": (_sparse_network, {"num_slices": 2}, 1, None,
                         lambda m, opt, step: _loss(m, _tokens(step)).backward()),
    "offloaded-activations-accumulated": (network, {"offload_activations": "last2"}, 2, None, _accumulate(2)),
    "model-called-twice-two-backwards": (network, {}, 2, None, _twice_two_backwards),
    "retain-graph-second-backward": (network, {}, 2, None, _retained),
    "param-group-added-mid-training": (network, {}, 1, 4, _groups_added),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_review_scenarios_equal_the_plain_optimizer(scenario):
    build, settings, accumulation_steps, first, one_step = SCENARIOS[scenario]
    settings = {"num_slices": NUM_SLICES, **settings}
    if settings.get("offload_activations") == "last2":
        settings["offload_activations"] = OffloadActivations(last=2)
    plain, model = build(), OffloadModel(build(), device="cpu", **settings)
    pick = (lambda m: list(m.parameters())[:first]) if first else (lambda m: m.parameters())
    plain_opt = torch.optim.SGD(pick(plain), lr=0.1)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, pick(model), lr=0.1, update_in_backward=True,
                                 accumulation_steps=accumulation_steps)
    _train(plain, model, plain_opt, optimizer, one_step)
    assert optimizer._in_backward.last_started
    assert_same(plain, plain_opt, model, optimizer)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_gradient_from_outside_into_a_parameter_the_optimizer_does_not_step_is_as_without_the_option(set_to_none):
    """A penalty on a weight of the model that this optimizer does not step (another optimizer, or
    none, takes it) changes no update backward starts: it is not refused, and that weight's
    ``.grad`` is autograd's bit for bit (backward does not add into it early: rule 6 of Note:
    [Gradients added in place] holds for it)."""
    plain, model = network(), OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    plain_opt = torch.optim.SGD(list(plain.parameters())[:4], lr=0.1, momentum=0.9)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, list(model.parameters())[:4], lr=0.1, momentum=0.9,
                                 update_in_backward=True)
    for step in range(4):
        for m, opt in ((plain, plain_opt), (model, optimizer)):
            penalised = list(m.parameters())[-2]
            (m(batch(step)).pow(2).mean() + penalised.pow(2).sum() * 1e-3).backward()
        for (name, a), b in zip(plain.named_parameters(), model.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
        for opt in (plain_opt, optimizer):
            opt.step()
        for m in (plain, model):  # the weights no optimizer steps keep accumulating
            m.zero_grad(set_to_none=set_to_none) if step % 2 else None
        plain_opt.zero_grad(set_to_none=set_to_none)
        optimizer.zero_grad(set_to_none=set_to_none)
    assert optimizer._in_backward.last_started == {0, 1}
    assert_same(plain, plain_opt, model, optimizer)


# -- refused at the first step, before any update ---------------------------------------------------


def _snapshot(model, optimizer):
    optimizer.synchronize()
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(optimizer.state_dict())


def _assert_untouched(before, model, optimizer):
    params, state = before
    optimizer.synchronize()
    for a, b in zip(params, model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert not optimizer.state_dict()["state"] and state == optimizer.state_dict()


def test_offloads_clip_by_a_coefficient_of_one_is_refused_at_the_first_step():
    """``offload.clip_grad_norm_`` below ``max_norm`` multiplies nothing, so no ``.grad`` version
    moves; the clip tells the update's reads itself, and the first ``step()`` refuses it before any
    update ran, as it does torch's clip (which multiplies by one)."""
    model = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=0.1, fused=True, update_in_backward=True,
                                 accumulation_steps=2)
    before = _snapshot(model, optimizer)
    for micro in range(2):
        _loss(model, batch(micro), 2).backward()
    versions = [p.grad._version for p in model.parameters()]
    norm = offload.clip_grad_norm_(model.parameters(), max_norm=1e3)
    assert norm < 1e3 and versions == [p.grad._version for p in model.parameters()]  # nothing was written
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_ ran over the gradient of .* between backward and "
                                           r"step\(\); the updates read it as backward left it, unclipped\. "
                                           r"No update ran: parameters and optimizer state are as they were"):
        optimizer.step()
    _assert_untouched(before, model, optimizer)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
@pytest.mark.parametrize("scheduler", ["StepLR", "ReduceLROnPlateau", "ConstantLR-done", "CosineAnnealingWarmRestarts"])
def test_a_scheduler_stepped_before_step_is_refused_at_the_first_step_though_no_value_moved(scheduler):
    """A scheduler's step between backward and ``step()`` that leaves the values as they were
    (StepLR between its steps, ReduceLROnPlateau within its patience) is refused at the first
    ``step()``, not at the later one whose values move, after updates ran."""
    model = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=0.1, fused=True, update_in_backward=True)
    schedulers = torch.optim.lr_scheduler
    made = {"StepLR": lambda: schedulers.StepLR(optimizer, 5, 0.5),
            "ReduceLROnPlateau": lambda: schedulers.ReduceLROnPlateau(optimizer, patience=2),
            "ConstantLR-done": lambda: schedulers.ConstantLR(optimizer, factor=0.5, total_iters=0),
            # Its own step(), not LRScheduler's; a floor at the learning rate keeps it where it is.
            "CosineAnnealingWarmRestarts": lambda: schedulers.CosineAnnealingWarmRestarts(optimizer, 10, eta_min=0.1),
            }[scheduler]()
    before = _snapshot(model, optimizer)
    lr = optimizer.param_groups[0]["lr"]
    _loss(model, batch(0)).backward()
    made.step(1.0) if scheduler == "ReduceLROnPlateau" else made.step()
    assert optimizer.param_groups[0]["lr"] == lr
    named = scheduler.split("-")[0]
    with pytest.raises(RuntimeError, match=rf"{named}\.step\(\) ran .* between backward and step\(\); the update "
                                           r"reads the hyperparameters backward saw\. No update ran"):
        optimizer.step()
    _assert_untouched(before, model, optimizer)


@pytest.mark.parametrize("torch_flags_it", [True, False], ids=["flagged", "unflagged"])
@pytest.mark.parametrize("scheduler", ["StepLR", "CosineAnnealingWarmRestarts"])
def test_the_step_a_scheduler_takes_as_it_is_built_is_told_apart(monkeypatch, scheduler, torch_flags_it):
    """A scheduler built between backward and step() (a second one over groups that have their
    initial_lr, leaving the values as they were) takes no step the update must refuse, and a later
    step() of one is refused, whether torch flags the step as the built one (``_is_initial``, in
    newer releases) or not (older ones, simulated)."""
    import contextlib

    if not torch_flags_it:
        monkeypatch.setattr(torch.optim.lr_scheduler, "_initial_mode", lambda scheduler: contextlib.nullcontext())
    model = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=0.1, fused=True, update_in_backward=True)
    schedulers = torch.optim.lr_scheduler

    def made():
        return (schedulers.StepLR(optimizer, 5, 1.0) if scheduler == "StepLR"
                else schedulers.CosineAnnealingWarmRestarts(optimizer, 10, eta_min=0.1))

    first = made()
    _loss(model, batch(0)).backward()
    made()  # built between backward and step()
    optimizer.step()
    _loss(model, batch(1)).backward()
    first.step()
    with pytest.raises(RuntimeError, match=rf"{scheduler}\.step\(\) ran .* between backward and step\(\)"):
        optimizer.step()


def test_schedulers_stepped_after_step_train_as_the_plain_optimizer():
    """The legitimate orders: schedulers built (their own first step) before training, stepped after
    ``optimizer.step()``, one reading the optimizer's values between backward and ``step()``."""
    plain, model = network(), OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.1)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=0.1, update_in_backward=True)
    pairs = []
    for opt in (plain_opt, optimizer):
        pairs.append((opt, torch.optim.lr_scheduler.StepLR(opt, 2, 0.5),
                      torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)))
    for step in range(5):
        for m, (opt, steps, plateau) in zip((plain, model), pairs):
            _loss(m, batch(step)).backward()
            assert opt.param_groups[0]["lr"] > 0 and steps.get_last_lr()  # reads between them are no step
            opt.step()
            steps.step()
            plateau.step(1.0)
            opt.zero_grad()
    assert optimizer._in_backward.last_started == set(range(NUM_SLICES))
    assert_same(plain, plain_opt, model, optimizer)


def test_zero_grad_without_step_after_backward_started_updates_is_refused_there():
    """A skipped step (``zero_grad()`` and no ``step()``) after the backward that started the
    updates: refused at that ``zero_grad()``, which zeroes nothing, and ``step()`` then finishes the
    step as the plain optimizer's; the first step, which starts none, is skipped as without the
    option."""
    plain, model = network(), OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, update_in_backward=True,
                                 accumulation_steps=2)
    for step in range(4):
        for m, opt in ((plain, plain_opt), (model, optimizer)):
            for micro in range(2):
                _loss(m, batch(10 * step + micro), 2).backward()
            if step == 0:  # nothing started yet: a skip as without the option
                opt.zero_grad()
                continue
            if step == 2 and opt is optimizer:
                grads = [p.grad.clone() for p in model.parameters()]
                with pytest.raises(RuntimeError, match=r"zero_grad\(\) without step\(\) after the backward that "
                                                       r"started the update of slices \[0, 1, 2\].*nothing was zeroed"):
                    opt.zero_grad()
                for p, g in zip(model.parameters(), grads):
                    torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
            opt.step()
            opt.zero_grad()
    assert_same(plain, plain_opt, model, optimizer)


def test_a_step_skipped_without_zero_grad_names_it_in_the_count_error():
    model = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=0.1, update_in_backward=True)
    for step in range(2):
        _loss(model, batch(step)).backward()
    with pytest.raises(RuntimeError, match=r"step\(\) after 2 backward\(s\).*a step\(\) skipped"):
        optimizer.step()


@pytest.mark.parametrize("zeroed_by", ["optimizer", "model"])
def test_a_batch_skipped_before_its_last_backward_starts_the_accumulation_again(zeroed_by):
    """``zero_grad()`` after a backward that started no update (the first of an accumulation of 2)
    skips the batch, as docs/optimizer.md advises: the next accumulation counts from one, as in the
    plain loop, whether the optimizer or the model (``netD.zero_grad()``) zeroes. Counted on, its
    first backward would start every slice's update on half its gradients."""
    plain, model = network(), OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, update_in_backward=True,
                                 accumulation_steps=2)
    for m, opt in ((plain, plain_opt), (model, optimizer)):
        for step in range(2):  # the second one starts updates in backward
            for micro in range(2):
                _loss(m, batch(10 * step + micro), 2).backward()
            opt.step()
            opt.zero_grad()
        _loss(m, batch(20), 2).backward()
        (m if zeroed_by == "model" else opt).zero_grad()  # the batch skipped
        for micro in range(2):
            _loss(m, batch(30 + micro), 2).backward()
            if opt is optimizer and micro == 0:
                assert not optimizer._in_backward.started  # the first backward of two starts nothing
        opt.step()
        opt.zero_grad()
    assert optimizer._in_backward.last_started == set(range(NUM_SLICES))
    assert_same(plain, plain_opt, model, optimizer)


def test_the_models_zero_grad_after_the_backward_that_started_updates_is_refused_as_the_optimizers():
    """``model.zero_grad()`` (PyTorch's DCGAN example calls ``netD.zero_grad()``) after the backward
    that started the updates is refused as the optimizer's ``zero_grad()`` is, zeroing nothing
    (accepted, it zeroed the gradients of a half-finished step, and the next ``step()`` blamed the
    count); ``step()`` then finishes the step as the plain optimizer's."""
    plain, model = network(), OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, update_in_backward=True)
    for step in range(3):
        for m, opt in ((plain, plain_opt), (model, optimizer)):
            _loss(m, batch(step)).backward()
            if step == 2 and opt is optimizer:
                grads = [p.grad.clone() for p in model.parameters()]
                for set_to_none in (True, False):
                    with pytest.raises(RuntimeError, match=r"zero_grad\(\) without step\(\) after the backward that "
                                                           r"started the update of slices \[0, 1, 2\].*nothing was "
                                                           r"zeroed"):
                        model.zero_grad(set_to_none=set_to_none)
                for p, g in zip(model.parameters(), grads):
                    torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
            opt.step()
            m.zero_grad()
    assert_same(plain, plain_opt, model, optimizer)
