"""Peak RSS of the fine-tune command's data path against the corpus size: flat.

Writes a plain-text corpus of each size (random words in lines, seeded) and a JSON lines copy of
it, then measures, each in a fresh process (``os.wait4``'s ``ru_maxrss``):

- ``steps``: ``offload-finetune`` (``python -m offload.cli.finetune``) on the tiny random Llama for
  ``--steps`` steps with ``--data`` the corpus and ``--eval-fraction`` on, so the eval split is
  read too;
- ``full_pass``: every 1024-id block of the corpus through ``offload.integrations.data.token_blocks``,
  the whole file read and tokenised once, with a Python tokenizer giving the byte-level
  tokenizer's ids (UTF-8 bytes) at memory speed: the byte-level tokenizer itself reads about
  0.6 MB/s, which would make a pass over 100 MB take minutes and measure nothing more.

Before the data path was lazy, the command read the whole file and tokenised it in one call:
20 MB of text peaked at 4.3 GB RSS.

Usage::

    python benchmarks/bench_data.py --sizes-mb 10 100 --json benchmarks/results/data_path_cpu_2026-11-26.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from json_output import check_dir, check_json_path  # benchmarks/json_output.py, next to this file

ROOT = Path(__file__).resolve().parents[1]

FULL_PASS = """
import sys, time
from offload.integrations.data import token_blocks

class Utf8Bytes:
    # The byte-level tokenizer's ids (a text's UTF-8 bytes), at memory speed: the pass measures
    # the reader and the packing, not that tokenizer (about 0.6 MB/s on one core).
    eos_token_id = None
    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": list(text.encode("utf-8"))}

start = time.perf_counter()
count = sum(1 for _ in token_blocks(sys.argv[1], Utf8Bytes(), 1024))
print(count, time.perf_counter() - start)
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[10, 100], help="corpus sizes in MB (10^6 bytes)")
    parser.add_argument("--steps", type=int, default=3, help="steps of each fine-tune run")
    parser.add_argument("--no-full-pass", action="store_true", help="measure the fine-tune runs only")
    parser.add_argument("--dir", type=Path, help="where the corpora go (default: a temporary directory)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if not all(0 < size < float("inf") for size in args.sizes_mb) or args.steps < 1:
        parser.error("--sizes-mb must be above 0 (and finite) and --steps at least 1")
    check_json_path(parser, args.json)
    check_dir(parser, args.dir)
    return args


def write_corpus(path: Path, nbytes: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    written = 0
    with path.open("w", encoding="utf-8") as file:
        while written < nbytes:
            line = " ".join(rng.choices(words, k=rng.randint(5, 30))) + ".\n"
            file.write(line)
            written += len(line)


def write_jsonl(text: Path, path: Path) -> None:
    with text.open(encoding="utf-8") as source, path.open("w", encoding="utf-8") as out:
        paragraph: list[str] = []
        for line in source:
            paragraph.append(line)
            if len(paragraph) == 20:
                out.write(json.dumps({"text": "".join(paragraph)}) + "\n")
                paragraph = []


def measured(command: list[str]) -> dict:
    """Run ``command``; its wall time and peak RSS (its own, not the children's of this process)."""
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(process.pid, 0)
    out, err = process.stdout.read(), process.stderr.read()
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{err[-3000:]}")
    return {"peak_rss_bytes": usage.ru_maxrss * 1024, "wall_s": round(time.perf_counter() - start, 2),
            "stdout_tail": out.strip().splitlines()[-1]}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        where = args.dir or Path(scratch)
        where.mkdir(parents=True, exist_ok=True)
        results = []
        for size in args.sizes_mb:
            text = where / f"corpus_{size:g}mb.txt"
            write_corpus(text, int(size * 1e6))
            jsonl = text.with_suffix(".jsonl")
            write_jsonl(text, jsonl)
            row = {"size_mb": size, "bytes": text.stat().st_size}
            for name, path in (("txt", text), ("jsonl", jsonl)):
                row[f"steps_{name}"] = measured([
                    sys.executable, "-m", "offload.cli.finetune", "--device", "cpu", "--no-progress",
                    "--out", str(where / "out"), "--overwrite", "--steps", str(args.steps), "--data", str(path),
                    "--eval-fraction", "0.01", "--eval-batches", "2"])
                if not args.no_full_pass:
                    row[f"full_pass_{name}"] = measured([sys.executable, "-c", FULL_PASS, str(path)])
            for key, value in row.items():
                if isinstance(value, dict):
                    print(f"{size:g} MB {key}: peak RSS {value['peak_rss_bytes'] / 2**20:.0f} MiB, {value['wall_s']} s")
            results.append(row)
            text.unlink()
            jsonl.unlink()
    if args.json is not None:
        record = {"benchmark": "data_path", "command": " ".join(["python", "benchmarks/bench_data.py", *(argv or sys.argv[1:])]),
                  "platform": platform.platform(), "python": platform.python_version(), "steps": args.steps,
                  "results": results}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
