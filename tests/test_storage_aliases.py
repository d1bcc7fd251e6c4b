"""Host storage that cannot follow the plain model, refused with what to do: tensors over one memory
(Note: [Parameters over one memory] in ``offload/streams/host_storage.py``), a buffer assigned anew
in forward with another dtype or shape (``_check_reassigned`` in ``offload/walk/engine.py``), and a
batch or instance norm in neither float32 nor the compute dtype (``_set_device_dtypes``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call

from offload import OffloadModel

from .test_mixed_precision import converted

EXACT = {"rtol": 0.0, "atol": 0.0}


# -- tensors over one memory -------------------------------------------------------------------


def embedding_and_head(tie: str) -> nn.Sequential:
    """An embedding whose output head uses its weight: ``"object"`` assigns the same
    ``nn.Parameter`` (a tie), ``"memory"`` a second ``nn.Parameter`` over the same memory."""
    torch.manual_seed(0)
    embedding, head = nn.Embedding(10, 6), nn.Linear(6, 10, bias=False)
    head.weight = embedding.weight if tie == "object" else nn.Parameter(embedding.weight)
    return nn.Sequential(embedding, nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), head)


class TwoNames(nn.Module):
    """Two ``nn.Parameter`` objects over one tensor's memory, in one layer."""

    def __init__(self) -> None:
        super().__init__()
        shared = torch.randn(6, 6)
        self.a = nn.Parameter(shared)
        self.b = nn.Parameter(shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.a) @ self.b.t()


def test_two_parameters_over_one_memory_in_two_slices_are_refused_naming_both():
    model = embedding_and_head("memory")
    addresses = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"parameter '0\.weight' and parameter '4\.weight' are two tensors over the "
                                         r"same memory.*head\.weight = emb\.weight"):
        OffloadModel(model, device="cpu", num_slices=2)
    assert [p.data_ptr() for p in model.parameters()] == addresses  # refused before anything moved


def test_two_parameters_over_one_memory_in_one_layer_are_refused():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"parameter '1\.a' and parameter '1\.b'"):
        OffloadModel(nn.Sequential(nn.Linear(6, 6), TwoNames(), nn.Linear(6, 3)), device="cpu", num_slices=2)


def test_a_parameter_over_part_of_another_and_a_buffer_over_a_parameter_are_refused():
    torch.manual_seed(0)
    part = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    part[1].bias = nn.Parameter(part[0].weight.data[1])  # its second row
    with pytest.raises(ValueError, match=r"parameter '0\.weight' and parameter '1\.bias'"):
        OffloadModel(part, device="cpu", num_slices=1)
    buffered = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    buffered[1].register_buffer("frozen", buffered[0].weight.detach())
    with pytest.raises(ValueError, match=r"parameter '0\.weight' and buffer '1\.frozen'"):
        OffloadModel(buffered, device="cpu", num_slices=2)


def test_parameters_over_one_memory_made_after_wrapping_are_refused_at_the_next_forward():
    torch.manual_seed(0)
    model = OffloadModel(nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)), device="cpu", num_slices=1)
    model[2].weight.data = model[0].weight.data
    with pytest.raises(ValueError, match=r"parameter 'Linear\.weight' and parameter 'Linear\.weight'"):
        model(torch.randn(2, 6))
    model[2].weight.data = model[0].weight.data.clone()  # memory of its own: followed at the next forward
    model(torch.randn(2, 6)).sum().backward()
    assert model[2].weight.grad is not None


def test_buffers_over_one_memory_and_substitutes_are_not_refused():
    # Buffers only read (a mask each layer registers as a view of one tensor) are copies as good as
    # the original; a tensor passed to functional_call keeps its memory (Note: [Tensors substituted
    # for a call]).
    torch.manual_seed(0)
    mask = torch.rand(6) > 0.5
    plain = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6))
    for layer in plain:
        layer.register_buffer("mask", mask[None])
        layer.register_forward_hook(lambda module, args, out: out * module.mask)
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=1)  # laid out together
    x = torch.randn(3, 6)
    torch.testing.assert_close(model(x), plain(x), **EXACT)
    tied = {"1.weight": model[0].weight.detach()}
    torch.testing.assert_close(functional_call(model, tied, (x,)),
                               functional_call(plain, {"1.weight": plain[0].weight.detach()}, (x,)), **EXACT)


def test_the_advised_tie_trains_bit_for_bit():
    plain, model = embedding_and_head("object"), OffloadModel(embedding_and_head("object"), device="cpu", num_slices=2)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5, fused=True) for m in (plain, model)]
    for step in range(3):
        ids = torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(step))
        outputs = [m(ids) for m in (plain, model)]
        torch.testing.assert_close(outputs[1], outputs[0], **EXACT)
        for out, optimizer in zip(outputs, optimizers):
            nn.functional.cross_entropy(out, ids).backward()
            optimizer.step()
            optimizer.zero_grad()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, **EXACT)
    assert model[0].weight is model[4].weight


# -- buffers assigned anew in forward ----------------------------------------------------------


