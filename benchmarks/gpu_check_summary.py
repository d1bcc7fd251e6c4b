"""The summary of ``benchmarks/gpu_check.sh``: its stages' JSON files merged into one, and the
tables printed last.

Usage::

    python benchmarks/gpu_check_summary.py merge STAGE_DIR summary.json   # every STAGE_DIR/<stage>.json under its stage's key
    python benchmarks/gpu_check_summary.py show summary.json              # the tables (pytest.log beside it for the tests)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

GB = 1e9


def merge(stage_dir: str, out: str) -> None:
    summary = {path.stem: json.loads(path.read_text()) for path in sorted(Path(stage_dir).glob("*.json"))}
    Path(out).write_text(json.dumps(summary, indent=1))


def host(facts: dict[str, Any]) -> str:
    link = facts["link_bytes_per_s"]
    return (f"host: {facts['cpu_model']}, {facts['logical_cores']} logical / {facts['physical_cores']} physical cores, "
            f"NUMA {facts['numa_nodes']}, THP {facts['transparent_hugepage']}, "
            f"{facts['host_memory_bytes'] / 2**30:.0f} GiB; copy {facts['copy_bytes_per_s_at_torch_threads'] / GB:.1f} GB/s "
            f"at {facts['torch_threads']} threads, {facts['copy_bytes_per_s_at_one_thread'] / GB:.1f} at 1; "
            f"link {link['host_to_device'] / GB:.1f} / {link['device_to_host'] / GB:.1f} GB/s ({link.get('kind')})")


def runs(name: str, report: dict[str, Any]) -> str:
    from bench_peers import table  # imports torch: only for show, not for every stage's merge

    link = report["bandwidth_bytes_per_s"]
    lines = [f"{name}: {report['device_name']}, {report['parameters'] / 1e9:.3f} B parameters, "
             f"{report['tokens_per_step']} tokens/step ({report['sizes']['batch']} x {report['sizes']['seq']}), "
             f"{report['num_slices']} slices; link {link['host_to_device'] / GB:.1f} / {link['device_to_host'] / GB:.1f} GB/s; "
             f"host update alone {report.get('host_update_alone_s')}", table(report)]
    resident = report["runs"].get("resident", {}).get("median_step_s")
    if resident:
        lines.append("step / resident step: " + ", ".join(
            f"{n} {r['median_step_s'] / resident:.2f}" for n, r in report["runs"].items() if n != "resident"))
    for n, r in report["runs"].items():
        if "efficiency" in r:
            lines.append(f"  {n}: efficiency {r['efficiency']:.2f} against {r['ideal_terms']}")
        if "bound" in r:  # the bound with the host's bytes (benchmarks/host_bound.py)
            b = r["bound"]
            lines.append(f"  {n}: efficiency {b['efficiency']:.2f} against the bound with the host counted "
                         f"{b['bound_terms']} (host {b['host_bytes']['total'] / GB:.2f} GB a step)")
    return "\n".join(lines)


def exact(report: dict[str, Any], name: str = "exact") -> str:
    grads = report.get("gradients_after_first_backward", {})
    per_slice = report.get("parameters_per_slice", {})
    lines = [f"{name} (deterministic {report.get('deterministic')}, {report.get('tokens_per_step')} tokens a step): "
             "gradients after the first backward, first offloaded "
             f"run against the resident model: bit identical {grads.get('bit_identical')} "
             f"({grads.get('offload_vs_resident_tensors_differing')} of {grads.get('tensors')} tensors differ)"]
    for name, verdict in grads.get("per_variant", {}).items():
        lines.append(f"  {name}: bit identical {verdict['bit_identical']} ({verdict['tensors_differing']} differ, "
                     f"largest relative {verdict['max_relative']:.3g})")
    lines.append(f"parameters after the run, per slice across the variants that placed every update alike: all equal "
                 f"{per_slice.get('all_equal')} ({per_slice.get('groups_compared')} groups, "
                 f"{per_slice.get('groups_differing')} differing: {per_slice.get('differing')})")
    lines.append("whole-model digests: " + ", ".join(f"{n} {r['parameters_sha256_16']}" for n, r in report["runs"].items()
                                                     if "parameters_sha256_16" in r))
    return "\n".join(lines)


def trace(report: dict[str, Any]) -> str:
    from stream_idle import markdown

    tables = {n: r["streams"] for n, r in report["runs"].items() if "streams" in r}
    lines = ["trace: per lane busy and idle time over one step's forward and backward", markdown(tables)]
    if "resident" in tables and len(tables) > 1:
        other = next(n for n in tables if n != "resident")
        busiest = {n: max(t["per_lane"].values(), key=lambda row: row["busy_ms"]) for n, t in tables.items()}
        extra = {k: v - busiest["resident"]["top"].get(k, 0.0) for k, v in busiest[other]["top"].items()}
        lines.append(f"{other} - resident: window {tables[other]['window_ms'] - tables['resident']['window_ms']:+.1f} ms, "
                     f"busiest lane busy {busiest[other]['busy_ms'] - busiest['resident']['busy_ms']:+.1f} ms, idle "
                     f"{busiest[other]['idle_ms'] - busiest['resident']['idle_ms']:+.1f} ms; its top operations against "
                     "the resident's (ms): " + ", ".join(f"{k} {v:+.1f}" for k, v in extra.items()))
    return "\n".join(lines)


def kernels(report: dict[str, Any]) -> str:
    if not report.get("one_pass_available"):
        return f"one-pass host update: off ({report.get('unavailable_reason')})"
    lines = [f"one-pass host update: ready after {report['build_and_check_s']:.0f} s ({report['machine']['capability']}); "
             "update over PyTorch's fused AdamW alone:"]
    for threads, rows in report["by_threads"].items():
        lines.append(f"  {threads} threads: " + ", ".join(f"{name} {row['vs_fused_alone']:.3f}" for name, row in rows.items()))
    return "\n".join(lines)


def hugepages(report: dict) -> str:
    steps = ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in report["median_step_s"].items())
    got = [b >> 20 for b in report["huge_page_bytes_per_round"]]
    return (f"hugepages: fused AdamW over {report['parameters'] / 1e6:.0f} M parameters at {report['threads']} threads: "
            f"{steps}; THP {report['thp'].get('enabled')}, huge pages got {got} MiB of "
            f"{report['mapped_bytes_per_round'] >> 20}")


def clipping(report: dict) -> str:
    gb = report["gradient_bytes"] / 1e9
    return (f"clipping: the norm of {gb:.2f} GB of float32 gradients at {report['pool_threads']} threads: PyTorch's "
            f"{report['torch_norm_s'] * 1e3:.1f} ms, offload's {report['offload_norm_s'] * 1e3:.1f} ms "
            f"({report['speedup']:.2f}x; the largest tensor alone {report['largest_tensor_norm_s'] * 1e3:.1f} ms), "
            f"scaling {report['scale_s'] * 1e3:.1f} ms; same bits: {report['same_bits']}")


def boundaries(report: dict) -> str:
    v = report["variants"]
    return (f"boundaries: the rotary tables sent once (shared) against at every boundary, "
            f"{report['config']['layers']} layers on {report['device']}: forward {v['shared']['forward_ms']:.1f} / "
            f"{v['every boundary']['forward_ms']:.1f} ms, backward {v['shared']['backward_ms']:.1f} / "
            f"{v['every boundary']['backward_ms']:.1f} ms, offloads {v['shared']['offloads']} / "
            f"{v['every boundary']['offloads']}, loads {v['shared']['loads']} / {v['every boundary']['loads']}; "
            f"same loss and gradients: {report['same_loss_and_gradients']}")


def walk(report: dict) -> str:
    v, per = report["variants"], report["per_slice"]
    times = ", ".join(f"{name} {r['forward_ms']:.1f} + {r['backward_ms']:.1f} ms" for name, r in v.items())
    return (f"walk: {report['slices']} thin slices on {report['device']}, forward + backward: {times}; per slice "
            f"the walk's forward {per['forward_ms']:.3f} ms beyond plain ({per['forward_beyond_checkpointed_ms']:.3f} "
            f"beyond checkpointed), backward {per['backward_ms']:.3f} ms beyond checkpointed")


def tests(pytest_log: Path) -> str:
    if not pytest_log.exists():
        return "tests: no pytest.log"
    keep = [line for line in pytest_log.read_text().splitlines()
            if line.startswith("===") or " passed" in line or " failed" in line or "collected" in line
            or line.startswith(("FAILED", "ERROR"))]
    return "tests:\n" + "\n".join(keep[-40:])


def show(path: str) -> None:
    summary = json.loads(Path(path).read_text())
    parts = [tests(Path(path).parent / "pytest.log")]
    for name, report in summary.items():
        if name == "host":
            parts.append(host(report))
        elif name.startswith("exact"):  # exact, and exact-batch at the batch stage's rows
            parts.append(exact(report, name))
        elif name == "trace":
            parts.append(trace(report))
        elif name == "kernels":
            parts.append(kernels(report))
        elif name == "hugepages":
            parts.append(hugepages(report))
        elif name == "clipping":
            parts.append(clipping(report))
        elif name == "boundaries":
            parts.append(boundaries(report))
        elif name == "walk":
            parts.append(walk(report))
        else:
            parts.append(runs(name, report))
            if any("streams" in r for r in report.get("runs", {}).values() if isinstance(r, dict)):
                parts.append(trace(report))
    print("\n\n".join(parts))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="{merge,show}")
    merging = commands.add_parser("merge", help="every STAGE_DIR/<stage>.json into OUT, under its stage's key")
    merging.add_argument("stage_dir", metavar="STAGE_DIR")
    merging.add_argument("out", metavar="OUT")
    showing = commands.add_parser("show", help="the tables of a merged summary (pytest.log beside it for the tests)")
    showing.add_argument("summary", metavar="SUMMARY")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    args = parse_args()
    merge(args.stage_dir, args.out) if args.command == "merge" else show(args.summary)
