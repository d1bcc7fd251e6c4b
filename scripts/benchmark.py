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
term by term (``memory_budget_terms``).

The offloaded run's ``peak_device_bytes`` is measured alone: after the timed steps and the
parameter comparison the other models are freed and a few more offloaded steps run. The peak
during the interleaved steps, which counts the resident model's parameters, gradients and AdamW
states too, is kept as ``peak_device_bytes_interleaved``.

A preset can cap device memory (``torch.cuda.set_per_process_memory_fraction``) so a big GPU
stands in for a small one: its resident run is then measured before the cap is set, as the
compute reference, and only the offloaded runs run under the cap.

``--max-model`` looks for the largest model that trains under a device-memory cap
(``--cap-gib``): it grows a transformer block by block until a step runs out of device memory or
the next size would not fit in host memory, and records each size's peak device memory, step time
and parameter bytes per byte of the cap.

Without a GPU it runs the ``tiny`` preset on the CPU as a smoke test (``--max-model``: a few tiny
sizes, with no cap).

Usage::

    python scripts/benchmark.py                              # every preset (GPU) or the smoke test (CPU)
    python scripts/benchmark.py --preset gpt-capped --steps 10
    python scripts/benchmark.py --out-dir benchmarks/results  # where JSON and Markdown go
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        python scripts/benchmark.py --max-model --cap-gib 2 --compute-dtype bf16
"""

from __future__ import annotations

import argparse
import contextlib
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
from offload.presets import Preset, build_preset
from offload.streams.host_storage import FLOAT32_LAYERS


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
        updates = model._engine.updates
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
    """The terms of the design's bound on device memory for one step (see README, Memory), in bytes.

    ``slots``: two slots (the slice computing, the next one loading); ``gradients``: two slices'
    gradients in float32 (one still being copied out while the next is produced); ``boundaries``:
    six whole-batch boundary activations (a slice's input and output and the next input loading,
    then their gradients in backward); ``slice_activations``: one microbatch's activations through
    the largest slice; ``loss``: the model's output, the loss computed on it and their gradients
    (whole-batch logits for a language model, outside every slice); ``slack``: allocator rounding
    and library workspaces. The terms measured on the device are ``None`` elsewhere.
    """
    engine = model._engine
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
    engine = model._engine
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
    runners: list[Runner] = []
    offload_runner = Runner("offload", make_step(offloaded, offloaded, preset, batch, target, device), offloaded,
                            traffic=offloaded._engine.traffic)

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
        traffic_before = offloaded._engine.traffic()
        rss_before = psutil.Process().memory_info().rss
        for k in range(args.steps):
            for runner in runners[k % len(runners):] + runners[:k % len(runners)]:
                timed_step(runner, device)
        loaded, offloaded_bytes = (after - before for after, before in zip(offloaded._engine.traffic(), traffic_before))
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
    resident = resident_model = fs_model = None
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


# -- the largest model under a device-memory cap -----------------------------------------------

#: The issue's goal: parameter bytes at least this many times the device memory they train in.
MAX_MODEL_GOAL_RATIO = 10.0

# The search grows the depth at a fixed width. Every block is one slice of the same size, so at any
# depth the device holds the same two slots, two slices' gradients, one block's activations and
# the same logits while the parameter bytes grow: the design's claim, bounded by host memory.
# Growing d_model instead would grow each slice quadratically until two slots no longer fit, which
# measures how finely the model is cut, not how large a model the cap can train.
# d_model 2304 (18 heads of 128): a block's float32 bytes (243 MiB) sit just below a power of two,
# which PyTorch's pinned-memory allocator rounds each buffer up to; at 2048 a third would be lost.
# The logits stay small (4 x 256 tokens x 8192 classes: 32 MiB in float32) so that the model, not
# the loss, fills the device.
MAX_MODEL_GPU = {"d_model": 2304, "n_heads": 18, "seq_len": 256, "vocab": 8192}
MAX_MODEL_CPU = {"d_model": 32, "n_heads": 4, "seq_len": 16, "vocab": 64}  # a smoke test of the search
MAX_MODEL_ROWS = 4
MAX_MODEL_CPU_LAYERS = 4

COMPUTE_DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def host_estimate(settings: dict[str, Any], compute_dtype: torch.dtype | None, rows: int) -> tuple[int, int]:
    """Parameters of the transformer with ``settings``, and the host bytes training it needs, from
    a build on the meta device (which allocates nothing).

    Counted: the float32 host copies and their gradients, pinned, each slice's buffer rounded up to
    a power of two as PyTorch's pinned allocator does (an overestimate where a buffer is not
    rounded); AdamW's two states, 8 bytes per parameter; with a compute dtype, the pinned shadow;
    every slice's whole-batch boundary activation, in float32. One slice per layer.
    """
    with torch.device("meta"):
        model = build_preset("transformer", **settings).model
    slice_bytes = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model]
    shadow_itemsize = torch.empty((), dtype=compute_dtype).element_size() if compute_dtype is not None else 0
    boundary = rows * settings["seq_len"] * settings["d_model"] * 4
    host = (2 * sum(_power_of_two_at_least(b) for b in slice_bytes)
            + 2 * sum(slice_bytes)
            + sum(_power_of_two_at_least(b // 4 * shadow_itemsize) for b in slice_bytes if shadow_itemsize)
            + len(model) * _power_of_two_at_least(boundary))
    return sum(p.numel() for p in model.parameters()), host


def host_budget(args: argparse.Namespace) -> tuple[int, str]:
    """Host bytes the search may fill, and where that figure comes from."""
    if args.host_memory_gib is not None:
        return int(args.host_memory_gib * 2**30), "--host-memory-gib"
    memory = psutil.virtual_memory()
    # Left to the rest of this process and the machine (the system, CUDA's own mappings, transient
    # copies while a model is built) and to what the estimate does not count.
    reserve = 4 * 2**30 + memory.total // 20
    return memory.available - reserve, f"available host memory less a reserve of {reserve / 2**30:.1f} GiB"


def release_memory(device: torch.device) -> None:
    """Hand back what the last size freed, so the next size's host check sees it as available."""
    gc.collect()
    if device.type != "cuda":
        return
    torch.cuda.empty_cache()
    # Pinned blocks stay cached in the process after their tensors are freed, where psutil counts
    # them as used. Without a way to empty that cache the host check only errs on the safe side.
    empty_host_cache = (getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
                        or getattr(torch._C, "_host_emptyCache", None))
    if empty_host_cache is not None:
        empty_host_cache()


