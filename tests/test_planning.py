"""The planner against measurement: the shapes it profiles on fake tensors against a real run's,
its memory against ``memory_footprint()`` and the resident set, its link bytes against the copy
engine's counters, its step time against steps recorded on a "device" whose work is a known
sleep, and the ``offload plan`` / ``offload calibrate`` commands end to end."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import io
import json
import os
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from offload import OffloadModel, OffloadOptimizer, estimate_memory
from offload.cli.plan import code, finetune_flags, parse_args, report, run_plan
from offload.model import engine_of
from offload.planning.choose import DEVICE_MARGIN, RESIDENT_GAIN, Limits, choose
from offload.planning.host_bytes import shadow_pass
from offload.planning.planner import footprints_by_resident, slice_layout
from offload.planning.presets import build_preset
from offload.planning.rates import (DEVICE_MEMORY_BANDWIDTH_DEFAULT, GPU_DEFAULTS, HOST_DEFAULT, HOST_NORM_DEFAULT,
                                    MachineRates, load_rates, save_rates)
from offload.planning.shapes import _backward_flops, _cpu_attention_flops, profile_layers
from offload.planning.timing import StepConfig, estimate_step_time, landed_gradients, traffic

ROOT = Path(__file__).resolve().parent.parent
SMALL_TRANSFORMER = {"n_layers": 3, "d_model": 64, "n_heads": 4, "seq_len": 32, "vocab": 256}


def _figures(profile: Any) -> list[Any]:
    """A profile's figures as the planner reads them: each layer's saved bytes in total and its
    largest saved tensor (a storage's id is an address: it differs by run)."""
    return [profile.input_bytes, profile.batch_size] + [
        (layer.forward_flops, layer.backward_flops, layer.saved_bytes, max(layer.saved.values(), default=0),
         layer.output_bytes, layer.summing)
        for layer in profile.layers]


@pytest.mark.parametrize(("trained", "dtype"), [("all", None), ("all", torch.bfloat16), ("lora", None),
                                                ("head", None)])
def test_a_chunked_loss_is_profiled_in_a_few_chunks_with_the_figures_of_every_chunk(trained, dtype, monkeypatch):
    """Note: [Loss chunks profiled once]: 100 tokens in chunks of 16 run the first chunk, the last
    4 tokens and one chunk alone for the other five's operations, whatever the batch, and the
    profile is the one of the loop over all seven, operation for operation and byte for byte; with
    the head's input trained, its adapters, or the head's weight alone."""
    transformers = pytest.importorskip("transformers")
    from offload.integrations.transformers import causal_lm_sequential
    from offload.integrations.transformers_layers import Head
    from offload.planning.loss_chunks import RepeatedChunks

    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**TINY_LLAMA))
    if trained == "lora":
        peft = pytest.importorskip("peft")
        hf = peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    elif trained == "head":
        hf.requires_grad_(False)
        hf.lm_head.requires_grad_(True)
    layers = causal_lm_sequential(hf, loss_chunk_tokens=16)

    def make_input() -> dict[str, torch.Tensor]:
        ids = torch.zeros(5, 20, dtype=torch.long)
        return {"input_ids": ids, "labels": ids}

    chunks = []
    chunk = Head._chunk
    monkeypatch.setattr(Head, "_chunk", lambda self, hidden, targets: chunks.append(len(hidden)) or chunk(
        self, hidden, targets))
    few = profile_layers(layers, make_input, compute_dtype=dtype)
    assert chunks == [16, 4, 16]
    chunks.clear()
    monkeypatch.setattr(RepeatedChunks, "patched", lambda self, layer, index: contextlib.nullcontext())
    every = profile_layers(layers, make_input, compute_dtype=dtype)
    assert chunks == [16] * 6 + [4]
    assert _figures(few) == _figures(every)
    assert few.layers[-1].forward_flops == 2 * 100 * 64 * 256 and few.layers[-1].saved


def test_a_chunked_loss_profiles_a_huge_batch_in_a_few_entries_and_megabytes():
    """Note: [Loss chunks profiled once], rule 5: the loop's chunks' losses are two entries of the
    head's saved bytes (the full chunks, the rest), not one a chunk, so that the profile's memory
    does not grow with the batch (10**10 rows took 7.5 GB, 10**12 were killed)."""
    import tracemalloc

    transformers = pytest.importorskip("transformers")
    from offload.integrations.transformers import causal_lm_sequential

    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**TINY_LLAMA))
    layers = causal_lm_sequential(hf, loss_chunk_tokens=16)

    def profile(rows: int) -> Any:
        def make_input() -> dict[str, torch.Tensor]:
            ids = torch.zeros(rows, 2, dtype=torch.long)
            return {"input_ids": ids, "labels": ids}
        return profile_layers(layers, make_input, compute_dtype=torch.bfloat16)

    few, many = profile(1000), profile(100_000)  # 125 and 12500 chunks
    assert len(many.layers[-1].saved) == len(few.layers[-1].saved) < 10
    assert many.layers[-1].saved_bytes - few.layers[-1].saved_bytes >= 99_000 * 2 * 4  # every chunk's losses
    tracemalloc.start()
    try:
        huge = profile(10**12)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20 and len(huge.layers[-1].saved) == len(few.layers[-1].saved)


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


_MLP = {"preset": "mlp", "settings": {"in_features": 512, "width": 1024, "depth": 8, "classes": 1000},
        "warm": {"width": 16, "depth": 2}, "slices": 4, "batch": 64}
RSS_SPECS = {
    "mlp": _MLP,
    "transformer-bf16-mb2": {"preset": "transformer", "settings": {"n_layers": 3, "d_model": 384, "n_heads": 6,
                                                                   "seq_len": 128, "vocab": 4096},
                             "warm": {"d_model": 48, "n_layers": 1, "vocab": 64}, "slices": 3, "batch": 8,
                             "compute_dtype": "bfloat16", "microbatches": 2},
    "mlp-disk-tier-masters-on-disk": _MLP | {"state": "disk", "masters": "disk", "compute_dtype": "bfloat16"},
    "mlp-lora": _MLP | {"lora": True},
}


