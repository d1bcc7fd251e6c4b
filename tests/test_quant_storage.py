"""4-bit codes stored in a floating-point dtype (bitsandbytes' ``quant_storage``, what
``BitsAndBytesConfig(bnb_4bit_quant_storage=torch.bfloat16)`` sets for FSDP-QLoRA) under a
``compute_dtype`` of another dtype.

The codes are bytes whatever tensor holds them: the same weights quantized into uint8 storage and into
bfloat16, float16 or float32 storage hold the same bytes, and the unwrapped models give the same
logits. Offloaded, the float-stored codes must travel as stored, as the uint8 ones do, not be cast
like float weights: the logits and the adapters' gradients must be the uint8-stored model's, bit for
bit, and ``estimate_memory`` must count the slots as ``memory_footprint()`` does. Note: [Quantized
weights] in ``offload/streams/quantized.py``; the test is ``keeping_their_dtype`` in
``offload/streams/host_storage.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from offload import OffloadModel, estimate_memory
from offload.model import engine_of

from .helpers import DEVICES
from .test_peft import labels_of, lora, offloaded_step
from .test_transformers import EXACT, batch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
with warnings.catch_warnings():  # its optional CPU kernels ("pip install kernels") are not needed
    warnings.simplefilter("ignore")
    bnb = pytest.importorskip("bitsandbytes")
from offload.integrations.transformers import causal_lm_sequential  # noqa: E402  (needs transformers)

#: (codes stored in, compute_dtype): each pair converts the other way round or changes the width.
PAIRS = [pytest.param(torch.bfloat16, torch.float16, id="bf16-in-fp16"),
         pytest.param(torch.float16, torch.bfloat16, id="fp16-in-bf16"),
         pytest.param(torch.float32, torch.bfloat16, id="fp32-in-bf16")]


def llama_64() -> torch.nn.Module:
    """A tiny Llama whose widths are multiples of bitsandbytes' block size (64), as its CPU kernels
    need."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(config)


def quantized(hf: torch.nn.Module, storage: torch.dtype) -> torch.nn.Module:
    """``hf`` with every ``nn.Linear`` but the head an NF4 ``Linear4bit`` (double quantisation)
    whose codes are stored in ``storage``, quantized on the CPU; the same codes whatever ``storage``."""
    for module in list(hf.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not torch.nn.Linear or name == "lm_head":
                continue
            layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=torch.float32, compress_statistics=True, quant_type="nf4",
                                      quant_storage=storage)
            layer.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, compress_statistics=True,
                                             quant_type="nf4", quant_storage=storage, module=layer)
            setattr(module, name, layer.to("cpu"))
    return hf


def offloaded_run(peft_model: torch.nn.Module, compute_dtype: torch.dtype, device: str
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits and the adapters' gradients of one step of ``peft_model`` offloaded in 3 slices."""
    model = OffloadModel(causal_lm_sequential(peft_model), device=device, num_slices=3, compute_dtype=compute_dtype)
    inputs = batch(device)
    logits, _ = offloaded_step(peft_model.get_base_model(), model, inputs, labels_of(inputs), seed=0)
    return logits, {name: p.grad for name, p in peft_model.named_parameters() if p.requires_grad}


def assert_same_runs(stored_in_uint8: torch.nn.Module, stored_in_float: torch.nn.Module,
                     compute_dtype: torch.dtype, device: str = "cpu") -> None:
    """The two models, the same codes stored two ways, give the same logits and adapter gradients
    offloaded under ``compute_dtype``, bit for bit."""
    want_logits, want_grads = offloaded_run(stored_in_uint8, compute_dtype, device)
    got_logits, got_grads = offloaded_run(stored_in_float, compute_dtype, device)
    assert got_logits.dtype == compute_dtype
    torch.testing.assert_close(got_logits, want_logits, **EXACT)
    assert got_grads.keys() == want_grads.keys() and got_grads
    for name, grad in got_grads.items():
        torch.testing.assert_close(grad, want_grads[name], **EXACT, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("storage", "compute_dtype"), PAIRS)
def test_float_stored_codes_compute_as_uint8_stored_ones(storage, compute_dtype, device):
    stored_in_uint8 = lora(quantized(llama_64(), torch.uint8), lora_dropout=0.0)
    stored_in_float = lora(quantized(llama_64(), storage), lora_dropout=0.0)
    weights = [m.weight for m in stored_in_float.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert weights and all(w.dtype == storage for w in weights)
    codes = [m.weight.view(torch.uint8) for m in stored_in_float.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert_same_runs(stored_in_uint8, stored_in_float, compute_dtype, device)
    # The host copies still hold the codes as quantized: nothing was cast in place.
    for w, before in zip(weights, codes):
        assert w.dtype == storage
        torch.testing.assert_close(w.view(torch.uint8), before, **EXACT)


def load_4bit(path, storage: torch.dtype) -> torch.nn.Module:
    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                             bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=storage)
    return transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=torch.float32,
                                                             device_map="cpu").train()


@pytest.mark.parametrize(("storage", "compute_dtype"), PAIRS)
def test_a_model_loaded_with_a_float_quant_storage(storage, compute_dtype, tmp_path):
    # The FSDP-QLoRA setting as users write it, from a bfloat16 checkpoint.
    llama_64().to(torch.bfloat16).save_pretrained(tmp_path)
    stored_in_uint8 = lora(load_4bit(tmp_path, torch.uint8), lora_dropout=0.0)
    stored_in_float = lora(load_4bit(tmp_path, storage), lora_dropout=0.0)
    assert_same_runs(stored_in_uint8, stored_in_float, compute_dtype)


def placed(storage: torch.dtype, compute_dtype: torch.dtype) -> tuple:
    """What ``estimate_memory`` predicts and what ``memory_footprint()`` and the loads then show, for
    the model with its codes stored in ``storage``."""
    sequential = causal_lm_sequential(lora(quantized(llama_64(), storage), lora_dropout=0.0))
    plan = estimate_memory(sequential, num_slices=3, device="cpu", compute_dtype=compute_dtype)
    model = OffloadModel(sequential, device="cpu", num_slices=3, compute_dtype=compute_dtype)
    footprint = model.memory_footprint()
    loads = [s.storage.load_nbytes for s in engine_of(model).slices]
    return plan.device_slots, plan.host_categories(), footprint.device_slots, footprint.host_categories(), loads


@pytest.mark.parametrize(("storage", "compute_dtype"), PAIRS)
def test_float_stored_codes_take_the_bytes_of_uint8_stored_ones(storage, compute_dtype):
    # The codes travel as stored: the same bytes in the host buffers, the shadows, the slots and
    # each load, predicted as they come.
    plan_slots, plan_host, slots, host, loads = placed(storage, compute_dtype)
    assert (slots, host, loads) == placed(torch.uint8, compute_dtype)[2:]
    assert plan_slots == slots
    for category in ("masters", "shadows"):
        assert plan_host[category] == host[category], category
