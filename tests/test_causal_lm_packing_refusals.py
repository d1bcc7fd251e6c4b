""":class:`OffloadedCausalLM` on what a forward may ask that the offloaded stages cannot give, against the
plain model: packed sequences' boundaries that convolution and linear-attention layers read from the
padding-free collators' keywords (rule 5 of Note: [What the trainers cannot get from the model]), and
every layer's hidden states or attentions asked for by the config (rule 6). What the stages can give,
packing through ``position_ids`` and the collators' keywords on attention layers, is the plain model's
bit for bit. Tiny models on the CPU; nothing is downloaded.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from offload.integrations.causal_lm import OffloadedCausalLM  # noqa: E402

from .helpers import quiet_transformers  # noqa: E402,F401 (autouse)
from .test_transformers import build  # noqa: E402

EXACT = {"rtol": 0.0, "atol": 0.0}
#: Three sequences of different lengths, packed into one row by the collators.
SEQUENCES = [list(range(5, 9)), list(range(20, 27)), list(range(40, 43))]
BOUNDARY_KEYWORDS = {"seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}


def packed(with_boundaries: bool) -> dict[str, torch.Tensor]:
    """One row of packed sequences with labels and ``position_ids``, and with the boundaries as
    TRL's padding-free collator gives them when ``with_boundaries``."""
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=with_boundaries,
                                                       return_seq_idx=with_boundaries)
    batch = collator([{"input_ids": s, "labels": s} for s in SEQUENCES])
    assert (BOUNDARY_KEYWORDS <= set(batch)) is with_boundaries and "position_ids" in batch
    return batch


def pair(kind: str) -> tuple[torch.nn.Module, OffloadedCausalLM]:
    hf = build(kind, dropout=0.0, layers=2)
    return copy.deepcopy(hf), OffloadedCausalLM(hf, device="cpu", num_slices=2)


@pytest.mark.parametrize(("kind", "keywords", "layer_type"), [
    ("lfm2", "seq_idx", "'conv'"), ("qwen3_next", "seq_idx, cu_seq_lens_q", "'linear_attention'")])
def test_packed_boundaries_that_a_recurrent_layer_reads_are_refused(kind, keywords, layer_type):
    # The stages would run the convolution across the boundaries: each sequence would leak into the next.
    _, model = pair(kind)
    batch = packed(with_boundaries=True)
    message = rf"boundaries in {keywords}, which {kind}'s {layer_type} layers need .* SFTConfig\(packing=False\)"
    with pytest.raises(ValueError, match=message):
        model(**batch)
    with pytest.raises(ValueError, match=message):  # TRL's fused LM head asks base_model
        model.base_model(**{key: value for key, value in batch.items() if key != "labels"})
    # Keywords given as None are absent, as in the model: the batch packed by position_ids alone.
    unset = {key: None for key in BOUNDARY_KEYWORDS}
    torch.testing.assert_close(model(**packed(with_boundaries=False), **unset).logits,
                               model(**packed(with_boundaries=False)).logits, **EXACT)


@pytest.mark.parametrize("kind", ["lfm2", "qwen3_next"])
def test_a_recurrent_model_packed_by_position_ids_alone_is_the_plain_model(kind):
    # Without the keywords the model's own convolutions run across the boundaries too: the same result.
    plain, model = pair(kind)
    batch = packed(with_boundaries=False)
    expected, got = plain(**batch, use_cache=False), model(**batch)
    torch.testing.assert_close(got.logits, expected.logits, **EXACT)
    torch.testing.assert_close(got.loss, expected.loss, **EXACT)


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_an_attention_only_model_takes_the_packed_boundaries_as_the_plain_model(kind):
    # Its masks find the boundaries in position_ids; gemma2's layer_types are all attention.
    plain, model = pair(kind)
    batch = packed(with_boundaries=True)
    expected, got = plain(**batch, use_cache=False), model(**batch)
    torch.testing.assert_close(got.logits, expected.logits, **EXACT)
    torch.testing.assert_close(got.loss, expected.loss, **EXACT)
    expected.loss.backward()
    got.loss.backward()
    for (name, p), q in zip(plain.named_parameters(), model.hf_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **EXACT, msg=name)


def test_sft_trainer_packing_on_a_convolution_model_is_refused(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from .test_trainer import TEXT, byte_tokenizer

    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    config = transformers.Lfm2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(tokenizer), max_position_embeddings=128, layer_types=["conv", "full_attention"],
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model = OffloadedCausalLM(transformers.Lfm2ForCausalLM(config), device="cpu", num_slices=2)
    args = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=4,
                         max_steps=1, save_strategy="no", disable_tqdm=True, bf16=False, max_length=64, packing=True)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict(TEXT),
                             processing_class=tokenizer)
    with pytest.raises(ValueError, match="lfm2's 'conv' layers need to keep the sequences apart"):
        trainer.train()


