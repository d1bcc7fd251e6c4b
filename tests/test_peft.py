"""LoRA (PEFT) on an offloaded frozen base, against the ``PeftModel``'s own forward and backward.

A ``peft.get_peft_model`` model is cut with ``causal_lm_sequential`` and wrapped in ``OffloadModel``;
the reference is a deep copy of the same ``PeftModel`` run the ordinary way. Logits, loss and every
adapter gradient must be bit-identical, the frozen base must get no ``.grad`` and send nothing back
to the host, and ``save_pretrained`` must write the trained adapter. Note: [PEFT models] in
``offload/integrations/peft.py``.
"""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest
import torch

from offload import OffloadModel, OffloadOptimizer

from .helpers import DEVICES, assert_same_grads
from .test_mixed_precision import converted, master_grads_of
from .test_transformers import EXACT, FAMILIES, ROOT, VOCAB, batch, build, finetune, step_losses

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from offload.integrations.transformers import causal_lm_sequential  # noqa: E402  (needs transformers)

#: The mixtures of experts, whose experts are fused parameters.
MIXTURES = ["mixtral", "qwen2_moe", "qwen3_moe"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


#: DeepSeek's multi-head latent attention: low-rank queries, keys and values.
LATENT_ATTENTION = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


def targets(kind: str) -> str | list[str]:
    """Attention and MLP of every family: PEFT's ``"all-linear"`` (every ``nn.Linear`` but the output
    head; on Qwen2-MoE its shared expert and that expert's gate). On the other mixtures of experts
    but GPT-OSS, GraniteMoE and JetMoE (whose experts are not ``nn.Linear``) it also takes the fused
    experts or the router, which PEFT adapts through a parametrization that takes no dropout
    (``lora.ParamWrapper``, see ``test_lora_on_fused_experts``), or wraps a router that returns a
    tuple, which then fails in the model's own forward (Phi-MoE, Llama 4): those get LoRA on attention
    (on Qwen3-Next, its full attention layers)."""
    if kind in ("deepseek_v2", "deepseek_v3"):
        return LATENT_ATTENTION
    if kind in ("mixtral", "qwen3_moe", "qwen3_next", "olmoe", "glm4_moe", "dots1", "llama4_text", "phimoe"):
        return ATTENTION
    return "all-linear"


def lora(hf: torch.nn.Module, kind: str = "llama", **options) -> torch.nn.Module:
    """``hf`` with LoRA adapters. ``init_lora_weights=False`` starts ``B`` random rather than zero,
    so that ``A`` gets a gradient, and the adapters change the logits, from the first step."""
    torch.manual_seed(1)
    config = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.1, "target_modules": targets(kind),
              "init_lora_weights": False, **options}
    return peft.get_peft_model(hf, peft.LoraConfig(**config))


def labels_of(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)


def reference_step(reference, inputs, labels, seed):
    torch.manual_seed(seed)
    out = reference(**inputs, labels=labels, use_cache=False)
    out.loss.backward()
    return out.logits, out.loss


def offloaded_step(hf, model, inputs, labels, seed):
    torch.manual_seed(seed)
    logits = model(inputs)
    loss = hf.loss_function(logits=logits, labels=labels, vocab_size=hf.config.vocab_size)
    loss.backward()
    return logits, loss


def assert_same_step(peft_model, reference, model, inputs, seed=7):
    """One forward and backward of both from the same random state: logits, loss and every gradient
    (frozen parameters: none on either side) bit for bit."""
    hf = peft_model.get_base_model()
    labels = labels_of(inputs)
    want_logits, want_loss = reference_step(reference, inputs, labels, seed)
    got_logits, got_loss = offloaded_step(hf, model, inputs, labels, seed)
    torch.testing.assert_close(got_logits, want_logits, **EXACT)
    torch.testing.assert_close(got_loss, want_loss, **EXACT)
    assert_same_grads(peft_model, reference, **EXACT)


def trainable(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


@pytest.mark.parametrize("kind", FAMILIES)
def test_lora_trains_as_the_peft_models_own_forward_and_backward(kind):
    # Dropout in the model and in the adapters: the recompute draws the same masks.
    peft_model = lora(build(kind, dropout=0.1, layers=2), kind)
    reference = copy.deepcopy(peft_model)
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=3)
    optimizers = [torch.optim.AdamW(trainable(m), lr=1e-2) for m in (peft_model, reference)]
    inputs = batch()
    for step in range(2):  # the second after an update of the adapters' host copies
        assert_same_step(peft_model, reference, model, inputs, seed=step)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for (name, p), q in zip(peft_model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, **EXACT, msg=lambda m: f"{name}: {m}")
        assert p.grad is None