class Level(nn.Module):
    """Assigns its buffer anew in forward, as ``self.level = self.level + 0.25``."""

    def __init__(self, level: torch.Tensor) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("level", level)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.level = self.level + 0.25
        return self.linear(x) * (1 + self.level)


def leveled(level: torch.Tensor) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Level(level), nn.Tanh(), nn.Linear(4, 2))


def test_a_buffer_assigned_anew_with_another_dtype_is_refused_and_left_as_it_was():
    model = OffloadModel(leveled(torch.zeros(4, dtype=torch.long)), device="cpu", num_slices=2)
    with pytest.raises(RuntimeError, match=r"buffer 'level' anew in forward with a tensor of dtype torch\.float32 "
                                           r"\(was torch\.int64\).*Register it with the shape and dtype"):
        model(torch.randn(3, 4))
    assert model[0].level.dtype == model.state_dict()["0.level"].dtype == torch.int64
    assert torch.equal(model[0].level, torch.zeros(4, dtype=torch.long))


def test_the_advice_for_a_new_dtype_registered_between_forwards_is_followed_bit_for_bit():
    plain = leveled(torch.zeros(4))
    model = OffloadModel(leveled(torch.zeros(4, dtype=torch.long)), device="cpu", num_slices=2)
    with pytest.raises(RuntimeError, match="dtype"):
        model(torch.randn(3, 4))
    model[0].level = torch.zeros(4)  # registered anew between forwards: the slice is laid out again
    for step in range(3):
        x = torch.randn(3, 4)
        torch.testing.assert_close(model(x), plain(x), **EXACT)
    torch.testing.assert_close(model[0].level, plain[0].level, **EXACT)
    assert model.state_dict()["0.level"].dtype == torch.float32


def test_a_buffer_assigned_anew_with_another_shape_is_refused_with_the_same_advice():
    class Grows(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("seen", torch.zeros(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen = torch.cat([self.seen, x.detach().sum(0)])
            return x

    model = OffloadModel(nn.Sequential(nn.Linear(4, 4), Grows()), device="cpu", num_slices=2)
    with pytest.raises(RuntimeError, match=r"'seen' anew in forward with a tensor of shape \(5,\) \(was \(1,\)\)"
                                           r".*Register it with the shape and dtype"):
        model(torch.randn(3, 4))
    assert torch.equal(model[1].seen, torch.zeros(1))


def test_a_value_in_the_compute_dtype_assigned_to_a_float32_buffer_is_kept_exactly():
    # Buffers keep their dtype under a compute dtype; half to float32 is exact.
    class Last(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("last", torch.zeros(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.last = x.detach()[0]
            return x

    model = OffloadModel(nn.Sequential(Last(), nn.Linear(4, 2)), device="cpu", num_slices=2,
                         compute_dtype=torch.bfloat16)
    x = torch.randn(3, 4)
    model(x)
    assert model[0].last.dtype == torch.float32
    torch.testing.assert_close(model[0].last, x[0].to(torch.bfloat16).float(), **EXACT)


# -- batch and instance norms under a compute dtype --------------------------------------------


def normed(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


@pytest.mark.parametrize(("dtype", "compute_dtype"), [(torch.float64, torch.bfloat16), (torch.float16, torch.bfloat16),
                                                      (torch.float64, torch.float16)])
def test_a_norm_in_neither_float32_nor_the_compute_dtype_is_refused_when_wrapped(dtype, compute_dtype):
    # One slice: the norm is checked before the slice's masters (a float16 Linear under bfloat16 is
    # refused on its own: tests/test_half_masters_refused.py).
    with pytest.raises(ValueError, match=rf"'weight' of a BatchNorm1d is {dtype}: under compute_dtype="
                                         rf"{compute_dtype}.*model\.float\(\)"):
        OffloadModel(normed(dtype), device="cpu", num_slices=1, compute_dtype=compute_dtype)


def test_a_norm_in_the_compute_dtype_runs_as_before():
    model = OffloadModel(normed(torch.bfloat16), device="cpu", num_slices=2, compute_dtype=torch.bfloat16)
    out = model(torch.randn(5, 6))
    out.float().sum().backward()
    assert out.dtype == model[1].weight.grad.dtype == torch.bfloat16


def test_a_float64_model_with_float32_norms_computes_as_the_converted_model():
    # The advice: float64 masters elsewhere, as a float64 Linear computes under bfloat16.
    plain = normed(torch.float64)
    plain[1].float()
    reference = converted(plain, torch.bfloat16)
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=2, compute_dtype=torch.bfloat16)
    x = torch.randn(5, 6, dtype=torch.float64)
    out, out_ref = model(x), reference(x.to(torch.bfloat16))
    torch.testing.assert_close(out, out_ref, **EXACT)
    out.float().pow(2).sum().backward()
    out_ref.float().pow(2).sum().backward()
    assert model[0].weight.dtype == model[0].weight.grad.dtype == torch.float64
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad.to(p.grad.dtype), **EXACT)
    torch.testing.assert_close(model[1].running_mean, reference[1].running_mean, **EXACT)
