"""Time and size of a checkpoint of a preset model with AdamW, and the host memory a save and a
load add.

It trains one step of the preset under OffloadModel and OffloadOptimizer (so the optimizer holds
its state), then saves it ``--repeats`` times with ``save_checkpoint`` and loads it back with
``load_checkpoint``: into the trained optimizer (its state tensors are loaded in place) and into a
fresh model and optimizer, as a resumed process does. The peak host memory of each call is read
from the kernel's high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``) and
reported above the resident memory before the call; for a fresh load, above that plus the host
memory the loaded optimizer keeps afterwards (``created_bytes``: its state tensors in RAM, and
with a disk tier its window). Saves sync every file to disk, so the times include the disk.

With ``--disk-tier DIR`` the optimizer keeps its moments in files under ``DIR``
(``OffloadOptimizer(..., disk_tier=DIR)``): a save then reads them slice by slice and a load
writes them slice by slice, and their peaks show what they hold of them at a time.

Usage::

    python benchmarks/bench_checkpoint.py --preset mlp --json benchmarks/results/checkpoint_cpu_mlp.json
    MALLOC_MMAP_THRESHOLD_=1048576 python benchmarks/bench_checkpoint.py --preset mlp --disk-tier /tmp/tier \
        --json benchmarks/results/checkpoint_disk_tier.json

(the fixed mmap threshold returns each freed buffer to the kernel, so that a peak above the
resident memory before a call is not hidden by memory the allocator kept from earlier ones).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from offload import OffloadModel, OffloadOptimizer, load_checkpoint, save_checkpoint
from offload.planning.presets import build_preset, preset_names
from json_output import check_dir, check_json_path  # benchmarks/json_output.py, next to this file


def setting(text: str) -> tuple[str, int]:
    name, _, value = text.partition("=")
    if not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, int(value)


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the high-water mark restarts from the resident memory now


def peak_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def measured(call) -> tuple[float, int]:
    """(seconds, peak resident bytes above those before) of ``call()``."""
    reset_peak()
    before = resident_bytes()
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    return seconds, peak_bytes() - before


def host_state_bytes(optimizer: OffloadOptimizer) -> int:
    """Host memory the optimizer's state takes: its state tensors in RAM, and a disk tier's window."""
    optimizer.synchronize()
    in_ram = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor))
    tier = optimizer._tier
    return in_ram + (tier.window_nbytes if tier is not None else 0)


def build(preset_name: str, settings: dict[str, int], slices: int,
          disk_tier: Path | None = None) -> tuple[OffloadModel, OffloadOptimizer]:
    preset = build_preset(preset_name, **settings)
    model = OffloadModel(preset.model, device="cpu", num_slices=slices)
    return model, OffloadOptimizer(model, torch.optim.AdamW, lr=1e-4, fused=True, disk_tier=disk_tier)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=preset_names(), default="mlp")
    parser.add_argument("--set", type=setting, action="append", default=[], metavar="NAME=VALUE",
                        help="override a preset setting (repeatable)")
    parser.add_argument("--slices", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="where to write the checkpoints (default: a temporary directory)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--disk-tier", type=Path, help="keep the optimizer's moments in files under this directory")
    args = parser.parse_args()
    check_json_path(parser, args.json)
    check_dir(parser, args.dir)
    settings = dict(args.set)

    model, optimizer = build(args.preset, settings, args.slices, args.disk_tier)
    preset = build_preset(args.preset, **settings)
    x, y = preset.make_batch(2, "cpu")
    preset.loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    optimizer.synchronize()
    del preset
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # One slice at a time: with a disk tier, each slice's moments are read from its file.
    state_bytes = sum(v.numel() * v.element_size() for _, states in optimizer.state_by_slice()
                      for s in states.values() for v in s.values() if isinstance(v, torch.Tensor))
    largest_slice = max(s.storage.host_nbytes for s in model._engine.slices)
    largest_tensor = max(p.numel() * p.element_size() for p in model.parameters())

    root = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        saves = []
        for k in range(args.repeats):
            path = root / f"step-{k}"
            saves.append(measured(lambda: save_checkpoint(path, model, optimizer, extra={"step": k})))
            if k < args.repeats - 1:
                shutil.rmtree(path)
        checkpoint_bytes = sum(f.stat().st_size for f in path.iterdir())
        loads_in_place = [measured(lambda: load_checkpoint(path, model, optimizer)) for _ in range(args.repeats)]
        fresh_loads = []
        created = []  # host memory each fresh optimizer keeps after its load
        for _ in range(args.repeats):
            fresh = build(args.preset, settings, args.slices, args.disk_tier)
            fresh_loads.append(measured(lambda: load_checkpoint(path, *fresh)))
            created.append(host_state_bytes(fresh[1]))
            del fresh
    finally:
        shutil.rmtree(root)

    def summary(runs: list[tuple[float, int]], created: int = 0) -> dict:
        return {"median_s": statistics.median(s for s, _ in runs), "runs_s": [s for s, _ in runs],
                "peak_added_bytes": max(b for _, b in runs) - created, "created_bytes": created,
                "gb_per_s": checkpoint_bytes / statistics.median(s for s, _ in runs) / 1e9}

    result = {
        "command": "python " + " ".join(sys.argv),
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "date": datetime.date.today().isoformat(),
        "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "torch": torch.__version__},
        "preset": args.preset, "settings": settings, "num_slices": args.slices, "optimizer": "AdamW",
        "disk_tier": args.disk_tier is not None,
        "parameter_bytes": parameter_bytes, "optimizer_state_bytes": state_bytes,
        "largest_slice_bytes": largest_slice, "largest_tensor_bytes": largest_tensor,
        "checkpoint_bytes": checkpoint_bytes,
        "save": summary(saves),
        "load_in_place": summary(loads_in_place),
        # A fresh optimizer's state is created by the load: count what it adds beyond what the
        # optimizer keeps (with a disk tier, the scalars and the window; the moments are on disk).
        "load_fresh": summary(fresh_loads, created=max(created)),
        "peak_resident_bytes": peak_bytes(),
    }
    print(f"{args.preset}: {parameter_bytes / 2**20:.0f} MiB of parameters, {state_bytes / 2**20:.0f} MiB of "
          f"AdamW state, largest slice {largest_slice / 2**20:.0f} MiB, largest tensor {largest_tensor / 2**20:.0f} MiB")
    print(f"checkpoint: {checkpoint_bytes / 2**20:.0f} MiB")
    for name in ("save", "load_in_place", "load_fresh"):
        r = result[name]
        print(f"{name:>14}: {r['median_s']:.2f} s ({r['gb_per_s']:.2f} GB/s), "
              f"peak host memory added {r['peak_added_bytes'] / 2**20:.0f} MiB")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
