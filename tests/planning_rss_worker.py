"""Run in a process of its own by tests/test_planning.py: train one configuration on the CPU and
print, as JSON, the resident set's growth, the footprint, and what estimate_memory predicted from
the model's profile.

Usage: python tests/planning_rss_worker.py '{"preset": "mlp", "settings": {...}, "slices": 4, ...}'
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile

import torch

from offload import DiskTier, OffloadModel, OffloadOptimizer, estimate_memory
from offload.kernels import host_kernel
from offload.planning.planner import slice_layout
from offload.tiers.state_window import most_at_once
from offload.planning.presets import build_preset
from offload.planning.shapes import profile_layers

DTYPES = {None: None, "bfloat16": torch.bfloat16}


def rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def train(spec: dict, steps: int, directory: str) -> tuple[OffloadModel, OffloadOptimizer, object]:
    preset = build_preset(spec["preset"], **spec["settings"])
    if spec.get("lora"):
        import peft

        targets = [name for name, m in preset.model.named_modules() if isinstance(m, torch.nn.Linear)]
        peft.inject_adapter_in_model(peft.LoraConfig(r=8, target_modules=targets), preset.model)
    dtype = DTYPES[spec.get("compute_dtype")]
    masters = DiskTier(f"{directory}/masters") if spec.get("masters") == "disk" else None
    model = OffloadModel(preset.model, device="cpu", num_slices=spec["slices"], compute_dtype=dtype,
                         num_microbatches=spec.get("microbatches", 1), masters=masters)
    tier = DiskTier(f"{directory}/state") if spec.get("state") == "disk" else None
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-4, fused=True, disk_tier=tier)
    x, y = preset.make_batch(spec["batch"], "cpu")
    for _ in range(steps):
        preset.loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    optimizer.synchronize()
    return model, optimizer, preset


def main() -> None:
    spec = json.loads(sys.argv[1])
    # The one-pass update's kernel is loaded once a process, on a thread of its own (its code and
    # its check's tensors): before the measurement, not during it.
    host_kernel(wait=True)
    with tempfile.TemporaryDirectory() as directory:
        torch.manual_seed(0)
        warm = dict(spec, settings=dict(spec["settings"], **spec.get("warm", {})))
        os.mkdir(directory + "/warm")
        train(warm, 1, directory + "/warm")  # what a process sets up once
        gc.collect()
        baseline = rss()
        model, optimizer, preset = train(spec, 3, directory)
        gc.collect()
        grown = rss() - baseline
        dtype = DTYPES[spec.get("compute_dtype")]
        profile = profile_layers(preset.model, lambda: preset.make_batch(spec["batch"], "cpu")[0], compute_dtype=dtype)
        estimate = estimate_memory(preset.model, num_slices=spec["slices"], compute_dtype=dtype, device="cpu",
                                   num_microbatches=spec.get("microbatches", 1), optimizer_state=spec.get("state", "ram"),
                                   masters=spec.get("masters", "ram"), profile=profile)
        footprint = model.memory_footprint()
        host = estimate.host_total
        if spec.get("masters") == "disk":
            # Between steps no masters or gradients are in RAM; estimate_memory's window (as the
            # footprint's) counts three slices' of each, in RAM while the optimizer steps.
            layout = slice_layout(preset.model, num_slices=spec["slices"], compute_dtype=dtype)
            window = min(3, layout.num_slices)
            host -= most_at_once(layout.host_bytes, window) + most_at_once(layout.gradient_bytes, window)
        print(json.dumps({
            "rss_growth": grown,
            "footprint_host": footprint.host_total,
            "footprint_device": footprint.device_total,
            "estimate_host": host,
            # What both count: with the masters on disk, their window as well.
            "estimate_host_total": estimate.host_total,
            # Between steps the device holds its slots (host memory on the CPU) and, with
            # microbatches, the two buffers that sum gradients (estimate_memory's device_gradients
            # also counts a third, the slice's gradients while autograd produces them).
            "estimate_device": estimate.device_slots + (2 * estimate.device_gradients // 3
                                                        if spec.get("microbatches", 1) > 1 else 0),
            "estimate_disk_window": estimate.host_disk_window,
        }))
        del optimizer, model


if __name__ == "__main__":
    main()