@pytest.mark.parametrize("spec", RSS_SPECS.values(), ids=RSS_SPECS.keys())
def test_the_estimate_predicts_the_resident_set_within_five_percent(spec):
    """The process's RSS growth over three steps (tests/planning_rss_worker.py, in its own process)
    against what estimate_memory holds between steps. glibc's mmap threshold is fixed: by default
    it rises after the first large free, and freed temporaries of the step then stay resident."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="2", MALLOC_ARENA_MAX="2")  # threads' stacks, arenas
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "planning_rss_worker.py"), json.dumps(spec)],
                          check=True, timeout=300, capture_output=True, text=True, env=env)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    predicted = result["estimate_host"] + result["estimate_device"]
    assert predicted == pytest.approx(result["rss_growth"], rel=0.05), result
    assert result["estimate_host_total"] == pytest.approx(result["footprint_host"], rel=0.05), result


@pytest.mark.parametrize("slices, microbatches, dtype, resident", [
    (2, 1, None, 0), (4, 1, None, 0), (5, 2, None, 0), (4, 1, torch.bfloat16, 0), (4, 1, None, 2),
    (5, 2, torch.bfloat16, 3), (3, 1, None, 3)])
def test_the_link_bytes_are_the_copy_engines(slices, microbatches, dtype, resident):
    """What the time model puts on the link, against the engine's counters over one step (a
    resident slice's device copies do not cross it)."""
    preset = build_preset("transformer", **SMALL_TRANSFORMER)
    rows = 8
    profile = profile_layers(preset.model, lambda: preset.make_batch(rows, "cpu")[0], compute_dtype=dtype)
    layout = slice_layout(preset.model, num_slices=slices, compute_dtype=dtype)
    moved = traffic(layout, profile, StepConfig(num_slices=slices, num_microbatches=microbatches, compute_dtype=dtype,
                                                resident_slices=resident))
    model = OffloadModel(preset.model, device="cpu", num_slices=slices, compute_dtype=dtype,
                         num_microbatches=microbatches, resident_slices=resident)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-4, fused=True)
    _step(model, optimizer, preset, rows)
    before = engine_of(model).traffic()
    _step(model, optimizer, preset, rows)
    loaded, offloaded = (a - b for a, b in zip(engine_of(model).traffic(), before))
    assert loaded == pytest.approx(moved.forward_loads + moved.backward_loads, rel=0.01)
    assert offloaded == pytest.approx(moved.forward_offloads + moved.backward_offloads, rel=0.01)


SLEEPING_DEVICE = ROOT / "benchmarks" / "results" / "planner_vs_sleeping_device_cpu_2026-11-28.json"


def _sleeping_device_script() -> Any:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import planner_vs_sleeping_device
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return planner_vs_sleeping_device


@pytest.mark.parametrize("index", range(4), ids=["overlapped-0.01-20", "serial-0.01-20", "overlapped-0.005-50",
                                                  "in-backward-0.005-50"])
def test_the_step_time_is_predicted_within_fifteen_percent_on_a_sleeping_device(index):
    """The time model against steps measured on a CPU "device" whose layers sleep a known time
    (``benchmarks/planner_vs_sleeping_device.py``, its docstring says what runs for real and what
    sleeps): each case predicted again, with the time model as it stands, from the rates measured
    in that case's rounds, against the median of the steps measured then; and nearer it than the
    other schedule measured at the same sleeps. The steps are recorded, not timed here: a test
    that timed this machine would follow its load, not the model."""
    script = _sleeping_device_script()
    recorded = json.loads(SLEEPING_DEVICE.read_text())
    case = recorded["cases"][index]
    assert (case["schedule"], case["seconds"], case["ns_per_parameter"]) == script.CASES[index]
    assert case["size"] == script.SIZE and recorded["tolerance"] == 0.15
    layout = slice_layout(script.sleepy_layers(case["size"], case["seconds"], case["slices"]), num_slices=case["slices"])
    predicted = script.predict(case, layout)
    measured = case["median_step_s"]
    assert predicted.step == pytest.approx(measured, rel=0.15), (predicted, case["steps_s"])
    if case["schedule"] == "in-backward":  # every slice's update started in backward
        assert all(s == list(range(case["slices"])) for s in case["started_in_backward"])
    # The other schedule measured at the same sleeps, predicted from this case's rates, is further
    # from this case's step: the model tells the schedules apart where the cases do.
    other, = (s for s, seconds, _ in script.CASES if seconds == case["seconds"] and s != case["schedule"])
    apart = script.predict(case, layout, schedule=other)
    assert abs(predicted.step - measured) < abs(apart.step - measured), (predicted, apart, measured)
    if case["seconds"] == 0.005:  # where the two schedules' predictions are well apart
        assert abs(apart.step - predicted.step) > 0.15 * predicted.step, (predicted, apart)


def test_the_sleeping_device_script_records_what_the_time_model_reads(tmp_path):
    """The script at toy sizes (``--quick``): each case's recorded prediction is the time model's
    from the rates it recorded beside it, which is what the test above predicts from."""
    script = _sleeping_device_script()
    out = tmp_path / "sleeping.json"
    script.main(["--quick", "--json", str(out)])
    recorded = json.loads(out.read_text())
    assert recorded["command"] == f"python benchmarks/planner_vs_sleeping_device.py --quick --json {out}"
    assert [(c["schedule"], c["ns_per_parameter"]) for c in recorded["cases"]] == [c[::2] for c in script.CASES]
    for case in recorded["cases"]:
        assert case["median_step_s"] == statistics.median(case["steps_s"]) > 0
        assert case["predicted_step_s"] == script.predict(case).step > 0
        assert (case["started_in_backward"] is None) == (case["schedule"] != "in-backward")


def test_the_rates_have_sources_and_survive_a_file(tmp_path):
    for name, rates in GPU_DEFAULTS.items():
        assert {"device_flops", "host_to_device", "device_to_host"} <= set(rates.sources), name
        assert rates.flops_for("bfloat16") > rates.flops_for("float32") > 0 and rates.device_memory
    assert GPU_DEFAULTS["h100-sxm"].flops_for("bfloat16") == 790e12
    path = save_rates(GPU_DEFAULTS["a100"].with_host(HOST_DEFAULT), tmp_path / "rates.json")
    assert load_rates(path) == GPU_DEFAULTS["a100"].with_host(HOST_DEFAULT)
    with pytest.raises(FileNotFoundError, match="offload calibrate"):
        load_rates(tmp_path / "none.json")
    # Rates without device rates (a record of measured device seconds) say which one is missing.
    for dtype, missing in (("float32", "float32"), ("bfloat16", "bfloat16 or float32")):
        with pytest.raises(ValueError, match=rf"^default host: no device rate for {missing}; run"):
            HOST_DEFAULT.flops_for(dtype)


