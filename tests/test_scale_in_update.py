"""``OffloadOptimizer(scale_in_update=True)``: ``offload.clip_grad_norm_`` hands its scaling of each
streamed slice's host gradients to the update worker, before the slice's update, and the training
is the plain model's clipped by ``torch.nn.utils.clip_grad_norm_``, bit for bit (Note: [Scaling in
the update] in ``offload/optimizing/deferred_scaling.py``)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import offload
from offload import OffloadModel, OffloadOptimizer, clipping
from offload.model import engine_of

from .helpers import DEVICES, SteppedWherePlaced, clip_where_placed
from .test_backward_norms import batch, network

EXACT = {"rtol": 0, "atol": 0}
MAX_NORM = 0.05


@pytest.fixture
def scaled_at_clip(monkeypatch):
    """The parameters each ``clip_grad_norm_`` scaled on its calling thread (PyTorch's scaling)."""
    counts: list[int] = []
    original = clipping.clip_grads_with_norm_

    def counting(parameters, *args, **kwargs):
        assert threading.current_thread() is threading.main_thread()
        counts.append(len(parameters))
        return original(parameters, *args, **kwargs)

    monkeypatch.setattr(clipping, "clip_grads_with_norm_", counting)
    return counts


def _twins(device: str = "cpu", extra: nn.Parameter | None = None, model_options: dict | None = None, **options):
    plain = network()
    model = OffloadModel(copy.deepcopy(plain), device=device, num_slices=3, **(model_options or {}))
    plain.to(device)
    params = [*model.parameters(), *([extra] if extra is not None else [])]
    plain_params = [*plain.parameters(), *([nn.Parameter(extra.detach().to(device, copy=True))] if extra is not None else [])]
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, params, lr=1e-2, fused=True, scale_in_update=True,
                                 **options)
    if device == "cpu":
        return plain, torch.optim.AdamW(plain_params, lr=1e-2, fused=True), model, optimizer
    return plain, SteppedWherePlaced(plain_params, params, torch.optim.AdamW, lr=1e-2, fused=True), model, optimizer


def _backward(plain: nn.Module, model: OffloadModel, step: int, device: str, extra=None, plain_extra=None) -> None:
    for m, e in ((plain, plain_extra), (model, extra)):
        loss = m(batch(step, device)).float().pow(2).mean()
        (loss + (e.pow(2).sum() if e is not None else 0)).backward()


def _assert_same(plain_params, params) -> None:
    for number, (a, b) in enumerate(zip(plain_params, params)):
        torch.testing.assert_close(b, a.cpu() if b.device.type == "cpu" else a, **EXACT, msg=lambda m: f"#{number}: {m}")


def _clip_both(plain_opt, optimizer, max_norm: float = MAX_NORM) -> None:
    plain_params = [p for g in plain_opt.param_groups for p in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    expected = clip_where_placed(plain_params, params, max_norm)
    # With a resident slice on a GPU both norms are on the device (its gradients come first).
    torch.testing.assert_close(offload.clip_grad_norm_(params, max_norm), expected, **EXACT)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norms_in_backward", [True, False])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_clipped_training_is_the_plain_models_and_no_gradient_is_scaled_at_the_clip(device, norms_in_backward,
                                                                                    set_to_none, scaled_at_clip):
    plain, plain_opt, model, optimizer = _twins(device, norms_in_backward=norms_in_backward)
    for step in range(4):
        _backward(plain, model, step, device)
        _clip_both(plain_opt, optimizer)
        for opt in (plain_opt, optimizer):
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
    optimizer.synchronize()
    _assert_same(plain.parameters(), model.parameters())
    assert scaled_at_clip == []  # every gradient was a streamed slice's: all scaled on the worker


def _offloaded_twins(device: str, **model_options):
    """The same model offloaded twice, clipping's scaling at the clip and in the update."""
    models, optimizers = [], []
    for scale_in_update in (False, True):
        models.append(OffloadModel(network(), device=device, num_slices=3, **model_options))
        optimizers.append(OffloadOptimizer(models[-1], torch.optim.AdamW, lr=1e-2, fused=True,
                                           scale_in_update=scale_in_update))
    return models, optimizers


