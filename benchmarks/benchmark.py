"""Step time of OffloadModel against the physical limit, the resident model and fairscale.

For each preset the same model and input run several ways, interleaved step by step after a
warm-up:

- ``resident``: the plain model on the device, checkpointed with the same segments
  (``checkpoint_sequential``, non-reentrant): the compute time offloading cannot beat.
- ``offload``: ``OffloadModel``.
- ``fairscale``: fairscale's ``OffloadModel`` with the same settings, when it can be imported
  (it is not a dependency; install it for the comparison).

OffloadModel is stepped by OffloadOptimizer (fused AdamW on a host worker, overlapped with the
next forward), the others by ``torch.optim.AdamW(foreach=True)``. Per run it reports the median
step time, its forward and backward, what of OffloadOptimizer's update the step still waited for,
samples/s, bytes moved per step (each direction), the
ideal time ``max(resident step, loaded bytes / host-to-device bandwidth, offloaded bytes /
device-to-host bandwidth)`` with bandwidths measured on this machine, ``efficiency = ideal /
measured``, ``speedup_vs_fairscale``, peak device memory and the memory budget of the design,
term by term (``memory_budget_terms``). ``bound`` counts the host too (``host_bound.py``): ``max(resident
step, link, host bytes per step / host memory bandwidth)``, both measured in this process, with its
``efficiency`` and the earlier ``max(resident step, link, fused AdamW alone)`` as ``old_efficiency``.

The offloaded run's ``peak_device_bytes`` is measured alone: after the timed steps and the
parameter comparison the other models are freed and a few more offloaded steps run. The peak
during the interleaved steps, which counts the resident model's parameters, gradients and AdamW
states too, is kept as ``peak_device_bytes_interleaved``.

A preset can cap device memory (``torch.cuda.set_per_process_memory_fraction``) so a big GPU
stands in for a small one: its resident run is then measured before the cap is set, as the
compute reference, and only the offloaded runs run under the cap.

Without a GPU it runs the ``tiny`` preset on the CPU as a smoke test. The largest model that
trains under a device-memory cap is found by ``benchmarks/bench_max_model.py``, not here.

Usage::

    python benchmarks/benchmark.py                              # every preset (GPU) or the smoke test (CPU)
    python benchmarks/benchmark.py --preset gpt-capped --steps 10
    python benchmarks/benchmark.py --out-dir benchmarks/results  # where JSON and Markdown go
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import gc
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint_sequential

from offload import OffloadModel, OffloadOptimizer
from offload.model import engine_of
from offload.kernels import host_kernel
from offload.planning.host_bytes import host_bytes_per_step
from offload.planning.presets import Preset, build_preset
from offload.streams.host_storage import FLOAT32_LAYERS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_bound import bound, fused_adamw_alone, host_bandwidth  # noqa: E402


#: The host bandwidth probe's copy: a few GB on a GPU's host, less for the CPU smoke test.
HOST_COPY_BYTES = {"cuda": 2 << 30, "cpu": 256 << 20}


@dataclass(frozen=True)
class Case:
    """One benchmark configuration."""

    label: str
    preset: str
    overrides: dict[str, Any]
    batch: int
    num_slices: int
    num_microbatches: int = 1
    memory_cap_bytes: int | None = None  # cap device memory for the offloaded runs
    compute_dtype: torch.dtype | None = None
    note: str = ""


CASES = {
    "tiny": Case("tiny", "tiny", {}, batch=8, num_slices=2, note="CPU smoke test"),
    "mlp": Case("mlp", "mlp", {}, batch=256, num_slices=4),
    "gpt-compute-bound": Case(
        "gpt-compute-bound", "transformer",
        {"n_layers": 12, "d_model": 1024, "n_heads": 16, "seq_len": 1024, "vocab": 32000},
        batch=16, num_slices=6,
        note="per-slice compute exceeds its transfer time",
    ),
    # 24 slices, not 12: on an H100 the whole-batch float32 logits, their log-softmax and
    # gradient take about 1.5 GiB of the 4 GiB, and 12 slices' two slots and gradients did not fit
    # beside them (out of memory at 3.96 GiB allocated). With 24, float32 still needs
    # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: without it, 0.68 GiB of the cap sat in
    # fragments and a 500 MiB logits block found no room (see benchmarks/results/h100-2026-11-22).
    "gpt-capped": Case(
        "gpt-capped", "transformer",
        {"n_layers": 24, "d_model": 2048, "n_heads": 16, "seq_len": 512, "vocab": 32000},
        batch=8, num_slices=24, num_microbatches=2, memory_cap_bytes=4 * 2**30,
        note="about 1.3B parameters (5.4 GB in float32) under a 4 GiB device cap",
    ),
    "gpt-capped-bf16": Case(
        "gpt-capped-bf16", "transformer",
        {"n_layers": 24, "d_model": 2048, "n_heads": 16, "seq_len": 512, "vocab": 32000},
        batch=8, num_slices=24, num_microbatches=2, memory_cap_bytes=4 * 2**30, compute_dtype=torch.bfloat16,
        note="gpt-capped with compute_dtype=bfloat16: half the bytes per load",
    ),
    "gpt-compute-bound-bf16": Case(
        "gpt-compute-bound-bf16", "transformer",
        {"n_layers": 12, "d_model": 1024, "n_heads": 16, "seq_len": 1024, "vocab": 32000},
        batch=16, num_slices=6, compute_dtype=torch.bfloat16,
        note="gpt-compute-bound with compute_dtype=bfloat16",
    ),
}


def in_compute_dtype(model: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """The resident counterpart of ``compute_dtype``: parameters in ``dtype`` except those of
    batch and instance norms, buffers as they are."""
    if dtype is None:
        return model
    for module in model.modules():
        if not isinstance(module, FLOAT32_LAYERS):
            for param in module.parameters(recurse=False):
                if param.is_floating_point():
                    param.data = param.data.to(dtype)
    return model


def cast_input(batch: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return batch
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, batch)


# -- measurements ------------------------------------------------------------------------------


def measure_bandwidth(device: torch.device, nbytes: int = 256 * 2**20, repeats: int = 10) -> dict[str, float]:
    """Pinned host-to-device and device-to-host copy bandwidth in bytes/s (host memcpy on the CPU)."""
    if device.type != "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        src.fill_(1)
        dst.copy_(src)
        start = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src)
        rate = nbytes * repeats / (time.perf_counter() - start)
        return {"host_to_device": rate, "device_to_host": rate, "kind": "host memcpy"}  # type: ignore[dict-item]
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = {}
    for name, (dst, src) in {"host_to_device": (dev, host), "device_to_host": (host, dev)}.items():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        end.record()
        torch.cuda.synchronize()
        rates[name] = nbytes * repeats / (begin.elapsed_time(end) / 1e3)
    return rates | {"kind": "pinned cudaMemcpyAsync"}  # type: ignore[operator]


@dataclass
class Runner:
    """A way of running the model: a step function and what it measured."""

    name: str
    step: Callable[[], None]
    model: nn.Module
    times: list[float] = field(default_factory=list)
    model_times: list[float] = field(default_factory=list)  # forward and backward, optimizer excluded
    peak: int = 0
    traffic: Callable[[], tuple[int, int]] | None = None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(runner: Runner, device: torch.device) -> None:
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    runner.model_times.append(runner.step())
    synchronize(device)
    runner.times.append(time.perf_counter() - start)
    if device.type == "cuda":
        runner.peak = max(runner.peak, torch.cuda.max_memory_allocated(device))


def make_step(model: nn.Module, forward: Callable[[Any], Any], preset: Preset, batch: Any,
              target: Any, device: torch.device) -> Callable[[], float]:
    """A training step that returns the seconds of its forward and backward, without the time the
    training thread waited for the optimizer's update.

    OffloadModel is stepped by OffloadOptimizer (fused AdamW on its host worker, overlapped with
    the next forward); the resident model and fairscale's by ``torch.optim.AdamW(foreach=True)``
    where their parameters live. What of OffloadOptimizer's update the step still waits for (in
    ``step()`` and in the forward's waits for each slice's update) is kept in ``step.exposed``.
    """
    exposed: list[float] = []
    blocked = [0.0]
    if isinstance(model, OffloadModel):
        optimizer: torch.optim.Optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-5, fused=True)
        updates = engine_of(model).updates
        wait = updates.wait

        def timed_wait(index: int) -> None:
            start = time.perf_counter()
            wait(index)
            blocked[0] += time.perf_counter() - start

        updates.wait = timed_wait  # type: ignore[method-assign]
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)

    def step() -> float:
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        preset.loss(forward(batch), target).backward()
        synchronize(device)
        model_time = time.perf_counter() - start - blocked[0]
        begin = time.perf_counter()
        optimizer.step()
        exposed.append(blocked[0] + time.perf_counter() - begin)
        blocked[0] = 0.0
        return model_time

    step.exposed = exposed  # type: ignore[attr-defined]
    step.optimizer = optimizer  # type: ignore[attr-defined]
    return step


def fairscale_class() -> type | None:
    try:
        from fairscale.experimental.nn.offload import OffloadModel as FairscaleOffloadModel
    except Exception:  # ImportError, or fairscale failing to import against this torch
        return None
    return FairscaleOffloadModel


def memory_budget_terms(model: OffloadModel, boundary_bytes: int | None, slice_activation_bytes: int | None,
                        loss_bytes: int | None) -> dict[str, int | None]:
    """The terms of the design's bound on device memory for one step (see docs/memory.md), in bytes.

    ``slots``: two slots (the slice computing, the next one loading); ``gradients``: two slices'
    gradients in float32 (one still being copied out while the next is produced); ``boundaries``:
    six whole-batch boundary activations (a slice's input and output and the next input loading,
    then their gradients in backward); ``slice_activations``: one microbatch's activations through
    the largest slice; ``loss``: the model's output, the loss computed on it and their gradients
    (whole-batch logits for a language model, outside every slice); ``slack``: allocator rounding
    and library workspaces. The terms measured on the device are ``None`` elsewhere.
    """
    engine = engine_of(model)
    largest_params = max(sum(e.tensor.numel() * e.tensor.element_size() for e in s.storage.params)
                         for s in engine.slices)
    return {
        "slots": 2 * engine.slots.slot_nbytes,
        "gradients": 2 * largest_params,
        "boundaries": None if boundary_bytes is None else 6 * boundary_bytes,
        "slice_activations": slice_activation_bytes,
        "loss": loss_bytes,
        "slack": 64 * 2**20,
    }


def slice_footprint(model: OffloadModel, batch: Any, device: torch.device) -> tuple[int | None, int | None]:
    """Bytes of one boundary activation entering the largest slice, and the peak memory of one
    microbatch through that slice, resident, forward and backward (its activations); ``None``
    off a GPU, where device memory is not counted."""
    if device.type != "cuda":
        return None, None
    engine = engine_of(model)
    index = max(range(engine.num_slices), key=lambda i: engine.slices[i].storage.host_nbytes)
    x = batch
    with torch.no_grad():
        for s in engine.slices[:index]:
            for layer in s.layers:
                x = copy.deepcopy(layer).to(device)(x)
    boundary = x.numel() * x.element_size()
    layers = nn.Sequential(*copy.deepcopy(engine.slices[index].layers)).to(device)
    rows = max(1, x.shape[0] // model.num_microbatches)
    x = x[:rows].detach().requires_grad_(x.is_floating_point())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    layers(x).float().sum().backward()
    torch.cuda.synchronize()
    activations = torch.cuda.max_memory_allocated(device) - base
    del layers, x
    gc.collect()
    torch.cuda.empty_cache()
    return boundary, activations


def output_like(model: OffloadModel, batch: Any) -> tuple[torch.Size, torch.dtype]:
    """Shape and dtype of the model's output, from one forward without autograd: it keeps no
    boundary activation and the output is dropped on return, so nothing stays on the device."""
    with torch.no_grad():
        output = model(batch)
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"the model returned a {type(output).__name__}; the benchmark needs a tensor output")
    return output.shape, output.dtype


def loss_footprint(preset: Preset, shape: torch.Size, dtype: torch.dtype, target: Any,
                   device: torch.device) -> int | None:
    """Peak device memory of the preset's loss and its backward on an output of ``shape`` and
    ``dtype``: the output itself, what the loss makes of it (a float32 copy, the log-softmax) and
    the output's gradient. ``None`` off a GPU."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    # Zeros, not random numbers: the loss's footprint does not depend on the values, and drawing
    # them would move the device generator the timed runs use.
    output = torch.zeros(shape, dtype=dtype, device=device, requires_grad=True)
    preset.loss(output, target).backward()
    torch.cuda.synchronize(device)
    footprint = torch.cuda.max_memory_allocated(device) - base
    del output  # and its .grad with it
    torch.cuda.empty_cache()
    return footprint