#: LoraConfig settings as PEFT's documentation shows them for causal LMs, one difference at a time.
VARIANTS = {
    "docs": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.05, "target_modules": "all-linear"},
    "default-init": {"init_lora_weights": True},
    "gaussian-init": {"init_lora_weights": "gaussian"},
    "bias-lora-only": {"bias": "lora_only"},
    "bias-all": {"bias": "all"},
    "rslora": {"use_rslora": True},
    "dora": {"use_dora": True, "lora_dropout": 0.0},
    "embeddings": {"target_modules": ["embed_tokens", "q_proj", "down_proj"]},
    "some-layers": {"target_modules": ["q_proj", "v_proj"], "layers_to_transform": [1]},
    "rank-pattern": {"rank_pattern": {"q_proj": 2}, "alpha_pattern": {"v_proj": 3}},
}


#: GPT-2's projections are Conv1D (weights stored transposed), which LoRA's fan_in_fan_out handles.
GPT2_VARIANTS = ["docs", "bias-lora-only", "dora", "embeddings"]


@pytest.mark.parametrize(("kind", "variant"),
                         [*(("llama", v) for v in VARIANTS), *(("gpt2", v) for v in GPT2_VARIANTS)])
def test_lora_config_variants(kind, variant):
    options = dict(VARIANTS[variant])
    if kind == "gpt2" and isinstance(options.get("target_modules"), list):
        # GPT-2's own names: its Conv1D projections, and its embedding where the variant adapts one.
        embedding = ["wte"] if "embed_tokens" in options["target_modules"] else []
        options["target_modules"] = [*embedding, "c_attn", "c_proj"]
    peft_model = lora(build(kind, layers=2), kind, **options)
    reference = copy.deepcopy(peft_model)
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=3)
    optimizers = [torch.optim.SGD(trainable(m), lr=0.1, fused=True) for m in (peft_model, reference)]
    for step in range(2):  # with PEFT's default init, B is zero and A gets a gradient from the second step
        assert_same_step(peft_model, reference, model, batch(), seed=step)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    torch.testing.assert_close(list(peft_model.parameters()), list(reference.parameters()), **EXACT)


@pytest.mark.parametrize("loss_chunk_tokens", [8, 1024])
def test_dropout_on_the_head_with_the_loss_in_the_head(loss_chunk_tokens):
    """LoRA with dropout on lm_head, the loss computed in the head chunk by chunk: each chunk's
    recompute replays its forward's dropout (the adapters' gradients are the PeftModel's, to the
    rounding of the chunked loss), and backward leaves the generator where the PeftModel's does."""
    from offload.integrations.causal_lm import OffloadedCausalLM

    peft_model = lora(build("llama", layers=2), "llama", target_modules=["lm_head", "q_proj"])
    reference = copy.deepcopy(peft_model)
    model = OffloadedCausalLM(peft_model, device="cpu", num_slices=3, loss_chunk_tokens=loss_chunk_tokens)
    inputs = batch()
    labels = labels_of(inputs)
    torch.manual_seed(3)
    want = reference(**inputs, labels=labels, use_cache=False).loss
    want.backward()
    after_reference = torch.rand(3)
    torch.manual_seed(3)
    got = model(**inputs, labels=labels).loss
    got.backward()
    torch.testing.assert_close(torch.rand(3), after_reference, **EXACT)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)
    # One chunk holds the batch at 1024 tokens: bit for bit; smaller chunks sum the loss otherwise.
    tolerance = EXACT if loss_chunk_tokens == 1024 else {"rtol": 1e-5, "atol": 1e-7}
    assert_same_grads(peft_model, reference, **tolerance)


@pytest.mark.parametrize("kind", ["llama", "gpt_neox"])
def test_modules_to_save_train_in_full(kind):
    # The head and the embeddings as full trainable copies (PEFT's ModulesToSaveWrapper) beside LoRA.
    names = ["lm_head", "embed_tokens" if kind == "llama" else "embed_in"]
    peft_model = lora(build(kind, layers=2), kind, modules_to_save=names)
    reference = copy.deepcopy(peft_model)
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=3)
    assert_same_step(peft_model, reference, model, batch())
    saved = [n for n, p in peft_model.named_parameters() if "modules_to_save" in n and p.grad is not None]
    assert len(saved) == 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["llama", "gpt2", "gemma3_text"])
