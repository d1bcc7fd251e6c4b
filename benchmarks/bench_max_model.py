"""The largest transformer that trains with OffloadModel under a device-memory cap.

It grows a transformer block by block at a fixed width (doubling the depth, then as deep as host
memory allows) under ``--cap-gib`` of device memory, until a training step runs out of device
memory or the next size would not fit in host memory, and records each size's peak device memory,
step time and parameter bytes per byte of the cap. The report is written after every size, so a
run cut short keeps what it measured.

It does not time the presets against the resident model and fairscale: that is
``benchmarks/benchmark.py``, whose step, timing and report writing this script reuses, so both
reports share their header (command, machine, bandwidth) and JSON layout.

Without a GPU it is a smoke test of the search: a few tiny sizes, with no cap.

Usage::

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        python benchmarks/bench_max_model.py --cap-gib 2 --compute-dtype bf16
    python benchmarks/bench_max_model.py --device cpu --max-layers 2   # the smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import psutil
import torch

from offload import OffloadModel, OffloadOptimizer
from offload.planning.presets import build_preset

from benchmark import (  # benchmarks/benchmark.py, next to this file
    Runner, make_step, report_stem, resolve_device, start_report, timed_step, write_report)

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
                      # Device memory only: a failed pinned host allocation also says "out of memory",
                      # and must not be recorded as the cap's limit.
                      out_of_memory=isinstance(error, torch.OutOfMemoryError))
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


def save_report(report: dict, stem: str) -> None:
    """Write the report, with the search's table in its Markdown once there is one."""
    summary = report["max_model"]
    write_report(report, stem, max_model_markdown(summary) if summary else "")


def run_search(args: argparse.Namespace, device: torch.device, report: dict, stem: str) -> None:
    """Run the search into ``report["max_model"]``, write the report, and exit 1 if it failed
    other than by running out of device memory."""
    report["max_model"] = None

    def save(summary: dict) -> None:
        report["max_model"] = summary
        save_report(report, stem)

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
    save_report(report, stem)
    print(f"\nwrote {stem}.json and {stem}.md")
    if report["failed"]:
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--cap-gib", type=float, default=2.0, help="device memory cap in GiB (default 2; none on the CPU)")
    parser.add_argument("--compute-dtype", choices=[k for k in COMPUTE_DTYPES if k], help="OffloadModel's compute_dtype")
    parser.add_argument("--max-layers", type=int,
                        help="the deepest model to try (default: as deep as host memory allows; 4 on the CPU)")
    parser.add_argument("--host-memory-gib", type=float,
                        help="host memory the search may fill (default: what is available, less a reserve)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per size (default 2)")
    parser.add_argument("--warmup", type=int, default=1, help="steps per size before the timed ones (default 1)")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = resolve_device(args.device)
    if device.type != "cuda":
        args.steps = min(args.steps, 3)
        args.warmup = min(args.warmup, 1)

    report = start_report(args, device)
    # The cap is in the name on a GPU only: the CPU search runs without one.
    tag = ("_maxmodel" + (f"_{args.cap_gib:g}gib" if device.type == "cuda" else "")
           + (f"_{args.compute_dtype}" if args.compute_dtype else ""))
    run_search(args, device, report, report_stem(args.out_dir, report, tag))


if __name__ == "__main__":
    main()
