"""``transformers.Trainer`` and TRL's ``SFTTrainer`` train an :class:`OffloadedCausalLM` as they train the
plain model: the same loss at every logged step and the same weights, bit for bit, on the CPU, with
gradient accumulation, clipping, warm-up and evaluation; checkpoints resume exactly and saved
models load with ``from_pretrained``.

Each run is a tiny Llama for a few steps: the plain runs are shared by the tests that compare
against them (module-scoped fixtures).
"""

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

import offload.clipping  # noqa: E402
from offload import OffloadModel  # noqa: E402
from offload.integrations.causal_lm import OffloadedCausalLM  # noqa: E402
from offload.integrations.transformers import parallel_clipping  # noqa: E402
from offload.optimizing import deferred_scaling  # noqa: E402
from offload.optimizing.deferred_scaling import DeferredScaling  # noqa: E402

from .helpers import CUDA, count_parallel_norms, quiet_transformers  # noqa: E402,F401 (autouse)

EXACT = dict(rtol=0, atol=0)
VOCAB = 64
STEPS = 4


def llama(vocab: int = VOCAB, tied: bool = False, **special) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=vocab, max_position_embeddings=128, tie_word_embeddings=tied,
        **(special or {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}))
    return transformers.AutoModelForCausalLM.from_config(config)


