"""Tokens per second, peak host memory and losses of one fine-tune through five tools, each with the
plain model and offloaded: ``offload-finetune`` (offloaded only), ``transformers.Trainer``, TRL's
``SFTTrainer``, an Accelerate loop and a Lightning module.

Every run trains the same thing: a randomly initialised Llama built from one config with one seed,
on the same token rows in the same order (random ids ending with the end-of-sequence token, so
every token counts, every row is a whole document for the command's packing, and the SFT runs'
packing keeps the rows as they are), with the same batch size, gradient accumulation, steps,
AdamW (fused, no weight decay), linear schedule with one warm-up step and clipping at norm 1.
Nothing is downloaded.

- ``command-offload``: ``python -m offload.cli.finetune`` on the model saved to a temporary
  folder and the rows written as JSON lines beside it (``--shuffle-buffer 1``: in file order,
  ``--loss-chunk-tokens 0`` and ``--compute-dtype none``: the loss from float32 logits, as the
  trainers compute it). It has no plain mode: its losses are compared with ``trainer-plain``'s.
- ``trainer-*`` and ``sft-*``: ``OffloadedCausalLM`` with ``offload_optimizer`` (docs/trainer.md),
  the rows drawn in order (``train_sampling_strategy="sequential"``).
- ``accelerate-*``: a loop over ``accelerator.prepare``'s loader (docs/accelerate.md), the model
  cut with ``causal_lm_sequential`` and wrapped in ``OffloadModel``, with ``OffloadOptimizer``.
- ``lightning-*``: a ``LightningModule`` holding the model (docs/lightning.md).

Each run is a process of its own: its peak resident set size (``ru_maxrss``) is the run's; for the
command it is the command's process (``os.wait4``), not the one that built its model folder.
Tokens per second count the steps after the first (which builds the optimizer and warms the
kernels up). Losses are the mean loss of each optimizer step; whether they equal the plain run's
is reported, not asserted. The load average is recorded: on a shared machine the speeds move
with it.

Usage::

    python benchmarks/bench_trainer.py --json benchmarks/results/tools_cpu.json
    python benchmarks/bench_trainer.py --runs command-offload trainer-plain --steps 3
    python benchmarks/bench_trainer.py --hidden 512 --layers 8 --steps 6 --device cuda --only trainer-offload
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from json_output import check_json_path  # benchmarks/json_output.py, next to this file

RUNS = ("command-offload", "trainer-plain", "trainer-offload", "sft-plain", "sft-offload", "accelerate-plain",
        "accelerate-offload", "lightning-plain", "lightning-offload")
#: The run whose losses each run's are compared with (the command has no plain mode).
PLAIN = {run: run.replace("-offload", "-plain") for run in RUNS} | {"command-offload": "trainer-plain"}
LEARNING_RATE = 1e-4
MAX_GRAD_NORM = 1.0
WARMUP_STEPS = 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--num-slices", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS),
                        help="the runs to make, each in a process of its own (default: all)")
    parser.add_argument("--only", choices=RUNS, help="make this one run in this process and print its result")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    check_json_path(parser, args.json)
    return args


# -- what every run shares -------------------------------------------------------------------------


def build_model(args: argparse.Namespace):
    """The randomly initialised Llama every run starts from (seed 0), without a key/value cache."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 4,
                                      num_hidden_layers=args.layers, num_attention_heads=max(args.hidden // 64, 1),
                                      vocab_size=args.vocab, max_position_embeddings=args.seq_len,
                                      pad_token_id=0, eos_token_id=1, use_cache=False)
    return transformers.AutoModelForCausalLM.from_config(config)


def token_rows(args: argparse.Namespace) -> list[list[int]]:
    """Every step's rows, in training order: random ids from 2 up, then the end-of-sequence id 1."""
    import torch

    rows = args.batch_size * args.grad_accum * args.steps
    ids = torch.randint(2, args.vocab, (rows, args.seq_len), generator=torch.Generator().manual_seed(1))
    ids[:, -1] = 1
    return ids.tolist()