def measure_alone(runner: Runner, device: torch.device, steps: int = 2) -> tuple[int | None, int | None]:
    """Peak device memory over ``steps`` more steps of ``runner``, and the memory still allocated
    after the last one (its slots, the input batch and target): call it once nothing else of the
    benchmark holds device memory. ``(None, None)`` off a GPU."""
    if device.type != "cuda":
        return None, None
    peak = 0
    for _ in range(steps):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        runner.step()
        torch.cuda.synchronize(device)
        peak = max(peak, torch.cuda.max_memory_allocated(device))
    return peak, torch.cuda.memory_allocated(device)


def run_case(case: Case, args: argparse.Namespace, device: torch.device, bandwidth: dict[str, float]) -> dict:
    torch.manual_seed(0)
    preset = build_preset(case.preset, **case.overrides)
    batch, target = preset.make_batch(case.batch, device)
    param_bytes = sum(p.numel() * p.element_size() for p in preset.model.parameters())
    print(f"\n[{case.label}] {preset.description}; {param_bytes / 2**30:.2f} GiB of parameters, batch {case.batch}"
          + (f"; {case.note}" if case.note else ""), flush=True)
    result: dict[str, Any] = {"case": case.label, "preset": case.preset, "overrides": case.overrides,
                              "batch": case.batch, "num_slices": case.num_slices,
                              "num_microbatches": case.num_microbatches, "parameter_bytes": param_bytes,
                              "note": case.note, "runs": {}}

    offloaded = OffloadModel(copy.deepcopy(preset.model), device=device, num_slices=case.num_slices,
                             num_microbatches=case.num_microbatches, compute_dtype=case.compute_dtype)
    segments = len(offloaded.partition)
    boundary, activations = slice_footprint(offloaded, batch, device)
    # Before the resident model takes its share of the device, so the loss is measured on its own.
    output_shape, output_dtype = output_like(offloaded, batch)
    loss_bytes = loss_footprint(preset, output_shape, output_dtype, target, device)
    result["output_shape"] = list(output_shape)
    result["output_dtype"] = str(output_dtype)
    terms = memory_budget_terms(offloaded, boundary, activations, loss_bytes)
    result["memory_budget_terms"] = terms
    result["memory_budget_bytes"] = None if None in terms.values() else sum(terms.values())  # type: ignore[arg-type]
    result["peak_device_bytes_measured"] = (
        "offload: alone, after the other models were freed (peak_device_bytes_interleaved: during the "
        "interleaved steps, the other models' memory included); resident and fairscale: during the interleaved steps")
    # The host's side of the bound, measured in this process before the steps.
    result["host_bandwidth"] = host_bandwidth(HOST_COPY_BYTES[device.type])
    result["fused_adamw_alone"] = fused_adamw_alone([p.shape for p in preset.model.parameters() if p.requires_grad])
    runners: list[Runner] = []
    offload_runner = Runner("offload", make_step(offloaded, offloaded, preset, batch, target, device), offloaded,
                            traffic=engine_of(offloaded).traffic)

    resident_model = in_compute_dtype(copy.deepcopy(preset.model), case.compute_dtype).to(device)

    def resident_forward(x: Any) -> Any:
        return checkpoint_sequential(resident_model, segments, cast_input(x, case.compute_dtype), use_reentrant=False)

    resident = Runner("resident", make_step(resident_model, resident_forward, preset, batch, target, device), resident_model)
    capped = case.memory_cap_bytes is not None and device.type == "cuda"
    if capped:
        # The resident model would not fit under the cap: measure its compute time first, uncapped.
        for _ in range(args.warmup):
            timed_step(resident, device)
        resident.times.clear()
        resident.model_times.clear()
        resident.peak = 0
        for _ in range(args.steps):
            timed_step(resident, device)
        result["runs"]["resident"] = summarise(resident, case, None)
        result["runs"]["resident"]["measured"] = "before the cap, as the compute reference"
        del resident, resident_model
        gc.collect()
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(case.memory_cap_bytes / total, device)
        result["device_memory_cap_bytes"] = case.memory_cap_bytes
    else:
        runners.append(resident)
    runners.append(offload_runner)

    fairscale = fairscale_class() if device.type == "cuda" and not args.no_fairscale else None
    if case.compute_dtype is not None:
        fairscale = None
        result["fairscale"] = "not measured: fairscale's OffloadModel has no compute dtype"
    elif fairscale is not None:
        fs_model = fairscale(model=copy.deepcopy(preset.model), device=device, offload_device=torch.device("cpu"),
                             num_slices=case.num_slices, checkpoint_activation=True,
                             num_microbatches=case.num_microbatches)
        runners.append(Runner("fairscale", make_step(fs_model, fs_model, preset, batch, target, device), fs_model))
    elif "fairscale" not in result:
        result["fairscale"] = ("GPU only" if device.type != "cuda" else "not measured: --no-fairscale"
                               if args.no_fairscale else "not measured: fairscale is not importable")

    try:
        for _ in range(args.warmup):
            for runner in list(runners):
                try:
                    timed_step(runner, device)
                except Exception as error:  # noqa: BLE001 - a failing comparison must not hide ours
                    if runner.name != "fairscale":
                        raise
                    runners.remove(runner)
                    result["fairscale"] = f"failed: {type(error).__name__}: {error}"
                    print(f"  fairscale {result['fairscale']}", flush=True)
                    del error
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
        for runner in runners:
            runner.times.clear()
            runner.model_times.clear()
            runner.peak = 0
        traffic_before = engine_of(offloaded).traffic()
        rss_before = psutil.Process().memory_info().rss
        for k in range(args.steps):
            for runner in runners[k % len(runners):] + runners[:k % len(runners)]:
                timed_step(runner, device)
        traffic_after = engine_of(offloaded).traffic()
        loaded, offloaded_bytes = (after - before for after, before in zip(traffic_after, traffic_before))
        rss_after = psutil.Process().memory_info().rss
        per_step = (loaded / args.steps, offloaded_bytes / args.steps)
        for runner in runners:
            result["runs"][runner.name] = summarise(runner, case, per_step if runner.name == "offload" else None)
        result["host_rss_growth_bytes_over_timed_steps"] = rss_after - rss_before
    finally:
        if capped:
            torch.cuda.set_per_process_memory_fraction(1.0, device)

    if not capped:
        # The same steps on the same data from the same weights: parameters should agree.
        result["max_parameter_difference_vs_resident"] = max_difference(offloaded, resident_model)
        if "fairscale" in result["runs"]:
            result["max_parameter_difference_fairscale_vs_resident"] = max_difference(
                runners[-1].model, resident_model)
    resident_run = result["runs"]["resident"]
    run = result["runs"]["offload"]
    # The interleaved peak counts the other runs' memory too (the resident model keeps its
    # parameters, gradients and AdamW states on the device between steps): drop every reference
    # to them (runners, closures' optimizers), then measure our steps alone. A capped case's cap
    # is lifted by now: it limits what may be allocated, not what a step allocates.
    runners = [offload_runner]
    resident = resident_model = fs_model = runner = None  # runner: the loops' last, fairscale's when it ran
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    run["peak_device_bytes"], run["device_bytes_between_steps"] = measure_alone(offload_runner, device)
    transfer = max(per_step[0] / bandwidth["host_to_device"], per_step[1] / bandwidth["device_to_host"])
    # The model's part (forward and backward) against its floor, then the whole step, whose
    # optimizer runs on the host for OffloadModel and on the device for the resident model.
    run["ideal_forward_backward_s"] = max(resident_run["median_forward_backward_s"], transfer)
    run["efficiency_forward_backward"] = run["ideal_forward_backward_s"] / run["median_forward_backward_s"]
    run["ideal_s"] = max(resident_run["median_step_s"], transfer)
    run["transfer_s"] = transfer
    run["efficiency"] = run["ideal_s"] / run["median_step_s"]
    # The step's time beyond its forward and backward compute: the optimizer, or what of
    # OffloadOptimizer's overlapped update the step still waited for.
    run["optimizer_in_step_s"] = run["median_step_s"] - run["median_forward_backward_s"]
    run["limited_by"] = "compute" if resident_run["median_forward_backward_s"] >= transfer else "host-device link"
    # The bound with the host counted (host_bound.py); ``efficiency`` above leaves the host out.
    run["bound"] = bound(run["median_step_s"], resident_run["median_step_s"], transfer,
                         host_bytes_of(preset.model, case).with_copies(*per_step),
                         result["host_bandwidth"]["bytes_per_s"], result["fused_adamw_alone"]["median_s"])
    if "fairscale" in result["runs"]:
        run["speedup_vs_fairscale"] = result["runs"]["fairscale"]["median_step_s"] / run["median_step_s"]
        run["speedup_vs_fairscale_forward_backward"] = (
            result["runs"]["fairscale"]["median_forward_backward_s"] / run["median_forward_backward_s"])
    if args.rss_steps and device.type == "cuda":
        result["host_rss_over_steps"] = rss_trace(offload_runner, device, args.rss_steps, case)
    del runners, offload_runner, offloaded
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def host_bytes_of(model: nn.Module, case: Case):  # type: ignore[no-untyped-def]
    """The host bytes one step of ``model`` touches, as OffloadOptimizer's fused AdamW updates it."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.requires_grad:
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    # The shadow in the update's pass where the one-pass kernel ran (Note: [One-pass update]).
    return host_bytes_per_step(counts, compute_dtype=case.compute_dtype, optimizer="adamw",
                               shadow_in_update=host_kernel() is not None)


def max_difference(model: nn.Module, reference: nn.Module) -> float:
    """Largest absolute parameter difference, relative to the largest reference parameter."""
    worst = scale = 0.0
    with torch.no_grad():
        for p, q in zip(model.parameters(), reference.parameters()):
            q = q.float()
            worst = max(worst, (p.to(q.device).float() - q).abs().max().item())
            scale = max(scale, q.abs().max().item())
    return worst / scale if scale else worst


def summarise(runner: Runner, case: Case, per_step: tuple[float, float] | None) -> dict:
    median = statistics.median(runner.times)
    summary = {
        "median_step_s": median,
        "median_forward_backward_s": statistics.median(runner.model_times),
        "samples_per_s": case.batch / median,
        "step_s": runner.times,
        "peak_device_bytes": runner.peak or None,
        "peak_device_bytes_interleaved": runner.peak or None,
    }
    exposed = getattr(runner.step, "exposed", None)
    if isinstance(runner.model, OffloadModel) and exposed:
        # Steps are timed after the warm-up: the last len(times) entries are theirs.
        summary["median_exposed_update_s"] = statistics.median(exposed[-len(runner.times):])
    if per_step is not None:
        summary["loaded_bytes_per_step"] = per_step[0]
        summary["offloaded_bytes_per_step"] = per_step[1]
    return summary


def rss_trace(runner: Runner, device: torch.device, steps: int, case: Case) -> list[int]:
    """Host RSS after every 10th of ``steps`` more steps: flat when pinned memory is allocated once."""
    trace = []
    for k in range(steps):
        runner.step()
        if (k + 1) % 10 == 0:
            synchronize(device)
            trace.append(psutil.Process().memory_info().rss)
    return trace


# -- reporting ---------------------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def table(results: list[dict]) -> str:
    header = ("| case | run | step ms | fwd+bwd ms | exposed update ms | samples/s | loaded MB/step | offloaded MB/step "
              "| ideal fwd+bwd ms | efficiency fwd+bwd | efficiency step | vs fairscale (step) | peak device MiB "
              "| peak interleaved MiB | budget MiB |")
    lines = [header, "|---" * (header.count("|") - 1) + "|"]
    for result in results:
        budget = result.get("memory_budget_bytes")
        for name, run in result["runs"].items():
            def fmt(key: str, scale: float = 1.0, digits: int = 1) -> str:
                value = run.get(key)
                return "" if value is None else f"{value * scale:.{digits}f}"
            lines.append(
                f"| {result['case']} | {name} | {fmt('median_step_s', 1e3)} | {fmt('median_forward_backward_s', 1e3)} "
                f"| {fmt('median_exposed_update_s', 1e3)} | {fmt('samples_per_s')} "
                f"| {fmt('loaded_bytes_per_step', 1e-6)} | {fmt('offloaded_bytes_per_step', 1e-6)} "
                f"| {fmt('ideal_forward_backward_s', 1e3)} | {fmt('efficiency_forward_backward', 1, 2)} "
                f"| {fmt('efficiency', 1, 2)} | {fmt('speedup_vs_fairscale', 1, 2)} "
                f"| {fmt('peak_device_bytes', 2**-20, 0)} | {fmt('peak_device_bytes_interleaved', 2**-20, 0)} "
                f"| {'' if name != 'offload' or budget is None else f'{budget / 2**20:.0f}'} |"
            )
    return "\n".join(lines)


def budget_lines(results: list[dict]) -> str:
    """What each case's memory budget is made of, one line per case."""
    lines = []
    for result in results:
        terms = result.get("memory_budget_terms") or {}
        parts = ", ".join(f"{name} {'not measured' if value is None else f'{value / 2**20:.0f}'}"
                          for name, value in terms.items())
        lines.append(f"- {result['case']}: budget terms (MiB): {parts}")
    return "\n".join(lines)