def _offload(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``offload ARGS`` in this process (``offload/cli/main.py``), its output captured."""
    from offload.cli.main import main

    out = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out):
        try:
            main(list(args))
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
    if check and code:
        raise AssertionError(f"offload {' '.join(args)} exited with {code}:\n{out.getvalue()}")
    return subprocess.CompletedProcess(args, code, out.getvalue(), "")


def test_calibrate_writes_rates_that_plan_reads(tmp_path, capsys):
    """``python -m offload calibrate`` as a user runs it, then ``plan`` reading its file: a CPU's
    rates plan ``--device cpu``, or a GPU given with ``--gpu``, never the default CUDA device."""
    out = tmp_path / "rates.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-m", "offload", "calibrate", "--out", str(out), "--dir", str(tmp_path / "disk"),
                    "--device", "cpu"], check=True, capture_output=True, timeout=300, env=env)
    rates = load_rates(out)
    assert rates.host_copy > 0 and rates.host_update > 0 and rates.disk_read and rates.disk_write
    assert rates.host_memory_bandwidth > 0 and "host_memory_bandwidth" in rates.sources
    assert rates.host_norm > 0 and "host_norm" in rates.sources
    assert rates.device_flops["float32"] > 0
    done = _offload("plan", "--preset", "tiny", "--device", "cpu", "--rates", str(out), "--host-memory", "4", "--json")
    plan = json.loads(done.stdout)
    assert plan["chosen"]["fits"] and plan["rates"]["name"] == rates.name
    # No link: a CUDA plan from them would time its loads as copies in RAM, and have no device memory.
    assert rates.host_to_device == rates.device_to_host == 0 and rates.device_memory is None
    done = _offload("plan", "--preset", "tiny", "--rates", str(out), "--host-memory", "4", check=False)
    assert done.returncode == 2 and done.stdout == ""
    assert f"--rates {out}: rates of a CPU device, no link rates" in capsys.readouterr().err
    done = _offload("plan", "--preset", "tiny", "--gpu", "a100", "--rates", str(out), "--host-memory", "4", "--json")
    assert json.loads(done.stdout)["rates"]["name"] == f"a100 + host {rates.name}"


TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128,
              "tie_word_embeddings": False}


def test_plan_answers_for_a_hf_config_and_its_choice_builds_and_trains(tmp_path):
    transformers = pytest.importorskip("transformers")
    from offload.integrations.transformers import causal_lm_sequential

    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    done = _offload("plan", "--hf-config", str(config), "--batch-size", "4", "--seq-len", "32", "--gpu", "a100",
                    "--host-memory", "8", "--device-memory", "0.05", "--json")
    plan = json.loads(done.stdout)
    chosen = plan["chosen"]
    assert chosen["fits"] and chosen["device_bytes"] <= 0.9 * 0.05 * 2**30
    assert "OffloadModel(" in chosen["code"] and f"--num-slices {chosen['num_slices']}" in chosen["finetune"]
    # The configuration it printed builds and trains, on the CPU here.
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**TINY_LLAMA))
    layers = causal_lm_sequential(hf, loss_chunk_tokens=1024)
    dtype = getattr(torch, chosen["compute_dtype"]) if chosen["compute_dtype"] else None
    model = OffloadModel(layers, device="cpu", num_slices=chosen["num_slices"], compute_dtype=dtype,
                         num_microbatches=chosen["num_microbatches"], resident_slices=chosen["resident_slices"])
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, fused=True)
    ids = torch.randint(0, 256, (4, 32))
    losses = []
    for _ in range(3):
        loss = model({"input_ids": ids, "labels": ids}).sum() / (4 * 31)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_plan_says_what_is_missing(tmp_path):
    # Without resident slices: with them, this model fits the device whole and needs little host memory.
    args = ("plan", "--preset", "mlp", "--set", "width=1024", "depth=8", "--gpu", "h100-sxm", "--batch-size", "8",
            "--resident-slices", "0")
    done = _offload(*args, "--host-memory", "0.05", check=False)
    assert done.returncode == 1
    assert "nothing fits: needs" in done.stdout and "GiB of host memory" in done.stdout
    done = _offload(*args, "--host-memory", "0.15", "--disk-dir", str(tmp_path), "--disk", "10", check=False)
    assert f"with the disk tier on {tmp_path} it needs" in done.stdout or "chosen:" in done.stdout
    done = _offload(*args, "--host-memory", "8", "--device-memory", "0.001", check=False)
    assert "of device memory at the least" in done.stdout


def test_plan_for_an_nn_sequential_prints_the_calls_and_a_table():
    done = _offload("plan", "--model", "tests.test_planning:small_mlp", "--input-shape", "64", "--gpu", "rtx-4090",
                    "--host-memory", "8", "--batch-size", "16")
    assert "chosen:" in done.stdout and "model = OffloadModel(tests.test_planning.small_mlp()" in done.stdout
    assert "optimizer = OffloadOptimizer(model, torch.optim.AdamW" in done.stdout and "offload-finetune" not in done.stdout


def small_mlp() -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])


def test_choose_takes_the_fastest_that_fits():
    preset = build_preset("transformer", **SMALL_TRANSFORMER)
    rates = GPU_DEFAULTS["h100-sxm"]
    plan = choose(preset.model, lambda dtype: profile_layers(preset.model, lambda: preset.make_batch(8, "cpu")[0],
                                                             compute_dtype=dtype),
                  rates, Limits(device_memory=2**30, host_memory=2**30), batch_size=8)
    fitting = [c for c in plan.candidates if c.fits]
    assert plan.chosen is not None and plan.chosen.time.step <= 1.01 * min(c.time.step for c in fitting)
    with pytest.raises(ValueError, match="cannot fix"):
        choose(preset.model, lambda dtype: None, rates, Limits(None, None), fixed={"slices": 2})


def test_with_the_disk_tier_it_raises_the_slices_the_tier_needs(tmp_path):
    """The tier's window holds three slices' state (and masters): at 3 slices it saves almost
    nothing, so where RAM is short the choice puts the state on disk and cuts more slices."""
    with torch.device("meta"):
        preset = build_preset("mlp", width=1024, depth=8)
    layout = slice_layout(preset.model, num_slices=3, compute_dtype=torch.bfloat16)
    in_ram = estimate_memory(preset.model, num_slices=3, compute_dtype=torch.bfloat16, device="cpu")
    limits = Limits(device_memory=2**30, host_memory=int(0.75 * in_ram.host_total), disk=2**40,
                    disk_dir=str(tmp_path))
    plan = choose(preset.model, lambda dtype: profile_layers(preset.model, lambda: preset.make_batch(8, "cpu")[0],
                                                             compute_dtype=dtype),
                  GPU_DEFAULTS["a100"], limits, batch_size=8,
                  fixed={"compute_dtype": torch.bfloat16, "resident_slices": 0})  # resident, the model would fit
    assert plan.chosen is not None and plan.chosen.config.optimizer_state == "disk"
    assert plan.chosen.config.num_slices > 3 and layout.num_slices == 3
    at_three = [c for c in plan.candidates if c.config.num_slices == 3 and c.config.optimizer_state == "disk"]
    assert at_three and not any(c.fits for c in at_three)


class _MallInfo(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


class _PeakAllocated(TorchDispatchMode):
    """The peak of the bytes malloc has handed out, read after every operation (glibc's
    ``mallinfo2``: in use in the heap plus mapped chunks). On a CPU "device" this is the device's
    working set: the host buffers of the steady state are allocated already."""

    def __init__(self, mallinfo: Any) -> None:
        super().__init__()
        self.mallinfo = mallinfo
        self.peak = self.allocated()

    def allocated(self) -> int:
        info = self.mallinfo()
        return info.uordblks + info.hblkhd

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.allocated())
        return out


@pytest.mark.parametrize("slices, microbatches", [(2, 1), (3, 2), (6, 1), (6, 4)])
def test_the_device_activations_are_the_working_set_of_a_step(slices, microbatches):
    """The device's peak over a step beyond what it holds between steps, measured on a CPU
    "device" by malloc's own count, against the estimate's activations and one slice's gradients
    as autograd produces them (the buffers that sum microbatches are there between steps too)."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("needs glibc's mallinfo2 (glibc 2.33 or later) to read the bytes malloc handed out")
    libc.mallinfo2.restype = _MallInfo
    preset = build_preset("transformer", n_layers=6, d_model=128, n_heads=4, seq_len=256, vocab=64)
    rows = 8
    profile = profile_layers(preset.model, lambda: preset.make_batch(rows, "cpu")[0])
    plan = estimate_memory(preset.model, num_slices=slices, num_microbatches=microbatches, device="cpu",
                           profile=profile)
    model = OffloadModel(preset.model, device="cpu", num_slices=slices, num_microbatches=microbatches)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=1e-4, fused=True)
    x, y = preset.make_batch(rows, "cpu")
    for _ in range(3):
        _step(model, optimizer, preset, rows)
        optimizer.synchronize()
    with _PeakAllocated(libc.mallinfo2) as mode:
        start = mode.peak
        preset.loss(model(x), y).backward()
    slice_gradients = plan.device_gradients // (3 if microbatches > 1 else 1)
    assert plan.device_activations + slice_gradients == pytest.approx(mode.peak - start, rel=0.10)


