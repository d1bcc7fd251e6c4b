"""``OffloadOptimizer(norms_in_backward=True)``: the host gradients' norms computed in backward and
taken by ``offload.clip_grad_norm_``, which then clips as ``torch.nn.utils.clip_grad_norm_`` clips the
plain model, bit for bit (Note: [Norms from backward] in ``offload/optimizing/backward_norms.py``)."""

from __future__ import annotations

import copy
import gc
import re
import threading
import time

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import offload
from offload import OffloadModel, OffloadOptimizer, clipping
from offload.optimizing import backward_norms

from .helpers import DEVICES, SteppedWherePlaced, clip_where_placed

EXACT = {"rtol": 0, "atol": 0}


def network(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Tanh(),
                         nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))


def batch(step: int, device: str) -> torch.Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(step)).to(device)


@pytest.fixture
def computed_at_clip(monkeypatch):
    """How many norms each ``clip_grad_norm_`` computed itself (on its calling thread's behalf)."""
    counts: list[int] = []
    original = clipping.pooled_norms

    def counting(tensors, *args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            counts.append(len(tensors))
        return original(tensors, *args, **kwargs)

    monkeypatch.setattr(clipping, "pooled_norms", counting)
    return counts


def _twins(device: str = "cpu", compute_dtype: torch.dtype | None = None, **options):
    plain = network()
    model = OffloadModel(copy.deepcopy(plain), device=device, num_slices=3, compute_dtype=compute_dtype)
    plain.to(device)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, norms_in_backward=True, **options)
    if device == "cpu":
        return plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True), model, optimizer
    return plain, SteppedWherePlaced(plain.parameters(), model.parameters(), torch.optim.AdamW, lr=1e-2,
                                     fused=True), model, optimizer


def _loss(model: nn.Module, step: int, device: str) -> torch.Tensor:
    return model(batch(step, device)).float().pow(2).mean()


def _clip_and_step(plain: nn.Module, plain_opt: torch.optim.Optimizer, model: OffloadModel,
                   optimizer: OffloadOptimizer, set_to_none: bool = True) -> None:
    """Clip both (PyTorch's clip on the plain model, offload's on the offloaded one): the same norm
    and gradients, bit for bit; then step both and zero their gradients."""
    expected = clip_where_placed(list(plain.parameters()), list(model.parameters()), max_norm=0.05)
    torch.testing.assert_close(offload.clip_grad_norm_(model.parameters(), max_norm=0.05), expected.cpu(), **EXACT)
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad.cpu(), **EXACT, msg=lambda m: f"{name}: {m}")
    for opt in (plain_opt, optimizer):
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)


def _assert_same(plain: nn.Module, model: OffloadModel, optimizer: OffloadOptimizer) -> None:
    optimizer.synchronize()
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a.cpu(), **EXACT, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("set_to_none", [True, False])
def test_clipped_training_is_the_plain_models_and_takes_the_norms_backward_computed(device, set_to_none,
                                                                                     computed_at_clip):
    plain, plain_opt, model, optimizer = _twins(device)
    for step in range(4):
        _loss(plain, step, device).backward()
        _loss(model, step, device).backward()
        _clip_and_step(plain, plain_opt, model, optimizer, set_to_none)
    _assert_same(plain, model, optimizer)
    # The first call computed every norm again to compare; the later ones computed none.
    assert computed_at_clip[0] == len(list(model.parameters()))
    assert computed_at_clip[1:] == [0, 0, 0]


@pytest.mark.parametrize("device", DEVICES)
def test_under_a_compute_dtype_the_float32_gradients_norms_are_taken(device, computed_at_clip):
    plain, plain_opt, model, optimizer = _twins(device, compute_dtype=torch.bfloat16)
    for step in range(3):
        _loss(model, step, device).backward()
        reference = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
        for r, p in zip(reference, model.parameters()):
            r.grad = p.grad.clone()
        expected = torch.nn.utils.clip_grad_norm_(reference, max_norm=0.05)
        got = offload.clip_grad_norm_(model.parameters(), max_norm=0.05)
        torch.testing.assert_close(got, expected, **EXACT)
        for p, r in zip(model.parameters(), reference):
            torch.testing.assert_close(p.grad, r.grad, **EXACT)
        optimizer.step()
        optimizer.zero_grad()
    assert computed_at_clip[1:] == [0, 0]


