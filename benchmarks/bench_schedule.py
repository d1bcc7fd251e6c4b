"""When the host update runs: during backward, during the next forward, or after the step; and
what keeping the first slices on the device (``resident_slices``) adds to either.

``OffloadOptimizer`` steps the host copies on a worker thread. The schedules, each measured as
the time of one training step (forward start to the next forward's start, median after warm-up):

- ``next-forward`` (``update_in_backward=False``, the default): ``step()`` starts the update and
  returns; it hides behind the next forward only (Note: [Overlapped host update] in
  ``offload/optimizer.py``).
- ``backward`` (``update_in_backward=True``): backward starts each slice's update as soon as its
  gradients are on the host, so it hides behind backward too (Note: [Update in backward] in
  ``offload/optimizing/in_backward.py``).
- ``serial`` (``step()`` then ``synchronize()``): nothing overlaps; the reference.
- ``next-forward+residentK`` and ``backward+residentK``: the first two on
  ``OffloadModel(..., resident_slices=K)`` (``--resident``; default 1 and a quarter of the slices):
  the first ``K`` slices stay on the device and ``step()`` updates them there, the host worker only
  the others (Note: [Resident slices] in ``offload/streams/resident_storage.py``). They are the
  slices the next forward needs first, whose host update it would otherwise wait for.

Each is compared with the bound ``max(device time of the step, update time)``: a step cannot take
less than the device's work (forward, recompute, backward), nor less than the update. The device
time of a step is measured: the same step without an optimizer. With ``K`` resident slices the
device's work includes their update, and the host's covers the other slices only: the bound is
``max(step without an optimizer with K resident + the resident update, the update of the streamed
slices)``, each term measured on its own (``resident_update_s``: ``step()`` with only the resident
slices' gradients present; ``update_s``: ``step()`` then ``synchronize()`` with only the others').

On ``--device cpu`` the device is simulated as in ``benchmarks/bench_optimizer.py``: each layer
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

What the CPU stand-in makes of resident slices (``resident_stand_in`` in the JSON): their update
"on the device" is a real AdamW on the CPU, run by the training thread in ``step()``, which is
what the stand-in's device is (it sleeps for the device's kernels and does the walk's own work);
it takes no ``--update-sleep-ns`` sleep (that models a slow *host*: ``SlowHostAdamW`` sleeps only
off the training thread). So the resident update costs what this CPU's AdamW costs per parameter,
far more, relative to the host's, than a GPU's update would, and it competes with the host worker
for the two cores; and the resident slices' loads stay copies in memory like the others' (on a
GPU they skip the link). The stand-in therefore understates what resident slices gain on a GPU.

``exact``: the parameters after every step of a schedule are bit-identical to a plain
``torch.optim.AdamW`` stepping host copies of the same layers, with the gradients of the unwrapped
model on the same device and the same inputs; for ``K`` resident slices, the first ``K`` layers'
parameters are stepped on the device by a second such AdamW, as ``OffloadOptimizer`` steps them
(on the CPU both are the same computation). Measured after the timed steps of every run.

The machine this was written on has 2 shared cores: ``--threads 1`` gives the update one thread
(``OffloadOptimizer(num_threads=1)``), leaving the other to the training thread.

Usage::

    python benchmarks/bench_schedule.py --update-sleep-ns 5 --threads 1 --json benchmarks/results/schedule_cpu.json
    python benchmarks/bench_schedule.py --quick --json /tmp/schedule.json     # toy sizes, seconds
    python benchmarks/bench_schedule.py --resident 2 --ratios 2 --json /tmp/r2.json  # one resident count, one ratio
    python benchmarks/bench_schedule.py --device cuda --dim 4096 --rows 512 --threads 8 --json schedule_cuda.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import offload  # noqa: E402
from offload import OffloadModel, OffloadOptimizer
from offload.model import engine_of
from offload.planning.host_bytes import host_bytes_per_step

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_bound import bound as host_counted_bound, fused_adamw_alone, host_bandwidth  # noqa: E402
from json_output import check_json_path  # benchmarks/json_output.py, next to this file

TARGET_STEP_OVER_BOUND = 1.15  # for the update during backward, where the update fits in forward + backward
TARGET_CLIPPED = 1.10  # for the update behind the next forward with clipping on, where the update fits in the forward
LR = 1e-3
# AdamW's implementations on the host: the fused one is about as fast per parameter as the CPU
# walk's own copies, the other two several times slower (docs/optimizer.md).
OPTIMIZERS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "per-tensor": {"foreach": False}}
RESIDENT_STAND_IN = {
    "cpu": "the resident slices' update on the device is a real AdamW on the CPU, run by the training thread "
           "(the stand-in's device) in step(), without the --update-sleep-ns sleep of the host's update; their "
           "loads are copies in memory like the streamed slices'",
    "cuda": "the resident slices' update runs on the GPU, queued on the compute stream by step(); their loads "
            "are device-to-device copies"}


@dataclass(frozen=True)
class Schedule:
    """One way of running the steps: which update schedule, on how many resident slices.

    Attributes:
        name: as in the JSON, e.g. ``backward+resident2``.
        stepped: whether an optimizer runs at all (``False``: forward and backward only, the step's
            device time).
        in_backward: ``OffloadOptimizer(update_in_backward=True)``.
        serial: ``synchronize()`` after each ``step()``.
        resident: ``OffloadModel(resident_slices=...)``.
    """

    name: str
    stepped: bool = True
    in_backward: bool = False
    serial: bool = False
    resident: int = 0


def schedules_for(residents: list[int]) -> list[Schedule]:
    """The schedules timed per ratio: the three on streamed slices only, then the default and the
    in-backward schedule with each count of resident slices."""
    schedules = [Schedule("next-forward"), Schedule("backward", in_backward=True), Schedule("serial", serial=True)]
    for k in residents:
        schedules += [Schedule(f"next-forward+resident{k}", resident=k),
                      Schedule(f"backward+resident{k}", in_backward=True, resident=k)]
    return schedules


def no_optimizer(resident: int) -> Schedule:
    """Forward and backward alone: the device time of a step with ``resident`` resident slices."""
    return Schedule("no-optimizer" + (f"+resident{resident}" if resident else ""), stepped=False, resident=resident)


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


def build_model(args: argparse.Namespace, seconds: float, clock: DeviceClock, resident: int) -> OffloadModel:
    return OffloadModel(build_layers(args, seconds, clock), device=args.device, num_slices=args.slices,
                        resident_slices=resident)


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
    parameter it stepped, when it runs on the host worker: a host whose update is slower, relative
    to the device, than this one's, without taking CPU or memory bandwidth from the training thread.
    On ``device_thread`` (the training thread: the stand-in's device, where ``step()`` updates the
    resident slices) it does not sleep: the device is not the slow host. The parameters are AdamW's."""

    ns_per_parameter = 0.0
    device_thread: int | None = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        if threading.get_ident() != self.device_thread:
            stepped = sum(p.numel() for group in self.param_groups for p in group["params"] if p.grad is not None)
            time.sleep(self.ns_per_parameter * stepped * 1e-9)
        return loss


