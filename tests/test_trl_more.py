"""TRL's trainers where they change the model's parameters inside the trainer, generate, or add adapters
around the model: an :class:`OffloadedCausalLM` trains as the plain model where the trainer builds
its own optimizer, and what would train differently is refused with what to do instead (Note:
[An optimizer built before the trainer] in ``offload/integrations/causal_lm_optimizer.py``, Note:
[Parameters replaced after the optimizer] in ``offload/optimizing/let_go.py``).

Tiny Llamas for two steps, as in ``test_trl.py``.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")

from offload import OffloadOptimizer  # noqa: E402
from offload.integrations.causal_lm import OffloadedCausalLM  # noqa: E402

from .helpers import quiet_transformers  # noqa: E402,F401 (autouse)
from .test_trainer import CHAT, EXACT, byte_tokenizer, llama  # noqa: E402
from .test_trl import PREFERENCES, SHARED, history  # noqa: E402

REPLACED = "the model's parameters changed after this OffloadOptimizer was built"


@pytest.fixture
def chat_tokenizer(tmp_path):
    """A saved tokenizer folder with a chat template and two tokens the byte tokenizer lacks, which
    TRL's clone_chat_template adds (the embeddings resized from 258 rows to 320)."""
    source = byte_tokenizer()
    source.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    source.eos_token = "<|im_end|>"
    source.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                            "{% endfor %}")
    source.save_pretrained(tmp_path / "chat_tokenizer")
    return str(tmp_path / "chat_tokenizer")


def tiny(tokenizer) -> torch.nn.Module:
    return llama(len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)


def sft(model, tokenizer, output_dir, chat_template_path, optimizers=(None, None)):
    config = trl.SFTConfig(output_dir=str(output_dir), chat_template_path=chat_template_path, **SHARED)
    torch.manual_seed(7)  # the resized embeddings' new rows: the same draw in every run
    return trl.SFTTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_dict(CHAT),
                          processing_class=tokenizer, optimizers=optimizers)


def test_a_cloned_chat_template_trains_with_the_trainers_optimizer_as_the_plain_model(chat_tokenizer, tmp_path):
    """SFTConfig(chat_template_path=<tokenizer folder>): TRL resizes the embeddings inside the
    trainer, then reads model.vocab_size, the wrapped model's as it is after the resize. With the
    trainer's own optimizer (built in train(), after the resize) the plain model's run bit for bit."""
    runs = []
    for kind in ("plain", "offloaded"):
        tokenizer = byte_tokenizer()
        hf = tiny(tokenizer)
        model = hf if kind == "plain" else OffloadedCausalLM(hf, device="cpu", num_slices=2)
        assert model.vocab_size == 258
        trainer = sft(model, tokenizer, tmp_path / kind, chat_template_path=chat_tokenizer)
        assert model.vocab_size == hf.vocab_size == len(tokenizer) == 320  # resized to a multiple of 64
        trainer.train()
        runs.append((history(trainer), {name: p.detach().clone() for name, p in hf.named_parameters()}))
    (plain_history, plain), (offloaded_history, offloaded) = runs
    assert offloaded_history == plain_history and len(plain_history) == 3  # two steps and the summary
    assert plain["lm_head.weight"].shape == (320, 32) and offloaded.keys() == plain.keys()
    for name, tensor in plain.items():
        torch.testing.assert_close(offloaded[name], tensor, **EXACT, msg=lambda m: f"{name}: {m}")


def test_offload_optimizer_refuses_a_chat_template_path_that_resizes_the_embeddings(chat_tokenizer, tmp_path):
    """Built before SFTTrainer's __init__, the optimizer would step the embeddings and lm_head the
    resize replaced: refused, naming both orders that work. A .jinja file only sets the template."""
    tokenizer = byte_tokenizer()
    model = OffloadedCausalLM(tiny(tokenizer), device="cpu", num_slices=2)
    with pytest.raises(ValueError, match=r"chat_template_path=.* names a tokenizer.*optimizers=\(None, None\).*"
                                         r"trl\.clone_chat_template\(model, tokenizer, path\) yourself"):
        model.offload_optimizer(trl.SFTConfig(output_dir=str(tmp_path / "o"), chat_template_path=chat_tokenizer,
                                              **SHARED))
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    config = trl.SFTConfig(output_dir=str(tmp_path / "o"), chat_template_path=str(template), **SHARED)
    assert isinstance(model.offload_optimizer(config), OffloadOptimizer)


def test_an_optimizer_built_before_the_resize_refuses_to_step_the_replaced_parameters(chat_tokenizer, tmp_path):
    """An OffloadOptimizer built by hand before SFTTrainer resizes the embeddings (the check above
    cannot see it): its first step refuses, naming the parameter, where it would silently step the
    old lm_head and embedding and never train the new ones."""
    tokenizer = byte_tokenizer()
    model = OffloadedCausalLM(tiny(tokenizer), device="cpu", num_slices=2)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    trainer = sft(model, tokenizer, tmp_path / "o", chat_template_path=chat_tokenizer, optimizers=(optimizer, None))
    with pytest.raises(RuntimeError, match=rf"{REPLACED}: parameter .*of shape \(258, 32\).*"
                                           r"optimizers=\(None, None\)"):
        trainer.train()


