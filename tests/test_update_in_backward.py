"""OffloadOptimizer(update_in_backward=True): updates that backward starts give the plain
optimizer's results bit for bit, wait for step() where they must, refuse what would make them
differ, and depend on the orderings that make them exact (Note: [Update in backward] in
``offload/optimizing/in_backward.py``)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from offload import DiskTier, GradScaler, OffloadModel, OffloadOptimizer
from offload.autograd.gradients import BackwardGradients
from offload.optimizing.in_backward import BackwardUpdates
from offload.streamcheck import StreamChecker
from offload.walk.milestones import Subscriber

from .helpers import DEVICES
from .stream_scenarios import SCENARIOS, build_on_cpu
from .test_mixed_precision import converted
from .test_optimizer import assert_same, batch, network
from .test_tied import ids, network as tied_network

pytestmark = pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")

EXACT = {"rtol": 0.0, "atol": 0.0}
BF16 = torch.bfloat16
NUM_SLICES = 3
ALL_SLICES = set(range(NUM_SLICES))

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "AdamW-fused": (torch.optim.AdamW, {"lr": 1e-2, "fused": True, "weight_decay": 0.1}),
    "SGD-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "Adam-per-tensor": (torch.optim.Adam, {"lr": 1e-2, "foreach": False}),
}


# -- the references -------------------------------------------------------------------------------


class Plain:
    """The plain model, its float32 parameters stepped by a plain ``torch.optim`` optimizer.
    Under a compute dtype each backward runs on a copy of the model converted to it (as
    tests/test_mixed_precision.py compares a half-precision OffloadModel), and its gradients, cast to
    float32, are added into the float32 parameters' ``.grad``: what OffloadModel computes."""

    def __init__(self, layers: nn.Module, compute_dtype: torch.dtype | None) -> None:
        self.model = layers
        self.compute_dtype = compute_dtype

    def backward(self, x: torch.Tensor, divide: int) -> None:
        if self.compute_dtype is None:
            (self.model(x).float().pow(2).mean() / divide).backward()
            return
        half = converted(self.model, self.compute_dtype)
        (half(x.to(self.compute_dtype)).float().pow(2).mean() / divide).backward()
        with torch.no_grad():
            for p, q in zip(self.model.parameters(), half.parameters()):
                if q.grad is not None:
                    p.grad = q.grad.float() if p.grad is None else p.grad.add_(q.grad.float())


class Twin:
    """An OffloadModel with the same settings, stepped by the plain optimizer: the reference where
    no plain model computes the same bits (microbatch gradients are summed in another order; a
    GPU's kernels round otherwise than the CPU's)."""

    def __init__(self, model: OffloadModel) -> None:
        self.model = model

    def backward(self, x: torch.Tensor, divide: int) -> None:
        offload_loss(self.model, x, divide).backward()


def offload_loss(model: nn.Module, x: torch.Tensor, divide: int) -> torch.Tensor:
    device = model.device if isinstance(model, OffloadModel) else torch.device("cpu")
    return model(x.to(device)).float().pow(2).mean() / divide


def two_groups(params: list[nn.Parameter], lr: float) -> list[dict[str, Any]]:
    """The last layer in a group of its own, at another learning rate."""
    return [{"params": params[:-2]}, {"params": params[-2:], "lr": lr / 3}]


