"""Tokens per second and peak host memory of one fine-tune through ``transformers.Trainer`` and TRL's
``SFTTrainer``, with the plain model and with ``OffloadedCausalLM`` (and ``offload_optimizer``).

Each run is a process of its own (its peak resident set size is the run's, ``ru_maxrss``): a
randomly initialised Llama built from a config, trained on random token rows of one length (so
every token counts; the SFT runs pack plain text rows of the same tokens). Tokens per second count
the steps after the first (which builds the optimizer and warms the kernels up), from the
trainer's step callbacks. Nothing is downloaded.

Usage::

    python scripts/bench_trainer.py --json benchmarks/results/trainer_cpu.json
    python scripts/bench_trainer.py --hidden 512 --layers 8 --steps 6 --device cuda --only trainer-offload
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

RUNS = ("trainer-plain", "trainer-offload", "sft-plain", "sft-offload")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--num-slices", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--only", choices=RUNS, help="run this one configuration in this process")
    parser.add_argument("--json", type=Path, help="write the results here")
    return parser.parse_args(argv)


def one_run(args: argparse.Namespace) -> dict:
    import datasets
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    kind, mode = args.only.split("-")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 4,
                                      num_hidden_layers=args.layers, num_attention_heads=max(args.hidden // 64, 1),
                                      vocab_size=args.vocab, max_position_embeddings=args.seq_len,
                                      pad_token_id=0, eos_token_id=1)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    rows = args.batch_size * args.grad_accum * args.steps
    ids = torch.randint(2, args.vocab, (rows, args.seq_len), generator=torch.Generator().manual_seed(1)).tolist()
    common = dict(output_dir=f"/tmp/bench_trainer_{os.getpid()}", per_device_train_batch_size=args.batch_size,
                  gradient_accumulation_steps=args.grad_accum, max_steps=args.steps, learning_rate=1e-4,
                  warmup_steps=1, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[],
                  disable_tqdm=True, seed=0, use_cpu=args.device == "cpu")
    model = hf
    if mode == "offload":
        from offload.integrations.causal_lm import OffloadedCausalLM

        model = OffloadedCausalLM(hf, device=args.device, num_slices=args.num_slices)
    times: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, *unused, **kwargs):
            if args.device != "cpu":
                torch.cuda.synchronize()
            times.append(time.perf_counter())

    if kind == "trainer":
        data = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})
        training = transformers.TrainingArguments(**common)
        build = transformers.Trainer
        extra = {}
    else:
        import trl

        tokenizer = byte_level_tokenizer(args.vocab)
        data = datasets.Dataset.from_dict({"input_ids": ids})  # pre-tokenized: SFTTrainer packs them as they are
        training = trl.SFTConfig(**common, max_length=args.seq_len, packing=True, bf16=False)
        build = trl.SFTTrainer
        extra = {"processing_class": tokenizer}
    optimizers = (model.offload_optimizer(training), None) if mode == "offload" else (None, None)
    trainer = build(model=model, args=training, train_dataset=data, optimizers=optimizers, callbacks=[Clock()],
                    **extra)
    trainer.train()
    tokens = args.batch_size * args.grad_accum * args.seq_len * (len(times) - 1)
    return {"run": args.only, "tokens_per_s": tokens / (times[-1] - times[0]),
            "steps_timed": len(times) - 1, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]}


def byte_level_tokenizer(vocab: int):
    """A tokenizer that only has to exist (the rows are token ids already) and to know pad and eos."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.WordLevel(vocab={f"t{k}": k for k in range(vocab)}, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="t0", eos_token="t1")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.only:
        print(json.dumps(one_run(args)))
        return
    results = []
    for run in RUNS:
        command = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--only", run]
        command = [c for k, c in enumerate(command) if not (c == "--json" or (k and command[k - 1] == "--json"))]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(f"{run} failed:\n{done.stderr[-3000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        results.append(result)
        print(f"{run:16s} {result['tokens_per_s']:10.0f} tokens/s  peak RSS {result['peak_rss_mib']:8.0f} MiB")
    report = {"command": "python scripts/bench_trainer.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "settings": {k: v for k, v in vars(args).items() if k not in ("json", "only")},
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}, "results": results}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