def test_a_gradient_changed_in_place_after_backward_has_its_norm_computed_again(computed_at_clip):
    plain, plain_opt, model, optimizer = _twins()
    for step in range(3):
        _loss(plain, step, "cpu").backward()
        _loss(model, step, "cpu").backward()
        optimizer._norms.settle()  # the norms taken before the change, not after
        for net in (plain, model):
            next(iter(net.parameters())).grad.mul_(3.0)  # a version counter moves
        _clip_and_step(plain, plain_opt, model, optimizer)
    _assert_same(plain, model, optimizer)
    # Computed again: that gradient's norm, and its slice's others' where they are views of one host
    # buffer (they share its version counter).
    assert all(1 <= count <= 2 for count in computed_at_clip[1:])


def test_a_gradient_from_outside_the_model_is_counted():
    """A penalty on a weight adds into its gradient after backward: that norm is computed again."""
    plain, plain_opt, model, optimizer = _twins()
    for step in range(3):
        for net in (plain, model):
            weight = dict(net.named_parameters())["2.weight"]
            (_loss(net, step, "cpu") + 0.1 * weight.square().sum()).backward()
        _clip_and_step(plain, plain_opt, model, optimizer, set_to_none=False)
    _assert_same(plain, model, optimizer)


def test_with_accumulation_the_last_backward_computes_them(computed_at_clip):
    plain, plain_opt, model, optimizer = _twins(accumulation_steps=2)
    jobs = []
    original = optimizer._norms._compute
    optimizer._norms._compute = lambda chosen, generation: (jobs.append(len(chosen)), original(chosen, generation))
    for step in range(3):
        for micro in range(2):
            (_loss(plain, 10 * step + micro, "cpu") / 2).backward()
            (_loss(model, 10 * step + micro, "cpu") / 2).backward()
            optimizer._norms.settle()
            assert bool(jobs) == (micro == 1)
        _clip_and_step(plain, plain_opt, model, optimizer)
        jobs.clear()
    _assert_same(plain, model, optimizer)
    # The second backward adds onto the first's .grad through autograd: only zeroed .grad are taken then.
    assert len(computed_at_clip) == 3


def test_a_write_the_version_counters_miss_is_found_by_the_first_clip():
    _, _, model, optimizer = _twins()
    _loss(model, 0, "cpu").backward()
    optimizer._norms.settle()  # the norms taken before the write, not after (a busy machine delays them)
    first = next(iter(model.parameters()))
    first.grad.data.mul_(2.0)  # .data: the gradient's version counter does not move
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"changed after backward computed its norm.*\.grad\.data.*without "
                                           r"norms_in_backward"):
        offload.clip_grad_norm_(model.parameters(), max_norm=1e-6)
    for p, g in zip(model.parameters(), before):  # nothing was clipped
        torch.testing.assert_close(p.grad, g, **EXACT)
    # The norms were forgotten: the same call now computes them all, and is PyTorch's.
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    torch.testing.assert_close(offload.clip_grad_norm_(model.parameters(), max_norm=1e9), expected, **EXACT)


@pytest.mark.parametrize("write", ["data", "unscale"])
def test_the_first_check_sees_a_write_after_backward_however_late_the_worker(monkeypatch, write):
    """A worker that runs late (a loaded machine; the first step's, which starts its thread) must not
    take the values written after backward: the first clip would find them equal and later steps
    would trust stale norms. The backward whose norms no clip has compared waits for them."""
    from offload.optimizing.backward_norms import BackwardNorms

    original = BackwardNorms._compute

    def late(self, *args):
        time.sleep(0.3)
        return original(self, *args)

    monkeypatch.setattr(BackwardNorms, "_compute", late)
    _, _, model, optimizer = _twins()
    _loss(model, 0, "cpu").backward()
    if write == "data":
        for p in model.parameters():
            p.grad.data.mul_(0.5)  # .data: the gradients' version counters do not move
    else:
        # GradScaler's unscale kernel leaves the version counters as they were.
        grads = [p.grad for p in model.parameters()]
        found = torch.zeros(1)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.full((1,), 0.5))
    with pytest.raises(RuntimeError, match="changed after backward computed its norm"):
        offload.clip_grad_norm_(model.parameters(), max_norm=1e-6)