def test_under_a_compute_dtype(kind, device):
    peft_model = lora(build(kind, layers=2), kind)
    reference = converted(peft_model, torch.bfloat16).to(device)
    model = OffloadModel(causal_lm_sequential(peft_model), device=device, num_slices=3, compute_dtype=torch.bfloat16)
    inputs = batch(device)
    labels = labels_of(inputs)
    want_logits, want_loss = reference_step(reference, inputs, labels, 7)
    got_logits, got_loss = offloaded_step(peft_model.get_base_model(), model, inputs, labels, 7)
    assert got_logits.dtype == torch.bfloat16
    torch.testing.assert_close(got_logits, want_logits, **EXACT)
    torch.testing.assert_close(got_loss, want_loss, **EXACT)
    assert_same_grads(peft_model, master_grads_of(reference), **EXACT)
    assert all(p.dtype == torch.float32 for p in peft_model.parameters())  # the masters stay float32


def test_offload_optimizer_steps_the_adapters_only():
    peft_model = lora(build("llama", layers=3))
    reference = copy.deepcopy(peft_model)
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=3)
    # Given every parameter, as OffloadOptimizer(model, ...) does by default: the frozen ones get no
    # gradient, so AdamW neither steps them nor keeps state for them.
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    plain = torch.optim.AdamW(trainable(reference), lr=1e-2)
    inputs = batch()
    frozen = {name: p.detach().clone() for name, p in peft_model.named_parameters() if not p.requires_grad}
    for step in range(3):
        assert_same_step(peft_model, reference, model, inputs, seed=step)
        optimizer.step()
        plain.step()
        optimizer.zero_grad()
        plain.zero_grad()
    optimizer.synchronize()
    torch.testing.assert_close(list(peft_model.parameters()), list(reference.parameters()), **EXACT)
    stepped = {id(p) for p, state in optimizer.state.items() if state}
    assert stepped == {id(p) for p in trainable(peft_model)}
    for name, p in peft_model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name])


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])
def test_lora_with_the_masters_on_disk_trains_as_with_them_in_ram(kind, tmp_path):
    from offload import DiskTier

    runs = []
    for masters in (None, DiskTier(tmp_path)):
        peft_model = lora(build(kind, layers=2, dropout=0.0), kind)
        model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=3,
                             compute_dtype=torch.bfloat16, masters=masters)
        runs.append((peft_model, model, OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)))
    inputs = batch()
    labels = labels_of(inputs)
    for step in range(3):
        losses = [offloaded_step(peft_model.get_base_model(), model, inputs, labels, step)[1]
                  for peft_model, model, _ in runs]
        torch.testing.assert_close(losses[1], losses[0], **EXACT)
        for _, _, optimizer in runs:
            optimizer.step()
            optimizer.zero_grad()
    for _, _, optimizer in runs:
        optimizer.synchronize()  # the parameters are read through the PeftModel, not the OffloadModel
    assert sum(s.storage.masters_file.resident_bytes() for s in runs[1][1]._engine.slices) == 0
    torch.testing.assert_close(list(runs[1][0].parameters()), list(runs[0][0].parameters()), **EXACT)


def nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_a_frozen_base_sends_only_adapter_gradients_back(num_microbatches):
    peft_model = lora(build("llama", dropout=0.0, layers=4))
    # One stage per slice: the embeddings (frozen), four decoder layers, the head.
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=6,
                         num_microbatches=num_microbatches)
    engine = model._engine
    model(batch())  # forward only: nothing goes to the host but boundary activations
    loaded, offloaded = engine.traffic()
    logits = model(batch())
    after_forward = engine.traffic()
    loads = engine.slots.loads
    logits.float().square().mean().backward()
    after_backward = engine.traffic()
    # Backward reloads the slices from the first with a trainable parameter on, but for the last
    # two, still in the two slots from forward: the frozen embeddings have nothing to differentiate.
    first = next(s.index for s in engine.slices
                 if any(p.requires_grad for layer in s.layers for p in layer.parameters()))
    assert first == 1 and engine.slots.loads - loads == engine.num_slices - 2 - first
    # Backward sends exactly the adapters' gradients back, one copy of each; the base stays put.
    assert after_backward[1] - after_forward[1] == nbytes(trainable(peft_model))
    assert engine.gradients.offloaded_bytes == nbytes(trainable(peft_model))
    # Loads are the same whether the base is frozen or not: each forward loads every slice once.
    assert after_forward[0] - loaded == loaded
    assert all(p.grad is None for p in peft_model.parameters() if not p.requires_grad)
    footprint = model.memory_footprint()
    if num_microbatches == 1:
        assert footprint.device_gradients == 0
    else:
        # The summation buffers hold a slice's adapter gradients, not its frozen weights.
        biggest = max(nbytes(p for layer in s.layers for p in layer.parameters() if p.requires_grad)
                      for s in engine.slices)
        assert biggest < footprint.device_gradients <= 2 * (biggest + 64 * 32)
        # Sized for every parameter of a slice, they would take more than twice as much.
        whole = max(nbytes(p for layer in s.layers for p in layer.parameters()) for s in engine.slices)
        assert footprint.device_gradients < whole


