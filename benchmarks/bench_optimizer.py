"""The host optimizer: how fast the update runs, and how much of it a training step still waits for.

Two measurements, written to one JSON file:

1. **Update throughput.** One AdamW step over the same float32 parameters (in ``--tensors``
   tensors) with PyTorch's default implementation for CPU tensors (per tensor), ``foreach=True``,
   ``fused=True``, ``fused=True`` after a backup copy of the parameters and both moments (what
   would make a failing update all-or-nothing), and OffloadOptimizer (fused, on its host worker,
   with and without writing a bfloat16 shadow), interleaved round by round with a separate cast
   pass of all masters into bfloat16. Rates are parameters per second and GB/s at 28 bytes per
   parameter (read parameter, gradient and both moments, write parameter and moments), against
   this machine's memory bandwidth measured by a large copy. ``update_bandwidth_fraction`` =
   OffloadOptimizer's GB/s / that bandwidth; ``shadow_cost_vs_update`` and
   ``backup_cost_vs_update``: what the shadow and the backup add, over the update without them.

2. **Overlap.** A training step of an OffloadModel whose layers *sleep* instead of computing (the
   device's work, using no CPU and releasing the GIL, as a GPU's would), three ways: without an
   optimizer step, with OffloadOptimizer, and the update alone. ``exposed_fraction`` = (step with
   OffloadOptimizer - step without) / update alone: the share of the update the step still waits
   for; and ``blocked_fraction``, the time the training thread spends blocked in ``step()`` and in
   the next forward's waits for slices' updates, over the update alone: the same quantity measured
   directly. On a CPU the first is noisy (the "device" still copies slices through the memory the
   update uses; the plain optimizer's own figure shows how far off it can be); the second does not
   depend on that. The forward's device work per slice is sized to exceed a slice's update (the update
   of a slice can hide only behind the forward of the slices before it), so all but about one
   slice's update could hide.

Usage::

    python benchmarks/bench_optimizer.py --json benchmarks/results/optimizer_cpu.json
    python benchmarks/bench_optimizer.py --params 20e6 --overlap-params 16e6 --rounds 3   # smaller, quicker
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer
from offload.model import engine_of
from json_output import check_json_path  # benchmarks/json_output.py, next to this file

BYTES_PER_PARAMETER = 28  # AdamW: read p, g, m, v (16 B), write p, m, v (12 B), float32


def memory_bandwidth(nbytes: int = 2**30, repeats: int = 5) -> float:
    """Bytes per second read plus written by a large copy (``torch.Tensor.copy_``)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    return 2 * nbytes * repeats / (time.perf_counter() - start)


