"""The update worker's thread count and ``OMP_WAIT_POLICY`` on the CPU stand-in: the same
``benchmarks/bench_schedule.py`` run with PyTorch's thread count for the update (the default) and
with one thread fewer (leaving the thread that drives the device a core), each under
``OMP_WAIT_POLICY`` unset, ``passive`` and ``active``.

Each configuration runs in a process of its own (the wait policy is read when OpenMP starts), the
configurations one after the other and then again, ``--repeats`` times, so that the machine's load
drifts over all of them alike. Per configuration and schedule it reports the median over the
repeats of the step (each repeat's own median), of ``step_over_bound`` and of the bound with the
host counted; every repeat's own JSON is kept beside (``--keep DIR``).

Usage::

    python benchmarks/bench_threads.py --repeats 3 --json benchmarks/results/threads_cpu_2026-11-28.json \\
        --keep benchmarks/results/threads_cpu_2026-11-28 -- --update-sleep-ns 5 --dim 1024 --ratios 1 2 --resident
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from json_output import check_json_path  # benchmarks/json_output.py, next to this file

SCHEDULE = Path(__file__).resolve().parent / "bench_schedule.py"
POLICIES = (None, "passive", "active")


def configurations() -> list[dict[str, Any]]:
    """Each thread count (PyTorch's, then one fewer where there is more than one) under each policy."""
    default = torch.get_num_threads()
    counts = [None] + ([default - 1] if default > 1 else [])
    return [{"threads": t, "omp_wait_policy": p} for p in POLICIES for t in counts]


def name_of(config: dict[str, Any]) -> str:
    threads = "default" if config["threads"] is None else f"threads{config['threads']}"
    return f"{threads}-{config['omp_wait_policy'] or 'unset'}"


def run_one(config: dict[str, Any], passed: list[str], out: Path) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if config["omp_wait_policy"]:
        env["OMP_WAIT_POLICY"] = config["omp_wait_policy"]
    threads = [] if config["threads"] is None else ["--threads", str(config["threads"])]
    subprocess.run([sys.executable, str(SCHEDULE), *passed, *threads, "--json", str(out)], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def summary(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Per ratio and schedule, the medians over the repeats."""
    out: dict[str, Any] = {}
    for k, ratio in enumerate(reports[0]["ratios"]):
        per_schedule = {}
        for name in ratio["schedules"]:
            runs = [r["ratios"][k]["schedules"][name] for r in reports]
            per_schedule[name] = {
                "step_s": statistics.median(r["step_s"] for r in runs),
                "step_over_bound": statistics.median(r["step_over_bound"] for r in runs),
                "step_over_host_counted_bound": statistics.median(r["step_over_host_counted_bound"] for r in runs),
                "steps_s": [r["step_s"] for r in runs], "exact": all(r["exact"] for r in runs)}
        out[str(ratio["ratio"])] = {"update_s": statistics.median(r["ratios"][k]["update_s"] for r in reports),
                                    "schedules": per_schedule}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", required=True)
    parser.add_argument("--keep", required=True, help="directory for each run's own JSON")
    parser.add_argument("passed", nargs="*",
                        help="bench_schedule.py's arguments, after -- (its sizes and schedule: --dim, --slices, "
                             "--ratios, --resident, --steps, --warmup, --rounds, --update-sleep-ns, --optimizer; "
                             "not --threads or --json, which this script sets)")
    args = parser.parse_args(argv)
    check_json_path(parser, args.json)
    keep = Path(args.keep)
    keep.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {name_of(c): [] for c in configurations()}
    for repeat in range(args.repeats):
        for config in configurations():
            name = name_of(config)
            report = run_one(config, args.passed, keep / f"{name}_{repeat}.json")
            runs[name].append(report)
            print(f"{name} repeat {repeat}: " + ", ".join(
                f"{s} {v['step_s'] * 1e3:.1f} ms" for s, v in report["ratios"][0]["schedules"].items()), flush=True)
    result = {"command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
              "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(), "repeats": args.repeats,
              "configurations": {name: {**config, "ratios": summary(runs[name])}
                                 for config in configurations() for name in [name_of(config)]}}
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    for name, config in result["configurations"].items():
        print(name, {r: {s: round(v["step_s"] * 1e3, 1) for s, v in x["schedules"].items()}
                     for r, x in config["ratios"].items()})


if __name__ == "__main__":
    main()
