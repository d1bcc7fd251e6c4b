"""When the host update runs: during backward, during the next forward, or after the step.

``OffloadOptimizer`` steps the host copies on a worker thread. Three schedules, each measured as
the time of one training step (forward start to the next forward's start, median after warm-up):

- ``next-forward`` (``update_in_backward=False``, the default): ``step()`` starts the update and
  returns; it hides behind the next forward only (Note: [Overlapped host update] in
  ``offload/optimizer.py``).
- ``backward`` (``update_in_backward=True``): backward starts each slice's update as soon as its
  gradients are on the host, so it hides behind backward too (Note: [Update in backward] in
  ``offload/optimizing/in_backward.py``).
- ``serial`` (``step()`` then ``synchronize()``): nothing overlaps; the reference.

Each is compared with the bound ``max(device time of the step, update time)``: a step cannot take
less than the device's work (forward, recompute, backward), nor less than the update. The device
time of a step is measured: the same step without an optimizer.

On ``--device cpu`` the device is simulated as in ``scripts/bench_optimizer.py``: each layer
computes ``y = x @ W`` (a real function of its parameter, so the results can be compared bit for
bit) and then *sleeps* ``s`` seconds (``2 s`` in backward), which uses no CPU and releases the GIL
as a GPU's work would. The training thread still does the walk's own work on the CPU (loading
slices is a copy in host memory, the matmuls run there): the step without an optimizer counts it,
and ``slept_s`` says how much of it was sleep. The update alone is measured first, and ``s`` is
chosen per ratio so that the forward (the walk's own forward plus the sleeps) takes ``update /
ratio``. The fused AdamW update costs about what that walk costs per parameter (both move the
parameters through memory), so on the CPU ratios above about 0.7 need a slower update:
``--update-sleep-ns`` makes each slice's update sleep that long per parameter after AdamW (a
slower host, taking no CPU from the training thread: the run in ``docs/optimizer.md``), and
``--optimizer per-tensor`` uses PyTorch's per-tensor AdamW, slower for real (and competing with
the training thread for the CPU and the GIL). On ``--device cuda`` nothing sleeps: the batch's rows are chosen per ratio
so that the measured forward takes ``update / ratio`` (its loads may keep it longer:
``update_over_forward`` is the ratio reached).

``exact``: the parameters after every step of a schedule are bit-identical to a plain
``torch.optim.AdamW`` stepping host copies of the same layers, with the gradients of the unwrapped
model on the same device and the same inputs.

The machine this was written on has 2 shared cores: ``--threads 1`` gives the update one thread
(``OffloadOptimizer(num_threads=1)``), leaving the other to the training thread.

Usage::

    python scripts/bench_schedule.py --update-sleep-ns 5 --threads 1 --json benchmarks/results/schedule_cpu.json
    python scripts/bench_schedule.py --quick --json /tmp/schedule.json     # toy sizes, seconds
    python scripts/bench_schedule.py --device cuda --dim 4096 --rows 512 --threads 8 --json schedule_cuda.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer

SCHEDULES = ("next-forward", "backward", "serial")
TARGET_STEP_OVER_BOUND = 1.15  # for the update during backward, where the update fits in forward + backward
LR = 1e-3
# AdamW's implementations on the host: the fused one is about as fast per parameter as the CPU
# walk's own copies, the other two several times slower (docs/optimizer.md).
OPTIMIZERS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "per-tensor": {"foreach": False}}


class DeviceClock:
    """The seconds the simulated device worked (slept) since the last ``reset()``."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def reset(self) -> None:
        self.seconds = 0.0

    def sleep(self, seconds: float) -> None:
        self.seconds += seconds
        time.sleep(seconds)


class _Sleep(torch.autograd.Function):
    """The identity, taking ``seconds`` of device time in forward and twice that in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float, clock: DeviceClock) -> torch.Tensor:
        ctx.seconds, ctx.clock = seconds, clock
        clock.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.clock.sleep(2 * ctx.seconds)  # backward does about twice a forward's work
        return grad, None, None


class Layer(nn.Module):
    """``y = x @ W`` with ``W`` of ``dim x dim``, then ``seconds`` of simulated device work (none at 0)."""

    def __init__(self, dim: int, seconds: float, clock: DeviceClock) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim) / math.sqrt(dim))
        self.seconds = seconds
        self.clock = clock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight
        return _Sleep.apply(y, self.seconds, self.clock) if self.seconds else y


def build_layers(args: argparse.Namespace, seconds: float, clock: DeviceClock) -> nn.Sequential:
    """The same weights for every schedule and the reference, whatever ``seconds``."""
    torch.manual_seed(args.seed)
    return nn.Sequential(*[Layer(args.dim, seconds, clock) for _ in range(args.slices)])


def make_inputs(args: argparse.Namespace, rows: int, count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(args.seed + 1)
    return [torch.randn(rows, args.dim, generator=generator).to(args.device) for _ in range(count)]


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


def sync(device: str) -> None:
    # Step boundaries on the device's clock: on a GPU, the work queued by the last backward.
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class SlowHostAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW``, whose ``step()`` then sleeps ``ns_per_parameter`` nanoseconds per
    parameter it stepped: a host whose update is slower, relative to the device, than this one's,
    without taking CPU or memory bandwidth from the training thread. The parameters are AdamW's."""

    ns_per_parameter = 0.0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        stepped = sum(p.numel() for group in self.param_groups for p in group["params"] if p.grad is not None)
        time.sleep(self.ns_per_parameter * stepped * 1e-9)
        return loss


