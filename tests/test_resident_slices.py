"""OffloadModel(resident_slices=k): the first k slices stay on the device, are updated there by
OffloadOptimizer with the same optimizer class, and give the plain optimizer's results bit for bit
(Note: [Resident slices] in ``offload/streams/resident_storage.py``)."""

from __future__ import annotations

import copy
import pickle
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from offload import DiskTier, OffloadModel, OffloadOptimizer, load_checkpoint, save_checkpoint
from offload.streams.resident_storage import ResidentStorage

from .helpers import CUDA, DEVICES
from .test_optimizer import assert_same, batch, network
from .test_tied import ids, network as tied_network
from .test_update_in_backward import OPTIMIZERS, Plain, Twin, offload_loss, plain_optimizer

pytestmark = pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")

EXACT = {"rtol": 0.0, "atol": 0.0}
BF16 = torch.bfloat16
NUM_SLICES = 3


def held_tensors(model: OffloadModel, index: int) -> list[torch.Tensor]:
    return [entry.tensor for entry in model._engine.slices[index].storage.held]


# -- 1. parity ------------------------------------------------------------------------------------

CASES = [
    pytest.param("AdamW-fused", None, 1, 1, False, id="AdamW-fused-fp32-resident1"),
    pytest.param("AdamW-fused", BF16, 2, 2, False, id="AdamW-fused-bf16-mb2-resident2"),
    pytest.param("AdamW-fused", BF16, 1, 1, True, id="AdamW-fused-bf16-resident1-in-backward"),
    pytest.param("SGD-momentum", None, 2, 3, False, id="SGD-momentum-fp32-mb2-all-resident"),
    pytest.param("SGD-momentum", BF16, 1, 2, True, id="SGD-momentum-bf16-resident2-in-backward"),
    pytest.param("Adam-per-tensor", None, 1, 2, True, id="Adam-per-tensor-fp32-resident2-in-backward"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, compute_dtype, num_microbatches, resident, in_backward", CASES)
def test_resident_slices_step_like_the_plain_optimizer(name, compute_dtype, num_microbatches, resident,
                                                       in_backward, device):
    cls, kwargs = OPTIMIZERS[name]
    settings = {"device": device, "num_slices": NUM_SLICES, "compute_dtype": compute_dtype,
                "num_microbatches": num_microbatches}
    model = OffloadModel(network(), resident_slices=resident, **settings)
    if num_microbatches == 1 and device == "cpu":
        reference: Plain | Twin = Plain(network(), compute_dtype)
    else:
        # On a GPU the resident slices are updated there: the reference is the same optimizer on
        # the same device, so that twin keeps them resident too.
        reference = Twin(OffloadModel(network(), resident_slices=resident if device != "cpu" else 0, **settings))
    plain = plain_optimizer(cls, reference.model.parameters(), kwargs)
    accumulation = 2
    declared = {"update_in_backward": True, "accumulation_steps": accumulation} if in_backward else {}
    optimizer = OffloadOptimizer(model, cls, **declared, **kwargs)
    for step in range(4):
        for micro in range(accumulation):
            x = batch(10 * step + micro)
            reference.backward(x, accumulation)
            offload_loss(model, x, accumulation).backward()
        for opt in (plain, optimizer):
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 0)
        if in_backward and step > 0:
            # The streamed slices' updates started in backward; the resident ones wait for step().
            assert optimizer._in_backward.last_started == set(range(resident, NUM_SLICES)), step
            assert set(optimizer._in_backward.deferred) == set(range(resident)), step
    assert_same(reference.model, plain, model, optimizer)
    for index in range(NUM_SLICES):
        for p in held_tensors(model, index):
            assert (p.device.type == torch.device(device).type) == (index < resident or device == "cpu")


@pytest.mark.parametrize("resident", [1, 2])
def test_batch_norm_buffers_and_microbatches_match_the_streamed_model(resident):
    """Buffers of a resident slice: written back on the device after forward, snapshotted for the
    recompute, restored in backward: the same outputs, gradients and running statistics as the
    model with every slice streamed, bit for bit."""

    def bn_network() -> nn.Sequential:
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 8),
                             nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))

    models = [OffloadModel(bn_network(), device="cpu", num_slices=4, num_microbatches=2, resident_slices=k)
              for k in (0, resident)]
    optimizers = [OffloadOptimizer(m, torch.optim.AdamW, lr=1e-2) for m in models]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BatchNorm over microbatches
        for step in range(3):
            outs = []
            for m, opt in zip(models, optimizers):
                torch.manual_seed(step)
                out = m(batch(step))
                out.pow(2).mean().backward()
                outs.append(out.detach())
                opt.step()
                opt.zero_grad()
            torch.testing.assert_close(outs[1], outs[0], **EXACT)
        with torch.no_grad():
            models[0].eval(), models[1].eval()
            torch.testing.assert_close(models[1](batch(9)), models[0](batch(9)), **EXACT)
    assert_same(models[0], optimizers[0], models[1], optimizers[1])
    for a, b in zip(models[0].buffers(), models[1].buffers()):
        torch.testing.assert_close(b, a, **EXACT)