def optimizer_class(args: argparse.Namespace) -> type[torch.optim.Optimizer]:
    if not args.update_sleep_ns:
        return torch.optim.AdamW
    return type("SlowHostAdamW", (SlowHostAdamW,), {"ns_per_parameter": args.update_sleep_ns,
                                                    "device_thread": threading.get_ident()})


def new_optimizer(args: argparse.Namespace, model: OffloadModel, schedule: Schedule) -> OffloadOptimizer:
    # --clip-with offload: the norms from backward and the scaling in the update (Notes: [Norms
    # from backward], [Scaling in the update]), as offload-finetune and offload plan clip.
    ahead = bool(args.clip) and args.clip_with == "offload" and not schedule.in_backward
    return OffloadOptimizer(model, optimizer_class(args), lr=LR, num_threads=args.threads,
                            update_in_backward=schedule.in_backward, norms_in_backward=ahead, scale_in_update=ahead,
                            **OPTIMIZERS[args.optimizer])


def clip(args: argparse.Namespace, parameters: Any) -> None:
    """The clip of ``--clip-with``: PyTorch's (one thread a norm, the scaling here), or offload's."""
    if args.clip_with == "offload":
        offload.clip_grad_norm_(parameters, args.clip)
    else:
        torch.nn.utils.clip_grad_norm_(parameters, args.clip)


