"""The planner against measurement: the shapes it profiles on fake tensors against a real run's,
its memory against ``memory_footprint()`` and the resident set, its link bytes against the copy
engine's counters, its step time against a step whose device work is a known sleep, and the
``offload plan`` / ``offload calibrate`` commands end to end."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer, estimate_memory
from offload.model import engine_of
from offload.planning.choose import Limits, choose
from offload.planning.planner import slice_layout
from offload.planning.presets import build_preset
from offload.planning.rates import GPU_DEFAULTS, HOST_DEFAULT, MachineRates, load_rates, save_rates
from offload.planning.shapes import profile_layers
from offload.planning.timing import StepConfig, estimate_step_time, traffic

ROOT = Path(__file__).resolve().parent.parent
SMALL_TRANSFORMER = {"n_layers": 3, "d_model": 64, "n_heads": 4, "seq_len": 32, "vocab": 256}


def _real_saved(layers: nn.Sequential, x: Any) -> tuple[list[int], list[int]]:
    """Per layer: the bytes autograd saves (parameters left out) and the output's, on real tensors."""
    params = {p.untyped_storage().data_ptr() for p in layers.parameters()}
    saved_per_layer, outputs = [], []
    for layer in layers:
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in params:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            x = layer(x)
        saved_per_layer.append(sum(saved.values()))
        outputs.append(x.untyped_storage().nbytes())
    return saved_per_layer, outputs


@pytest.mark.parametrize("preset, settings", [("transformer", SMALL_TRANSFORMER), ("tiny", {})])
def test_the_fake_profile_counts_what_a_real_run_saves(preset, settings):
    model = build_preset(preset, **settings)
    x, _ = model.make_batch(4, "cpu")
    profile = profile_layers(model.model, lambda: model.make_batch(4, "cpu")[0])
    saved, outputs = _real_saved(model.model, x)
    assert [layer.saved_bytes for layer in profile.layers] == saved
    assert [layer.output_bytes for layer in profile.layers] == outputs
    assert profile.input_bytes == x.untyped_storage().nbytes() and profile.batch_size == 4
    # Operations: a Linear's forward is 2 x rows x in x out, its backward twice that.
    linear = model.model[0] if preset == "tiny" else model.model[-1]
    rows = 4 if preset == "tiny" else 4 * settings["seq_len"]
    layer = profile.layers[0] if preset == "tiny" else profile.layers[-1]
    assert layer.forward_flops == 2 * rows * linear.in_features * linear.out_features


def _step(model: OffloadModel, optimizer: OffloadOptimizer, preset: Any, rows: int) -> None:
    x, y = preset.make_batch(rows, "cpu")
    preset.loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)


@pytest.mark.parametrize("name, settings, slices, microbatches, dtype, lora", [
    ("transformer", SMALL_TRANSFORMER, 3, 1, None, False),
    ("transformer", SMALL_TRANSFORMER, 2, 2, torch.bfloat16, False),
    ("mlp", {"in_features": 64, "width": 128, "depth": 4, "classes": 10}, 4, 1, None, False),
    ("mlp", {"in_features": 64, "width": 128, "depth": 4, "classes": 10}, 3, 2, torch.bfloat16, True),
], ids=["transformer", "transformer-bf16-mb2", "mlp", "mlp-lora-bf16-mb2"])
def test_the_estimate_with_activations_matches_the_footprint_mid_step(name, settings, slices, microbatches, dtype, lora):
    """Host memory with the boundary activations in use (after a forward, before its backward)."""
    preset = build_preset(name, **settings)
    if lora:  # a frozen base, trainable adapters beside it
        import peft

        targets = [n for n, m in preset.model.named_modules() if isinstance(m, nn.Linear)]
        peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=targets), preset.model)
    rows = 8
    profile = profile_layers(preset.model, lambda: preset.make_batch(rows, "cpu")[0], compute_dtype=dtype)
    plan = estimate_memory(preset.model, num_slices=slices, compute_dtype=dtype, num_microbatches=microbatches,
                           device="cpu", profile=profile)
    model = OffloadModel(preset.model, device="cpu", num_slices=slices, compute_dtype=dtype,
                         num_microbatches=microbatches)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-4, fused=True)
    for _ in range(2):  # the steady state: the gradient window allocated
        _step(model, optimizer, preset, rows)
    optimizer.synchronize()
    x, y = preset.make_batch(rows, "cpu")
    loss = preset.loss(model(x), y)
    mid = model.memory_footprint()
    loss.backward()
    optimizer.step()
    optimizer.synchronize()
    after = model.memory_footprint()  # the activations' buffers idle in the pool, for the next step
    assert mid.host_activations == pytest.approx(plan.host_activations, rel=0.05)
    assert mid.host_total == pytest.approx(plan.host_total, rel=0.05)
    assert after.host_total == pytest.approx(plan.host_total, rel=0.05)
    assert plan.device_activations > 0 and plan.device_total > plan.device_slots


RSS_SPECS = {
    "mlp": {"preset": "mlp", "settings": {"in_features": 512, "width": 1536, "depth": 8, "classes": 1000},
            "warm": {"width": 16, "depth": 2}, "slices": 4, "batch": 64},
    "transformer-bf16-mb2": {"preset": "transformer", "settings": {"n_layers": 4, "d_model": 512, "n_heads": 8,
                                                                   "seq_len": 256, "vocab": 8192},
                             "warm": {"d_model": 64, "n_layers": 1, "vocab": 64}, "slices": 3, "batch": 8,
                             "compute_dtype": "bfloat16", "microbatches": 2},
    "mlp-disk-tier-masters-on-disk": {"preset": "mlp", "settings": {"in_features": 512, "width": 1536, "depth": 8,
                                                                    "classes": 1000},
                                      "warm": {"width": 16, "depth": 2}, "slices": 4, "batch": 64, "state": "disk",
                                      "masters": "disk", "compute_dtype": "bfloat16"},
    "mlp-lora": {"preset": "mlp", "settings": {"in_features": 512, "width": 1536, "depth": 8, "classes": 1000},
                 "warm": {"width": 16, "depth": 2}, "slices": 4, "batch": 64, "lora": True},
}


@pytest.mark.parametrize("spec", RSS_SPECS.values(), ids=RSS_SPECS.keys())
def test_the_estimate_predicts_the_resident_set_within_five_percent(spec):
    """The process's RSS growth over three steps (tests/planning_rss_worker.py, in its own process)
    against what estimate_memory holds between steps. glibc's mmap threshold is fixed: by default
    it rises after the first large free, and freed temporaries of the step then stay resident."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               MALLOC_MMAP_THRESHOLD_="65536")
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "planning_rss_worker.py"), json.dumps(spec)],
                          check=True, timeout=300, capture_output=True, text=True, env=env)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    predicted = result["estimate_host"] + result["estimate_device"]
    assert predicted == pytest.approx(result["rss_growth"], rel=0.05), result
    assert result["estimate_host"] == pytest.approx(result["footprint_host"], rel=0.05), result