@pytest.mark.parametrize("device", DEVICES)
def test_under_a_compute_dtype_outputs_and_masters_are_the_scaling_at_the_clips(device):
    # Against the same model clipped without the option (itself PyTorch's, tests/test_clipping.py):
    # the forward reads the shadows the updates wrote after the worker's scaling.
    models, optimizers = _offloaded_twins(device, compute_dtype=torch.bfloat16)
    for step in range(4):
        outs = [m(batch(step, device).to(torch.bfloat16)) for m in models]
        torch.testing.assert_close(outs[1], outs[0], **EXACT)
        for out in outs:
            out.float().pow(2).mean().backward()
        norms = [offload.clip_grad_norm_(m.parameters(), MAX_NORM) for m in models]
        torch.testing.assert_close(norms[1], norms[0], **EXACT)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    _assert_same(models[0].parameters(), models[1].parameters())


def test_gradients_read_through_the_model_between_the_clip_and_step_are_scaled():
    plain, plain_opt, model, optimizer = _twins()
    for step in range(2):
        _backward(plain, model, step, "cpu")
        _clip_both(plain_opt, optimizer)
        for (name, a), b in zip(plain.named_parameters(), model.parameters()):  # the model waits for the scaling
            torch.testing.assert_close(b.grad, a.grad, **EXACT, msg=lambda m: f"{name}: {m}")
        for opt in (plain_opt, optimizer):
            opt.step()
            opt.zero_grad()
    optimizer.synchronize()
    _assert_same(plain.parameters(), model.parameters())


def test_a_second_clip_reads_what_the_first_ones_scaling_wrote():
    plain, plain_opt, model, optimizer = _twins()
    for step in range(2):
        _backward(plain, model, step, "cpu")
        _clip_both(plain_opt, optimizer)  # by parameter lists: nothing waits through the model
        _clip_both(plain_opt, optimizer, max_norm=MAX_NORM / 3)
        for opt in (plain_opt, optimizer):
            opt.step()
            opt.zero_grad()
    optimizer.synchronize()
    _assert_same(plain.parameters(), model.parameters())


def test_a_step_that_never_comes_leaves_the_next_forward_exact_and_the_shadows_cast_anew():
    # A GradScaler that found infinities skips step(): the scaling stays pending until the next
    # forward loads the slice. It is no update: the shadows are cast from the masters again (here
    # written between the steps through a reference, which PyTorch does not see), as without it.
    models, optimizers = _offloaded_twins("cpu", compute_dtype=torch.bfloat16)
    firsts = [next(m.parameters()) for m in models]
    for step in range(4):
        outs = [m(batch(step, "cpu").to(torch.bfloat16)) for m in models]
        torch.testing.assert_close(outs[1], outs[0], **EXACT)
        for model, optimizer, out, first in zip(models, optimizers, outs, firsts):
            out.float().pow(2).mean().backward()
            offload.clip_grad_norm_(model.parameters(), MAX_NORM)
            if step % 2:
                optimizer.step()
                optimizer.synchronize()  # before writing what the update writes
            optimizer.zero_grad()
            first.data.mul_(0.5)  # without a step, while the scaling may still run: it writes gradients only
    _assert_same(models[0].parameters(), models[1].parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_resident_slices_device_gradients_and_parameters_outside_the_model_are_scaled_at_once(device, scaled_at_clip):
    # On a GPU the total norm is on the device (the resident slice's gradients come first): the
    # streamed slices' scaling is still handed over, by PyTorch's coefficient copied to the host.
    extra = nn.Parameter(torch.randn(5, generator=torch.Generator().manual_seed(3)))
    plain, plain_opt, model, optimizer = _twins(device, extra=extra, model_options={"resident_slices": 1})
    plain_extra = plain_opt.param_groups[0]["params"][-1]
    for step in range(3):
        _backward(plain, model, step, device, extra.to(device) if device != "cpu" else extra, plain_extra)
        _clip_both(plain_opt, optimizer)
        for opt in (plain_opt, optimizer):
            opt.step()
            opt.zero_grad()
    optimizer.synchronize()
    _assert_same([*plain.parameters(), plain_extra], [*model.parameters(), extra])
    resident = len(engine_of(model).slices[0].storage.params)
    assert resident > 0 and scaled_at_clip == [resident + 1] * 3


def test_masters_on_disk_are_scaled_at_once_and_exact(tmp_path, scaled_at_clip):
    models, optimizers = [], []
    for scale_in_update in (False, True):
        models.append(OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=torch.bfloat16,
                                   masters=offload.DiskTier(tmp_path / str(scale_in_update))))
        optimizers.append(OffloadOptimizer(models[-1], torch.optim.AdamW, lr=1e-2, fused=True,
                                           scale_in_update=scale_in_update))
    for step in range(3):
        for model, optimizer in zip(models, optimizers):
            model(batch(step, "cpu").to(torch.bfloat16)).float().pow(2).mean().backward()
            offload.clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizer.step()
            optimizer.zero_grad()
    for optimizer in optimizers:
        optimizer.synchronize()
    _assert_same(models[0].parameters(), models[1].parameters())
    assert scaled_at_clip == [len(list(network().parameters()))] * 6  # both models', at each clip


