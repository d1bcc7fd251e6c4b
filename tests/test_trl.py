"""TRL's trainers where they would train an :class:`OffloadedCausalLM` differently from the plain model:
each case either matches the plain run bit for bit, once set up as the refusal says, or is refused
with that advice before it trains (Note: [What the trainers cannot get from the model] in
``offload/integrations/transformers_refusals.py``).

Tiny Llamas and Mixtrals for one or two steps; SFTTrainer's plain runs are in ``test_trainer.py``.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")

from offload.integrations.causal_lm import OffloadedCausalLM  # noqa: E402

from .helpers import quiet_transformers  # noqa: E402,F401 (autouse)
from .test_trainer import CHAT, EXACT, byte_tokenizer, llama  # noqa: E402

#: What every run here shares: two steps of four rows, a loss logged at each, float32 (TRL's default is bf16).
SHARED = dict(use_cpu=True, report_to=[], per_device_train_batch_size=4, max_steps=2, logging_steps=1,
              save_strategy="no", seed=0, disable_tqdm=True, learning_rate=1e-2, max_length=64, bf16=False)

PREFERENCES = {"prompt": [f"what is {i} + {i}? " for i in range(16)],
               "chosen": [f"{2 * i}." for i in range(16)], "rejected": [f"{2 * i + 1}, maybe" for i in range(16)]}
UNPAIRED = {"prompt": [f"what is {i} + {i}? " for i in range(16)],
            "completion": [f"{2 * i}." if i % 2 else f"{2 * i + 1}?" for i in range(16)],
            "label": [bool(i % 2) for i in range(16)]}
TRAINERS = {"dpo": (trl.DPOConfig, trl.DPOTrainer, PREFERENCES), "kto": (trl.KTOConfig, trl.KTOTrainer, UNPAIRED)}


def history(trainer) -> list[dict]:
    """Every logged entry but timings and the FLOP estimate (which counts the reference's forward)."""
    return [{key: value for key, value in entry.items()
             if "runtime" not in key and "per_second" not in key and key != "total_flos"}
            for entry in trainer.state.log_history]


def adapted(tokenizer, target_modules=("q_proj", "v_proj"), **lora) -> torch.nn.Module:
    hf = llama(len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(5)  # the adapters' initial values
    return peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=list(target_modules), **lora))


def adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if ".default." in name}


# -- rule 2: the reference of DPOTrainer and KTOTrainer ----------------------------------------------

@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_a_peft_model_is_its_own_reference_as_the_peft_model_is_once_precomputed(kind, tmp_path):
    """For a PeftModel without ref_model TRL takes the model with its adapters as they start for the
    reference. It cannot see the PeftModel inside an OffloadedCausalLM and would load the base model
    again, whole and without adapters (adapters that do not start at zero then give another loss):
    refused without precompute_ref_log_probs; with it, the plain PeftModel's run bit for bit."""
    config_class, trainer_class, data = TRAINERS[kind]
    tokenizer = byte_tokenizer()
    runs = []
    for name in ("plain", "offloaded"):
        lora = adapted(tokenizer, init_lora_weights=False)  # adapters that change the model from the start
        model = lora if name == "plain" else OffloadedCausalLM(lora, device="cpu", num_slices=2)
        config = config_class(output_dir=str(tmp_path / name), precompute_ref_log_probs=name == "offloaded", **SHARED)
        optimizers = (None, None)
        if name == "offloaded":
            with pytest.raises(ValueError, match=rf"{trainer_class.__name__} does not see the PeftModel.*"
                                                 r"offload_optimizer cannot see a ref_model passed to the trainer.*"
                                                 rf"{config_class.__name__}\(precompute_ref_log_probs=True\).*"
                                                 r"passing a ref_model, build the .*\(optimizers left at their default\)"):
                model.offload_optimizer(config_class(output_dir=str(tmp_path / "refused"), **SHARED))
            optimizers = (model.offload_optimizer(config), None)
        trainer = trainer_class(model=model, args=config, train_dataset=datasets.Dataset.from_dict(data),
                                processing_class=tokenizer, optimizers=optimizers)
        assert trainer.ref_model is None  # no second model loaded
        trainer.train()
        runs.append((history(trainer), adapters(lora)))
    (plain_history, plain), (offloaded_history, offloaded) = runs
    assert offloaded_history == plain_history and len(plain_history) == 3  # two steps and the summary
    assert plain_history[0]["loss"] == pytest.approx(0.6931471824645996 if kind == "dpo" else 0.5, abs=0)
    assert offloaded.keys() == plain.keys() and len(plain) == 8
    for name, tensor in plain.items():
        torch.testing.assert_close(offloaded[name], tensor, **EXACT, msg=lambda m: f"{name}: {m}")