def rows(n: int, seed: int, length: int = 12) -> "datasets.Dataset":
    """Rows of one length with right padding of varying size (labels -100 there), and a text
    column the model does not take (the Trainer drops it: remove_unused_columns)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n, length), generator=g)
    lengths = torch.randint(6, length + 1, (n,), generator=g)
    mask = (torch.arange(length)[None] < lengths[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": mask.tolist(),
                                       "labels": labels.tolist(), "text": [f"row {k}" for k in range(n)]})


TRAIN, EVAL = rows(16, seed=3), rows(8, seed=4)


def arguments(out, **changes) -> "transformers.TrainingArguments":
    settings = dict(output_dir=str(out), use_cpu=True, report_to=[], per_device_train_batch_size=2,
                    per_device_eval_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=1.0, warmup_steps=2,
                    learning_rate=1e-2, max_steps=STEPS, logging_steps=1, eval_strategy="steps", eval_steps=2,
                    save_strategy="no", seed=0, disable_tqdm=True)
    settings.update(changes)
    return transformers.TrainingArguments(**settings)


def logged(trainer) -> list[tuple[str, int, float]]:
    return [(key, entry["step"], entry[key]) for entry in trainer.state.log_history
            for key in ("loss", "eval_loss", "grad_norm") if key in entry]


def assert_same_weights(actual: torch.nn.Module, expected: torch.nn.Module) -> None:
    named = dict(actual.named_parameters())
    assert named.keys() == dict(expected.named_parameters()).keys()
    for name, p in expected.named_parameters():
        torch.testing.assert_close(named[name], p, **EXACT, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    hf = llama()
    trainer = transformers.Trainer(model=hf, args=arguments(tmp_path_factory.mktemp("plain")), train_dataset=TRAIN,
                                   eval_dataset=EVAL)
    trainer.train()
    return logged(trainer), hf


@pytest.mark.parametrize("optimizer", ["trainer's AdamW", "offload_optimizer", "offload_optimizer, parallel_clipping",
                                       "offload_optimizer with norms_in_backward, parallel_clipping",
                                       "offload_optimizer with norms_in_backward, scale_in_update, parallel_clipping"])
def test_trainer_matches_the_plain_model_bit_for_bit(plain_run, optimizer, tmp_path, monkeypatch):
    losses, plain = plain_run
    hf = llama()
    model = OffloadedCausalLM(hf, device="cpu", num_slices=2)
    args = arguments(tmp_path)
    options = ({"norms_in_backward": True, "accumulation_steps": args.gradient_accumulation_steps}
               if "norms_in_backward" in optimizer else {})
    if "scale_in_update" in optimizer:
        options["scale_in_update"] = True
    optimizers = ((model.offload_optimizer(args, **options), None) if optimizer.startswith("offload_optimizer")
                  else (None, None))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TRAIN, eval_dataset=EVAL,
                                   optimizers=optimizers)
    norms = count_parallel_norms(monkeypatch)
    computed: list[int] = []  # the norms each clip computed itself
    real = offload.clipping.pooled_norms
    monkeypatch.setattr(offload.clipping, "pooled_norms", lambda ts, *a: computed.append(len(ts)) or real(ts, *a))
    scaled_at_clip: list[int] = []
    handed_over: list[int] = []  # the parameters each clip handed to the update worker
    real_take = DeferredScaling.take
    monkeypatch.setattr(DeferredScaling, "take", lambda self, ps, c: handed_over.append(len(taken := real_take(
        self, ps, c))) or taken)
    real_scaling = offload.clipping.clip_grads_with_norm_
    monkeypatch.setattr(offload.clipping, "clip_grads_with_norm_",
                        lambda ps, *a: scaled_at_clip.append(len(ps)) or real_scaling(ps, *a))
    alone: list[int] = []  # the slices whose scaling ran by itself, not in their update
    real_alone = deferred_scaling._scale
    monkeypatch.setattr(deferred_scaling, "_scale", lambda owed, index: alone.append(index) or real_alone(owed, index))
    if optimizer.endswith("parallel_clipping"):
        assert parallel_clipping(trainer) is trainer
    trainer.train()
    assert len(norms) == (STEPS if optimizer.endswith("parallel_clipping") else 0)
    if "norms_in_backward" in optimizer:  # the first clip computes them all again to compare, the others none
        assert computed == [len(list(model.parameters()))] + [0] * (STEPS - 1)
    if "scale_in_update" in optimizer:  # every clip scaled by the slices' updates, none at the clip
        assert scaled_at_clip == [] and len(handed_over) == STEPS and all(handed_over) and alone == []
    assert logged(trainer) == losses  # every training loss, gradient norm and eval loss, bit for bit
    assert sum(key == "eval_loss" for key, _, _ in losses) == 2 and sum(key == "loss" for key, _, _ in losses) == STEPS
    assert_same_weights(hf, plain)


def test_accumulation_under_the_trainer_adds_onto_earlier_gradients(plain_run, tmp_path):
    """gradient_accumulation_steps=2: the second backward of each step adds each slice's gradients
    onto .grad as they land (Note: [Adding onto earlier gradients]): the pool holds the gradients and
    two slices' landing buffers, never every slice's new gradients beside the old ones."""
    losses, plain = plain_run
    hf = llama()
    model = OffloadedCausalLM(hf, device="cpu", num_slices=4)
    engine = model.offloaded._engine
    in_use: list[int] = []
    real = engine.gradients.accumulate

    def counting(pending, in_flight=1):
        real(pending, in_flight)
        in_use.append(sum(not b.is_idle() for b in engine.pool.buffers() if b.data.numel() >= 8192))  # not activations

    engine.gradients.accumulate = counting
    args = arguments(tmp_path)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TRAIN, eval_dataset=EVAL,
                                   optimizers=(model.offload_optimizer(args), None))
    trainer.train()
    assert logged(trainer) == losses
    assert_same_weights(hf, plain)
    assert in_use and max(in_use) <= 4 + 2  # each slice's .grad buffer, and two landing


def test_parallel_clipping_logs_the_norm_without_clipping_as_the_plain_trainer(tmp_path, monkeypatch):
    """At ``max_grad_norm=0`` the Trainer still computes the norm to log it (clipping at an infinite
    norm): through ``parallel_clipping`` the logged norms and the weights are the plain model's, and
    the gradients are not rewritten (a coefficient of one)."""
    runs = []
    for kind in ("plain", "offloaded"):
        hf = llama()
        args = arguments(tmp_path / kind, max_grad_norm=0.0, eval_strategy="no")
        model = hf if kind == "plain" else OffloadedCausalLM(hf, device="cpu", num_slices=2)
        optimizers = (None, None) if kind == "plain" else (model.offload_optimizer(args), None)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=TRAIN, optimizers=optimizers)
        if kind == "offloaded":
            norms = count_parallel_norms(monkeypatch)
            parallel_clipping(trainer)
        trainer.train()
        runs.append((logged(trainer), hf))
    (plain_logged, plain), (offloaded_logged, offloaded) = runs
    assert offloaded_logged == plain_logged and sum(key == "grad_norm" for key, _, _ in plain_logged) == STEPS
    assert len(norms) == STEPS
    assert_same_weights(offloaded, plain)


def test_parallel_clipping_refuses_what_has_no_accelerator():
    with pytest.raises(TypeError, match="transformers.Trainer or an accelerate.Accelerator"):
        parallel_clipping(object())


def test_trainer_with_the_loss_in_the_head_matches_to_float32_rounding(plain_run, tmp_path):
    # loss_chunk_tokens: the loss is summed chunk by chunk (Note: [Chunked loss]); evaluation works
    # without logits.
    losses, plain = plain_run
    model = OffloadedCausalLM(llama(), device="cpu", num_slices=2, loss_chunk_tokens=8)
    args = arguments(tmp_path)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TRAIN, eval_dataset=EVAL,
                                   optimizers=(model.offload_optimizer(args), None))
    trainer.train()
    chunked = logged(trainer)
    assert [entry[:2] for entry in chunked] == [entry[:2] for entry in losses]
    torch.testing.assert_close([entry[2] for entry in chunked], [entry[2] for entry in losses], rtol=1e-5, atol=0)


def plain_and_offloaded_runs(tmp_path, build=llama, **changes) -> list[tuple[list, torch.nn.Module]]:
    """The Trainer's logged losses and the trained model, plain and offloaded (``offload_optimizer``)."""
    runs = []
    for kind in ("plain", "offloaded"):
        hf = build()
        args = arguments(tmp_path / kind, max_steps=2, **changes)
        model = hf if kind == "plain" else OffloadedCausalLM(hf, device="cpu", num_slices=2)
        optimizers = (None, None) if kind == "plain" else (model.offload_optimizer(args), None)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=TRAIN, eval_dataset=EVAL,
                                       optimizers=optimizers)
        trainer.train()
        runs.append((logged(trainer), hf))
    return runs