def plain_optimizer(cls: type[torch.optim.Optimizer], params: Any, kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the per-tensor warning, about the reference itself
        return cls(params, **kwargs)


# -- 1. parity ------------------------------------------------------------------------------------

#: Pairs of settings rather than their product: every optimizer meets both compute dtypes, and every
#: two of (compute dtype, microbatches, accumulation, zeroing) meet in each combination.
CASES = [
    pytest.param("AdamW-fused", None, 1, 1, True, False, False, id="AdamW-fused-fp32"),
    pytest.param("AdamW-fused", BF16, 2, 3, False, True, True, id="AdamW-fused-bf16-mb2-acc3-zero-sched-groups"),
    pytest.param("AdamW-fused", BF16, 1, 3, True, True, True, id="AdamW-fused-bf16-acc3-sched-groups"),
    pytest.param("SGD-momentum", None, 2, 3, True, True, False, id="SGD-momentum-fp32-mb2-acc3-sched"),
    pytest.param("SGD-momentum", BF16, 1, 1, False, False, True, id="SGD-momentum-bf16-zero-groups"),
    pytest.param("Adam-per-tensor", None, 1, 3, False, False, True, id="Adam-per-tensor-fp32-acc3-zero-groups"),
    pytest.param("Adam-per-tensor", BF16, 2, 1, True, True, False, id="Adam-per-tensor-bf16-mb2-sched"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, compute_dtype, num_microbatches, accumulation_steps, set_to_none, schedule, groups",
                         CASES)
def test_updates_started_in_backward_equal_the_plain_optimizer(name, compute_dtype, num_microbatches,
                                                                accumulation_steps, set_to_none, schedule, groups,
                                                                device):
    cls, kwargs = OPTIMIZERS[name]
    settings = {"device": device, "num_slices": NUM_SLICES, "compute_dtype": compute_dtype,
                "num_microbatches": num_microbatches}
    model = OffloadModel(network(), **settings)
    if num_microbatches == 1 and device == "cpu":
        reference: Plain | Twin = Plain(network(), compute_dtype)
    else:
        reference = Twin(OffloadModel(network(), **settings))

    def params_of(m: nn.Module) -> Any:
        return two_groups(list(m.parameters()), kwargs["lr"]) if groups else m.parameters()

    plain = plain_optimizer(cls, params_of(reference.model), kwargs)
    optimizer = OffloadOptimizer(model, cls, params_of(model), update_in_backward=True,
                                 accumulation_steps=accumulation_steps, **kwargs)
    schedulers = []
    if schedule:  # the learning rate (and momentum, or beta1) change after every step
        max_lr = [g["lr"] for g in plain.param_groups]
        schedulers = [torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=max_lr, total_steps=8)
                      for opt in (plain, optimizer)]
    for step in range(5):
        for micro in range(accumulation_steps):
            x = batch(10 * step + micro)
            reference.backward(x, accumulation_steps)
            offload_loss(model, x, accumulation_steps).backward()
        for opt in (plain, optimizer):
            opt.step()
        for scheduler in schedulers:
            scheduler.step()
        for opt in (plain, optimizer):
            opt.zero_grad(set_to_none=set_to_none)
        # The first step only checks; from the second on, backward starts every slice's update.
        assert optimizer._in_backward.checked
        assert optimizer._in_backward.last_started == (ALL_SLICES if step > 0 else set()), step
        assert optimizer._in_backward.deferred == {}
    assert_same(reference.model, plain, model, optimizer)


def test_parameters_outside_the_model_are_stepped_by_step():
    plain, model = network(), OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    scales = [nn.Parameter(torch.ones(3)) for _ in range(2)]
    kwargs = {"lr": 0.1, "momentum": 0.9}
    plain_opt = plain_optimizer(torch.optim.SGD, [{"params": plain.parameters()}, {"params": [scales[0]]}], kwargs)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, [{"params": model.parameters()}, {"params": [scales[1]]}],
                                 update_in_backward=True, **kwargs)
    for step in range(4):
        for m, scale, opt in ((plain, scales[0], plain_opt), (model, scales[1], optimizer)):
            (m(batch(step)) * scale).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 0)
        assert optimizer._in_backward.last_started == (ALL_SLICES if step > 0 else set())
    assert_same(plain, plain_opt, model, optimizer)
    torch.testing.assert_close(scales[1], scales[0], **EXACT)


