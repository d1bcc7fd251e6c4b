"""The planner's update schedules beside one H100's: the default (the update behind the next
forward) and the update during backward, for the Llama-shaped model of ``benchmarks/bench_peers.py``.

The run (``benchmarks/results/h100-2026-11-26b/peers2.json``, one call) timed the same model, batch
and configuration (0.886 B parameters, bf16 compute, 18 slices, batch 8 x 1024, fused AdamW) as
``offload`` (the default schedule) and ``offload-in-backward`` (``update_in_backward=True``).
The planner predicts each schedule three ways, to tell its schedule model from its rates:

- **from ops**: everything predicted: the device's time from the model's operations over
  790 TFLOP/s, the link at 54.9 GB/s, the host's update at the rate of this run's fused AdamW over
  the model's float32 tensors alone (``host_update_alone_s``);
- **from resident**: the device's time from the run's resident forward and backward (a third of it
  forward, all of it again for recompute and backward), the rest as above;
- **from the run's parts**: the schedule model alone (:func:`~offload.planning.timing.exposed_update`)
  given the offloaded run's own forward and backward (``offload``'s, a third of it forward) and the
  update as long as ``OffloadOptimizer``'s update measured alone after backward (``offload-sync``'s
  ``synchronize()`` in ``peers.json``, an earlier call of the same session: the shadow included).

With ``--resident K ...`` it predicts instead, "from resident" as above, each schedule with the
first ``K`` slices resident (``OffloadModel(..., resident_slices=K)``: no loads, gradient offloads or
host update for them, their update at the device's memory bandwidth), and the device memory they
add (``estimate_memory``): predictions for the next GPU run to be set beside, not measurements.

Usage::

    python benchmarks/planner_schedules_h100.py --out benchmarks/results/planner_schedules_h100_2026-11-26.md
    python benchmarks/planner_schedules_h100.py --resident 0 2 4 6 9 --out benchmarks/results/planner_resident_h100_2026-11-27.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from offload.planning.host_bytes import shadow_pass
from offload.planning.planner import slice_layout
from offload.planning.rates import load_rates
from offload.planning.timing import StepConfig, estimate_step_time, exposed_update, landed_gradients

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "benchmarks" / "results" / "h100-2026-11-26b"
RATES = ROOT / "benchmarks" / "results" / "h100-2026-11-26" / "rates_h100_host.json"
LLAMA = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
         "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8,
         "max_position_embeddings": 1024, "tie_word_embeddings": False}
#: The planner's schedule -> the run's variant of it.
MEASURED = {"overlapped": "offload", "in-backward": "offload-in-backward"}


def _model() -> tuple[dict[str, Any], Any, Any, Any]:
    """The run, its rates (the host update at the run's AdamW rate), the model's layers (on the
    meta device) and their profile for the run's batch."""
    import transformers

    from offload.integrations.transformers import causal_lm_sequential
    from offload.planning.shapes import profile_layers

    run = json.loads((RUN / "peers2.json").read_text())
    rates = dataclasses.replace(load_rates(RATES), name="h100 host, AdamW rate of peers2.json",
                                host_update=28 * run["parameters"] / run["host_update_alone_s"])
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**LLAMA),
                                                           dtype=torch.float32)
    layers = causal_lm_sequential(hf)  # logits, as bench_peers computes its loss
    rows, tokens = run["sizes"]["batch"], run["sizes"]["seq"]
    profile = profile_layers(layers, lambda: torch.zeros(rows, tokens, dtype=torch.long), compute_dtype=torch.bfloat16)
    return run, rates, layers, profile


def resident_predictions(counts: list[int]) -> dict[str, Any]:
    """Per resident count and schedule, the predicted step (device time from the run's resident
    forward and backward) and the device bytes the resident slices add."""
    from offload import estimate_memory

    run, rates, layers, profile = _model()
    slices, dtype = run["num_slices"], torch.bfloat16
    layout = slice_layout(layers, num_slices=slices, compute_dtype=dtype)
    resident = run["runs"]["resident"]["median_forward_backward_s"]
    table: dict[str, Any] = {}
    for count in counts:
        memory = estimate_memory(layers, num_slices=slices, compute_dtype=dtype, resident_slices=count)
        row: dict[str, Any] = {"device_resident_bytes": memory.device_resident + memory.device_resident_gradients
                               + memory.device_resident_optimizer_state}
        for schedule in ("overlapped", "in-backward"):
            config = StepConfig(num_slices=slices, compute_dtype=dtype, schedule=schedule, resident_slices=count)
            step = estimate_step_time(layout, profile, config, rates, device_seconds=(resident / 3, resident))
            row[schedule] = {"step": step.step, "update": step.update, "exposed": step.exposed_update}
        table[str(count)] = row
    return {"rates": rates.to_json(), "run": str((RUN / "peers2.json").relative_to(ROOT)),
            "measured_resident_step_s": run["runs"]["resident"]["median_step_s"], "resident_slices": table}