def test_label_smoothing_shifts_the_labels_as_for_the_plain_model(tmp_path):
    """The Trainer shifts the labels for its label smoother only for a model whose ``_get_name()``
    names a causal LM (Note: [What the trainers read from the model], rule 7)."""
    model = OffloadedCausalLM(llama(), device="cpu", num_slices=2)
    assert model._get_name() == "LlamaForCausalLM" and repr(model).startswith("OffloadedCausalLM(\n")
    runs = plain_and_offloaded_runs(tmp_path, label_smoothing_factor=0.1)
    (plain_logged, plain), (offloaded_logged, offloaded) = runs
    assert offloaded_logged == plain_logged and sum(key == "eval_loss" for key, _, _ in plain_logged) == 1
    assert_same_weights(offloaded, plain)


def test_label_smoothing_with_the_loss_in_the_head_is_refused_with_advice(tmp_path):
    model = OffloadedCausalLM(llama(), device="cpu", num_slices=2, loss_chunk_tokens=8)
    with pytest.raises(ValueError, match="label_smoothing_factor needs the logits.*without loss_chunk_tokens"):
        model.offload_optimizer(arguments(tmp_path, label_smoothing_factor=0.1))
    # What the Trainer's own optimizer meets at the first step: the labels taken out of the batch.
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with pytest.raises(TypeError, match="label_smoothing_factor or compute_loss_func"):
        model(input_ids=ids)


def test_metrics_and_predictions_are_refused_the_logits_the_loss_in_the_head_does_not_return(tmp_path):
    """With loss_chunk_tokens the output has no logits: compute_metrics (with preprocess_logits_for_metrics
    or without) and predict() raise saying what to do, where the Trainer would hand them an empty tuple
    (Note: [What the trainers cannot get from the model], rule 4). The loss alone still evaluates, the
    plain model's to float32 rounding, and trains and evaluates under bf16 (Accelerate reads the
    placeholder's dtype there)."""
    model = OffloadedCausalLM(llama(), device="cpu", num_slices=2, loss_chunk_tokens=8)
    advice = r"returns no logits.*prediction_loss_only=True.*built without loss_chunk_tokens"

    def accuracy(prediction) -> dict[str, float]:
        return {"accuracy": float((prediction.predictions == prediction.label_ids).mean())}

    for extra in ({}, {"preprocess_logits_for_metrics": lambda logits, labels: logits.argmax(-1)}):
        trainer = transformers.Trainer(model=model, args=arguments(tmp_path, eval_strategy="no"), eval_dataset=EVAL,
                                       compute_metrics=accuracy, **extra)
        with pytest.raises(TypeError, match=advice):
            trainer.evaluate()
    with pytest.raises(TypeError, match=advice):
        transformers.Trainer(model=model, args=arguments(tmp_path, eval_strategy="no")).predict(EVAL)
    args = arguments(tmp_path, eval_strategy="no", prediction_loss_only=True)
    metrics = transformers.Trainer(model=model, args=args, eval_dataset=EVAL, compute_metrics=accuracy).evaluate()
    plain = transformers.Trainer(model=llama(), args=arguments(tmp_path / "plain", eval_strategy="no"),
                                 eval_dataset=EVAL).evaluate()
    assert "eval_accuracy" not in metrics
    torch.testing.assert_close(metrics["eval_loss"], plain["eval_loss"], rtol=1e-5, atol=0)
    # Training prepares the model: under bf16 its outputs pass through Accelerate's float32 conversion.
    model = OffloadedCausalLM(llama(), device="cpu", num_slices=2, loss_chunk_tokens=8)
    trainer = transformers.Trainer(model=model, args=arguments(tmp_path, max_steps=2, bf16=True), train_dataset=TRAIN,
                                   eval_dataset=EVAL)
    trainer.train()
    assert [key for key, _, _ in logged(trainer)] == ["loss", "grad_norm", "loss", "grad_norm", "eval_loss"]


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, pad_token_id=0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.AutoModelForCausalLM.from_config(config)