def test_autograd_adopts_the_landed_gradients_without_a_copy():
    """With ``.grad`` set to None, autograd takes each landed host gradient as ``.grad`` itself,
    as without update_in_backward: the update and the check may not hold it (autograd would copy
    every gradient, and read it on the host while the update runs)."""
    landed: set[int] = set()

    class Landing(Subscriber):
        def gradients_leaving(self, token, index, pending):
            landed.update(g.data_ptr() for g in pending.host_views if g is not None)

    model = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, update_in_backward=True)
    model._engine.milestones.subscribe(Landing())
    for step in range(3):
        landed.clear()
        offload_loss(model, batch(step), 1).backward()
        assert all(p.grad.data_ptr() in landed for p in model.parameters()), step
        optimizer.step()
        optimizer.zero_grad()
    assert optimizer._in_backward.last_started == ALL_SLICES


# -- 2. updates that wait for step() ---------------------------------------------------------------


@pytest.mark.parametrize("cls, kwargs", [
    pytest.param(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}, id="SGD-momentum"),
    pytest.param(torch.optim.AdamW, {"lr": 0.01, "fused": True}, id="AdamW-fused"),
])
def test_a_weight_tied_across_slices_waits_for_step(cls, kwargs):
    plain = tied_network(dropout=0.0)
    model = OffloadModel(tied_network(dropout=0.0), device="cpu", num_slices=3)
    assert model.partition == (("0",), ("1", "2", "3", "4", "5"), ("6",))
    plain_opt = plain_optimizer(cls, plain.parameters(), kwargs)
    optimizer = OffloadOptimizer(model, cls, update_in_backward=True, **kwargs)
    for step in range(4):
        for m, opt in ((plain, plain_opt), (model, optimizer)):
            m(ids()).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        if step > 0:
            # The table sits in slice 0 and is borrowed by slice 2 (which holds nothing else): autograd
            # sums its two gradients after backward returns, so slice 0 waits; slice 1 starts in backward.
            assert optimizer._in_backward.deferred == {0: "'weight' of a Embedding in slice 0 is tied to another slice"}
            assert optimizer._in_backward.last_started == {1}
    assert_same(plain, plain_opt, model, optimizer)


def halve(grad: torch.Tensor) -> torch.Tensor:
    return grad * 0.5


def halve_in_place(p: torch.Tensor) -> None:
    p.grad.mul_(0.5)


@pytest.mark.parametrize("hook", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_gradient_hook_waits_for_step(hook):
    plain, model = network(), OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    for m in (plain, model):
        weight = m.get_submodule("2").weight  # applied after backward returns
        weight.register_hook(halve) if hook == "register_hook" else weight.register_post_accumulate_grad_hook(
            halve_in_place)
    kwargs = {"lr": 1e-2, "fused": True}
    plain_opt = plain_optimizer(torch.optim.AdamW, plain.parameters(), kwargs)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, update_in_backward=True, **kwargs)
    for step in range(4):
        for m, opt in ((plain, plain_opt), (model, optimizer)):
            offload_loss(m, batch(step), 1).backward()
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 0)
        if step > 0:
            assert optimizer._in_backward.deferred == {1: "'weight' of a Linear in slice 1 has a gradient hook"}
            assert optimizer._in_backward.last_started == {0, 2}
    assert_same(plain, plain_opt, model, optimizer)


@pytest.mark.parametrize("given", ["trainable", "all"])
def test_a_frozen_part_is_left_alone(given):
    """Like a LoRA base: a linear layer frozen, in a slice with a trainable LayerNorm. The
    optimizer may be given the trainable parameters only, or every parameter (``torch.optim``
    skips those without a gradient)."""
    plain, model = network(), OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    assert model.partition[1] == ("2", "3", "4")
    for m in (plain, model):
        m.get_submodule("2").requires_grad_(False)

    def params_of(m: nn.Module) -> list[nn.Parameter]:
        return [p for p in m.parameters() if p.requires_grad or given == "all"]

    kwargs = {"lr": 0.1, "momentum": 0.9}
    plain_opt = plain_optimizer(torch.optim.SGD, params_of(plain), kwargs)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, params_of(model), update_in_backward=True, **kwargs)
    frozen = [p.detach().clone() for p in model.get_submodule("2").parameters()]
    for step in range(4):
        for m, opt in ((plain, plain_opt), (model, optimizer)):
            m(batch(step)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 0)
        if step > 0:
            assert optimizer._in_backward.last_started == ALL_SLICES and not optimizer._in_backward.deferred
    assert_same(plain, plain_opt, model, optimizer)
    for before, p in zip(frozen, model.get_submodule("2").parameters()):
        assert torch.equal(before, p) and p.grad is None


