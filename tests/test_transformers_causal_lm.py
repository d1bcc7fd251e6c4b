""":class:`OffloadedCausalLM` where it answers as ``PreTrainedModel`` does, against the plain model: the
config it saves, resizing, replacing and tying again the embeddings, switching the attention, its mode
after ``from_pretrained`` and the keywords it takes, ``save_pretrained``'s arguments and the forward's refusals. Bit for bit on the CPU; nothing is downloaded.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from offload.integrations.causal_lm import OffloadedCausalLM  # noqa: E402
from offload.integrations.transformers import load_causal_lm  # noqa: E402

from .helpers import quiet_transformers  # noqa: E402,F401 (autouse)

EXACT = {"rtol": 0.0, "atol": 0.0}
VOCAB = 64


def llama(tied: bool = False, **options) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=tied, **options))


def pair(hf: torch.nn.Module) -> tuple[torch.nn.Module, OffloadedCausalLM]:
    return copy.deepcopy(hf), OffloadedCausalLM(hf, device="cpu", num_slices=2)


def ids(high: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, high, (2, 9), generator=torch.Generator().manual_seed(seed))


def train_both(plain: torch.nn.Module, model: OffloadedCausalLM, steps: int = 2, high: int = VOCAB) -> None:
    """``steps`` SGD steps of both models on one batch: logits, loss, every gradient and the parameters
    after them bit for bit."""
    names = [name for name, _ in plain.named_parameters()]
    assert [name for name, _ in model.hf_model.named_parameters()] == names  # the same parameters, tied alike
    assert len(list(model.parameters())) == len(names)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5, fused=True) for m in (plain, model)]
    batch = ids(high=high, seed=1)
    for _ in range(steps):
        expected, got = plain(input_ids=batch, labels=batch), model(input_ids=batch, labels=batch)
        torch.testing.assert_close(got.logits, expected.logits, **EXACT)
        torch.testing.assert_close(got.loss, expected.loss, **EXACT)
        expected.loss.backward()
        got.loss.backward()
        for name, p, q in zip(names, plain.parameters(), model.hf_model.parameters()):
            torch.testing.assert_close(q.grad, p.grad, **EXACT, msg=name)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for name, p, q in zip(names, plain.parameters(), model.hf_model.parameters()):
        torch.testing.assert_close(q, p, **EXACT, msg=name)


def test_save_pretrained_writes_the_dtype_of_the_weights_it_writes(tmp_path):
    llama().to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert hf.dtype == torch.bfloat16
    plain, model = pair(hf.float())  # trained in float32, as a bfloat16 checkpoint often is
    plain.save_pretrained(tmp_path / "plain")
    model.save_pretrained(tmp_path / "offloaded")
    written = [json.loads((tmp_path / name / "config.json").read_text()) for name in ("plain", "offloaded")]
    assert written[0]["dtype"] == written[1]["dtype"] == "float32"
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "offloaded").dtype == torch.float32


def test_save_pretrained_honours_max_shard_size_and_variant_and_refuses_the_rest(tmp_path):
    from safetensors.torch import load_file

    plain, model = pair(llama())
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB", variant="fp16")
    files = sorted((tmp_path / "sharded").glob("*.safetensors"))
    assert len(files) > 2 and all(f.name.startswith("model.fp16-") for f in files)
    assert (tmp_path / "sharded" / "model.safetensors.index.fp16.json").is_file()
    for file in files:  # none over the limit but a tensor larger than it, alone
        shard = load_file(file)
        assert len(shard) == 1 or sum(t.numel() * t.element_size() for t in shard.values()) <= 20_000
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sharded", variant="fp16")
    torch.testing.assert_close(loaded.state_dict(), plain.state_dict(), **EXACT)
    model.save_pretrained(tmp_path / "sharded", variant="fp16", safe_serialization=True)  # a shard a slice again
    assert sorted(f.name for f in (tmp_path / "sharded").glob("*.safetensors")) == [
        f"model.fp16-0000{k}-of-00002.safetensors" for k in (1, 2)]
    with pytest.raises(TypeError, match=r"cannot honour push_to_hub, repo_id\. .*huggingface_hub\.upload_folder"):
        model.save_pretrained(tmp_path / "hub", push_to_hub=True, repo_id="someone/model")
    with pytest.raises(TypeError, match="cannot honour safe_serialization"):
        model.save_pretrained(tmp_path / "hub", safe_serialization=False)
    with pytest.raises(ValueError, match="max_shard_size must be a byte count or a number followed by KB"):
        model.save_pretrained(tmp_path / "hub", max_shard_size="20 KiBs")
    assert not (tmp_path / "hub").exists()
    # Binary units as Hugging Face takes them; is_main_process positionally, as its signature has it.
    model.save_pretrained(tmp_path / "binary", max_shard_size="0.02MiB")
    assert len(list((tmp_path / "binary").glob("*.safetensors"))) > 2
    model.save_pretrained(tmp_path / "not-main", False)
    assert not (tmp_path / "not-main").exists()
    # Shards a failed save left under their working names are not left beside the next one's.
    (tmp_path / "binary" / "model.safetensors.partial-00099").write_bytes(b"half a shard")
    model.save_pretrained(tmp_path / "binary")
    assert not list((tmp_path / "binary").glob("*partial*"))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_resize_token_embeddings_trains_as_the_plain_model_resized(tied):
    plain, model = pair(llama(tied=tied))
    model(input_ids=ids())  # laid out once before the resize
    for resized in (plain, model):
        torch.manual_seed(1)  # the new rows are drawn around the old ones' mean
        assert resized.resize_token_embeddings(80).weight.shape == (80, 32)
    assert model.config.vocab_size == 80 and model.get_output_embeddings().weight.shape == (80, 32)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    train_both(plain, model, high=80)


def test_tie_weights_ties_again_a_tie_that_was_broken_as_the_plain_model_does():
    plain, model = pair(llama(tied=True))
    model(input_ids=ids())  # laid out once before
    # load_state_dict(assign=True) puts each stored tensor in place, the tied two apart, in plain PyTorch too.
    state = {key: value.clone() for key, value in llama(tied=True).state_dict().items()}
    for loaded in (plain, model):
        loaded.load_state_dict({key: value.clone() for key, value in state.items()}, assign=True)
        assert loaded.get_output_embeddings().weight is not loaded.get_input_embeddings().weight
        loaded.tie_weights()
        assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    train_both(plain, model)
    # Untied on purpose, the config says so: tie_weights() leaves it untied, as the plain model's.
    plain, model = llama(tied=True), OffloadedCausalLM(llama(tied=True), "cpu", untie_embeddings=True)
    plain.config.tie_word_embeddings = False
    plain.lm_head.weight = torch.nn.Parameter(plain.lm_head.weight.detach().clone())
    for untied in (plain, model):
        untied.tie_weights()
        assert untied.get_output_embeddings().weight is not untied.get_input_embeddings().weight
    train_both(plain, model)


@pytest.mark.parametrize("which", ["input", "output"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_set_embeddings_trains_the_new_module_as_the_plain_model_does(which, tied):
    plain, model = pair(llama(tied=tied))
    model(input_ids=ids())  # laid out once before the new module
    torch.manual_seed(4)
    new = torch.nn.Embedding(VOCAB, 32) if which == "input" else torch.nn.Linear(32, VOCAB, bias=False)
    for changed in (plain, model):
        getattr(changed, f"set_{which}_embeddings")(copy.deepcopy(new))
    module = getattr(model, f"get_{which}_embeddings")()
    torch.testing.assert_close(module.weight, new.weight, **EXACT)
    assert any(p is module.weight for p in model.parameters())
    train_both(plain, model)


def test_switching_the_attention_implementation_reaches_the_stages():
    plain, model = pair(llama(attn_implementation="sdpa"))
    plain.eval()
    model.eval()
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    for implementation in ("eager", "sdpa"):
        plain.set_attn_implementation(implementation)
        model.set_attn_implementation(implementation)
        assert model.config._attn_implementation == implementation
        torch.testing.assert_close(model(input_ids=ids(), attention_mask=mask).logits,
                                   plain(input_ids=ids(), attention_mask=mask).logits, **EXACT)


def test_from_pretrained_is_in_eval_mode_as_the_plain_model(tmp_path):
    llama(attention_dropout=0.5).save_pretrained(tmp_path)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    model = OffloadedCausalLM.from_pretrained(tmp_path, device="cpu", num_slices=2)
    assert plain.training is False and model.training is False and model.offloaded.training is False
    assert load_causal_lm(tmp_path, "cpu", num_slices=2)[0].training is False
    torch.testing.assert_close(model(input_ids=ids()).logits, plain(input_ids=ids()).logits, **EXACT)
    assert OffloadedCausalLM(llama().eval(), device="cpu", num_slices=2).training is False


def test_from_pretrained_takes_the_attention_implementation_and_torch_dtype_as_the_plain_model(tmp_path):
    llama().save_pretrained(tmp_path)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    model = OffloadedCausalLM.from_pretrained(tmp_path, device="cpu", num_slices=2, attn_implementation="eager")
    assert model.config._attn_implementation == plain.config._attn_implementation == "eager"
    torch.testing.assert_close(model(input_ids=ids(), attention_mask=mask).logits,
                               plain(input_ids=ids(), attention_mask=mask).logits, **EXACT)
    plain.train()
    model.train()
    train_both(plain, model)
    with pytest.warns(FutureWarning, match="torch_dtype is deprecated"):
        model = OffloadedCausalLM.from_pretrained(tmp_path, device="cpu", num_slices=2, torch_dtype=torch.bfloat16)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    torch.testing.assert_close(model.state_dict(), plain.state_dict(), **EXACT)
    with pytest.raises(TypeError, match=r"^load_causal_lm \(and OffloadedCausalLM\.from_pretrained\) got unexpected "
                                        r"keyword argument: 'trust_remote_code'; it takes dtype, .*num_slices"):
        OffloadedCausalLM.from_pretrained(tmp_path, device="cpu", trust_remote_code=True)


@pytest.mark.parametrize("key, value, hint", [
    ("output_hidden_states", True, r"model\.base_model\(\.\.\.\) returns the last layer's"),
    ("output_attentions", True, r"a forward hook on an attention layer"),
    ("inputs_embeds", "embeds", r"pass input_ids, and change the embeddings with a forward hook"),
])
def test_a_keyword_the_caller_typed_is_refused_with_its_reason_and_no_dataset_advice(key, value, hint):
    """The Trainer's advice on dataset columns is for keywords that could be columns, not these."""
    _, model = pair(llama())
    given = torch.zeros(2, 9, 32) if value == "embeds" else value
    with pytest.raises(TypeError, match=rf"takes input_ids, .*logits_to_keep and return_dict .*cannot honour {key}\. "
                                        rf".*{hint}") as refused:
        model(**({} if key == "inputs_embeds" else {"input_ids": ids()}), **{key: given})
    assert "remove_unused_columns" not in str(refused.value)
    with pytest.raises(TypeError, match=r"cannot honour a_column\. With transformers\.Trainer keep remove_unused_columns"):
        model(input_ids=ids(), a_column=torch.zeros(2))


