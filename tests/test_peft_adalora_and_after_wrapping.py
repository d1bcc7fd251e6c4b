"""PEFT methods whose trouble no layout shows: AdaLoRA's ``update_and_allocate`` under
``OffloadOptimizer``, and adapters injected after wrapping that change nothing inside the slices
(prompt learning, ``layer_replication``); and LoRA on a tied embedding with ``ensure_weight_tying``.
Note: [PEFT models] in ``offload/integrations/peft.py``, rules 2, 7 and 8.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

from offload import OffloadModel, OffloadOptimizer
from offload.model import engine_of

from .test_peft import assert_same_step, trainable
from .test_transformers import EXACT, batch, build

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from offload.integrations.causal_lm import OffloadedCausalLM  # noqa: E402  (needs transformers)
from offload.integrations.transformers import causal_lm_sequential  # noqa: E402


def wrap(hf: torch.nn.Module, wrapper: str) -> torch.nn.Module:
    """``hf`` wrapped as users wrap it, after one forward (the slices laid out without adapters)."""
    if wrapper == "OffloadedCausalLM":
        model = OffloadedCausalLM(hf, device="cpu", num_slices=3)
        model(**batch())
    else:
        model = OffloadModel(causal_lm_sequential(hf), device="cpu", num_slices=3)
        model(batch())
    return model


WRAPPERS = ["causal_lm_sequential", "OffloadedCausalLM"]


# -- AdaLoRA under OffloadOptimizer (rule 7) ---------------------------------------------------------


class LateAdamW(torch.optim.AdamW):
    """AdamW whose every update starts 20 ms late, as a large slice's takes long: the updates
    ``step()`` hands to the worker are still running when ``update_and_allocate`` comes."""

    def step(self, closure=None):
        time.sleep(0.02)
        return super().step(closure)


@pytest.fixture
def peft_update_and_allocate(monkeypatch):
    """PEFT's own ``AdaLoraModel.update_and_allocate`` for the test, so that each test finds AdaLoRA
    (at the cut, or injected after wrapping) and makes it wait itself, not an earlier test."""
    from peft.tuners.adalora import AdaLoraModel

    method = AdaLoraModel.update_and_allocate
    monkeypatch.setattr(AdaLoraModel, "update_and_allocate", getattr(method, "__wrapped__", method))


def adalora(hf: torch.nn.Module) -> torch.nn.Module:
    """``hf`` with AdaLoRA adapters (no orthogonality penalty) whose ranks are pruned from the second step on."""
    torch.manual_seed(1)
    return peft.get_peft_model(hf, peft.AdaLoraConfig(
        init_r=4, target_r=2, lora_alpha=8, target_modules=["q_proj", "v_proj"], total_step=8, tinit=1, tfinal=2,
        deltaT=1, orth_reg_weight=0.0))


@pytest.mark.parametrize("injected", [False, True], ids=["cut from the PeftModel", "injected after wrapping"])
def test_adalora_under_offload_optimizer_trains_as_the_peft_model(injected, peft_update_and_allocate):
    # PEFT's loop calls update_and_allocate right after step(); it read the adapters and masked
    # lora_E through the tuner while the host updates step() handed over were still running: the
    # adapters drifted from the PeftModel's (0.07 after 8 steps), silently and not on every run.
    hf = build("llama", dropout=0.0, layers=2)
    reference = adalora(copy.deepcopy(hf))
    if injected:
        model = wrap(hf, "causal_lm_sequential")
        peft_model = adalora(hf)
    else:
        peft_model = adalora(hf)
        model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=3)
    optimizer = OffloadOptimizer(model, LateAdamW, lr=1e-2, fused=True)
    reference_optimizer = torch.optim.AdamW(trainable(reference), lr=1e-2, fused=True)
    pending_after_step = 0
    for step in range(8):
        assert_same_step(peft_model, reference, model, batch(), seed=step)
        optimizer.step()
        reference_optimizer.step()
        pending_after_step += engine_of(model).updates.pending()
        peft_model.base_model.update_and_allocate(step)
        reference.base_model.update_and_allocate(step)
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
    assert pending_after_step >= 6  # the race was there to lose: all steps but the first overlap
    optimizer.synchronize()
    assert any(bool((p == 0).any()) for name, p in peft_model.named_parameters() if "lora_E" in name)  # pruned
    for (name, p), q in zip(peft_model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, **EXACT, msg=lambda m: f"{name}: {m}")


# -- what no layout shows, injected after wrapping (rule 8) -----------------------------------------


PROMPT_LEARNING = {
    "PROMPT_TUNING": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    "PREFIX_TUNING": lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    "P_TUNING": lambda: peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, encoder_hidden_size=8),
}


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("method", list(PROMPT_LEARNING))
def test_prompt_learning_injected_after_wrapping_is_refused(method, wrapper):
    # Accepted, the wrapper ran the bare model: the loss without the virtual tokens, no trainable
    # parameter, and backward failed with "element 0 of tensors does not require grad".
    hf = build("llama", dropout=0.0, layers=2).eval()
    bare = copy.deepcopy(hf)
    model = wrap(hf, wrapper)
    with pytest.raises(ValueError, match=rf"prompt-learning adapter \({method}\) around a Hugging Face model that "
                                         r"was cut into stages .*the bare model.*\(LoRA, DoRA"):
        peft.get_peft_model(hf, PROMPT_LEARNING[method]())
    assert "peft_config" not in hf.__dict__  # refused before PEFT changed the model
    inputs = batch()
    with torch.no_grad():
        got = model(**inputs).logits if wrapper == "OffloadedCausalLM" else model(inputs)
    torch.testing.assert_close(got, bare(**inputs, use_cache=False).logits, **EXACT)


def test_a_saved_prompt_loaded_onto_a_wrapped_model_is_refused_and_accepted_once_unwrapped(tmp_path):
    # Loaded for evaluation, the trained prompt was ignored by the offloaded logits.
    hf = build("llama", dropout=0.0, layers=2)
    peft.get_peft_model(copy.deepcopy(hf), PROMPT_LEARNING["PROMPT_TUNING"]()).save_pretrained(tmp_path)
    model = wrap(hf, "OffloadedCausalLM")
    with pytest.raises(ValueError, match=r"prompt-learning adapter \(PROMPT_TUNING\)"):
        peft.PeftModel.from_pretrained(model.hf_model, tmp_path)
    del model  # the PeftModel runs the model itself once no stages do
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path)
    assert peft_model.get_base_model() is hf


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_layer_replication_injected_after_wrapping_is_refused(wrapper):
    # PEFT set a new list of copied layers on the decoder; the stages kept running the 2 old ones
    # without adapters (eval loss 4.574 where the PeftModel's was 4.602; training: "element 0 of
    # tensors does not require grad").
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                             layer_replication=[[0, 2], [1, 2]])
    hf = build("llama", dropout=0.0, layers=2)
    layers = hf.model.layers
    model = wrap(hf, wrapper)  # noqa: F841  (refused while the stages live)
    message = (r"LlamaModel\.layers, the decoder's list of layers, is being replaced after the model was cut into "
               r"stages .*LoraConfig\(layer_replication=\.\.\.\).*Call peft\.get_peft_model\(hf_model, config\) "
               r"before wrapping")
    with pytest.raises(ValueError, match=message):
        peft.get_peft_model(hf, config)
    assert hf.model.layers is layers and hf.config.num_hidden_layers == 2 and "peft_config" not in hf.__dict__


def test_layer_replication_before_wrapping_trains_and_a_second_one_after_is_refused():
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                             layer_replication=[[0, 2], [1, 2]])
    torch.manual_seed(1)
    peft_model = peft.get_peft_model(build("llama", dropout=0.0, layers=2), config)
    reference = copy.deepcopy(peft_model)
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=3)
    assert_same_step(peft_model, reference, model, batch())
    with pytest.raises(ValueError, match=r"decoder's list of layers, is being replaced"):
        peft_model.add_adapter("more", config)
    assert list(peft_model.peft_config) == ["default"]


# -- LoRA on a tied embedding with ensure_weight_tying (rule 2) --------------------------------------


def tied_lora(ensure_weight_tying: bool, hf: torch.nn.Module | None = None) -> torch.nn.Module:
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"], init_lora_weights=False,
                             ensure_weight_tying=ensure_weight_tying)
    return peft.get_peft_model(build("gemma", dropout=0.0, tied=True, layers=1) if hf is None else hf, config)


TIED_LORA = (r"a LoRA on a tied embedding with ensure_weight_tying=True: PEFT gives lm_head the embedding's LoRA "
             r"matrices .*Pass ensure_weight_tying=False .*modules_to_save=\['embed_tokens'\]")


@pytest.mark.parametrize("wrapper", ["causal_lm_sequential", "OffloadedCausalLM", "injected after wrapping"])
def test_lora_on_a_tied_embedding_with_ensure_weight_tying_is_refused_saying_what_to_use(wrapper):
    # Refused by the layout: "two tensors over the same memory (as after head.weight =
    # nn.Parameter(emb.weight)) ... assign the same nn.Parameter object", which a PEFT user never did.
    with pytest.raises(ValueError, match=TIED_LORA):
        if wrapper == "causal_lm_sequential":
            causal_lm_sequential(tied_lora(True))
        elif wrapper == "OffloadedCausalLM":
            OffloadedCausalLM(tied_lora(True), device="cpu", num_slices=2)
        else:
            hf = build("gemma", dropout=0.0, tied=True, layers=1)
            model = wrap(hf, "causal_lm_sequential")
            tied_lora(True, hf)
            model(batch())


def test_lora_on_a_tied_embedding_without_ensure_weight_tying_trains_as_the_peft_model():
    peft_model = tied_lora(False)
    reference = copy.deepcopy(peft_model)
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=2)
    for seed in range(2):
        assert_same_step(peft_model, reference, model, batch(), seed=seed)