# -- 3. the disk tier and masters on disk ------------------------------------------------------------


@pytest.mark.parametrize("masters_on_disk", [False, True], ids=["state-on-disk", "masters-and-state-on-disk"])
def test_state_and_masters_on_disk(masters_on_disk, tmp_path):
    # Masters on disk need a compute dtype (the device computes from the shadows).
    compute_dtype = BF16 if masters_on_disk else None
    masters = DiskTier(tmp_path / "masters") if masters_on_disk else None
    model = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES, compute_dtype=compute_dtype, masters=masters)
    reference = Plain(network(), compute_dtype)
    kwargs = {"lr": 1e-2, "fused": True}
    plain = plain_optimizer(torch.optim.AdamW, reference.model.parameters(), kwargs)
    with OffloadOptimizer(model, torch.optim.AdamW, disk_tier=DiskTier(tmp_path / "state"), update_in_backward=True,
                          accumulation_steps=2, **kwargs) as optimizer:
        assert optimizer._tier is not None
        assert all((s.storage.masters_file is not None) == masters_on_disk for s in model._engine.slices)
        for step in range(4):
            for micro in range(2):
                x = batch(10 * step + micro)
                reference.backward(x, 2)
                offload_loss(model, x, 2).backward()
            plain.step()
            optimizer.step()
            plain.zero_grad()
            optimizer.zero_grad(set_to_none=step % 2 == 0)
            assert optimizer._in_backward.last_started == (ALL_SLICES if step > 0 else set())
        assert_same(reference.model, plain, model, optimizer)


# -- 4. what it refuses ---------------------------------------------------------------------------------


def fresh(accumulation_steps: int = 1, fused: bool = True) -> tuple[OffloadModel, OffloadOptimizer]:
    model = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=fused, update_in_backward=True,
                                 accumulation_steps=accumulation_steps)
    return model, optimizer


def snapshot_of(model: OffloadModel, optimizer: OffloadOptimizer) -> tuple[list[torch.Tensor], dict[str, Any]]:
    optimizer.synchronize()
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(optimizer.state_dict())


def assert_unchanged(model: OffloadModel, optimizer: OffloadOptimizer,
                     before: tuple[list[torch.Tensor], dict[str, Any]]) -> None:
    params, state = snapshot_of(model, optimizer)
    for a, b in zip(params, before[0]):
        assert torch.equal(a, b)
    assert state["state"].keys() == before[1]["state"].keys()
    for k in state["state"]:
        for key, value in state["state"][k].items():
            assert torch.equal(value, before[1]["state"][k][key]), (k, key)


def penalised_backward(model: OffloadModel, step: int) -> None:
    loss = offload_loss(model, batch(step), 1) + 1e-3 * sum(p.pow(2).sum() for p in model.parameters())
    loss.backward()


def clipped(model: OffloadModel, optimizer: OffloadOptimizer, step: int) -> None:
    offload_loss(model, batch(step), 1).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
    optimizer.step()


def warmed_up(model: OffloadModel, optimizer: OffloadOptimizer, step: int) -> None:
    offload_loss(model, batch(step), 1).backward()
    for group in optimizer.param_groups:  # a schedule set by hand, between backward and step()
        group["lr"] = 1e-3 * (step + 1)
    optimizer.step()


