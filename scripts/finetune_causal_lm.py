"""Fine-tune a Hugging Face causal LM with OffloadModel and OffloadOptimizer, end to end.

By default the model is a small randomly initialised Llama built from a config, and the text is
read byte by byte (ids 0-255), so nothing is downloaded; a byte-level tokenizer is saved with it.
With ``--model PATH`` it loads weights and tokenizer from a local directory (``save_pretrained``
output, this script's included), slice by slice into the host copies (``load_causal_lm``: never the
whole model in RAM beside them), or with ``from_pretrained`` for LoRA and ``--untie-embeddings``.
Either way it trains on the text of ``--text`` (a short text shipped with the repository by
default), shows loss and tokens/s in a progress bar, and writes the trained model with ``save_pretrained`` into ``--out``. The loss is
computed in the head, ``--loss-chunk-tokens`` tokens at a time, so the batch's logits never sit on
the device whole; ``--loss-chunk-tokens 0`` returns the logits and computes the loss from them.
With ``--save-every N`` it saves a checkpoint every N steps under ``--out``/checkpoints/step-N;
``--resume latest`` (or a checkpoint's path) continues from one, with the same batches and losses
as a run that never stopped.
With ``--disk-tier DIR`` AdamW's moments live in files in DIR, and with ``--masters-on-disk`` the
float32 masters too (under ``--compute-dtype`` bf16 or fp16): host RAM then holds the shadow and
the gradients, about 7 bytes per parameter, instead of 18 (``docs/disk-tier.md``).
With ``--lora-r R`` it trains LoRA adapters (``peft``) on the frozen model instead of every weight,
and ``--out`` receives the adapter (``PeftModel.save_pretrained``; load it back with
``peft.PeftModel.from_pretrained(base_model, out)``).

Usage::

    python scripts/finetune_causal_lm.py --out /tmp/tuned                     # tiny random Llama, CPU or GPU
    python scripts/finetune_causal_lm.py --model ./my-llama --text book.txt --out ./tuned --steps 500 \\
        --batch-size 8 --seq-len 1024 --num-slices 16 --compute-dtype bf16
    python scripts/finetune_causal_lm.py --out /tmp/tuned --steps 40 --save-every 10  # killed at step 27...
    python scripts/finetune_causal_lm.py --out /tmp/tuned --steps 40 --save-every 10 --resume latest
    python scripts/finetune_causal_lm.py --model ./my-llama --out ./adapter --lora-r 16 --lora-targets q_proj v_proj
    python scripts/finetune_causal_lm.py --model ./my-llama --out ./tuned --disk-tier /nvme/offload --masters-on-disk
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path

# PyTorch warns at import when NumPy is not installed, though nothing here needs NumPy.
warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)

import torch

from offload import DiskTier, OffloadModel, OffloadOptimizer, latest_checkpoint, load_checkpoint, save_checkpoint

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "sample.txt"
#: Random-initialised configs by size: (hidden, layers, heads, key/value heads, intermediate).
SIZES = {"tiny": (64, 4, 4, 2, 128), "small": (512, 8, 8, 4, 1408), "1b": (2048, 16, 32, 8, 5632)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}
try:
    from offload.integrations.transformers import SUPPORTED_MODEL_TYPES as ARCHITECTURES
except ImportError:  # without the extra, --help still answers; training says what to install
    ARCHITECTURES = ("llama",)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", type=Path, help="local directory with weights (and tokenizer) to fine-tune")
    parser.add_argument("--arch", default="llama", choices=ARCHITECTURES,
                        help="architecture of the random-initialised model when no --model is given")
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES), help="size of the random-initialised model")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="plain-text file to train on")
    parser.add_argument("--out", type=Path, required=True, help="directory for save_pretrained")
    parser.add_argument("--steps", type=int, default=20, help="training steps")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--num-slices", type=int, default=3, help="num_slices of OffloadModel")
    parser.add_argument("--microbatches", type=int, default=1, help="num_microbatches of OffloadModel")
    parser.add_argument("--compute-dtype", default="bf16", choices=sorted(DTYPES), help="compute_dtype of OffloadModel")
    # 1024 tokens: one chunk's logits are 1024 x vocab (0.5 GB in float32 for a 128k vocabulary), and each
    # projection is still a product of 1024 rows by the whole vocabulary.
    parser.add_argument("--loss-chunk-tokens", type=int, default=1024,
                        help="compute the loss in the head over chunks of this many tokens (0: return logits)")
    parser.add_argument("--untie-embeddings", action="store_true",
                        help="give a tied lm_head a weight of its own (by default tied embeddings stay tied)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the layers compute (cuda when present)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model's initialisation and the batches")
    parser.add_argument("--no-progress", action="store_true",
                        help="print one line per step instead of a bar, and no loading bars")
    parser.add_argument("--disk-tier", type=Path, metavar="DIR",
                        help="keep AdamW's moments in files in DIR, a local disk (OffloadOptimizer(disk_tier=...))")
    parser.add_argument("--masters-on-disk", action="store_true",
                        help="keep the float32 masters in files in --disk-tier's DIR too (OffloadModel(masters=...))")
    add_checkpoint_args(parser)
    add_lora_arguments(parser)
    args = parser.parse_args(argv)
    if args.masters_on_disk and args.disk_tier is None:
        parser.error("--masters-on-disk needs --disk-tier DIR: the directory for their files")
    if args.masters_on_disk and args.compute_dtype == "fp32":
        parser.error("--masters-on-disk needs --compute-dtype bf16 or fp16: loads read the half-precision shadow")
    check_lora_arguments(parser, args)
    for name in ("steps", "batch_size", "seq_len", "num_slices", "microbatches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device}: not a device; use cuda, cuda:N or cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device is available here; use --device cpu")
    if args.loss_chunk_tokens < 0:
        parser.error("--loss-chunk-tokens must be 0 (off) or a number of tokens")
    if not args.text.is_file():
        parser.error(f"--text {args.text}: no such file")
    if args.model is not None and not args.model.is_dir():
        parser.error(f"--model {args.model}: not a directory (a save_pretrained output is expected)")
    check_checkpoint_args(parser, args)
    return args


# -- checkpoints: --save-every and --resume ---------------------------------------------------------


def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--save-every", type=int, default=0, metavar="N",
                        help="save a checkpoint every N steps under OUT/checkpoints/step-N (0: never)")
    parser.add_argument("--keep-checkpoints", type=int, default=None, metavar="K",
                        help="keep only the K newest checkpoints (default: all)")
    parser.add_argument("--resume", metavar="PATH|latest",
                        help="continue from a checkpoint: its directory, or 'latest' for OUT/checkpoints' newest")


def check_checkpoint_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.save_every < 0:
        parser.error("--save-every must be 0 (never) or a number of steps")
    if args.keep_checkpoints is not None and args.keep_checkpoints < 1:
        parser.error("--keep-checkpoints must be at least 1")
    if args.resume == "latest":
        args.resume = latest_checkpoint(args.out / "checkpoints")
        if args.resume is None:
            parser.error(f"--resume latest: no checkpoint under {args.out / 'checkpoints'} yet")
    elif args.resume is not None:
        args.resume = Path(args.resume)


def resume(args: argparse.Namespace, model: OffloadModel, optimizer: OffloadOptimizer,
           generator: torch.Generator) -> int:
    """Load ``--resume`` into the model, the optimizer and the batch generator; the steps done."""
    if args.resume is None:
        return 0
    extra = load_checkpoint(args.resume, model, optimizer)
    generator.set_state(extra["generator"])  # the next batch is the one the stopped run would have drawn
    print(f"resumed from {args.resume} after step {extra['step']}")
    return extra["step"]


def save_every(args: argparse.Namespace, step: int, model: OffloadModel, optimizer: OffloadOptimizer,
               generator: torch.Generator) -> None:
    if args.save_every and step % args.save_every == 0:
        save_checkpoint(args.out / "checkpoints" / f"step-{step}", model, optimizer,
                        extra={"step": step, "generator": generator.get_state()}, keep_last=args.keep_checkpoints)


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    lora = parser.add_argument_group("LoRA", 'train low-rank adapters (peft) on the frozen model: '
                                     'pip install "offload[peft]"')
    lora.add_argument("--lora-r", type=int, default=0, help="adapter rank (0, the default: train every weight)")
    lora.add_argument("--lora-alpha", type=float, help="adapter scale numerator (default: twice the rank)")
    lora.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input")
    lora.add_argument("--lora-targets", nargs="+", default=["all-linear"], metavar="MODULE",
                      help="module names to adapt, or all-linear (every linear layer but the output head)")


def check_lora_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.lora_r < 0:
        parser.error("--lora-r must be 0 (off) or a positive rank")
    if not 0.0 <= args.lora_dropout < 1.0:
        parser.error("--lora-dropout must be in [0, 1)")


def with_lora(hf, args: argparse.Namespace):
    """``hf`` with LoRA adapters (a ``PeftModel``; its base is frozen), or ``None`` without ``--lora-r``."""
    if args.lora_r == 0:
        return None
    try:
        import peft
    except ImportError as error:
        raise SystemExit(f'{error}. --lora-r needs peft: pip install "offload[peft]"') from error
    targets = args.lora_targets[0] if args.lora_targets == ["all-linear"] else args.lora_targets
    config = peft.LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha or 2 * args.lora_r,
                             lora_dropout=args.lora_dropout, target_modules=targets, task_type="CAUSAL_LM")
    peft_model = peft.get_peft_model(hf, config)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    print(f"LoRA rank {args.lora_r} on {', '.join(sorted(config.target_modules))}: "
          f"{trainable / 1e6:.2f} M trainable parameters")
    return peft_model


def random_model(arch: str, size: str, vocab: int, seq_len: int):
    import transformers

    hidden, layers, heads, kv_heads, intermediate = SIZES[size]
    if arch == "gpt2":
        config = transformers.GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=vocab,
                                         n_positions=max(seq_len, 64), tie_word_embeddings=False,
                                         bos_token_id=0, eos_token_id=0)
    else:
        # Token ids 0 for padding and both ends (some families' defaults lie outside a byte
        # vocabulary), and head_dim set where a family would otherwise take a fixed default.
        config = transformers.AutoConfig.for_model(
            arch, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=vocab,
            max_position_embeddings=max(seq_len, 64), tie_word_embeddings=False, head_dim=hidden // heads,
            pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(config), byte_tokenizer()


def byte_tokenizer():
    """A tokenizer whose ids are the text's UTF-8 bytes (0-255), saved with the random model.

    With it, ``AutoTokenizer.from_pretrained(out)`` and ``--model out`` work on the output as on
    any ``save_pretrained`` directory, and ``decode`` turns generated ids back into text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Byte-level pre-tokenizers stand for each byte with a printable character: bytes that are
    # printable themselves keep theirs, the rest take code points from 256 up, in byte order.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = (b for b in range(256) if b not in printable)
    char = {b: chr(b) for b in printable} | {b: chr(256 + k) for k, b in enumerate(others)}
    tokenizer = Tokenizer(models.BPE(vocab={char[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def pretrained_model(path: Path):
    """``from_pretrained``: for LoRA and ``--untie-embeddings``, which change the model before it is
    wrapped (the other runs load it slice by slice with ``load_causal_lm``)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    return model, pretrained_tokenizer(path)


def pretrained_tokenizer(path: Path):
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise SystemExit(f"--model {path}: no tokenizer found there ({error}); save one with the weights") from error


def token_stream(text: str, tokenizer) -> torch.Tensor:
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        from tqdm import tqdm

        from offload.integrations.transformers import CausalLMSequential, causal_lm_sequential, load_causal_lm
    except ImportError as error:
        raise SystemExit(f'{error}. Install the extra: pip install -e ".[transformers]"') from error
    if args.no_progress:
        import transformers

        transformers.utils.logging.disable_progress_bar()  # the bar of loading checkpoint shards

    torch.manual_seed(args.seed)
    tier = None if args.disk_tier is None else DiskTier(args.disk_tier)
    options = {"num_slices": args.num_slices, "num_microbatches": args.microbatches,
               "compute_dtype": DTYPES[args.compute_dtype], "masters": tier if args.masters_on_disk else None}
    peft_model = None
    if args.model is not None and args.lora_r == 0 and not args.untie_embeddings:
        # Slice by slice into the host copies (or the masters' files): the model is never whole
        # in RAM beside them, as from_pretrained would have it.
        model, hf = load_causal_lm(args.model, args.device, loss_chunk_tokens=args.loss_chunk_tokens or None,
                                   **options)
        tokenizer = pretrained_tokenizer(args.model)
        print(f"loaded {args.model} slice by slice")
    else:
        if args.model is None:
            hf, tokenizer = random_model(args.arch, args.size, 256, args.seq_len)
        else:
            hf, tokenizer = pretrained_model(args.model)
        peft_model = with_lora(hf, args)
        layers = causal_lm_sequential(hf if peft_model is None else peft_model,
                                      untie_embeddings=args.untie_embeddings,
                                      loss_chunk_tokens=args.loss_chunk_tokens or None)
        model = OffloadModel(layers, device=args.device, **options)
    hf.config.use_cache = False  # training: no key/value cache
    tokens = token_stream(args.text.read_text(encoding="utf-8"), tokenizer)
    if tokens.numel() <= args.seq_len:
        raise SystemExit(f"--text has {tokens.numel()} tokens; --seq-len {args.seq_len} needs more")
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=args.lr, weight_decay=0.0, fused=True, disk_tier=tier)
    params = sum(p.numel() for p in model.parameters())
    print(f"{type(hf).__name__}: {params / 1e6:.1f} M parameters in {model.num_slices} slices on {args.device}, "
          f"compute dtype {args.compute_dtype}; {tokens.numel()} tokens of text")

    vocab = hf.config.vocab_size
    generator = torch.Generator().manual_seed(args.seed)
    done = resume(args, model, optimizer, generator)
    bar = tqdm(range(done + 1, args.steps + 1), desc="fine-tuning", unit="step", disable=args.no_progress,
               file=sys.stdout, initial=done, total=args.steps)
    start = time.perf_counter()
    seen = 0
    loss_value = math.nan
    for step in bar:
        starts = torch.randint(0, tokens.numel() - args.seq_len, (args.batch_size,), generator=generator)
        ids = torch.stack([tokens[s:s + args.seq_len] for s in starts.tolist()]).to(args.device)
        if args.loss_chunk_tokens:
            loss = model({"input_ids": ids, "labels": ids}).sum() / CausalLMSequential.count_loss_tokens(ids)
        else:
            loss = hf.loss_function(logits=model({"input_ids": ids}), labels=ids, vocab_size=vocab)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        seen += ids.numel()
        rate = seen / (time.perf_counter() - start)
        if args.no_progress:
            print(f"step {step}/{args.steps}  loss {loss_value:.4f}  {rate:,.0f} tokens/s")
        else:
            bar.set_postfix(loss=f"{loss_value:.4f}", tokens_per_s=f"{rate:,.0f}")
        save_every(args, step, model, optimizer, generator)
    bar.close()

    optimizer.synchronize()  # the last update runs beside the loop: let it finish before saving
    args.out.mkdir(parents=True, exist_ok=True)
    (hf if peft_model is None else peft_model).save_pretrained(args.out)  # with LoRA, the adapter only
    tokenizer.save_pretrained(args.out)
    optimizer.close()  # a disk tier's files go
    elapsed = time.perf_counter() - start
    # The loss in full (repr): a resumed run's last line equals the uninterrupted run's.
    print(f"final loss {loss_value!r}; {seen / elapsed:,.0f} tokens/s over {args.steps - done} steps; "
          f"saved to {args.out}")


if __name__ == "__main__":
    main()
