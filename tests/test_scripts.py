"""The tools in scripts/ and the measurements in benchmarks/ run end to end (small settings): what the
README and the docs quote keeps working."""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def process(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    # The scripts import this checkout's offload, not whichever one is installed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def run(*args: str, cwd: Path = ROOT) -> str:
    done = process(*args, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@functools.cache
def demo_run() -> subprocess.CompletedProcess:
    """``scripts/demo.py`` on the CPU with every warning shown, run once for the tests that read it
    (here, and tests/test_docs.py's check that a base install warns of nothing)."""
    return process("-W", "default", "scripts/demo.py", "--steps", "3", "--device", "cpu")


def test_demo_trains_and_names_its_device():
    done = demo_run()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "device: cpu" in done.stdout and "step   3" in done.stdout


def test_benchmark_smoke_test_on_cpu(tmp_path):
    out = run("benchmarks/benchmark.py", "--device", "cpu", "--out-dir", str(tmp_path))
    assert "| tiny | offload |" in out
    (report,) = tmp_path.glob("benchmark_*.json")
    data = json.loads(report.read_text())
    run_ = data["results"][0]["runs"]["offload"]
    assert run_["loaded_bytes_per_step"] > 0 and run_["offloaded_bytes_per_step"] > 0
    assert 0 < run_["efficiency"] and run_["median_step_s"] > 0
    # The bound with the host counted, measured in the same process, and the old one beside it.
    bound, result = run_["bound"], data["results"][0]
    assert len(result["fused_adamw_alone"]["samples_s"]) == 7 and result["host_bandwidth"]["bytes_per_s"] > 0
    assert bound["bound_s"] == max(bound["bound_terms"].values()) and bound["efficiency"] > 0
    assert bound["old_bound_terms"]["update_alone_s"] == result["fused_adamw_alone"]["median_s"]
    assert bound["host_bytes"]["loads"] == run_["loaded_bytes_per_step"]
    assert (tmp_path / report.name.replace(".json", ".md")).exists()
    # Device memory is counted on a GPU only: the keys are there, empty.
    result = data["results"][0]
    for key in ("peak_device_bytes", "peak_device_bytes_interleaved", "device_bytes_between_steps"):
        assert key in run_ and run_[key] is None
    assert result["output_shape"] == [8, 4] and result["output_dtype"] == "torch.float32"
    terms = result["memory_budget_terms"]
    assert set(terms) == {"slots", "gradients", "boundaries", "slice_activations", "loss", "slack"}
    assert terms["slots"] > 0 and terms["gradients"] > 0 and terms["slack"] > 0
    assert terms["boundaries"] is terms["slice_activations"] is terms["loss"] is None
    assert result["memory_budget_bytes"] is None


def test_benchmark_records_forward_backward_apart_and_a_slices_override(tmp_path):
    run("benchmarks/benchmark.py", "--device", "cpu", "--preset", "tiny", "--slices", "3", "--out-dir", str(tmp_path))
    (report,) = tmp_path.glob("benchmark_*_tiny_3slices.json")
    result = json.loads(report.read_text())["results"][0]
    assert result["num_slices"] == 3
    offload = result["runs"]["offload"]
    assert 0 < offload["median_forward_backward_s"] < offload["median_step_s"]
    assert offload["optimizer_in_step_s"] > 0 and offload["efficiency_forward_backward"] > 0
    assert offload["median_exposed_update_s"] >= 0


def max_model_report(tmp_path: Path, *args: str) -> dict:
    run("benchmarks/bench_max_model.py", "--device", "cpu", "--out-dir", str(tmp_path), *args)
    (report,) = tmp_path.glob("benchmark_*_maxmodel.json")
    assert (tmp_path / report.name.replace(".json", ".md")).exists()
    data = json.loads(report.read_text())
    assert data["failed"] == {} and "benchmarks/bench_max_model.py" in data["command"]
    return data["max_model"]


def test_max_model_grows_the_depth_until_host_memory_runs_out(tmp_path):
    # The CPU has no cap to find: a smoke test of the search, on tiny sizes.
    search = max_model_report(tmp_path / "a", "--max-layers", "2")
    assert [s["n_layers"] for s in search["sizes"]] == [1, 2] and all(s["trained"] for s in search["sizes"])
    assert search["largest_trained"]["n_layers"] == 2 and search["stopped"] == "reached --max-layers 2"
    assert search["device_memory_cap_bytes"] is None and search["parameter_bytes_per_cap"] is None
    one, two = search["sizes"]
    assert two["parameters"] - one["parameters"] == search["parameters_per_block"]
    assert one["median_step_s"] > 0 and one["peak_device_bytes"] is None
    assert 0 < one["host_bytes_estimate"] < two["host_bytes_estimate"]
    # Host memory for one block but not two: it stops before building the second.
    between = (one["host_bytes_estimate"] + two["host_bytes_estimate"]) / 2 / 2**30
    search = max_model_report(tmp_path / "b", "--host-memory-gib", f"{between:.9f}")
    assert [s["n_layers"] for s in search["sizes"]] == [1]
    assert search["stopped"].startswith("host memory: n_layers=2 would need")


def test_profile_step_prints_the_busiest_operations(tmp_path):
    # Every operation listed (--rows 100): which ones make the top few depends on timing.
    out = run("benchmarks/profile_step.py", "--case", "tiny", "--steps", "1", "--rows", "100",
              "--device", "cpu", "--trace", str(tmp_path / "trace.json"))
    assert "host time by operation" in out and "OffloadFunction" in out
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]


def test_optimizer_benchmark(tmp_path):
    run("benchmarks/bench_optimizer.py", "--params", "4e5", "--tensors", "40", "--slices", "4", "--rounds", "1",
        "--overlap-params", "4e5", "--sleep", "0.001", "--json", str(tmp_path / "o.json"))
    data = json.loads((tmp_path / "o.json").read_text())
    assert data["update"]["update_bandwidth_fraction"] > 0
    assert set(data["update"]["variants"]) == {"default", "foreach", "fused", "fused with a backup",
                                               "OffloadOptimizer", "OffloadOptimizer+bf16 shadow",
                                               "OffloadOptimizer+bf16 shadow, two passes", "fused, then a bf16 cast",
                                               "one-pass kernel: update + bf16 shadow"}
    # Note: [One-pass update]: both ways beside the fused update alone, and the bytes each touches.
    one_pass = data["update"]["one_pass"]
    assert one_pass["kernel_update_and_shadow_vs_fused"] > 0 and one_pass["two_passes_update_and_shadow_vs_fused"] > 0
    assert one_pass["host_bytes_per_parameter"] == {"one pass": 30, "two passes": 34}
    assert data["overlap"]["num_slices"] == 4 and "exposed_fraction" in data["overlap"]
    # The figures sit at the top level too.
    assert data["num_slices"] == 4
    assert data["exposed_fraction"] == data["overlap"]["exposed_fraction"]
    assert data["update_bandwidth_fraction"] == data["update"]["update_bandwidth_fraction"]
    assert set(data["update"]["shadow_cost_vs_update"]) == {"written by the update", "separate cast pass"}
    assert data["update"]["cast_pass_s"] > 0 and "backup_cost_vs_update" in data["update"]


def test_distributed_training_script_runs_on_two_cpu_processes():
    out = run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "scripts/train_distributed.py",
              "--preset", "tiny", "--steps", "6", "--lr", "1e-2")
    assert "rank 0:" in out and "rank 1:" in out and "total:" in out and "on 2 rank(s)" in out
    # Progress at every step, and a loss that falls: the ranks fit their repeated batches.
    assert [f"step {k}/6: loss" in out for k in range(1, 7)] == [True] * 6
    first, last = (float(x) for x in re.search(r"loss (\S+) at the first step, last loss (\S+)", out).groups())
    assert last < first