class Stack(nn.Module):
    """``count`` parameters of ``size`` elements: an update-only workload."""

    def __init__(self, count: int, size: int) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(size) * 0.01) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    total = int(args.params)
    size = total // args.tensors
    torch.manual_seed(0)
    layers = [Stack(args.tensors // args.slices, size) for _ in range(args.slices)]
    grads_of: dict[str, list[torch.Tensor]] = {}

    def with_grads(params: list[torch.Tensor], name: str) -> list[torch.Tensor]:
        grads_of[name] = [torch.randn_like(p) * 0.01 for p in params]
        for p, g in zip(params, grads_of[name]):
            p.grad = g
        return params

    variants: dict[str, Callable[[], None]] = {}
    for name, kwargs in (("default", {}), ("foreach", {"foreach": True}), ("fused", {"fused": True})):
        params = with_grads([nn.Parameter(torch.randn(size) * 0.01) for _ in range(args.tensors)], name)
        variants[name] = torch.optim.AdamW(params, lr=1e-4, **kwargs).step
    params = with_grads([nn.Parameter(torch.randn(size) * 0.01) for _ in range(args.tensors)], "fused with a backup")
    variants["fused with a backup"] = backed_up(torch.optim.AdamW(params, lr=1e-4, fused=True))
    masters, shadow = torch.randn(total), torch.empty(total, dtype=torch.bfloat16)
    shadow.copy_(masters)
    variants["bf16 cast pass"] = functools.partial(shadow.copy_, masters)
    variants.update(one_pass_variants(args, size))
    models = {}
    for name, dtype in (("OffloadOptimizer", None), ("OffloadOptimizer+bf16 shadow", torch.bfloat16),
                        ("OffloadOptimizer+bf16 shadow, two passes", torch.bfloat16)):
        model = OffloadModel(nn.Sequential(*[Stack(args.tensors // args.slices, size) for _ in range(args.slices)]),
                             device="cpu", num_slices=args.slices, compute_dtype=dtype)
        with_grads(list(model.parameters()), name)
        optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-4, fused=True)
        if dtype is not None:
            model(torch.zeros(1))  # lay the shadows out: later steps write them

        def step(optimizer: OffloadOptimizer = optimizer, one_pass: bool = "two passes" not in name) -> None:
            os.environ["OFFLOAD_HOST_KERNELS"] = "1" if one_pass else "0"  # read at each slice's update
            optimizer.step()
            optimizer.synchronize()
            os.environ.pop("OFFLOAD_HOST_KERNELS")
        variants[name] = step
        models[name] = model
    del layers
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(args.rounds + 1):
        order = list(variants)
        order = order[round_ % len(order):] + order[:round_ % len(order)]
        for name in order:
            start = time.perf_counter()
            variants[name]()
            if round_ > 0:  # the first round allocates the optimizer state
                times[name].append(time.perf_counter() - start)
    bandwidth = memory_bandwidth()
    results = {}
    for name, samples in times.items():
        median = statistics.median(samples)
        results[name] = {"median_s": median, "params_per_s": total / median,
                         "gb_per_s": total * BYTES_PER_PARAMETER / median / 1e9, "samples_s": samples}
    cast = results.pop("bf16 cast pass")["median_s"]  # not an AdamW step: no rate at 28 B/param
    fused = results["fused"]["median_s"]
    for name in results:
        results[name]["vs_fused"] = results[name]["median_s"] / fused
    offload = results["OffloadOptimizer"]["median_s"]
    return {
        "parameters": total,
        "tensors": args.tensors,
        "memory_bandwidth_gb_per_s": bandwidth / 1e9,
        "variants": results,
        "update_bandwidth_fraction": results["OffloadOptimizer"]["gb_per_s"] * 1e9 / bandwidth,
        "update_bandwidth_fraction_bf16_shadow": results["OffloadOptimizer+bf16 shadow"]["gb_per_s"] * 1e9 / bandwidth,
        "cast_pass_s": cast,
        "shadow_cost_vs_update": {
            "written by the update": (results["OffloadOptimizer+bf16 shadow"]["median_s"] - offload) / offload,
            "separate cast pass": cast / offload,
        },
        "backup_cost_vs_update": (results["fused with a backup"]["median_s"] - fused) / fused,
        # Note: [One-pass update]: the update and its shadow over the fused update alone (target <= 1.05).
        "one_pass": {
            "kernel_update_and_shadow_vs_fused": results["one-pass kernel: update + bf16 shadow"]["vs_fused"],
            "two_passes_update_and_shadow_vs_fused": results["fused, then a bf16 cast"]["vs_fused"],
            "offload_optimizer_one_pass_vs_fused": results["OffloadOptimizer+bf16 shadow"]["vs_fused"],
            "offload_optimizer_two_passes_vs_fused": results["OffloadOptimizer+bf16 shadow, two passes"]["vs_fused"],
            "host_bytes_per_parameter": {"one pass": BYTES_PER_PARAMETER + 2, "two passes": BYTES_PER_PARAMETER + 6},
        },
    }


def one_pass_variants(args: argparse.Namespace, size: int) -> dict[str, Callable[[], None]]:
    """PyTorch's fused AdamW kernel and then a cast of its parameters into a bfloat16 shadow, and
    the one-pass kernel that does both (Note: [One-pass update]), over flat buffers as a slice's."""
    from offload.kernels import host_kernel
    from offload.kernels.one_pass import one_pass

    kernel = host_kernel(wait=True)
    if kernel is None:
        raise SystemExit("the one-pass kernel did not build here; see the warning above")
    variants: dict[str, Callable[[], None]] = {}
    options = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.01, "eps": 1e-8, "amsgrad": False,
               "maximize": False}
    for name in ("fused, then a bf16 cast", "one-pass kernel: update + bf16 shadow"):
        flat, shadow = torch.randn(size * args.tensors) * 0.01, torch.empty(size * args.tensors, dtype=torch.bfloat16)
        lists = [list(flat.split(size)), [torch.randn(size) * 0.01 for _ in range(args.tensors)],
                 [torch.zeros(size) for _ in range(args.tensors)], [torch.zeros(size) for _ in range(args.tensors)],
                 [], [torch.tensor(1.0) for _ in range(args.tensors)]]
        if name.startswith("fused"):
            def step(lists: list[list[torch.Tensor]] = lists, flat: torch.Tensor = flat, shadow: torch.Tensor = shadow) -> None:
                torch._fused_adamw_(*lists, **options)
                shadow.copy_(flat)
        else:
            def step(lists: list[list[torch.Tensor]] = lists, shadow: torch.Tensor = shadow) -> None:
                one_pass(kernel, torch.ops.aten._fused_adamw_.default, lists, list(shadow.split(size)), options)
        variants[name] = step
    return variants


def backed_up(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """``optimizer.step`` after copying every parameter and its state into buffers kept for it:
    the backup an all-or-nothing update would restore after a failure."""
    backups: list[torch.Tensor] = []

    def step() -> None:
        if optimizer.state:  # the first step allocates the state: nothing to back up yet
            sources = [t for group in optimizer.param_groups for p in group["params"]
                       for t in (p.detach(), *(v for v in optimizer.state[p].values() if v.dim() > 0))]
            if not backups:
                backups.extend(torch.empty_like(t) for t in sources)
            torch._foreach_copy_(backups, sources)
        optimizer.step()
    return step


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(2 * ctx.seconds)  # backward does about twice a forward's work
        return grad, None


class Sleepy(nn.Module):
    """A layer with ``size`` parameters whose "compute" is a sleep: the device's work."""

    def __init__(self, size: int, seconds: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(size) * 0.01)
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x + self.weight[: x.shape[-1]], self.seconds)


def overlap(args: argparse.Namespace) -> dict[str, Any]:
    size = int(args.overlap_params) // args.slices
    torch.manual_seed(0)
    model = OffloadModel(nn.Sequential(*[Sleepy(size, args.sleep) for _ in range(args.slices)]), device="cpu",
                         num_slices=args.slices)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-4, fused=True)
    x = torch.randn(4, 16)

    def forward_backward() -> None:
        model(x).pow(2).mean().backward()

    # How long the training thread is blocked by the update: in step() and in the next forward's
    # waits for each slice's update (SliceUpdates.wait).
    blocked = [0.0]
    updates = engine_of(model).updates
    wait = updates.wait

    def timed_wait(index: int) -> None:
        start = time.perf_counter()
        wait(index)
        blocked[0] += time.perf_counter() - start

    updates.wait = timed_wait  # type: ignore[method-assign]

    def with_update() -> None:
        forward_backward()
        start = time.perf_counter()
        optimizer.step()
        blocked[0] += time.perf_counter() - start
        optimizer.zero_grad()

    def without_update() -> None:
        forward_backward()
        optimizer.zero_grad()

    plain = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def with_plain_update() -> None:
        # The same update with the plain optimizer, which runs in the calling thread: the
        # reference point, exposed in full.
        forward_backward()
        plain.step()
        optimizer.zero_grad()

    def update_alone() -> None:
        optimizer.step()
        optimizer.synchronize()

    forward_backward()
    optimizer.step()
    optimizer.synchronize()  # the optimizer state exists from here on
    times: dict[str, list[float]] = {"with": [], "without": [], "plain": [], "update": [], "blocked": []}
    for round_ in range(args.rounds * 3 + 1):
        for name, fn in (("with", with_update), ("without", without_update), ("plain", with_plain_update)):
            blocked[0] = 0.0
            start = time.perf_counter()
            fn()
            forward_backward()  # the next step's forward waits for what is left of the update
            optimizer.zero_grad()
            if round_ > 0:
                times[name].append(time.perf_counter() - start)
                if name == "with":
                    times["blocked"].append(blocked[0])
        forward_backward()
        start = time.perf_counter()
        update_alone()
        if round_ > 0:
            times["update"].append(time.perf_counter() - start)
        optimizer.zero_grad()
    medians = {name: statistics.median(samples) for name, samples in times.items()}
    # Paired: the two variants run back to back in each round, so machine noise cancels.
    exposed = statistics.median(a - b for a, b in zip(times["with"], times["without"])) / medians["update"]
    exposed_plain = statistics.median(a - b for a, b in zip(times["plain"], times["without"])) / medians["update"]
    blocked_fraction = medians["blocked"] / medians["update"]
    return {
        "num_slices": args.slices,
        "parameters": size * args.slices,
        "device_sleep_per_slice_forward_s": args.sleep,
        "two_steps_with_update_s": medians["with"],
        "two_steps_without_update_s": medians["without"],
        "update_alone_s": medians["update"],
        "exposed_fraction": exposed,
        "blocked_fraction": blocked_fraction,
        "exposed_fraction_plain_fused_adamw": exposed_plain,
        "two_steps_with_plain_update_s": medians["plain"],
        "target": 1 / args.slices + 0.05,
        "samples_s": times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--params", type=float, default=100e6, help="parameters for the throughput part")
    parser.add_argument("--tensors", type=int, default=2000, help="tensors they are split into")
    parser.add_argument("--slices", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--overlap-params", type=float, default=64e6, help="parameters for the overlap part")
    parser.add_argument("--sleep", type=float, default=0.008, help="device seconds per slice forward")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    check_json_path(parser, args.json)

    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{torch.get_num_threads()} torch threads", flush=True)
    update = throughput(args)
    print(f"\nAdamW update of {update['parameters'] / 1e6:.0f} M float32 parameters in {update['tensors']} tensors; "
          f"memory bandwidth (copy) {update['memory_bandwidth_gb_per_s']:.1f} GB/s")
    print(f"{'variant':32s} {'ms':>8s} {'M params/s':>11s} {'GB/s':>7s} {'vs fused':>9s}")
    for name, row in update["variants"].items():
        print(f"{name:32s} {row['median_s'] * 1e3:8.1f} {row['params_per_s'] / 1e6:11.0f} "
              f"{row['gb_per_s']:7.1f} {row['vs_fused']:9.2f}")
    print(f"update_bandwidth_fraction: {update['update_bandwidth_fraction']:.2f} (target >= 0.7); with a bf16 "
          f"shadow: {update['update_bandwidth_fraction_bf16_shadow']:.2f}")
    one_pass = update["one_pass"]
    print(f"update + bf16 shadow over the fused update alone: one pass {one_pass['kernel_update_and_shadow_vs_fused']:.3f} "
          f"(target <= 1.05), two passes {one_pass['two_passes_update_and_shadow_vs_fused']:.3f}; through "
          f"OffloadOptimizer {one_pass['offload_optimizer_one_pass_vs_fused']:.3f} and "
          f"{one_pass['offload_optimizer_two_passes_vs_fused']:.3f}")
    costs = update["shadow_cost_vs_update"]
    print(f"over OffloadOptimizer's update: the bf16 shadow written by it {costs['written by the update']:.2f}, "
          f"a separate cast pass {costs['separate cast pass']:.2f}; a backup before the fused update "
          f"{update['backup_cost_vs_update']:.2f} of it")

    hidden = overlap(args)
    print(f"\noverlap, {hidden['num_slices']} slices, {hidden['parameters'] / 1e6:.0f} M parameters, "
          f"{hidden['device_sleep_per_slice_forward_s'] * 1e3:.0f} ms of device work per slice forward:")
    print(f"  two steps without the update {hidden['two_steps_without_update_s'] * 1e3:.1f} ms, with it "
          f"{hidden['two_steps_with_update_s'] * 1e3:.1f} ms; the update alone {hidden['update_alone_s'] * 1e3:.1f} ms")
    print(f"  exposed_fraction: {hidden['exposed_fraction']:.3f} (target <= {hidden['target']:.3f}); the plain "
          f"fused AdamW in the same step: {hidden['exposed_fraction_plain_fused_adamw']:.3f}")
    print(f"  blocked_fraction (the training thread blocked in step() and in the forward's waits, over the "
          f"update alone): {hidden['blocked_fraction']:.3f}")

    if args.json:
        report = {"command": "python " + " ".join(sys.argv), "date": datetime.date.today().isoformat(),
                  "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                              "torch_threads": torch.get_num_threads(), "torch": torch.__version__},
                  # The figures the issue asks for, at the top; the sections below hold them too.
                  "update_bandwidth_fraction": update["update_bandwidth_fraction"],
                  "exposed_fraction": hidden["exposed_fraction"], "num_slices": hidden["num_slices"],
                  "update": update, "overlap": hidden}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
