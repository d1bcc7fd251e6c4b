"""Loading a causal LM checkpoint slice by slice against ``from_pretrained`` and wrapping: time and
peak memory.

Writes a randomly initialised Llama checkpoint (float32 safetensors shards, ``config.json`` and
index, as ``save_pretrained`` lays them out) one shard at a time, so writing it never holds the
model either, then runs ``scripts/load_checkpoint.py`` in a fresh process for each method, each
``--repeats`` times, alternating, after reading the files once so that every run finds them in the
page cache (the figures are then about the loader, not the disk).

Usage::

    python benchmarks/bench_loading.py --dir DIR --json benchmarks/results/loading_cpu_DATE.json
        [--layers 16] [--hidden 1536] [--intermediate 4096] [--vocab 32000] [--repeats 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch
from json_output import check_dir, check_json_path  # benchmarks/json_output.py, next to this file

ROOT = Path(__file__).resolve().parents[1]
SHARD_BYTES = 512 * 2**20


def write_checkpoint(path: Path, args: argparse.Namespace) -> dict:
    import transformers
    from safetensors.torch import save_file

    # Heads 128 wide, at least one: the loader reads tensors, whatever the heads cut them into, and no
    # forward runs, so a --hidden under 128 (a smoke test's) gets one head rather than none.
    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 128), num_key_value_heads=max(1, args.hidden // 512),
        vocab_size=args.vocab, tie_word_embeddings=False)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in transformers.AutoModelForCausalLM.from_config(config).state_dict().items()}
    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    names = list(shapes)
    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = shapes[name].numel() * 4
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    weight_map = {}
    for index, group in enumerate(groups):
        file = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for name in group:
            shape = shapes[name]
            # Norm weights start at one, matrices small and random, as an initialised model.
            shard[name] = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=generator) * 0.02
            weight_map[name] = file
        save_file(shard, str(path / file), metadata={"format": "pt"})
        del shard
    total = sum(s.numel() * 4 for s in shapes.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config.save_pretrained(path)
    return {"parameters": sum(s.numel() for s in shapes.values()), "bytes": total, "shards": len(groups),
            "config": {"layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate,
                       "vocab": args.vocab}}


def warm(path: Path) -> None:
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb", buffering=0) as handle:
            while handle.read(64 * 2**20):
                pass


def measure(path: Path, method: str, num_slices: int) -> dict:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "load_checkpoint.py"), str(path), "--method", method,
         "--device", "cpu", "--num-slices", str(num_slices)],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{method} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True, help="where the checkpoint is written (kept for reuse)")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--num-slices", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    sizes = ("layers", "hidden", "intermediate", "vocab", "num_slices", "repeats")
    if min(getattr(args, name) for name in sizes) < 1:
        parser.error(f"{', '.join('--' + name.replace('_', '-') for name in sizes)} must be at least 1")
    check_json_path(parser, args.json)
    check_dir(parser, args.dir)

    written = json.loads((args.dir / "bench.json").read_text()) if (args.dir / "bench.json").is_file() else None
    if written is None or written["config"] != {"layers": args.layers, "hidden": args.hidden,
                                                "intermediate": args.intermediate, "vocab": args.vocab}:
        written = write_checkpoint(args.dir, args)
        (args.dir / "bench.json").write_text(json.dumps(written))
    print(f"checkpoint: {written['parameters'] / 1e6:.0f} M parameters, {written['bytes'] / 2**30:.2f} GiB "
          f"in {written['shards']} shards")
    warm(args.dir)
    runs = []
    for _ in range(args.repeats):
        for method in ("slices", "from_pretrained"):
            runs.append(measure(args.dir, method, args.num_slices))
            print(f"{method}: {runs[-1]['seconds']} s, peak RSS growth {runs[-1]['peak_rss_growth_bytes'] / 2**30:.2f} GiB")
    summary = {}
    for method in ("slices", "from_pretrained"):
        mine = [r for r in runs if r["method"] == method]
        summary[method] = {"seconds_min": min(r["seconds"] for r in mine),
                           "peak_rss_growth_gib_max": round(max(r["peak_rss_growth_bytes"] for r in mine) / 2**30, 3),
                           "host_copies_gib": round(mine[0]["host_copies_bytes"] / 2**30, 3)}
    result = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "load_average": os.getloadavg()},
        "page_cache": "warm: every file read once before the runs",
        "checkpoint": written,
        "summary": summary,
        "runs": runs,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
