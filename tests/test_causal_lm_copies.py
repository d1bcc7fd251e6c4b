"""A copy of the stages of a Hugging Face model (``copy.deepcopy`` or ``torch.save``/``torch.load`` of
an ``OffloadedCausalLM``, or of an ``OffloadModel`` together with its model) follows the modules that
its own model replaces after the copy, as the original follows its model's: ``resize_token_embeddings``
with an untied head, ``set_output_embeddings``, ``set_input_embeddings``, adapters injected after
wrapping (``_FollowedPlaces`` in ``offload/integrations/transformers_stages.py``). The copy used to
keep running the modules it was copied with, silently. Bit for bit against the plain model given the
same calls, and neither the original nor the copy sees the other's replacements.
"""

from __future__ import annotations

import copy
import gc
import io
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")
from offload import OffloadModel  # noqa: E402
from offload.integrations.causal_lm import OffloadedCausalLM  # noqa: E402
from offload.integrations.transformers import causal_lm_sequential  # noqa: E402

from .helpers import quiet_transformers  # noqa: E402,F401 (autouse)
from .test_transformers_causal_lm import EXACT, ids, llama, pair, train_both  # noqa: E402


def _saved_and_loaded(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {"deepcopy": copy.deepcopy, "torch.save/torch.load": _saved_and_loaded}


@pytest.mark.parametrize("how", list(COPIES))
def test_a_copy_resized_trains_as_the_plain_model_resized_and_the_original_keeps_its_own(how):
    plain, model = pair(llama())
    model(input_ids=ids())  # laid out once before the copy
    twin, plain_twin = COPIES[how](model), copy.deepcopy(plain)
    for resized in (plain_twin, twin):
        torch.manual_seed(1)  # the new rows are drawn around the old ones' mean
        resized.resize_token_embeddings(80)
    assert twin.stages[-1].lm_head is twin.hf_model.lm_head
    assert model.get_output_embeddings().weight.shape == (64, 32)  # the copy's resize is the copy's
    for resized in (plain, model):
        torch.manual_seed(2)
        resized.resize_token_embeddings(72)
    train_both(plain_twin, twin, high=80)
    train_both(plain, model, high=72)  # and the original's resize, after the copy, is the original's


@pytest.mark.parametrize("how", list(COPIES))
def test_a_copys_new_embeddings_train_as_the_plain_models(how):
    plain, model = pair(llama())
    twin = COPIES[how](model)
    torch.manual_seed(3)
    head, embedding = torch.nn.Linear(32, 64, bias=False), torch.nn.Embedding(64, 32)
    for changed in (plain, twin):
        changed.set_output_embeddings(copy.deepcopy(head))
        changed.set_input_embeddings(copy.deepcopy(embedding))
    assert twin.stages[0].embed_tokens is twin.hf_model.model.embed_tokens
    train_both(plain, twin)
    assert model.stages[-1].lm_head is model.hf_model.lm_head is not twin.hf_model.lm_head


def test_adapters_injected_into_a_copys_model_train_as_in_the_plain_adapted_model():
    peft = pytest.importorskip("peft")
    plain, model = pair(llama())
    twin = copy.deepcopy(model)
    for adapted in (plain, twin.hf_model):
        torch.manual_seed(4)  # init_lora_weights=False: random adapters, so that they change the logits
        peft.inject_adapter_in_model(peft.LoraConfig(r=2, target_modules=["q_proj", "lm_head"],
                                                     init_lora_weights=False), adapted)
    assert twin.stages[-1].lm_head is twin.hf_model.lm_head
    batch = ids(seed=1)
    got, expected = twin(input_ids=batch, labels=batch), plain(input_ids=batch, labels=batch)
    torch.testing.assert_close(got.logits, expected.logits, **EXACT)
    got.loss.backward()
    expected.loss.backward()
    for (name, p), q in zip(plain.named_parameters(), twin.hf_model.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, **EXACT, msg=name)
    assert type(model.stages[-1].lm_head) is torch.nn.Linear  # the original's head has no adapter


@pytest.mark.parametrize("how", list(COPIES))
def test_an_offload_model_copied_with_its_hugging_face_model_follows_the_copys_resize(how):
    """``OffloadModel(causal_lm_sequential(hf))`` keeps no ``CausalLMSequential``: the stages
    themselves carry what they follow."""
    hf = llama()
    plain = copy.deepcopy(hf)
    both = COPIES[how]({"hf": hf, "model": OffloadModel(causal_lm_sequential(hf), device="cpu", num_slices=2)})
    for resized in (plain, both["hf"]):
        torch.manual_seed(1)
        resized.resize_token_embeddings(80)
    batch = ids(high=80, seed=1)
    torch.testing.assert_close(both["model"]({"input_ids": batch}), plain(input_ids=batch).logits, **EXACT)
    assert hf.lm_head.weight.shape == (64, 32)


def test_a_dropped_model_is_freed_at_once_its_stages_holding_what_they_follow():
    """The stages keep what they follow (the model's parents) without a reference cycle: a model
    dropped is freed when its last reference goes, not at the garbage collector's next pass."""
    model = OffloadedCausalLM(llama(), device="cpu", num_slices=2)
    stages = [weakref.ref(stage) for stage in model.stages]
    hf_model = weakref.ref(model.hf_model)
    gc.disable()
    try:
        del model
        assert hf_model() is None and all(stage() is None for stage in stages)
    finally:
        gc.enable()