def test_the_schedules_exposed_update_in_their_limits():
    """The per-slice simulations against what they come to in closed form, four equal slices."""
    from offload.planning.timing import exposed_in_backward, exposed_overlapped

    grads = [100] * 4
    # Behind the next forward: the update plus one slice's forward, or one slice's update, less the forward.
    assert exposed_overlapped(grads, forward=0.4, update=0.8) == pytest.approx(0.8 + 0.1 - 0.4)
    assert exposed_overlapped(grads, forward=0.4, update=0.2) == pytest.approx(0.05)
    # Started in backward, on a CPU "device" (slices land every backward / 4): a worker that keeps
    # up leaves the last slice's update; one that falls behind, the update less the backward after
    # the first slice landed.
    assert exposed_in_backward(grads, backward=1.2, update=0.4, device_to_host=None) == pytest.approx(0.1)
    assert exposed_in_backward(grads, backward=1.2, update=2.0, device_to_host=None) == pytest.approx(2.0 - 0.9)
    # On a GPU each slice's gradients land after their offload; slice 0's as the backward ends.
    assert exposed_in_backward(grads, backward=1.2, update=0.4, device_to_host=1000.0) == pytest.approx(0.1)
    assert exposed_in_backward([0] * 4, backward=1.0, update=1.0, device_to_host=None) == 0.0
    # Resident slices (no host update): the next forward runs them first, after their update on
    # the device (start), before it waits for the first streamed slice's host update.
    assert exposed_overlapped([0, 0, 1, 1], forward=0.4, update=0.2, start=0.1) == 0.0
    assert exposed_overlapped([0, 0, 1, 1], forward=0.4, update=1.0, start=0.1) == pytest.approx(1.1 - 0.1 - 0.4)
    # In backward: the worker is through at 0.3 + 1.0 + 1.0 (it starts when slice 3's land, 0.3);
    # the forward needs slice 2 after the device update (0.1) and two slices' forward (0.2).
    assert exposed_in_backward([0, 0, 1, 1], backward=1.2, update=2.0, device_to_host=None, forward=0.4,
                               start=0.1) == pytest.approx(2.3 - 1.2 - 0.1 - 0.2)
    assert exposed_in_backward([0, 0, 1, 1], backward=1.2, update=1.0, device_to_host=None, forward=0.4,
                               start=0.1) == 0.0  # through at 1.3, before the forward needs slice 2 (1.5)


def _mlp_plan(*flags: str) -> dict[str, Any]:
    """``offload plan --json`` for an MLP whose host update (the 2-core runner's rate) is about
    twice the H100's forward at this batch: long enough for the schedule to matter."""
    args = ("plan", "--preset", "mlp", "--set", "width=2048", "depth=8", "--gpu", "h100-sxm", "--host-memory", "8",
            "--batch-size", "4096", "--compute-dtype", "none", "--microbatches", "1", "--num-slices", "8",
            "--resident-slices", "0", "--json")  # the whole model would fit the device: every slice streamed
    return json.loads(_offload(*args, *flags).stdout)


def test_plan_chooses_the_update_in_backward_where_it_is_faster_and_prints_it():
    plan = _mlp_plan()
    chosen = plan["chosen"]
    by_schedule = {c["schedule"]: c["step_s"] for c in plan["candidates"]}
    assert set(by_schedule) == {"overlapped", "in-backward"}  # serial is never faster: not tried
    assert by_schedule["in-backward"] < 0.9 * by_schedule["overlapped"]
    assert chosen["schedule"] == "in-backward" and chosen["step_s"] == by_schedule["in-backward"]
    assert "update_in_backward=True" in chosen["code"] and plan["clips_gradients"] is False
    text = _offload("plan", "--preset", "mlp", "--set", "width=2048", "depth=8", "--gpu", "h100-sxm", "--host-memory",
                    "8", "--batch-size", "4096", "--compute-dtype", "none", "--microbatches", "1",
                    "--resident-slices", "0").stdout
    assert "in-backward" in text.split("chosen:")[1] and "update_in_backward=True)" in text
    assert "no clip_grad_norm_, no GradScaler" in text


def test_plan_never_chooses_the_update_in_backward_for_clipped_gradients():
    plan = _mlp_plan("--max-grad-norm", "1.0")
    assert plan["clips_gradients"] and plan["chosen"]["schedule"] == "overlapped"
    assert {c["schedule"] for c in plan["candidates"]} == {"overlapped"}
    assert "update_in_backward" not in plan["chosen"]["code"]
    # No --hf-config, no fine-tune command; the flag travels into it where there is one (below).
    assert plan["chosen"]["finetune"] is None
    done = _offload("plan", "--preset", "mlp", "--gpu", "h100-sxm", "--schedule", "in-backward", "--max-grad-norm",
                    "1.0", check=False)
    assert done.returncode == 2


def test_a_fixed_schedule_is_kept_and_in_backward_with_clipping_refused():
    plan = _mlp_plan("--schedule", "serial")
    assert {c["schedule"] for c in plan["candidates"]} == {"serial"} and plan["chosen"]["schedule"] == "serial"
    preset = build_preset("transformer", **SMALL_TRANSFORMER)
    with pytest.raises(ValueError, match="'in-backward' schedule cannot clip the gradients"):
        choose(preset.model, lambda dtype: None, GPU_DEFAULTS["h100-sxm"], Limits(None, None),
               fixed={"schedule": "in-backward"}, clips_gradients=True)
    with pytest.raises(ValueError, match="schedule must be one of"):
        choose(preset.model, lambda dtype: None, GPU_DEFAULTS["h100-sxm"], Limits(None, None),
               fixed={"schedule": "later"})


