"""The planner's step time against steps timed on a CPU "device" whose layers sleep a known time.

Loads, offloads and the host update run for real; each layer's forward sleeps ``seconds`` and its
backward twice that (no CPU used, the GIL released, as a GPU's kernels would), and the update is a
real fused AdamW followed by a sleep of ``ns`` nanoseconds per parameter it stepped (a slower host
that takes no CPU from the training thread; on two shared cores a slower update for real would,
and the step's time would follow the machine's load). The layers are small (1.6 M parameters in
all) and the sleeps long, so that the CPU work (the copies, AdamW itself) is a small part of a
step: what the other processes of a shared machine take of the CPU changes little of it. The
rates are measured as ``offload calibrate`` measures them, in the same rounds as the steps (a
shared machine's speed moves from one minute to the next), the update's from the update alone.
The cases:

- ``overlapped`` and ``serial`` at 10 ms a slice and 20 ns a parameter: the update about as long
  as the forward, so the schedule decides how much of it shows;
- ``overlapped`` and ``in-backward`` at 5 ms and 50 ns: the update about four times the forward
  and longer than the backward; the default schedule exposes most of it, the update during
  backward (each slice's update started as its gradients land) what outlasts the backward after
  the first slice's gradients landed. The two schedules' predictions lie well apart there.

This is a benchmark: it times the machine. The JSON it writes keeps each case's rates and measured
steps; ``tests/test_planning.py`` predicts each case again from the recorded rates with the time
model as it stands and compares it with the recorded steps, so that a change to the time model
is checked against these measurements without timing the machine the tests run on.

Usage::

    python benchmarks/planner_vs_sleeping_device.py --json benchmarks/results/planner_vs_sleeping_device_cpu_2026-11-28.json
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
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer
from offload.planning.planner import SliceLayout, slice_layout
from offload.planning.rates import MachineRates
from offload.planning.timing import StepConfig, StepTime, estimate_step_time, traffic
from json_output import check_json_path  # benchmarks/json_output.py, next to this file

#: (schedule, seconds a layer's forward sleeps, ns the update sleeps per parameter).
CASES = [("overlapped", 0.01, 20.0), ("serial", 0.01, 20.0), ("overlapped", 0.005, 50.0),
         ("in-backward", 0.005, 50.0)]
SLICES = 4
#: Parameters per layer; with --quick, a toy size.
SIZE, QUICK_SIZE = 400_000, 100_000
#: How close a prediction must come to the measured step (the median of consecutive steps).
TOLERANCE = 0.15


class _Sleep(torch.autograd.Function):
    """The device's work as a sleep. The weight's gradient is a buffer made once, so that producing
    it costs nothing either (on a GPU that write is negligible; on the CPU it would be work the
    sleep does not account for)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds, ctx.grad = seconds, grad
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        time.sleep(2 * ctx.seconds)  # a backward does about twice a forward's work
        return grad, ctx.grad, None, None


class Sleepy(nn.Module):
    def __init__(self, size: int, seconds: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(size) * 0.01)
        self.grad = torch.zeros(size)  # not a buffer: the device's own scratch
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.weight, self.grad, self.seconds)


class SlowHostAdamW(torch.optim.AdamW):
    """AdamW whose ``step()`` then sleeps ``ns_per_parameter`` ns per parameter it stepped."""

    ns_per_parameter = 0.0

    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        stepped = sum(p.numel() for group in self.param_groups for p in group["params"] if p.grad is not None)
        time.sleep(self.ns_per_parameter * stepped * 1e-9)
        return loss


def sleepy_layers(size: int, seconds: float, slices: int = SLICES) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Sleepy(size, seconds) for _ in range(slices)])


def predict(case: dict[str, Any], layout: SliceLayout | None = None, schedule: str | None = None) -> StepTime:
    """A recorded case's step as the time model predicts it from the case's recorded rates
    (``schedule``: another schedule's, for the same case)."""
    slices, seconds = case["slices"], case["seconds"]
    layout = layout or slice_layout(sleepy_layers(case["size"], seconds, slices), num_slices=slices)
    return estimate_step_time(layout, None, StepConfig(num_slices=slices, schedule=schedule or case["schedule"]),
                              MachineRates.from_json(case["rates"]), device="cpu",
                              device_seconds=(slices * seconds, slices * 3 * seconds))


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _wait_for_quiet(seconds: float) -> None:
    """Wait until the one-minute load average is at most the number of cores, or ``seconds``."""
    deadline = time.monotonic() + seconds
    while os.getloadavg()[0] > (os.cpu_count() or 1) and time.monotonic() < deadline:
        time.sleep(2.0)