def test_distributed_training_script_without_torchrun_says_how_to_launch_it():
    done = subprocess.run([sys.executable, "scripts/train_distributed.py", "--preset", "tiny"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={k: v for k, v in os.environ.items()
                                                                              if k not in ("RANK", "WORLD_SIZE")})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "start it with torchrun" in done.stderr and "torchrun --nproc_per_node=2" in done.stderr


def test_cpu_overhead_benchmark(tmp_path):
    out = run("benchmarks/bench_cpu_overhead.py", "--width", "32", "--depth", "2", "--batch", "8", "16",
              "--steps", "2", "--warmup", "1", "--json", str(tmp_path / "overhead.json"))
    assert "offload/ckpt" in out
    data = json.loads((tmp_path / "overhead.json").read_text())
    assert [r["batch"] for r in data["runs"]] == [8, 16]


def test_resident_cpu_benchmark_runs_each_variant_with_the_same_losses(tmp_path):
    run("benchmarks/bench_resident_cpu.py", "--variants", "streamed", "resident-passive", "--rounds", "1", "--steps",
        "2", "--warmup", "0", "--json", str(tmp_path / "r.json"))
    variants = json.loads((tmp_path / "r.json").read_text())["variants"]
    assert variants["resident-passive"]["resident_slices"] == 3
    assert variants["resident-passive"]["environment"] == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert variants["streamed"]["median_step_s"] > 0
    assert variants["streamed"]["runs"][0]["last_loss"] == variants["resident-passive"]["runs"][0]["last_loss"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cast_benchmark(tmp_path, dtype):
    run("benchmarks/bench_cast.py", "--mib", "1", "--repeats", "2", "--dtype", dtype, "--json", str(tmp_path / "c.json"))
    assert json.loads((tmp_path / "c.json").read_text())["host_cast_float32_gb_per_s"] > 0


def test_bench_activations_compares_the_three_ways_and_finds_them_identical(tmp_path):
    out = run("benchmarks/bench_activations.py", "--device", "cpu", "--layers", "2", "--d-model", "32", "--heads", "2",
              "--seq-len", "16", "--vocab", "64", "--batch", "2", "--steps", "1", "--json", str(tmp_path / "a.json"))
    assert "identical loss and gradients: True" in out
    data = json.loads((tmp_path / "a.json").read_text())
    modes = data["modes"]
    # Only the offloaded slices move their saved tensors; the recompute is a second forward.
    assert modes["offload"]["saved_activation_bytes_per_step"] > 0
    assert modes["recompute"]["saved_activation_bytes_per_step"] == modes["kept"]["saved_activation_bytes_per_step"] == 0
    assert modes["recompute"]["flops_per_step"] > modes["offload"]["flops_per_step"] == modes["kept"]["flops_per_step"]
    assert modes["offload"]["host_activation_bytes_after_forward"] > modes["kept"]["host_activation_bytes_after_forward"]
    assert set(data["crossover_tokens_per_slice"]) == {"pcie4", "pcie5", "nvlink-c2c"}
    assert "benchmarks/bench_activations.py" in data["command"]


def test_bench_boundaries_counts_each_passing_leaf_once_with_the_same_results(tmp_path):
    out = run("benchmarks/bench_boundaries.py", "--layers", "3", "--hidden", "32", "--seq-len", "16", "--rounds", "2",
              "--warmup", "1", "--json", str(tmp_path / "b.json"))
    assert "same loss and gradients: True" in out
    data = json.loads((tmp_path / "b.json").read_text())
    shared, every = data["variants"]["shared"], data["variants"]["every boundary"]
    # Five slices, four checkpointed: the token ids, then the hidden states and both rotary tables
    # at each of three boundaries, or the tables only at the first.
    assert every["offloads"] == every["loads"] == 1 + 3 * 3
    assert shared["offloads"] == shared["loads"] == 1 + 3 + 2
    assert "benchmarks/bench_boundaries.py" in data["command"]


def test_chunked_loss_precision_script(tmp_path):
    out = run("benchmarks/chunked_loss_precision.py", "--tokens", "256", "--hidden", "16", "--vocab", "32",
              "--chunks", "64", "16", "--json", str(tmp_path / "p.json"))
    assert "4 chunk(s) of    64 tokens" in out
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert [r["chunks"] for r in rows] == [1, 4, 16] and all(r["norm"] > 0 for r in rows)


def test_bench_storage_smoke_test(tmp_path):
    out = run("benchmarks/bench_storage.py", "--small", "--dir", str(tmp_path / "disk"), "--json",
              str(tmp_path / "storage.json"))
    assert "exact: True; with the masters on disk too (bfloat16 compute): True" in out
    data = json.loads((tmp_path / "storage.json").read_text())
    assert data["exact_masters_on_disk"] is True
    # The masters (4) and their gradients (4) moved to disk as well, a bfloat16 shadow (2) came: 6
    # bytes per parameter fewer, but for the three slices' masters and gradients RAM takes while
    # the optimizer steps (counted in the window: Note: [Masters on disk]).
    window = (data["masters_and_state_on_disk"]["host_bytes"]["host_disk_window"]
              - data["state_on_disk"]["host_bytes"]["host_disk_window"]) / data["state_on_disk"]["parameters"]
    assert 0 < window < 8
    assert data["host_bytes_per_param_disk"] - data["host_bytes_per_param_masters_on_disk"] + window == pytest.approx(
        6, rel=0.1)
    for key in ("disk_read_gbps", "disk_write_gbps", "tier_read_fraction", "tier_write_fraction"):
        assert data[key] > 0, key
    assert data["exact"] is True and "benchmarks/bench_storage.py" in data["command"]
    # The moments moved to disk: 8 bytes per parameter fewer in RAM, less the window of 3 of 8 slices.
    assert data["host_bytes_per_param_ram"] - data["host_bytes_per_param_disk"] == pytest.approx(8 * 5 / 8, rel=0.1)
    assert data["state_on_disk"]["disk_bytes"] >= 8 * data["state_on_disk"]["parameters"]
    assert data["state_on_disk"]["tier_read_bytes_per_step"] == data["state_on_disk"]["disk_bytes"]
    assert os.listdir(tmp_path / "disk") == []  # every file removed


def finetune_here(*args: str) -> str:
    """``scripts/finetune_causal_lm.py ARGS`` in this process (its ``main``), its output: for runs
    compared with each other, which need no fresh interpreter each (seconds of imports)."""
    from offload.cli.finetune import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(list(args))
    return out.getvalue()


def last_line(out: str, start: str) -> str:
    (line,) = [line for line in out.splitlines() if line.startswith(start)][-1:]
    return line


def step_losses(out: str) -> list[str]:
    return re.findall(r"^step (\d+)/\d+  loss (\S+)", out, flags=re.MULTILINE)


def test_finetune_script_resumes_with_the_losses_of_a_run_that_never_stopped(tmp_path):
    common = ["--device", "cpu", "--no-progress", "--compute-dtype", "bf16", "--steps", "4", "--out", str(tmp_path)]
    # The run that never stopped in this process; the resumed one in a fresh interpreter, the script
    # as a user starts it: all it has of the first run is the checkpoint.
    whole = finetune_here(*common, "--save-every", "2")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step-2", "step-4"]
    # As if stopped after step 2.
    resumed = run("scripts/finetune_causal_lm.py", *common, "--resume", str(tmp_path / "checkpoints" / "step-2"))
    assert "resumed from" in resumed and "step-2 after step 2" in resumed
    assert step_losses(resumed) == step_losses(whole)[2:] and len(step_losses(whole)) == 4
    # The final loss in full, bit for bit.
    final = last_line(whole, "final loss").split(";")[0]
    assert final == last_line(resumed, "final loss").split(";")[0] and len(final) > len("final loss 1.2345")


def test_finetune_script_with_state_and_masters_on_disk_has_the_same_losses(tmp_path):
    common = ["--device", "cpu", "--no-progress", "--compute-dtype", "bf16", "--steps", "3"]
    in_ram = finetune_here(*common, "--out", str(tmp_path / "ram"))
    on_disk = finetune_here(*common, "--out", str(tmp_path / "disk"), "--disk-tier", str(tmp_path / "tier"),
                            "--masters-on-disk")
    assert step_losses(on_disk) == step_losses(in_ram) and len(step_losses(in_ram)) == 3
    assert last_line(on_disk, "final loss").split(";")[0] == last_line(in_ram, "final loss").split(";")[0]
    assert os.listdir(tmp_path / "tier") == []  # the state's and the masters' files are gone
    # Trained further from the saved model, loaded slice by slice (into the masters' files).
    common += ["--model", str(tmp_path / "ram")]
    in_ram = finetune_here(*common, "--out", str(tmp_path / "ram2"))
    on_disk = finetune_here(*common, "--out", str(tmp_path / "disk2"), "--disk-tier", str(tmp_path / "tier"),
                            "--masters-on-disk")
    assert "slice by slice" in in_ram and "slice by slice" in on_disk
    assert step_losses(on_disk) == step_losses(in_ram) and len(step_losses(in_ram)) == 3
    assert last_line(on_disk, "final loss").split(";")[0] == last_line(in_ram, "final loss").split(";")[0]


def test_distributed_script_resumes_on_two_ranks_and_on_one(tmp_path):
    common = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "scripts/train_distributed.py",
              "--preset", "tiny", "--steps", "4", "--out", str(tmp_path)]
    whole = run(*common, "--save-every", "2")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step-2", "step-4"]
    resumed = run(*common, "--resume", str(tmp_path / "checkpoints" / "step-2"))
    assert "resumed from" in resumed
    final = last_line(whole, "total:").split("last loss")[1]
    assert final == last_line(resumed, "total:").split("last loss")[1]
    # A checkpoint of two ranks continues on one (the batches split otherwise, so the loss differs),
    # given steps left to train past its step 4.
    one = run(*[arg.replace("--nproc_per_node=2", "--nproc_per_node=1") for arg in common], "--resume", "latest",
              "--steps", "5")
    assert "on 1 rank(s)" in one and "resumed from" in one and "step 5/5" in one


@pytest.mark.parametrize("disk_tier", [False, True])
def test_checkpoint_benchmark(tmp_path, disk_tier):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    tier = ["--disk-tier", str(tmp_path / "tier")] if disk_tier else []
    out = run("benchmarks/bench_checkpoint.py", "--preset", "tiny", "--slices", "2", "--repeats", "1", "--dir",
              str(checkpoints), "--json", str(tmp_path / "c.json"), *tier)
    assert "save:" in out and "load_fresh:" in out
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["disk_tier"] is disk_tier
    assert data["checkpoint_bytes"] > data["parameter_bytes"] + data["optimizer_state_bytes"] > 0
    assert data["save"]["median_s"] > 0 and data["load_fresh"]["median_s"] > 0
    assert list(checkpoints.iterdir()) == []  # its checkpoints are removed


def test_bench_checksums_smoke_test(tmp_path):
    # A --dir not made yet is made, as bench_loading.py makes its own.
    out = run("benchmarks/bench_checksums.py", "--preset", "tiny", "--slices", "2", "--rounds", "1", "--dir",
              str(tmp_path / "made" / "here"), "--json", str(tmp_path / "c.json"))
    assert "save_with:" in out and "load_without:" in out
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["checkpoint_bytes"] > 0 and data["crc32_save"]["runs_s"][0] > 0 and data["crc32_load"]["runs_s"][0] > 0
    assert list((tmp_path / "made" / "here").iterdir()) == []  # its checkpoints are removed


def test_bench_data_smoke_test(tmp_path):
    # The command docs/huggingface.md cites, at a corpus of 10 kB: one fine-tune step and one pass
    # over the blocks, plain text and JSON lines each, every one in a process of its own.
    out = run("benchmarks/bench_data.py", "--sizes-mb", "0.01", "--steps", "1", "--dir", str(tmp_path / "corpora"),
              "--json", str(tmp_path / "d.json"))
    assert "0.01 MB steps_txt: peak RSS" in out and "0.01 MB full_pass_jsonl: peak RSS" in out
    (row,) = json.loads((tmp_path / "d.json").read_text())["results"]
    assert row["size_mb"] == 0.01 and row["bytes"] >= 10_000
    for name in ("steps_txt", "steps_jsonl", "full_pass_txt", "full_pass_jsonl"):
        assert row[name]["peak_rss_bytes"] > 0, name
    assert row["steps_txt"]["stdout_tail"].startswith("final loss")
    assert int(row["full_pass_txt"]["stdout_tail"].split()[0]) > 0  # blocks of 1024 ids
    assert sorted(p.name for p in (tmp_path / "corpora").iterdir()) == ["out"]  # the corpora removed


def test_bench_loading_gives_a_small_hidden_size_one_head(tmp_path):
    # Heads are 128 wide: --hidden 64 had none (a division by zero in the config). The loader reads
    # tensors, whatever the heads cut them into.
    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_loading
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    sizes = argparse.Namespace(layers=1, hidden=64, intermediate=128, vocab=256)
    written = bench_loading.write_checkpoint(tmp_path, sizes)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_attention_heads"] == config["num_key_value_heads"] == 1 and config["hidden_size"] == 64
    assert written["parameters"] == 2 * 256 * 64 + 4 * 64 * 64 + 3 * 64 * 128 + 3 * 64


def page(nbytes):
    return -(-nbytes // 4096) * 4096


@pytest.mark.parametrize("masters_on_disk", [False, True], ids=["masters-in-ram", "masters-on-disk"])
def test_scale_benchmark_smoke(masters_on_disk, tmp_path):
    extra = ("--compute-dtype", "bfloat16", "--masters-on-disk") if masters_on_disk else ()
    out = run("benchmarks/bench_scale.py", "--width", "64", "--layers", "4", "--slices", "2", "--steps", "2", "--batch", "2",
              "--dir", str(tmp_path), "--json", str(tmp_path / "scale.json"), *extra)
    assert "step 2:" in out
    data = json.loads((tmp_path / "scale.json").read_text())
    assert data["parameters"] == 4 * (64 * 64 + 64)
    def total(key):
        return sum(step[key] for step in data["steps"])

    # AdamW's two moments live on disk, each read once per step after the first, written every step.
    assert data["disk_state_bytes"] >= 8 * data["parameters"]
    assert total("tier_read_bytes") >= 8 * data["parameters"]
    assert total("tier_write_bytes") >= 2 * 8 * data["parameters"]
    # The masters' files (4 bytes per parameter, in whole pages): read in by the first forward and
    # around each update, and written back (synced: clean pages cost nothing) after each. Their
    # gradients' files, as large: written as each backward lands them, read in and dropped around
    # each update (Note: [Gradients on disk]).
    masters = 2 * page(2 * (64 * 64 + 64) * 4) if masters_on_disk else 0
    assert data["disk_masters_bytes"] == data["disk_gradients_bytes"] == masters
    assert total("masters_read_bytes") == 3 * masters + 2 * masters
    assert total("masters_write_bytes") == 3 * masters + 2 * 2 * masters
    on_disk = data["disk_state_bytes"] + data["disk_masters_bytes"] + data["disk_gradients_bytes"]
    assert abs(data["estimate_disk_bytes"] - on_disk) <= 0.05 * on_disk
    assert [p.name for p in tmp_path.iterdir()] == ["scale.json"]  # checkpoint and state removed


def test_scale_benchmark_resumes_bit_for_bit(tmp_path):
    out = run("benchmarks/bench_scale.py", "--width", "64", "--layers", "4", "--slices", "2", "--steps", "3", "--batch", "2",
              "--dir", str(tmp_path), "--json", str(tmp_path / "scale.json"), "--compute-dtype", "bfloat16",
              "--masters-on-disk", "--resume-check")
    data = json.loads((tmp_path / "scale.json").read_text())
    # Saved before step 3, loaded into a model built again from the safetensors checkpoint.
    assert data["resume"]["loss_equal"] is True and data["resume"]["parameters_equal"] is True
    assert data["resume"]["resumed_loss"] == data["steps"][2]["loss"]
    assert "step 3's loss equal, parameters after it equal bit for bit" in out
    assert [p.name for p in tmp_path.iterdir()] == ["scale.json"]


def test_tools_benchmark_runs_each_tool(tmp_path):
    # One run per tool, tiny: the command's losses are compared with trainer-plain's.
    runs = ["command-offload", "trainer-plain", "sft-offload", "accelerate-offload", "lightning-offload"]
    left_before = set(Path("/tmp").glob("bench_trainer_*"))
    out = run("benchmarks/bench_trainer.py", "--runs", *runs, "--hidden", "32", "--layers", "1", "--vocab", "64",
              "--seq-len", "16", "--batch-size", "2", "--grad-accum", "2", "--steps", "2",
              "--json", str(tmp_path / "tools.json"))
    data = json.loads((tmp_path / "tools.json").read_text())
    assert [r["run"] for r in data["results"]] == runs and len(data["machine"]["load_average_before"]) == 3
    for result in data["results"]:
        assert result["steps_timed"] == 1 and len(result["losses"]) == 2, result
        assert result["tokens_per_s"] > 0 and result["peak_rss_mib"] > 0
    command = data["results"][0]
    # The same model, rows, order, schedule and optimizer as the Trainer's: the same losses.
    assert command["losses_equal_plain"] is True and command["plain_run"] == "trainer-plain"
    assert command["final_loss"] == data["results"][1]["losses"][-1]
    assert "losses = trainer-plain's" in out
    assert set(Path("/tmp").glob("bench_trainer_*")) <= left_before  # the trainers' output directories removed


def test_peers_benchmark_dry_run_matches_the_resident_model_bit_for_bit(tmp_path):
    # The GPU check's second stage at toy sizes (benchmarks/gpu_check.sh --cpu-dry-run runs it too).
    run("benchmarks/bench_peers.py", "--cpu-dry-run", "--only", "resident,offload,offload-sync,fsdp2",
        "--json", str(tmp_path / "peers.json"))
    report = json.loads((tmp_path / "peers.json").read_text())
    assert set(report["runs"]) == {"resident", "offload", "offload-sync", "fsdp2"}, report["failed"]
    assert report["gradients_after_first_backward"]["bit_identical"]
    assert report["runs"]["offload"]["loaded_bytes_per_step"] > 0
    assert report["runs"]["offload-sync"]["median_synchronize_s"] >= 0


def test_peers_benchmark_dry_run_with_resident_slices(tmp_path):
    # The GPU check's resident variants at toy sizes (4 slices: a quarter is one resident slice).
    # The first offloaded run's gradients are compared with the resident model's: the resident variant's.
    runs = ["resident", "offload-resident", "offload-in-backward-resident", "offload"]
    run("benchmarks/bench_peers.py", "--cpu-dry-run", "--only", ",".join(runs), "--json", str(tmp_path / "peers.json"))
    report = json.loads((tmp_path / "peers.json").read_text())
    assert list(report["runs"]) == runs, report["failed"]
    assert report["resident_slices"] == 1 and report["gradients_after_first_backward"]["bit_identical"]
    offload = report["runs"]["offload"]
    for name in runs[1:3]:
        ours = report["runs"][name]
        assert ours["resident_slices"] == 1 and ours["host_update_streamed_alone_s"] > 0
        assert ours["ideal_terms"]["host_update_streamed_alone_s"] == ours["host_update_streamed_alone_s"]
        assert "host_update_alone_s" not in ours["ideal_terms"] and ours["efficiency"] > 0
        # The bound with the host counted: the streamed slices' parameters only.
        assert ours["bound"]["old_efficiency"] == ours["efficiency"]
        assert 0 < ours["bound"]["host_bytes"]["update"] < offload["bound"]["host_bytes"]["update"]
        # The resident slice's loads and gradients never cross the link.
        assert 0 < ours["loaded_bytes_per_step"] < offload["loaded_bytes_per_step"]
        assert 0 < ours["offloaded_bytes_per_step"] < offload["offloaded_bytes_per_step"]
        # On the CPU the resident slice's AdamW is the host's: the same parameters after the run.
        assert ours["parameters_sha256_16"] == offload["parameters_sha256_16"]


def test_peers_benchmark_tensor_sequential_is_the_model():
    # fairscale's stages take one tensor each: the same logits as the model's own forward.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_peers
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    pytest.importorskip("transformers")
    base = bench_peers.build_llama(bench_peers.DRY_SIZES)
    ids = torch.randint(0, bench_peers.DRY_SIZES["vocab"], (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(bench_peers.tensor_sequential(base)(ids), base(ids).logits, rtol=0, atol=0)


def test_lowbit_benchmark(tmp_path):
    pytest.importorskip("torchao.optim", reason="the lowbit extra (torchao) is not installed")
    run("benchmarks/bench_lowbit.py", "--width", "256", "--layers", "2", "--warmup", "1", "--steps", "1",
        "--json", str(tmp_path / "lowbit.json"))
    results = json.loads((tmp_path / "lowbit.json").read_text())["results"]
    assert results["torchao AdamW8bit"]["state_bytes_per_param"] < results["AdamW fused float32"]["state_bytes_per_param"] / 3


def test_schedule_benchmark_times_each_schedule_and_finds_it_exact(tmp_path):
    run("benchmarks/bench_schedule.py", "--quick", "--threads", "1", "--update-sleep-ns", "20",
        "--json", str(tmp_path / "schedule.json"))
    data = json.loads((tmp_path / "schedule.json").read_text())
    assert "benchmarks/bench_schedule.py --quick" in data["command"]
    assert data["host_threads"] == torch.get_num_threads() and data["update_threads"] == 1
    assert data["host_bandwidth"]["num_threads"] == 1 and len(data["fused_adamw_alone"]["samples_s"]) == 7
    assert set(data["sizes"]) >= {"dim", "slices", "parameters", "rows"}
    assert [r["ratio"] for r in data["ratios"]] == [1, 2, 4]
    # --quick has 4 slices: a quarter of them is the one resident slice.
    assert data["resident_slices"] == [1] and "training thread" in data["resident_stand_in"]
    names = ["next-forward", "backward", "serial", "next-forward+resident1", "backward+resident1"]
    assert data["schedules"] == names
    for ratio in data["ratios"]:
        assert ratio["update_s"] > 0 and ratio["device_s"] > 0 and ratio["slept_s"] >= 0
        assert list(ratio["schedules"]) == names
        for name, schedule in ratio["schedules"].items():
            assert set(schedule) >= {"step_s", "bound_s", "step_over_bound", "update_s", "device_s", "exact"}
            assert schedule["bound_s"] == max(schedule["device_s"], schedule["update_s"])
            assert schedule["step_over_bound"] == schedule["step_s"] / schedule["bound_s"]
            # The bound with the host counted: AdamW's 28 bytes a streamed float32 parameter, the
            # copies in RAM read and written, the slow host's sleep in the host's term.
            counted, streamed = schedule["host_counted"], data["sizes"]["dim"] ** 2 * (4 - schedule["resident_slices"])
            assert counted["host_bytes"]["update"] == 28 * streamed and counted["host_bytes"]["shadow"] == 0
            assert counted["bound_terms"]["update_sleep_s"] == pytest.approx(20e-9 * streamed)
            assert counted["bound_s"] == max(counted["bound_terms"][k] for k in ("resident_step_s", "host_bytes_s"))
            assert schedule["step_over_host_counted_bound"] == schedule["step_s"] / counted["bound_s"]
            assert schedule["exact"] is True, name
            assert schedule["resident_slices"] == (1 if "resident" in name else 0)
        # With a resident slice, the device's work includes its update and the host's leaves it out.
        terms = ratio["resident"]["1"]
        assert terms["resident_update_s"] > 0 and terms["device_without_update_s"] > 0
        assert terms["device_s"] == terms["device_without_update_s"] + terms["resident_update_s"]
        resident = ratio["schedules"]["backward+resident1"]
        assert resident["device_s"] == terms["device_s"] and resident["update_s"] == terms["update_s"]
        assert resident["resident_update_s"] == terms["resident_update_s"]


def test_schedule_benchmark_clipped_by_offload_is_exact_and_counts_the_clip_with_the_host(tmp_path):
    # --clip-with offload: the norms from backward, the scaling in the update; the parameters are
    # still those of the plain AdamW after PyTorch's clip, and the clip's time is the host's share.
    run("benchmarks/bench_schedule.py", "--quick", "--threads", "1", "--ratios", "1", "--resident", "1", "--clip", "1e-3",
        "--clip-with", "offload", "--json", str(tmp_path / "schedule.json"))
    data = json.loads((tmp_path / "schedule.json").read_text())
    assert data["clip"] == 1e-3 and data["clip_with"] == "offload"
    (ratio,) = data["ratios"]
    assert list(ratio["schedules"]) == ["next-forward", "serial", "next-forward+resident1"]  # in backward cannot clip
    for name, schedule in ratio["schedules"].items():
        assert schedule["exact"] is True, name
        assert schedule["clip_s"] > 0
        assert schedule["bound_s"] == max(schedule["device_s"], schedule["update_s"] + schedule["clip_s"])
        terms = schedule["host_counted"]["bound_terms"]
        assert terms["clip_bytes_s"] > 0 and terms["resident_step_s"] == pytest.approx(schedule["device_s"])


def test_schedule_benchmark_slow_host_sleeps_on_the_host_worker_only(monkeypatch):
    # The resident slices' update runs on the training thread, the stand-in's device: it must not
    # take the slow host's sleep, which the host worker's updates take. The sleeps are recorded,
    # not timed (a loaded machine makes any step slow).
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_schedule
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    cls = bench_schedule.optimizer_class(argparse.Namespace(update_sleep_ns=2e6))  # 2 ms per parameter
    slept: list[tuple[int, float]] = []
    monkeypatch.setattr(bench_schedule.time, "sleep", lambda s: slept.append((threading.get_ident(), s)))

    def step() -> None:
        p = torch.nn.Parameter(torch.zeros(50))
        p.grad = torch.ones(50)
        cls([p], lr=1e-3).step()

    step()
    assert slept == []
    worker = threading.Thread(target=step)
    worker.start()
    worker.join()
    assert len(slept) == 1 and slept[0][0] != threading.get_ident() and slept[0][1] == pytest.approx(0.1)


def test_threads_benchmark_times_one_fewer_thread_under_each_wait_policy(monkeypatch):
    # benchmarks/bench_threads.py's configurations and its medians over repeats, without the runs.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_threads
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    monkeypatch.setattr(bench_threads.torch, "get_num_threads", lambda: 4)
    names = [bench_threads.name_of(c) for c in bench_threads.configurations()]
    assert names == ["default-unset", "threads3-unset", "default-passive", "threads3-passive", "default-active",
                     "threads3-active"]
    monkeypatch.setattr(bench_threads.torch, "get_num_threads", lambda: 1)
    assert [c["threads"] for c in bench_threads.configurations()] == [None] * 3

    def report(step: float) -> dict:
        schedule = {"step_s": step, "step_over_bound": step / 2, "step_over_host_counted_bound": step / 3,
                    "exact": True}
        return {"ratios": [{"ratio": 1.0, "update_s": step, "schedules": {"backward": schedule}}]}

    summary = bench_threads.summary([report(1.0), report(5.0), report(2.0)])
    assert summary["1.0"]["update_s"] == 2.0
    assert summary["1.0"]["schedules"]["backward"] == {"step_s": 2.0, "step_over_bound": 1.0,
                                                       "step_over_host_counted_bound": 2 / 3,
                                                       "steps_s": [1.0, 5.0, 2.0], "exact": True}


def test_bench_backward_norms_finds_every_way_the_same(tmp_path):
    out = run("benchmarks/bench_backward_norms.py", "--quick", "--json", str(tmp_path / "n.json"))
    data = json.loads((tmp_path / "n.json").read_text())
    assert data["same_norms"] is True and data["same_parameters"] is True and data["scaled_every_step"] is True
    assert set(data["medians"]) == {"after_backward", "in_backward", "scaled_in_update"} and "same norms: True" in out


def test_update_order_benchmark_quick_times_both_orders(tmp_path):
    # benchmarks/gpu_check.sh does not run it: this smoke run is what keeps it working.
    out = run("benchmarks/bench_update_order.py", "--quick", "--threads", "1", "--ratios", "1",
              "--json", str(tmp_path / "order.json"))
    data = json.loads((tmp_path / "order.json").read_text())
    assert data["schedules"] == ["backward", "backward+landed-order"]
    assert set(data["forward_wait"]) == {"backward", "backward+landed-order"}
    assert all(s["exact"] is True for s in data["ratios"][0]["schedules"].values())
    assert "forward waits for updates" in out


def script_error(*args: str) -> str:
    """A script's refusal: exit status 2 and one line of error from its parser, no traceback."""
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    (line,) = [line for line in done.stderr.splitlines() if "error:" in line]
    return line


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps must be at least 1"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--slices", "0"], "--slices must be at least 1"),
    (["--microbatches", "0"], "--microbatches must be at least 1"),
    (["--lr", "-1"], "--lr must be 0 or more"),
    (["--set", "foo=1"], "has no setting 'foo'"),
    (["--resume", "/nonexistent/checkpoint"], "no such checkpoint directory"),
    (["--out", "scripts/demo.py", "--save-every", "1"], "--out scripts/demo.py: not a directory"),
])
def test_distributed_training_script_refuses_bad_values_before_starting(args, message):
    # Refused by the parser, before torchrun's ranks would each print a traceback.
    assert message in script_error("scripts/train_distributed.py", "--preset", "tiny", *args)