def test_a_parameter_listed_twice_is_scaled_twice_as_pytorch_does(scaled_at_clip):
    plain, plain_opt, model, optimizer = _twins()
    _backward(plain, model, 0, "cpu")
    plain_params, params = list(plain.parameters()), list(model.parameters())
    expected = torch.nn.utils.clip_grad_norm_(plain_params + plain_params[:2], MAX_NORM)
    torch.testing.assert_close(offload.clip_grad_norm_(params + params[:2], MAX_NORM), expected, **EXACT)
    for a, b in zip(plain_params, params):
        torch.testing.assert_close(b.grad, a.grad, **EXACT)
    assert scaled_at_clip == [len(params) + 2]


def test_a_gradient_that_is_not_contiguous_is_scaled_at_the_clip_and_an_expanded_one_raises_there(scaled_at_clip):
    plain, plain_opt, model, optimizer = _twins()
    _backward(plain, model, 0, "cpu")
    for net in (plain, model):
        weight = next(iter(net.parameters()))
        weight.grad = weight.grad.t().contiguous().t()  # the same values, transposed strides
    _clip_both(plain_opt, optimizer)
    for a, b in zip(plain.parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, **EXACT)
    assert scaled_at_clip == [1]
    for opt in (plain_opt, optimizer):
        opt.step()
        opt.zero_grad()
    optimizer.synchronize()
    _assert_same(plain.parameters(), model.parameters())
    # An expanded gradient: PyTorch's product raises on it, at the clip, before anything is scaled.
    _backward(plain, model, 1, "cpu")
    weight = next(iter(model.parameters()))
    weight.grad = torch.ones(1, 1).expand_as(weight)
    with pytest.raises(RuntimeError, match="single memory location"):
        offload.clip_grad_norm_(model.parameters(), MAX_NORM)


def test_an_optimizer_a_newer_one_replaced_scales_at_once(scaled_at_clip):
    plain, plain_opt, model, optimizer = _twins()
    newer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    _backward(plain, model, 0, "cpu")
    _clip_both(plain_opt, optimizer)
    assert scaled_at_clip == [len(list(plain.parameters()))]
    with pytest.raises(RuntimeError, match="newer OffloadOptimizer"):
        optimizer.step()
    del newer


def test_bad_arguments():
    model = OffloadModel(network(), device="cpu", num_slices=2)
    with pytest.raises(TypeError, match="scale_in_update must be True or False"):
        OffloadOptimizer(model, torch.optim.AdamW, scale_in_update=1)
    with pytest.raises(ValueError, match="scale_in_update is for clipping"):
        OffloadOptimizer(model, torch.optim.AdamW, scale_in_update=True, update_in_backward=True)