def test_a_parameter_unfrozen_later_gets_its_gradient():
    # The summation buffers grow when more gradients are needed than when they were allocated.
    peft_model = lora(build("llama", dropout=0.0, layers=2), lora_dropout=0.0)
    reference = copy.deepcopy(peft_model)
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=2, num_microbatches=2)
    inputs = {key: value[:2] for key, value in batch().items()}
    model(inputs).sum().backward()
    small = model.memory_footprint().device_gradients
    for m in (peft_model, reference):
        m.zero_grad()
        m.get_base_model().model.layers[0].mlp.down_proj.base_layer.weight.requires_grad_(True)
    model(inputs).sum().backward()
    for row in range(2):  # as the microbatches run: a row at a time, their gradients added
        reference(**{key: value[row:row + 1] for key, value in inputs.items()}, use_cache=False).logits.sum().backward()
    assert_same_grads(peft_model, reference, **EXACT)
    assert model.memory_footprint().device_gradients > small


def test_save_pretrained_writes_the_trained_adapter(tmp_path):
    peft_model = lora(build("llama", layers=2), init_lora_weights=True)
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=2)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    for _ in range(2):
        offloaded_step(peft_model.get_base_model(), model, batch(), labels_of(batch()), 0)
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    peft_model.save_pretrained(tmp_path)
    loaded = peft.PeftModel.from_pretrained(build("llama", layers=2), tmp_path)
    trained = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    assert trained and all(not torch.equal(p, torch.zeros_like(p)) for n, p in trained.items() if "lora_B" in n)
    got = dict(loaded.named_parameters())
    for name, p in trained.items():
        torch.testing.assert_close(got[name], p, **EXACT)
    peft_model.eval()
    loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(batch()), loaded(**batch(), use_cache=False).logits, **EXACT)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_adapters_added_after_wrapping(kind):
    hf = build(kind, layers=2)
    reference = lora(copy.deepcopy(hf), kind)
    layers = causal_lm_sequential(hf)
    model = OffloadModel(layers, device="cpu", num_slices=3)
    model(batch())  # a forward before the adapters: the slices are laid out without them
    peft_model = lora(hf, kind)  # injects adapter modules into the layers the slices run
    assert_same_step(peft_model, reference, model, batch())
    adapter = next(n for n, _ in model.named_parameters() if "lora_A" in n)
    assert layers.hf_name(adapter) in {n for n, _ in hf.named_parameters()}
    assert nbytes(trainable(hf)) == model._engine.gradients.offloaded_bytes


# -- what causal_lm_sequential accepts ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma2", "phi", "gpt2", "gpt_neox"])
def test_peft_models_and_their_tuners_are_cut_as_their_base_model(kind):
    # The Llama-layout families failed with "no attribute 'rotary_emb'": the PeftModel's attribute
    # lookup found the LoraModel's `model`, the ForCausalLM, rather than the decoder.
    peft_model = lora(build(kind, layers=1), kind)
    for wrapped in (peft_model, peft_model.base_model):
        layers = causal_lm_sequential(wrapped)
        assert layers.hf_model is peft_model.get_base_model()
        assert {id(p) for p in layers.parameters()} == {id(p) for p in peft_model.parameters()}


def test_prompt_learning_peft_models_are_refused():
    hf = build("llama", layers=1)
    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    with pytest.raises(ValueError, match=r"prompt-learning adapter \(PROMPT_TUNING\).*\(LoRA"):
        causal_lm_sequential(peft.get_peft_model(hf, config))