def test_a_weight_tied_to_a_resident_slice_trains_like_the_plain_model():
    """An embedding held by the resident first slice and borrowed by the streamed last one: the
    last slice casts it from the device copy, and both slices' gradients meet in one ``.grad`` on
    the device."""
    plain = tied_network(dropout=0.0)
    model = OffloadModel(tied_network(dropout=0.0), device="cpu", num_slices=3, resident_slices=1)
    assert len(model._engine.slices[2].storage.borrowed) == 1
    plain_opt = plain_optimizer(torch.optim.AdamW, plain.parameters(), {"lr": 1e-2})
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    for step in range(3):
        for m, opt in ((plain, plain_opt), (model, optimizer)):
            m(ids()).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert_same(plain, plain_opt, model, optimizer)


def test_gradients_of_plain_autograd_calls():
    """``torch.autograd.grad`` with ``inputs=`` naming a resident parameter and a streamed one, and
    two backwards adding into ``.grad``, as on the plain model."""
    plain, model = network(), OffloadModel(network(), device="cpu", num_slices=NUM_SLICES, resident_slices=1)
    picks = [lambda m: list(m.parameters())[0], lambda m: list(m.parameters())[-1]]
    for m in (plain, model):
        m.zero_grad()
    got = torch.autograd.grad(model(batch(0)).pow(2).sum(), [pick(model) for pick in picks])
    want = torch.autograd.grad(plain(batch(0)).pow(2).sum(), [pick(plain) for pick in picks])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **EXACT)
    for m in (plain, model):
        for step in range(2):
            m(batch(step)).pow(2).sum().backward()
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **EXACT, msg=lambda m: f"{name}: {m}")


# -- 2. what stays where --------------------------------------------------------------------------


def test_resident_slices_skip_the_link_and_the_host_pool():
    slice_loads: list[int] = []

    def traffic(resident: int) -> tuple[OffloadModel, int, int]:
        model = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES, resident_slices=resident)
        copies = model._engine.copies
        load = copies.load

        def counted(dst, src, *args, label="", **kwargs):
            if label in ("offload::load slice 0", "offload::load slice 1"):
                slice_loads.append(src.nbytes)
            return load(dst, src, *args, label=label, **kwargs)

        copies.load = counted
        model(batch(0)).pow(2).mean().backward()
        return (model, *model._engine.traffic())

    streamed, loaded, offloaded = traffic(0)
    model, loaded_resident, offloaded_resident = traffic(2)
    assert model.resident_slices == 2
    assert [isinstance(s.storage, ResidentStorage) for s in model._engine.slices] == [True, True, False]
    # What the streamed model loads of slices 0 and 1, and their gradients, no longer cross the link.
    storages = [s.storage for s in streamed._engine.slices[:2]]
    assert len(slice_loads) >= 2
    assert loaded - loaded_resident == sum(slice_loads)
    assert offloaded - offloaded_resident == sum(e.tensor.numel() * 4 for st in storages for e in st.params)
    pooled = {b.data.untyped_storage().data_ptr() for b in model._engine.pool.buffers()}
    for index, resident in ((0, True), (1, True), (2, False)):
        for p in held_tensors(model, index):
            if isinstance(p, nn.Parameter):
                assert (p.grad.untyped_storage().data_ptr() in pooled) is not resident, index


def test_the_footprint_counts_resident_bytes_on_the_device():
    model = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES, resident_slices=1)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    model(batch(0)).pow(2).mean().backward()
    optimizer.step()
    footprint = model.memory_footprint()
    resident = held_tensors(model, 0)
    streamed = held_tensors(model, 1) + held_tensors(model, 2)
    nbytes = sum(t.numel() * t.element_size() for t in resident)
    assert footprint.device_resident == nbytes
    assert footprint.device_resident_gradients == nbytes  # each in memory of its own, as autograd leaves it
    assert footprint.device_resident_optimizer_state == 2 * nbytes  # AdamW's two moments
    assert footprint.parameters == sum(p.numel() for p in model.parameters())
    host = sum(t.numel() * t.element_size() for t in streamed)
    assert host <= footprint.host_masters < host + 64 * len(streamed)
    assert footprint.host_optimizer_state == 2 * host
    assert "device_resident" in str(footprint)


def test_copies_and_pickles_keep_the_resident_slices():
    model = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES, resident_slices=2)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert twin.resident_slices == 2
        torch.testing.assert_close(twin(batch(1)), model(batch(1)), **EXACT)
    assert "resident" in repr(model)


