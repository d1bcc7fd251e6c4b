"""compute_dtype: half-precision compute with float32 host masters, loss scaling, accumulation, clipping."""

from __future__ import annotations

import contextlib
import copy
import tempfile

import pytest
import torch
from torch import nn

from offload import OffloadModel
from offload.streams.host_storage import FLOAT32_LAYERS

from .helpers import ACTIVATIONS, DEVICES, assert_same_grads, microbatched_reference, seeded

EXACT = {"rtol": 0.0, "atol": 0.0}
HALF = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


def network(dropout: float = 0.0) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(12, 32), nn.LayerNorm(32), nn.GELU(), nn.Dropout(dropout),
        nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Tanh(),
        nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4),
    )


def converted(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The plain model as OffloadModel computes it: parameters in ``dtype`` except those of
    batch and instance norms; buffers unchanged."""
    reference = copy.deepcopy(model)
    for module in reference.modules():
        if isinstance(module, FLOAT32_LAYERS):
            continue
        for name, param in module.named_parameters(recurse=False):
            param.data = param.data.to(dtype)
    return reference


def master_grads_of(reference: nn.Module) -> nn.Module:
    """A float32 view of a converted reference's gradients, to compare with float32 .grad."""
    view = copy.deepcopy(reference)
    for p, p_ref in zip(view.parameters(), reference.parameters()):
        p.data = p.data.float()
        p.grad = None if p_ref.grad is None else p_ref.grad.float()
    return view


@pytest.mark.filterwarnings("ignore:OffloadModel with num_microbatches > 1 runs BatchNorm")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("num_slices", [1, 3])
@pytest.mark.parametrize("num_microbatches", [1, 2])
@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_parity_with_the_converted_model(device, dtype, num_slices, num_microbatches, activations, dropout):
    torch.manual_seed(0)
    plain = network(dropout)
    reference = converted(plain, dtype).to(device)
    model = OffloadModel(copy.deepcopy(plain), device=device, num_slices=num_slices, num_microbatches=num_microbatches,
                         compute_dtype=dtype, **ACTIVATIONS[activations])
    x = torch.randn(8, 12, device=device)
    x_ref = x.clone().requires_grad_()
    x_off = x.clone().requires_grad_()

    def reference_step():
        out = microbatched_reference(reference, model.partition, x_ref.to(dtype), num_microbatches)
        out.float().pow(2).mean().backward()
        return out

    out_ref = seeded(5, reference_step)
    out_off = seeded(5, lambda: model(x_off))
    out_off.float().pow(2).mean().backward()

    assert out_off.dtype == dtype
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    torch.testing.assert_close(out_off, out_ref, **EXACT)
    assert x_off.grad.dtype == torch.float32
    if num_microbatches == 1:
        # Same half-precision operations, and gradients cast exactly from half to float32.
        torch.testing.assert_close(x_off.grad, x_ref.grad, **EXACT)
        assert_same_grads(model, master_grads_of(reference), **EXACT)
    else:
        # Microbatch gradients are summed in float32 here, in half precision by the reference.
        tol = {"rtol": 2e-2, "atol": 2e-3}
        torch.testing.assert_close(x_off.grad, x_ref.grad, **tol)
        assert_same_grads(model, master_grads_of(reference), **tol)
    for (name, b_off), b_ref in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b_off.to(device), b_ref, **EXACT, msg=lambda m: f"{name}: {m}")