def test_clipping_costs_the_hosts_gradients_read_on_several_threads_then_scaled():
    """Hugging Face's Trainer clips at max_grad_norm=1.0 unless told otherwise: the norm of every
    host gradient (``offload.clip_grad_norm_``: on several threads, bounded by the memory's
    bandwidth and by the largest tensor read on one), then a pass that scales them, while the
    device waits."""
    preset = build_preset("transformer", **SMALL_TRANSFORMER)
    layout = slice_layout(preset.model, num_slices=4, compute_dtype=torch.bfloat16)
    rates = dataclasses.replace(GPU_DEFAULTS["h100-sxm"], host_norm=5e9, host_memory_bandwidth=50e9)
    for resident in (0, 2):
        config = StepConfig(num_slices=4, compute_dtype=torch.bfloat16, resident_slices=resident)
        plain = estimate_step_time(layout, None, config, rates, device_seconds=(0.01, 0.03))
        clipped = estimate_step_time(layout, None, replace(config, clips_gradients=True), rates,
                                     device_seconds=(0.01, 0.03))
        host = sum(layout.gradient_bytes[resident:])  # a resident slice's gradients are clipped on the device
        largest = max(layout.largest_gradient_bytes[resident:])
        norm = max(largest / 5e9, host / 50e9)
        assert plain.clip == 0 and clipped.clip == pytest.approx(norm + 2 * host / 50e9)
        assert clipped.step == pytest.approx(plain.step + clipped.clip)
    # One thread a tensor: a single large tensor's norm is bounded by the one-thread rate.
    one = slice_layout([50_000_000], num_slices=1)
    assert one.largest_gradient_bytes == [200_000_000]
    config = StepConfig(num_slices=1, clips_gradients=True)
    alone = estimate_step_time(one, None, config, rates, device_seconds=(0.01, 0.03))
    assert alone.clip == pytest.approx(200e6 / 5e9 + 2 * 200e6 / 50e9)
    # Many tensors of that size: the memory's bandwidth.
    many = slice_layout([5_000_000] * 40, num_slices=4)
    alone = estimate_step_time(many, None, replace(config, num_slices=4), rates, device_seconds=(0.01, 0.03))
    assert alone.clip == pytest.approx(3 * 800e6 / 50e9)
    # Unmeasured, a gradient's norm reads at the default one-thread rate.
    assert dataclasses.replace(rates, host_norm=None).host_norm_rate == HOST_NORM_DEFAULT
    with pytest.raises(ValueError, match="'in-backward' schedule cannot clip"):
        estimate_step_time(layout, None, StepConfig(num_slices=4, schedule="in-backward", clips_gradients=True),
                           rates, device_seconds=(0.01, 0.03))
    # The plan counts it, and says so.
    assert _mlp_plan("--max-grad-norm", "1.0")["chosen"]["step_s"] > _mlp_plan("--schedule", "overlapped")[
        "chosen"]["step_s"]
    text = _offload("plan", "--preset", "mlp", "--set", "width=2048", "depth=8", "--gpu", "h100-sxm", "--host-memory",
                    "8", "--resident-slices", "0", "--max-grad-norm", "1.0").stdout
    assert "clipping the gradients on the host" in text


def test_norms_in_backward_leave_the_first_streamed_slices_norms_and_what_backward_cannot_cover():
    """With the norms computed in backward (Note: [Norms from backward]) a slice at a time as each
    lands, the clip waits for the first streamed slice's norms (it lands last), or for the norms
    backward is too short to cover; the scaling stays."""
    preset = build_preset("transformer", **SMALL_TRANSFORMER)
    layout = slice_layout(preset.model, num_slices=4, compute_dtype=torch.bfloat16)
    rates = dataclasses.replace(GPU_DEFAULTS["h100-sxm"], host_norm=5e9, host_memory_bandwidth=50e9)
    for resident, backward_device in ((0, 0.03), (1, 0.03), (0, 1e-6)):
        config = StepConfig(num_slices=4, compute_dtype=torch.bfloat16, resident_slices=resident, clips_gradients=True)
        after = estimate_step_time(layout, None, config, rates, device_seconds=(0.01, backward_device))
        ahead = estimate_step_time(layout, None, replace(config, norms_in_backward=True), rates,
                                   device_seconds=(0.01, backward_device))
        per_slice = [max(largest / 5e9, nbytes / 50e9) for largest, nbytes in
                     zip(layout.largest_gradient_bytes[resident:], layout.gradient_bytes[resident:])]
        scaling = 2 * sum(layout.gradient_bytes[resident:]) / 50e9
        assert ahead.clip == pytest.approx(max(per_slice[0], sum(per_slice) - ahead.backward) + scaling)
        assert ahead.clip <= after.clip and ahead.step == pytest.approx(after.step - after.clip + ahead.clip)
    # The plan computes them in backward when it clips, and says so in its code; not with masters on disk.
    chosen = _mlp_plan("--max-grad-norm", "1.0")["chosen"]
    assert "norms_in_backward=True" in chosen["code"]
    assert "norms_in_backward" not in _mlp_plan("--schedule", "overlapped")["chosen"]["code"]
    plan = choose(preset.model, lambda dtype: profile_layers(preset.model, lambda: preset.make_batch(8, "cpu")[0],
                                                             compute_dtype=dtype),
                  rates, Limits(None, None, disk=2**40, disk_dir="/nvme"), batch_size=8, clips_gradients=True,
                  fixed={"num_slices": 4, "num_microbatches": 1})
    masters = {c.config.masters: c.config.norms_in_backward for c in plan.candidates}
    assert masters == {"ram": True, "disk": False}


def test_scaling_in_the_update_moves_the_clips_scaling_into_the_update_the_next_forward_overlaps():
    """With the clip's scaling in each slice's update (Note: [Scaling in the update]), the clip keeps
    only the norms, and the update grows by the scaling: by the write-back of the gradients alone
    where the one-pass update multiplies them as it reads them, by a pass of its own otherwise; the
    step waits for what the next forward does not cover of it."""
    preset = build_preset("transformer", **SMALL_TRANSFORMER)
    layout = slice_layout(preset.model, num_slices=4, compute_dtype=torch.bfloat16)
    rates = dataclasses.replace(GPU_DEFAULTS["h100-sxm"], host_norm=5e9, host_memory_bandwidth=50e9)
    for resident, forward_device, one_pass in ((0, 0.5, True), (1, 0.5, True), (0, 1e-6, True), (0, 0.5, False),
                                               (0, 1e-6, False)):
        config = StepConfig(num_slices=4, compute_dtype=torch.bfloat16, resident_slices=resident, clips_gradients=True,
                            norms_in_backward=True)
        with shadow_pass(one_pass):
            at_clip = estimate_step_time(layout, None, config, rates, device_seconds=(forward_device, 0.03))
            deferred = estimate_step_time(layout, None, replace(config, scale_in_update=True), rates,
                                          device_seconds=(forward_device, 0.03))
        scaling = 2 * sum(layout.gradient_bytes[resident:]) / 50e9
        added = scaling / 2 if one_pass else scaling
        assert deferred.clip == pytest.approx(at_clip.clip - scaling)
        assert deferred.update == pytest.approx(at_clip.update + added)
        assert deferred.step <= at_clip.step + 1e-12
        waited = deferred.exposed_update - at_clip.exposed_update  # the scaling the next forward does not hide
        assert deferred.step == pytest.approx(at_clip.step - scaling + waited) and 0 <= waited <= added + 1e-12
        if forward_device == 0.5:  # a long forward hides all but (at most) the first streamed slice's share
            assert waited <= added * layout.gradient_bytes[resident] / sum(layout.gradient_bytes[resident:]) + 1e-12
    # Gradients in files (masters on disk) are scaled at the clip all the same.
    config = StepConfig(num_slices=4, compute_dtype=torch.bfloat16, clips_gradients=True, masters="disk")
    on_disk = [estimate_step_time(layout, None, replace(config, scale_in_update=s), rates, device_seconds=(0.5, 0.03))
               for s in (False, True)]
    assert on_disk[1] == on_disk[0]
    chosen = _mlp_plan("--max-grad-norm", "1.0")["chosen"]
    assert "scale_in_update=True" in chosen["code"]
    assert "scale_in_update" not in _mlp_plan("--schedule", "overlapped")["chosen"]["code"]