def word_tokenizer(vocab: int):
    """A tokenizer whose word ``t<k>`` is id ``k`` from 2 up (pad ``<pad>`` 0, eos ``</s>`` 1): the command
    reads the rows back from text as the ids they were. The special tokens are no word's prefix: a
    tokenizer finds them inside words before it splits the text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "</s>": 1} | {f"t{k}": k for k in range(2, vocab)}
    inner = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="<pad>", eos_token="</s>")


def step_means(losses: list[float], grad_accum: int) -> list[float]:
    """The mean of each optimizer step's microbatch losses."""
    return [sum(losses[k:k + grad_accum]) / grad_accum for k in range(0, len(losses), grad_accum)]


def result(args: argparse.Namespace, times: list[float], losses: list[float], peak_rss_kib: float, **extra) -> dict:
    tokens = args.batch_size * args.grad_accum * args.seq_len * (len(times) - 1)
    return {"run": args.only, "tokens_per_s": tokens / (times[-1] - times[0]), "steps_timed": len(times) - 1,
            "peak_rss_mib": peak_rss_kib / 1024, "losses": losses, **extra}


def own_peak_rss_kib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# -- the runs ----------------------------------------------------------------------------------------


def hf_trainer_run(args: argparse.Namespace, kind: str, mode: str) -> dict:
    """``transformers.Trainer`` or TRL's ``SFTTrainer`` (docs/trainer.md)."""
    import datasets
    import torch
    import transformers

    hf = build_model(args)
    ids = token_rows(args)
    # The trainers write nothing there (save_strategy="no") but make the directory: a temporary one, removed.
    output_dir = tempfile.mkdtemp(prefix="bench_trainer_")
    common = dict(output_dir=output_dir, per_device_train_batch_size=args.batch_size,
                  gradient_accumulation_steps=args.grad_accum, max_steps=args.steps, learning_rate=LEARNING_RATE,
                  warmup_steps=WARMUP_STEPS, max_grad_norm=MAX_GRAD_NORM, logging_steps=1, save_strategy="no",
                  report_to=[], disable_tqdm=True, seed=0, use_cpu=args.device == "cpu",
                  train_sampling_strategy="sequential")
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

        data = datasets.Dataset.from_dict({"input_ids": ids})  # pre-tokenized: SFTTrainer packs them as they are
        training = trl.SFTConfig(**common, max_length=args.seq_len, packing=True, bf16=False)
        build = trl.SFTTrainer
        extra = {"processing_class": word_tokenizer(args.vocab)}
    optimizers = (model.offload_optimizer(training), None) if mode == "offload" else (None, None)
    trainer = build(model=model, args=training, train_dataset=data, optimizers=optimizers, callbacks=[Clock()],
                    **extra)
    try:
        trainer.train()
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return result(args, times, losses, own_peak_rss_kib())


def accelerate_run(args: argparse.Namespace, mode: str) -> dict:
    """A plain loop over what ``accelerator.prepare`` returns (docs/accelerate.md)."""
    import torch
    import transformers
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, cpu=args.device == "cpu")
    hf = build_model(args)
    loss_function, vocab = hf.loss_function, hf.config.vocab_size
    if mode == "offload":
        from offload import OffloadModel, OffloadOptimizer
        from offload.integrations.transformers import causal_lm_sequential

        offloaded = OffloadModel(causal_lm_sequential(hf), device=accelerator.device, num_slices=args.num_slices)
        model = offloaded
        optimizer = OffloadOptimizer(offloaded, torch.optim.AdamW, lr=LEARNING_RATE, weight_decay=0.0, fused=True)

        def logits_of(ids):
            return offloaded({"input_ids": ids})
    else:
        model = hf.to(accelerator.device)
        optimizer = torch.optim.AdamW(hf.parameters(), lr=LEARNING_RATE, weight_decay=0.0, fused=True)

        def logits_of(ids):
            return hf(input_ids=ids).logits
    schedule = transformers.get_scheduler("linear", optimizer, num_warmup_steps=WARMUP_STEPS,
                                          num_training_steps=args.steps)
    loader = DataLoader(TensorDataset(torch.tensor(token_rows(args))), batch_size=args.batch_size, shuffle=False)
    # The model and the optimizer stay where they are (an offloaded model's parameters on the host).
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader, device_placement=[False, False, True])
    model.train()
    times: list[float] = []
    losses: list[float] = []
    for (ids,) in loader:
        with accelerator.accumulate(model):
            loss = loss_function(logits=logits_of(ids), labels=ids, vocab_size=vocab)
            accelerator.backward(loss)  # divided by the accumulation steps
            losses.append(loss.item())
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
            optimizer.step()
            if accelerator.sync_gradients:
                schedule.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            if args.device != "cpu":
                torch.cuda.synchronize()
            times.append(time.perf_counter())
    if mode == "offload":
        optimizer.optimizer.synchronize()  # the last update runs beside the loop
    return result(args, times, step_means(losses, args.grad_accum), own_peak_rss_kib())


