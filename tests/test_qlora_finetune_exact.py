"""``offload-finetune --model DIR --lora-r R --load-in-4bit`` against the same QLoRA model trained
unwrapped by hand from the same saved bfloat16 checkpoint: every printed loss and every saved
adapter weight, bit for bit (issue 42, item 2, through the command).

The reference is written as a user would write it with transformers, PEFT and PyTorch alone,
matching each of the command's settings (docs/lora.md, "Matching offload-finetune by hand", lists
them): the checkpoint loaded in ``--compute-dtype``'s dtype (``none``: float32, not the stored
bfloat16) with that dtype as ``bnb_4bit_compute_dtype``; ``lora_alpha`` twice the rank (PEFT's
default is 8); ``torch.manual_seed(--seed)`` before loading; AdamW fused without weight decay
(PyTorch's default is 0.01); transformers' schedule; the loss over every microstep's tokens
(``num_items_in_batch``); torch's clipping; with ``--microbatches K`` a forward and backward per
chunk of rows. Only the loss's rounding under ``--loss-chunk-tokens`` (the default) is the
library's own: Note: [Chunked loss] in ``offload/integrations/transformers_stages.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
with warnings.catch_warnings():  # its optional CPU kernels ("pip install kernels") are not needed
    warnings.simplefilter("ignore")
    pytest.importorskip("bitsandbytes")
from safetensors.torch import load_file  # noqa: E402

from offload.cli import finetune as cli  # noqa: E402
from offload.cli.finetune_args import DTYPES, SCHEDULES  # noqa: E402
from offload.cli.finetune_args import parse_args as finetune_args  # noqa: E402
from offload.cli.models import random_model  # noqa: E402

from .test_finetune import EXACT, run_cli  # noqa: E402

STEPS = 3
COMMON = ["--steps", str(STEPS), "--batch-size", "2", "--seq-len", "16", "--lora-r", "2", "--seed", "3",
          "--load-in-4bit"]
CASES = {
    # What a GPU run would use: the checkpoint's bfloat16, the default chunked loss; every training
    # option that changes the arithmetic, and dropout (the recompute's draws must be the forward's).
    "bf16, chunked loss, accumulation, clipping, schedule, dropout": [
        "--compute-dtype", "bf16", "--grad-accum", "2", "--max-grad-norm", "0.5", "--lr-schedule", "cosine",
        "--warmup-steps", "1", "--lora-dropout", "0.1"],
    # The CPU's default dtype (float32), HF's own loss on the logits; FP4 without double quantisation,
    # the model in one slice resident and one streamed.
    "float32, logits, fp4": [
        "--compute-dtype", "none", "--loss-chunk-tokens", "0", "--bnb-4bit-quant-type", "fp4",
        "--no-bnb-4bit-use-double-quant", "--num-slices", "2", "--resident-slices", "1"],
    "microbatches": ["--compute-dtype", "bf16", "--loss-chunk-tokens", "0", "--microbatches", "2"],
    # --untie-embeddings loads with from_pretrained, the command's other path (a no-op on this
    # untied model otherwise); microbatches under the chunked loss. Not with dropout: a slice
    # draws for each chunk before the next slice runs, an unwrapped model for the whole model.
    "from_pretrained path, chunked loss, microbatches": ["--compute-dtype", "bf16", "--untie-embeddings",
                                                        "--microbatches", "2"],
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random tiny Llama saved in bfloat16, with the command's byte tokenizer."""
    path = tmp_path_factory.mktemp("llama_bf16")
    torch.manual_seed(0)
    hf, tokenizer = random_model("llama", "tiny", 256, 16)
    hf.to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def chunked_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed token losses as the command's chunked head adds them: HF's shifted float32
    cross-entropies per token, added into their row in token order, then the rows added."""
    targets = F.pad(labels, (0, 1), value=-100)[:, 1:]
    per_token = F.cross_entropy(logits.float().flatten(0, 1), targets.reshape(-1), ignore_index=-100,
                                reduction="none")
    rows = torch.arange(labels.shape[0]).repeat_interleave(labels.shape[1])
    return torch.zeros(labels.shape[0]).index_add(0, rows, per_token).sum()


def unwrapped_run(args: list[str]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The QLoRA model trained by hand as the command trains it: each step's loss and the adapters."""
    settings = finetune_args(["--device", "cpu", "--out", "unused", *args])
    dtype = DTYPES[settings.compute_dtype] or torch.float32
    four_bit = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=settings.bnb_4bit_quant_type,
                                               bnb_4bit_use_double_quant=settings.bnb_4bit_use_double_quant,
                                               bnb_4bit_compute_dtype=dtype)
    torch.manual_seed(settings.seed)  # the adapters' initial values, then dropout's draws
    hf = transformers.AutoModelForCausalLM.from_pretrained(settings.model, quantization_config=four_bit, dtype=dtype,
                                                           device_map="cpu")
    hf.config.use_cache = False
    model = peft.get_peft_model(hf, peft.LoraConfig(r=settings.lora_r, lora_alpha=2 * settings.lora_r,
                                                    lora_dropout=settings.lora_dropout,
                                                    target_modules="all-linear", task_type="CAUSAL_LM"))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=settings.lr, weight_decay=0.0, fused=True)
    scheduler = transformers.get_scheduler(SCHEDULES[settings.lr_schedule], optimizer,
                                           num_warmup_steps=settings.warmup_steps, num_training_steps=settings.steps)
    # The command's data order: its batches are a function of --seed alone.
    batches = cli.Batches(settings, transformers.AutoTokenizer.from_pretrained(settings.model)).train()
    losses = []
    for _ in range(settings.steps):
        micro = [next(batches) for _ in range(settings.grad_accum)]
        tokens = sum((ids[:, 1:] != -100).sum() for ids in micro)  # num_items_in_batch, as the Trainer counts
        step_loss = None
        for ids in micro:
            # OffloadModel's microbatches: each chunk of rows runs through the model on its own,
            # and the loss is taken over the whole batch.
            logits = torch.cat([model(input_ids=rows).logits for rows in ids.chunk(settings.microbatches)])
            if settings.loss_chunk_tokens:
                loss = chunked_loss_sum(logits, ids) / tokens
            else:
                loss = hf.loss_function(logits=logits, labels=ids, vocab_size=hf.config.vocab_size,
                                        num_items_in_batch=tokens)
            loss.backward()
            step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
        if settings.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(trainable, settings.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss.item())
    adapters = {n.replace(".default", ""): p.detach() for n, p in model.named_parameters() if p.requires_grad}
    return losses, adapters


# peft asks the model a deprecated transformers question; the note is theirs.
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
@pytest.mark.parametrize("flags", CASES.values(), ids=CASES.keys())
def test_finetune_trains_a_checkpoint_in_4bits_as_the_same_qlora_model_trained_by_hand(flags, checkpoint, tmp_path,
                                                                                      capsys):
    args = ["--model", str(checkpoint), *COMMON, *flags]
    code, out, err = run_cli(*args, "--out", str(tmp_path / "adapter"), tmp_path=tmp_path, capsys=capsys)
    assert code == 0, err
    # The last step's loss in full (repr); the earlier ones as printed, rounded to 4 places.
    printed = [line.split()[3] for line in out.splitlines() if line.startswith("step ")]
    final = float(next(line for line in out.splitlines() if line.startswith("final loss ")).split()[2].rstrip(";"))
    losses, want = unwrapped_run(args)
    assert printed == [f"{loss:.4f}" for loss in losses] and final == losses[-1], (printed, final, losses)
    got = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert sorted(got) == sorted(want) and len(got) == 2 * 7 * 4
    assert all(want[n].abs().sum() > 0 for n in want if "lora_B" in n)  # trained, not the zero init
    torch.testing.assert_close(got, want, **EXACT)