def test_train_and_eval_reach_the_hugging_face_models_own_flags():
    """``hf_model`` is no submodule (its layers are the stages'), yet code that reads its
    ``training`` (a pipeline, ``generate``) sees the mode the wrapper was put in."""
    _, model = pair(llama())
    model.eval()
    assert not any(m.training for m in (model, model.offloaded, *model.hf_model.modules()))
    model.train()
    assert all(m.training for m in (model, model.offloaded, *model.hf_model.modules()))


def test_forward_names_what_it_refuses_and_gives_no_loss_for_shift_labels_alone():
    plain, model = pair(llama())
    with pytest.raises(TypeError, match="cannot honour inputs_embeds"):
        model(inputs_embeds=torch.zeros(2, 9, 32))
    with pytest.raises(TypeError, match="it needs input_ids"):
        model(attention_mask=torch.ones(2, 9))
    # What some tokenizers return by default: the message says how not to pass it.
    with pytest.raises(TypeError, match="cannot honour token_type_ids. If the tokenizer added token_type_ids, call it "
                                        "with return_token_type_ids=False"):
        model(input_ids=ids(), token_type_ids=torch.zeros_like(ids()))
    shift_labels = torch.roll(ids(), -1, 1)
    shift_labels[:, -1] = -100
    expected, got = plain(input_ids=ids(), shift_labels=shift_labels), model(input_ids=ids(), shift_labels=shift_labels)
    assert expected.loss is None and got.loss is None
    torch.testing.assert_close(got.logits, expected.logits, **EXACT)
    expected, got = (m(input_ids=ids(), labels=ids(), shift_labels=shift_labels) for m in (plain, model))
    torch.testing.assert_close(got.loss, expected.loss, **EXACT)