def test_distributed_training_script_refuses_a_resume_with_nothing_left(tmp_path):
    checkpoint = tmp_path / "checkpoints" / "step-2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "offload.json").write_text("{}")
    (tmp_path / "checkpoints" / "latest").write_text("step-2")
    line = script_error("scripts/train_distributed.py", "--preset", "tiny", "--steps", "2", "--out", str(tmp_path),
                        "--resume", "latest")
    assert "the checkpoint is at step 2 and --steps is 2, so nothing would train: pass --steps N > 2" in line
    assert "not a checkpoint" in script_error("scripts/train_distributed.py", "--resume", str(tmp_path))


@pytest.mark.parametrize("args, message", [
    (["{empty}"], "no config.json"),
    (["{config}"], "a config.json but no weights"),
    (["{config}", "--num-slices", "0"], "--num-slices must be at least 1"),
    (["{config}", "--device", "foo"], "argument --device: foo is not a device: use cpu, cuda or cuda:N"),
    (["{config}", "--device", "meta"], "argument --device: meta: the layers compute on cpu, cuda or cuda:N, not meta"),
] + ([] if torch.cuda.is_available() else [(["{config}", "--device", "cuda"], "argument --device: cuda: this machine has no CUDA device; use --device cpu")]))
def test_load_checkpoint_script_refuses_before_loading(tmp_path, args, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.json").write_text('{"model_type": "llama"}')
    args = [a.format(empty=tmp_path / "empty", config=tmp_path / "config") for a in args]
    assert message in script_error("scripts/load_checkpoint.py", *args)


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps must be at least 1"),
    (["--device", "foo"], "argument --device: foo is not a device: use cpu, cuda or cuda:N"),
    (["--device", "meta"], "argument --device: meta: the layers compute on cpu, cuda or cuda:N, not meta"),
] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "argument --device: cuda: this machine has no CUDA device; use --device cpu")]))
def test_demo_refuses_bad_values(args, message):
    assert message in script_error("scripts/demo.py", *args)