def resolve_device(name: str) -> torch.device:
    """The device ``--device`` names, with an index on a GPU: the memory cap needs one."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def start_report(args: argparse.Namespace, device: torch.device) -> dict:
    """Measure the link's bandwidth, print it, and return a report holding it with the command,
    the machine and ``args.steps`` / ``args.warmup``; ``results`` and ``failed`` start empty."""
    bandwidth = measure_bandwidth(device)
    print(f"device: {device_name(device)}; host->device {bandwidth['host_to_device'] / 1e9:.1f} GB/s, "
          f"device->host {bandwidth['device_to_host'] / 1e9:.1f} GB/s ({bandwidth['kind']})")
    return {
        "command": "python " + " ".join(sys.argv),
        "date": datetime.date.today().isoformat(),
        "device_name": device_name(device),
        "torch": torch.__version__,
        "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "bandwidth_bytes_per_s": bandwidth,
        "steps": args.steps,
        "warmup": args.warmup,
        "results": [],
        "failed": {},
    }


def report_stem(out_dir: str, report: dict, tag: str) -> str:
    """``<out_dir>/benchmark_<device>_<date><tag>``, the path of a report's JSON and Markdown
    without the extension; creates ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", report["device_name"].lower()).strip("-")
    return os.path.join(out_dir, f"benchmark_{slug}_{report['date']}{tag}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", nargs="+", choices=sorted(CASES), help="cases to run (default: all on a GPU, tiny on the CPU)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run (default 8)")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the timed ones (default 3)")
    parser.add_argument("--rss-steps", type=int, default=0, help="extra offload steps to trace host RSS (GPU)")
    parser.add_argument("--no-fairscale", action="store_true")
    parser.add_argument("--slices", type=int, help="override every case's num_slices")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = resolve_device(args.device)
    names = args.preset or (list(CASES) if device.type == "cuda" else ["tiny"])
    cases = {name: CASES[name] if args.slices is None else dataclasses.replace(CASES[name], num_slices=args.slices)
             for name in names}
    if device.type != "cuda":
        args.steps = min(args.steps, 3)
        args.warmup = min(args.warmup, 1)

    report = start_report(args, device)
    tag = ("" if args.preset is None else "_" + "_".join(names)) + ("" if args.slices is None else f"_{args.slices}slices")
    stem = report_stem(args.out_dir, report, tag)
    for name in names:
        # One case failing (out of memory on a smaller card, say) must not lose the others' figures.
        try:
            report["results"].append(run_case(cases[name], args, device, report["bandwidth_bytes_per_s"]))
        except Exception as error:  # noqa: BLE001 - recorded and reported below
            report["failed"][name] = f"{type(error).__name__}: {error}"
            print(f"\n[{name}] failed: {report['failed'][name]}", file=sys.stderr)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        write_report(report, stem)
    print("\n" + table(report["results"]))
    print(f"\nwrote {stem}.json and {stem}.md")
    if report["failed"]:
        sys.exit(1)


def write_report(report: dict, stem: str, extra: str = "") -> None:
    """Write ``report`` to ``stem``.json and, readable, to ``stem``.md: the machine, the table of
    ``results``, then ``extra`` (another script's section) and the failures."""
    bandwidth = report["bandwidth_bytes_per_s"]
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    with open(stem + ".md", "w") as f:
        f.write(f"# Benchmark on {report['device_name']}, {report['date']}\n\n")
        f.write(f"Command: `{report['command']}`\n\n")
        f.write(f"Bandwidth: host->device {bandwidth['host_to_device'] / 1e9:.1f} GB/s, "
                f"device->host {bandwidth['device_to_host'] / 1e9:.1f} GB/s ({bandwidth['kind']}).\n\n")
        if report["results"]:
            f.write(table(report["results"]) + "\n\n")
            f.write("Peak device MiB: the offloaded run's measured alone, after the other models were freed; "
                    "the resident and fairscale runs' during the interleaved steps.\n\n")
            f.write(budget_lines(report["results"]) + "\n")
        if extra:
            f.write("\n" + extra + "\n")
        for name, error in report["failed"].items():
            f.write(f"\n{name} failed: {error}\n")


if __name__ == "__main__":
    main()