def test_gpt2_under_the_trainer_matches_the_plain_model_bit_for_bit(tmp_path):
    """GPT-2's ``loss_type`` is ``None`` (its class name names no loss): the Trainer then counts
    ``num_items_in_batch`` over the unshifted labels, and must for the offloaded model too."""
    model = OffloadedCausalLM(gpt2(), device="cpu", num_slices=2)
    assert model.loss_type is None
    (plain_logged, plain), (offloaded_logged, offloaded) = plain_and_offloaded_runs(tmp_path, build=gpt2)
    assert offloaded_logged == plain_logged
    assert_same_weights(offloaded, plain)


@CUDA
def test_trainer_moves_the_compute_to_the_gpu_and_keeps_the_parameters_on_the_host(tmp_path):
    # Trainer calls model.to("cuda:0"); float32 on the GPU: the plain run's losses to rounding.
    runs = []
    for kind in ("plain", "offloaded"):
        hf = llama()
        model = hf if kind == "plain" else OffloadedCausalLM(hf, device="cpu", num_slices=2)
        trainer = transformers.Trainer(model=model, args=arguments(tmp_path / kind, use_cpu=False),
                                       train_dataset=TRAIN, eval_dataset=EVAL)
        trainer.train()
        runs.append(logged(trainer))
        if kind == "offloaded":
            assert model.device.type == "cuda"
            assert all(p.device.type == "cpu" and p.is_pinned() for p in hf.parameters())
    (plain, offloaded) = runs
    assert [entry[:2] for entry in offloaded] == [entry[:2] for entry in plain]
    torch.testing.assert_close([entry[2] for entry in offloaded], [entry[2] for entry in plain], rtol=1e-4, atol=0)