def test_among_equal_steps_the_choice_keeps_the_update_behind_the_next_forward():
    """One slice: the update during backward starts as the backward ends, as step() would; the two
    schedules tie and the choice takes the one that allows clipping."""
    plan = _mlp_plan("--num-slices", "1")
    steps = {c["schedule"]: c["step_s"] for c in plan["candidates"]}
    assert steps["in-backward"] == pytest.approx(steps["overlapped"]) and plan["chosen"]["schedule"] == "overlapped"


def test_plan_for_a_hf_config_prints_the_fine_tune_flags_of_the_schedule(tmp_path):
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    common = ("plan", "--hf-config", str(config), "--batch-size", "4", "--seq-len", "32", "--gpu", "h100-sxm",
              "--host-memory", "8", "--compute-dtype", "none", "--microbatches", "1", "--num-slices", "4", "--json")
    for flags, schedule in ((("--schedule", "in-backward"), "in-backward"), (("--max-grad-norm", "0.5"), "overlapped")):
        chosen = json.loads(_offload(*common, *flags).stdout)["chosen"]
        assert chosen["schedule"] == schedule
        assert ("--update-in-backward" in chosen["finetune"]) == (schedule == "in-backward")
        assert ("--max-grad-norm 0.5" in chosen["finetune"]) == (schedule == "overlapped")