def test_trainable_tokens_on_a_tied_embedding_are_refused_saying_what_trains_instead():
    from offload.integrations.causal_lm import OffloadedCausalLM

    with pytest.raises(ValueError, match=r"trainable tokens .*modules_to_save=\['embed_tokens'\]"):
        OffloadedCausalLM(lora(build("gemma", tied=True, layers=1), "gemma", trainable_token_indices=[3, 5]),
                          device="cpu", num_slices=2)
    # Cut by causal_lm_sequential, it reached OffloadModel, whose layout refused "buffer 'default'"
    # with advice about slices.
    with pytest.raises(ValueError, match=r"trainable tokens .*modules_to_save=\['embed_tokens'\]"):
        causal_lm_sequential(lora(build("gemma", tied=True, layers=1), "gemma", trainable_token_indices=[3, 5]))
    # What the message advises trains as the PeftModel does.
    peft_model = lora(build("gemma", tied=True, layers=1), "gemma", modules_to_save=["embed_tokens"]).eval()
    reference = copy.deepcopy(peft_model)
    model = OffloadedCausalLM(peft_model, device="cpu", num_slices=2)
    inputs = batch()
    labels = labels_of(inputs)
    torch.testing.assert_close(model(**inputs, labels=labels).loss, reference(**inputs, labels=labels).loss, **EXACT)


def test_activated_lora_is_refused():
    config = peft.LoraConfig(r=2, target_modules=["q_proj"], alora_invocation_tokens=[5, 6])
    with pytest.raises(ValueError, match="activated LoRA"):
        causal_lm_sequential(peft.get_peft_model(build("llama", layers=1), config))


def test_a_refused_adapter_is_refused_active_or_not():
    # An activated LoRA beside the active adapter was accepted: set_adapter("act") then switched it
    # on unseen, and the stages ran it as a plain LoRA (logits 0.4 from the PeftModel's).
    peft_model = lora(build("llama", layers=1), target_modules=["q_proj"])
    peft_model.add_adapter("act", peft.LoraConfig(r=2, target_modules=["q_proj"], alora_invocation_tokens=[5, 6],
                                                 task_type="CAUSAL_LM"))
    assert peft_model.active_adapters == ["default"]
    with pytest.raises(ValueError, match=r"activated LoRA .*'act' active or not.*delete_adapter\('act'\)"):
        causal_lm_sequential(peft_model)


#: Methods refused at the cut, by what their config needs (a tied embedding) and the message's words.
INJECTED_AFTER_WRAPPING = {
    "activated LoRA": (False, lambda: peft.LoraConfig(r=2, target_modules=["q_proj"], alora_invocation_tokens=[5, 6],
                                                      task_type="CAUSAL_LM"),
                       r"activated LoRA \(alora_invocation_tokens\)"),
    "AdaLoRA": (False, lambda: peft.AdaLoraConfig(init_r=4, target_r=2, target_modules=["q_proj"], total_step=4),
                r"AdaLoRA adapter whose orth_reg_weight is 0\.5: .*AdaLoraConfig\(orth_reg_weight=0\)"),
    "VeRA": (False, lambda: peft.VeraConfig(r=4, target_modules=["q_proj", "o_proj"]),
             r"VeRA adapter: .*same frozen random projections.*Use LoRA"),
    "RandLoRA": (False, lambda: peft.RandLoraConfig(r=4, target_modules=["q_proj", "o_proj"]),
                 r"RandLoRA adapter: .*same frozen random projections.*Use LoRA"),
    "trainable tokens": (True, lambda: peft.LoraConfig(r=2, target_modules=["q_proj"], trainable_token_indices=[3, 5]),
                         r"trainable tokens .*modules_to_save=\['embed_tokens'\]"),
}


@pytest.mark.parametrize("wrapper", ["causal_lm_sequential", "OffloadedCausalLM"])
@pytest.mark.parametrize("method", list(INJECTED_AFTER_WRAPPING))
def test_methods_injected_after_wrapping_are_refused_as_at_wrapping(method, wrapper):
    # get_peft_model on the wrapped model (docs/lora.md, "Adapters added after wrapping") bypassed
    # the refusals: an activated LoRA trained as a plain LoRA (logits 0.4 from the PeftModel's), an
    # AdaLoRA without its penalty (loss 4.57 where the PeftModel's was 59.3); VeRA, RandLoRA and tied
    # trainable tokens met the layout's "buffer 'default' is registered in an earlier slice too".
    from offload.integrations.causal_lm import OffloadedCausalLM

    tied, config, message = INJECTED_AFTER_WRAPPING[method]
    hf = build("llama", dropout=0.0, tied=tied, layers=2)
    trainers_model = wrapper == "OffloadedCausalLM"
    model = (OffloadedCausalLM(hf, device="cpu", num_slices=3) if trainers_model
             else OffloadModel(causal_lm_sequential(hf), device="cpu", num_slices=3))

    def forward():
        return model(**batch()) if trainers_model else model(batch())

    forward()
    peft.get_peft_model(hf, config())
    for _ in range(2):  # refused again: the refusal left the slices as they were laid out
        with pytest.raises(ValueError, match=message):
            forward()


