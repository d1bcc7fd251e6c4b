"""OffloadedCausalLM's accessors of the Hugging Face model's embeddings wait for the pending host
update first, as the offloaded model's ``parameters()`` and ``state_dict()`` do (Note: [Overlapped
host update] in offload/optimizer.py): the update runs behind ``step()``, and a read before it
lands would see the weights of the step before, or, for a resize, lose the update."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from offload import OffloadOptimizer  # noqa: E402
from offload.integrations.causal_lm import OffloadedCausalLM  # noqa: E402

EXACT = {"rtol": 0.0, "atol": 0.0}


class SlowAdamW(torch.optim.AdamW):
    """AdamW that takes a while before it starts: its update is still pending when step() returns."""

    def step(self, closure: Any = None) -> Any:
        time.sleep(0.3)
        return super().step(closure)


def stepped(tied: bool = False) -> tuple[OffloadedCausalLM, OffloadOptimizer, dict[str, torch.Tensor]]:
    """A tiny Llama after one step() whose update is still pending, and its weights before it."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                      tie_word_embeddings=tied)
    model = OffloadedCausalLM(transformers.LlamaForCausalLM(config), device="cpu", num_slices=3)
    optimizer = OffloadOptimizer(model, SlowAdamW, lr=1e-2)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()  # returns while the update is still to run
    return model, optimizer, before


@pytest.mark.parametrize("accessor", ["get_input_embeddings", "get_output_embeddings"])
def test_an_embedding_handed_out_right_after_step_holds_the_update(accessor):
    model, optimizer, before = stepped()
    read = getattr(model, accessor)().weight.detach().clone()
    optimizer.synchronize()
    assert not torch.equal(read, before["lm_head.weight" if accessor == "get_output_embeddings"
                                       else "model.embed_tokens.weight"])
    torch.testing.assert_close(read, getattr(model, accessor)().weight.detach(), **EXACT)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_resize_right_after_step_keeps_the_update(tied):
    model, optimizer, _ = stepped(tied)
    model.resize_token_embeddings(80)
    optimizer.synchronize()
    resized = model.state_dict()

    synchronized, optimizer, _ = stepped(tied)
    optimizer.synchronize()
    updated = synchronized.state_dict()
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        assert resized[key].shape[0] == 80
        torch.testing.assert_close(resized[key][:64], updated[key], **EXACT)


def test_base_model_as_trls_fused_head_calls_it_keeps_the_update_behind_the_forward():
    # TRL projects base_model's hidden states through get_output_embeddings().weight. base_model's
    # check of the head must not wait for the whole pending update before the forward: that wait
    # expires every slice's shadow, which the loads then cast again.
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    model = OffloadedCausalLM(transformers.LlamaForCausalLM(config), device="cpu", num_slices=4,
                              compute_dtype=torch.bfloat16)
    optimizer = OffloadOptimizer(model, SlowAdamW, lr=1e-3)
    slices = model.offloaded._engine.slices
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    steps = 3
    for _ in range(steps):
        hidden = model.base_model(input_ids=ids).last_hidden_state
        weight = model.get_output_embeddings().weight
        (hidden.float() @ weight.float().t()).logsumexp(-1).mean().backward()
        optimizer.step()  # returns while the update is still to run
        optimizer.zero_grad()
    optimizer.synchronize()
    # Each slice's shadow cast when first loaded, then once after each step's update.
    assert sum(s.storage.shadow_refreshes for s in slices) == len(slices) * (1 + steps)
