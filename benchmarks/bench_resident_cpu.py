"""Resident slices on a CPU "device": step time of ``offload-finetune``'s tiny Llama with every
slice streamed and with every slice resident, and what makes the resident run slow on a shared CPU.

Each variant trains the same model as ``offload-finetune --compute-dtype none`` (the tiny
random-initialised Llama, bytes as tokens, batch 4 x 64 tokens, 3 slices, fused AdamW) in a
process of its own, for ``--steps`` steps after ``--warmup``; the variants run interleaved,
``--rounds`` times, and each reports the median step (forward, backward, ``step()``) and its last
loss (the same in every variant: resident and streamed slices train bit for bit alike on the CPU).

- ``streamed``: ``resident_slices=0``: the host worker updates the slices beside the next forward.
- ``resident``: ``resident_slices=3``: ``step()`` updates them on the calling thread.
- ``*-passive``: the same under ``OMP_WAIT_POLICY=PASSIVE``: OpenMP's threads sleep at once when
  a parallel region ends instead of spinning for a while first.
- ``resident-second-team``: resident, with one more thread that ran a parallel kernel once and
  waits: the process then has a second OpenMP team, as the streamed run's host worker gives it.

What it shows (Note: [Resident slices on a CPU] in ``offload/streams/resident_storage.py``): the
resident run's slowness is OpenMP's spinning wait on cores other processes share, not its work.

Usage::

    python benchmarks/bench_resident_cpu.py --json benchmarks/results/resident_cpu_2026-11-28.json
    python benchmarks/bench_resident_cpu.py --rounds 1 --steps 5     # a quick look
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import threading
import time

import torch
from json_output import check_json_path  # benchmarks/json_output.py, next to this file

VARIANTS = {  # name: (resident slices, extra environment, a second OpenMP team)
    "streamed": (0, {}, False),
    "resident": (3, {}, False),
    "streamed-passive": (0, {"OMP_WAIT_POLICY": "PASSIVE"}, False),
    "resident-passive": (3, {"OMP_WAIT_POLICY": "PASSIVE"}, False),
    "resident-second-team": (3, {}, True),
}


def run_variant(name: str, steps: int, warmup: int) -> dict:
    """Train ``name``'s model in this process; the median times of its steps after the warm-up."""
    from offload import OffloadModel, OffloadOptimizer
    from offload.cli.models import random_model
    from offload.integrations.transformers import causal_lm_sequential

    resident, _, second_team = VARIANTS[name]
    if second_team:
        done = threading.Event()

        def team() -> None:
            torch.ones(1 << 22).mul_(2)  # large enough to run in parallel: this thread gets a team
            done.wait()

        threading.Thread(target=team, daemon=True).start()
    torch.manual_seed(0)
    hf, _ = random_model("llama", "tiny", 256, 64)
    model = OffloadModel(causal_lm_sequential(hf, loss_chunk_tokens=1024), device="cpu", num_slices=3,
                         resident_slices=resident)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.0, fused=True)
    ids = torch.randint(0, 256, (4, 64))
    phases = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        loss = model({"input_ids": ids, "labels": ids}).sum() / ids.numel()
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        last_loss = loss.item()
        phases.append((forward - start, backward - forward, time.perf_counter() - backward))
    optimizer.synchronize()
    timed = phases[warmup:]
    return {"last_loss": last_loss, "step_s": statistics.median(sum(p) for p in timed),
            **{f"{what}_s": statistics.median(p[i] for p in timed) for i, what in
               enumerate(("forward", "backward", "optimizer_step"))}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each variant, interleaved")
    parser.add_argument("--only", choices=list(VARIANTS), help="run this variant here and print its result")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    check_json_path(parser, args.json)
    if args.only:
        print(json.dumps(run_variant(args.only, args.steps, args.warmup)))
        return
    runs: dict[str, list[dict]] = {name: [] for name in args.variants}
    for _ in range(args.rounds):
        for name in args.variants:
            env = os.environ | VARIANTS[name][1]
            load = os.getloadavg()[0]
            out = subprocess.run([sys.executable, __file__, "--only", name, "--steps", str(args.steps),
                                  "--warmup", str(args.warmup)], env=env, check=True, capture_output=True, text=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]) | {"load_average_1min": load})
            print(f"{name:>22}: step {runs[name][-1]['step_s'] * 1e3:8.1f} ms  (load {load:.1f})", flush=True)
    results = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "date": datetime.date.today().isoformat(),
        "machine": {"processor": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "threads": torch.get_num_threads()},
        "model": "offload-finetune's tiny Llama (hidden 64, 4 layers), batch 4 x 64 tokens, 3 slices, fp32, "
                 "fused AdamW",
        "variants": {name: {"resident_slices": VARIANTS[name][0], "environment": VARIANTS[name][1],
                            "second_openmp_team": VARIANTS[name][2],
                            "median_step_s": statistics.median(r["step_s"] for r in runs[name]), "runs": runs[name]}
                     for name in args.variants},
    }
    for name, entry in results["variants"].items():
        print(f"{name:>22}: median step {entry['median_step_s'] * 1e3:8.1f} ms")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
            handle.write("\n")


if __name__ == "__main__":
    main()