# -- rule 1: an adapter on lm_head under TRL's fused LM head ------------------------------------------

def test_an_adapter_on_lm_head_is_refused_under_trls_fused_head_as_for_a_peft_model(tmp_path):
    """TRL's fused head projects through get_output_embeddings().weight, the LoRA layer's frozen base
    weight: TRL refuses a PeftModel so adapted, and the OffloadedCausalLM's base_model refuses too, at
    the first step, before any weight changes (it trained on, the adapter never changing, before)."""
    tokenizer = byte_tokenizer()
    data = datasets.Dataset.from_dict(CHAT)
    with pytest.raises(ValueError, match="Applying a PEFT adapter to `lm_head` is not supported"):
        trl.SFTTrainer(model=adapted(tokenizer, ("q_proj", "lm_head")), args=trl.SFTConfig(
            output_dir=str(tmp_path / "plain"), **SHARED), train_dataset=data, processing_class=tokenizer)
    lora = adapted(tokenizer, ("q_proj", "lm_head"))
    before = adapters(lora)
    model = OffloadedCausalLM(lora, device="cpu", num_slices=2)
    trainer = trl.SFTTrainer(model=model, args=trl.SFTConfig(output_dir=str(tmp_path / "offloaded"), **SHARED),
                             train_dataset=data, processing_class=tokenizer)
    with pytest.raises(ValueError, match=r"lm_head is a PEFT adapter layer \(Linear\).*get_output_embeddings\(\)"
                                         r"\.weight.*Remove 'lm_head' from target_modules"):
        trainer.train()
    assert all(torch.equal(p, before[name]) for name, p in adapters(lora).items())


def test_an_adapter_on_lm_head_trains_under_the_trainer_as_in_the_peft_model(tmp_path):
    """The model's own forward runs the adapted lm_head: transformers.Trainer trains it as it trains the
    PeftModel, bit for bit; only a caller of base_model is refused."""
    from .test_trainer import TRAIN, arguments, logged

    runs = []
    for name in ("plain", "offloaded"):
        lora = adapted(byte_tokenizer(), ("q_proj", "lm_head"))
        model = lora if name == "plain" else OffloadedCausalLM(lora, device="cpu", num_slices=2)
        args = arguments(tmp_path / name, max_steps=2, eval_strategy="no")
        optimizers = (None, None) if name == "plain" else (model.offload_optimizer(args), None)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=TRAIN, optimizers=optimizers)
        trainer.train()
        runs.append((logged(trainer), adapters(lora)))
    (plain_logged, plain), (offloaded_logged, offloaded) = runs
    assert offloaded_logged == plain_logged
    head = [name for name in plain if "lm_head.lora_B" in name]
    assert head and plain[head[0]].abs().max() > 0  # the head's adapter trained
    for name, tensor in plain.items():
        torch.testing.assert_close(offloaded[name], tensor, **EXACT, msg=lambda m: f"{name}: {m}")


# -- rule 3: a mixture of experts' load-balancing loss ------------------------------------------------