@pytest.mark.parametrize("change", ["resize_token_embeddings", "tie_weights"])
def test_a_change_through_the_wrapper_refuses_the_older_optimizer_and_not_a_newer_one(change):
    """resize_token_embeddings (a new embedding and lm_head) or tie_weights (lm_head's weight
    replaced by the embedding's) through the wrapper: the optimizer built before refuses at step(),
    naming what was replaced; the one built after steps the new parameters."""
    model = OffloadedCausalLM(llama(64), device="cpu", num_slices=2)
    before = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    if change == "resize_token_embeddings":
        model.resize_token_embeddings(80)
        replaced = r"parameter 'weight' of a Linear of shape \(64, 32\) in slice 1"  # the old lm_head module
    else:
        model.hf_model.config.tie_word_embeddings = True
        model.tie_weights()
        replaced = r"parameter '3\.lm_head\.weight' \(Linear\) of shape \(64, 32\) in slice 1"
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(RuntimeError, match=rf"{REPLACED}: {replaced} was replaced"):
        before.step()
    del before
    after = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    head = model.get_output_embeddings().weight.detach().clone()
    after.step()
    after.synchronize()
    assert not torch.equal(model.get_output_embeddings().weight, head)


@pytest.mark.parametrize("config_class", [trl.GRPOConfig, trl.RLOOConfig])
def test_the_trainers_that_generate_are_refused_up_front(config_class, tmp_path):
    """GRPO and RLOO generate from the model at every step, which the wrapper does not: refused when
    the optimizer is built, not at the first step inside generate()."""
    model = OffloadedCausalLM(tiny(byte_tokenizer()), device="cpu", num_slices=2)
    config = config_class(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=4,
                          num_generations=2, max_completion_length=8, bf16=False)
    trainer = config_class.__name__.removesuffix("Config") + "Trainer"
    with pytest.raises(ValueError, match=rf"TRL's {trainer} generates completions from the model at every step"):
        model.offload_optimizer(config)


def test_a_trainer_that_generates_only_when_told_is_refused_only_then(tmp_path):
    """By class and settings, not by the settings a class has: GKD generates for a share lmbda of
    its steps (none at 0, though its config has max_new_tokens), A2PO at every step (its config has
    no generation settings), ORPO only with generate_during_eval."""
    from trl.experimental.a2po import A2POConfig
    from trl.experimental.gkd import GKDConfig
    from trl.experimental.orpo import ORPOConfig

    model = OffloadedCausalLM(tiny(byte_tokenizer()), device="cpu", num_slices=2)
    common = {"output_dir": str(tmp_path), "use_cpu": True, "report_to": [], "bf16": False}
    model.offload_optimizer(GKDConfig(lmbda=0.0, seq_kd=False, **common))
    model.offload_optimizer(ORPOConfig(**common))
    for config, when in ((GKDConfig(lmbda=0.5, **common), "for a share lmbda=0.5"),
                         (A2POConfig(**common), "at every step"),
                         (ORPOConfig(generate_during_eval=True, **common), "in each evaluation")):
        with pytest.raises(ValueError, match=f"generates completions from the model {when}"):
            model.offload_optimizer(config)


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_peft_config_under_dpo_and_kto_is_refused_naming_the_trainer_and_the_precompute(kind, tmp_path):
    from .test_trl import TRAINERS

    config_class, trainer_class, data = TRAINERS[kind]
    tokenizer = byte_tokenizer()
    model = OffloadedCausalLM(tiny(tokenizer), device="cpu", num_slices=2)
    advice = (rf"give the TRL trainer \({trainer_class.__name__}\) that model without peft_config, and "
              rf"{config_class.__name__}\(precompute_ref_log_probs=True\)")
    with pytest.raises(ValueError, match=advice):
        trainer_class(model=model, args=config_class(output_dir=str(tmp_path), **SHARED),
                      train_dataset=datasets.Dataset.from_dict(data), processing_class=tokenizer,
                      peft_config=peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def test_a_peft_model_with_a_ref_model_trains_under_the_trainers_optimizer_as_the_peft_model(tmp_path):
    """The refusal's second way out (offload_optimizer cannot see the ref_model): with a ref_model
    and the trainer's own optimizer, no precompute, the plain PeftModel's run bit for bit."""
    tokenizer = byte_tokenizer()
    saved = tmp_path / "base"
    tiny(tokenizer).save_pretrained(saved)
    runs = []
    for kind in ("plain", "offloaded"):
        torch.manual_seed(5)
        lora = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(saved),
                                   peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        model = lora if kind == "plain" else OffloadedCausalLM(lora, device="cpu", num_slices=2)
        config = trl.DPOConfig(output_dir=str(tmp_path / kind), **SHARED)
        if kind == "offloaded":
            with pytest.raises(ValueError, match="offload_optimizer cannot see a ref_model passed to the trainer"):
                model.offload_optimizer(config)
        trainer = trl.DPOTrainer(model=model, ref_model=transformers.AutoModelForCausalLM.from_pretrained(saved),
                                 args=config, train_dataset=datasets.Dataset.from_dict(PREFERENCES),
                                 processing_class=tokenizer)
        trainer.train()
        runs.append((history(trainer), {n: p.detach().clone() for n, p in lora.named_parameters() if ".default." in n}))
    (plain_history, plain), (offloaded_history, offloaded) = runs
    assert offloaded_history == plain_history and len(plain) == 8
    for name, tensor in plain.items():
        torch.testing.assert_close(offloaded[name], tensor, **EXACT, msg=lambda m: f"{name}: {m}")
