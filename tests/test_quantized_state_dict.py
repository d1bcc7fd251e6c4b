"""``OffloadedCausalLM.state_dict()`` and ``load_state_dict()`` over a bitsandbytes 4-bit or 8-bit
base, and over a ``PeftModel``, against the plain model's.

What the checkpoints of Lightning (``ModelCheckpoint``, ``fit(ckpt_path=...)``) and Accelerate
(``save_state``, ``load_state``) call: the state dict must hold the plain model's keys and values,
and a load must do to the model what it does to the plain one. Note: [Hugging Face names at any
depth] in ``offload/integrations/causal_lm.py``, Note: [Quantized weights] in
``offload/streams/quantized.py`` (rule 7), Note: [PEFT models] in ``offload/integrations/peft.py``
(rule 6).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from .test_int8 import eight_bit
from .test_peft import lora
from .test_qlora import quantized
from .test_transformers import EXACT, batch, build

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
with warnings.catch_warnings():  # its optional CPU kernels ("pip install kernels") are not needed
    warnings.simplefilter("ignore")
    bnb = pytest.importorskip("bitsandbytes")
from offload.integrations.causal_lm import OffloadedCausalLM  # noqa: E402  (needs transformers)


class Holder(nn.Module):
    """A parent, as a LightningModule holds the model: its keys get a prefix."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def base_of(model: nn.Module) -> nn.Module:
    return model.get_base_model() if isinstance(model, peft.PeftModel) else model


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, **EXACT, msg=key)


@pytest.mark.parametrize("adapters", [False, True], ids=["base-alone", "lora"])
@pytest.mark.parametrize("quant_type, double", [("nf4", True), ("fp4", False)])
def test_a_4bit_base_saves_and_loads_as_the_plain_model(adapters, quant_type, double):
    hf = quantized(build("llama", layers=2), quant_type, double)
    model = lora(hf) if adapters else hf
    plain = Holder(base_of(copy.deepcopy(model)))
    offloaded = Holder(OffloadedCausalLM(model, device="cpu", num_slices=3))
    saved = offloaded.state_dict()  # raised a KeyError on "...weight.absmax"
    assert any(key.endswith("weight.quant_state.bitsandbytes__" + quant_type) for key in saved)
    assert_same_state(saved, plain.state_dict())
    # bitsandbytes' Linear4bit loads its weight and leaves the keys below it unexpected: the
    # offloaded model reports them as the plain one does, under the same names.
    plain_keys = plain.load_state_dict(saved, strict=False)
    offloaded_keys = offloaded.load_state_dict(saved, strict=False)
    assert plain_keys.unexpected_keys and offloaded_keys == plain_keys
    for holder in (plain, offloaded):
        with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: \"model\.model\.layers\.0\."):
            holder.load_state_dict(saved)
    assert_same_state(offloaded.state_dict(), plain.state_dict())


def perturbed(hf: nn.Module) -> nn.Module:
    torch.manual_seed(3)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p), alpha=0.1)
    return hf


@pytest.mark.parametrize("threshold", [0.0, 6.0])
def test_a_fresh_8bit_model_loads_a_state_dict_as_the_plain_model(threshold):
    source = OffloadedCausalLM(lora(eight_bit(perturbed(build("llama", dropout=0.0, layers=2)), threshold)),
                               device="cpu", num_slices=3)
    saved = {key: value.clone() for key, value in source.state_dict().items()}
    assert any(key.endswith("q_proj.base_layer.SCB") for key in saved)
    plain = lora(eight_bit(build("llama", dropout=0.0, layers=2), threshold)).eval()
    peft_model = lora(eight_bit(build("llama", dropout=0.0, layers=2), threshold))
    offloaded = OffloadedCausalLM(peft_model, device="cpu", num_slices=3).eval()
    with torch.no_grad():
        before = offloaded(**batch()).logits
    assert str(plain.get_base_model().load_state_dict(saved)) == "<All keys matched successfully>"
    # Raised bitsandbytes' "Loading a quantized checkpoint into non-quantized Linear8bitLt".
    assert str(offloaded.load_state_dict(saved)) == "<All keys matched successfully>"
    assert_same_state(offloaded.state_dict(), plain.get_base_model().state_dict())
    with torch.no_grad():
        want = plain(**batch()).logits
        got = offloaded(**batch()).logits
    torch.testing.assert_close(got, want, **EXACT)
    assert not torch.equal(got, before), "the load changed nothing"


def test_a_scale_of_another_shape_is_a_size_mismatch():
    offloaded = OffloadedCausalLM(lora(eight_bit(build("llama", dropout=0.0, layers=2))), device="cpu",
                                  num_slices=3)
    saved = offloaded.state_dict()
    key = "model.layers.0.mlp.up_proj.base_layer.SCB"
    saved[key] = saved[key][:-1]
    with pytest.raises(RuntimeError, match=rf"size mismatch for {key}: copying a param with shape \(63,\)"):
        offloaded.load_state_dict(saved)


def test_a_peft_models_state_dict_loads_and_the_hf_names_load_into_its_base_model():
    plain = perturbed(lora(build("llama", dropout=0.0, layers=2)))
    offloaded = OffloadedCausalLM(lora(build("llama", dropout=0.0, layers=2)), device="cpu", num_slices=3)
    assert next(iter(offloaded.state_dict())) == "model.embed_tokens.weight"  # the Hugging Face model's names
    assert str(offloaded.load_state_dict(plain.state_dict())) == "<All keys matched successfully>"
    assert_same_state(offloaded.state_dict(), plain.get_base_model().state_dict())
    fresh = lora(build("llama", dropout=0.0, layers=2))
    assert str(fresh.get_base_model().load_state_dict(offloaded.state_dict())) == "<All keys matched successfully>"
    assert_same_state(fresh.state_dict(), plain.state_dict())