@pytest.mark.parametrize("device", ["foo", "meta"])
def test_the_scripts_refuse_a_bad_device_while_parsing_in_the_same_words(tmp_path, device):
    """profile_memory.py reads --device as demo.py and load_checkpoint.py do (device_argument): the
    same line after the script's name, before a model is built or a mode runs."""
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    lines = {script: script_error(script, *args, "--device", device) for script, args in [
        ("scripts/demo.py", []), ("scripts/load_checkpoint.py", [str(tmp_path)]),
        ("scripts/profile_memory.py", ["--preset", "tiny"])]}
    words = {line.split(" error: ", 1)[1] for line in lines.values()}
    assert len(words) == 1 and words.pop().startswith(f"argument --device: {device}"), lines


def test_demo_says_no_cuda_only_without_it():
    assert ("(no CUDA device found)" in demo_run().stdout) is (not torch.cuda.is_available())


def help_of(script: str) -> str:
    done = process(script, "--help")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    return " ".join(done.stdout.split())  # the options' help as one line, however argparse wraps it


def test_the_tools_help_gives_every_default():
    text = help_of("scripts/load_checkpoint.py")
    for default in ("(default: slices)", "(default: cuda when present, else cpu)", "(default: 8)", "(default: fp32)",
                    "(default: none)"):
        assert default in text, default
    text = help_of("scripts/profile_memory.py")
    for option in ("num_slices values (default: 4)", "num_microbatches values (default: 1)", "(default: adamw)"):
        assert option in text, option