@pytest.mark.parametrize("key", ["output_hidden_states", "output_attentions"])
def test_layer_outputs_asked_by_the_config_are_warned_of_unless_the_call_turns_them_off(key):
    plain, model = pair("llama")
    for m in (plain, model):
        m.set_attn_implementation("eager")  # the only one that gives attention weights
    ids = packed(with_boundaries=False)["input_ids"]
    setattr(model.config, key, True)
    setattr(plain.config, key, True)
    assert getattr(plain(input_ids=ids, use_cache=False), key.removeprefix("output_")) is not None
    message = rf"config asks every forward for {key}=True.*outputs hold None there.* model\.config\.{key} = False"
    # A saved config may carry it into a run that never reads them: the logits are the model's.
    with pytest.warns(UserWarning, match=message):
        got = model(input_ids=ids)
    assert getattr(got, key.removeprefix("output_")) is None
    torch.testing.assert_close(got.logits, plain(input_ids=ids, use_cache=False).logits, **EXACT)
    with pytest.warns(UserWarning, match=message):
        model.base_model(input_ids=ids)
    with pytest.raises(TypeError, match=f"cannot honour {key}"):  # the call's own, as before
        model(input_ids=ids, **{key: True})
    # The call's False wins over the config, as in the model: neither returns them.
    expected, got = plain(input_ids=ids, use_cache=False, **{key: False}), model(input_ids=ids, **{key: False})
    assert getattr(expected, key.removeprefix("output_")) is None
    torch.testing.assert_close(got.logits, expected.logits, **EXACT)
    setattr(model.config, key, False)  # as a trainer's or a generation config may set it: silent
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(model(input_ids=ids).logits, expected.logits, **EXACT)


def test_a_saved_config_asking_for_hidden_states_loads_and_its_forward_warns(tmp_path):
    plain, _ = pair("llama")
    plain.config.output_hidden_states = True
    plain.save_pretrained(tmp_path)
    model = OffloadedCausalLM.from_pretrained(tmp_path, device="cpu", num_slices=2)
    assert model.config.output_hidden_states is True
    with pytest.warns(UserWarning, match=r"model\.config\.output_hidden_states = False"):
        model(input_ids=packed(with_boundaries=False)["input_ids"])


def test_use_cache_asked_by_the_call_is_warned_of_and_the_tuple_holds_loss_and_logits():
    plain, model = pair("llama")
    ids = packed(with_boundaries=False)["input_ids"]
    with pytest.warns(UserWarning, match=r"ignores use_cache=True.*past_key_values is None.*use_cache=False"):
        got = model(input_ids=ids, labels=ids, use_cache=True, return_dict=False)
    expected = plain(input_ids=ids, labels=ids, use_cache=True, return_dict=False)
    assert len(expected) == 3 and len(got) == 2  # the model's third item is its cache
    for a, b in zip(got, expected[:2]):
        torch.testing.assert_close(a, b, **EXACT)
    with warnings.catch_warnings():  # the config's default (True in most models) and the trainers' False: silent
        warnings.simplefilter("error")
        assert model.config.use_cache is True
        model(input_ids=ids)
        model(input_ids=ids, use_cache=False)


def test_generate_is_missing_with_advice_and_hasattr_stays_false():
    _, model = pair("llama")
    assert not hasattr(model, "generate")
    with pytest.raises(AttributeError, match=r"no generate\(\).*model\.hf_model.*AutoModelForCausalLM"):
        model.generate
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):  # other names as before
        model.no_such_thing
    assert model.hf_model is not None and model.config is model.hf_model.config


def test_generate_advice_with_resident_slices_on_a_device_points_to_the_saved_folder():
    # hf_model.generate would meet the resident slices' parameters on the device and the others on the
    # host; the device is set by hand here (a CPU machine), as OffloadModel sets it on a GPU.
    hf = build("llama", dropout=0.0, layers=2)
    model = OffloadedCausalLM(hf, device="cpu", num_slices=2, resident_slices=1)
    model.offloaded.device = torch.device("cuda", 0)
    try:
        with pytest.raises(AttributeError, match=r"no generate\(\).*1 resident slice\(s\)' \(on cuda:0\).*"
                                                 r"AutoModelForCausalLM\.from_pretrained"):
            model.generate
    finally:
        model.offloaded.device = torch.device("cpu")


@pytest.mark.parametrize("key", ["past_key_values", "cache_position"])
def test_a_decoding_loops_cache_arguments_are_refused_with_where_to_decode(key):
    _, model = pair("llama")
    ids = packed(with_boundaries=False)["input_ids"]
    value = transformers.DynamicCache() if key == "past_key_values" else torch.arange(ids.shape[1])
    with pytest.raises(TypeError, match=rf"cannot honour {key}.*no key-value cache.*model\.hf_model\.generate"):
        model(input_ids=ids, **{key: value})