def lightning_run(args: argparse.Namespace, mode: str) -> dict:
    """A ``LightningModule`` holding the model (docs/lightning.md)."""
    import lightning as L
    import torch
    import transformers
    from torch.utils.data import DataLoader, TensorDataset

    hf = build_model(args)
    losses: list[float] = []
    times: list[float] = []

    class FineTune(L.LightningModule):
        def __init__(self):
            super().__init__()
            # A plain function and an int: an offloaded module keeps ``hf`` out of its attributes,
            # which would register its parameters a second time.
            self.loss_function, self.vocab = hf.loss_function, hf.config.vocab_size
            if mode == "offload":
                from offload import OffloadModel
                from offload.integrations.transformers import causal_lm_sequential

                self.net = OffloadModel(causal_lm_sequential(hf), device=args.device, num_slices=args.num_slices)
            else:
                self.net = hf

        def training_step(self, batch, index):
            (ids,) = batch
            logits = self.net({"input_ids": ids}) if mode == "offload" else self.net(input_ids=ids).logits
            loss = self.loss_function(logits=logits, labels=ids, vocab_size=self.vocab)
            losses.append(loss.item())
            return loss  # Lightning divides it by accumulate_grad_batches before backward

        def configure_optimizers(self):
            if mode == "offload":
                from offload import OffloadOptimizer

                optimizer = OffloadOptimizer(self.net, torch.optim.AdamW, lr=LEARNING_RATE, weight_decay=0.0,
                                             fused=True)
            else:
                optimizer = torch.optim.AdamW(self.net.parameters(), lr=LEARNING_RATE, weight_decay=0.0, fused=True)
            schedule = transformers.get_scheduler("linear", optimizer, num_warmup_steps=WARMUP_STEPS,
                                                  num_training_steps=args.steps)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer, *unused):
            if trainer.global_step > len(times):  # an optimizer step ended with this batch
                if args.device != "cpu":
                    torch.cuda.synchronize()
                times.append(time.perf_counter())

    loader = DataLoader(TensorDataset(torch.tensor(token_rows(args))), batch_size=args.batch_size, shuffle=False)
    trainer = L.Trainer(accelerator="cpu" if args.device == "cpu" else "gpu", devices=1, max_steps=args.steps,
                        accumulate_grad_batches=args.grad_accum, gradient_clip_val=MAX_GRAD_NORM, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Clock()])
    trainer.fit(FineTune(), loader)
    return result(args, times, step_means(losses, args.grad_accum), own_peak_rss_kib())