def betas_filled(model: OffloadModel, optimizer: OffloadOptimizer, step: int) -> None:
    for group in optimizer.param_groups:  # tensors, as a compiled step keeps them, set before backward
        group["betas"] = (torch.tensor(0.9), torch.tensor(0.999))
    offload_loss(model, batch(step), 1).backward()
    for group in optimizer.param_groups:  # changed in place, inside the tuple, between backward and step()
        group["betas"][0].fill_(0.8)
    optimizer.step()


def scaled(scaler_class: type[torch.amp.GradScaler], unscale: bool) -> Callable[..., None]:
    def mistake(model: OffloadModel, optimizer: OffloadOptimizer, step: int) -> None:
        scaler = scaler_class("cpu", init_scale=2.0**8)
        scaler.scale(offload_loss(model, batch(step), 1)).backward()
        if unscale:
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
    return mistake


MISTAKES: list[Any] = [
    pytest.param(lambda model, optimizer, step: penalised_backward(model, step), True,
                 "the gradient of .* \\(and 9 more\\) also comes from outside this call of the model",
                 id="penalty-on-the-weights"),
    pytest.param(clipped, True, "changed between backward and step\\(\\)", id="clip_grad_norm_"),
    pytest.param(warmed_up, True, "update_in_backward: 'lr' of group 0 changed between backward and step\\(\\); the "
                 "update reads the hyperparameters backward saw", id="lr-set-between-backward-and-step"),
    pytest.param(betas_filled, True, "update_in_backward: 'betas' of group 0 changed between backward and step",
                 id="tensor-betas-filled-between-backward-and-step"),
    # A fused optimizer takes the scale itself, unless unscale_ came first; another has its
    # gradients unscaled in place, by a kernel that leaves their version counters as they were.
    *[pytest.param(scaled(scaler_class, unscale), fused, "a GradScaler steps this optimizer",
                   id=f"{scaler_class.__module__.split('.')[0]}.GradScaler-{'fused' if fused else 'per-tensor'}"
                      f"{'-unscale_' if unscale else ''}")
      for scaler_class in (torch.amp.GradScaler, GradScaler) for fused in (True, False) for unscale in (False, True)],
]


@pytest.mark.parametrize("mistake, fused, message", MISTAKES)
def test_a_mistake_in_the_first_step_is_refused_before_any_update(mistake, fused, message):
    model, optimizer = fresh(fused=fused)
    before = snapshot_of(model, optimizer)
    with pytest.raises(RuntimeError, match=message) as raised:
        mistake(model, optimizer, 0)
    assert "No update ran: parameters and optimizer state are as they were." in str(raised.value)
    assert "OffloadOptimizer without update_in_backward" in str(raised.value)
    assert_unchanged(model, optimizer, before)
    assert not optimizer._in_backward.checked


def test_more_backwards_than_declared_are_refused():
    model, optimizer = fresh(accumulation_steps=2)
    before = snapshot_of(model, optimizer)
    for micro in range(3):
        offload_loss(model, batch(micro), 2).backward()
    with pytest.raises(RuntimeError, match="step\\(\\) after 3 backward\\(s\\), but the optimizer was built "
                                           "with accumulation_steps=2.*No update ran.*accumulation_steps"):
        optimizer.step()
    assert_unchanged(model, optimizer, before)


def test_fewer_backwards_than_declared_step_as_without_the_option():
    """An epoch's last step when its batches do not divide by the accumulation (the Hugging Face
    Trainer steps after the remainder): nothing started in backward, step() steps .grad as usual."""
    model, optimizer = fresh(accumulation_steps=2)
    twin = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    twin.load_state_dict(model.state_dict())
    reference = OffloadOptimizer(twin, torch.optim.AdamW, lr=1e-2, fused=True)
    for step, backwards in enumerate([2, 2, 1, 2, 1]):
        for micro in range(backwards):
            offload_loss(model, batch(10 * step + micro), 2).backward()
            offload_loss(twin, batch(10 * step + micro), 2).backward()
        optimizer.step()
        reference.step()
        assert optimizer._in_backward.last_started == (ALL_SLICES if backwards == 2 and step > 0 else set())
        optimizer.zero_grad()
        reference.zero_grad()
    optimizer.synchronize()
    reference.synchronize()
    for got, want in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(optimizer.state_dict()["state"], reference.state_dict()["state"], rtol=0, atol=0)