def try_size(settings: dict[str, Any], rows: int, compute_dtype: torch.dtype | None, args: argparse.Namespace,
             device: torch.device) -> dict[str, Any]:
    """Build the transformer with ``settings``, train it for a few steps with OffloadOptimizer, and
    return what that measured or how it failed. Everything it built is freed on return."""
    record: dict[str, Any] = {"n_layers": settings["n_layers"]}
    runner = None
    start = time.perf_counter()
    try:
        preset = build_preset("transformer", **settings)
        record["parameters"] = sum(p.numel() for p in preset.model.parameters())
        record["parameter_bytes"] = preset.parameter_bytes
        batch, target = preset.make_batch(rows, device)
        # One slice per layer: no slice holds more than one block, whatever the depth.
        model = OffloadModel(preset.model, device=device, num_slices=len(preset.model), compute_dtype=compute_dtype)
        runner = Runner("offload", make_step(model, model, preset, batch, target, device), model)
        record["build_s"] = time.perf_counter() - start
        for _ in range(args.warmup):
            timed_step(runner, device)
        # The peak keeps the warm-up steps': the first step allocates what later steps reuse.
        runner.times.clear()
        runner.model_times.clear()
        for _ in range(args.steps):
            timed_step(runner, device)
        record.update(
            trained=True,
            median_step_s=statistics.median(runner.times),
            median_forward_backward_s=statistics.median(runner.model_times),
            peak_device_bytes=runner.peak if device.type == "cuda" else None,
            device_bytes_between_steps=torch.cuda.memory_allocated(device) if device.type == "cuda" else None,
            host_rss_bytes=psutil.Process().memory_info().rss,
        )
    except Exception as error:  # noqa: BLE001 - how a size fails is the result; the caller decides
        message = str(error).strip().splitlines()
        record.update(trained=False, error=f"{type(error).__name__}: {message[0][:400] if message else ''}",
                      out_of_memory=isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error))
    finally:
        optimizer = getattr(runner.step, "optimizer", None) if runner is not None else None
        if isinstance(optimizer, OffloadOptimizer):
            # A host update still running holds this size's tensors past the return; the next
            # size's host check must not count them. After a failed step the update may fail
            # too: the step's error is the one recorded.
            with contextlib.suppress(Exception):
                optimizer.synchronize()
    return record


