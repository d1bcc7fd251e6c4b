"""``.to(device)`` / ``.cuda()`` / ``.cpu()`` on an OffloadModel move its compute device; the host
copies stay on ``offload_device`` (Note: [Moving an OffloadModel] in ``offload/modeling/placement.py``)."""

import copy

import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer
from offload.model import engine_of

from .helpers import CUDA, assert_same_grads

EXACT = dict(rtol=0, atol=0)


def small() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def test_to_the_compute_device_is_a_no_op():
    model = OffloadModel(small(), device="cpu", num_slices=2)
    engine = engine_of(model)
    params = [p.data_ptr() for p in model.parameters()]
    assert model.to("cpu") is model and model.cpu() is model and model.to(torch.device("cpu")) is model
    assert engine_of(model) is engine  # nothing rebuilt
    assert [p.data_ptr() for p in model.parameters()] == params


def test_a_move_changes_the_compute_device_and_keeps_the_host_copies():
    # A model built to compute on "meta" (no data there) moved to the CPU: the only move a machine
    # without a GPU can make. The parameters stay the same objects on the host, with their values.
    plain = small()
    model = OffloadModel(copy.deepcopy(plain), device="meta", num_slices=2)
    params = list(model.parameters())
    old_engine = engine_of(model)
    assert model.to("cpu") is model
    assert model.device == torch.device("cpu") and model.offload_device == torch.device("cpu")
    assert engine_of(model) is not old_engine and engine_of(model).device == torch.device("cpu")
    assert list(model.parameters()) == params and all(p.device.type == "cpu" for p in params)
    x = torch.randn(4, 6)
    torch.testing.assert_close(model(x), plain(x), **EXACT)
    model(x).sum().backward()
    plain(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **EXACT, msg=lambda m: f"{name}: {m}")


def test_a_move_with_a_dtype_converts_the_host_copies():
    plain = small().double()
    model = OffloadModel(small(), device="meta", num_slices=2)
    model.to("cpu", torch.float64)
    assert model.device == torch.device("cpu")
    assert all(p.dtype == torch.float64 and p.device.type == "cpu" for p in model.parameters())
    x = torch.randn(4, 6, dtype=torch.float64)
    torch.testing.assert_close(model(x), plain(x), **EXACT)


def test_a_dtype_change_converts_the_host_copies_in_place():
    model = OffloadModel(small(), device="cpu", num_slices=2)
    engine = engine_of(model)
    model.to(torch.float64)
    assert model.device == torch.device("cpu") and engine_of(model) is engine
    assert all(p.dtype == torch.float64 for p in model.parameters())
    x = torch.randn(2, 6, dtype=torch.float64)
    torch.testing.assert_close(model(x), small().double()(x), **EXACT)


def test_a_device_that_does_not_exist_is_named():
    model = OffloadModel(small(), device="cpu", num_slices=2)
    missing = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    with pytest.raises((RuntimeError, ValueError), match="compute device|CUDA device"):
        model.to(missing)
    assert model.device == torch.device("cpu")
    model(torch.randn(2, 6))  # still works where it was