def test_checkpoints_resume_exactly_and_saved_models_load_with_from_pretrained(plain_run, tmp_path):
    losses, plain = plain_run
    # An interrupted run: checkpoints every 2 steps, stopped after 2 (max_steps=2 with the same schedule length
    # would change the schedule, so a callback stops it).
    model = OffloadedCausalLM(llama(), device="cpu", num_slices=3)
    args = arguments(tmp_path, save_strategy="steps", save_steps=2)

    class StopAfterTwo(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 2

    transformers.Trainer(model=model, args=args, train_dataset=TRAIN, eval_dataset=EVAL,
                         optimizers=(model.offload_optimizer(args), None), callbacks=[StopAfterTwo()]).train()
    checkpoint = tmp_path / "checkpoint-2"
    # A checkpoint is a Hugging Face folder, one shard per slice.
    assert (checkpoint / "model.safetensors.index.json").exists() and (checkpoint / "config.json").exists()
    # A new process would build the model afresh: here, new weights (another seed) that the resume overwrites.
    torch.manual_seed(1)
    resumed_hf = llama()
    for p in resumed_hf.parameters():
        torch.nn.init.normal_(p)
    resumed = OffloadedCausalLM(resumed_hf, device="cpu", num_slices=3)
    trainer = transformers.Trainer(model=resumed, args=args, train_dataset=TRAIN, eval_dataset=EVAL,
                                   optimizers=(resumed.offload_optimizer(args), None))
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert [entry for entry in logged(trainer) if entry[1] > 2] == [entry for entry in losses if entry[1] > 2]
    assert_same_weights(resumed_hf, plain)
    # save_model writes a folder from_pretrained loads, with the trained weights.
    trainer.save_model(str(tmp_path / "final"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert_same_weights(loaded, plain)


def test_a_tied_model_saves_once_and_loads_tied(tmp_path):
    hf = llama(tied=True)
    model = OffloadedCausalLM(hf, device="cpu", num_slices=2)
    with torch.no_grad():
        hf.model.embed_tokens.weight.add_(1.0)  # the head's weight is the same tensor: it changes too
    model.save_pretrained(tmp_path)
    assert os.listdir(tmp_path).count("model.safetensors.index.json") == 1
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert_same_weights(loaded, hf)
    # state_dict and load_state_dict in Hugging Face names, as Trainer's resume uses them.
    assert set(model.state_dict()) == set(hf.state_dict())
    other = OffloadedCausalLM(llama(tied=True), device="cpu", num_slices=2)
    result = other.load_state_dict(loaded.state_dict(), strict=False)
    assert result.unexpected_keys == []
    assert_same_weights(other.hf_model, hf)


def test_save_pretrained_leaves_no_older_weights_and_writes_experts_as_hugging_face_does(tmp_path):
    from safetensors.torch import load_file

    # Saved back into the folder it was loaded from (one model.safetensors): the shards replace that file.
    llama().save_pretrained(tmp_path / "llama")
    model = OffloadedCausalLM.from_pretrained(tmp_path / "llama", device="cpu", num_slices=2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.save_pretrained(tmp_path / "llama")
    assert "model.safetensors" not in os.listdir(tmp_path / "llama")
    assert_same_weights(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama"), model.hf_model)
    # Fused experts are stored one by one, under the names the model's own save_pretrained writes.
    torch.manual_seed(0)
    mixtral = transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2))
    mixtral.save_pretrained(tmp_path / "plain")
    OffloadedCausalLM(mixtral, device="cpu", num_slices=2).save_pretrained(tmp_path / "offloaded")

    def stored(folder):
        return {key: t for file in sorted(folder.glob("*.safetensors")) for key, t in load_file(file).items()}

    plain, offloaded = stored(tmp_path / "plain"), stored(tmp_path / "offloaded")
    assert offloaded.keys() == plain.keys() and any(".experts.0." in key for key in plain)
    torch.testing.assert_close(offloaded, plain, **EXACT)


def mixture_of_experts(kind: str, seed: int = 0) -> torch.nn.Module:
    """A tiny Mixtral (stored as ``block_sparse_moe.experts.3.w1``, renamed and stacked on loading) or
    Qwen3-MoE (stored as ``mlp.experts.3.gate_proj``, stacked on loading)."""
    torch.manual_seed(seed)
    shared = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                  num_experts_per_tok=2, pad_token_id=0)
    config = (transformers.MixtralConfig(intermediate_size=64, num_local_experts=4, **shared) if kind == "mixtral" else
              transformers.Qwen3MoeConfig(moe_intermediate_size=16, num_experts=4, head_dim=8, **shared))
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_a_mixture_of_experts_resumes_exactly_from_its_experts_stored_one_by_one(kind, tmp_path):
    # The checkpoint stores each expert apart (save_pretrained's layout); the Trainer loads it with
    # load_state_dict, which stacks them back into the fused tensors.
    args = arguments(tmp_path, eval_strategy="no", save_strategy="steps", save_steps=2)
    runs = []
    for seed, checkpoint in ((0, None), (1, str(tmp_path / "checkpoint-2"))):
        model = OffloadedCausalLM(mixture_of_experts(kind, seed), device="cpu", num_slices=2)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=TRAIN,
                                       optimizers=(model.offload_optimizer(args), None))
        trainer.train(resume_from_checkpoint=checkpoint)
        runs.append((logged(trainer), model.hf_model))
    (uninterrupted, expected), (resumed, actual) = runs
    assert any(".experts.0." in key for key in load_checkpoint(tmp_path / "checkpoint-2"))
    assert [entry for entry in resumed if entry[1] > 2] == [entry for entry in uninterrupted if entry[1] > 2]
    assert_same_weights(actual, expected)


def load_checkpoint(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {key: t for file in sorted(folder.glob("*.safetensors")) for key, t in load_file(file).items()}


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_load_state_dict_takes_experts_stored_one_by_one_as_from_pretrained_does(kind, tmp_path):
    saved = OffloadedCausalLM(mixture_of_experts(kind), device="cpu", num_slices=2)
    saved.save_pretrained(tmp_path)
    stored = load_checkpoint(tmp_path)
    from_pretrained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    model = OffloadedCausalLM(mixture_of_experts(kind, seed=1), device="cpu", num_slices=2)
    result = model.load_state_dict(stored)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert_same_weights(model.hf_model, from_pretrained)
    # The model's own (fused) names still load.
    fused = OffloadedCausalLM(mixture_of_experts(kind, seed=2), device="cpu", num_slices=2)
    fused.load_state_dict(saved.state_dict())
    assert_same_weights(fused.hf_model, from_pretrained)
    # Inside a parent module (a LightningModule's checkpoint), under its prefix.
    parent = torch.nn.Module()
    parent.net = OffloadedCausalLM(mixture_of_experts(kind, seed=2), device="cpu", num_slices=2)
    parent.load_state_dict({f"net.{key}": t for key, t in stored.items()})
    assert_same_weights(parent.net.hf_model, from_pretrained)
    # One expert's part missing: its stacked tensor is missing, the other parts stacked with it unexpected.
    part = "block_sparse_moe.experts.1.w3" if kind == "mixtral" else "mlp.experts.1.up_proj"
    result = model.load_state_dict({key: t for key, t in stored.items() if f"layers.0.{part}" not in key}, strict=False)
    assert result.missing_keys == ["model.layers.0.mlp.experts.gate_up_proj"]
    assert len(result.unexpected_keys) == 7 and all("layers.0." in key for key in result.unexpected_keys)
    # One of the wrong shape: named as load_state_dict names a tensor of the wrong shape.
    with pytest.raises(RuntimeError, match=r"size mismatch for net\.model\.layers\.1\."):
        parent.load_state_dict({f"net.{key}": t for key, t in stored.items()} | {
            f"net.model.layers.1.{part}.weight": torch.zeros(3, 32)})


def test_return_dict_logits_to_keep_and_a_given_state_dict_as_the_model_takes_them(tmp_path):
    from safetensors.torch import load_file

    hf = llama().eval()
    model = OffloadedCausalLM(llama(), device="cpu", num_slices=2).eval()
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    loss, logits = model(input_ids=ids, labels=ids, return_dict=False)
    expected = hf(input_ids=ids, labels=ids, use_cache=False, return_dict=False)
    assert len(expected) == 2
    torch.testing.assert_close((loss, logits), expected, **EXACT)
    assert model.base_model(input_ids=ids, return_dict=False)[0].shape == (2, 9, 32)
    # The kept logits are the rows of every position's (the model projects only those rows: they may
    # round differently, by about a float32 ulp).
    full = hf(input_ids=ids, use_cache=False).logits
    keeps = {1: full[:, -1:], 3: full[:, -3:], "positions": full[:, [0, 4]], "per row": full[[[0], [1]], [[1], [8]]]}
    for keep, want in keeps.items():
        kept = {"positions": torch.tensor([0, 4]), "per row": torch.tensor([[1], [8]])}.get(keep, keep)
        got = model(input_ids=ids, logits_to_keep=kept).logits
        torch.testing.assert_close(got, want, **EXACT)
        torch.testing.assert_close(got, hf(input_ids=ids, use_cache=False, logits_to_keep=kept).logits,
                                   rtol=1e-6, atol=1e-7)
        if keep == 3:  # with labels for the kept positions: the model's loss on them
            labels = ids[:, -keep:]
            got = model(input_ids=ids, labels=labels, logits_to_keep=kept).loss
            torch.testing.assert_close(got, hf(input_ids=ids, labels=labels, use_cache=False, logits_to_keep=kept).loss,
                                       rtol=1e-6, atol=1e-7)
    # save_pretrained(state_dict=...) writes those tensors, as the model's own does.
    given = {key: torch.full_like(t, 0.5) for key, t in model.state_dict().items()}
    names = set(given)
    model.save_pretrained(tmp_path, state_dict=given)  # which empties the dict, as the model's own does
    written = {key: t for file in tmp_path.glob("*.safetensors") for key, t in load_file(file).items()}
    assert written.keys() == names and all(bool((t == 0.5).all()) for t in written.values())


def test_from_pretrained_loads_a_folder_slice_by_slice(tmp_path):
    hf = llama()
    hf.save_pretrained(tmp_path)
    model = OffloadedCausalLM.from_pretrained(tmp_path, device="cpu", num_slices=2)
    assert_same_weights(model.hf_model, hf)
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(input_ids=ids).logits, hf.eval()(input_ids=ids).logits, **EXACT)


def test_the_model_looks_like_a_hugging_face_causal_lm():
    hf = llama()
    model = OffloadedCausalLM(hf, device="cpu", num_slices=2)
    assert model.loss_type == "ForCausalLM" and model.config is hf.config and model.main_input_name == "input_ids"
    assert model.get_input_embeddings() is hf.model.embed_tokens and model.get_output_embeddings() is hf.lm_head
    assert model.num_parameters() == hf.num_parameters()
    assert model.num_parameters(exclude_embeddings=True) == hf.num_parameters(exclude_embeddings=True)
    assert model.device == torch.device("cpu")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    assert model.is_gradient_checkpointing
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :3] = -100
    expected = hf(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(11))
    output = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(11), use_cache=False)
    torch.testing.assert_close(output.loss, expected.loss, **EXACT)
    torch.testing.assert_close(output.logits, expected.logits, **EXACT)
    hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state
    torch.testing.assert_close(hidden, hf.model(input_ids=ids).last_hidden_state, **EXACT)
    with pytest.raises(TypeError, match="cannot honour inputs_embeds"):
        model(input_ids=ids, inputs_embeds=torch.zeros(2, 9, 32))