@pytest.mark.parametrize("script", ["benchmarks/gpu_check_summary.py", "benchmarks/stream_idle.py"])
def test_summary_tools_help_and_usage_error(script):
    assert "usage:" in help_of(script)
    done = process(script)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "arguments are required" in done.stderr


@pytest.mark.parametrize("args, message", [
    (["benchmarks/bench_cast.py", "--mib", "-1"], "--mib and --repeats must be at least 1"),
    (["benchmarks/bench_cast.py", "--repeats", "0"], "--mib and --repeats must be at least 1"),
    (["benchmarks/bench_cast.py", "--json", "/tmp"], "--json /tmp: is a directory"),
    (["benchmarks/bench_cast.py", "--json", "scripts/demo.py/x.json"], "scripts/demo.py is a file, not a directory"),
    (["benchmarks/bench_replay_state.py", "--steps", "0"], "--steps must be at least 1"),
    (["benchmarks/bench_replay_state.py", "--json", "/tmp"], "--json /tmp: is a directory"),
    (["benchmarks/chunked_loss_precision.py", "--tokens", "0"], "must be at least 1"),
    (["benchmarks/chunked_loss_precision.py", "--chunks", "64", "0"], "must be at least 1"),
    (["benchmarks/bench_data.py", "--sizes-mb", "0"], "--sizes-mb must be above 0"),
    (["benchmarks/bench_data.py", "--steps", "0"], "--steps at least 1"),
    (["benchmarks/bench_loading.py", "--dir", "d", "--json", "j.json", "--hidden", "0"], "must be at least 1"),
    # --dir is made if missing (bench_loading.py's way), refused where it cannot be, before measuring.
    (["benchmarks/bench_checkpoint.py", "--dir", "README.md"], "--dir README.md: is a file, not a directory"),
    (["benchmarks/bench_scale.py", "--dir", "README.md/x"], "--dir README.md/x: cannot be made (Not a directory)"),
    (["benchmarks/bench_data.py", "--dir", "README.md"], "--dir README.md: is a file, not a directory"),
])
def test_benchmarks_refuse_bad_sizes_and_outputs_before_measuring(args, message):
    assert message in script_error(*args)