def train_both(model: OffloadModel, optimizer: OffloadOptimizer, plain: nn.Sequential,
               plain_optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    """``steps`` steps of both pairs on the same batches; the gradients and then the parameters
    compared bit for bit after each."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 6, generator=generator)
        for m, o in ((model, optimizer), (plain, plain_optimizer)):
            m(x).square().mean().backward()
        assert_same_grads(model, plain, **EXACT)
        for o in (optimizer, plain_optimizer):
            o.step()
            o.zero_grad()
        optimizer.synchronize()
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p, q, **EXACT, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("update_in_backward", [False, True], ids=["at_step", "in_backward"])
@pytest.mark.parametrize("optimizer_class, kwargs", [(torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
                                                     (torch.optim.AdamW, dict(lr=1e-2, fused=True))],
                         ids=["sgd", "adamw"])
def test_an_offload_optimizer_built_before_a_move_follows_it_and_trains_as_the_plain_one(
        optimizer_class, kwargs, update_in_backward):
    # Accelerate's prepare(model, optimizer): the optimizer is built first, then the model moved.
    plain = small()
    model = OffloadModel(copy.deepcopy(plain), device="meta", num_slices=2)
    optimizer = OffloadOptimizer(model, optimizer_class, update_in_backward=update_in_backward, **kwargs)
    model.to("cpu")
    assert model.device == torch.device("cpu")
    assert set(engine_of(model).optimizers) == {optimizer}  # its state counts in the new engine's footprint
    train_both(model, optimizer, plain, optimizer_class(plain.parameters(), **kwargs))
    if update_in_backward:  # the new engine's backward started them (its first step() only checks)
        assert optimizer._in_backward.last_started == {0, 1}


def test_an_offload_optimizer_with_state_keeps_it_exact_through_a_move():
    # State loaded before the move (a resumed run, then prepare): it is the host's, and stays.
    plain = small()
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(2)
    for _ in range(2):
        plain(torch.randn(4, 6, generator=generator)).square().mean().backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad()
    model = OffloadModel(copy.deepcopy(plain), device="meta", num_slices=2)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    optimizer.load_state_dict(copy.deepcopy(plain_optimizer.state_dict()))  # not the plain one's tensors
    state = {p: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    model.to("cpu")
    assert optimizer.state.keys() == state.keys()
    for p, s in state.items():
        for key, value in s.items():
            torch.testing.assert_close(optimizer.state[p][key], value, **EXACT)
    train_both(model, optimizer, plain, plain_optimizer)


def test_a_move_under_an_offload_optimizer_with_a_disk_tier_is_refused(tmp_path):
    model = OffloadModel(small(), device="meta", num_slices=2)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, disk_tier=tmp_path)
    engine = engine_of(model)
    with pytest.raises(RuntimeError, match="disk_tier.*build the OffloadOptimizer after moving the model"):
        model.to("cpu")
    assert model.device == torch.device("meta") and engine_of(model) is engine
    optimizer.close()


def test_a_move_with_masters_on_disk_is_refused_with_or_without_an_optimizer(tmp_path):
    model = OffloadModel(small(), device="meta", num_slices=2, compute_dtype=torch.bfloat16, masters=tmp_path)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    with pytest.raises(RuntimeError, match="cannot move its compute from meta to cpu: its masters are on disk"):
        model.to("cpu")
    del optimizer
    with pytest.raises(RuntimeError, match="its masters are on disk"):
        model.to("cpu")
    assert model.device == torch.device("meta")


def test_a_move_to_the_host_under_an_offload_optimizer_that_stepped_warns_and_keeps_the_compute_device():
    # What Lightning's teardown does (.cpu()) after training: the parameters are on the host already.
    model = OffloadModel(small(), device="meta", num_slices=2)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=0.1)
    optimizer.step()
    engine = engine_of(model)
    with pytest.warns(UserWarning, match="keeps computing on meta"):
        model.cpu()
    assert model.device == torch.device("meta") and engine_of(model) is engine
    del optimizer


@CUDA
def test_cuda_moves_the_compute_and_keeps_parameters_pinned_on_the_host():
    plain = small()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=2)
    params = list(model.parameters())
    model.cuda()
    assert model.device == torch.device("cuda", torch.cuda.current_device())
    assert list(model.parameters()) == params
    assert all(p.device.type == "cpu" and p.is_pinned() for p in params)
    x = torch.randn(4, 6)
    out = model(x.cuda())
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), plain(x), rtol=1e-5, atol=1e-6)
    model.to("cpu")
    assert model.device == torch.device("cpu")
    torch.testing.assert_close(model(x), plain(x), **EXACT)


@CUDA
@pytest.mark.parametrize("resident_slices", [0, 1], ids=["streamed", "resident"])
def test_an_offload_optimizer_with_state_follows_a_move_to_cuda_as_one_built_there(resident_slices):
    # The state after two steps on the CPU: the host's stays where it is, a resident slice's goes to
    # the GPU beside its parameters; two more steps equal those of a model and optimizer built on
    # the GPU and loaded with the same weights and state.
    def trained_on_the_cpu() -> tuple[OffloadModel, OffloadOptimizer]:
        model = OffloadModel(small(), device="cpu", num_slices=2, resident_slices=resident_slices)
        optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
        steps(model, optimizer, torch.Generator().manual_seed(1))
        return model, optimizer

    def steps(model: OffloadModel, optimizer: OffloadOptimizer, generator: torch.Generator) -> None:
        for _ in range(2):
            model(torch.randn(4, 6, generator=generator)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        optimizer.synchronize()

    moved, moved_optimizer = trained_on_the_cpu()
    moved.cuda()
    source, source_optimizer = trained_on_the_cpu()
    built = OffloadModel(small(), device="cuda", num_slices=2, resident_slices=resident_slices)
    built.load_state_dict(source.state_dict())
    built_optimizer = OffloadOptimizer(built, torch.optim.AdamW, lr=1e-2, fused=True)
    built_optimizer.load_state_dict(source_optimizer.state_dict())
    for p, q in zip(moved.parameters(), built.parameters()):
        s, t = moved_optimizer.state[p], built_optimizer.state[q]
        assert p.device == q.device and s.keys() == t.keys()
        for key in t:
            assert s[key].device == t[key].device, key
            torch.testing.assert_close(s[key], t[key], **EXACT)
    steps(moved, moved_optimizer, torch.Generator().manual_seed(2))
    steps(built, built_optimizer, torch.Generator().manual_seed(2))
    for (name, p), q in zip(moved.named_parameters(), built.parameters()):
        torch.testing.assert_close(p, q, **EXACT, msg=lambda m: f"{name}: {m}")
