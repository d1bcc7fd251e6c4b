"""What checkpoint checksums cost: saves and loads of a preset with AdamW, with checksums and
without, alternating, so that both see the same machine (Note: [Checkpoint checksums] in
``offload/checkpoint/checkpoint_files.py``).

"Without" swaps DCP's plain filesystem back in for the saves and skips the check of the loads,
in this process only; the library itself has no switch. Each round saves and loads once each
way; the result file has every run, the medians and the minima, and the seconds spent in
``zlib.crc32`` (on the helper thread while saving, on the caller's while loading). Loads are in
place (the trained model and optimizer) and read files the save just wrote (the page cache).

Usage::

    python benchmarks/bench_checksums.py --preset mlp --rounds 10 --dir /tmp/benchck \\
        --json benchmarks/results/checksums_cpu_mlp.json
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
import zlib
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import FileSystem

from offload import load_checkpoint, save_checkpoint
from offload.checkpoint import checkpoint_files
from offload.checkpoint import loader as checkpoint
from offload.planning.presets import build_preset, preset_names

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_checkpoint import build  # noqa: E402 - the same model and optimizer as that benchmark
from json_output import check_dir, check_json_path  # benchmarks/json_output.py, next to this file


class TimedZlib:
    """``zlib`` whose ``crc32`` adds its seconds to ``seconds`` (read between calls)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def crc32(self, data, value=0):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        value = zlib.crc32(data, value)
        self.seconds += time.perf_counter() - start
        return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=preset_names(), default="mlp")
    parser.add_argument("--slices", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--dir", type=Path, help="where to write the checkpoints (default: a temporary directory)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    check_json_path(parser, args.json)
    check_dir(parser, args.dir)

    model, optimizer = build(args.preset, {}, args.slices)
    preset = build_preset(args.preset)
    x, y = preset.make_batch(2, "cpu")
    preset.loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    optimizer.synchronize()
    del preset

    timed = TimedZlib()
    checkpoint_files.zlib = timed  # type: ignore[assignment]
    summing_create_stream = checkpoint_files.ChecksummingFileSystem.create_stream
    verify = checkpoint.verify_checksums
    runs: dict[str, list[float]] = {k: [] for k in ("save_with", "save_without", "load_with", "load_without",
                                                    "crc32_save", "crc32_load")}
    root = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        for _ in range(args.rounds):
            for on in (True, False):
                checkpoint_files.ChecksummingFileSystem.create_stream = (  # type: ignore[method-assign]
                    summing_create_stream if on else FileSystem.create_stream)
                checkpoint.verify_checksums = verify if on else (lambda *_: None)  # type: ignore[assignment]
                way = "with" if on else "without"
                timed.seconds = 0.0
                start = time.perf_counter()
                save_checkpoint(root / "c", model, optimizer)
                runs[f"save_{way}"].append(time.perf_counter() - start)
                if on:
                    runs["crc32_save"].append(timed.seconds)
                timed.seconds = 0.0
                start = time.perf_counter()
                load_checkpoint(root / "c", model, optimizer)
                runs[f"load_{way}"].append(time.perf_counter() - start)
                if on:
                    runs["crc32_load"].append(timed.seconds)
        checkpoint_bytes = sum(f.stat().st_size for f in (root / "c").iterdir())
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"{args.preset}: checkpoint {checkpoint_bytes / 2**20:.0f} MiB, {args.rounds} rounds")
    result: dict = {
        "command": "python " + " ".join(sys.argv),
        "date": datetime.date.today().isoformat(),
        "machine": {"processor": platform.machine(), "cpus": os.cpu_count(), "load_average": os.getloadavg(),
                    "torch": torch.__version__},
        "preset": args.preset, "num_slices": args.slices, "checkpoint_bytes": checkpoint_bytes,
    }
    for name, values in runs.items():
        result[name] = {"median_s": statistics.median(values), "min_s": min(values), "runs_s": values}
        print(f"{name:>12}: median {statistics.median(values):.3f} s, min {min(values):.3f} s")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