class UpdateTimer:
    """The update alone, on a model of the benchmark's size with ``resident`` resident slices that
    does no device work, kept for measuring again before each ratio (the machine's load drifts).

    With resident slices, each part is timed on its own, the other part's gradients set aside:
    the host update of the streamed slices (``step()`` then ``synchronize()``) and the resident
    slices' update on the device (``step()``, then the device's queue drained)."""

    def __init__(self, args: argparse.Namespace, resident: int) -> None:
        self.device = args.device
        self.args = args
        self.clip = args.clip
        self.model = build_model(args, 0.0, DeviceClock(), resident)
        self.optimizer = new_optimizer(args, self.model, Schedule("serial", serial=True))
        loss_of(self.model(make_inputs(args, 4, 1)[0])).backward()
        engine = engine_of(self.model)
        held = [(s.storage.resident, e.tensor) for s in engine.slices for e in s.storage.held if e.is_parameter]
        self.streamed = [p for on_device, p in held if not on_device]
        self.resident = [p for on_device, p in held if on_device]
        self.measure(1)  # the first step allocates the optimizer state

    def _timed(self, params: list[torch.Tensor]) -> float:
        """One update of ``params`` alone: the others' gradients set aside for it."""
        others = [p for p in (*self.streamed, *self.resident) if all(p is not q for q in params)]
        grads = [p.grad for p in others]
        for p in others:
            p.grad = None
        try:
            sync(self.device)
            start = time.perf_counter()
            self.optimizer.step()
            self.optimizer.synchronize()
            sync(self.device)
            return time.perf_counter() - start
        finally:
            for p, grad in zip(others, grads):
                p.grad = grad

    def measure(self, repeats: int) -> dict[str, list[float]]:
        """``repeats`` samples of the host update (``update_s``) and, with resident slices, of theirs
        (``resident_update_s``)."""
        samples: dict[str, list[float]] = {"update_s": [], "resident_update_s": [], "clip_s": []}
        for _ in range(repeats):
            samples["update_s"].append(self._timed(self.streamed))
            if self.resident:
                samples["resident_update_s"].append(self._timed(self.resident))
            if self.clip:
                sync(self.device)
                start = time.perf_counter()
                clip(self.args, [*self.resident, *self.streamed])
                self.optimizer.synchronize()  # offload's: its scaling, handed to the update worker
                sync(self.device)
                samples["clip_s"].append(time.perf_counter() - start)
        return samples


def run_schedule(args: argparse.Namespace, schedule: Schedule, seconds: float,
                 inputs: list[torch.Tensor]) -> dict[str, Any]:
    """Train on ``inputs`` with ``schedule``; step times from each step's forward to the next
    one's, after the warm-up, leaving out the last step (nothing follows it to hide its update
    behind)."""
    clock = DeviceClock()
    model = build_model(args, seconds, clock, schedule.resident)
    optimizer = new_optimizer(args, model, schedule) if schedule.stepped else None
    starts, forwards, slept, in_step = [], [], [], []
    traffic = []  # the copy engine's loaded and offloaded bytes before each step
    for x in inputs:
        traffic.append(engine_of(model).traffic())
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
            if args.clip:  # what HF Trainer does by default (max_grad_norm=1.0): before the update can start
                clip(args, model.parameters())
            optimizer.step()
            if schedule.serial:
                optimizer.synchronize()
            optimizer.zero_grad()
        in_step.append(time.perf_counter() - stepped)
        starts.append(start)
        slept.append(clock.seconds)
    if optimizer is not None:
        optimizer.synchronize()
    parameters = [p.detach().to("cpu", copy=True) for p in model.parameters()]
    if optimizer is not None:
        optimizer.close()
    # The model and optimizer hold reference cycles: freed now, not at the next collection, so
    # that runs do not pile their host copies and optimizer state up.
    del model, optimizer
    gc.collect()
    timed = slice(args.warmup, len(inputs) - 1)
    steps = [b - a for a, b in zip(starts, starts[1:])][timed]
    count = len(inputs) - 1 - args.warmup
    loaded, offloaded = ((b - a) / count for a, b in zip(traffic[args.warmup], traffic[-1]))
    return {"step_s": statistics.median(steps), "loaded_bytes_per_step": loaded, "offloaded_bytes_per_step": offloaded, "forward_s": statistics.median(forwards[timed]),
            "forwards_s": forwards[timed],
            "slept_s": statistics.median(slept[timed]), "in_step_s": statistics.median(in_step[timed]),
            "samples_s": steps, "parameters": parameters}


