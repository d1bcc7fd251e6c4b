"""What the slice walk costs the thread that drives it, per slice, beside the layers' own work.

On a GPU the thread that launches a slice's kernels also runs the walk's Python between and
around them: binding the device copies, the boundary's offload, the recompute's bookkeeping, the
gradients' way out. Where a layer's kernels take about as long as their launch (a decoder layer
at 8 x 1024 tokens), every millisecond of that Python is a millisecond of device idle. This
script measures it with layers thin enough that the walk shows: on the CPU, or on a GPU, where
such layers are launch-bound and the walk's Python is what the device waits for.

A Hugging Face Llama with many thin layers runs one training step (forward and backward) three
ways, alternated in one process so that machine noise hits all alike:

- ``plain``: the model itself;
- ``checkpointed``: the model with Hugging Face gradient checkpointing (non-reentrant), the same
  recompute as the offloaded model without any walk;
- ``offload``: ``OffloadedCausalLM``, one slice per layer.

On a GPU the plain and checkpointed models are moved to the device whole; the offloaded one keeps
its parameters on the host.

Reported per variant: the median forward and backward time. Per slice: the offloaded forward's
time beyond the plain forward (and beyond the checkpointed one, which pays for its own
bookkeeping too), and the offloaded backward's beyond the checkpointed backward (which recomputes
the same layers), each divided by the number of slices. Also counted, once and
exactly: the Python function calls a step makes in the library (``offload/``), per slice, which
do not depend on the machine's speed.

Usage::

    python benchmarks/bench_walk.py [--device cpu] [--layers 32] [--hidden 64] [--seq-len 16] [--batch 2] \\
        [--rounds 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import platform
import pstats
import statistics
import sys
import time
from typing import Any

import torch

import offload
from offload.integrations.causal_lm import OffloadedCausalLM

from bench_boundaries import sync, thin_llama, thin_llama_options, token_ids  # next to this file
from json_output import check_json_path  # benchmarks/json_output.py, next to this file

VARIANTS = ("plain", "checkpointed", "offload")
LIBRARY = os.path.dirname(os.path.abspath(offload.__file__))


def build(args: argparse.Namespace, variant: str, device: str) -> torch.nn.Module:
    model = thin_llama(args)
    if variant == "offload":
        return OffloadedCausalLM(model, device=device, num_slices=args.layers + 2)
    if variant == "checkpointed":
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model.to(device)


def step(model: torch.nn.Module, ids: torch.Tensor, device: str) -> tuple[float, float, torch.Tensor]:
    """One forward and backward: their seconds and the loss."""
    sync(device)
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    sync(device)
    middle = time.perf_counter()
    loss.backward()
    sync(device)
    end = time.perf_counter()
    model.zero_grad(set_to_none=True)
    return middle - start, end - middle, loss.detach()


def library_calls(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, int]:
    """Python function calls into the library in one forward and in one backward."""
    counts = {}
    loss = None
    for phase in ("forward", "backward"):
        profile = cProfile.Profile()
        profile.enable()
        if phase == "forward":
            loss = model(input_ids=ids, labels=ids).loss
        else:
            loss.backward()
        profile.disable()
        stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
        counts[phase] = sum(entry[1] for (path, _, _), entry in stats.items() if path.startswith(LIBRARY))
    model.zero_grad(set_to_none=True)
    return counts


def main() -> None:
    parser = thin_llama_options(__doc__.split("\n\n")[0], layers=32, seq_len=16, rounds=15)
    args = parser.parse_args()
    check_json_path(parser, args.json)
    if args.rounds < 1:
        parser.error("--rounds: at least 1")

    models = {name: build(args, name, args.device) for name in VARIANTS}
    ids = token_ids(args).to(args.device)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    losses: dict[str, torch.Tensor] = {}
    for round_ in range(args.warmup + args.rounds):
        order = list(VARIANTS) if round_ % 2 == 0 else list(reversed(VARIANTS))  # none always first
        for name in order:
            forward, backward, loss = step(models[name], ids, args.device)
            losses.setdefault(name, loss)
            if round_ >= args.warmup:
                times[name].append((forward, backward))
    calls = library_calls(models["offload"], ids)

    medians = {name: {"forward_ms": statistics.median(t[0] for t in times[name]) * 1e3,
                      "backward_ms": statistics.median(t[1] for t in times[name]) * 1e3} for name in VARIANTS}
    slices = args.layers + 2
    offloaded, plain, checkpointed = medians["offload"], medians["plain"], medians["checkpointed"]
    per_slice = {
        "forward_ms": (offloaded["forward_ms"] - plain["forward_ms"]) / slices,
        "forward_beyond_checkpointed_ms": (offloaded["forward_ms"] - checkpointed["forward_ms"]) / slices,
        "backward_ms": (offloaded["backward_ms"] - checkpointed["backward_ms"]) / slices,
        "library_calls_forward": calls["forward"] / slices,
        "library_calls_backward": calls["backward"] / slices,
    }
    # On the CPU bit for bit; a GPU's kernels may differ between the device and host layouts.
    same_loss = torch.equal(losses["offload"].cpu(), losses["plain"].cpu())
    report = {"command": " ".join(["python", *sys.argv]), "date": datetime.date.today().isoformat(),
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "config": vars(args), "slices": slices,
              "same_loss": same_loss, "variants": medians, "per_slice": per_slice, "library_calls": calls}
    print(f"{args.layers} layers of {args.hidden} ({slices} slices), {args.batch} x {args.seq_len} tokens, "
          f"{report['device']}, medians of "
          f"{args.rounds} alternated steps; offloaded loss equal to the plain one: {same_loss}")
    print("| variant | forward ms | backward ms |")
    print("|---|---:|---:|")
    for name, r in medians.items():
        print(f"| {name} | {r['forward_ms']:.2f} | {r['backward_ms']:.2f} |")
    print(f"walk per slice: forward {per_slice['forward_ms']:.3f} ms beyond plain "
          f"({per_slice['forward_beyond_checkpointed_ms']:.3f} beyond checkpointed), backward "
          f"{per_slice['backward_ms']:.3f} ms beyond checkpointed; library calls per slice: forward "
          f"{per_slice['library_calls_forward']:.1f}, backward {per_slice['library_calls_backward']:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