def optimizer_class(args: argparse.Namespace) -> type[torch.optim.Optimizer]:
    if not args.update_sleep_ns:
        return torch.optim.AdamW
    return type("SlowHostAdamW", (SlowHostAdamW,), {"ns_per_parameter": args.update_sleep_ns})


def new_optimizer(args: argparse.Namespace, model: OffloadModel, schedule: str) -> OffloadOptimizer:
    return OffloadOptimizer(model, optimizer_class(args), lr=LR, num_threads=args.threads,
                            update_in_backward=schedule == "backward", **OPTIMIZERS[args.optimizer])


class UpdateTimer:
    """The update alone (``step()`` then ``synchronize()``), on a model of the benchmark's size that
    does no device work, kept for measuring again before each ratio (the machine's load drifts)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.model = OffloadModel(build_layers(args, 0.0, DeviceClock()), device=args.device, num_slices=args.slices)
        self.optimizer = new_optimizer(args, self.model, "serial")
        loss_of(self.model(make_inputs(args, 4, 1)[0])).backward()
        self.measure(1)  # the first step allocates the optimizer state

    def measure(self, repeats: int) -> list[float]:
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            self.optimizer.step()
            self.optimizer.synchronize()
            samples.append(time.perf_counter() - start)
        return samples


def run_schedule(args: argparse.Namespace, schedule: str | None, seconds: float,
                 inputs: list[torch.Tensor]) -> dict[str, Any]:
    """Train on ``inputs`` with ``schedule`` (``None``: forward and backward only, no optimizer);
    step times from each step's forward to the next one's, after the warm-up, leaving out the last
    step (nothing follows it to hide its update behind)."""
    clock = DeviceClock()
    model = OffloadModel(build_layers(args, seconds, clock), device=args.device, num_slices=args.slices)
    optimizer = None if schedule is None else new_optimizer(args, model, schedule)
    starts, forwards, slept, in_step = [], [], [], []
    for x in inputs:
        sync(args.device)
        start = time.perf_counter()
        clock.reset()
        loss = loss_of(model(x))
        sync(args.device)
        forwards.append(time.perf_counter() - start)
        loss.backward()
        stepped = time.perf_counter()
        if optimizer is None:
            model.zero_grad()
        else:
            optimizer.step()
            if schedule == "serial":
                optimizer.synchronize()
            optimizer.zero_grad()
        in_step.append(time.perf_counter() - stepped)
        starts.append(start)
        slept.append(clock.seconds)
    if optimizer is not None:
        optimizer.synchronize()
    timed = slice(args.warmup, len(inputs) - 1)
    steps = [b - a for a, b in zip(starts, starts[1:])][timed]
    return {"step_s": statistics.median(steps), "forward_s": statistics.median(forwards[timed]),
            "forwards_s": forwards[timed],
            "slept_s": statistics.median(slept[timed]), "in_step_s": statistics.median(in_step[timed]),
            "samples_s": steps, "parameters": [p.detach().clone() for p in model.parameters()]}


def reference(args: argparse.Namespace, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters after a plain fused AdamW steps host copies of the unwrapped layers, one step
    per input, with the gradients the layers compute on the device."""
    model = build_layers(args, 0.0, DeviceClock())
    host = [p.detach().clone().requires_grad_() for p in model.parameters()]
    model.to(args.device)
    device_params = list(model.parameters())
    optimizer = torch.optim.AdamW(host, lr=LR, **OPTIMIZERS[args.optimizer])
    for x in inputs:
        loss_of(model(x)).backward()
        for h, p in zip(host, device_params):
            h.grad = p.grad.to("cpu", copy=True)
            p.grad = None
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for h, p in zip(host, device_params):
                p.copy_(h)
    return [h.detach() for h in host]