def test_the_h100_schedule_comparison_is_what_the_script_computes_now():
    """``benchmarks/results/planner_schedules_h100_2026-11-26.json`` (docs/planning.md's table)
    against the planner as it stands: a change to the time model shows here."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import planner_schedules_h100
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    recorded = json.loads((ROOT / "benchmarks" / "results" / "planner_schedules_h100_2026-11-26.json").read_text())
    now = planner_schedules_h100.predictions()
    for schedule, ways in recorded["schedules"].items():
        for way, figures in ways.items():
            for key, value in figures.items():  # None: serial was not measured
                got = now["schedules"][schedule][way][key]
                assert got == (None if value is None else pytest.approx(value, rel=1e-9)), (schedule, way, key)
    steps = {s: now["schedules"][s]["from_parts"]["step"] for s in ("overlapped", "in-backward", "serial")}
    assert steps["in-backward"] < steps["overlapped"] < steps["serial"]


# -- resident slices ------------------------------------------------------------------------------


def _small_transformer_plan(limits: Limits, rates: MachineRates = GPU_DEFAULTS["h100-sxm"], **fixed: Any):
    preset = build_preset("transformer", **SMALL_TRANSFORMER)
    return choose(preset.model, lambda dtype: profile_layers(preset.model, lambda: preset.make_batch(8, "cpu")[0],
                                                             compute_dtype=dtype),
                  rates, limits, batch_size=8, fixed=fixed), preset


def test_resident_slices_take_their_bytes_off_the_link_and_the_host_update():
    preset = build_preset("transformer", **SMALL_TRANSFORMER)
    layout = slice_layout(preset.model, num_slices=4, compute_dtype=torch.bfloat16)
    config = StepConfig(num_slices=4, compute_dtype=torch.bfloat16)
    streamed, resident = traffic(layout, None, config), traffic(layout, None, replace(config, resident_slices=2))
    assert resident.forward_loads == sum(layout.device_bytes[2:]) < streamed.forward_loads
    assert resident.backward_loads == 0  # slices 2 and 3 stay in the slots, 0 and 1 are resident
    assert resident.backward_offloads == sum(layout.gradient_bytes[2:])
    # Copied into their files as they land (masters on disk), one microbatch's gradients leave in
    # the compute dtype (Note: [Gradients in the compute dtype]); before, in float32.
    on_disk = replace(config, resident_slices=2, masters="disk")
    assert traffic(layout, None, on_disk).backward_offloads == sum(layout.computed_gradient_bytes[2:]) < sum(
        layout.gradient_bytes[2:])
    with landed_gradients(in_compute_dtype=False):
        assert traffic(layout, None, on_disk).backward_offloads == sum(layout.gradient_bytes[2:])
    assert resident.first_load == resident.last_offload == 0
    # AdamW: 28 bytes per float32 parameter, and the bfloat16 shadow written in the same pass (2;
    # Note: [One-pass update]); on the device, no shadow.
    assert resident.update == 30 * sum(layout.gradient_bytes[2:]) // 4
    assert resident.device_update == 7 * sum(layout.gradient_bytes[:2])
    assert resident.shadow == 0
    with shadow_pass(in_update=False):  # without the one pass, the shadow's own pass:
        two_passes = traffic(layout, None, replace(config, resident_slices=2))
    assert two_passes.update == 7 * sum(layout.gradient_bytes[2:])
    # each float32 master read (4 bytes), its bfloat16 shadow written (2).
    assert two_passes.shadow == (4 + 2) * sum(layout.trainable_counts[2:])
    # All resident, timed on an H100: no host update, and the update on the device at its memory
    # bandwidth (28 bytes per parameter); the forward and backward are the device's alone.
    rates = GPU_DEFAULTS["h100-sxm"]
    every = estimate_step_time(layout, None, replace(config, resident_slices=4), rates, device_seconds=(0.01, 0.02))
    assert every.update == every.exposed_update == every.load == every.offload == 0
    assert every.device_update == pytest.approx(28 * layout.trainable / rates.device_memory_bandwidth)
    assert every.step == pytest.approx(every.forward_compute + every.backward_compute + every.device_update)
    none = estimate_step_time(layout, None, config, rates, device_seconds=(0.01, 0.02))
    assert none.device_update == 0 and every.step < none.step
    # A rates file without the bandwidth (a CPU calibration) times the device update with the default.
    unknown = dataclasses.replace(rates, device_memory_bandwidth=None)
    assert estimate_step_time(layout, None, replace(config, resident_slices=4), unknown,
                              device_seconds=(0.01, 0.02)).device_update == pytest.approx(
        28 * layout.trainable / DEVICE_MEMORY_BANDWIDTH_DEFAULT)
    with pytest.raises(ValueError, match="between 0 and the number of slices"):
        estimate_step_time(layout, None, replace(config, resident_slices=5), rates, device_seconds=(0.01, 0.02))


def test_with_a_small_model_and_a_big_device_every_slice_is_resident():
    plan, _ = _small_transformer_plan(Limits(device_memory=80 * 2**30, host_memory=8 * 2**30))
    chosen = plan.chosen
    assert chosen is not None and all(c.config.resident_slices == c.config.num_slices for c in plan.candidates)
    t = chosen.time
    # Nothing crosses the link but the boundary activations, hidden behind compute; no host update.
    assert t.update == t.exposed_update == 0 and chosen.memory.host_masters == 0
    assert t.step == pytest.approx(t.forward_compute + t.backward_compute + t.device_update)
    assert chosen.memory.device_resident > 0


def test_auto_keeps_the_most_resident_slices_that_fit_the_device():
    preset = build_preset("transformer", **SMALL_TRANSFORMER)
    layout = slice_layout(preset.model, num_slices=4)
    profile = profile_layers(preset.model, lambda: preset.make_batch(8, "cpu")[0])
    by_resident = footprints_by_resident(layout, profile)
    totals = [m.device_total for m in by_resident]
    assert totals == sorted(totals) and totals[0] < totals[-1]
    # Room for two resident slices and not three, within the margin.
    limit = int((totals[2] + totals[3]) / 2 / DEVICE_MARGIN)
    fixed = {"num_slices": 4, "num_microbatches": 1, "compute_dtype": None, "schedule": "overlapped"}
    plan, _ = _small_transformer_plan(Limits(device_memory=limit, host_memory=8 * 2**30), **fixed)
    assert plan.chosen is not None and plan.chosen.config.resident_slices == 2
    assert plan.chosen.memory.device_total == totals[2]
    assert plan.chosen.memory == estimate_memory(preset.model, num_slices=4, profile=profile, resident_slices=2)
    # Fixed, it is kept (and configurations with fewer slices are not tried).
    plan, _ = _small_transformer_plan(Limits(device_memory=80 * 2**30, host_memory=8 * 2**30),
                                      resident_slices=1, compute_dtype=None, num_microbatches=1)
    assert {c.config.resident_slices for c in plan.candidates} == {1}
    plan, _ = _small_transformer_plan(Limits(None, None), resident_slices=2, compute_dtype=None, num_microbatches=1)
    assert min(c.config.num_slices for c in plan.candidates) == 2
    with pytest.raises(ValueError, match="between 0 and the number of slices"):
        _small_transformer_plan(Limits(None, None), resident_slices=3, num_slices=2)


def test_on_a_cpu_device_resident_slices_are_no_faster_and_not_chosen():
    """On a CPU "device" a resident slice's copies are the copies in RAM a streamed slice makes,
    and its update runs in step() instead of beside the next forward: predicted no faster, so auto
    keeps none resident (``offload-finetune --resident-slices 3`` on the tiny Llama ran slower)."""
    preset = build_preset("transformer", **SMALL_TRANSFORMER)
    layout = slice_layout(preset.model, num_slices=4)
    profile = profile_layers(preset.model, lambda: preset.make_batch(8, "cpu")[0])
    rates = dataclasses.replace(HOST_DEFAULT, device_flops={"float32": 50e9})
    config = StepConfig(num_slices=4, compute_dtype=None)
    for optimizer in (None, "adamw"):
        times = [estimate_step_time(layout, profile, replace(config, resident_slices=k), rates, device="cpu",
                                    optimizer=optimizer) for k in range(5)]
        # A resident slice's load copies its bytes once, as a streamed slice's load does.
        assert [t.forward for t in times] == pytest.approx([times[0].forward] * 5, rel=1e-12)
        if optimizer is None:  # no update: the same copies, the same step
            assert [t.step for t in times] == pytest.approx([times[0].step] * 5, rel=1e-12)
        else:  # their update no longer hides behind the next forward (slice 0's never hid)
            assert all(later.step >= earlier.step for earlier, later in zip(times, times[1:]))
            assert times[4].step > times[0].step
    plan = choose(preset.model, lambda dtype: profile_layers(preset.model, lambda: preset.make_batch(8, "cpu")[0],
                                                             compute_dtype=dtype),
                  rates, Limits(device_memory=None, host_memory=8 * 2**30), device="cpu", batch_size=8,
                  fixed={"compute_dtype": None})
    assert plan.chosen is not None and {c.config.resident_slices for c in plan.candidates} == {0}
    # Fixed, a count is kept.
    plan = choose(preset.model, lambda dtype: profile, rates, Limits(None, 8 * 2**30), device="cpu", batch_size=8,
                  fixed={"num_slices": 4, "compute_dtype": None, "resident_slices": 2})
    assert {c.config.resident_slices for c in plan.candidates} == {2}


def test_on_a_cpu_device_a_gain_of_a_few_bytes_of_padding_keeps_no_slice_resident():
    """A resident slice's slot copy, a copy a tensor, skips the padding between its tensors that a
    streamed slice's one copy of the flat layout carries (here before the buffers' region, the
    batch norms' statistics): predicted faster by a few nanoseconds, far under RESIDENT_GAIN of
    the step, and a copy a tensor costs calls the model does not count. Auto keeps none resident."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 64), nn.BatchNorm1d(64))
    rates = dataclasses.replace(HOST_DEFAULT, device_flops={"float32": 50e9})
    fixed = {"num_slices": 1, "num_microbatches": 1, "compute_dtype": None, "schedule": "overlapped"}

    def plan(**more: Any) -> Any:
        return choose(model, lambda dtype: profile_layers(model, lambda: torch.zeros(8, 64), compute_dtype=dtype),
                      rates, Limits(None, 8 * 2**30), device="cpu", batch_size=8, fixed=fixed | more)

    streamed, resident = (plan(resident_slices=k).chosen.time.step for k in (0, 1))
    assert 0 < streamed - resident < RESIDENT_GAIN / 10 * streamed
    chosen = plan().chosen
    assert chosen is not None and chosen.config.resident_slices == 0 and chosen.time.step == streamed


def test_plan_prints_the_resident_slices_in_the_calls_and_the_flags():
    args = parse_args(["--model", "tests.test_planning:small_mlp", "--input-shape", "64", "--gpu", "rtx-4090",
                       "--host-memory", "8", "--batch-size", "16", "--num-slices", "3", "--compute-dtype", "none",
                       "--microbatches", "1"])
    plan, work, rates, limits = run_plan(args)
    assert plan.chosen is not None and plan.chosen.config.resident_slices == 3
    text = report(plan, work, rates, limits, args)
    assert 'OffloadModel(tests.test_planning.small_mlp(), device="cuda", num_slices=3, resident_slices=3)' in text
    assert "resident slices' update on the device" in text
    work.finetune = []  # as a --hf-config workload: the fine-tune command carries the flag
    assert "--resident-slices 3" in finetune_flags(plan.chosen, work, args)
    args = parse_args(["--model", "tests.test_planning:small_mlp", "--input-shape", "64", "--gpu", "rtx-4090",
                       "--host-memory", "8", "--num-slices", "3", "--resident-slices", "0"])
    plan, work, _, _ = run_plan(args)
    assert {c.config.resident_slices for c in plan.candidates} == {0} and "resident_slices" not in code(
        plan.chosen, work, args)
    for bad in (["--resident-slices", "-1"], ["--resident-slices", "some"], ["--num-slices", "2", "--resident-slices",
                                                                              "3"]):
        with pytest.raises(SystemExit):
            parse_args(["--preset", "mlp", "--gpu", "h100-sxm", *bad])