def test_an_activated_lora_added_after_wrapping_is_refused_until_deleted():
    # Added beside the trained adapter and switched on with set_adapter, it ran as a plain LoRA.
    peft_model = lora(build("llama", layers=2), target_modules=["q_proj", "v_proj"])
    reference = copy.deepcopy(peft_model)
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=3)
    assert_same_step(peft_model, reference, model, batch(), seed=0)
    peft_model.add_adapter("act", peft.LoraConfig(r=2, target_modules=["q_proj"], alora_invocation_tokens=[5, 6],
                                                 task_type="CAUSAL_LM"))
    peft_model.set_adapter("act")
    with pytest.raises(ValueError, match=r"activated LoRA .*'act' active or not"):
        model(batch())
    peft_model.set_adapter("default")
    peft_model.delete_adapter("act")
    assert_same_step(peft_model, reference, model, batch(), seed=1)  # gradients added to the first step's


def test_a_buffer_in_two_slices_is_named_from_its_layer_down():
    # The message named the buffer "default", the key of VeRA's BufferDict, which every adapted layer holds.
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x)

    layers = torch.nn.Sequential(Block(), Block())
    peft.get_peft_model(layers, peft.VeraConfig(r=2, target_modules=["proj"]))
    with pytest.raises(ValueError, match=r"buffer 'proj\.vera_A\.default' is registered in an earlier slice too; "
                                         r".*\(this one a Block\)"):
        OffloadModel(layers, device="cpu", num_slices=2)


def adalora(hf: torch.nn.Module, **options) -> torch.nn.Module:
    """``hf`` with AdaLoRA adapters whose ranks are pruned from the second step on."""
    torch.manual_seed(1)
    config = {"init_r": 4, "target_r": 2, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "total_step": 4,
              "tinit": 1, "tfinal": 1, "deltaT": 1, **options}
    return peft.get_peft_model(hf, peft.AdaLoraConfig(**config))


def test_adalora_with_its_orthogonality_penalty_is_refused():
    # AdaLoraModel.forward adds orth_reg_weight times a penalty over the adapters to the loss: a
    # stage's loss without it was 4.58 where the PeftModel's was 61.0, with other gradients.
    peft_model = adalora(build("llama", layers=1))
    for wrapped in (peft_model, peft_model.base_model):
        with pytest.raises(ValueError, match=r"AdaLoRA adapter whose orth_reg_weight is 0\.5: .*"
                                             r"AdaLoraConfig\(orth_reg_weight=0\).* or use LoRA"):
            causal_lm_sequential(wrapped)


def test_adalora_without_the_penalty_trains_as_the_peft_model():
    """With ``orth_reg_weight=0`` the PeftModel adds zero to the loss: steps, rank allocation
    (``update_and_allocate`` masks the host copies of ``lora_E`` in place) and all, bit for bit."""
    peft_model = adalora(build("llama", layers=2), orth_reg_weight=0.0)
    reference = copy.deepcopy(peft_model)
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=3)
    optimizers = [torch.optim.AdamW(trainable(m), lr=1e-2) for m in (peft_model, reference)]
    for step in range(4):
        assert_same_step(peft_model, reference, model, batch(), seed=step)
        for optimizer, m in zip(optimizers, (peft_model, reference)):
            optimizer.step()
            m.base_model.update_and_allocate(step)
            optimizer.zero_grad()
    assert any(bool((p == 0).any()) for name, p in peft_model.named_parameters() if "lora_E" in name)  # pruned
    for (name, p), q in zip(peft_model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, **EXACT, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize(("method", "config", "why"), [
    ("SHADOW", lambda: peft.ShadowConfig(task_type="CAUSAL_LM"), "hooks on the model's forward"),
    ("VeRA", lambda: peft.VeraConfig(r=4, target_modules=["q_proj", "o_proj"]), "same frozen random projections"),
    ("PVeRA", lambda: peft.PveraConfig(r=4, target_modules=["q_proj", "o_proj"]), "same frozen random projections"),
    ("RandLoRA", lambda: peft.RandLoraConfig(r=4, target_modules=["q_proj", "o_proj"]),
     "same frozen random projections"),
])
def test_methods_the_stages_cannot_run_are_refused_saying_what_to_use(method, config, why):
    # SHADOW trained nothing ("element 0 of tensors does not require grad"): its shadow network is
    # driven by hooks the stages never call. VeRA's shared buffer was refused with advice about
    # slices, which a causal_lm_sequential or OffloadedCausalLM user cannot follow.
    if not hasattr(peft, "ShadowConfig") and method == "SHADOW":
        pytest.skip("this peft has no SHADOW method")
    peft_model = peft.get_peft_model(build("llama", layers=2), config())
    with pytest.raises(ValueError, match=rf"cannot cut a PeftModel with a {method} adapter: .*{why}.*Use LoRA "
                                         r"\(LoraConfig\)"):
        causal_lm_sequential(peft_model)


def test_gpt2_double_heads_is_refused():
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=VOCAB, n_positions=64)
    with pytest.raises(ValueError, match="GPT2DoubleHeadsModel is not a GPT2LMHeadModel.*AutoModelForCausalLM"):
        causal_lm_sequential(transformers.GPT2DoubleHeadsModel(config))


