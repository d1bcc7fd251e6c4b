"""The planner's device activations for LoRA on a bfloat16 device copy against a real step's
working set, measured as ``tests/test_planning.py`` measures the presets' (malloc's count on a
CPU "device"): a frozen base and its adapter read one input, whose two gradients backward sums
(Note: [Gradients summed in backward] in ``offload/planning/shapes.py``)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from offload import OffloadModel, OffloadOptimizer, estimate_memory
from offload.planning.shapes import profile_layers
from tests.test_planning import _MallInfo, _PeakAllocated

#: A Llama whose decoder's largest activation (the MLP's, before ``down_proj``) is twice its
#: hidden state: the input of the sum.
LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256,
         "tie_word_embeddings": False}


def test_a_lora_step_on_a_bfloat16_device_copy_is_the_working_set_the_estimate_counts():
    """Four slices (embedding, two decoders, head), batch 8 x 128, the loss in chunks: the
    estimate's activations and one slice's gradients against the peak beyond the steady state.
    Counted as one gradient of the largest saved tensor, the step took 16 % more."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("needs glibc's mallinfo2 (glibc 2.33 or later) to read the bytes malloc handed out")
    libc.mallinfo2.restype = _MallInfo
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from offload.integrations.transformers import causal_lm_sequential

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**LLAMA))
    hf = peft.get_peft_model(hf, peft.LoraConfig(r=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    layers = causal_lm_sequential(hf, loss_chunk_tokens=1024)
    ids = torch.randint(0, LLAMA["vocab_size"], (8, 128))

    def batch() -> dict[str, torch.Tensor]:
        return {"input_ids": ids.clone(), "labels": ids.clone()}

    profile = profile_layers(layers, batch, compute_dtype=torch.bfloat16)
    plan = estimate_memory(layers, num_slices=4, compute_dtype=torch.bfloat16, device="cpu", profile=profile)
    model = OffloadModel(layers, device="cpu", num_slices=4, compute_dtype=torch.bfloat16)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=1e-4)
    for _ in range(3):
        model(batch()).sum().backward()
        optimizer.step()
        optimizer.synchronize()
        optimizer.zero_grad(set_to_none=False)
    inputs = batch()
    with _PeakAllocated(libc.mallinfo2) as mode:
        start = mode.peak
        model(inputs).sum().backward()
    assert plan.device_activations + plan.device_gradients == pytest.approx(mode.peak - start, rel=0.10)