def measure(schedule: str, seconds: float, ns_per_parameter: float, size: int, rounds: int) -> dict[str, Any]:
    """One case: its steps timed one after the other, and the rates measured between them."""
    from offload.cli.calibrate import host_copy_rate, slice_overhead

    optimizer_class = type("SlowHostAdamW", (SlowHostAdamW,), {"ns_per_parameter": ns_per_parameter})
    plain = sleepy_layers(size, seconds)
    layout = slice_layout(plain, num_slices=SLICES)
    model = OffloadModel(plain, device="cpu", num_slices=SLICES)
    optimizer = OffloadOptimizer(model, optimizer_class, lr=1e-4, fused=True,
                                 update_in_backward=schedule == "in-backward")
    x = torch.randn(4, 16)

    def step() -> None:
        model(x).pow(2).mean().backward()
        optimizer.step()
        if schedule == "serial":
            optimizer.synchronize()
        optimizer.zero_grad()

    def update_alone() -> None:
        optimizer.step()
        optimizer.synchronize()

    for _ in range(3):
        step()
    optimizer.synchronize()
    steps, updates, copies, started = [], [], [], []
    for _ in range(rounds):
        # Steps one after the other, each waiting for what it waits for of the last one's update; the
        # first of a round waits for none (the update alone ran to its end before it): left out.
        steps += [_timed(step) for _ in range(3)][1:]
        if optimizer._in_backward is not None:
            started.append(sorted(optimizer._in_backward.last_started))
            # The next backward starts nothing, as an optimizer's first does: step() runs the whole update.
            optimizer._in_backward.checked = False
        optimizer.synchronize()
        model(x).pow(2).mean().backward()
        updates.append(_timed(update_alone))
        optimizer.zero_grad()
        copies.append(host_copy_rate(64 * 2**20, repeats=1))
    update_bytes = traffic(layout, None, StepConfig(num_slices=SLICES)).update
    rates = MachineRates(name="this host, in the case's rounds", device_flops={}, host_to_device=0.0,
                         device_to_host=0.0, host_copy=statistics.median(copies),
                         host_update=update_bytes / statistics.median(updates),
                         slice_overhead_s=slice_overhead(repeats=3))
    case = {"schedule": schedule, "seconds": seconds, "ns_per_parameter": ns_per_parameter, "slices": SLICES,
            "size": size, "rates": rates.to_json(), "steps_s": steps, "median_step_s": statistics.median(steps),
            "updates_alone_s": updates, "started_in_backward": started if schedule == "in-backward" else None}
    case["predicted_step_s"] = predict(case, layout).step
    case["predicted_over_measured"] = case["predicted_step_s"] / case["median_step_s"]
    return case


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of steps and rate measurements per case")
    parser.add_argument("--tries", type=int, default=3,
                        help="measurements of a case at most, again while its prediction misses by more than "
                             f"{TOLERANCE * 100:.0f} %% (a shared machine's load comes in spikes that lengthen whole rounds)")
    parser.add_argument("--quiet-wait", type=float, default=60.0,
                        help="seconds to wait before each case for the load average to fall to the core count")
    parser.add_argument("--quick", action="store_true", help="toy sizes, one round and try: a smoke test")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    check_json_path(parser, args.json)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # --quick: a tenth of the sleeps too, so that the four cases take a few seconds.
    size, rounds, tries, scale = (QUICK_SIZE, 1, 1, 0.1) if args.quick else (SIZE, args.rounds, args.tries, 1.0)
    cases = []
    for schedule, seconds, ns in CASES:
        missed: list[float] = []  # the predicted over measured steps of the tries measured again
        for attempt in range(1, tries + 1):
            _wait_for_quiet(0.0 if args.quick else args.quiet_wait)
            load = os.getloadavg()
            case = measure(schedule, seconds * scale, ns, size, rounds)
            case.update(attempt=attempt, load_average_before=load, missed_tries=list(missed))
            if abs(case["predicted_over_measured"] - 1) <= TOLERANCE:
                break
            missed.append(case["predicted_over_measured"])
        cases.append(case)
        print(f"{schedule:11s} {case['seconds'] * 1e3:g} ms/slice {ns:g} ns/parameter: predicted "
              f"{case['predicted_step_s'] * 1e3:.0f} ms, measured {case['median_step_s'] * 1e3:.0f} ms "
              f"(x{case['predicted_over_measured']:.2f}, try {case['attempt']})", flush=True)
    if args.json:
        report = {"command": "python benchmarks/planner_vs_sleeping_device.py " + " ".join(argv or sys.argv[1:]),
                  "date": datetime.date.today().isoformat(), "tolerance": TOLERANCE,
                  "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                              "torch": torch.__version__, "load_average_after": os.getloadavg()},
                  "cases": cases}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
