"""A bfloat16 checkpoint loaded slice by slice into a 4-bit offloaded base: ``load_causal_lm(...,
quantization_config=BitsAndBytesConfig(load_in_4bit=True))`` against ``from_pretrained`` with the
same config on the CPU, bit for bit. Note: [Quantizing while loading] in ``offload/loading/four_bit.py``."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import warnings

import pytest
import torch

from .test_transformers import ROOT

transformers = pytest.importorskip("transformers")
with warnings.catch_warnings():  # its optional CPU kernels ("pip install kernels") are not needed
    warnings.simplefilter("ignore")
    bnb = pytest.importorskip("bitsandbytes")
from offload.integrations.transformers import load_causal_lm  # noqa: E402  (needs transformers)

#: Widths that are multiples of bitsandbytes' block (64) and one that is not (96 x 160).
LLAMA = {"vocab_size": 300, "hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "max_position_embeddings": 64,
         "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random tiny Llama saved in bfloat16 as ``save_pretrained`` saves it."""
    path = tmp_path_factory.mktemp("llama_bf16")
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**LLAMA), dtype=torch.bfloat16)
    hf.save_pretrained(path, safe_serialization=True)
    return path


def four_bit(quant_type: str, double: bool):
    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                           bnb_4bit_use_double_quant=double, bnb_4bit_compute_dtype=torch.bfloat16)


@pytest.mark.parametrize("config", [None, four_bit("nf4", True)], ids=["alone", "with quantization_config"])
def test_a_checkpoint_saved_in_4_bits_is_refused_saying_what_to_load(checkpoint, tmp_path, config):
    """Its codes and state (``weight.absmax``, ``quant_map``, ...) have no place in the model built
    here: one line naming the quantisation and what to load, not each stored tensor as unexpected."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=four_bit("nf4", True),
                                                           device_map="cpu")
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError) as raised:
        load_causal_lm(tmp_path, "cpu", quantization_config=config)
    message = str(raised.value)
    assert message.startswith(f"{tmp_path} holds a checkpoint saved quantized (bitsandbytes: ") and "\n" not in message
    assert "load the unquantized checkpoint" in message and "from_pretrained" in message
    assert "absmax" not in message


@pytest.mark.parametrize(("quant_type", "double", "dtype"), [("nf4", True, torch.bfloat16),
                                                             ("fp4", False, torch.bfloat16),
                                                             ("nf4", False, torch.float32)])
def test_load_causal_lm_quantizes_as_from_pretrained(checkpoint, quant_type, double, dtype):
    config = four_bit(quant_type, double)
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=config,
                                                                  dtype=dtype, device_map="cpu")
    model, hf = load_causal_lm(checkpoint, "cpu", dtype=dtype, quantization_config=config, num_slices=3)
    weights = [m.weight for m in hf.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(weights) == 7 * LLAMA["num_hidden_layers"] and type(hf.lm_head) is torch.nn.Linear
    assert all(type(w) is bnb.nn.Params4bit and not w.requires_grad for w in weights)
    # Every tensor bit for bit: the codes, the state (absmax, code table, nested absmax and offset,
    # the packed QuantState), the unquantised rest in ``dtype``.
    expected, got = reference.state_dict(), hf.state_dict()
    assert list(got) == list(expected)
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    for ours, theirs in zip(weights, [m.weight for m in reference.modules() if isinstance(m, bnb.nn.Linear4bit)]):
        assert (ours.quant_state.shape, ours.quant_state.dtype) == (theirs.quant_state.shape, theirs.quant_state.dtype)
    # The same logits through the slices (in training mode: in eval, bitsandbytes repacks the
    # weights for its CPU kernel, and fails on widths not a multiple of its block).
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model.train()({"input_ids": ids})
        torch.testing.assert_close(logits, reference.train()(ids).logits, rtol=0, atol=0)
    assert hf.is_loaded_in_4bit and hf.config.quantization_config is config


def test_laying_a_loaded_4bit_slice_out_again_frees_its_old_host_buffer(checkpoint):
    # The quantisation state's tensors and the buffers come out of the meta device by a swap
    # (host_storage.adopt_meta). Were they views of the host buffer, a later layout (adapters
    # injected, Note: [PEFT models], rule 5) would set their data but leave their view's base on
    # the old buffer: the whole old buffer of every 4-bit slice kept, beside the new one.
    import weakref

    peft = pytest.importorskip("peft")
    model, hf = load_causal_lm(checkpoint, "cpu", dtype=torch.bfloat16, quantization_config=four_bit("nf4", True),
                               num_slices=3)
    slices = model._engine.slices
    old = [weakref.ref(s.storage.flat) for s in slices]
    with warnings.catch_warnings():  # peft asks the model a deprecated transformers question
        warnings.simplefilter("ignore", FutureWarning)
        peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules="all-linear", task_type="CAUSAL_LM"))
    with torch.no_grad():
        model.train()({"input_ids": torch.zeros(1, 4, dtype=torch.long)})
    laid_out_again = [ref() is not s.storage.flat for ref, s in zip(old, slices)]
    assert sum(laid_out_again) >= 2  # every slice with decoder layers (a 4-bit one) got adapters
    gc.collect()
    assert [ref() is not None for ref, again in zip(old, laid_out_again) if again] == [False] * sum(laid_out_again)


@pytest.mark.parametrize("settings", [{"load_in_8bit": True}, {"load_in_4bit": True, "llm_int8_skip_modules": ["o"]},
                                      {"load_in_4bit": True, "bnb_4bit_quant_storage": torch.bfloat16}])
def test_other_quantisations_are_refused(checkpoint, settings):
    with pytest.raises(ValueError, match="BitsAndBytesConfig|from_pretrained"):
        load_causal_lm(checkpoint, "cpu", quantization_config=transformers.BitsAndBytesConfig(**settings))


def test_an_8bit_config_is_refused_in_one_line_that_names_it(checkpoint):
    with pytest.raises(ValueError) as refused:
        load_causal_lm(checkpoint, "cpu", quantization_config=transformers.BitsAndBytesConfig(load_in_8bit=True))
    message = str(refused.value)
    assert "\n" not in message and "got a BitsAndBytesConfig(load_in_8bit=True);" in message
    assert message.endswith("load other quantisations with from_pretrained and wrap the model")


@pytest.mark.parametrize("flags", [[], ["--lora-r", "2", "--forward-only"]], ids=["load", "adapters and a forward"])
def test_bench_qlora_loading_records_the_peak(tmp_path, flags):
    out = tmp_path / "loading.json"
    done = subprocess.run([sys.executable, "benchmarks/bench_qlora_loading.py", "--hidden", "128", "--layers", "2",
                           "--intermediate", "256", "--vocab", "300", "--num-slices", "2", "--dir", str(tmp_path),
                           "--skip-from-pretrained", "--json", str(out), *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["forward_only"] == bool(flags)
    result = record["results"]["load_causal_lm"]
    assert 0 < result["quantised_bytes"] < result["bf16_bytes"]
    assert result["peak_rss_growth"] > 0 and result["largest_slice_bf16_bytes"] > 0