def test_a_chunked_loss_is_the_models_to_float32_rounding():
    hf = llama()
    model = OffloadedCausalLM(hf, device="cpu", num_slices=2, loss_chunk_tokens=5)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    output = model(input_ids=ids, labels=ids)
    with pytest.raises(TypeError, match="returns no logits"):  # a placeholder: rule 4 of Note: [What the trainers
        output.logits.float()                                    # cannot get from the model]
    torch.testing.assert_close(output.loss, hf(input_ids=ids, labels=ids).loss, rtol=1e-6, atol=0)


def test_offload_optimizer_groups_and_hyperparameters_are_the_trainers(tmp_path, monkeypatch):
    model = OffloadedCausalLM(llama(), device="cpu", num_slices=2)
    args = arguments(tmp_path, weight_decay=0.1, adam_beta2=0.98, learning_rate=3e-4)
    optimizer = model.offload_optimizer(args)
    decayed, plain = optimizer.param_groups
    names = {p: name for name, p in model.named_parameters()}
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all("norm" in names[p] for p in plain["params"]) and not any("norm" in names[p] for p in decayed["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(names)
    assert decayed["betas"] == (0.9, 0.98) and decayed["lr"] == 3e-4 and decayed["fused"] is True
    # An optimizer the Trainer builds from the whole model (GaLore, LOMO, ...) cannot step slice by slice.
    monkeypatch.setattr(transformers.Trainer, "get_optimizer_cls_and_kwargs",
                        staticmethod(lambda args, model: (torch.optim.AdamW, {"lr": 1e-3, "model": model})))
    with pytest.raises(ValueError, match="builds its optimizer from the whole model"):
        model.offload_optimizer(args)
    # A schedule-free optimizer (optim="schedule_free_adamw"): its train() and eval() would never be called.
    from .test_optimizer import _ScheduleFree
    monkeypatch.setattr(transformers.Trainer, "get_optimizer_cls_and_kwargs",
                        staticmethod(lambda args, model: (_ScheduleFree, {"lr": 1e-3})))
    with pytest.raises(ValueError, match=r"optimizers=\(None, None\)"):
        model.offload_optimizer(args)


def lora_model() -> torch.nn.Module:
    peft = pytest.importorskip("peft")
    hf = llama()
    torch.manual_seed(5)  # the adapters' initial values
    return peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def test_offload_optimizer_keeps_the_trainers_empty_group_so_their_states_load_into_each_other(tmp_path):
    """LoRA adapters alone (no biases, no norms) leave the Trainer's second group empty; it keeps it."""
    args = arguments(tmp_path, weight_decay=0.1, eval_strategy="no")
    plain = transformers.Trainer(model=lora_model(), args=args, train_dataset=TRAIN).create_optimizer()
    model = OffloadedCausalLM(lora_model(), device="cpu", num_slices=2)
    optimizer = model.offload_optimizer(args)
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    assert sizes == [len(g["params"]) for g in plain.param_groups] == [8, 0]
    optimizer.load_state_dict(plain.state_dict())
    plain.load_state_dict(optimizer.state_dict())


def test_load_best_model_at_end_with_lora_is_refused_with_advice(tmp_path):
    """The Trainer reloads the best adapters only into a PeftModel it trains itself: for this model it
    would look for the whole model's weights after the last step. Refused before the first."""
    model = OffloadedCausalLM(lora_model(), device="cpu", num_slices=2)
    args = arguments(tmp_path, save_strategy="steps", save_steps=2, load_best_model_at_end=True)
    with pytest.raises(ValueError, match=r"load_best_model_at_end=False.*PeftModel.from_pretrained\(base_model, "
                                         r"trainer.state.best_model_checkpoint\)"):
        model.offload_optimizer(args)


# -- TRL's SFTTrainer -------------------------------------------------------------------------------

trl = pytest.importorskip("trl")


def byte_tokenizer():
    """UTF-8 bytes as ids, and two special tokens: nothing to download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = (b for b in range(256) if b not in printable)
    char = {b: chr(b) for b in printable} | {b: chr(256 + k) for k, b in enumerate(others)}
    inner = Tokenizer(models.BPE(vocab={char[b]: b for b in range(256)}, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=inner)
    tokenizer.add_special_tokens({"eos_token": "<eos>", "pad_token": "<pad>"})
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{{ eos_token }}"
    return tokenizer


CHAT = {"messages": [[{"role": "user", "content": f"what is {i} + {i}?"},
                      {"role": "assistant", "content": f"{2 * i}"}] for i in range(16)]}
TEXT = {"text": [f"the number {i} is {'even' if i % 2 == 0 else 'odd'}." for i in range(16)]}


@pytest.mark.parametrize(("data", "packing"), [(CHAT, False), (TEXT, True)], ids=["chat-template", "packing"])
def test_sft_trainer_matches_the_plain_model_bit_for_bit(data, packing, tmp_path):
    # SFTConfig's defaults otherwise (bf16, gradient checkpointing, TRL's fused LM head).
    tokenizer = byte_tokenizer()
    runs = []
    for kind in ("plain", "offloaded"):
        hf = llama(len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        model = hf if kind == "plain" else OffloadedCausalLM(hf, device="cpu", num_slices=2)
        config = trl.SFTConfig(output_dir=str(tmp_path / kind), use_cpu=True, report_to=[],
                               per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=2,
                               logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True, learning_rate=1e-2,
                               warmup_steps=1, max_length=64, packing=packing)
        trainer = trl.SFTTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_dict(data),
                                 processing_class=tokenizer)
        if kind == "offloaded":
            parallel_clipping(trainer)  # TRL's trainers clip as the Trainer does
        trainer.train()
        runs.append((logged(trainer), hf))
    (plain_losses, plain), (losses, offloaded) = runs
    assert losses == plain_losses and len(losses) == 4  # a loss and a gradient norm per step
    assert_same_weights(offloaded, plain)


def test_sft_trainer_trains_the_same_lora_adapters_and_refuses_a_peft_config(tmp_path):
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    tokenizer = byte_tokenizer()
    config = dict(use_cpu=True, report_to=[], per_device_train_batch_size=4, max_steps=2, logging_steps=1,
                  save_strategy="no", seed=0, disable_tqdm=True, learning_rate=1e-2, max_length=64)
    runs = []
    for kind in ("plain", "offloaded"):
        hf = llama(len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        torch.manual_seed(5)  # the adapters' initial values
        lora = peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        model = lora if kind == "plain" else OffloadedCausalLM(lora, device="cpu", num_slices=2)
        trainer = trl.SFTTrainer(model=model, args=trl.SFTConfig(output_dir=str(tmp_path / kind), **config),
                                 train_dataset=datasets.Dataset.from_dict(CHAT), processing_class=tokenizer)
        trainer.train()
        trainer.save_model(str(tmp_path / kind / "adapter"))  # PeftModel.save_pretrained: the adapters alone
        runs.append((logged(trainer), load_file(tmp_path / kind / "adapter" / "adapter_model.safetensors")))
    (plain_losses, plain), (losses, offloaded) = runs
    assert losses == plain_losses
    assert plain.keys() == offloaded.keys() and any("lora_A" in key for key in plain)
    for key, tensor in plain.items():
        torch.testing.assert_close(offloaded[key], tensor, **EXACT, msg=lambda m: f"{key}: {m}")
    # TRL's peft_config would wrap the offloaded model in PEFT, which names adapters by the stages: refused.
    model = OffloadedCausalLM(llama(len(tokenizer), pad_token_id=tokenizer.pad_token_id), device="cpu", num_slices=2)
    with pytest.raises(ValueError, match="wrap the PeftModel"):
        trl.SFTTrainer(model=model, args=trl.SFTConfig(output_dir=str(tmp_path / "refused"), **config),
                       train_dataset=datasets.Dataset.from_dict(CHAT), processing_class=tokenizer,
                       peft_config=peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def test_update_in_backward_under_the_trainer_is_refused_up_front(tmp_path):
    """The Trainer rewrites every gradient in place between backward and step() (clipping, or a
    clip at an infinite norm to log the norm even with max_grad_norm=0): refused when the
    optimizer is built, not at the first step()."""
    model = OffloadedCausalLM(llama(), device="cpu", num_slices=2)
    for max_grad_norm in (1.0, 0.0):
        with pytest.raises(ValueError, match="update_in_backward cannot be used under transformers.Trainer.*infinite "
                                             "norm"):
            model.offload_optimizer(arguments(tmp_path, max_grad_norm=max_grad_norm), update_in_backward=True)
