"""Bad input gets a clear error that says what to do."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offload import OffloadModel


def test_rejects_a_model_that_is_not_sequential():
    with pytest.raises(TypeError, match="nn.Sequential, or a list of nn.Module"):
        OffloadModel(nn.Linear(2, 2), device="cpu")


def test_rejects_a_sequential_subclass_with_its_own_forward():
    class Custom(nn.Sequential):
        def forward(self, x):
            return super().forward(x) * 2

    with pytest.raises(TypeError, match="overrides nn.Sequential.forward"):
        OffloadModel(Custom(nn.Linear(2, 2)), device="cpu")


@pytest.mark.parametrize("as_slices", [False, True], ids=["sequential", "slices"])
def test_rejects_a_lazy_layer_not_run_yet_and_takes_it_once_run(as_slices):
    layers = [nn.Linear(4, 8), nn.Sequential(nn.ReLU(), nn.LazyLinear(3))]
    with pytest.raises(ValueError, match=r"layer 1's parameter 1\.weight \(LazyLinear\) is not initialized yet.*Run "
                                         "one forward of the unwrapped model"):
        OffloadModel(layers if as_slices else nn.Sequential(*layers), device="cpu", num_slices=2)
    plain = nn.Sequential(*layers)
    x = torch.randn(2, 4)
    expected = plain(x)  # the lazy layer makes its tensors
    model = OffloadModel(layers if as_slices else nn.Sequential(*layers), device="cpu", num_slices=2)
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


def test_rejects_a_list_with_a_non_module():
    with pytest.raises(TypeError, match="slice 1 is a builtin_function_or_method; every slice must be an nn.Module"):
        OffloadModel([nn.Linear(2, 2), torch.relu], device="cpu")


@pytest.mark.parametrize("model", [nn.Sequential(), []])
def test_rejects_empty_models(model):
    with pytest.raises(ValueError, match="no layers|empty"):
        OffloadModel(model, device="cpu")


@pytest.mark.parametrize("name", ["num_slices", "num_microbatches"])
@pytest.mark.parametrize("value", [0, -2])
def test_rejects_counts_below_one(name, value):
    with pytest.raises(ValueError, match=f"{name} must be at least 1"):
        OffloadModel(nn.Sequential(nn.Linear(2, 2)), device="cpu", **{name: value})


@pytest.mark.parametrize("name", ["num_slices", "num_microbatches"])
def test_rejects_non_integer_counts(name):
    with pytest.raises(TypeError, match=f"{name} must be an int"):
        OffloadModel(nn.Sequential(nn.Linear(2, 2)), device="cpu", **{name: 2.5})


def test_cuda_requested_without_cuda_names_the_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA
    with pytest.raises(ValueError, match="device='cuda:1' was requested, but CUDA is not available"):
        OffloadModel(nn.Sequential(nn.Linear(2, 2)), device="cuda:1")


@pytest.mark.parametrize("name", ["device", "offload_device"])
def test_a_device_index_without_an_accelerator_is_a_value_error_saying_to_pass_cpu(monkeypatch, name):
    """torch reads an int as the accelerator's index and, with none, says only that it cannot reach one."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)  # a machine without one
    with pytest.raises(ValueError, match=rf"{name}=0 \(an accelerator's index\) was requested, but this machine has "
                                         rf"no accelerator; pass {name}='cpu'"):
        OffloadModel(nn.Sequential(nn.Linear(2, 2)), **{"device": "cpu", name: 0})


def test_unknown_device_string():
    with pytest.raises(TypeError, match="device must be"):
        OffloadModel(nn.Sequential(nn.Linear(2, 2)), device="gpu0")


def test_keyword_arguments_to_forward_are_refused():
    model = OffloadModel(nn.Sequential(nn.Linear(2, 2)), device="cpu")
    with pytest.raises(TypeError, match=r"keyword argument\(s\) \['mask'\]"):
        model(torch.randn(1, 2), mask=None)


def test_more_than_one_positional_input_is_refused():
    model = OffloadModel(nn.Sequential(nn.Linear(2, 2)), device="cpu")
    with pytest.raises(TypeError, match="exactly one input"):
        model(torch.randn(1, 2), torch.randn(1, 2))


def test_buffers_shared_across_slices_are_refused_with_advice():
    first, last = nn.BatchNorm1d(4), nn.BatchNorm1d(4)
    last.register_buffer("running_mean", first.running_mean)
    with pytest.raises(ValueError, match="buffer 'running_mean' is registered in an earlier slice too; a buffer must sit"):
        OffloadModel(nn.Sequential(first, nn.Linear(4, 4), last), device="cpu", num_slices=3)


def test_a_parameter_tied_across_slices_in_two_dtypes_is_refused():
    """Under a compute dtype a batch norm keeps float32 while other layers compute in half precision:
    one tensor cannot be both on the device."""
    norm, linear = nn.BatchNorm1d(4), nn.Linear(4, 4)
    linear.bias = norm.weight
    with pytest.raises(ValueError, match="compute with it in"):
        OffloadModel(nn.Sequential(norm, nn.Linear(4, 4), linear), device="cpu", num_slices=3,
                     compute_dtype=torch.bfloat16)


def test_moving_the_model_to_a_device_that_does_not_exist_is_refused():
    model = OffloadModel(nn.Sequential(nn.Linear(2, 2)), device="cpu")
    missing = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(RuntimeError, match="could not move its compute device from cpu"):
        model.to(missing)


def test_optimizer_step_between_forward_and_backward_is_detected():
    model = OffloadModel(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)), device="cpu", num_slices=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(3, 2)).sum()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_offload_device_meta_is_refused_with_what_to_pass():
    with pytest.raises(ValueError, match="offload_device='meta' holds no data.*pass offload_device='cpu'"):
        OffloadModel(nn.Sequential(nn.Linear(2, 2)), device="cpu", offload_device="meta")


def test_wrapping_an_offload_model_again_says_it_is_already_wrapped():
    model = OffloadModel(nn.Sequential(nn.Linear(2, 2)), device="cpu")
    with pytest.raises(TypeError, match="already an OffloadModel; train it as it is"):
        OffloadModel(model, device="cpu")


def test_estimate_memory_takes_a_parameter_count_and_refuses_bad_counts():
    from offload import estimate_memory

    # A count is the model cut into num_slices equal slices.
    assert estimate_memory(8_000, num_slices=4, device="cpu") == estimate_memory([2_000] * 4, num_slices=4, device="cpu")
    assert estimate_memory(10, num_slices=4, device="cpu") == estimate_memory([3, 3, 2, 2], num_slices=4, device="cpu")
    for bad in (0, -5):
        with pytest.raises(ValueError, match=f"needs a positive parameter count, got {bad}"):
            estimate_memory(bad)
    with pytest.raises(ValueError, match="layer 0 has -5 parameters; each count must be an int >= 0"):
        estimate_memory([-5, 10])
    with pytest.raises(ValueError, match=r"layer 1 has 2\.5 parameters"):
        estimate_memory([10, 2.5])
    with pytest.raises(TypeError, match="takes an nn.Sequential, a list of each layer's parameter count, or the "
                                        "model's parameter count"):
        estimate_memory("7b")