def test_a_pinned_memory_limit_rules_out_what_pins_more():
    """``--pinned-memory``: a configuration that pins more host memory than the platform allows does
    not fit, and when only that is short the answer says how much it needs; the chosen one's pinned
    bytes are printed."""
    free = _mlp_plan()
    pinned = free["chosen"]["pinned_bytes"]
    assert pinned > 0 and free["limits"]["pinned_memory"] is None
    enough = _mlp_plan("--pinned-memory", f"{pinned / 2**30 * 1.01:.4f}")
    assert enough["chosen"] is not None and enough["chosen"]["pinned_bytes"] <= enough["limits"]["pinned_memory"]
    least = min(c["pinned_bytes"] for c in free["candidates"] if c["fits"])
    args = ("plan", "--preset", "mlp", "--set", "width=2048", "depth=8", "--gpu", "h100-sxm", "--host-memory", "8",
            "--batch-size", "4096", "--compute-dtype", "none", "--microbatches", "1", "--num-slices", "8",
            "--resident-slices", "0", "--pinned-memory", f"{least / 2**30 * 0.9:.4f}")
    done = _offload(*args, "--json", check=False)
    short = json.loads(done.stdout)
    assert done.returncode == 1 and short["chosen"] is None
    assert all("pinned" in c["over"] for c in short["candidates"])
    assert "of pinned host memory at the least; the platform pins" in _offload(*args, check=False).stdout
    assert "pinned host memory: " in _offload(*args[:-2]).stdout
    assert _offload("plan", "--preset", "mlp", "--gpu", "h100-sxm", "--pinned-memory", "0", check=False).returncode == 2


TINY_MOE = {
    "mixtral": {"model_type": "mixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "num_local_experts": 4,
                "num_experts_per_tok": 2},
    "qwen3_moe": {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 32,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                  "vocab_size": 128, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1},
}


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return torch.nn.functional.scaled_dot_product_attention(x * self.scale, x, x)


def test_attention_is_counted_whatever_the_pytorch():
    """Fake tensors run the CPU's flash attention, which torch's counter counts from 2.15 on and as
    nothing before: the planner counts it as the CUDA kernels are counted, under any PyTorch."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    shape = (2, 4, 16, 8)
    profile = profile_layers(nn.Sequential(_Attention()), lambda: torch.zeros(shape))
    (layer,) = profile.layers
    assert layer.forward_flops == sdpa_flop_count(shape, shape, shape) > 0
    assert layer.backward_flops == sdpa_backward_flop_count(shape, shape, shape, shape)


class _GroupedQueryAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        keys = x[:, :2] * self.scale  # 2 key and value heads for the query's 4
        return torch.nn.functional.scaled_dot_product_attention(x * self.scale, keys, keys, enable_gqa=True)


def test_grouped_query_attention_is_counted_as_its_heads_repeated(monkeypatch):
    """Hugging Face passes ``enable_gqa=True`` where there is no mask: keys and values with fewer
    heads than the queries. torch's ``sdpa_flop_count`` refused those shapes before 2.13 (the
    planner failed on a GPU machine's torch 2.11): the count is the keys' heads repeated."""
    from torch.utils import flop_counter
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    def heads_equal(count):  # the check of torch before 2.13
        def strict(*shapes):
            assert len({shape[1] for shape in shapes}) == 1, "query/key/value shapes are incompatible"
            return count(*shapes)
        return strict

    from offload.planning import shapes

    for module in (flop_counter, shapes):  # torch's, and any name the planner imported from it
        monkeypatch.setattr(module, "sdpa_flop_count", heads_equal(sdpa_flop_count), raising=False)
        monkeypatch.setattr(module, "sdpa_backward_flop_count", heads_equal(sdpa_backward_flop_count),
                            raising=False)
    shape = (2, 4, 16, 8)
    profile = profile_layers(nn.Sequential(_GroupedQueryAttention()), lambda: torch.zeros(shape))
    (layer,) = profile.layers
    assert layer.forward_flops == sdpa_flop_count(shape, shape, shape) > 0
    assert layer.backward_flops == sdpa_backward_flop_count(shape, shape, shape, shape)


@pytest.mark.parametrize("family", sorted(TINY_MOE))
def test_the_fake_profile_of_mixture_of_experts_in_float32_is_a_real_runs(family):
    """Note: [Grouped matmuls on fake tensors] in ``offload/planning/shapes.py``: the experts'
    ``torch._grouped_mm`` profiles in float32 (its meta kernel takes bfloat16 only), saving what a
    real float32 run saves, and its operations are counted, the same in either dtype."""
    transformers = pytest.importorskip("transformers")
    from torch.utils.flop_counter import FlopCounterMode
    from torch.utils._pytree import tree_flatten

    from offload.integrations.transformers import causal_lm_sequential

    settings = TINY_MOE[family]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**settings))
    assert hf.config._experts_implementation == "grouped_mm"
    layers = causal_lm_sequential(hf)
    rows, tokens = 2, 16
    profile = profile_layers(layers, lambda: torch.zeros(rows, tokens, dtype=torch.long))
    bf16 = profile_layers(layers, lambda: torch.zeros(rows, tokens, dtype=torch.long), compute_dtype=torch.bfloat16)

    # The real run, layer by layer: what autograd saves (parameters left out), what each returns, and
    # the operations torch's counter sees, which has no formula for the experts' grouped matmuls
    # (its attention counted as the planner counts it: torch before 2.15 has no formula for the CPU's).
    params = {p.untyped_storage().data_ptr() for p in layers.parameters()}
    x: Any = torch.randint(0, settings["vocab_size"], (rows, tokens))
    saved, outputs, flops_without_experts = [], [], []
    for layer in layers:
        layer_saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in params:
                layer_saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with FlopCounterMode(display=False, custom_mapping=_cpu_attention_flops()) as counter, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            x = layer(x)
        saved.append(sum(layer_saved.values()))
        outputs.append(sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                            for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)}.values()))
        flops_without_experts.append(counter.get_total_flops())
    assert [layer.saved_bytes for layer in profile.layers] == saved
    assert [layer.output_bytes for layer in profile.layers] == outputs

    # Each decoder layer's experts: every token through top-k experts, an up (gate and up: twice the
    # intermediate width) and a down projection, 2 operations a multiply-add.
    hidden, top_k = settings["hidden_size"], settings["num_experts_per_tok"]
    intermediate = settings.get("moe_intermediate_size", settings["intermediate_size"])
    experts = 2 * rows * tokens * top_k * (hidden * 2 * intermediate + intermediate * hidden)
    decoders = range(1, 1 + settings["num_hidden_layers"])
    assert [layer.forward_flops for layer in profile.layers] == [
        flops + (experts if k in decoders else 0) for k, flops in enumerate(flops_without_experts)]
    assert [layer.forward_flops for layer in bf16.layers] == [layer.forward_flops for layer in profile.layers]
    # The backward as the real run's, counted the same way (how PyTorch differentiates a grouped
    # matmul changes between releases: not exactly twice the forward in every one).
    assert profile.backward_flops == bf16.backward_flops == _backward_flops(x)