def test_foreach_true_is_pytorchs_own_path(scaled_at_clip):
    # Its result (or its error, where the device has no foreach kernels) is PyTorch's, at the clip.
    plain, plain_opt, model, optimizer = _twins()
    _backward(plain, model, 0, "cpu")
    try:
        expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), MAX_NORM, foreach=True)
    except RuntimeError as error:
        with pytest.raises(RuntimeError, match="foreach=True was passed"):
            offload.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=True)
        assert "foreach=True was passed" in str(error)
        return
    torch.testing.assert_close(offload.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=True), expected, **EXACT)
    for a, b in zip(plain.parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, **EXACT)
    assert scaled_at_clip == [len(list(plain.parameters()))]


def test_a_clip_of_one_model_does_not_wait_for_anothers_scaling(monkeypatch):
    from offload.optimizing import deferred_scaling

    others = [_twins() for _ in range(2)]
    for plain, _, model, _ in others:
        _backward(plain, model, 0, "cpu")
    held_grads = {id(p.grad) for p in others[1][2].parameters()}
    release = threading.Event()
    real = deferred_scaling._scale

    def held(scaling, index):
        if any(id(g) in held_grads for g in scaling._owed.values()):
            release.wait(30)
        real(scaling, index)

    monkeypatch.setattr(deferred_scaling, "_scale", held)
    watchdog = threading.Timer(5.0, release.set)  # a clip that waited would see it set
    watchdog.start()
    try:
        _clip_both(others[1][1], others[1][3])
        for index in range(3):  # the second model's scaling, submitted now, is held on its worker
            engine_of(others[1][2]).updates.event(index)
        _clip_both(others[0][1], others[0][3])  # the first model's clip goes on meanwhile
        assert not release.is_set()
    finally:
        release.set()
        watchdog.cancel()
    for plain, plain_opt, model, optimizer in others:
        for opt in (plain_opt, optimizer):
            opt.step()
        optimizer.synchronize()
        _assert_same(plain.parameters(), model.parameters())


# The product in the one-pass kernel: each streamed slice's update multiplies its gradients by the
# clip's coefficient as it reads them, unless something needed them first.

@pytest.fixture(scope="module")
def kernel():
    from offload.kernels import build

    module = build.host_kernel(wait=True)
    if module is None:
        pytest.fail(f"the one-pass kernel did not build here: {build.unavailable_reason()}")
    return module


@pytest.fixture
def how_scaled(monkeypatch):
    """How the clip's products ran: ``kernel`` (a one-pass call multiplied), ``alone`` (a slice's
    scaling ran by itself on the worker)."""
    from offload.kernels import one_pass
    from offload.optimizing import deferred_scaling

    seen = {"kernel": 0, "alone": 0}
    real_pass, real_scale = one_pass.one_pass, deferred_scaling._scale

    def passing(kernel, op, lists, shadows, options, clip=None):
        seen["kernel"] += clip is not None
        real_pass(kernel, op, lists, shadows, options, clip)

    def scaling(owed, index):
        seen["alone"] += 1
        real_scale(owed, index)

    monkeypatch.setattr(one_pass, "one_pass", passing)
    monkeypatch.setattr(deferred_scaling, "_scale", scaling)
    return seen


def _twins_under_bf16(optimizer_class, compute_dtype=torch.bfloat16, **options):
    """The same model under a compute dtype (bfloat16), scaled at the clip and in the update."""
    models = [OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=compute_dtype) for _ in range(2)]
    optimizers = [OffloadOptimizer(m, optimizer_class, scale_in_update=s, **options)
                  for m, s in zip(models, (False, True))]
    return models, optimizers


def _step_twins(models, optimizers, step: int, params=None, between=None) -> None:
    dtype = next(models[0].parameters()).dtype if models[0].compute_dtype is None else models[0].compute_dtype
    outs = [m(batch(step, "cpu").to(dtype)) for m in models]
    torch.testing.assert_close(outs[1], outs[0], **EXACT)
    for m, o, out in zip(models, optimizers, outs):
        out.float().pow(2).mean().backward()
        chosen = list(m.parameters()) if params is None else [list(m.parameters())[k] for k in params]
        offload.clip_grad_norm_(chosen, MAX_NORM)
        if between is not None:
            between(m)
        o.step()
    for o in optimizers:
        o.synchronize()
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(b.grad, a.grad, **EXACT)  # stored as the clip left them
    for o in optimizers:
        o.zero_grad()