def test_a_norm_kept_holds_no_gradient_memory_and_goes_with_it():
    _, _, model, optimizer = _twins()
    grad = torch.randn(1000)
    storage = StorageWeakRef(grad.untyped_storage())
    clipping.remember_norms(optimizer._norms, [grad], [torch.linalg.vector_norm(grad)], [grad._version],
                            [("g", 0)])
    assert clipping._known_norms([grad])[0] is not None
    del grad
    gc.collect()
    assert storage.expired()
    assert clipping._known_norms([torch.randn(1000)]) == [None]  # memory the allocator gives out again


def test_without_the_option_nothing_is_computed_in_backward(computed_at_clip):
    model = OffloadModel(network(), device="cpu", num_slices=3)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    for step in range(2):
        _loss(model, step, "cpu").backward()
        offload.clip_grad_norm_(model.parameters(), max_norm=0.05)
        optimizer.step()
        optimizer.zero_grad()
    assert computed_at_clip == [len(list(model.parameters()))] * 2


def test_a_newer_optimizer_replaces_the_computation_and_a_dead_one_stops_it():
    model = OffloadModel(network(), device="cpu", num_slices=3)
    first = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, norms_in_backward=True)
    second = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, norms_in_backward=True)
    subscribers = model._engine.milestones.subscribers
    assert first._norms not in subscribers and second._norms in subscribers
    norms = second._norms
    del first, second
    gc.collect()
    assert norms not in model._engine.milestones.subscribers


def test_bad_arguments():
    model = OffloadModel(network(), device="cpu", num_slices=3)
    with pytest.raises(ValueError, match="norms_in_backward is for clipping.*update_in_backward"):
        OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, norms_in_backward=True, update_in_backward=True)
    with pytest.raises(TypeError, match="norms_in_backward must be True or False"):
        OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, norms_in_backward=1)


def test_a_sparse_gradient_meets_what_pytorch_does_with_norms_kept():
    # PyTorch's clip refuses a sparse gradient up to 2.14 (no sparse vector norm) and clips it from
    # 2.15: offload's raises the same error, or gives the same norm and gradients, bit for bit.
    plain, _, model, optimizer = _twins()
    _loss(plain, 0, "cpu").backward()
    _loss(model, 0, "cpu").backward()
    optimizer._norms.settle()
    assert clipping._known

    def with_sparse(params):
        sparse = nn.Parameter(torch.zeros(10, 3))
        sparse.grad = torch.sparse_coo_tensor([[1, 4]], torch.ones(2, 3), (10, 3))
        return [*params, sparse]

    theirs, mine = with_sparse(plain.parameters()), with_sparse(model.parameters())
    try:
        expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm=1.0)
    except NotImplementedError as error:
        with pytest.raises(NotImplementedError, match=re.escape(str(error).splitlines()[0])):
            offload.clip_grad_norm_(mine, max_norm=1.0)
        return
    torch.testing.assert_close(offload.clip_grad_norm_(mine, max_norm=1.0), expected, rtol=0, atol=0)
    for p, q in zip(mine, theirs):
        torch.testing.assert_close(p.grad.to_dense(), q.grad.to_dense(), rtol=0, atol=0)


def test_each_parameters_first_norm_from_backward_is_compared_even_when_clipped_in_groups():
    _, _, model, optimizer = _twins()
    params = list(model.parameters())
    first, second = params[:4], params[4:]
    _loss(model, 0, "cpu").backward()
    offload.clip_grad_norm_(first, max_norm=1e9)  # compares the first group's norms only
    second[0].grad.data.mul_(3.0)  # unseen by the version counter
    with pytest.raises(RuntimeError, match="changed after backward computed its norm"):
        offload.clip_grad_norm_(second, max_norm=1e9)


def test_a_replaced_optimizer_stays_out_of_the_walks_when_the_model_moves():
    model = OffloadModel(network(), device="cpu", num_slices=3)
    old = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, norms_in_backward=True)
    new = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    subscribers = model._engine.milestones.subscribers
    assert old._norms not in subscribers and new._norms is None
    old._norms.follow(model._engine)  # as a move's _follow does for every optimizer of the model
    assert old._norms not in model._engine.milestones.subscribers
    _loss(model, 0, "cpu").backward()
    old._norms.settle()
    assert not clipping._known