def mixtral(tokenizer) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(tokenizer), max_position_embeddings=128, num_local_experts=4, num_experts_per_tok=2,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("coefficient", [None, 0.5, 0.0], ids=["config's", "0.5", "off"])
def test_the_router_loss_trains_bit_for_bit_under_any_router_aux_loss_coef(coefficient, tmp_path):
    """SFTConfig's default takes the model config's router_aux_loss_coef, asks the backbone (TRL's
    fused head calls base_model) for the router logits and adds the load-balancing loss: the stages
    carry them (Note: [Router logits]), so the run, its logged aux loss and the weights are the plain
    model's bit for bit; 0.0 turns the loss off in both."""
    tokenizer = byte_tokenizer()
    data = datasets.Dataset.from_dict(CHAT)
    runs = []
    for name in ("plain", "offloaded"):
        hf = mixtral(tokenizer)
        model = hf if name == "plain" else OffloadedCausalLM(hf, device="cpu", num_slices=2)
        config = trl.SFTConfig(output_dir=str(tmp_path / name), router_aux_loss_coef=coefficient, **SHARED)
        optimizers = (None, None) if name == "plain" else (model.offload_optimizer(config), None)
        trainer = trl.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                                 optimizers=optimizers)
        trainer.train()
        runs.append((history(trainer), dict(hf.named_parameters())))
    (plain_history, plain), (offloaded_history, offloaded) = runs
    assert offloaded_history == plain_history and len(plain_history) == 3
    assert ("aux_loss" in plain_history[0]) == (coefficient != 0.0)
    for name, p in plain.items():
        torch.testing.assert_close(offloaded[name], p, **EXACT, msg=lambda m: f"{name}: {m}")


def test_output_router_logits_set_in_the_config_after_wrapping_trains_as_the_model(tmp_path):
    """transformers.Trainer's equivalent: the model adds the router loss when its config asks for the
    logits, here set after the model was wrapped: the Trainer's run is the plain model's bit for bit."""
    from .test_trainer import arguments

    tokenizer = byte_tokenizer()
    ids = torch.randint(3, len(tokenizer), (8, 9), generator=torch.Generator().manual_seed(0))
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    runs = []
    for name in ("plain", "offloaded"):
        hf = mixtral(tokenizer)
        hf.router_aux_loss_coef = 0.5  # what the forward reads; large enough to move the routers
        model = hf if name == "plain" else OffloadedCausalLM(hf, device="cpu", num_slices=2)
        hf.config.output_router_logits = True
        args = arguments(tmp_path / name, eval_strategy="no", max_steps=2)
        optimizers = (None, None) if name == "plain" else (model.offload_optimizer(args), None)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=optimizers)
        trainer.train()
        runs.append((history(trainer), dict(hf.named_parameters())))
    (plain_history, plain), (offloaded_history, offloaded) = runs
    assert offloaded_history == plain_history and len(plain_history) == 3
    for name, p in plain.items():
        torch.testing.assert_close(offloaded[name], p, **EXACT, msg=lambda m: f"{name}: {m}")


def test_the_router_loss_of_a_family_without_one_is_refused_naming_router_aux_loss_coef(tmp_path):
    """Llama 4 returns router logits without computing a load-balancing loss, and TRL would add one from
    its config's coefficient: refused before training, naming router_aux_loss_coef=0.0."""
    tokenizer = byte_tokenizer()
    config = transformers.Llama4TextConfig(
        hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=len(tokenizer), num_local_experts=2, num_experts_per_tok=1,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model = OffloadedCausalLM(transformers.AutoModelForCausalLM.from_config(config), device="cpu", num_slices=2)
    advice = r"load-balancing loss \(SFTConfig\(router_aux_loss_coef=None\) weights it by .*router_aux_loss_coef=0\.0"
    with pytest.raises(ValueError, match=advice):
        model.offload_optimizer(trl.SFTConfig(output_dir=str(tmp_path / "default"), **SHARED))
