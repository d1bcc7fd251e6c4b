"""The planner's step time beside every step measured on the H100 (benchmarks/results/h100-2026-11-22).

For each offloaded run in ``run*_benchmark_*.json`` there, the script builds the case's model (the
benchmark's preset with its settings; ``compute_dtype=bfloat16`` for the ``-bf16`` cases), profiles
it on fake tensors for the run's batch, and predicts the step two ways:

- **from operations**: device compute from the model's operations over the ``h100-sxm`` default
  rate (790 TFLOP/s bfloat16; float32 67 TFLOP/s x 0.8), link 54.5 GB/s each way;
- **from the resident time**: the same model with the device's time taken from the run's own
  resident forward and backward (a third of it forward, all of it again for recompute and
  backward), which isolates the offload model (link, overlap, update) from the device's rate.

The host those runs had is not in ``GPU_DEFAULTS``: its fused AdamW rate is taken from one run,
run 3's ``mlp`` (33.5 M parameters updated in 32.9 ms: 28.5 GB/s at 28 bytes per parameter), so
that row's update is not an independent check; the rest is. Host copies (the shadow the update
writes) and the per-slice cost keep the defaults. The runs' own step includes the update's
exposed part, as the planner's ``"overlapped"`` schedule does.

Usage::

    python benchmarks/planner_vs_h100.py --out benchmarks/results/planner_vs_h100_2026-11-26.md
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
from pathlib import Path
from typing import Any

import torch

from offload.planning.planner import estimate_memory, slice_layout
from offload.planning.presets import build_preset
from offload.planning.rates import GB, GPU_DEFAULTS
from offload.planning.shapes import profile_layers
from offload.planning.timing import StepConfig, estimate_step_time, traffic

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "h100-2026-11-22"
HOST_UPDATE = 28 * 33_522_664 / 0.03291198149999275  # run 3, mlp: see the docstring
RATES = dataclasses.replace(GPU_DEFAULTS["h100-sxm"], name="h100-sxm, host AdamW from run 3 mlp",
                            host_update=HOST_UPDATE)


def predict(result: dict[str, Any]) -> dict[str, Any]:
    """The planner's figures for one benchmark case."""
    dtype = torch.bfloat16 if result["case"].endswith("-bf16") else None
    with torch.device("meta"):  # shapes only: a 1.3 B model needs no 5 GB of weights here
        preset = build_preset(result["preset"], **result["overrides"])
    rows, slices, microbatches = result["batch"], result["num_slices"], result["num_microbatches"]
    profile = profile_layers(preset.model, lambda: preset.make_batch(rows, "cpu")[0], compute_dtype=dtype)
    layout = slice_layout(preset.model, num_slices=slices, compute_dtype=dtype)
    config = StepConfig(num_slices=slices, num_microbatches=microbatches, compute_dtype=dtype)
    from_flops = estimate_step_time(layout, profile, config, RATES)
    resident = result["runs"]["resident"]["median_forward_backward_s"]
    from_resident = estimate_step_time(layout, profile, config, RATES, device_seconds=(resident / 3, resident))
    memory = estimate_memory(preset.model, num_slices=slices, compute_dtype=dtype, num_microbatches=microbatches,
                             profile=profile)
    moved = traffic(layout, profile, config)
    offload = result["runs"]["offload"]
    return {
        "case": result["case"], "slices": slices, "microbatches": microbatches, "batch": rows,
        "measured_forward_backward_s": offload["median_forward_backward_s"],
        "measured_step_s": offload["median_step_s"],
        "resident_forward_backward_s": resident,
        "predicted_from_flops": from_flops.to_json(),
        "predicted_from_resident": from_resident.to_json(),
        "measured_loaded_bytes": offload.get("loaded_bytes_per_step"),
        "measured_offloaded_bytes": offload.get("offloaded_bytes_per_step"),
        "predicted_loaded_bytes": moved.forward_loads + moved.backward_loads,
        "predicted_offloaded_bytes": moved.forward_offloads + moved.backward_offloads,
        "measured_peak_device_bytes": offload.get("peak_device_bytes"),
        "predicted_device_bytes": memory.device_total,
        "forward_flops": profile.forward_flops, "backward_flops": profile.backward_flops,
    }


def rows() -> list[dict[str, Any]]:
    table = []
    for path in sorted(RESULTS.glob("run*_benchmark_*.json")):
        run = path.name.split("_")[0]
        for result in json.loads(path.read_text())["results"]:
            if "offload" in result["runs"]:
                table.append({"run": run, "file": path.name} | predict(result))
    return table


def markdown(table: list[dict[str, Any]]) -> str:
    def ms(s: float) -> str:
        return f"{s * 1e3:,.0f}" if s >= 0.1 else f"{s * 1e3:.1f}"

    lines = ["| case | run | slices, mb | fwd+bwd measured | from ops | from resident | step measured | "
             "from ops | from resident | ratio (resident) | loaded GB meas. / pred. | offloaded GB meas. / pred. | "
             "device peak GiB meas. / pred. |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in table:
        ops, res = r["predicted_from_flops"], r["predicted_from_resident"]
        fb_ops, fb_res = ops["forward"] + ops["backward"], res["forward"] + res["backward"]
        lines.append(
            f"| {r['case']} | {r['run']} | {r['slices']}, {r['microbatches']} | {ms(r['measured_forward_backward_s'])} | "
            f"{ms(fb_ops)} | {ms(fb_res)} | {ms(r['measured_step_s'])} | {ms(ops['step'])} | {ms(res['step'])} | "
            f"{res['step'] / r['measured_step_s']:.2f} | {r['measured_loaded_bytes'] / GB:.2f} / "
            f"{r['predicted_loaded_bytes'] / GB:.2f} | {r['measured_offloaded_bytes'] / GB:.2f} / "
            f"{r['predicted_offloaded_bytes'] / GB:.2f} | {r['measured_peak_device_bytes'] / 2**30:.2f} / "
            f"{r['predicted_device_bytes'] / 2**30:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the Markdown table; a .json beside it holds every figure")
    args = parser.parse_args()
    table = rows()
    text = markdown(table)
    print(text)
    header = (f"# The planner beside the H100 runs ({datetime.date.today()})\n\n"
              f"Written by `python benchmarks/planner_vs_h100.py --out {args.out}` from "
              f"`benchmarks/results/h100-2026-11-22/run*_benchmark_*.json`; times in ms. Rates: {RATES.name}. "
              "See the script's docstring for what each column is.\n\n"
              "- *from ops*: device time from the model's operations over the default rate; *from resident*: from "
              "the run's resident forward and backward; *ratio*: predicted step (from resident) / measured step.\n"
              "- Loaded and offloaded bytes are the copy engine's counters against the planner's count. Run 2's "
              "gpt-compute-bound-bf16 offloaded bfloat16 gradients (the code before the float32 gradient change); "
              "the planner counts float32 ones, as the library sends them now.\n"
              "- The measured device peak is `torch.cuda.max_memory_allocated` of the benchmark process, which also "
              "holds the resident model it compares against (its parameters, gradients and AdamW state: most of "
              "mlp's 0.73 GiB) and the loss on whole-batch logits (GPT cases); the planner's figure is the offloaded "
              "model's own, activations included, loss excluded. Not comparable beyond an upper bound.\n"
              "- Runs 2 to 6 ran on different machines; the host's AdamW rate moved by a third between them "
              "(h100-2026-11-22/README.md), which the one host rate used here cannot follow (runs 4 and 5).\n\n")
    args.out.write_text(header + text + "\n")
    args.out.with_suffix(".json").write_text(json.dumps({"rates": RATES.to_json(), "rows": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
