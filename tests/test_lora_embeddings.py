"""Adapters on the token embedding and on ``lm_head`` injected after the stages were cut, against PEFT.

The embedding stage and the head hold those modules themselves (the decoder layers' adapters sit
inside the layers), so when ``peft.get_peft_model`` replaces them on their Hugging Face parent, the
stages must take the new modules too (Note: [PEFT models] in ``offload/integrations/peft.py``,
rule 5). That happens when the adapters go in after ``OffloadModel`` was built, and always on the
path that loads a model slice by slice (``load_causal_lm``, ``offload-finetune --model``).
Everything is compared bit for bit with the ``PeftModel`` run the ordinary way.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from offload import OffloadModel

from .test_peft import assert_same_step, lora, trainable
from .test_transformers import EXACT, batch, build

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from offload.integrations.transformers import causal_lm_sequential  # noqa: E402  (needs transformers)
from offload.integrations.transformers_loading import load_causal_lm  # noqa: E402

#: Adapters on the modules the embedding stage and the head hold, beside one inside the layers.
CONFIGS = {
    "lora": {"llama": {"target_modules": ["q_proj", "embed_tokens", "lm_head"]},
             "gpt2": {"target_modules": ["c_attn", "wte", "lm_head"]}},
    "modules-to-save": {"llama": {"target_modules": ["q_proj"], "modules_to_save": ["lm_head", "embed_tokens"]},
                        "gpt2": {"target_modules": ["c_attn"], "modules_to_save": ["lm_head", "wte"]}},
}


def train_two_steps(peft_model, reference, model) -> None:
    """Two steps of both, the second after an update of the adapters' host copies: every logit, loss
    and gradient bit for bit, and the embedding's and the head's adapters among those that train."""
    optimizers = [torch.optim.AdamW(trainable(m), lr=1e-2) for m in (peft_model, reference)]
    for step in range(2):
        assert_same_step(peft_model, reference, model, batch(), seed=step)
        outside = [n for n, p in peft_model.named_parameters()
                   if p.grad is not None and ("lm_head" in n or "embed_tokens" in n or "wte" in n)]
        assert len(outside) >= 2, outside
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for (name, p), q in zip(peft_model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, **EXACT, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_embedding_and_head_adapters_added_after_wrapping_train_as_the_peft_model(kind, config):
    hf = build(kind, layers=2)
    reference = lora(copy.deepcopy(hf), kind, **CONFIGS[config][kind])
    model = OffloadModel(causal_lm_sequential(hf), device="cpu", num_slices=3)
    model(batch())  # a forward before the adapters: the slices are laid out without them
    peft_model = lora(hf, kind, **CONFIGS[config][kind])  # replaces the modules the first and last stage hold
    train_two_steps(peft_model, reference, model)


@pytest.mark.parametrize("config", CONFIGS)
def test_adapters_injected_into_a_model_loaded_slice_by_slice_train_as_from_pretrained_does(config, tmp_path):
    # offload-finetune --model: load_causal_lm, then the adapters, which nothing could inject before.
    build("llama", layers=2).save_pretrained(tmp_path)
    reference = lora(transformers.AutoModelForCausalLM.from_pretrained(tmp_path), **CONFIGS[config]["llama"])
    model, hf = load_causal_lm(tmp_path, "cpu", num_slices=3)
    peft_model = lora(hf, **CONFIGS[config]["llama"])
    for module in (model, reference):
        module.train()  # dropout in the model and in the adapters: the same masks
    train_two_steps(peft_model, reference, model)


def test_finetune_trains_lora_on_the_embedding_and_head_of_a_model_loaded_slice_by_slice(tmp_path, capsys,
                                                                                         monkeypatch):
    # The same losses and exported adapter as the run that loads with from_pretrained and injects
    # the adapters before the stages are cut; and the exported B matrices have moved from zero.
    from safetensors.torch import load_file

    from offload.cli import finetune as cli
    from offload.cli.models import pretrained_model, random_model, with_lora

    from .test_finetune import run_cli

    torch.manual_seed(0)
    hf, tokenizer = random_model("llama", "tiny", 256, 16)
    hf.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    args = ["--model", str(tmp_path / "base"), "--steps", "2", "--batch-size", "2", "--seq-len", "16",
            "--lora-r", "4", "--lr", "1e-2", "--lora-targets", "q_proj", "lm_head", "embed_tokens"]

    def from_pretrained_then_wrapped(args, options, causal_lm_sequential, load_causal_lm):
        hf, tokenizer = pretrained_model(args.model, None)
        peft_model = with_lora(hf, args)
        layers = causal_lm_sequential(peft_model, loss_chunk_tokens=args.loss_chunk_tokens or None)
        return OffloadModel(layers, device=args.device, **options), hf, tokenizer, peft_model

    def run(name: str) -> tuple[list[str], dict[str, torch.Tensor]]:
        code, out, err = run_cli(*args, "--out", str(tmp_path / name), tmp_path=tmp_path, capsys=capsys)
        assert code == 0, err
        losses = [line.split(" tokens/s")[0].rsplit(" ", 1)[0] for line in out.splitlines()
                  if line.startswith(("step ", "final loss "))]
        return losses, load_file(tmp_path / name / "adapter_model.safetensors")

    losses, trained = run("sliced")
    monkeypatch.setattr(cli, "_build_model", from_pretrained_then_wrapped)
    want_losses, want = run("whole")
    assert len(losses) == 3 and losses == want_losses
    moved = [n for n in want if ("lm_head.lora_B" in n or "lora_embedding_B" in n) and want[n].abs().sum() > 0]
    assert len(moved) == 2, sorted(want)
    torch.testing.assert_close(trained, want, **EXACT)


def test_the_exported_config_keeps_the_models_use_cache(tmp_path, capsys):
    # Training runs the stages, which pass no cache; the exported model is the user's, cache included.
    from offload.cli.models import random_model

    from .test_finetune import run_cli

    torch.manual_seed(0)
    hf, tokenizer = random_model("llama", "tiny", 256, 16)
    assert hf.config.use_cache is True
    hf.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    code, _, err = run_cli("--model", str(tmp_path / "base"), "--out", str(tmp_path / "out"), "--steps", "1",
                           "--batch-size", "2", "--seq-len", "16", tmp_path=tmp_path, capsys=capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "out" / "config.json").read_text())["use_cache"] is True