class OwnForward(transformers.LlamaForCausalLM):
    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


class OwnDecoder(transformers.LlamaModel):
    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


class ExtraMethod(transformers.LlamaForCausalLM):
    def describe(self) -> str:
        return "a causal LM with one more method"


def test_classes_that_override_forward_are_refused():
    config = build("llama", layers=1).config
    with pytest.raises(ValueError, match="OwnForward overrides LlamaForCausalLM.forward"):
        causal_lm_sequential(OwnForward(config))
    model = transformers.LlamaForCausalLM(config)
    model.model = OwnDecoder(config)
    with pytest.raises(ValueError, match="OwnDecoder overrides LlamaModel.forward"):
        causal_lm_sequential(model)
    # A subclass that keeps the forward computes what the family computes.
    extra = ExtraMethod(config)
    reference = copy.deepcopy(extra)
    extra.eval()
    reference.eval()
    with torch.no_grad():
        got = OffloadModel(causal_lm_sequential(extra), device="cpu", num_slices=2)(batch())
        torch.testing.assert_close(got, reference(**batch(), use_cache=False).logits, **EXACT)


# -- scripts/finetune_causal_lm.py --lora-r ------------------------------------------------------------


def finetune_script():
    spec = importlib.util.spec_from_file_location("finetune_causal_lm", ROOT / "scripts" / "finetune_causal_lm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_finetune_script_trains_and_saves_a_lora_adapter(tmp_path):
    done = finetune("--out", str(tmp_path / "adapter"), "--steps", "3", "--lora-r", "4", "--lora-dropout", "0.1",
                    "--lora-targets", "q_proj", "v_proj", "down_proj")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LoRA rank 4 on down_proj, q_proj, v_proj" in done.stdout and len(step_losses(done)) == 3
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert not (tmp_path / "adapter" / "model.safetensors").exists()  # the adapter only, not the base
    # The base the script built (its seed, its random-initialised tiny Llama), with the adapter loaded back.
    torch.manual_seed(0)
    base, _ = finetune_script().random_model("llama", "tiny", 256, 64)
    untouched = copy.deepcopy(base)
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    adapters = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert len(adapters) == 2 * 3 * 4  # A and B, three targets, four layers
    # PEFT starts B at zero; three AdamW steps moved every one.
    assert all(p.abs().sum() > 0 for n, p in adapters.items() if "lora_B" in n)
    base_weights = {n.replace(".base_layer", ""): p for n, p in loaded.get_base_model().state_dict().items()
                    if "lora_" not in n}
    assert base_weights.keys() == untouched.state_dict().keys()
    for name, p in untouched.state_dict().items():
        assert torch.equal(base_weights[name], p), name


def test_finetune_script_refuses_a_negative_rank(tmp_path):
    done = finetune("--out", str(tmp_path), "--lora-r", "-1")
    assert done.returncode == 2 and "--lora-r must be 0 (off) or a positive rank" in done.stderr


def test_untying_a_frozen_embedding_keeps_the_heads_copy_frozen():
    peft_model = lora(build("gpt2", tied=True, layers=1), "gpt2")
    layers = causal_lm_sequential(peft_model, untie_embeddings=True)
    hf = peft_model.get_base_model()
    assert hf.lm_head.weight is not hf.transformer.wte.weight and not hf.lm_head.weight.requires_grad
    model = OffloadModel(layers, device="cpu", num_slices=2)
    offloaded_step(hf, model, batch(), labels_of(batch()), 0)
    assert hf.lm_head.weight.grad is None and model._engine.gradients.offloaded_bytes == nbytes(trainable(hf))


def test_bench_lora_records_the_bytes_a_frozen_base_saves(tmp_path, monkeypatch):
    # In this process (what it records does not depend on the process; the imports are paid once).
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # for its json_output.py
    spec = importlib.util.spec_from_file_location("bench_lora_under_test", ROOT / "benchmarks" / "bench_lora.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "lora.json"
    bench.main(["--hidden", "64", "--layers", "2", "--vocab", "300", "--seq-len", "16", "--lora-r", "2",
                "--json", str(out)])
    results = json.loads(out.read_text())["results"]
    full, lora_fp32, lora_bf16 = results["full"], results["lora"], results["lora_bf16_base"]
    assert full["trainable_parameters"] == full["parameters"] > lora_fp32["trainable_parameters"] > 0
    # Full fine-tuning, as documented: 4 B host copy, 2 B shadow, 4 B gradient, 8 B AdamW state.
    assert full["host_bytes_per_base_parameter"] == pytest.approx(18.0, abs=0.01)
    for lora in (lora_fp32, lora_bf16):
        assert lora["per_step"]["offloaded_gradients"] == lora["host_gradients"]
        assert lora["host_gradients"] == 4 * lora["trainable_parameters"]
        assert lora["memory_footprint"]["device_gradients"] < full["memory_footprint"]["device_gradients"]
    assert lora_bf16["memory_footprint"]["host_copies"] < lora_fp32["memory_footprint"]["host_copies"]


#: The fused experts' parameters, as PEFT's ``target_parameters`` names them.
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


#: The mixtures of experts whose fused experts PEFT adapts by name (``EXPERTS``).
FUSED_EXPERTS = [*MIXTURES, "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe", "dots1", "qwen3_next", "gpt_oss",
                 "phimoe"]


@pytest.mark.parametrize("kind,config", [*((kind, "target_parameters") for kind in FUSED_EXPERTS),
                                         *((kind, "all-linear") for kind in MIXTURES)])
def test_lora_on_fused_experts(kind, config):
    # PEFT adapts fused experts (and, under all-linear, the router) through a parametrization it
    # registers and removes inside the layer's forward (lora.ParamWrapper, which takes no dropout).
    attention = targets(kind) if isinstance(targets(kind), list) else ATTENTION  # DeepSeek's latent attention
    options = ({"target_modules": attention, "target_parameters": EXPERTS} if config == "target_parameters"
               else {"target_modules": "all-linear"})
    peft_model = lora(build(kind, dropout=0.0, layers=2), kind, lora_dropout=0.0, **options)
    reference = copy.deepcopy(peft_model)
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=3)
    optimizers = [torch.optim.AdamW(trainable(m), lr=1e-2, fused=True) for m in (peft_model, reference)]
    for step in range(2):
        assert_same_step(peft_model, reference, model, batch(), seed=step)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    # Every parameter registered as in the plain model (PEFT's parametrization re-registers GPT-OSS's
    # expert weights after their biases there too).
    assert [n for n, _ in peft_model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    torch.testing.assert_close(list(peft_model.parameters()), list(reference.parameters()), **EXACT)
    if config == "target_parameters" or kind != "qwen2_moe":  # all-linear adapts Qwen2-MoE's shared expert only
        assert any(".experts." in n and p.requires_grad for n, p in peft_model.named_parameters())


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_estimate_memory_counts_gradients_and_state_for_the_adapters_only(compute_dtype):
    # A LoRA model's frozen base has no .grad, no gradient buffers and no optimizer state: the
    # estimate made from the cut model, before wrapping, matches what training then holds.
    from offload import estimate_memory

    sequential = causal_lm_sequential(lora(build("llama", layers=3)))
    plan = estimate_memory(sequential, num_slices=3, optimizer="adamw", device="cpu", compute_dtype=compute_dtype)
    model = OffloadModel(sequential, device="cpu", num_slices=3, compute_dtype=compute_dtype)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    for _ in range(2):
        logits = model(batch())
        logits.float().logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    optimizer.synchronize()
    footprint = model.memory_footprint()
    for category in ("masters", "shadows", "gradients", "optimizer_state"):
        assert plan.host_categories()[category] == footprint.host_categories()[category], category
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert footprint.host_optimizer_state == 8 * adapters