@pytest.mark.parametrize("cls,options,in_kernel", [
    pytest.param(torch.optim.AdamW, {"lr": 1e-2, "fused": True, "weight_decay": 0.1}, True, id="AdamW-fused"),
    # float32 throughout: no shadow to write, the kernel multiplies the gradients all the same.
    pytest.param(torch.optim.AdamW, {"lr": 1e-2, "fused": True, "compute_dtype": None}, True, id="AdamW-fused-fp32"),
    pytest.param(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "fused": True}, True, id="SGD-fused"),
    pytest.param(torch.optim.AdamW, {"lr": 1e-2, "foreach": True}, False, id="AdamW-foreach"),
])
@pytest.mark.filterwarnings("ignore:AdamW is stepping")
def test_the_one_pass_kernel_multiplies_the_gradients_as_it_reads_them(kernel, how_scaled, cls, options, in_kernel):
    models, optimizers = _twins_under_bf16(cls, **options)
    for step in range(3):
        _step_twins(models, optimizers, step)
    _assert_same(models[0].parameters(), models[1].parameters())
    # Three streamed slices a step; a per-tensor optimizer's update scales them first, itself.
    assert how_scaled == {"kernel": 9 if in_kernel else 0, "alone": 0}


def test_gradients_read_before_the_update_are_scaled_alone_and_not_again_by_it(kernel, how_scaled):
    models, optimizers = _twins_under_bf16(torch.optim.AdamW, lr=1e-2, fused=True)
    read = lambda model: [p.grad.sum() for p in model.parameters()]  # noqa: E731 (through the model: it waits)
    _step_twins(models, optimizers, 0, between=read)
    assert how_scaled == {"kernel": 0, "alone": 3}
    _step_twins(models, optimizers, 1)
    _assert_same(models[0].parameters(), models[1].parameters())
    assert how_scaled == {"kernel": 3, "alone": 3}


def test_a_clip_of_some_of_a_slices_parameters_scales_those_only(kernel, how_scaled):
    # The first layer's weight and the last layer's bias: their slices' calls mix gradients the
    # clip scaled with others it did not, which the update multiplies first, on their own.
    models, optimizers = _twins_under_bf16(torch.optim.AdamW, lr=1e-2, fused=True)
    last = len(list(network().parameters())) - 1
    for step in range(2):
        _step_twins(models, optimizers, step, params=[0, last])
    _assert_same(models[0].parameters(), models[1].parameters())
    assert how_scaled == {"kernel": 0, "alone": 0}


def test_a_skipped_step_or_another_operation_reads_the_owed_gradients_scaled(kernel):
    from offload.kernels import OnePassUpdate
    from offload.kernels.scaling import OwedScaling

    generator = torch.Generator().manual_seed(0)
    make = lambda: [torch.randn(40, generator=generator) for _ in range(2)]  # noqa: E731
    params, grads, avgs, sqs = make(), make(), make(), [t.abs() for t in make()]
    coefficient = torch.tensor(0.37)
    expected = [g * coefficient for g in grads]
    before = [t.clone() for t in (*params, *avgs, *sqs)]
    shadows = {p.data_ptr(): torch.empty(40, dtype=torch.bfloat16) for p in params}
    with OnePassUpdate(kernel, shadows, OwedScaling(grads, coefficient)):
        # GradScaler found an inf: PyTorch's kernel skips the step; the clip's product stands.
        torch._fused_adamw_(params, grads, avgs, sqs, [], [torch.tensor(1.0)] * 2, lr=0.1, beta1=0.9, beta2=0.99,
                            weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
                            found_inf=torch.tensor(1.0))
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))
    assert all(torch.equal(a, b) for a, b in zip((*params, *avgs, *sqs), before))
    grads = make()
    unread, expected = grads[0].clone(), grads[1] * coefficient
    with OnePassUpdate(kernel, shadows, OwedScaling(grads, coefficient)):
        view = grads[1][5:9].clone()  # a view's read scales the whole gradient first, once
        total = grads[1].sum()
        like = torch.empty_like(grads[0])  # its size only: it stays owed
    torch.testing.assert_close(view, expected[5:9], **EXACT)
    torch.testing.assert_close(total, expected.sum(), **EXACT)
    assert like.shape == unread.shape and torch.equal(grads[0], unread)  # never read: left to the update


