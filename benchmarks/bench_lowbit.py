"""Low-bit optimizers on the host: update time and state bytes per parameter against fused float32 AdamW.

One ``OffloadModel`` of identical linear layers is stepped by ``OffloadOptimizer`` with each class
in turn (``torch.optim.AdamW(fused=True)``; torchao's ``AdamW8bit`` and ``AdamW4bit``;
bitsandbytes' ``AdamW8bit``, ``Lion8bit`` and ``SGD8bit``); each update is timed from ``step()`` to
``synchronize()`` (the whole host update, nothing overlapped), the median of ``--steps`` after
``--warmup`` (torchao's classes compile their step on first use). State bytes count what the
optimizer keeps per parameter (codes, scales and quantization maps for the low-bit classes). The
update moves, per parameter, the parameter (read and write), its gradient (read) and the state (read
and write).

``--libraries`` picks the low-bit libraries measured beside fused AdamW: ``torchao`` (the lowbit
extra) and ``bnb`` (the bnb extra, bitsandbytes).

Usage::

    python benchmarks/bench_lowbit.py --json benchmarks/results/lowbit_cpu.json
    python benchmarks/bench_lowbit.py --libraries bnb --json benchmarks/results/lowbit_bnb_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer
from offload.planning.footprint import state_storages
from json_output import check_json_path  # benchmarks/json_output.py, next to this file


def state_bytes(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> int:
    storages = {storage.data_ptr(): storage.nbytes() for p in params for value in optimizer.state[p].values()
                if isinstance(value, torch.Tensor) and value.dim() > 0 for storage in state_storages(value)}
    return sum(storages.values())


def measure(cls: type, kwargs: dict, width: int, layers: int, warmup: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = OffloadModel(nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]),
                         device="cpu", num_slices=layers)
    optimizer = OffloadOptimizer(model, cls, lr=1e-4, **kwargs)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3  # the gradients stay: each step reads them again
    times = []
    for k in range(warmup + steps):
        start = time.perf_counter()
        optimizer.step()
        optimizer.synchronize()
        if k >= warmup:
            times.append(time.perf_counter() - start)
    n = sum(p.numel() for p in params)
    nbytes = state_bytes(optimizer, params)
    optimizer.close()
    median = statistics.median(times)
    return {"update_s": median, "params": n, "params_per_s": n / median, "state_bytes_per_param": nbytes / n,
            "host_bytes_per_param_per_update": 4 * 2 + 4 + 2 * nbytes / n, "times_s": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--libraries", nargs="+", choices=["torchao", "bnb"], default=["torchao"],
                        help="low-bit libraries to measure beside fused float32 AdamW (default: torchao)")
    parser.add_argument("--json")
    args = parser.parse_args()
    check_json_path(parser, args.json)
    classes = {"AdamW fused float32": (torch.optim.AdamW, {"fused": True})}
    if "torchao" in args.libraries:
        from torchao.optim import AdamW4bit, AdamW8bit  # the lowbit extra

        classes.update({"torchao AdamW8bit": (AdamW8bit, {}), "torchao AdamW4bit": (AdamW4bit, {})})
    if "bnb" in args.libraries:
        import bitsandbytes as bnb  # the bnb extra

        # SGD8bit needs momentum (it refuses to run without); the others at their defaults.
        classes.update({"bitsandbytes AdamW8bit": (bnb.optim.AdamW8bit, {}),
                        "bitsandbytes Lion8bit": (bnb.optim.Lion8bit, {}),
                        "bitsandbytes SGD8bit": (bnb.optim.SGD8bit, {"momentum": 0.9})})
    report = {"command": "python " + " ".join(sys.argv), "date": datetime.date.today().isoformat(),
              "host": f"{platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads",
              "torch": torch.__version__, "libraries": {name: _version(name) for name in args.libraries},
              "results": {}}
    for name, (cls, kwargs) in classes.items():
        report["results"][name] = measure(cls, kwargs, args.width, args.layers, args.warmup, args.steps)
    base = report["results"]["AdamW fused float32"]
    print(f"{report['host']}; {base['params'] / 1e6:.1f} M parameters in {args.layers} slices")
    print("| class | update ms | vs fused float32 | state bytes/param | host bytes/param/update |")
    print("|---|---:|---:|---:|---:|")
    for name, r in report["results"].items():
        r["update_vs_fused_float32"] = r["update_s"] / base["update_s"]
        print(f"| {name} | {r['update_s'] * 1e3:.1f} | {r['update_vs_fused_float32']:.2f} "
              f"| {r['state_bytes_per_param']:.2f} | {r['host_bytes_per_param_per_update']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


def _version(library: str) -> str:
    from importlib.metadata import version

    return version({"torchao": "torchao", "bnb": "bitsandbytes"}[library])


if __name__ == "__main__":
    main()
