"""Fine-tune a Hugging Face causal LM with OffloadModel and OffloadOptimizer, end to end.

By default the model is a small randomly initialised Llama built from a config, and the text is
read byte by byte (ids 0-255), so nothing is downloaded. With ``--model PATH`` it loads weights and
tokenizer from a local directory (``save_pretrained`` output). Either way it trains on the text of
``--text`` (a short text shipped with the repository by default), shows loss and tokens/s in a
progress bar, and writes the trained model with ``save_pretrained`` into ``--out``. The loss is
computed in the head, ``--loss-chunk-tokens`` tokens at a time, so the batch's logits never sit on
the device whole; ``--loss-chunk-tokens 0`` returns the logits and computes the loss from them.
With ``--lora-r R`` it trains LoRA adapters (``peft``) on the frozen model instead of every weight,
and ``--out`` receives the adapter (``PeftModel.save_pretrained``; load it back with
``peft.PeftModel.from_pretrained(base_model, out)``).

Usage::

    python scripts/finetune_causal_lm.py --out /tmp/tuned                     # tiny random Llama, CPU or GPU
    python scripts/finetune_causal_lm.py --model ./my-llama --text book.txt --out ./tuned --steps 500 \\
        --batch-size 8 --seq-len 1024 --num-slices 16 --compute-dtype bf16
    python scripts/finetune_causal_lm.py --model ./my-llama --out ./adapter --lora-r 16 --lora-targets q_proj v_proj
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from offload import OffloadModel, OffloadOptimizer

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "sample.txt"
#: Random-initialised configs by size: (hidden, layers, heads, key/value heads, intermediate).
SIZES = {"tiny": (64, 4, 4, 2, 128), "small": (512, 8, 8, 4, 1408), "1b": (2048, 16, 32, 8, 5632)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}
try:
    from offload.integrations.transformers import SUPPORTED_MODEL_TYPES as ARCHITECTURES
except ImportError:  # without the extra, --help still answers; training says what to install
    ARCHITECTURES = ("llama",)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="local directory with weights (and tokenizer) to fine-tune")
    parser.add_argument("--arch", default="llama", choices=ARCHITECTURES,
                        help="architecture of the random-initialised model when no --model is given")
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES), help="size of the random-initialised model")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="plain-text file to train on")
    parser.add_argument("--out", type=Path, required=True, help="directory for save_pretrained")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--num-slices", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--compute-dtype", default="bf16", choices=sorted(DTYPES))
    # 1024 tokens: one chunk's logits are 1024 x vocab (0.5 GB in float32 for a 128k vocabulary), and each
    # projection is still a product of 1024 rows by the whole vocabulary.
    parser.add_argument("--loss-chunk-tokens", type=int, default=1024,
                        help="compute the loss in the head over chunks of this many tokens (0: return logits)")
    parser.add_argument("--untie-embeddings", action="store_true",
                        help="give a tied lm_head a weight of its own (by default tied embeddings stay tied)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="print one line per step instead of a bar")
    add_lora_arguments(parser)
    args = parser.parse_args(argv)
    check_lora_arguments(parser, args)
    for name in ("steps", "batch_size", "seq_len", "num_slices", "microbatches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.loss_chunk_tokens < 0:
        parser.error("--loss-chunk-tokens must be 0 (off) or a number of tokens")
    if not args.text.is_file():
        parser.error(f"--text {args.text}: no such file")
    if args.model is not None and not args.model.is_dir():
        parser.error(f"--model {args.model}: not a directory (a save_pretrained output is expected)")
    return args


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
    return transformers.AutoModelForCausalLM.from_config(config), None


def pretrained_model(path: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise SystemExit(f"--model {path}: no tokenizer found there ({error}); save one with the weights") from error
    return model, tokenizer


def token_stream(text: str, tokenizer) -> torch.Tensor:
    if tokenizer is None:
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)  # bytes as ids
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        from tqdm import tqdm

        from offload.integrations.transformers import causal_lm_sequential
    except ImportError as error:
        raise SystemExit(f'{error}. Install the extra: pip install "offload[transformers]"') from error

    torch.manual_seed(args.seed)
    if args.model is None:
        hf, tokenizer = random_model(args.arch, args.size, 256, args.seq_len)
    else:
        hf, tokenizer = pretrained_model(args.model)
    hf.config.use_cache = False  # training: no key/value cache
    tokens = token_stream(args.text.read_text(encoding="utf-8"), tokenizer)
    if tokens.numel() <= args.seq_len:
        raise SystemExit(f"--text has {tokens.numel()} tokens; --seq-len {args.seq_len} needs more")
    peft_model = with_lora(hf, args)
    layers = causal_lm_sequential(hf if peft_model is None else peft_model, untie_embeddings=args.untie_embeddings,
                                  loss_chunk_tokens=args.loss_chunk_tokens or None)

    model = OffloadModel(layers, device=args.device, num_slices=args.num_slices,
                         num_microbatches=args.microbatches, compute_dtype=DTYPES[args.compute_dtype])
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=args.lr, weight_decay=0.0, fused=True)
    params = sum(p.numel() for p in model.parameters())
    print(f"{type(hf).__name__}: {params / 1e6:.1f} M parameters in {model.num_slices} slices on {args.device}, "
          f"compute dtype {args.compute_dtype}; {tokens.numel()} tokens of text")

    vocab = hf.config.vocab_size
    generator = torch.Generator().manual_seed(args.seed)
    bar = tqdm(range(1, args.steps + 1), desc="fine-tuning", unit="step", disable=args.no_progress, file=sys.stdout)
    start = time.perf_counter()
    seen = 0
    loss_value = math.nan
    for step in bar:
        starts = torch.randint(0, tokens.numel() - args.seq_len, (args.batch_size,), generator=generator)
        ids = torch.stack([tokens[s:s + args.seq_len] for s in starts.tolist()]).to(args.device)
        if layers.loss_chunk_tokens is not None:
            loss = model({"input_ids": ids, "labels": ids}).sum() / layers.count_loss_tokens(ids)
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
    bar.close()

    optimizer.synchronize()  # the last update runs beside the loop: let it finish before saving
    args.out.mkdir(parents=True, exist_ok=True)
    (hf if peft_model is None else peft_model).save_pretrained(args.out)  # with LoRA, the adapter only
    if tokenizer is not None:
        tokenizer.save_pretrained(args.out)
    elapsed = time.perf_counter() - start
    print(f"final loss {loss_value:.4f}; {seen / elapsed:,.0f} tokens/s over {args.steps} steps; "
          f"saved to {args.out}")


if __name__ == "__main__":
    main()
