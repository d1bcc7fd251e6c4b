"""Hugging Face causal LMs through ``offload.integrations.transformers``, against the models' own forward.

Models are built from small configs with random weights: nothing is downloaded. The reference is
a deep copy of the same model run the ordinary way with ``use_cache=False`` (the training setting:
with GPT-2's default ``use_cache=True`` its forward builds a key/value cache even in training,
which changes the attention's memory layout and the last bits of the logits).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib.util
import io
import subprocess
import sys
import types
import weakref
from pathlib import Path

import pytest
import torch
import torch.utils._python_dispatch

import offload
from offload import OffloadModel
from offload.model import engine_of

from .helpers import ACTIVATIONS, DEVICES, HostStepped, assert_same_grads, grads_of
from .test_mixed_precision import converted, master_grads_of

transformers = pytest.importorskip("transformers", reason='transformers is not installed: pip install -e ".[transformers]"')
from offload.integrations.transformers import (  # noqa: E402  (needs transformers)
    SUPPORTED_MODEL_TYPES,
    CausalLMSequential,
    causal_lm_sequential,
)

EXACT = {"rtol": 0.0, "atol": 0.0}
VOCAB = 97
FAMILIES = ["gpt2", "llama", "mistral", "ministral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi", "phi3",
            "olmo", "olmo2", "olmo3", "smollm3", "granite", "cohere", "glm", "glm4", "helium", "stablelm", "gpt_neox",
            "mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3", "deepseek_v2", "ernie4_5", "olmoe",
            "granitemoe", "granitemoeshared", "cohere2", "glm4_moe", "dots1", "seed_oss", "exaone4", "arcee",
            "apertus", "hunyuan_v1_dense", "llama4_text", "nemotron", "phimoe", "jetmoe", "bitnet", "lfm2",
            "qwen3_next"]
#: Model types with a config class of their own that transformers builds as a family's ``*ForCausalLM``
#: (internlm3 and iquestcoder from 5.23, the others from 5.24), built with that family's options.
BUILT_AS_FAMILY = {"exaone": "llama", "internlm3": "llama", "iquestcoder": "llama", "sarvam_mla": "deepseek_v3",
                   "sarvam_moe": "glm4_moe"}
#: Families with a class of their own from transformers 5.24 whose forward repeats a checked family's,
#: statement for statement (offload/integrations/transformers_families.py says whose): cut with that
#: family's layout, and checked here and in the loader's round trip as the families are. The mixtures
#: of experts among them are built with the options of the family whose layout they take.
LATER_MOE = {"glm4_moe_lite": "deepseek_v3", "solar_open": "glm4_moe", "aria_text": "deepseek_v3",
             "axk1": "deepseek_v3", "ernie4_5_moe": "olmoe", "flex_olmo": "olmoe", "exaone_moe": "dots1",
             "flint": "qwen2_moe"}
LATER_FAMILIES = [kind for kind in ("vaultgemma", "ministral3", "diffllama", "jais2", "youtu", *LATER_MOE)
                  if kind in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES]
#: The families and the model types built as one of their classes that the installed release knows, for
#: the bit-for-bit checks here. Other files take ``FAMILIES``: what they set per family (LoRA's targets)
#: or load (Sarvam-MoE's fused attention weights, which load_causal_lm refuses) is the family's alone.
MODEL_TYPES = FAMILIES + LATER_FAMILIES + [kind for kind in BUILT_AS_FAMILY
                          if kind in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES]
#: The families whose configs tie the input and output embeddings by default.
TIED_BY_DEFAULT = ["gpt2", "gemma", "gemma2", "gemma3_text", "smollm3", "cohere", "ernie4_5", "cohere2", "jetmoe",
                   "lfm2"]


def alternating(layers: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


def family_options(kind: str, layers: int, dropout: float) -> dict:
    """What each family needs beyond the shared small config so that what sets it apart is exercised:
    sliding windows shorter than the sequence, both layer types, multipliers and caps far from 1,
    dropout wherever the family has some."""
    window = {"sliding_window": 4, "layer_types": alternating(layers)}
    return {
        "mistral": {"sliding_window": 4},
        "ministral": {**window, "head_dim": 8},
        "qwen2": {**window, "use_sliding_window": True},
        "gemma": {"head_dim": 8},
        "gemma2": {**window, "head_dim": 8, "final_logit_softcapping": 2.0, "attn_logit_softcapping": 1.0},
        "vaultgemma": {**window, "head_dim": 8, "final_logit_softcapping": 2.0, "attn_logit_softcapping": 1.0},
        "ministral3": {"sliding_window": 4},
        "diffllama": {"attention_dropout": 0.0},  # its config refuses more
        # Multi-head latent attention, as DeepSeek-V3's, in dense layers.
        "youtu": {"num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4,
                  "qk_nope_head_dim": 4, "v_head_dim": 8},
        # Its two layer types also get rotary tables of their own (bases 1e4 and 1e6).
        "gemma3_text": {**window, "head_dim": 8},
        "phi": {"resid_pdrop": dropout, "embd_pdrop": dropout},
        "phi3": {"sliding_window": 4, "resid_pdrop": dropout, "embd_pdrop": dropout},
        "olmo3": {**window, "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
        "smollm3": {**window, "no_rope_layer_interval": 2},
        "granite": {"embedding_multiplier": 4.0, "logits_scaling": 3.0, "residual_multiplier": 0.5,
                    "attention_multiplier": 0.25},
        "glm": {"head_dim": 8},
        "glm4": {"head_dim": 8},
        "helium": {"head_dim": 8},
        "stablelm": {"hidden_dropout": dropout},
        "gpt_neox": {"hidden_dropout": dropout},
        "mixtral": {"sliding_window": 4, "num_local_experts": 4, "num_experts_per_tok": 2},
        "qwen2_moe": {**window, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                      "shared_expert_intermediate_size": 16},
        "qwen3_moe": {"use_sliding_window": True, "sliding_window": 4, "head_dim": 8, "num_experts": 4,
                      "num_experts_per_tok": 2, "moe_intermediate_size": 16},
        # Attention sinks, sliding layers, yarn rotary tables.
        "gpt_oss": {**window, "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
                    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                        "rope_theta": 1.5e5, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}},
        # Multi-head latent attention (low-rank queries, keys and values: as many of each as heads), the first
        # layer dense, the others routing over groups of experts beside a shared one.
        "deepseek_v3": {"num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4,
                        "qk_nope_head_dim": 4, "v_head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
                        "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "moe_intermediate_size": 16},
        "deepseek_v2": {"num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4,
                        "qk_nope_head_dim": 4, "v_head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
                        "n_group": 2, "topk_group": 1, "topk_method": "group_limited_greedy",
                        "first_k_dense_replace": 1, "moe_intermediate_size": 16},
        "ernie4_5": {"head_dim": 8},
        "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
        "granitemoe": {"embedding_multiplier": 4.0, "logits_scaling": 3.0, "residual_multiplier": 0.5,
                       "attention_multiplier": 0.25, "num_local_experts": 4, "num_experts_per_tok": 2},
        "granitemoeshared": {"embedding_multiplier": 4.0, "logits_scaling": 3.0, "residual_multiplier": 0.5,
                             "attention_multiplier": 0.25, "num_local_experts": 4, "num_experts_per_tok": 2,
                             "shared_intermediate_size": 16},
        "cohere2": {**window, "head_dim": 8, "logit_scale": 0.25},
        "glm4_moe": {"head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
                     "first_k_dense_replace": 1, "moe_intermediate_size": 16, "use_qk_norm": True},
        "dots1": {**window, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 2,
                  "topk_group": 1, "first_k_dense_replace": 1, "moe_intermediate_size": 16},
        "seed_oss": {"head_dim": 8, "residual_dropout": dropout},
        "exaone4": {**window, "head_dim": 8},
        "arcee": {"head_dim": 8},
        "apertus": {"head_dim": 8},
        "hunyuan_v1_dense": {"head_dim": 8},
        # Chunked and full attention layers, layers without rotary, experts on every other layer.
        "llama4_text": {"head_dim": 8, "attention_chunk_size": 4, "no_rope_layer_interval": 2,
                        "layer_types": ["chunked_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                        "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
                        "intermediate_size_mlp": 64},
        "nemotron": {"head_dim": 8},
        "phimoe": {"sliding_window": 4, "num_local_experts": 4, "num_experts_per_tok": 2},
        "jetmoe": {"num_local_experts": 4, "num_experts_per_tok": 2, "kv_channels": 8},
        # Linear attention (gated delta rule) layers between full attention layers, experts beside a shared one.
        "qwen3_next": {"head_dim": 8, "layer_types": ["linear_attention" if i % 2 == 0 else "full_attention"
                                                      for i in range(layers)],
                       "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                       "linear_value_head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                       "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16},
        # Convolution layers between attention layers.
        "lfm2": {"layer_types": ["conv" if i % 2 == 0 else "full_attention" for i in range(layers)]},
    }.get(kind, {})


def build(kind: str, dropout: float = 0.1, tied: bool = False, layers: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=layers, n_head=4, vocab_size=VOCAB, n_positions=64,
                                         resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                         tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)
    else:
        shared = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": layers, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 64,
                  "attention_dropout": dropout, "tie_word_embeddings": tied, "pad_token_id": 0, "bos_token_id": 0,
                  "eos_token_id": 0}
        options = family_options(BUILT_AS_FAMILY.get(kind, LATER_MOE.get(kind, kind)), layers, dropout)
        config = transformers.AutoConfig.for_model(kind, **{**shared, **options})
    return transformers.AutoModelForCausalLM.from_config(config)


def batch(device: str = "cpu") -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (4, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0  # right padding
    mask[2, :3] = 0  # left padding
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def reference_loss(hf, inputs, labels):
    out = hf(**inputs, labels=labels, use_cache=False)
    return out.logits, out.loss


def offloaded_loss(hf, model, inputs, labels):
    logits = model(inputs)
    return logits, hf.loss_function(logits=logits, labels=labels, vocab_size=hf.config.vocab_size)


def both_backward(hf, reference, model, inputs, labels, seed: int = 7):
    """One forward and backward of the reference and of the offloaded model from the same random
    state; returns (offloaded logits, reference logits)."""
    torch.manual_seed(seed)
    want_logits, want_loss = reference_loss(reference, inputs, labels)
    want_loss.backward()
    torch.manual_seed(seed)
    got_logits, got_loss = offloaded_loss(hf, model, inputs, labels)
    got_loss.backward()
    torch.testing.assert_close(got_loss, want_loss, **EXACT)
    return got_logits, want_logits


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", MODEL_TYPES)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("checkpoint_activation", [True, False])
def test_logits_loss_and_gradients_are_bit_identical(kind, train, checkpoint_activation, device):
    hf = build(kind)
    reference = copy.deepcopy(hf).to(device)
    hf.train(train)
    reference.train(train)
    model = OffloadModel(causal_lm_sequential(hf), device=device, num_slices=3,
                         checkpoint_activation=checkpoint_activation)
    inputs = batch(device)
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    for _ in range(2):  # the second step after an update of the host copies
        got_logits, want_logits = both_backward(hf, reference, model, inputs, labels)
        torch.testing.assert_close(got_logits, want_logits, **EXACT)
        assert_same_grads(hf, reference, **EXACT)
        with torch.no_grad():
            for p, q in zip(hf.parameters(), reference.parameters()):
                if p.grad is not None:  # ERNIE 4.5 MoE's unused expert bias has none, in both
                    p.sub_(0.1 * p.grad)
                    q.sub_(0.1 * q.grad)
                p.grad = q.grad = None


#: Families whose layers differ in what they save (learned and rotary positions, sliding windows,
#: parallel attention, experts), each with one policy and dtype, so that every policy and dtype
#: meets more than one family.
OFFLOADED_CASES = [
    ("gpt2", "offload_last", None),
    ("llama", "offload_all", torch.bfloat16),
    ("gemma3_text", "offload_last", torch.bfloat16),
    ("gpt_neox", "offload_all", None),
    ("qwen3_moe", "offload_last", None),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("kind", "activations", "compute_dtype"), OFFLOADED_CASES,
                         ids=[f"{k}-{a}-{'bf16' if d else 'float32'}" for k, a, d in OFFLOADED_CASES])
def test_offloaded_activations_are_bit_identical(kind, activations, compute_dtype, device):
    hf = build(kind)
    reference = (copy.deepcopy(hf) if compute_dtype is None else converted(hf, compute_dtype)).to(device)
    model = OffloadModel(causal_lm_sequential(hf), device=device, num_slices=3, compute_dtype=compute_dtype,
                         **ACTIVATIONS[activations])
    inputs = batch(device)
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    got_logits, want_logits = both_backward(hf, reference, model, inputs, labels)
    torch.testing.assert_close(got_logits, want_logits, **EXACT)
    assert_same_grads(hf, reference if compute_dtype is None else master_grads_of(reference), **EXACT)
    assert engine_of(model).activations.saved_bytes > 0


@pytest.mark.parametrize(("kind", "activations"), [
    ("gpt2", "recompute"), ("llama", "recompute"), ("gemma3_text", "recompute"), ("gpt_neox", "recompute"),
    ("llama", "offload_all"), ("gemma3_text", "offload_all"),
])
def test_with_the_models_own_gradient_checkpointing(kind, activations):
    hf = build(kind)
    hf.gradient_checkpointing_enable()
    reference = copy.deepcopy(hf)
    model = OffloadModel(causal_lm_sequential(hf), device="cpu", num_slices=2, **ACTIVATIONS[activations])
    inputs = batch()
    got_logits, want_logits = both_backward(hf, reference, model, inputs, inputs["input_ids"])
    torch.testing.assert_close(got_logits, want_logits, **EXACT)
    assert_same_grads(hf, reference, **EXACT)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", MODEL_TYPES)
def test_under_a_compute_dtype(kind, device):
    hf = build(kind)
    # Parameters in bf16, buffers (rotary tables) as they are.
    reference = converted(hf, torch.bfloat16).to(device)
    model = OffloadModel(causal_lm_sequential(hf), device=device, num_slices=3, compute_dtype=torch.bfloat16)
    inputs = batch(device)
    got_logits, want_logits = both_backward(hf, reference, model, inputs, inputs["input_ids"])
    assert got_logits.dtype == torch.bfloat16
    torch.testing.assert_close(got_logits, want_logits, **EXACT)
    assert_same_grads(hf, master_grads_of(reference), **EXACT)


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])
def test_microbatches_follow_the_model_chunk_by_chunk(kind):
    hf = build(kind, dropout=0.0)
    reference = copy.deepcopy(hf)
    model = OffloadModel(causal_lm_sequential(hf), device="cpu", num_slices=3, num_microbatches=2)
    inputs = batch()
    got = model(inputs)
    want = torch.cat([reference(input_ids=inputs["input_ids"][rows], attention_mask=inputs["attention_mask"][rows],
                                use_cache=False).logits for rows in (slice(0, 2), slice(2, 4))])
    torch.testing.assert_close(got, want, **EXACT)


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_each_slice_builds_its_masks_once_and_sees_a_mask_changed_in_place(kind):
    # The mask functions read mask values from the host (a device sync on a GPU): at most once per
    # kind of mask per slice run, as the model does once per forward, not once per layer.
    hf = build(kind, dropout=0.0, layers=6)
    reference = copy.deepcopy(hf)
    layers = causal_lm_sequential(hf)
    model = OffloadModel(layers, device="cpu", num_slices=2)
    calls, counted = [], {}
    for stage in layers:
        if hasattr(stage, "mask_function"):
            def count(*args, original=stage.mask_function, **kwargs):
                calls.append(original)
                return original(*args, **kwargs)
            stage.mask_function = counted.setdefault(stage.mask_function, count)
    runs = len(counted) * sum(any(hasattr(layers[int(name)], "mask_function") for name in names)
                              for names in model.partition)
    inputs = batch()
    got = model(inputs)
    assert 0 < len(calls) <= runs < 6, (len(calls), runs)
    got.float().pow(2).mean().backward()  # the recompute of the first slice builds its masks again
    assert len(calls) <= 2 * runs, (len(calls), runs)
    torch.testing.assert_close(got, reference(**inputs, use_cache=False).logits, **EXACT)
    # The same tensors again, one changed in place: the next forward must not reuse a stale mask.
    inputs["position_ids"] = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(model(inputs), reference(**inputs, use_cache=False).logits, **EXACT)
        inputs["attention_mask"][1, 6:] = 0
        torch.testing.assert_close(model(inputs), reference(**inputs, use_cache=False).logits, **EXACT)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_without_position_ids_no_slice_looks_for_packed_sequences(kind, monkeypatch):
    # The look reads a value on the host: on a GPU a wait for the device in every slice's forward
    # and recompute (Note: [Default positions]). Positions a user passes are looked at, as the
    # model does.
    import transformers.masking_utils as masking

    looks = []
    original = masking.find_packed_sequence_indices
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda *a, **k: looks.append(1) or original(*a, **k))
    hf = build(kind, dropout=0.0)
    reference = copy.deepcopy(hf)
    model = OffloadModel(causal_lm_sequential(hf), device="cpu", num_slices=3)
    ids = batch()["input_ids"]
    got = model({"input_ids": ids})
    got.float().pow(2).mean().backward()
    assert looks == []
    want = reference(input_ids=ids, use_cache=False).logits
    want.float().pow(2).mean().backward()
    torch.testing.assert_close(got, want, **EXACT)
    assert_same_grads(hf, reference, **EXACT)
    packed = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]] * ids.shape[0])
    with torch.no_grad():
        torch.testing.assert_close(model({"input_ids": ids, "position_ids": packed}),
                                   reference(input_ids=ids, position_ids=packed, use_cache=False).logits, **EXACT)
    assert looks


def test_inference_mode_and_a_mask_rewritten_through_data():
    hf = build("llama", dropout=0.0).eval()
    reference = copy.deepcopy(hf)
    model = OffloadModel(causal_lm_sequential(hf), device="cpu", num_slices=2)
    inputs = batch()
    with torch.inference_mode():  # inference tensors have no version to key a mask on
        torch.testing.assert_close(model(inputs), reference(**inputs, use_cache=False).logits, **EXACT)
    inputs["position_ids"] = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        model(inputs)
        inputs["attention_mask"].data[3, :2] = 0  # no version bump: the next forward must still see it
        torch.testing.assert_close(model(inputs), reference(**inputs, use_cache=False).logits, **EXACT)


def test_input_ids_alone_and_explicit_positions():
    hf = build("qwen2", dropout=0.0).eval()
    reference = copy.deepcopy(hf)
    model = OffloadModel(causal_lm_sequential(hf), device="cpu", num_slices=2)
    ids = batch()["input_ids"]
    torch.testing.assert_close(model(ids), reference(input_ids=ids, use_cache=False).logits, **EXACT)
    positions = torch.arange(3, 13).unsqueeze(0)
    torch.testing.assert_close(model({"input_ids": ids, "position_ids": positions}),
                               reference(input_ids=ids, position_ids=positions, use_cache=False).logits, **EXACT)


def test_packed_positions_pack_the_masks_only_where_the_model_packs_them():
    # Llama builds its masks from the position ids: sequences packed into a row attend apart. GPT-OSS
    # builds them without, so there its packed sequences attend across (only the rotary tables restart).
    packed = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]] * 4)
    ids = batch()["input_ids"]
    for kind in ("llama", "gpt_oss"):
        hf = build(kind, dropout=0.0).eval()
        reference = copy.deepcopy(hf)
        model = OffloadModel(causal_lm_sequential(hf), device="cpu", num_slices=2)
        want = reference(input_ids=ids, position_ids=packed, use_cache=False).logits
        torch.testing.assert_close(model({"input_ids": ids, "position_ids": packed}), want, **EXACT)
        # A mask of ones turns the look for packed sequences off: the second sequence of each row then sees
        # the first, which changes its logits in Llama and not in GPT-OSS.
        unpacked = reference(input_ids=ids, position_ids=packed, attention_mask=torch.ones_like(ids)).logits
        assert (kind == "llama") != torch.equal(unpacked[:, 5:], want[:, 5:])


def test_the_hugging_face_model_holds_the_trained_weights(tmp_path):
    hf = build("llama")
    layers = causal_lm_sequential(hf)
    model = OffloadModel(layers, device="cpu", num_slices=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    inputs = batch()
    for _ in range(2):
        _, loss = offloaded_loss(hf, model, inputs, inputs["input_ids"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    renamed = layers.hf_state_dict(model.state_dict())
    assert renamed.keys() == hf.state_dict().keys()
    hf.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    assert loaded.keys() == renamed.keys()
    for key, value in renamed.items():
        torch.testing.assert_close(loaded[key], value, **EXACT, msg=key)
    assert not torch.equal(renamed["model.layers.0.mlp.up_proj.weight"],
                           build("llama").state_dict()["model.layers.0.mlp.up_proj.weight"]), "training changed nothing"
    with pytest.raises(KeyError, match="not a parameter or buffer"):
        layers.hf_name("7.nothing.weight")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", [*TIED_BY_DEFAULT, "qwen2"])
@pytest.mark.parametrize("checkpoint_activation", [True, False])
def test_tied_embeddings_stay_tied_and_bit_identical(kind, checkpoint_activation, device, tmp_path):
    """The first slice holds the tied matrix and the last borrows it; autograd adds both gradients."""
    hf = build(kind, tied=True)
    reference = copy.deepcopy(hf).to(device)
    model = OffloadModel(causal_lm_sequential(hf), device=device, num_slices=3,
                         checkpoint_activation=checkpoint_activation)
    assert hf.lm_head.weight is hf.get_input_embeddings().weight
    assert reference.lm_head.weight is reference.get_input_embeddings().weight
    optimizer = offload.OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    # On a GPU the reference's optimizer steps host copies, as OffloadModel's does (see HostStepped).
    def make_adamw(params):
        return torch.optim.AdamW(params, lr=1e-2, fused=True)
    plain_optimizer = make_adamw(reference.parameters()) if device == "cpu" else HostStepped(reference, make_adamw)
    inputs = batch(device)
    labels = inputs["input_ids"]
    for _ in range(3):
        got_logits, want_logits = both_backward(hf, reference, model, inputs, labels)
        torch.testing.assert_close(got_logits, want_logits, **EXACT)
        assert_same_grads(hf, reference, **EXACT)
        optimizer.step()
        plain_optimizer.step()
        optimizer.zero_grad()
        plain_optimizer.zero_grad()
    optimizer.synchronize()
    for (name, p), q in zip(hf.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q.cpu(), **EXACT, msg=name)
    hf.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.get_input_embeddings().weight
    torch.testing.assert_close(loaded.lm_head.weight, hf.lm_head.weight, **EXACT)


def test_tied_embeddings_untied_on_request(tmp_path):
    hf = build("gpt2", tied=True, dropout=0.0).eval()
    reference = copy.deepcopy(hf)
    model = OffloadModel(causal_lm_sequential(hf, untie_embeddings=True), device="cpu", num_slices=3)
    inputs = batch()
    # Same values, so the first forward is unchanged...
    torch.testing.assert_close(model(inputs), reference(**inputs, use_cache=False).logits, **EXACT)
    assert hf.lm_head.weight is not hf.transformer.wte.weight
    assert not hf.config.tie_word_embeddings
    # ...and the checkpoint holds both matrices.
    hf.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is not loaded.transformer.wte.weight


# -- the chunked loss (loss_chunk_tokens) ---------------------------------------------------------

#: The chunked loss adds float32 token losses per chunk and row, then over rows, where transformers
#: adds them in one reduction: another summation order, measured within 1 ulp (1.04e-7 relative).
LOSS_ROUNDING = {"rtol": 2 ** -22, "atol": 0.0}
#: How far each gradient may move, relative to its largest element, when the chunks are smaller
#: than the batch. A token's loss and gradient do not depend on the other tokens, but a matrix
#: product may compute a row differently for another number of rows (the CPU's float32 kernels
#: do for 10 tokens or fewer, not for 20), so a chunk's logits and hidden-state gradients round differently,
#: and every gradient behind them with them; and the lm_head gradient is added chunk by chunk in
#: the compute dtype. Measured on the CPU: float32 at most 4.9e-7 (4 ulps of the largest
#: element); bfloat16 0 below the head and at most 8.9e-3 for lm_head (about one bfloat16 ulp).
GRAD_ROUNDING = {None: 1e-6, torch.bfloat16: 2 ** -6}
#: Chunk sizes against the batch's 4 rows of 10 tokens: pieces of rows that do not divide a row
#: (3, 7), whole rows that do not divide the batch (30: three rows, then one), and more than the batch.
CHUNKS = [3, 7, 30, 1000]


def labelled(device: str = "cpu") -> dict[str, torch.Tensor]:
    """The batch, with labels as a collator writes them: the input ids, -100 on padding."""
    inputs = batch(device)
    return {**inputs, "labels": inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)}


def chunked_backward(reference, model, inputs, microbatches: int = 1, seed: int = 7):
    """One forward and backward of the reference (its own loss, ``num_items_in_batch`` counted over
    the whole batch, as the Trainer does) and of the offloaded model (the sum of its per-row sums
    over the same count); returns (offloaded loss, reference loss). With microbatches the
    reference runs each one on its own, as the offloaded model does."""
    count = CausalLMSequential.count_loss_tokens(inputs["labels"])
    torch.manual_seed(seed)
    rows = torch.arange(len(inputs["input_ids"])).tensor_split(microbatches)
    want = sum(reference(**{key: value[part] for key, value in inputs.items()}, use_cache=False,
                         num_items_in_batch=count).loss for part in rows)
    want.backward()
    torch.manual_seed(seed)
    sums = model(inputs)
    assert sums.shape == (len(inputs["input_ids"]),) and sums.dtype == torch.float32
    got = sums.sum() / count
    got.backward()
    return got, want


def assert_grads_within(actual, expected, rounding: float) -> None:
    got, want = grads_of(actual), grads_of(expected)
    assert got.keys() == want.keys()
    for name, expected_grad in want.items():
        torch.testing.assert_close(got[name].to(expected_grad.device), expected_grad, rtol=0.0,
                                   atol=rounding * expected_grad.abs().max().item(), msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["llama", "gpt2", "gemma2", "granite"])
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["float32", "bf16"])
def test_chunked_loss_matches_the_models_own_loss(kind, chunk, compute_dtype, device):
    # Gemma 2 soft-caps the logits and Granite divides them: each chunk's logits get the same steps before the loss.
    hf = build(kind)
    reference = (converted(hf, compute_dtype) if compute_dtype else copy.deepcopy(hf)).to(device)
    model = OffloadModel(causal_lm_sequential(hf, loss_chunk_tokens=chunk), device=device, num_slices=3,
                         compute_dtype=compute_dtype)
    got, want = chunked_backward(reference, model, labelled(device))
    torch.testing.assert_close(got, want, **LOSS_ROUNDING)
    expected = master_grads_of(reference) if compute_dtype else reference
    if chunk >= 40:
        # One chunk of the whole batch: the same products as the model's, so every gradient is its bit for bit.
        assert_same_grads(hf, expected, **EXACT)
    else:
        assert_grads_within(hf, expected, GRAD_ROUNDING[compute_dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["llama", "gemma2"])
@pytest.mark.parametrize(("train", "microbatches", "checkpoint_activation"),
                         [(False, 1, True), (True, 2, True), (True, 2, False)], ids=["eval", "microbatches",
                                                                                     "microbatches-kept-graphs"])
@pytest.mark.parametrize("chunk", [7, 1000])
def test_chunked_loss_in_eval_mode_and_across_microbatches(kind, train, microbatches, checkpoint_activation, chunk,
                                                           device):
    hf = build(kind, dropout=0.1 if microbatches == 1 else 0.0).train(train)
    reference = copy.deepcopy(hf).to(device)
    model = OffloadModel(causal_lm_sequential(hf, loss_chunk_tokens=chunk), device=device, num_slices=3,
                         num_microbatches=microbatches, checkpoint_activation=checkpoint_activation)
    got, want = chunked_backward(reference, model, labelled(device), microbatches)
    torch.testing.assert_close(got, want, **LOSS_ROUNDING)
    if chunk >= 40 // microbatches:
        assert_same_grads(hf, reference, **EXACT)
    else:
        assert_grads_within(hf, reference, GRAD_ROUNDING[None])


def test_chunked_loss_takes_shift_labels_as_transformers_does():
    hf = build("llama", dropout=0.0).eval()
    reference = copy.deepcopy(hf)
    layers = causal_lm_sequential(hf, loss_chunk_tokens=1000)
    inputs = labelled()
    shifted = torch.nn.functional.pad(inputs["labels"], (0, 1), value=-100)[:, 1:]
    unshifted = {key: value for key, value in inputs.items() if key != "labels"}
    with torch.no_grad():
        # The labels shifted beforehand give the same sums as the labels.
        torch.testing.assert_close(layers({**unshifted, "shift_labels": shifted}), layers(inputs), **EXACT)
        # Given both, shift_labels are the targets, as ForCausalLMLoss takes them.
        other = torch.randint(0, VOCAB, shifted.shape, generator=torch.Generator().manual_seed(3))
        other[1, :4] = -100
        count = layers.count_loss_tokens(inputs["labels"], shift_labels=other)
        assert count == other.numel() - 4
        want = reference(**inputs, shift_labels=other, use_cache=False, num_items_in_batch=count).loss
        torch.testing.assert_close(layers({**inputs, "shift_labels": other}).sum() / count, want, **LOSS_ROUNDING)
    assert layers.count_loss_tokens(inputs["labels"]) == (inputs["labels"][:, 1:] != -100).sum()


class _WatchLogits(torch.utils._python_dispatch.TorchDispatchMode):
    """Watches every tensor an operation creates (views aside) whose last dim is the vocabulary:
    the largest, in tokens, and the most bytes alive at once, in distinct storages. Alive counts
    what it created and still exists, and every such tensor an operation reads or writes at that
    moment: autograd's saved tensors have no Python object of their own between operations, but
    they show up as the arguments of the backward operations that use them."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.created: list[tuple[str, int, weakref.ref]] = []
        self.largest = 0
        self.peak_bytes = 0

    def _logits_like(self, tree):
        # Rows of vocabulary-sized vectors, laid out as logits are (the transposed output matrix,
        # V x H seen as H x V, has a last dim of V too, but not a unit stride).
        return [t for t in torch.utils._pytree.tree_leaves(tree)
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab and t.stride(-1) == 1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        created = [] if func.is_view else self._logits_like(out)
        for tensor in created:
            self.created.append((str(func), tensor.numel() // self.vocab, weakref.ref(tensor)))
            self.largest = max(self.largest, tensor.numel() // self.vocab)
        touched = self._logits_like((args, kwargs, out))
        alive = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                 for t in [*(ref() for _, _, ref in self.created), *touched] if t is not None}
        self.peak_bytes = max(self.peak_bytes, sum(alive.values()))
        return out

    def alive(self) -> int:
        gc.collect()
        return sum(ref() is not None for _, _, ref in self.created)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("kind", "compute_dtype"), [("llama", None), ("gemma2", torch.bfloat16)],
                         ids=["llama-float32", "gemma2-bf16"])
def test_chunked_loss_never_holds_the_batchs_logits(kind, compute_dtype, device):
    tokens, chunk = 40, 7  # 4 rows of 10 tokens: chunks of 7 and 3 tokens, two per row
    watch = _WatchLogits(VOCAB)
    model = OffloadModel(causal_lm_sequential(build(kind), loss_chunk_tokens=chunk), device=device, num_slices=3,
                         compute_dtype=compute_dtype)
    with watch:
        sums = model(labelled(device))
    # Each chunk's logits were freed once its sums were taken: nothing of that size waits for backward.
    assert watch.largest == chunk and watch.alive() == 0
    forward = len(watch.created)
    with watch:
        sums.sum().backward()
    assert watch.largest == chunk
    # Backward projects each chunk again, one after another (chunks of the flattened batch: 6), with
    # at most three chunks' worth of float32 logits at a time (the log-softmax's gradient, its saved
    # output and its input's gradient), and half a chunk more of bfloat16 ones before the soft-cap
    # under a compute dtype: never the batch's.
    assert sum(name == "aten.mm.default" for name, _, _ in watch.created[forward:]) == -(-tokens // chunk)
    assert watch.peak_bytes <= 3.5 * chunk * VOCAB * 4 < tokens * VOCAB * 4, watch.peak_bytes

    # Without it the same watch sees the batch's logits.
    watch = _WatchLogits(VOCAB)
    model = OffloadModel(causal_lm_sequential(build(kind)), device=device, num_slices=3, compute_dtype=compute_dtype)
    with watch:
        model(batch(device))
    assert watch.largest == tokens


def test_hooks_on_the_output_projection_can_tell_the_chunks_recompute():
    hf = build("llama")
    model = OffloadModel(causal_lm_sequential(hf, loss_chunk_tokens=7), device="cpu", num_slices=3)
    seen = []
    hf.lm_head.register_forward_hook(lambda *_: seen.append(offload.is_recomputing()))
    sums = model(labelled())
    assert seen == [False] * 6  # 40 tokens in chunks of 7
    sums.sum().backward()
    assert seen == [False] * 6 + [True] * 6


def test_chunked_loss_refuses_missing_labels_and_bad_settings():
    hf = build("llama")
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match="loss_chunk_tokens must be a positive number of tokens"):
            causal_lm_sequential(hf, loss_chunk_tokens=bad)
    layers = causal_lm_sequential(hf, loss_chunk_tokens=8)
    inputs = labelled()
    with pytest.raises(TypeError, match="needs 'labels'"):
        layers(batch())
    with pytest.raises(TypeError, match="needs 'labels'"):  # None counts as absent, as in Hugging Face
        layers({**batch(), "labels": None})
    with pytest.raises(TypeError, match="a dict with 'input_ids' and 'labels'"):
        layers(inputs["input_ids"])
    with pytest.raises(TypeError, match="got keys"):
        layers({**inputs, "token_type_ids": inputs["input_ids"]})
    with pytest.raises(ValueError, match="torch.long"):
        layers({**inputs, "labels": inputs["labels"].float()})
    with pytest.raises(ValueError, match="shaped like input_ids"):
        layers({**inputs, "labels": inputs["labels"][:, 1:]})
    with pytest.raises(ValueError, match="needs labels or shift_labels"):
        layers.count_loss_tokens()
    # Labels without the option stay refused (test_unsupported_models_and_batches_get_clear_errors), now
    # with the option named.
    with pytest.raises(TypeError, match="loss_chunk_tokens"):
        causal_lm_sequential(hf)(inputs)
    hf._loss_function = lambda *args, **kwargs: None  # a model whose loss is not ForCausalLMLoss
    with pytest.raises(ValueError, match="this model's loss_function is '<lambda>'"):
        causal_lm_sequential(hf, loss_chunk_tokens=8)


def small(kind: str, **options) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(kind, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                               vocab_size=VOCAB, pad_token_id=0, **options)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("kind", [kind for kind in MODEL_TYPES if kind in BUILT_AS_FAMILY])
def test_a_model_type_built_as_a_familys_class_is_cut_as_that_family(kind):
    """Its logits, loss and gradients are checked with the families; here, that it is the family's
    class, and that its model type alone does not make another class acceptable."""
    family = BUILT_AS_FAMILY[kind]
    hf, familys = build(kind, dropout=0.0, layers=1), build(family, dropout=0.0, layers=1)
    assert type(hf) is type(familys) and type(hf.config) is not type(familys.config)
    causal_lm_sequential(hf)
    # Another class under that model type (a checkpoint's remote code, say): not what the family's layout follows.
    other = small("mistral")
    other.config.model_type = kind
    with pytest.raises(ValueError, match=f"is not a {type(hf).__name__}"):
        causal_lm_sequential(other)


def test_unsupported_models_and_batches_get_clear_errors():
    # StarCoder2 applies dropout to the embeddings under the decoder's own training flag, outside any module.
    with pytest.raises(ValueError, match=", ".join(SUPPORTED_MODEL_TYPES)):
        causal_lm_sequential(small("starcoder2", embedding_dropout=0.1))
    for kind, experts in (("mixtral", "num_local_experts"), ("olmoe", "num_experts"), ("gpt_oss", "num_local_experts"),
                          ("deepseek_v3", "n_routed_experts")):
        with pytest.raises(ValueError, match="load-balancing"):
            causal_lm_sequential(small(kind, **{experts: 2}, num_experts_per_tok=1, output_router_logits=True))
    with pytest.raises(ValueError, match="bidirectional"):
        causal_lm_sequential(small("gemma3_text", use_bidirectional_attention=True))
    # A layer type whose mask the stages do not know (a later release's, say).
    unknown = small("qwen2", layer_types=["full_attention"])
    unknown.config.layer_types[0] = "mystery_attention"
    with pytest.raises(ValueError, match="layer 0 is of type 'mystery_attention'"):
        causal_lm_sequential(unknown)
    with pytest.raises(ValueError, match="supports the causal LMs"):
        causal_lm_sequential(torch.nn.Linear(2, 2))
    # A model type that a later release builds as Llama's class, unchecked: the refusal says that is why.
    unchecked = small("llama")
    unchecked.config.model_type = "llama_lookalike"
    with pytest.raises(ValueError, match="got LlamaForCausalLM, llama's class, for model_type 'llama_lookalike', "
                                         "which has not been checked against llama's layout"):
        causal_lm_sequential(unchecked)
    layers = causal_lm_sequential(build("llama"))
    inputs = batch()
    with pytest.raises(TypeError, match="compute the loss from them"):
        layers({**inputs, "labels": inputs["input_ids"]})
    with pytest.raises(TypeError, match="dict of tensors"):
        layers([inputs["input_ids"]])
    # A decoder takes a dict of ready masks, one per layer type; the stages build each from a tensor.
    causal = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
    with pytest.raises(TypeError, match="'attention_mask' must be a tensor .* not dict: a dict of masks per layer"):
        layers({"input_ids": inputs["input_ids"], "attention_mask": {"full_attention": causal}})


# -- scripts/finetune_causal_lm.py --------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def finetune_process(*args: str) -> subprocess.CompletedProcess:
    """The script in a fresh interpreter: for what only a first import shows (the notes it prints)."""
    return subprocess.run([sys.executable, "scripts/finetune_causal_lm.py", *args, "--device", "cpu", "--no-progress"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def finetune(*args: str) -> subprocess.CompletedProcess:
    """The script's ``main`` in this process, its exit status and output as a process's would be: a
    fresh interpreter costs seconds of imports, and the runs compared here need none of its isolation."""
    argv = [*args, "--device", "cpu", "--no-progress"]
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            load_finetune_script().main(argv)
        except SystemExit as exit_info:
            code = exit_info.code if isinstance(exit_info.code, int) else 1
            if not isinstance(exit_info.code, int):
                print(exit_info.code, file=sys.stderr)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def save_local_model(path: Path, config) -> torch.nn.Module:
    """A model and a word-level tokenizer of the shipped text, saved as a user's local checkpoint would be."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted(set((ROOT / "offload" / "cli" / "sample.txt").read_text().split()))
    vocab = {"[UNK]": 0, **{word: i + 1 for i, word in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.save_pretrained(path)
    config.save_pretrained(path)
    # The ids the tokenizer loads with beside the config: the model type's tokenizer class may add
    # its special tokens (Qwen2's adds <|endoftext|>), and the command refuses more ids than the
    # model embeds.
    config.vocab_size = len(transformers.AutoTokenizer.from_pretrained(path))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    return model


def step_losses(done: subprocess.CompletedProcess) -> list[float]:
    return [float(line.split("loss ")[1].split()[0]) for line in done.stdout.splitlines() if line.startswith("step ")]


def test_finetune_script_trains_a_random_model_and_saves_it(tmp_path):
    done = finetune("--out", str(tmp_path / "tuned"), "--steps", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    losses = step_losses(done)
    assert len(losses) == 3 and "saved to" in done.stdout
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tuned").config.model_type == "llama"
    # The loss computed in the head (the default) against the loss computed from the logits: the same
    # training, to the printed digits.
    from_logits = finetune("--out", str(tmp_path / "from_logits"), "--steps", "3", "--loss-chunk-tokens", "0")
    assert from_logits.returncode == 0, from_logits.stderr[-3000:]
    assert step_losses(from_logits) == pytest.approx(losses, rel=0, abs=1e-4)


def test_finetune_script_on_local_weights_with_their_tokenizer(tmp_path):
    config = transformers.AutoConfig.for_model("qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    original = save_local_model(tmp_path / "base", config)
    done = finetune("--model", str(tmp_path / "base"), "--out", str(tmp_path / "tuned"), "--steps", "2",
                    "--seq-len", "16", "--untie-embeddings")
    assert done.returncode == 0, done.stderr[-3000:]
    tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tuned")
    assert not tuned.config.tie_word_embeddings
    assert not torch.equal(tuned.model.layers[0].mlp.up_proj.weight, original.model.layers[0].mlp.up_proj.weight)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "tuned")("The clock")["input_ids"] != [0, 0]


def test_finetune_script_keeps_a_tied_model_tied(tmp_path):
    save_local_model(tmp_path / "base", transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, tie_word_embeddings=True))
    done = finetune("--model", str(tmp_path / "base"), "--out", str(tmp_path / "tuned"), "--steps", "2",
                    "--seq-len", "16")
    assert done.returncode == 0, done.stderr[-3000:]
    tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tuned")
    assert tuned.config.tie_word_embeddings and tuned.lm_head.weight is tuned.transformer.wte.weight


def test_finetune_script_saves_a_byte_tokenizer_that_loads_decodes_and_trains_again(tmp_path):
    done = finetune("--out", str(tmp_path / "tuned"), "--steps", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "tuned")
    text = "The clock struck thirteen — héllo\n"
    ids = tokenizer(text)["input_ids"]
    assert ids == list(text.encode("utf-8")) and tokenizer.decode(ids) == text
    # Generation decodes as docs/huggingface.md shows.
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tuned")
    prompt = tokenizer("The clock", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert tokenizer.decode(generated[0]).startswith("The clock") and generated.shape[1] == len("The clock") + 5
    # The output is a model directory the script takes back, with no loading bars under --no-progress.
    again = finetune_process("--model", str(tmp_path / "tuned"), "--out", str(tmp_path / "again"), "--steps", "1")
    assert again.returncode == 0, again.stderr[-3000:]
    # Nor the notes torchao and bitsandbytes log as transformers imports them (offload/cli/quiet_imports.py).
    assert again.stderr == ""


def load_finetune_script() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("finetune_script", ROOT / "scripts" / "finetune_causal_lm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("device", "fragment"), [("cuda", "cuda: this machine has no CUDA device; use --device cpu"),
                                                  ("gpu0", "gpu0 is not a device: use cpu, cuda or cuda:N")])
def test_finetune_script_refuses_a_device_it_cannot_use_in_one_line(device, fragment, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        load_finetune_script().parse_args(["--out", str(tmp_path), "--device", device])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].endswith(f"argument --device: {fragment}")