def rows_for(args: argparse.Namespace, forward_s: float) -> tuple[int, list[dict[str, float]]]:
    """On a GPU: the batch rows whose forward takes ``forward_s``. The forward's loads are a cost
    that does not grow with the rows and may hide the matmuls' until they outgrow it, so it is not a
    line: two probes, then secant steps from the last two, and the probe nearest the target."""
    probes: list[dict[str, float]] = []

    def probe(rows: int) -> None:
        run = run_schedule(args, None, 0.0, make_inputs(args, rows, args.warmup + 3))
        probes.append({"rows": rows, "forward_s": run["forward_s"]})

    probe(args.rows)
    probe(4 * args.rows)
    for _ in range(2):
        (r0, f0), (r1, f1) = ((p["rows"], p["forward_s"]) for p in probes[-2:])
        per_row = (f1 - f0) / (r1 - r0) if r1 != r0 else 0.0
        if per_row <= 0:
            break
        rows = max(1, min(64 * args.rows, round(r1 + (forward_s - f1) / per_row)))
        if rows in (p["rows"] for p in probes):
            break
        probe(rows)
    best = min(probes, key=lambda p: abs(p["forward_s"] - forward_s))
    return int(best["rows"]), probes


def run_round(args: argparse.Namespace, round_: int, seconds: float, inputs: list[torch.Tensor],
              expected: list[torch.Tensor]) -> dict[str | None, dict[str, Any]]:
    """Each schedule once, and the step without an optimizer (``None``), in an order rotated by
    ``round_`` so that no schedule always runs first (the machine's load drifts)."""
    order: list[str | None] = [None, *SCHEDULES]
    order = order[round_ % len(order):] + order[:round_ % len(order)]
    runs = {}
    for schedule in order:
        run = run_schedule(args, schedule, seconds, inputs)
        parameters = run.pop("parameters")
        if schedule is not None:
            run["exact"] = all(torch.equal(a, b) for a, b in zip(parameters, expected, strict=True))
        runs[schedule] = run
    return runs


def sleep_for(args: argparse.Namespace, forward_s: float) -> tuple[float, list[dict[str, float]]]:
    """On the CPU: the sleep per slice forward that makes the forward take ``forward_s``, the walk's
    own work included: from the walk alone, then corrected twice by what the forward took (the
    machine's load moves the walk's share)."""
    seconds, probes = 0.0, []
    for _ in range(3):
        forwards = run_schedule(args, None, seconds, make_inputs(args, args.rows, args.warmup + 4))["forwards_s"]
        # The fastest forward: the walk's work is the same every step, the machine's load only adds.
        probes.append({"sleep_per_slice_forward_s": seconds, "forward_s": min(forwards)})
        seconds = max(0.0, seconds + (forward_s - min(forwards)) / args.slices)
    return seconds, probes


