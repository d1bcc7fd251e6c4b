"""Every rotary-embedding type transformers offers, on inputs shorter and longer than the model's
maximum, bit for bit against the model's own forward and backward.

The dynamic types change their state in forward (Note: [Attribute state] in
``offload/walk/module_state.py``): the sequence lengths below take each branch in turn (growth past the
maximum, staying grown, and the reset to the original tables on a short input).
"""

from __future__ import annotations

import copy

import pytest
import torch

from offload import OffloadModel

from .helpers import DEVICES, assert_same_grads

transformers = pytest.importorskip("transformers")
from offload.integrations.transformers import causal_lm_sequential  # noqa: E402  (needs transformers)

EXACT = {"rtol": 0.0, "atol": 0.0}
VOCAB = 97
MAX_POSITIONS = 12
#: Longer than the maximum, longer still, equal to it, shorter, longer again.
LENGTHS = [20, 28, 12, 6, 24]
#: The rope types of ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` and the default, each with
#: the parameters it reads (the factor that transformers' own causal-LM tests use for scaling, 10).
ROPE_PARAMETERS = {
    "default": {},
    "linear": {"factor": 10.0},
    "dynamic": {"factor": 10.0},
    "yarn": {"factor": 10.0, "original_max_position_embeddings": MAX_POSITIONS},
    "longrope": {"short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 3.0, 4.0, 6.0],
                 "original_max_position_embeddings": MAX_POSITIONS // 2},
    "llama3": {"factor": 10.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": MAX_POSITIONS // 2},
    "proportional": {"partial_rotary_factor": 0.5},
}


def test_every_rope_type_is_covered():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert set(ROPE_INIT_FUNCTIONS) | {"default"} == set(ROPE_PARAMETERS)


def build(kind: str, rope: dict, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        kind, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS, pad_token_id=0,
        bos_token_id=0, eos_token_id=0, rope_parameters=rope, **({"head_dim": 8} if kind != "llama" else {}))
    return transformers.AutoModelForCausalLM.from_config(config)


def train_along(hf, device: str, num_slices: int, num_microbatches: int = 1) -> None:
    reference = copy.deepcopy(hf).to(device)
    model = OffloadModel(causal_lm_sequential(hf), device=device, num_slices=num_slices,
                         num_microbatches=num_microbatches)
    for step, length in enumerate(LENGTHS):
        ids = torch.randint(1, VOCAB, (2, length), generator=torch.Generator().manual_seed(step)).to(device)
        torch.manual_seed(step)
        # With microbatches the model runs on each chunk of the batch in turn: so does the reference.
        want_logits = torch.cat([reference(input_ids=chunk, use_cache=False).logits
                                 for chunk in ids.tensor_split(num_microbatches)])
        want_loss = reference.loss_function(logits=want_logits, labels=ids, vocab_size=VOCAB)
        want_loss.backward()
        torch.manual_seed(step)
        logits = model({"input_ids": ids})
        loss = hf.loss_function(logits=logits, labels=ids, vocab_size=VOCAB)
        loss.backward()
        torch.testing.assert_close(logits, want_logits, **EXACT)
        torch.testing.assert_close(loss, want_loss, **EXACT)
        assert_same_grads(hf, reference, **EXACT)
        with torch.no_grad():
            for p, q in zip(hf.parameters(), reference.parameters()):
                p.sub_(0.1 * p.grad)
                q.sub_(0.1 * q.grad)
                p.grad = q.grad = None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rope_type", list(ROPE_PARAMETERS))
@pytest.mark.parametrize("num_slices", [2, 3])
def test_every_rope_type_at_every_length(rope_type, num_slices, device):
    # With 2 layers and 3 slices the first decoder layer shares a slice with the embedding stage, so
    # its recompute recomputes the rotary tables too.
    hf = build("llama", {"rope_type": rope_type, "rope_theta": 1e4, **ROPE_PARAMETERS[rope_type]})
    train_along(hf, device, num_slices)


def test_dynamic_rope_with_microbatches():
    hf = build("llama", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 10.0})
    train_along(hf, "cpu", num_slices=3, num_microbatches=2)


@pytest.mark.parametrize("kind", ["gemma3_text", "qwen2"])
def test_dynamic_rope_in_other_families(kind):
    if kind == "gemma3_text":  # a rotary table per layer type, each dynamic: state per layer type
        rope = {layer_type: {"rope_type": "dynamic", "rope_theta": theta, "factor": 10.0}
                for layer_type, theta in (("sliding_attention", 1e4), ("full_attention", 1e6))}
    else:
        rope = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 10.0}
    train_along(build(kind, rope), "cpu", num_slices=3)