def test_a_gradient_replaced_after_the_clip_is_scaled_by_the_update_all_the_same(kernel, how_scaled):
    # PyTorch's clip scaled the tensor it found; a gradient set after it is stepped as it is, and
    # the one the clip found, which the step no longer reads, is scaled by the update all the same.
    models, optimizers = _twins_under_bf16(torch.optim.AdamW, lr=1e-2, fused=True)
    held = [list(m.parameters()) for m in models]  # references taken before: reading them does not wait
    found = []

    def replace(model):
        params = held[models.index(model)]
        found.append(params[0].grad)
        params[0].grad = torch.full_like(params[0].grad, 0.01)

    _step_twins(models, optimizers, 0, between=replace)
    torch.testing.assert_close(found[1], found[0], **EXACT)
    assert not torch.equal(found[1], torch.full_like(found[1], 0.01))
    _assert_same(models[0].parameters(), models[1].parameters())
    assert how_scaled == {"kernel": 2, "alone": 0}  # the first slice's call mixes the two kinds


def test_a_gradient_tensor_two_parameters_share_is_scaled_at_the_clip_once_for_each(kernel, scaled_at_clip):
    models, optimizers = _twins_under_bf16(torch.optim.AdamW, lr=1e-2, fused=True)
    for m in models:
        m(batch(0, "cpu").to(torch.bfloat16)).float().pow(2).mean().backward()
        first, second = [p for p in m.parameters() if p.shape == (32, 32)][:2]
        second.grad = first.grad  # one tensor: PyTorch's clip multiplies it twice, and both step with that
    for m in models:
        offload.clip_grad_norm_(m.parameters(), MAX_NORM)
    for o in optimizers:
        o.step()
        o.synchronize()
    _assert_same(models[0].parameters(), models[1].parameters())
    assert scaled_at_clip[1] == 2  # the second model's clip: the shared tensor, once for each parameter


def test_a_scaling_claimed_by_an_update_that_could_not_be_submitted_stays_owed(kernel, monkeypatch):
    from offload.optimizing.stepping import SliceUpdates

    models, optimizers = _twins_under_bf16(torch.optim.AdamW, lr=1e-2, fused=True)
    real, calls = SliceUpdates._submit, []

    def failing_once(self, index, work, waits=()):
        calls.append(index)
        if len(calls) == 1:
            raise RuntimeError("no room for the update")
        return real(self, index, work, waits)

    for m in models:
        m(batch(0, "cpu").to(torch.bfloat16)).float().pow(2).mean().backward()
        offload.clip_grad_norm_(m.parameters(), MAX_NORM)
    optimizers[0].step()
    monkeypatch.setattr(SliceUpdates, "_submit", failing_once)
    with pytest.raises(RuntimeError, match="no room"):
        optimizers[1].step()
    monkeypatch.setattr(SliceUpdates, "_submit", real)
    for a, b in zip(*(m.parameters() for m in models)):  # through the model: the owed scaling runs first
        torch.testing.assert_close(b.grad, a.grad, **EXACT)


def test_an_operation_on_tensors_outside_the_owed_gradients_memory_checks_none_of_them(monkeypatch):
    from offload.kernels import scaling

    grads = [torch.randn(8) for _ in range(50)]
    owed = scaling.OwedScaling(grads, torch.tensor(0.5))
    checked = []
    real = scaling._overlap
    monkeypatch.setattr(scaling, "_overlap", lambda *args: checked.append(1) or real(*args))
    owed.apply([torch.tensor(float(k)) for k in range(200)])  # an update's step counts, say
    assert checked == []
    owed.apply([grads[3][2:4]])
    assert len(checked) == 50 and owed.owes(grads[4]) and not owed.owes(grads[3])