@pytest.mark.parametrize("mistake, fused, message", [m for m in MISTAKES if m.id in (
    "penalty-on-the-weights", "clip_grad_norm_", "lr-set-between-backward-and-step", "torch.GradScaler-per-tensor")])
def test_a_mistake_after_the_checked_step_says_which_slices_ran(mistake, fused, message):
    model, optimizer = fresh(fused=fused)
    for step in range(2):
        offload_loss(model, batch(step), 1).backward()
        optimizer.step()
        optimizer.zero_grad()
    with pytest.raises(RuntimeError, match=message) as raised:
        mistake(model, optimizer, 2)  # turned on at the third step
    assert ("The update of slices [0, 1, 2] already ran with the gradients backward produced: reload the last "
            "checkpoint before training on.") in str(raised.value)


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2"])
def test_accumulation_steps_must_be_a_positive_int(value):
    model = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    with pytest.raises(ValueError, match=f"accumulation_steps must be a positive int, got {value!r}"):
        OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, update_in_backward=True, accumulation_steps=value)


@pytest.mark.parametrize("value", [1, None, "yes"])
def test_update_in_backward_must_be_a_bool(value):
    model = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    with pytest.raises(TypeError, match=f"update_in_backward must be True or False, got {value!r}"):
        OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, update_in_backward=value)


def test_accumulation_steps_without_update_in_backward_is_refused():
    model = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    with pytest.raises(ValueError, match="accumulation_steps tells update_in_backward .or norms_in_backward. which "
                                         "backward starts the update.*leave it out"):
        OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, accumulation_steps=4)


def test_data_parallelism_and_sharding_are_refused(tmp_path):
    model = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    with pytest.raises(ValueError, match="update_in_backward is not supported with data parallelism"):
        OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, shard=True, update_in_backward=True)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES, process_group=dist.group.WORLD)
        with pytest.raises(ValueError, match="update_in_backward is not supported with data parallelism "
                                             "\\(process_group\\).*Leave update_in_backward out"):
            OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, update_in_backward=True)
    finally:
        dist.destroy_process_group()


# -- 5. the orderings that make it exact ---------------------------------------------------------------


def run_scenario(schedule: str | None) -> tuple[list[torch.Tensor], StreamChecker | None]:
    """The checker's ``update_in_backward`` scenario: synchronous copies, or deferred under the
    checker with ``schedule``."""
    if schedule is None:
        return SCENARIOS["update_in_backward"](build_on_cpu), None
    with StreamChecker(schedule=schedule, seed=7) as checker:
        got = SCENARIOS["update_in_backward"](build_on_cpu)
    return got, checker


def same(expected: list[torch.Tensor], got: list[torch.Tensor]) -> bool:
    return len(expected) == len(got) and all(torch.equal(a, b) for a, b in zip(expected, got))


def announce_before_the_additions(self: BackwardGradients) -> None:
    """The mutation: each slice announced as soon as its gradients left the device, before they
    were added into ``.grad``."""
    engine, token = self.run.engine, self.run.call
    while self._unannounced:
        i, pending, final = self._unannounced.pop(0)
        engine.milestones.gradients_final(token, i, final, pending.ready)


def without_the_copy_wait(original: Callable[..., None]) -> Callable[..., None]:
    """The mutation: the update started without waiting for its gradients' copy to the host."""
    def gradients_final(self, token, index, grads, ready):
        original(self, token, index, grads, None)
    return gradients_final