NORMS = [
    pytest.param(lambda: [nn.LayerNorm(16)], id="LayerNorm"),
    pytest.param(lambda: [nn.GroupNorm(4, 16)], id="GroupNorm"),
    pytest.param(lambda: [nn.RMSNorm(16)], id="RMSNorm"),
    pytest.param(lambda: [nn.BatchNorm1d(16)], id="BatchNorm1d"),
    pytest.param(lambda: [nn.Unflatten(1, (4, 4)), nn.InstanceNorm1d(4, affine=True, track_running_stats=True),
                          nn.Flatten()], id="InstanceNorm1d"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("make_norm", NORMS)
def test_every_norm_layer_trains_in_the_compute_dtype(device, dtype, make_norm):
    """Each norm's kernels must accept the dtypes compute_dtype gives them on this device: LayerNorm
    on CUDA refuses a float32 weight with a bfloat16 input, BatchNorm takes it."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 16), *make_norm(), nn.Linear(16, 4))
    reference = converted(plain, dtype).to(device)
    model = OffloadModel(copy.deepcopy(plain), device=device, num_slices=2, compute_dtype=dtype)
    x = torch.randn(6, 16, device=device)
    out_ref = reference(x.to(dtype))
    out_ref.float().pow(2).mean().backward()
    out_off = model(x)
    out_off.float().pow(2).mean().backward()
    torch.testing.assert_close(out_off, out_ref, **EXACT)
    assert_same_grads(model, master_grads_of(reference), **EXACT)
    for (name, b_off), b_ref in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b_off.to(device), b_ref, **EXACT, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_loads_move_half_the_bytes_and_gradients_arrive_in_float32(device):
    torch.manual_seed(0)
    plain = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    full = OffloadModel(copy.deepcopy(plain), device=device, num_slices=4)
    half = OffloadModel(copy.deepcopy(plain), device=device, num_slices=4, compute_dtype=torch.bfloat16)
    x = torch.randn(2, 64, device=device)
    for model in (full, half):
        model(x).float().sum().backward()
    loaded_full, _ = full._engine.traffic()
    loaded_half, _ = half._engine.traffic()
    assert loaded_half < 0.52 * loaded_full
    # Boundary activations leave in the compute dtype; gradients leave in float32, cast on the
    # device, so the host adopts them as .grad without a cast.
    assert half._engine.activations.offloaded_bytes == full._engine.activations.offloaded_bytes // 2
    param_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    assert half._engine.gradients.offloaded_bytes == full._engine.gradients.offloaded_bytes == param_bytes
    # Where the host copies them into their files (masters on disk: Note: [Gradients on disk]) they
    # leave in the compute dtype, half the bytes, and .grad ends the same, bit for bit (Note:
    # [Gradients in the compute dtype]); added into .grad on the host, or summed over microbatches,
    # they leave in float32.
    for microbatches, masters, set_to_none, expected in ((1, True, True, param_bytes // 2),
                                                         (1, True, False, param_bytes),
                                                         (1, False, False, param_bytes),
                                                         (2, True, True, param_bytes)):
        reference = OffloadModel(copy.deepcopy(plain), device=device, num_slices=4, compute_dtype=torch.bfloat16,
                                 num_microbatches=microbatches)
        files = tempfile.TemporaryDirectory() if masters else contextlib.nullcontext()
        with files as directory:
            landed = OffloadModel(copy.deepcopy(plain), device=device, num_slices=4, compute_dtype=torch.bfloat16,
                                  num_microbatches=microbatches, masters=directory)
            for step in range(2):
                reference.zero_grad()
                landed.zero_grad(set_to_none=set_to_none)
                before = landed._engine.gradients.offloaded_bytes
                for model in (reference, landed):
                    model(x + step).float().sum().backward()
            assert landed._engine.gradients.offloaded_bytes - before == expected, (microbatches, masters, set_to_none)
            for p, q in zip(reference.parameters(), landed.parameters()):
                assert q.grad.dtype == torch.float32 and torch.equal(p.grad, q.grad)
            del landed


def gradient_copies(model: OffloadModel) -> list[int]:
    """Per device-to-host copy call of the model's gradients from now on, how many tensors it sends."""
    copies = model._engine.copies
    calls: list[int] = []
    offload_many = copies.offload_many

    def counting(dsts, srcs, *args, **kwargs):
        if "gradients" in kwargs.get("label", ""):
            calls.append(len(srcs))
        return offload_many(dsts, srcs, *args, **kwargs)

    copies.offload_many = counting
    return calls


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF)
def test_a_slices_gradients_cast_on_the_device_leave_in_one_copy(device, dtype, monkeypatch):
    """Note: [One copy per slice]: cast into one buffer laid out as the host's, each slice's
    gradients cross in one copy, and .grad is what the plain model's gradients cast give, bit for
    bit; with a parameter kept in float32 (BatchNorm's) and a frozen one in the slice."""
    torch.manual_seed(0)
    plain = network()
    plain[4].bias.requires_grad_(False)
    reference = converted(plain, dtype).to(device)
    x = torch.randn(8, 12, device=device)
    reference(x.to(dtype)).float().pow(2).mean().backward()
    trainable = [p for p in plain.parameters() if p.requires_grad]
    counted = []
    for gather, expected in (("1", [1, 1, 1]), ("0", None)):
        monkeypatch.setenv("OFFLOAD_GRADIENT_GATHER", gather)
        model = OffloadModel(copy.deepcopy(plain), device=device, num_slices=3, compute_dtype=dtype)
        calls = gradient_copies(model)
        model(x).float().pow(2).mean().backward()
        # Without gathering, a copy per gradient (one call per slice, each with its tensors).
        assert calls == (expected or calls) and sum(calls) == (3 if expected else len(trainable))
        assert_same_grads(model, master_grads_of(reference), **EXACT)
        counted.append(model._engine.copies.offload_copies)  # what the benchmarks report per step
    assert counted[1] - counted[0] == len(trainable) - 3


def test_gradients_leave_a_copy_each_where_gathering_would_cost_a_copy_of_its_own(tmp_path):
    """No cast on the device (float32 compute), or half-precision gradients copied into their
    files as they are (masters on disk): the gradients are not gathered."""
    torch.manual_seed(0)
    plain = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    x = torch.randn(4, 16)
    for options in ({}, {"compute_dtype": torch.bfloat16, "masters": str(tmp_path)}):
        model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=2, **options)
        calls = gradient_copies(model)
        model(x).float().sum().backward()
        assert calls == [4, 4], options