def resident_markdown(result: dict[str, Any]) -> str:
    lines = ["| resident slices | device GiB added | overlapped step (exposed) | in-backward step (exposed) |",
             "| ---: | ---: | ---: | ---: |"]
    for count, row in result["resident_slices"].items():
        cells = [f"{row[s]['step'] * 1e3:.0f} ({row[s]['exposed'] * 1e3:.0f})" for s in ("overlapped", "in-backward")]
        lines.append(f"| {count} | {row['device_resident_bytes'] / 2**30:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def predictions() -> dict[str, Any]:
    """The planner's predictions of the measured run's schedules; that run wrote each shadow in a
    pass of its own (before the one-pass update) and sent every gradient in float32 (before the
    gradients added on the host left in the compute dtype), and is predicted so."""
    with shadow_pass(in_update=False), landed_gradients(in_compute_dtype=False):
        return _predictions()


def _predictions() -> dict[str, Any]:
    import transformers

    from offload.integrations.transformers import causal_lm_sequential
    from offload.planning.shapes import profile_layers

    run = json.loads((RUN / "peers2.json").read_text())
    update_alone = json.loads((RUN / "peers.json").read_text())["runs"]["offload-sync"]["median_synchronize_s"]
    sizes, slices, dtype = run["sizes"], run["num_slices"], torch.bfloat16
    parameters = run["parameters"]
    rates = dataclasses.replace(load_rates(RATES), name="h100 host, AdamW rate of peers2.json",
                                host_update=28 * parameters / run["host_update_alone_s"])
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**LLAMA),
                                                           dtype=torch.float32)
    layers = causal_lm_sequential(hf)  # logits, as bench_peers computes its loss
    rows, tokens = sizes["batch"], sizes["seq"]
    profile = profile_layers(layers, lambda: torch.zeros(rows, tokens, dtype=torch.long), compute_dtype=dtype)
    layout = slice_layout(layers, num_slices=slices, compute_dtype=dtype)
    resident = run["runs"]["resident"]["median_forward_backward_s"]
    own = run["runs"]["offload"]["median_forward_backward_s"]
    table: dict[str, Any] = {}
    for schedule in ("overlapped", "in-backward", "serial"):
        config = StepConfig(num_slices=slices, compute_dtype=dtype, schedule=schedule)
        from_ops = estimate_step_time(layout, profile, config, rates)
        from_resident = estimate_step_time(layout, profile, config, rates, device_seconds=(resident / 3, resident))
        exposed = exposed_update(schedule, own / 3, 2 * own / 3, update_alone, layout.gradient_bytes,
                                 rates.device_to_host)
        measured = run["runs"].get(MEASURED.get(schedule, ""), {})
        table[schedule] = {
            "from_ops": {"step": from_ops.step, "forward_backward": from_ops.forward + from_ops.backward,
                         "update": from_ops.update, "exposed": from_ops.exposed_update},
            "from_resident": {"step": from_resident.step,
                              "forward_backward": from_resident.forward + from_resident.backward,
                              "update": from_resident.update, "exposed": from_resident.exposed_update},
            "from_parts": {"step": own + exposed, "forward_backward": own, "update": update_alone, "exposed": exposed},
            "measured": {"step": measured.get("median_step_s"),
                         "forward_backward": measured.get("median_forward_backward_s"),
                         "exposed": measured.get("median_exposed_update_s")},
        }
    return {"rates": rates.to_json(), "run": str((RUN / "peers2.json").relative_to(ROOT)),
            "update_alone_s": update_alone, "schedules": table}


def markdown(result: dict[str, Any]) -> str:
    def ms(s: float | None) -> str:
        return "" if s is None else f"{s * 1e3:.0f}"

    table = result["schedules"]
    lines = ["| schedule | measured step (exposed) | from ops | from resident | from the run's parts |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for schedule, r in table.items():
        m = r["measured"]
        measured = f"{ms(m['step'])} ({ms(m['exposed'])})" if m["step"] is not None else "not run"
        lines.append(f"| {schedule} | {measured} | " + " | ".join(
            f"{ms(r[k]['step'])} ({ms(r[k]['exposed'])})" for k in ("from_ops", "from_resident", "from_parts")) + " |")
    gain = {k: table["overlapped"][k]["step"] - table["in-backward"][k]["step"]
            for k in ("measured", "from_ops", "from_resident", "from_parts")}
    lines.append("| overlapped - in-backward | " + " | ".join(ms(gain[k]) for k in gain) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True,
                        help="the Markdown table; a .json beside it holds every figure")
    parser.add_argument("--resident", type=int, nargs="+", metavar="K",
                        help="predict the schedules with these numbers of resident slices instead")
    args = parser.parse_args()
    if args.resident:
        resident = resident_predictions(args.resident)
        table = resident_markdown(resident)
        print(table)
        args.out.write_text(
            "# The planner's prediction with resident slices, for the H100 run's model (not measured)\n\n"
            f"Written by `python benchmarks/planner_schedules_h100.py --resident {' '.join(map(str, args.resident))} "
            f"--out {args.out}` from `{resident['run']}`: step and (in brackets) exposed update in ms, device time "
            "from the run's resident forward and backward, the host update at the run's AdamW rate, the resident "
            "slices' update at the device's memory bandwidth (datasheet x 0.8). The resident model's measured step: "
            f"{resident['measured_resident_step_s'] * 1e3:.0f} ms.\n\n" + table + "\n")
        args.out.with_suffix(".json").write_text(json.dumps(resident, indent=2) + "\n")
        return
    result = predictions()
    text = markdown(result)
    print(text)
    header = (f"# The planner's schedules beside the H100 run (2026-11-26)\n\n"
              f"Written by `python benchmarks/planner_schedules_h100.py --out {args.out}` from `{result['run']}`; "
              "step and (in brackets) exposed update in ms. See the script's docstring for the columns. "
              f"The update alone after backward took {result['update_alone_s'] * 1e3:.0f} ms (peers.json, "
              "offload-sync).\n\n")
    args.out.write_text(header + text + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