def test_the_disk_tier_leaves_resident_state_on_the_device(tmp_path):
    plain, model = network(), OffloadModel(network(), device="cpu", num_slices=NUM_SLICES, resident_slices=1)
    plain_opt = plain_optimizer(torch.optim.AdamW, plain.parameters(), {"lr": 1e-2})
    with OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, disk_tier=DiskTier(tmp_path)) as optimizer:
        for step in range(3):
            for m, opt in ((plain, plain_opt), (model, optimizer)):
                m(batch(step)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        assert_same(plain, plain_opt, model, optimizer)
        assert sorted(optimizer._tier.records) == [1, 2]  # the streamed slices only
        footprint = model.memory_footprint()
        assert footprint.device_resident_optimizer_state == 2 * sum(
            p.numel() * p.element_size() for p in held_tensors(model, 0))


def test_a_checkpoint_resumes_bit_for_bit(tmp_path):
    def build() -> tuple[OffloadModel, OffloadOptimizer]:
        m = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES, compute_dtype=BF16, resident_slices=1)
        return m, OffloadOptimizer(m, torch.optim.AdamW, lr=1e-2, fused=True)

    def train(m: OffloadModel, opt: OffloadOptimizer, steps: range) -> None:
        for step in steps:
            offload_loss(m, batch(step), 1).backward()
            opt.step()
            opt.zero_grad()

    straight, straight_opt = build()
    train(straight, straight_opt, range(4))
    first, first_opt = build()
    train(first, first_opt, range(2))
    save_checkpoint(tmp_path / "ckpt", first, first_opt)
    resumed, resumed_opt = build()
    load_checkpoint(tmp_path / "ckpt", resumed, resumed_opt)
    train(resumed, resumed_opt, range(2, 4))
    assert_same(straight, straight_opt, resumed, resumed_opt)


# -- 3. bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value, error, match", [
    (-1, ValueError, "between 0 and the number of slices"),
    (4, ValueError, r"between 0 and the number of slices \(3\)"),
    (True, TypeError, "must be an int"),
    (1.0, TypeError, "must be an int"),
])
def test_bad_resident_counts_are_refused(value, error, match):
    with pytest.raises(error, match=match):
        OffloadModel(network(), device="cpu", num_slices=NUM_SLICES, resident_slices=value)


def test_resident_slices_refuse_a_process_group():
    with pytest.raises(ValueError, match="resident_slices with a process_group is not supported"):
        OffloadModel(network(), device="cpu", num_slices=NUM_SLICES, resident_slices=1, process_group=object())


# -- 4. on a GPU ----------------------------------------------------------------------------------


@CUDA
def test_on_a_gpu_resident_parameters_gradients_and_state_live_there():
    model = OffloadModel(network(), device="cuda", num_slices=NUM_SLICES, compute_dtype=BF16, resident_slices=1)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    for step in range(2):
        offload_loss(model, batch(step), 1).backward()
        optimizer.step()
        if step == 0:
            grads: dict[Any, str] = {id(p): p.grad.device.type for p in model.parameters()}
        optimizer.zero_grad()
    for index in range(NUM_SLICES):
        expected = "cuda" if index == 0 else "cpu"
        for p in held_tensors(model, index):
            assert p.device.type == expected
            if isinstance(p, nn.Parameter):
                assert grads[id(p)] == expected
                assert all(v.device.type == expected for v in optimizer.state[p].values() if v.dim() > 0)


# -- 5. the orderings -----------------------------------------------------------------------------


def test_a_resident_load_off_the_compute_stream_is_a_race_the_checker_reports(monkeypatch):
    """Resident loads are ordered after the optimizer's device update (and the caller's writes) by
    running on the compute stream. Moved to the load stream without a wait, as a host slice's load
    would go, the checker reports the race with the update that wrote the parameters."""
    from offload.streamcheck import StreamChecker
    from offload.streams.flat_views import typed_view

    def on_the_load_stream(self: ResidentStorage, slot: torch.Tensor) -> None:
        copies = self_copies[0]
        for entry in self.held:
            view = typed_view(slot, entry.device_offset, entry.device_dtype, entry.shape, entry.stride)
            copies.backend.copy(view, entry.tensor.detach(), copies.load_stream, to_device=True)
        copies.wait_ready(copies.backend.record(copies.load_stream))

    def trained_under_the_checker() -> StreamChecker:
        with StreamChecker(schedule="late") as checker:
            model = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES, resident_slices=1)
            self_copies[:] = [model._engine.copies]
            optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
            for step in range(2):
                model(batch(step)).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
        return checker

    self_copies: list[Any] = []
    checker = trained_under_the_checker()
    assert not checker.races, checker.summary()
    monkeypatch.setattr(ResidentStorage, "load_into", on_the_load_stream)
    checker = trained_under_the_checker()
    assert any(race.kind == "write then read not ordered" and "_fused_adamw_" in race.first
               for race in checker.races), checker.summary()


@CUDA
def test_a_cpu_call_under_an_optimizer_leaves_resident_tensors_on_the_gpu():
    """``.cpu()`` under an OffloadOptimizer (a training loop's teardown) warns and keeps computing
    on the GPU: the resident slices' parameters and gradients stay there too."""
    model = OffloadModel(network(), device="cuda", num_slices=NUM_SLICES, resident_slices=1)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    offload_loss(model, batch(0), 1).backward()
    optimizer.step()
    with pytest.warns(UserWarning, match="keeps computing"):
        model.cpu()
    for p in held_tensors(model, 0):
        assert p.device.type == "cuda"
        if isinstance(p, nn.Parameter):
            assert p.grad.device.type == "cuda"
    offload_loss(model, batch(1), 1).backward()
    optimizer.step()