def command_run(args: argparse.Namespace) -> dict:
    """``python -m offload.cli.finetune`` on the model and rows written to a temporary folder; its
    steps timed from its output lines, its peak memory its own process's (``os.wait4``)."""
    with tempfile.TemporaryDirectory(prefix="bench_command_") as folder:
        folder = Path(folder)
        hf = build_model(args)
        hf.save_pretrained(folder / "model")
        word_tokenizer(args.vocab).save_pretrained(folder / "model")
        del hf
        with open(folder / "rows.jsonl", "w") as rows:
            for row in token_rows(args):
                # The command appends the end-of-sequence token after each document.
                rows.write(json.dumps({"text": " ".join(f"t{k}" for k in row[:-1])}) + "\n")
        command = [sys.executable, "-m", "offload.cli.finetune", "--model", str(folder / "model"),
                   "--data", str(folder / "rows.jsonl"), "--out", str(folder / "out"), "--device", args.device,
                   "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
                   "--grad-accum", str(args.grad_accum), "--num-slices", str(args.num_slices),
                   "--compute-dtype", "none", "--loss-chunk-tokens", "0", "--lr", str(LEARNING_RATE),
                   "--lr-schedule", "linear", "--warmup-steps", str(WARMUP_STEPS),
                   "--max-grad-norm", str(MAX_GRAD_NORM), "--shuffle-buffer", "1", "--seed", "0", "--no-progress"]
        # Its warnings to a file: a full stderr pipe would stop it while its stdout is read here.
        with open(folder / "stderr.txt", "w+") as errors:
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True)
            times: list[float] = []
            losses: list[float] = []
            lines = []
            for line in process.stdout:
                lines.append(line)
                if line.startswith("step "):  # "step 3/5  loss 9.0612  1,234 tokens/s", printed after the step
                    times.append(time.perf_counter())
                    losses.append(float(line.split()[3]))
            _, status, usage = os.wait4(process.pid, 0)
            if status != 0:
                errors.seek(0)
                raise SystemExit(f"{' '.join(command)} failed:\n{''.join(lines)[-2000:]}{errors.read()[-3000:]}")
    final = next(line for line in lines if line.startswith("final loss "))
    # The command prints each step's loss to 4 decimals and the last one in full.
    return result(args, times, losses, usage.ru_maxrss, final_loss=float(final.split()[2].rstrip(";")),
                  losses_decimals=4)


def one_run(args: argparse.Namespace) -> dict:
    tool, mode = args.only.split("-")
    load = os.getloadavg()[0]
    if tool == "command":
        done = command_run(args)
    elif tool in ("trainer", "sft"):
        done = hf_trainer_run(args, tool, mode)
    elif tool == "accelerate":
        done = accelerate_run(args, mode)
    else:
        done = lightning_run(args, mode)
    return {**done, "load_average_1min_at_start": load}


# -- the whole comparison ----------------------------------------------------------------------------


def compare_losses(run: dict, plain: dict | None) -> bool | None:
    """Whether ``run``'s losses equal its plain run's (to the decimals the command prints, and its
    last loss in full); ``None`` without a plain run to compare with."""
    if plain is None or run is plain:
        return None
    if "final_loss" in run:
        rounded = [round(loss, run["losses_decimals"]) for loss in plain["losses"]]
        return run["losses"] == rounded and run["final_loss"] == plain["losses"][-1]
    return run["losses"] == plain["losses"]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.only:
        print(json.dumps(one_run(args)))
        return
    settings = [c for k, c in enumerate(argv) if not (c in ("--json", "--runs") or (k and argv[k - 1] == "--json"))]
    settings = [c for c in settings if c not in RUNS]
    load_before = os.getloadavg()
    results = {}
    for run in args.runs:
        command = [sys.executable, __file__, *settings, "--only", run]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(f"{run} failed:\n{done.stderr[-3000:]}")
        results[run] = json.loads(done.stdout.strip().splitlines()[-1])
    for run, result in results.items():
        result["plain_run"] = PLAIN[run] if PLAIN[run] != run else None
        result["losses_equal_plain"] = compare_losses(result, results.get(PLAIN[run]))
        equal = {None: "", True: f"losses = {PLAIN[run]}'s", False: f"losses differ from {PLAIN[run]}'s"}
        print(f"{run:19s} {result['tokens_per_s']:8.0f} tokens/s  peak RSS {result['peak_rss_mib']:6.0f} MiB  "
              f"{equal[result['losses_equal_plain']]}")
    report = {"command": "python benchmarks/bench_trainer.py " + " ".join(argv),
              "settings": {k: v for k, v in vars(args).items() if k not in ("json", "only")},
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "load_average_before": load_before, "load_average_after": os.getloadavg()},
              "results": list(results.values())}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