def reference(args: argparse.Namespace, inputs: list[torch.Tensor], resident: int = 0) -> list[torch.Tensor]:
    """The parameters after a plain AdamW steps host copies of the unwrapped layers, one step per
    input, with the gradients the layers compute on the device; the first ``resident`` layers'
    parameters stepped where they are, on the device, by a second AdamW of the same settings."""
    model = build_layers(args, 0.0, DeviceClock())
    host = [p.detach().clone().requires_grad_() for p in model.parameters()]
    model.to(args.device)
    device_params = list(model.parameters())
    on_device = list(model[:resident].parameters())
    streamed = [(h, p) for h, p in zip(host, device_params) if all(p is not q for q in on_device)]
    optimizers = [torch.optim.AdamW([h for h, _ in streamed], lr=LR, **OPTIMIZERS[args.optimizer])]
    if on_device:
        optimizers.append(torch.optim.AdamW(on_device, lr=LR, **OPTIMIZERS[args.optimizer]))
    for x in inputs:
        loss_of(model(x)).backward()
        for h, p in streamed:
            h.grad = p.grad.to("cpu", copy=True)
            p.grad = None
        if args.clip:  # over the parameters in the model's order: the same norm, bit for bit
            torch.nn.utils.clip_grad_norm_(on_device + [h for h, _ in streamed], args.clip)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():
            for h, p in streamed:
                p.copy_(h)
    return [p.detach().to("cpu", copy=True) for p in model[:resident].parameters()] + [h.detach() for h, _ in streamed]


def rows_for(args: argparse.Namespace, forward_s: float) -> tuple[int, list[dict[str, float]]]:
    """On a GPU: the batch rows whose forward takes ``forward_s``. The forward's loads are a cost
    that does not grow with the rows and may hide the matmuls' until they outgrow it, so it is not a
    line: two probes, then secant steps from the last two, and the probe nearest the target."""
    probes: list[dict[str, float]] = []

    def probe(rows: int) -> None:
        run = run_schedule(args, no_optimizer(0), 0.0, make_inputs(args, rows, args.warmup + 3))
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
              expected: dict[int, list[torch.Tensor]]) -> dict[str, dict[str, Any]]:
    """Each schedule once, and the steps without an optimizer, in an order rotated by ``round_``
    so that no schedule always runs first (the machine's load drifts). ``expected``: the reference
    parameters per count of resident slices."""
    order = [no_optimizer(k) for k in sorted(expected)] + args.schedules
    order = order[round_ % len(order):] + order[:round_ % len(order)]
    runs = {}
    for schedule in order:
        run = run_schedule(args, schedule, seconds, inputs)
        parameters = run.pop("parameters")
        if schedule.stepped:
            run["exact"] = all(torch.equal(a, b) for a, b in zip(parameters, expected[schedule.resident], strict=True))
        runs[schedule.name] = run
    return runs


def sleep_for(args: argparse.Namespace, forward_s: float) -> tuple[float, list[dict[str, float]]]:
    """On the CPU: the sleep per slice forward that makes the forward take ``forward_s``, the walk's
    own work included: from the walk alone, then corrected twice by what the forward took (the
    machine's load moves the walk's share)."""
    seconds, probes = 0.0, []
    for _ in range(3):
        forwards = run_schedule(args, no_optimizer(0), seconds,
                                make_inputs(args, args.rows, args.warmup + 4))["forwards_s"]
        # The fastest forward: the walk's work is the same every step, the machine's load only adds.
        probes.append({"sleep_per_slice_forward_s": seconds, "forward_s": min(forwards)})
        seconds = max(0.0, seconds + (forward_s - min(forwards)) / args.slices)
    return seconds, probes


def measure_updates(timers: dict[int, UpdateTimer], repeats: int, into: dict[int, dict[str, list[float]]]) -> None:
    for k, timer in timers.items():
        for key, values in timer.measure(repeats).items():
            into.setdefault(k, {}).setdefault(key, []).extend(values)


def references(args: argparse.Namespace, inputs: list[torch.Tensor]) -> dict[int, list[torch.Tensor]]:
    return {k: reference(args, inputs, k) for k in [0, *args.resident]}


