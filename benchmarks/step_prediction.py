"""The planner's prediction beside each run of ``benchmarks/bench_peers.py``, for the machine it ran on.

For every offloaded run of a report (``offload``, ``offload-in-backward``, ``offload-clip``, each
with or without resident slices) the planner predicts the same model, batch, slices, schedule and
resident slices two ways:

- **from resident**: the device's forward and backward from the report's own ``resident`` run,
  which checkpoints every decoder layer as the offloaded model checkpoints every slice: a forward,
  a recompute and a backward of twice the forward's work, so a quarter of it forward and three
  quarters the recompute and backward (a third and all of it, as before 2026-11-28, counted the
  recompute twice: 744 ms predicted where 582 ran at 32 x 1024 tokens on an H200); what the
  offload model (link, overlap, update) adds to the device's own time;
- **from ops**: the device's time from the model's operations over the ``h100-sxm`` default rate
  (an H200 has the H100's matrix rate).

Both take the link from the report's pinned copies (each way), the host's update from its fused
AdamW alone over the model's float32 tensors (``host_update_alone_s``), the host's memory
bandwidth (the shadow's pass) from its copy of a few GB (``host_bandwidth``), the rest from the
``h100-sxm`` defaults. A clipped run is the ``overlapped`` schedule (clipping cannot start the
update in backward) with the clipping's own term: the norm read on one thread at the report's
``host_norm_bytes_per_s``, the scaling at its host memory bandwidth; since 2026-11-29 the clipped
runs compute the norms in backward (``norms_in_backward``), and the prediction says so (what of the
norms backward does not cover, then the scaling); since the same day they scale in the update
(``scale_in_update``), and the prediction adds the scaling to the update.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

#: A run's schedule as the planner names it.
SCHEDULE_OF = {"offload": "overlapped", "offload-clip": "overlapped", "offload-in-backward": "in-backward",
               "offload-sync": "serial"}


def schedule_and_resident(name: str, default_resident: int) -> tuple[str, int] | None:
    """``offload-in-backward-resident6`` -> ``("in-backward", 6)``; ``None`` for a run the planner
    does not model (the resident model, the peers, the variants that take a step apart)."""
    match = re.fullmatch(r"(offload(?:-in-backward|-clip|-sync)?)(-resident(\d*))?", name)
    if match is None:
        return None
    resident = 0 if match[2] is None else int(match[3]) if match[3] else default_resident
    return SCHEDULE_OF[match[1]], resident


def rates_of(report: dict[str, Any]):
    """The ``h100-sxm`` defaults with the report's own link, host update and host memory bandwidth."""
    from offload.planning.rates import ADAMW_BYTES_PER_PARAMETER, GPU_DEFAULTS

    link = report["bandwidth_bytes_per_s"]
    changes: dict[str, Any] = {"name": f"h100-sxm defaults; link and host update of {report['device_name']}",
                               "host_to_device": link["host_to_device"], "device_to_host": link["device_to_host"]}
    if report.get("host_bandwidth"):
        changes["host_memory_bandwidth"] = report["host_bandwidth"]["bytes_per_s"]
    if report.get("host_norm_bytes_per_s"):
        changes["host_norm"] = report["host_norm_bytes_per_s"]
    if report.get("host_update_alone_s"):
        changes["host_update"] = ADAMW_BYTES_PER_PARAMETER * report["parameters"] / report["host_update_alone_s"]
    return dataclasses.replace(GPU_DEFAULTS["h100-sxm"], **changes)


def predict(report: dict[str, Any]) -> None:
    """Add ``planner`` (``from_resident``, ``from_ops``: step, forward and backward, update, exposed
    update, in seconds) to each offloaded run of ``report`` the planner models."""
    import transformers

    from offload.integrations.transformers import causal_lm_sequential
    from offload.planning.planner import slice_layout
    from offload.planning.shapes import profile_layers
    from offload.planning.timing import StepConfig, estimate_step_time

    runs, sizes = report["runs"], report["sizes"]
    wanted = {n: schedule_and_resident(n, report["resident_slices"]) for n in runs}
    wanted = {n: w for n, w in wanted.items() if w is not None}
    if not wanted:
        return
    rates, dtype, slices = rates_of(report), torch.bfloat16, report["num_slices"]
    config = transformers.LlamaConfig(
        vocab_size=sizes["vocab"], hidden_size=sizes["hidden"], intermediate_size=sizes["intermediate"],
        num_hidden_layers=sizes["layers"], num_attention_heads=sizes["heads"], num_key_value_heads=sizes["kv_heads"],
        max_position_embeddings=sizes["seq"], use_cache=False, tie_word_embeddings=False)
    with torch.device("meta"):  # shapes only
        layers = causal_lm_sequential(transformers.LlamaForCausalLM(config))
    profile = profile_layers(layers, lambda: torch.zeros(sizes["batch"], sizes["seq"], dtype=torch.long),
                             compute_dtype=dtype)
    layout = slice_layout(layers, num_slices=slices, compute_dtype=dtype)
    resident = runs.get("resident", {}).get("median_forward_backward_s")
    for name, (schedule, count) in wanted.items():
        step_config = StepConfig(num_slices=slices, compute_dtype=dtype, schedule=schedule, resident_slices=count,
                                 clips_gradients=name.startswith("offload-clip"),
                                 norms_in_backward=name.startswith("offload-clip"),  # as bench_peers' clipped runs
                                 scale_in_update=name.startswith("offload-clip"))
        ways = {"from_ops": estimate_step_time(layout, profile, step_config, rates)}
        if resident:
            ways["from_resident"] = estimate_step_time(layout, profile, step_config, rates,
                                                       device_seconds=(resident / 4, resident * 3 / 4))
        runs[name]["planner"] = {"schedule": schedule, "resident_slices": count} | {
            way: {"step": t.step, "forward_backward": t.forward + t.backward, "update": t.update,
                  "exposed": t.exposed_update, "clip": t.clip} for way, t in ways.items()}
    report["planner_rates"] = rates.to_json()