def measure_ratio(args: argparse.Namespace, ratio: float, timer: UpdateTimer,
                  expected: list[torch.Tensor]) -> dict[str, Any]:
    """The schedules where the update takes ``ratio`` times the forward's device time."""
    update_samples = timer.measure(args.update_repeats)
    update_s = statistics.median(update_samples)
    result: dict[str, Any] = {"ratio": ratio}
    if args.device == "cpu":
        # The forward's device time is the walk's own work on the CPU (loads, matmuls) plus the
        # sleeps: they make up the rest, where the walk alone is shorter than the target.
        rows = args.rows
        seconds, result["sleep_probes"] = sleep_for(args, update_s / ratio)
        result["sleep_per_slice_forward_s"] = seconds
    else:
        seconds = 0.0
        rows, result["row_probes"] = rows_for(args, update_s / ratio)
    result["rows"] = rows
    inputs = make_inputs(args, rows, args.warmup + args.steps + 1)
    if rows != args.rows:
        expected = reference(args, inputs)
    rounds = []
    for round_ in range(args.rounds):
        if round_ > 0:
            update_samples += timer.measure(args.update_repeats)
        rounds.append(run_round(args, round_, seconds, inputs, expected))
    update_s = statistics.median(update_samples)
    plain = [r[None] for r in rounds]
    # The device's time of a step: the step without an optimizer (on the CPU: the sleeps and the
    # walk's own work, which the training thread does).
    device_s = statistics.median(s for run in plain for s in run["samples_s"])
    forward_s = statistics.median(run["forward_s"] for run in plain)
    result.update(update_s=update_s, update_samples_s=update_samples, forward_s=forward_s, device_s=device_s,
                  update_over_forward=update_s / forward_s, update_fits_in_forward_backward=update_s <= device_s,
                  device_samples_s=[s for run in plain for s in run["samples_s"]], schedules={})
    if args.device == "cpu":
        result["slept_s"] = statistics.median(run["slept_s"] for run in plain)
    bound = max(device_s, update_s)
    for schedule in SCHEDULES:
        runs = [r[schedule] for r in rounds]
        samples = [s for run in runs for s in run["samples_s"]]
        step_s = statistics.median(samples)
        result["schedules"][schedule] = {
            "step_s": step_s, "bound_s": bound, "step_over_bound": step_s / bound, "update_s": update_s,
            "device_s": device_s, "exact": all(run["exact"] for run in runs),
            "in_step_s": statistics.median(run["in_step_s"] for run in runs), "samples_s": samples}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu (sleeping layers) or cuda (real matmuls)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[1.0, 2.0, 4.0],
                        help="update time over the forward's device time")
    parser.add_argument("--dim", type=int, default=2048, help="each layer's weight is dim x dim")
    parser.add_argument("--slices", type=int, default=8, help="layers, one a slice")
    parser.add_argument("--rows", type=int, default=16,
                        help="batch rows (on cuda: the first probe; the rows are chosen per ratio)")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="fused",
                        help="AdamW's implementation on the host")
    parser.add_argument("--update-sleep-ns", type=float, default=0.0,
                        help="nanoseconds per parameter each slice's update sleeps after AdamW: a slower host")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per schedule and round")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the timed ones")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every schedule per ratio, in rotated order")
    parser.add_argument("--update-repeats", type=int, default=3, help="updates timed alone, per ratio and round")
    parser.add_argument("--threads", type=int, default=None,
                        help="the update's CPU threads (OffloadOptimizer num_threads); default: PyTorch's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="toy sizes, a few seconds: a smoke test")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.quick:
        args.dim, args.slices, args.rows, args.steps, args.warmup, args.rounds, args.update_repeats = \
            128, 4, 8, 2, 2, 1, 2
    if args.warmup < 2:
        parser.error("--warmup must be at least 2: the first backward and step() of update_in_backward only check")
    if args.steps < 1 or args.rounds < 1 or args.update_repeats < 1:
        parser.error("--steps, --rounds and --update-repeats must be at least 1")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but CUDA is not available")

    parameters = args.dim * args.dim * args.slices
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} "
          f"torch threads, update threads: {args.threads or 'PyTorch default'}; device {args.device}; "
          f"{args.slices} slices of {args.dim}x{args.dim} ({parameters / 1e6:.1f} M parameters); "
          f"AdamW {args.optimizer}" + (f", update +{args.update_sleep_ns:g} ns/parameter of sleep"
                                       if args.update_sleep_ns else ""), flush=True)
    timer = UpdateTimer(args)
    count = args.warmup + args.steps + 1
    expected = reference(args, make_inputs(args, args.rows, count))
    results = []
    print(f"{'ratio':>5s} {'update ms':>9s} {'fwd ms':>7s} {'device ms':>9s}  "
          + "  ".join(f"{s + ' ms (/bound)':>25s}" for s in SCHEDULES) + "  exact")
    for ratio in args.ratios:
        result = measure_ratio(args, ratio, timer, expected)
        results.append(result)
        schedules = result["schedules"]
        print(f"{ratio:5g} {result['update_s'] * 1e3:9.1f} {result['forward_s'] * 1e3:7.1f} "
              f"{result['device_s'] * 1e3:9.1f}  "
              + "  ".join(f"{schedules[s]['step_s'] * 1e3:16.1f} ({schedules[s]['step_over_bound']:5.2f})"
                          for s in SCHEDULES)
              + "  " + str(all(schedules[s]["exact"] for s in SCHEDULES)), flush=True)
    met = [r["schedules"]["backward"]["step_over_bound"] <= TARGET_STEP_OVER_BOUND
           for r in results if r["update_fits_in_forward_backward"]]
    print(f"update during backward within {TARGET_STEP_OVER_BOUND} of the bound where the update fits in forward + "
          f"backward: {sum(met)} of {len(met)} ratios")

    if args.json:
        report = {"command": "python " + " ".join(sys.argv), "date": datetime.date.today().isoformat(),
                  "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                              "torch": torch.__version__,
                              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None},
                  "host_threads": torch.get_num_threads(), "update_threads": args.threads,
                  "device": args.device, "optimizer": args.optimizer, "update_sleep_ns": args.update_sleep_ns,
                  "sizes": {"dim": args.dim, "slices": args.slices, "parameters": parameters, "rows": args.rows,
                            "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds},
                  "target_step_over_bound": TARGET_STEP_OVER_BOUND, "ratios": results}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
