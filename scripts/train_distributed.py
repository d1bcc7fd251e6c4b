"""Data-parallel training of a preset model with OffloadModel, one process per GPU (or per CPU
process with gloo), launched with ``torchrun``.

Every rank builds the same model and wraps it with ``process_group``; a ``DistributedSampler``
gives each rank its share of a synthetic dataset; gradients are averaged across ranks during
backward, and ``OffloadOptimizer`` updates each rank's share of the parameters. Rank 0 prints
its loss at every step; at the end each rank prints its samples/s, and rank 0 the total and the
first and last loss (the last in full, so runs compare exactly). ``--save-every N`` saves a
checkpoint every N steps under ``--out``/checkpoints/step-N (each rank writes its share of the
optimizer state); ``--resume latest`` continues from the newest, on any number of ranks.

Usage::

    torchrun --nproc_per_node=2 scripts/train_distributed.py --preset mlp --steps 20
    torchrun --nproc_per_node=8 scripts/train_distributed.py --preset transformer --batch-size 8 \\
        --set n_layers=24 --set d_model=2048 --compute-dtype bf16
    torchrun --nproc_per_node=2 scripts/train_distributed.py --steps 40 --out /tmp/run --save-every 10 \\
        --resume latest
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from offload import (CheckpointError, OffloadModel, OffloadOptimizer, latest_checkpoint, load_checkpoint,
                     save_checkpoint)
from offload.checkpoint.commit import INFO_FILE, committed
from offload.planning.presets import build_preset, preset_names


# The presets' labels are random: on a stream of fresh batches there is nothing to learn and the
# loss stays at ln(classes). Each rank cycles over this many batches instead, so the loss falls
# as the model fits them and shows that training works.
DISTINCT_BATCHES = 2


def setting(text: str) -> tuple[str, int]:
    name, _, value = text.partition("=")
    if not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, int(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", choices=preset_names(), default="mlp", help="the model to train")
    parser.add_argument("--set", type=setting, action="append", default=[], metavar="NAME=VALUE",
                        help="override a preset setting (repeatable)")
    parser.add_argument("--batch-size", type=int, help="rows per rank and step; None: the preset's")
    parser.add_argument("--steps", type=int, default=20, help="training steps (a resumed run's total, not more)")
    parser.add_argument("--slices", type=int, default=4, help="num_slices of OffloadModel")
    parser.add_argument("--microbatches", type=int, default=1, help="num_microbatches of OffloadModel")
    parser.add_argument("--compute-dtype", choices=["none", "bf16", "fp16"], default="none",
                        help="compute_dtype of OffloadModel")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    add_checkpoint_args(parser)
    args = parser.parse_args()
    # Every refusal here, before the process group: one line from the parser, not a traceback per rank.
    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size), ("--slices", args.slices),
                        ("--microbatches", args.microbatches)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if not args.lr >= 0:
        parser.error(f"--lr must be 0 or more, got {args.lr}")
    check_checkpoint_args(parser, args)
    try:
        preset = build_preset(args.preset, **dict(args.set))
    except ValueError as error:  # an unknown setting, or one out of range
        parser.error(f"--set: {error}")
    if "RANK" not in os.environ:  # the command as given, under torchrun: copied, it trains what was asked
        parser.error("start it with torchrun, one process per GPU (or CPU process): "
                     f"torchrun --nproc_per_node=2 {shlex.join(sys.argv)}")

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    batch_size = args.batch_size or preset.batch_size
    inputs, targets = preset.make_batch(batch_size * world_size * DISTINCT_BATCHES, "cpu")
    sampler = DistributedSampler(TensorDataset(inputs, targets), num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=0, drop_last=True)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=batch_size, sampler=sampler, pin_memory=cuda)
    dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.compute_dtype]
    model = OffloadModel(preset.model, device=device, num_slices=args.slices, num_microbatches=args.microbatches,
                         compute_dtype=dtype, process_group=dist.group.WORLD)
    # The host update shares parameters through host memory: a gloo group when the model's is NCCL.
    host_group = dist.new_group(backend="gloo") if cuda and world_size > 1 else None
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=args.lr, fused=True, process_group=host_group)
    if rank == 0:
        print(f"{preset.description}; {preset.parameter_bytes / 2**20:.1f} MiB of parameters; {world_size} rank(s) "
              f"on {device.type}, {batch_size} rows per rank and step, {DISTINCT_BATCHES} batches per rank "
              f"repeated", flush=True)

    done = resume(args, model, optimizer)
    start = time.perf_counter()
    steps = done
    losses: list[float] = []
    for x, y in batches_from(loader, sampler, done):
        if steps == done + 1:
            start = time.perf_counter()  # the first step allocates and warms up
        loss = preset.loss(model(x.to(device, non_blocking=True)), y.to(device, non_blocking=True))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
        if rank == 0:
            losses.append(loss.item())
            print(f"step {steps}/{args.steps}: loss {losses[-1]:.4f} (rank 0's batch)", flush=True)
        save_every(args, steps, model, optimizer)
        if steps >= args.steps:
            break
    optimizer.synchronize()
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    timed = max(steps - done - 1, 1)
    rate = timed * batch_size / seconds
    print(f"rank {rank}: {rate:.1f} samples/s over {timed} steps", flush=True)
    # Gathered as objects: a NCCL group gathers only CUDA tensors, and this is one float per rank.
    rates: list[float | None] = [None] * world_size
    dist.all_gather_object(rates, rate)
    if rank == 0:
        total = sum(r for r in rates if r is not None)
        # The last loss in full (repr): a resumed run's last line equals the uninterrupted run's.
        trained = f"; loss {losses[0]:.4f} at the first step, last loss {losses[-1]!r}" if losses else ""
        print(f"total: {total:.1f} samples/s on {world_size} rank(s){trained}", flush=True)
    # The model's and the optimizer's host workers end before the group they communicate over, and
    # every rank is past its last collective before any rank tears the group down.
    del model, optimizer
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


# -- checkpoints: --save-every and --resume ---------------------------------------------------------


def batches_from(loader: DataLoader, sampler: DistributedSampler, start: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """The batches of steps ``start``, ``start + 1``, ... as a run from step 0 draws them: each pass
    over the data starts at a step that is a multiple of its length and shuffles with that step as
    its epoch, so a resumed run passes over what the stopped run trained on and continues with the
    batch it would have taken next."""
    per_pass = len(loader)
    step = start - start % per_pass
    while True:
        sampler.set_epoch(step)
        for k, batch in enumerate(loader):
            if step + k >= start:
                yield batch
        step += per_pass


def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, help="directory for checkpoints (OUT/checkpoints/step-N)")
    parser.add_argument("--save-every", type=int, default=0, metavar="N",
                        help="save a checkpoint every N steps (0: never); needs --out")
    parser.add_argument("--resume", metavar="PATH|latest",
                        help="continue from a checkpoint: its directory, or 'latest' for OUT/checkpoints' newest; "
                             "with the stopped run's settings; --steps is the total, past the checkpoint's step")


def check_checkpoint_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.save_every < 0:
        parser.error("--save-every must be 0 (never) or a number of steps")
    if args.out is None and (args.save_every or args.resume == "latest"):
        parser.error("--save-every and --resume latest need --out")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: not a directory")
    if args.resume == "latest":
        try:
            args.resume = latest_checkpoint(args.out / "checkpoints")
        except CheckpointError as error:  # a "latest" directory, say
            parser.error(f"--resume latest: {error}")
        if args.resume is None:
            parser.error(f"--resume latest: no checkpoint under {args.out / 'checkpoints'} yet")
    elif args.resume is not None:
        args.resume = Path(args.resume).expanduser()
        # A save replacing it, killed half way, leaves the checkpoint beside its name: the load reads it there.
        try:
            found = committed(args.resume)
        except CheckpointError as error:  # the directory checkpoints were saved into, not one of them
            parser.error(f"--resume {args.resume}: {error}")
        if not found.is_dir():
            parser.error(f"--resume {args.resume}: no such checkpoint directory")
        if not (found / INFO_FILE).is_file():
            parser.error(f"--resume {args.resume}: not a checkpoint (no {INFO_FILE} in it)")
    # Nothing left to train, from the name save_every() gives the checkpoint, before anything is
    # built; resume() checks the step saved in it, whatever its name.
    named = None if args.resume is None else re.fullmatch(r"step-(\d+)", args.resume.name)
    if named is not None and int(named[1]) >= args.steps:
        parser.error(no_steps_left(int(named[1]), args.steps))


def no_steps_left(step: int, steps: int) -> str:
    """The refusal of a resume that would train nothing (as ``offload-finetune`` words it)."""
    return (f"--resume: the checkpoint is at step {step} and --steps is {steps}, so nothing would train: pass "
            f"--steps N > {step}, or --out a new directory without --resume to start over")


def resume(args: argparse.Namespace, model: OffloadModel, optimizer: OffloadOptimizer) -> int:
    """Load ``--resume`` on every rank (each reads the optimizer state it updates); the steps done."""
    if args.resume is None:
        return 0
    extra = load_checkpoint(args.resume, model, optimizer)
    if extra["step"] >= args.steps:  # a checkpoint not named by save_every(): its step was not known before
        raise SystemExit(f"train_distributed.py: error: {no_steps_left(extra['step'], args.steps)}"
                         if dist.get_rank() == 0 else 2)
    if dist.get_rank() == 0:
        print(f"resumed from {args.resume} after step {extra['step']}", flush=True)
    return extra["step"]


def save_every(args: argparse.Namespace, step: int, model: OffloadModel, optimizer: OffloadOptimizer) -> None:
    if args.save_every and step % args.save_every == 0:
        save_checkpoint(args.out / "checkpoints" / f"step-{step}", model, optimizer, extra={"step": step})


if __name__ == "__main__":
    main()