def max_model(args: argparse.Namespace, device: torch.device, save: Callable[[dict], None]) -> dict:
    """Grow the transformer block by block (doubling the depth, then as deep as host memory
    allows) until a training step fails or the next size would not fit in host memory; ``save``
    is called with the summary after every size, so a run cut short keeps what it measured."""
    cuda = device.type == "cuda"
    compute_dtype = COMPUTE_DTYPES[args.compute_dtype]
    width = MAX_MODEL_GPU if cuda else MAX_MODEL_CPU
    max_layers = args.max_layers if args.max_layers is not None else (None if cuda else MAX_MODEL_CPU_LAYERS)
    cap = int(args.cap_gib * 2**30) if cuda else None
    rows = MAX_MODEL_ROWS
    # The host estimate is linear in the depth: blocks are alike, the embedding and head are fixed.
    (params_1, host_1), (params_2, host_2) = (host_estimate(width | {"n_layers": n}, compute_dtype, rows) for n in (1, 2))
    per_block, fixed = host_2 - host_1, 2 * host_1 - host_2
    logits_bytes = rows * width["seq_len"] * width["vocab"] * 4
    summary: dict[str, Any] = {
        "device_memory_cap_bytes": cap,
        "compute_dtype": None if compute_dtype is None else str(compute_dtype),
        "grown": "n_layers, at a fixed width; one slice per layer",
        "settings": width,
        "batch": rows,
        "logits_bytes_float32": logits_bytes,
        "host_bytes_per_block_estimate": per_block,
        "host_bytes_fixed_estimate": fixed,
        "parameters_per_block": params_2 - params_1,
        "goal_parameter_bytes_per_cap": MAX_MODEL_GOAL_RATIO,
        "note": (f"logits kept small ({rows} x {width['seq_len']} tokens x {width['vocab']} classes, "
                 f"{logits_bytes / 2**20:.1f} MiB in float32) so that the model, not the loss, fills the device"
                 + ("" if cuda else "; CPU: no device-memory cap, a smoke test of the search only")),
        "sizes": [],
        "largest_trained": None,
        "parameter_bytes_per_cap": None,
        "stopped": None,
    }
    print(f"\n[max-model] {summary['note']}; "
          + (f"cap {cap / 2**30:g} GiB" if cap else "no cap") + f", compute dtype {summary['compute_dtype'] or 'float32'}",
          flush=True)
    if cap is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        if cap > total:
            raise ValueError(f"--cap-gib {args.cap_gib:g} is more than the device's {total / 2**30:.1f} GiB")
        torch.cuda.set_per_process_memory_fraction(cap / total, device)
    try:
        previous, target = 0, 1
        while True:
            budget, source = host_budget(args)
            fits = max(0, (budget - fixed) // per_block)
            n = min(target, fits, target if max_layers is None else max_layers)
            if n <= previous:
                if max_layers is not None and previous >= max_layers:
                    summary["stopped"] = f"reached --max-layers {max_layers}"
                else:
                    needed = fixed + per_block * (previous + 1)
                    summary["stopped"] = (f"host memory: n_layers={previous + 1} would need about {needed / 2**30:.1f} GiB "
                                          f"of host memory, {max(budget, 0) / 2**30:.1f} GiB may be used ({source})")
                break
            # Overwritten once the size is done: what a run killed meanwhile (time limit, the
            # kernel's out-of-memory killer) leaves in the report.
            summary["stopped"] = f"cut short while trying n_layers={n}"
            save(summary)
            record = try_size(width | {"n_layers": n}, rows, compute_dtype, args, device)
            record["host_bytes_estimate"] = fixed + per_block * n
            record["host_bytes_allowed"] = budget
            release_memory(device)
            if record.get("parameter_bytes") is not None and cap is not None:
                record["parameter_bytes_per_cap"] = record["parameter_bytes"] / cap
            summary["sizes"].append(record)
            print("  " + size_line(record), flush=True)
            if not record["trained"]:
                summary["stopped"] = f"n_layers={n} failed: {record['error']}"
                break
            summary["largest_trained"] = record
            summary["parameter_bytes_per_cap"] = record.get("parameter_bytes_per_cap")
            save(summary)
            previous, target = n, 2 * n
    finally:
        if cap is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    print(f"  stopped: {summary['stopped']}", flush=True)
    save(summary)
    return summary


def size_line(record: dict[str, Any]) -> str:
    head = f"{record['n_layers']} block{'' if record['n_layers'] == 1 else 's'}"
    if "parameters" in record:
        head += f", {record['parameters'] / 1e6:,.1f}M parameters ({record['parameter_bytes'] / 2**30:.2f} GiB"
        head += f", {record['parameter_bytes_per_cap']:.2f}x the cap)" if "parameter_bytes_per_cap" in record else ")"
    if not record["trained"]:
        return f"{head}: failed: {record['error']}"
    peak = record["peak_device_bytes"]
    return (f"{head}: step {record['median_step_s']:.3f} s, forward+backward {record['median_forward_backward_s']:.3f} s"
            + ("" if peak is None else f", peak device {peak / 2**20:,.0f} MiB"))


def max_model_markdown(summary: dict[str, Any]) -> str:
    cap = summary["device_memory_cap_bytes"]
    lines = [f"## Largest model that trains under {f'a {cap / 2**30:g} GiB device cap' if cap else 'no cap (CPU smoke test)'}",
             "",
             f"Grown: {summary['grown']} ({', '.join(f'{k} {v}' for k, v in summary['settings'].items())}, "
             f"batch {summary['batch']}, compute dtype {summary['compute_dtype'] or 'float32'}); {summary['note']}.",
             "",
             "| blocks | parameters (M) | parameter GiB | x cap | host GiB (estimate) | peak device MiB "
             "| between steps MiB | fwd+bwd s | step s | result |",
             "|---" * 10 + "|"]

    def fmt(value: Any, scale: float = 1.0, digits: int = 1) -> str:
        return "" if value is None else f"{value * scale:,.{digits}f}"

    for r in summary["sizes"]:
        lines.append(
            f"| {r['n_layers']} | {fmt(r.get('parameters'), 1e-6)} | {fmt(r.get('parameter_bytes'), 2**-30, 2)} "
            f"| {fmt(r.get('parameter_bytes_per_cap'), 1, 2)} | {fmt(r['host_bytes_estimate'], 2**-30)} "
            f"| {fmt(r.get('peak_device_bytes'), 2**-20, 0)} | {fmt(r.get('device_bytes_between_steps'), 2**-20, 0)} "
            f"| {fmt(r.get('median_forward_backward_s'), 1, 3)} | {fmt(r.get('median_step_s'), 1, 3)} "
            f"| {'trained' if r['trained'] else r['error']} |")
    largest = summary["largest_trained"]
    ratio = summary["parameter_bytes_per_cap"]
    lines.append("")
    if largest is None:
        lines.append("No size trained.")
    else:
        lines.append(f"Largest that trained: {largest['n_layers']} blocks, {largest['parameters'] / 1e6:,.1f}M parameters, "
                     f"{largest['parameter_bytes'] / 2**30:.2f} GiB"
                     + ("" if ratio is None else f" = {ratio:.2f}x the cap (goal: at least {MAX_MODEL_GOAL_RATIO:g}x)")
                     + ".")
    lines.append(f"Stopped: {summary['stopped']}.")
    return "\n".join(lines)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", nargs="+", choices=sorted(CASES), help="cases to run (default: all on a GPU, tiny on the CPU)")
    parser.add_argument("--steps", type=int, help="timed steps per run (default 8; --max-model: 2 per size)")
    parser.add_argument("--warmup", type=int, help="steps before the timed ones (default 3; --max-model: 1)")
    parser.add_argument("--rss-steps", type=int, default=0, help="extra offload steps to trace host RSS (GPU)")
    parser.add_argument("--no-fairscale", action="store_true")
    parser.add_argument("--slices", type=int, help="override every case's num_slices")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    search = parser.add_argument_group("largest model under a device-memory cap")
    search.add_argument("--max-model", action="store_true",
                        help="grow a transformer until a step fails under --cap-gib or host memory runs out")
    search.add_argument("--cap-gib", type=float, help="device memory cap in GiB (default 2; none on the CPU)")
    search.add_argument("--compute-dtype", choices=[k for k in COMPUTE_DTYPES if k], help="OffloadModel's compute_dtype")
    search.add_argument("--max-layers", type=int,
                        help="the deepest model to try (default: as deep as host memory allows; 4 on the CPU)")
    search.add_argument("--host-memory-gib", type=float,
                        help="host memory the search may fill (default: what is available, less a reserve)")
    args = parser.parse_args()
    search_only = {"--cap-gib": args.cap_gib, "--compute-dtype": args.compute_dtype, "--max-layers": args.max_layers,
                   "--host-memory-gib": args.host_memory_gib}
    if not args.max_model and any(v is not None for v in search_only.values()):
        parser.error(f"{', '.join(k for k, v in search_only.items() if v is not None)} need --max-model")
    if args.max_model and (args.preset or args.slices is not None):
        parser.error("--max-model builds its own model: it takes no --preset or --slices")
    if args.max_model and args.cap_gib is None:
        args.cap_gib = 2.0
    if args.steps is None:
        args.steps = 2 if args.max_model else 8
    if args.warmup is None:
        args.warmup = 1 if args.max_model else 3
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # the memory cap needs an index
        device = torch.device("cuda", torch.cuda.current_device())
    names = args.preset or (list(CASES) if device.type == "cuda" else ["tiny"])
    cases = {name: CASES[name] if args.slices is None else dataclasses.replace(CASES[name], num_slices=args.slices)
             for name in names}
    if device.type != "cuda":
        args.steps = min(args.steps, 3)
        args.warmup = min(args.warmup, 1)

    bandwidth = measure_bandwidth(device)
    print(f"device: {device_name(device)}; host->device {bandwidth['host_to_device'] / 1e9:.1f} GB/s, "
          f"device->host {bandwidth['device_to_host'] / 1e9:.1f} GB/s ({bandwidth['kind']})")
    report = {
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
    os.makedirs(args.out_dir, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-")
    tag = ("" if args.preset is None else "_" + "_".join(names)) + ("" if args.slices is None else f"_{args.slices}slices")
    stem = os.path.join(args.out_dir, f"benchmark_{slug}_{report['date']}{tag}")
    if args.max_model:
        run_max_model(args, device, report, os.path.join(args.out_dir, f"benchmark_{slug}_{report['date']}_maxmodel"
                      + (f"_{args.cap_gib:g}gib" if device.type == "cuda" else "")
                      + (f"_{args.compute_dtype}" if args.compute_dtype else "")))
        return
    for name in names:
        # One case failing (out of memory on a smaller card, say) must not lose the others' figures.
        try:
            report["results"].append(run_case(cases[name], args, device, bandwidth))
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


def run_max_model(args: argparse.Namespace, device: torch.device, report: dict, stem: str) -> None:
    report["max_model"] = None

    def save(summary: dict) -> None:
        report["max_model"] = summary
        write_report(report, stem)

    try:
        summary = max_model(args, device, save)
    except Exception as error:  # noqa: BLE001 - recorded and reported below
        report["failed"]["max-model"] = f"{type(error).__name__}: {error}"
        print(f"\n[max-model] failed: {report['failed']['max-model']}", file=sys.stderr)
    else:
        # Running out of device memory is how the search ends; any other failure is a failure.
        failed = summary["sizes"] and not summary["sizes"][-1]["trained"] and not summary["sizes"][-1]["out_of_memory"]
        if failed:
            report["failed"]["max-model"] = summary["stopped"]
        print("\n" + max_model_markdown(summary))
    write_report(report, stem)
    print(f"\nwrote {stem}.json and {stem}.md")
    if report["failed"]:
        sys.exit(1)


def write_report(report: dict, stem: str) -> None:
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
        if report.get("max_model"):
            f.write("\n" + max_model_markdown(report["max_model"]) + "\n")
        for name, error in report["failed"].items():
            f.write(f"\n{name} failed: {error}\n")


if __name__ == "__main__":
    main()