def test_bf16_training_tracks_float32():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
    teacher = torch.randn(16, 1)
    runs = {}
    for dtype in (None, torch.bfloat16):
        torch.manual_seed(1)
        model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=3, compute_dtype=dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(60):
            x = torch.randn(64, 16)
            y = torch.tanh(x @ teacher / 4)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        runs[dtype] = losses
    fp32, bf16 = runs[None], runs[torch.bfloat16]
    assert fp32[-1] < 0.2 * fp32[0] and bf16[-1] < 0.2 * bf16[0]
    late = slice(-10, None)
    assert abs(sum(bf16[late]) - sum(fp32[late])) <= 0.15 * sum(fp32[late])


@pytest.mark.parametrize("device", DEVICES)
def test_grad_scaler_overflow_skips_the_step_and_leaves_parameters_bit_identical(device):
    torch.manual_seed(0)
    model = OffloadModel(network(), device=device, num_slices=3, compute_dtype=torch.float16)
    scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=2.0**10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randn(8, 12, device=device)
    x[3, 5] = float("inf")  # the stand-in for an overflow in half precision
    scaler.scale(model(x).float().pow(2).mean()).backward()
    scaler.step(optimizer)
    scaler.update()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert scaler.get_scale() == 2.0**9
    assert not optimizer.state  # the optimizer never stepped

    # The next, finite step goes through: unscaled gradients match an unscaled backward up to
    # half-precision rounding (scaling exists because small fp16 gradients underflow unscaled).
    twin = copy.deepcopy(model)
    x = torch.randn(8, 12, device=device)
    optimizer.zero_grad()
    scaler.scale(model(x).float().pow(2).mean()).backward()
    scaler.unscale_(optimizer)
    twin(x).float().pow(2).mean().backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-2, atol=1e-4)
    scaler.step(optimizer)
    scaler.update()
    assert optimizer.state and scaler.get_scale() == 2.0**9
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_gradient_accumulation_over_micro_steps(device, dtype):
    torch.manual_seed(0)
    plain = network()
    model = OffloadModel(copy.deepcopy(plain), device=device, num_slices=3, compute_dtype=dtype)
    reference = (converted(plain, dtype) if dtype else copy.deepcopy(plain)).to(device)
    steps = 4
    summed: dict[str, torch.Tensor] = {}
    for _ in range(steps):
        x = torch.randn(8, 12, device=device)
        (model(x).float().pow(2).mean() / steps).backward()
        reference.zero_grad()
        (reference(x.to(dtype) if dtype else x).float().pow(2).mean() / steps).backward()
        for name, p in reference.named_parameters():
            # The masters accumulate in float32; so does this sum of the reference's gradients.
            summed[name] = summed.get(name, 0) + p.grad.float()
    tol = EXACT if dtype is None else {"rtol": 1e-6, "atol": 1e-7}
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.to(device), summed[name], **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_clip_grad_norm_over_host_gradients_matches(device):
    torch.manual_seed(0)
    plain = network()
    model = OffloadModel(copy.deepcopy(plain), device=device, num_slices=3)
    reference = copy.deepcopy(plain).to(device)
    x = torch.randn(8, 12, device=device)
    for net in (model, reference):
        net(x).pow(2).sum().backward()
    norm_off = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    norm_ref = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5)
    torch.testing.assert_close(norm_off.to(device), norm_ref, rtol=1e-6, atol=0)
    assert norm_ref > 0.5  # clipping happened
    assert_same_grads(model, reference, rtol=1e-6, atol=1e-8)


def test_compute_dtype_is_validated():
    with pytest.raises(ValueError, match="compute_dtype must be None, torch.bfloat16 or torch.float16"):
        OffloadModel(nn.Sequential(nn.Linear(2, 2)), device="cpu", compute_dtype=torch.float64)


def test_shadow_is_refreshed_once_per_forward():
    model = OffloadModel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)), device="cpu",
                         num_slices=3, compute_dtype=torch.bfloat16)
    storages = [s.storage for s in model._engine.slices]
    model(torch.randn(2, 4)).float().sum().backward()  # backward reloads slice 0 from the same shadow
    assert [st.shadow_refreshes for st in storages] == [1, 1, 1]
    with torch.no_grad():
        model._modules["0"].weight.data.fill_(0.5)  # not visible to version counters
        out = model(torch.randn(2, 4))
    assert [st.shadow_refreshes for st in storages] == [2, 2, 2]
    assert torch.isfinite(out).all()
    loaded = model._engine.slots._slots
    assert any(slot.slice_index is not None for slot in loaded)
    device_weight = storages[0].device_views(storages[0].shadow)[0]
    assert torch.equal(device_weight, torch.full((4, 4), 0.5, dtype=torch.bfloat16))