def test_every_benchmark_writing_json_checks_its_path_after_parsing():
    # benchmarks/json_output.py: a --json that cannot be written fails before the run, not after it.
    writers = [path for path in sorted((ROOT / "benchmarks").glob("*.py")) if re.search(r"--json\b", path.read_text())
               and path.name not in ("json_output.py", "bench_update_order.py")]  # the latter parses as bench_schedule
    assert len(writers) > 20
    assert [p.name for p in writers if "check_json_path(parser, args.json)" not in p.read_text()] == []


def test_the_readme_and_the_guide_fine_tune_into_folders_of_their_own():
    # Followed in order, a run into the folder of a finished model is refused ("pass --overwrite"):
    # the README's quick start and docs/huggingface.md's first command each write their own.
    def outs(document: str) -> set[str]:
        found = set()
        text = (ROOT / document).read_text()
        for command in re.finditer(r"(?:finetune_causal_lm\.py|offload-finetune)([^\n`#]*)", text):
            args = command.group(1).split()
            if "--out" in args and not {"--resume", "--overwrite"} & set(args):
                found.add(args[args.index("--out") + 1])
        return found

    readme, guide = outs("README.md"), outs("docs/huggingface.md")
    assert readme and guide and readme.isdisjoint(guide), readme & guide


def test_offload_command_without_a_command_is_a_usage_error():
    done = process("-m", "offload")
    assert done.returncode == 2 and "usage: offload COMMAND" in done.stderr and "a COMMAND is required" in done.stderr


def test_offload_command_help_into_a_closed_pipe_ends_quietly():
    # `offload --help | head -0`: the reader gone before the help is written.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.Popen([sys.executable, "-m", "offload", "--help"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    done.stdout.close()
    err = done.stderr.read().decode()
    assert done.wait(timeout=120) == 1 and "Traceback" not in err and "BrokenPipeError" not in err, err