def measure_ratio(args: argparse.Namespace, ratio: float, timers: dict[int, UpdateTimer],
                  expected: dict[int, list[torch.Tensor]]) -> dict[str, Any]:
    """The schedules where the (whole, host) update takes ``ratio`` times the forward's device time."""
    updates: dict[int, dict[str, list[float]]] = {}
    measure_updates(timers, args.update_repeats, updates)
    update_s = statistics.median(updates[0]["update_s"])
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
        expected = references(args, inputs)
    rounds = []
    for round_ in range(args.rounds):
        if round_ > 0:
            measure_updates(timers, args.update_repeats, updates)
        rounds.append(run_round(args, round_, seconds, inputs, expected))

    def device_samples(k: int) -> list[float]:
        # The device's time of a step: the step without an optimizer (on the CPU: the sleeps and
        # the walk's own work, which the training thread does).
        return [s for r in rounds for s in r[no_optimizer(k).name]["samples_s"]]

    update_s = statistics.median(updates[0]["update_s"])
    plain = [r[no_optimizer(0).name] for r in rounds]
    device_s = statistics.median(device_samples(0))
    forward_s = statistics.median(run["forward_s"] for run in plain)
    result.update(update_s=update_s, update_samples_s=updates[0]["update_s"], forward_s=forward_s, device_s=device_s,
                  update_over_forward=update_s / forward_s, update_fits_in_forward_backward=update_s <= device_s,
                  device_samples_s=device_samples(0), schedules={}, resident={})
    if args.device == "cpu":
        result["slept_s"] = statistics.median(run["slept_s"] for run in plain)
    # Per count of resident slices: the device's work (the step without an optimizer, then their
    # update on the device) and the host's (the update of the other slices).
    terms = {0: {"update_s": update_s, "device_s": device_s}}
    for k in args.resident:
        without = statistics.median(device_samples(k))
        on_device = statistics.median(updates[k]["resident_update_s"])
        terms[k] = {"update_s": statistics.median(updates[k]["update_s"]), "device_s": without + on_device,
                    "device_without_update_s": without, "resident_update_s": on_device}
        result["resident"][str(k)] = {**terms[k], "update_samples_s": updates[k]["update_s"],
                                      "resident_update_samples_s": updates[k]["resident_update_s"],
                                      "device_without_update_samples_s": device_samples(k)}
    for schedule in args.schedules:
        runs = [r[schedule.name] for r in rounds]
        samples = [s for run in runs for s in run["samples_s"]]
        step_s = statistics.median(samples)
        term = terms[schedule.resident]
        # PyTorch's clip reads every gradient and scales it on the training thread, after backward
        # and before step() can start the update: nothing overlaps it. Offload's computes the norms
        # in backward and scales in the update: the host's share of the bound grows by it instead.
        clip_s = statistics.median(updates[schedule.resident]["clip_s"]) if args.clip else 0.0
        bound = (max(term["device_s"], term["update_s"] + clip_s) if args.clip_with == "offload"
                 else max(term["device_s"], term["update_s"]) + clip_s)
        counted = host_bound_of(args, runs, schedule, step_s, term["device_s"])
        result["schedules"][schedule.name] = {
            "step_s": step_s, "bound_s": bound, "step_over_bound": step_s / bound, **term, "clip_s": clip_s,
            "host_counted": counted, "step_over_host_counted_bound": step_s / counted["bound_s"],
            "resident_slices": schedule.resident, "update_in_backward": schedule.in_backward,
            "exact": all(run["exact"] for run in runs),
            "in_step_s": statistics.median(run["in_step_s"] for run in runs), "samples_s": samples}
    return result