def test_the_optimizers_finalizer_takes_no_lock_and_its_norms_are_dropped(monkeypatch):
    """A finalizer may run inside any allocation, one under the registry's lock included: it must not
    wait for a lock its own thread may hold."""
    _, _, model, optimizer = _twins()
    _loss(model, 0, "cpu").backward()
    norms = optimizer._norms
    norms.settle()
    assert clipping._known

    class Refused:
        def __enter__(self):
            raise AssertionError("a lock taken")

        def __exit__(self, *exc):
            return False

        acquire = __enter__

    with monkeypatch.context() as patch:
        patch.setattr(clipping, "_known_lock", Refused())
        patch.setattr(norms, "_lock", Refused())
        norms._optimizer_gone()
    assert norms.closed and norms not in model._engine.milestones.subscribers
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    torch.testing.assert_close(offload.clip_grad_norm_(model.parameters(), max_norm=1e9), expected, **EXACT)
    assert not clipping._known  # dropped where found


def test_backwards_without_a_clip_hold_no_more_than_one_backwards_jobs():
    _, _, model, optimizer = _twins()
    for step in range(20):
        _loss(model, step, "cpu").backward()
        optimizer.step()
        optimizer.zero_grad()
        assert len(optimizer._norms._events) <= 3  # one per slice: the last backward's


def test_a_backward_through_two_calls_of_the_model_counts_once():
    _, _, model, optimizer = _twins(accumulation_steps=2)
    (_loss(model, 0, "cpu") + _loss(model, 1, "cpu")).backward()
    assert optimizer._norms.backwards == 1
    _loss(model, 2, "cpu").backward()
    assert optimizer._norms.backwards == 2


def test_the_norms_worker_ends_with_its_optimizer():
    model = OffloadModel(network(), device="cpu", num_slices=3)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, norms_in_backward=True)
    _loss(model, 0, "cpu").backward()
    offload.clip_grad_norm_(model.parameters(), max_norm=1.0)
    assert any(t.name == "offload gradient norms" for t in threading.enumerate())
    del optimizer
    gc.collect()
    for _ in range(50):
        if not any(t.name == "offload gradient norms" for t in threading.enumerate()):
            break
        time.sleep(0.1)
    assert not any(t.name == "offload gradient norms" for t in threading.enumerate())


@pytest.mark.parametrize("first", ["overflow", "zero"])
def test_a_first_step_whose_norms_cannot_show_a_write_checks_nothing(first):
    """Unscaling a non-finite or zero gradient leaves its norm as it was: such a first clip compares
    equal norms and must not have later clips trust the norms of still-scaled gradients."""
    _, _, model, optimizer = _twins()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)  # the plain one: its unscale_ is not told
    for step in range(2):
        loss = _loss(model, step, "cpu")
        if step == 0:
            loss = loss * (float("inf") if first == "overflow" else 0.0)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        if step == 0:
            offload.clip_grad_norm_(model.parameters(), max_norm=0.05)
        else:
            with pytest.raises(RuntimeError, match="changed after backward computed its norm.*GradScaler"):
                offload.clip_grad_norm_(model.parameters(), max_norm=0.05)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


def test_offloads_grad_scaler_has_the_norms_computed_anew_overflow_first_or_not(computed_at_clip, monkeypatch):
    """offload.GradScaler's unscale_ forgets the norms backward took of the scaled gradients: the
    training is the plain model's under torch's scaler, a first step that overflows included; and
    from the first unscaling on, backward computes none (each would be thrown away)."""
    in_backward: list[int] = []
    original = backward_norms.pooled_norms
    monkeypatch.setattr(backward_norms, "pooled_norms",
                        lambda tensors, *args: in_backward.append(len(tensors)) or original(tensors, *args))
    plain, plain_opt, model, optimizer = _twins(accumulation_steps=2)
    scalers = (torch.amp.GradScaler("cpu", init_scale=2.0**8), offload.GradScaler("cpu", init_scale=2.0**8))
    for step in range(4):
        norms = []
        for net, opt, scaler, clip in ((plain, plain_opt, scalers[0], torch.nn.utils.clip_grad_norm_),
                                       (model, optimizer, scalers[1], offload.clip_grad_norm_)):
            for micro in range(2):
                loss = _loss(net, 10 * step + micro, "cpu") / 2
                scaler.scale(loss * float("inf") if step == 0 and micro == 1 else loss).backward()
            scaler.unscale_(opt)
            norms.append(clip(net.parameters(), max_norm=0.05))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        torch.testing.assert_close(norms[1], norms[0], **EXACT, equal_nan=True)
    _assert_same(plain, model, optimizer)
    assert computed_at_clip == [len(list(model.parameters()))] * 4  # every norm computed at the clip
    computed_by_first_backward = sum(in_backward)
    assert 0 < computed_by_first_backward <= len(list(model.parameters()))  # the first step's only