@pytest.mark.parametrize("mutation", ["announce-before-the-additions", "no-wait-for-the-copy"])
def test_the_checker_reports_an_update_that_does_not_wait_for_its_gradients(mutation, monkeypatch):
    expected, _ = run_scenario(None)
    got, checker = run_scenario("issue")
    assert same(expected, got) and not checker.races, checker.summary()
    if mutation == "announce-before-the-additions":
        monkeypatch.setattr(BackwardGradients, "_announce", announce_before_the_additions)
        unordered = "host: add_.Tensor at offload/streams/gradients.py"  # the addition into .grad
    else:
        monkeypatch.setattr(BackwardUpdates, "gradients_final", without_the_copy_wait(BackwardUpdates.gradients_final))
        unordered = "offload stream: copy to host (gradients.py:"  # offload, or _offload_gathered
    got, checker = run_scenario("issue")
    # The checker names the access the update was not ordered after ...
    assert any(unordered in race.first + race.second and "host update stream" in race.first + race.second
               for race in checker.races), checker.summary()
    if mutation == "announce-before-the-additions":
        # ... and, run as soon as it is submitted, the update misses the gradients added after it.
        assert not same(expected, got)


# -- 6. backwards that add nothing into .grad, or into part of it --------------------------------------


def test_autograd_grad_starts_nothing_and_is_not_counted():
    plain, model = network(), OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    kwargs = {"lr": 1e-2, "fused": True}
    plain_opt = plain_optimizer(torch.optim.AdamW, plain.parameters(), kwargs)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, update_in_backward=True, accumulation_steps=2, **kwargs)
    for step in range(4):
        for micro in range(2):
            for m in (plain, model):
                offload_loss(m, batch(10 * step + micro), 2).backward()
            if micro == 0:
                # Between the two backwards of an accumulation: gradients returned, none added into
                # .grad. Counted, it would end the accumulation and start the updates.
                want = torch.autograd.grad(offload_loss(plain, batch(99), 1), list(plain.parameters()))
                got = torch.autograd.grad(offload_loss(model, batch(99), 1), list(model.parameters()))
                for g, w in zip(got, want):
                    torch.testing.assert_close(g, w, **EXACT)
                assert optimizer._in_backward.backwards == 1 and not optimizer._in_backward.started
        for opt in (plain_opt, optimizer):
            opt.step()
            opt.zero_grad()
        assert optimizer._in_backward.last_started == (ALL_SLICES if step > 0 else set())
    assert_same(plain, plain_opt, model, optimizer)


@pytest.mark.parametrize("part", ["first-slice", "last-slice", "one-weight"])
def test_a_backward_into_part_of_the_model_steps_as_the_plain_optimizer(part):
    """``backward(inputs=...)`` adds into the ``.grad`` of those parameters only: it is a backward
    of the accumulation, and it starts the updates of the slices it gives gradients to; the
    others, stepped by step(), read the ``.grad`` they hold (zeros: momentum still moves them)."""
    plain, model = network(), OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    kwargs = {"lr": 0.1, "momentum": 0.9}
    plain_opt = plain_optimizer(torch.optim.SGD, plain.parameters(), kwargs)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, update_in_backward=True, **kwargs)
    assert model.partition == (("0", "1"), ("2", "3", "4"), ("5", "6", "7"))
    chosen = {"first-slice": ["0.weight", "0.bias"], "last-slice": ["7.weight", "7.bias", "5.weight"],
              "one-weight": ["2.weight"]}[part]
    started = {"first-slice": {0}, "last-slice": {2}, "one-weight": {1}}[part]
    for step in range(4):
        for m, opt in ((plain, plain_opt), (model, optimizer)):
            loss = m(batch(step)).pow(2).mean()
            if step == 2:
                named = dict(m.named_parameters())
                loss.backward(inputs=[named[n] for n in chosen])
            else:
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        assert optimizer._in_backward.last_started == (set() if step == 0 else started if step == 2 else ALL_SLICES)
    assert_same(plain, plain_opt, model, optimizer)
