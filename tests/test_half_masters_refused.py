"""A model in one half-precision dtype under a ``compute_dtype`` of the other is refused when wrapped
(Note: [Masters narrower than the compute dtype] in ``offload/streams/dtype_refusals.py``): its
gradients would land in ``.grad`` in the parameter's dtype, where a float16 one overflows to inf above
65504 and flushes tiny ones to 0 (a bfloat16 one rounds), silently. Frozen parameters too; models in
float32, float64 or the compute dtype itself, and parameters that keep their dtype, are not. After
wrapping, a conversion is warned of instead, and a round trip (``model.half().float()``) ends as on the plain
model.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from offload import OffloadModel

from .test_mixed_precision import converted

EXACT = {"rtol": 0.0, "atol": 0.0}
BF16, FP16 = torch.bfloat16, torch.float16
#: (the model's dtype, compute_dtype): each cannot hold the other's values.
CROSSED = [pytest.param(FP16, BF16, id="fp16-model-bf16-compute"),
           pytest.param(BF16, FP16, id="bf16-model-fp16-compute")]


def linears(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).to(dtype)


@pytest.mark.parametrize(("dtype", "compute_dtype"), CROSSED)
@pytest.mark.parametrize("placement", ["ram", "resident", "disk"])
def test_a_model_in_the_other_half_dtype_is_refused_naming_its_parameters(dtype, compute_dtype, placement, tmp_path):
    plain = linears(dtype)
    before = copy.deepcopy(plain)
    options = {"ram": {}, "resident": {"resident_slices": 1}, "disk": {"masters": str(tmp_path)}}[placement]
    with pytest.raises(ValueError, match=rf"parameters 'weight', 'bias' of a Linear are {dtype}, under "
                                         rf"compute_dtype={compute_dtype}: their gradients.*model\.float\(\).*"
                                         rf"compute_dtype={dtype}, the model's own dtype"):
        OffloadModel(plain, device="cpu", num_slices=2, compute_dtype=compute_dtype, **options)
    for p, q in zip(plain.parameters(), before.parameters()):  # refused before anything changed them
        assert p.dtype == dtype
        torch.testing.assert_close(p, q, **EXACT)


@pytest.mark.parametrize(("dtype", "compute_dtype"), CROSSED)
def test_frozen_parameters_are_refused_too(dtype, compute_dtype):
    # A float32 head trains over a frozen base in the other dtype: requires_grad may be switched on later.
    plain = nn.Sequential(nn.Linear(4, 4).to(dtype).requires_grad_(False), nn.Tanh(), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=rf"are {dtype}.*Frozen parameters count too.*convert a frozen base to "
                                         rf"{compute_dtype}"):
        OffloadModel(plain, device="cpu", num_slices=2, compute_dtype=compute_dtype)


def test_the_advice_gives_the_converted_models_gradients_where_float16_ones_overflowed():
    """The hunt's case (a float16 model under bfloat16 whose gradients overflowed to inf), converted
    to float32 as the error says: every gradient is the bfloat16 model's, exactly, and finite."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).half()
    model = OffloadModel(copy.deepcopy(plain).float(), device="cpu", num_slices=2, compute_dtype=BF16)
    reference = converted(plain, BF16)
    x = torch.full((2, 4), 300.0)
    (model(x).float().sum() * 1000).backward()
    (reference(x.to(BF16)).float().sum() * 1000).backward()
    assert max(q.grad.float().abs().max().item() for q in reference.parameters()) > torch.finfo(FP16).max
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, q.grad.float(), **EXACT)


@pytest.mark.parametrize(("dtype", "compute_dtype"), [(torch.float32, BF16), (torch.float64, FP16), (BF16, BF16),
                                                      (FP16, FP16)])
def test_masters_that_hold_the_compute_dtype_are_accepted(dtype, compute_dtype):
    plain = linears(dtype)
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=2, compute_dtype=compute_dtype)
    reference = converted(plain, compute_dtype)
    x = torch.randn(3, 4)
    model(x).float().sum().backward()
    reference(x.to(compute_dtype)).float().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad.dtype == dtype
        torch.testing.assert_close(p.grad, q.grad.to(dtype), **EXACT)


class Counted(nn.Module):
    """A layer with an integer parameter (a step count, never cast) beside a float16 batch norm's kept dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = nn.Parameter(torch.zeros(1, dtype=torch.int64), requires_grad=False)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) + self.steps


def test_parameters_that_keep_their_dtype_do_not_count():
    # Under float16 compute a float16 norm keeps its dtype (no cast, exact gradients); an integer
    # parameter is never cast.
    plain = nn.Sequential(nn.Linear(4, 4), Counted().half())  # .half() converts floating-point tensors only
    model = OffloadModel(plain, device="cpu", num_slices=2, compute_dtype=FP16)
    model(torch.randn(3, 4)).float().sum().backward()
    assert model[1].norm.weight.grad.dtype == FP16


def test_a_conversion_after_wrapping_is_warned_of_and_a_round_trip_ends_as_the_plain_models():
    plain = linears()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=2, compute_dtype=BF16)
    with pytest.warns(UserWarning, match=r"parameters 'weight', 'bias' of a Linear are now torch.float16, converted "
                                         r"after wrapping, under compute_dtype=torch.bfloat16.*model\.float\(\)"):
        model.half()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # back in float32: nothing to warn of
        model.float()
    reference = converted(plain.half().float(), BF16)
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), reference(x.to(BF16)), **EXACT)


def test_offloaded_causal_lm_refuses_too():
    pytest.importorskip("transformers")
    from offload.integrations.causal_lm import OffloadedCausalLM

    from .test_transformers import build

    hf = build("llama", dropout=0.0, layers=1).to(BF16)
    with pytest.raises(ValueError, match=rf"{BF16}, under compute_dtype={FP16}"):
        OffloadedCausalLM(hf, device="cpu", num_slices=2, compute_dtype=FP16)