def host_bound_of(args: argparse.Namespace, runs: list[dict[str, Any]], schedule: Schedule, step_s: float,
                  device_s: float) -> dict[str, Any]:
    """The bound with the host counted (``host_bound.py``): the device's work, or the host bytes of a
    step over the host's measured memory bandwidth plus the slow host's sleep, whichever is longer.

    The host bytes are the library's count for the streamed slices (float32 AdamW, no shadow) with
    the copy engine's bytes: on a CPU "device" a load or an offload is a copy in RAM, each byte read
    and written (twice the engine's count); on a GPU the link's DMA touches host memory once. The
    ``--update-sleep-ns`` sleep stands for host work a slower host would do: it adds to the host's term."""
    streamed = args.dim * args.dim * (args.slices - schedule.resident)
    copies = 2 if args.device == "cpu" else 1
    host = host_bytes_per_step(streamed, optimizer="adamw").with_copies(
        copies * statistics.median(r["loaded_bytes_per_step"] for r in runs),
        copies * statistics.median(r["offloaded_bytes_per_step"] for r in runs))
    # Clipping reads every float32 gradient twice (its norm, then the scaling) and writes it once,
    # serially between backward and the update (the resident slices' are the device's on a GPU).
    clip_bytes = 12 * args.dim * args.dim * args.slices if args.clip else 0
    sleep_s = args.update_sleep_ns * 1e-9 * streamed
    alone = args.fused_adamw_alone["median_s"] * (args.slices - schedule.resident) / args.slices
    counted = host_counted_bound(step_s, device_s, 0.0, host, args.host_bandwidth["bytes_per_s"], alone + sleep_s)
    clip_s = clip_bytes / args.host_bandwidth["bytes_per_s"]
    counted["bound_terms"]["host_bytes_s"] += sleep_s + clip_s
    if args.clip_with == "torch":  # serial between backward and step(); offload's overlaps the device
        counted["bound_terms"]["resident_step_s"] += clip_s
    counted["bound_terms"]["update_sleep_s"] = sleep_s
    counted["bound_terms"]["clip_bytes_s"] = clip_s
    counted["bound_s"] = max(counted["bound_terms"][k] for k in ("resident_step_s", "link_s", "host_bytes_s"))
    counted["efficiency"] = counted["bound_s"] / step_s
    return counted


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu (sleeping layers) or cuda (real matmuls)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[1.0, 2.0, 4.0],
                        help="update time over the forward's device time")
    parser.add_argument("--dim", type=int, default=2048, help="each layer's weight is dim x dim")
    parser.add_argument("--slices", type=int, default=8, help="layers, one a slice")
    parser.add_argument("--rows", type=int, default=16,
                        help="batch rows (on cuda: the first probe; the rows are chosen per ratio)")
    parser.add_argument("--resident", type=int, nargs="*", default=None,
                        help="counts of resident slices, each timed with the default and the in-backward "
                             "schedule (default: 1 and a quarter of the slices; none: the flag alone)")
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
    parser.add_argument("--host-copy-mib", type=int, default=1024,
                        help="the host memory bandwidth probe's copy, per buffer (--quick: 64)")
    parser.add_argument("--clip", type=float, default=None, metavar="NORM",
                        help="clip the gradients' total norm to NORM before each step (HF Trainer's default is 1.0); "
                             "the in-backward schedules, which refuse clipping, are left out")
    parser.add_argument("--clip-with", choices=("torch", "offload"), default="torch",
                        help="torch: torch.nn.utils.clip_grad_norm_, as the Trainer clips by default; offload: "
                             "offload.clip_grad_norm_ with the norms computed in backward and the scaling in the update")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="toy sizes, a few seconds: a smoke test")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    check_json_path(parser, args.json)
    if args.quick:
        args.dim, args.slices, args.rows, args.steps, args.warmup, args.rounds, args.update_repeats = \
            128, 4, 8, 2, 2, 1, 2
        args.host_copy_mib = 64
        # Toy sizes: each run's gc.collect() would spend most of its time walking the objects the
        # imports made (torch's), which it never frees; set aside, it walks the runs' own.
        gc.freeze()
    if args.warmup < 2:
        parser.error("--warmup must be at least 2: the first backward and step() of update_in_backward only check")
    if args.steps < 1 or args.rounds < 1 or args.update_repeats < 1:
        parser.error("--steps, --rounds and --update-repeats must be at least 1")
    if args.resident is None:
        args.resident = [1, max(1, args.slices // 4)]
    args.resident = sorted(set(args.resident))
    if any(not 1 <= k < args.slices for k in args.resident):
        parser.error(f"--resident: each count must be at least 1 and below --slices ({args.slices}), so that some "
                     f"slices stream; got {args.resident}")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but CUDA is not available")
    args.schedules = [s for s in schedules_for(args.resident) if not (args.clip and s.in_backward)]
    return args


def print_ratio(result: dict[str, Any]) -> None:
    print(f"ratio {result['ratio']:g} (reached {result['update_over_forward']:.2f}): update {result['update_s'] * 1e3:.1f} "
          f"ms, forward {result['forward_s'] * 1e3:.1f} ms, device {result['device_s'] * 1e3:.1f} ms")
    for name, s in result["schedules"].items():
        print(f"  {name:24s} {s['step_s'] * 1e3:8.1f} ms / bound {s['bound_s'] * 1e3:8.1f} ms = "
              f"{s['step_over_bound']:5.2f}, host counted {s['host_counted']['bound_s'] * 1e3:8.1f} ms = "
              f"{s['step_over_host_counted_bound']:5.2f}   (device {s['device_s'] * 1e3:7.1f}, host update {s['update_s'] * 1e3:7.1f}"
              + (f", of which resident update {s['resident_update_s'] * 1e3:.1f} on the device" if s["resident_slices"]
                 else "") + f")  exact: {s['exact']}", flush=True)


def write_report(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    report = {"command": "python " + " ".join(sys.argv), "date": datetime.date.today().isoformat(),
              "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                          "torch": torch.__version__,
                          "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None},
              "host_threads": torch.get_num_threads(), "update_threads": args.threads, "clip": args.clip, "clip_with": args.clip_with,
              "device": args.device, "optimizer": args.optimizer, "update_sleep_ns": args.update_sleep_ns,
              "sizes": {"dim": args.dim, "slices": args.slices, "parameters": args.dim * args.dim * args.slices,
                        "rows": args.rows, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds},
              "resident_slices": args.resident, "schedules": [s.name for s in args.schedules],
              "resident_stand_in": RESIDENT_STAND_IN[torch.device(args.device).type],
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
              "host_bandwidth": args.host_bandwidth, "fused_adamw_alone": args.fused_adamw_alone,
              "target_step_over_bound": TARGET_STEP_OVER_BOUND, "ratios": results}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


def main() -> None:
    args = parse_args()
    parameters = args.dim * args.dim * args.slices
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} "
          f"torch threads, update threads: {args.threads or 'PyTorch default'}; device {args.device}; "
          f"{args.slices} slices of {args.dim}x{args.dim} ({parameters / 1e6:.1f} M parameters); "
          f"AdamW {args.optimizer}" + (f", update +{args.update_sleep_ns:g} ns/parameter of sleep"
                                       if args.update_sleep_ns else "")
          + f"; resident slices {args.resident}", flush=True)
    # The host's side of the bound, measured with the update worker's threads before the steps.
    args.host_bandwidth = host_bandwidth(args.host_copy_mib << 20, num_threads=args.threads)
    args.fused_adamw_alone = fused_adamw_alone([torch.Size([args.dim, args.dim])] * args.slices)
    print(f"host memory {args.host_bandwidth['bytes_per_s'] / 1e9:.1f} GB/s read plus written; fused AdamW alone "
          f"{args.fused_adamw_alone['median_s'] * 1e3:.1f} ms", flush=True)
    timers = {k: UpdateTimer(args, k) for k in [0, *args.resident]}
    count = args.warmup + args.steps + 1
    expected = references(args, make_inputs(args, args.rows, count))
    results = []
    for ratio in args.ratios:
        result = measure_ratio(args, ratio, timers, expected)
        results.append(result)
        print_ratio(result)
        if args.json:  # after each ratio: a run stopped by a time limit keeps the ratios it finished
            write_report(args, results)
    if args.clip:
        met = [r["schedules"]["next-forward"]["step_over_bound"] <= TARGET_CLIPPED
               for r in results if r["update_s"] <= r["forward_s"]]
        print(f"clipped, update behind the next forward within {TARGET_CLIPPED} of the bound where the "
              f"update fits in the forward: {sum(met)} of {len(met)} ratios")
    else:
        met = [r["schedules"]["backward"]["step_over_bound"] <= TARGET_STEP_OVER_BOUND
               for r in results if r["update_fits_in_forward_backward"]]
        print(f"update during backward within {TARGET_STEP_OVER_BOUND} of the bound where the update fits in "
              f"forward + backward: {sum(met)} of {len(met)} ratios")
    if args.json:
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
