"""The memory profiler (``offload/profiling/``, ``scripts/profile_memory.py``) and the model presets.

The script runs end to end on the ``tiny`` preset in a subprocess, as a user would run it; the
measuring functions are tested directly. Figures that need a GPU or NVML must be reported as
unavailable, with the reason, never raised; the one claim that needs a GPU (offloading lowers the
peak allocated device memory) runs behind the ``cuda`` marker.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from offload import OffloadModel
from offload.planning.presets import Preset, build_preset, preset_from_factory, preset_names, preset_settings
from offload.profiling import (
    Mode,
    ModeFailed,
    PlotUnavailable,
    check_plotting,
    format_size,
    host_buffer_bytes,
    offload_modes,
    open_nvml,
    parse_size,
    profile_modes,
)

from .helpers import CUDA

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "profile_memory.py"
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_script(*args: str) -> subprocess.CompletedProcess:
    # The package of this checkout, whether or not it is the one installed.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": path})


def load_script() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("profile_memory_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_one_line_error(stderr: str, *fragments: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    assert "error:" in lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# -- the script, end to end ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One run of the script on the tiny preset, with every output it can write here."""
    out = tmp_path_factory.mktemp("profile")
    paths = {"json": out / "run.json", "csv": out / "timeline.csv", "plot": out / "memory.png"}
    args = ["--preset", "tiny", "--steps", "2", "--slices", "2", "--microbatches", "1", "2",
            "--checkpoint", "on", "--device", "cpu", "--expect-peak-below", "1TiB",
            "--json", str(paths["json"]), "--csv", str(paths["csv"])]
    if HAS_MATPLOTLIB:
        args += ["--plot", str(paths["plot"])]
    result = run_script(*args)
    assert result.returncode == 0, result.stderr
    return {"result": result, "paths": paths, "json": json.loads(paths["json"].read_text())}


def test_script_json_reports_resident_and_offload_runs_with_host_figures(tiny_run):
    data = tiny_run["json"]
    runs = data["runs"]
    assert [run["mode"] for run in runs] == ["resident", "offload", "offload"]
    assert [run["label"] for run in runs] == ["resident", "offload slices=2 mb=1 ckpt=on",
                                              "offload slices=2 mb=2 ckpt=on"]
    for run in runs:
        host_fields = {k: v for k, v in run.items() if "host" in k or "rss" in k}
        assert {"host_rss_peak_bytes", "host_rss_start_bytes", "host_pinned_bytes"} <= set(host_fields)
        assert run["host_rss_peak_bytes"] >= run["host_rss_start_bytes"] > 0
        assert run["host_pinned_bytes"] == 0  # nothing is pinned without CUDA...
        assert run["notes"]["host_pinned_bytes"]  # ...and the entry says why
        assert run["error"] is None
        assert run["step_time_s"] > 0 and len(run["step_times_s"]) == 2
        assert set(run["phases"]) == {"forward", "backward", "optimizer"}
        for phase in run["phases"].values():
            assert phase["host_rss_peak_bytes"] > 0 and phase["time_s"] > 0
        # Device figures are absent on the CPU, with the reason next to them.
        assert run["device_peak_allocated_bytes"] is None
        assert run["notes"]["device_peak_allocated_bytes"] == "unavailable (device is cpu)"
        assert run["ratio_to_resident"]["host_rss_peak"] > 0
    assert runs[0]["ratio_to_resident"]["step_time"] == 1.0
    offloaded = runs[1]
    assert offloaded["host_model_bytes"] >= data["model"]["parameter_bytes"]
    assert offloaded["num_slices"] == 2 and offloaded["checkpoint_activation"] is True
    assert data["device"] == "cpu" and data["model"]["settings"]["depth"] == 3
    assert data["expect_peak_below"]["passed"] is True


def test_script_reports_unavailable_figures_instead_of_raising(tiny_run):
    data, stdout = tiny_run["json"], tiny_run["result"].stdout
    assert data["unavailable"]["device"] == "device is cpu"
    assert data["figures"]["nvml"].startswith("NVML unavailable: ")
    assert data["figures"]["host_pinned"] == "not pinned (CPU device)"
    assert "device: unavailable (device is cpu)" in stdout
    assert "nvml: NVML unavailable: " in stdout


def test_script_prints_a_table_and_progress(tiny_run):
    stdout, stderr = tiny_run["result"].stdout, tiny_run["result"].stderr
    for label in ("resident", "offload slices=2 mb=1 ckpt=on", "offload slices=2 mb=2 ckpt=on"):
        assert label in stdout
    assert "host RSS peak" in stdout and "MiB" in stdout and "1.00x" in stdout
    assert "OK: offloaded peak host RSS" in stdout
    assert "[1/3] resident: step 1/2" in stderr and "[3/3] offload slices=2 mb=2 ckpt=on: step 2/2" in stderr


def test_script_steps_a_fused_optimizer_and_says_cpu_times_are_no_guide(tiny_run):
    # A per-tensor AdamW on offloaded parameters would trip the library's own fused=True warning.
    assert "fused=True" not in tiny_run["result"].stderr
    assert "step times on the CPU: nothing overlaps" in tiny_run["result"].stdout


def test_script_csv_holds_the_sampled_timeline(tiny_run):
    lines = tiny_run["paths"]["csv"].read_text().splitlines()
    assert lines[0].split(",") == ["label", "step", "phase", "time_s", "host_rss_bytes", "nvml_used_bytes",
                                   "device_allocated_bytes", "device_reserved_bytes"]
    rows = [line.split(",") for line in lines[1:]]
    assert {row[0] for row in rows} == {run["label"] for run in tiny_run["json"]["runs"]}
    assert {"setup", "forward", "backward", "optimizer", "teardown"} <= {row[2] for row in rows}
    assert all(int(row[4]) > 0 and row[5] == "" and row[6] == "" for row in rows)


def test_script_plot_is_a_png(tiny_run):
    if not HAS_MATPLOTLIB:
        pytest.skip('matplotlib is not installed: pip install -e ".[plot]"')
    assert tiny_run["paths"]["plot"].read_bytes()[:8] == PNG_SIGNATURE


def test_plot_tells_thirteen_modes_apart_marks_phases_and_leaves_out_teardown():
    if not HAS_MATPLOTLIB:
        pytest.skip('matplotlib is not installed: pip install -e ".[plot]"')
    from matplotlib.figure import Figure

    from offload.profiling.plot import PHASE_MARKERS, draw_profile

    modes = [Mode.resident(), *offload_modes([1, 2, 3], [1, 2], [True, False])]
    # The runner collects garbage before each of its 27 measurements: with what this process held
    # before frozen (gc.freeze), each collection walks the modes' objects only, not the whole heap
    # of an interpreter that imported torch and the suite (most of this test's time, unfrozen).
    gc.freeze()
    try:
        profile = profile_modes(lambda: build_preset("tiny"), modes, "cpu", steps=2)
    finally:
        gc.unfreeze()
    (ax,) = draw_profile(profile, Figure).axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    mode_lines = [lines[run.label] for run in profile.runs]
    assert len(mode_lines) == 13
    assert len({(line.get_color(), line.get_linestyle()) for line in mode_lines}) == 13
    assert ax.get_ylim()[0] == 0
    for run, line in zip(profile.runs, mode_lines):
        samples = [s for s in profile.samples if s.label == run.label]
        assert "teardown" in {s.phase for s in samples}
        # The line ends with the last step: the teardown's samples are not drawn.
        assert list(line.get_xdata()) == [s.time_s for s in samples if s.phase != "teardown"]
    # One marker per phase per step on every line, and a legend entry per phase.
    markers = [line for line in ax.get_lines() if line.get_linestyle() == "None" and len(line.get_xdata())]
    assert len(markers) == 13 * len(PHASE_MARKERS)
    assert all(len(line.get_xdata()) == 2 for line in markers)
    assert {f"{phase} starts" for phase in PHASE_MARKERS} <= set(lines)


def test_script_fails_when_the_offloaded_peak_exceeds_the_budget():
    result = run_script("--preset", "tiny", "--steps", "1", "--device", "cpu", "--no-resident", "--slices", "2",
                        "--checkpoint", "on", "--expect-peak-below", "1KiB")
    assert result.returncode == 1
    assert "FAIL: offloaded peak host RSS (the device is the CPU)" in result.stderr
    assert "exceeds 1.0 KiB" in result.stderr


def test_script_unknown_preset_is_a_one_line_error():
    result = run_script("--preset", "huge")
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "unknown preset 'huge'", "tiny, mlp, transformer")


@pytest.mark.parametrize(("args", "fragments"), [
    (["--expect-peak-below", "12XB"], ["cannot read '12XB' as a size", "512MiB"]),
    (["--expect-peak-below", "-1GiB"], ["--expect-peak-below"]),
    (["--model", "torch.nn:Identity", "--input-shape", "4"], ["torch.nn:Identity returned a Identity",
                                                              "must return an nn.Sequential"]),
    (["--model", "torch.nn", "--input-shape", "4"], ["package.module:factory"]),
    (["--model", "no_such_package_xyz.models:build", "--input-shape", "4"], ["cannot import 'no_such_package_xyz"]),
    (["--model", "torch.nn:Sequential"], ["--model needs --input-shape"]),
    (["--preset", "tiny", "--vocab", "10"], ["describe the input of --model"]),
    (["--steps", "0"], ["--steps", "positive integer"]),
    (["--device", "cuda:7"] if not torch.cuda.is_available() else ["--device", "nonsense"], ["--device"]),
])
def test_bad_arguments_are_one_line_errors(args, fragments, capsys):
    script = load_script()
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--preset", "tiny", "--steps", "1", *args] if "--preset" not in args else args)
    assert exit_info.value.code == 2
    assert_one_line_error(capsys.readouterr().err, *fragments)


def test_plot_without_matplotlib_is_a_clear_error_before_anything_runs(monkeypatch, capsys):
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # what `import` sees when it is not installed
    with pytest.raises(PlotUnavailable, match=r'pip install "offload\[plot\]"'):
        check_plotting()
    script = load_script()
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--preset", "tiny", "--plot", "never-written.png"])
    assert exit_info.value.code == 2
    assert_one_line_error(capsys.readouterr().err, "--plot", "needs matplotlib, which is not installed")
    assert not Path("never-written.png").exists()


# -- measuring, directly ------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "nbytes"), [
    ("100000", 100000), ("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("1.5GB", 1_500_000_000),
    ("1.5 gib", 3 * 2**29), ("64kb", 64_000), ("0", 0), ("7B", 7),
])
def test_parse_size(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "GiB", "12XB", "-1GiB", "1.2.3MiB", "2 G", "1e3"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="cannot read .* as a size"):
        parse_size(text)


def test_format_size():
    assert [format_size(n) for n in (None, 0, 1023, 1536, 5 * 2**20, 3 * 2**29)] == [
        "n/a", "0 B", "1023 B", "1.5 KiB", "5.0 MiB", "1.50 GiB"]


def test_open_nvml_on_a_cpu_device_says_why():
    reader, status = open_nvml("cpu")
    assert reader is None and status == "NVML unavailable: device is cpu, NVML measures GPUs"


def test_open_nvml_without_pynvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    reader, status = open_nvml("cuda")
    assert reader is None
    assert status.startswith("NVML unavailable: cannot import pynvml") and "nvidia-ml-py" in status


def fake_pynvml(init_error: Exception | None = None, lookup_error: Exception | None = None) -> types.ModuleType:
    module = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    calls: list[str] = []

    def init() -> None:
        calls.append("init")
        if init_error is not None:
            raise init_error

    def by_index(index: int) -> object:
        if lookup_error is not None:
            raise lookup_error
        return ("handle", index)

    module.NVMLError = NVMLError
    module.calls = calls
    module.nvmlInit = init
    module.nvmlShutdown = lambda: calls.append("shutdown")
    module.nvmlDeviceGetHandleByUUID = by_index
    module.nvmlDeviceGetHandleByIndex = by_index
    module.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(used=123 * 2**20)
    return module


@pytest.mark.parametrize("error", [
    "NVMLError_LibraryNotFound: NVML Shared Library Not Found", "OSError: libnvidia-ml.so.1: cannot open",
])
def test_open_nvml_reports_an_init_failure(monkeypatch, error):
    kind, message = error.split(": ", 1)
    module = fake_pynvml()
    exception_type = type(kind, (module.NVMLError,), {}) if kind.startswith("NVML") else OSError

    def init() -> None:
        raise exception_type(message)

    module.nvmlInit = init
    monkeypatch.setitem(sys.modules, "pynvml", module)
    reader, status = open_nvml("cuda")
    assert reader is None and status == f"NVML unavailable: {kind}: {message}"


def test_open_nvml_shuts_down_when_the_device_cannot_be_found(monkeypatch):
    module = fake_pynvml(lookup_error=RuntimeError("no such GPU"))
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(uuid="abc"))
    reader, status = open_nvml("cuda")
    assert reader is None and status == "NVML unavailable: RuntimeError: no such GPU"
    assert module.calls == ["init", "shutdown"]


def test_open_nvml_reads_used_memory_of_the_device_by_uuid(monkeypatch):
    module = fake_pynvml()
    looked_up: list[str] = []
    module.nvmlDeviceGetHandleByUUID = lambda uuid: looked_up.append(uuid) or "handle"
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(uuid="1234-abcd"))
    reader, status = open_nvml("cuda:1")
    assert reader is not None and reader.used_bytes() == 123 * 2**20
    assert looked_up == ["GPU-1234-abcd"] and "matched by UUID GPU-1234-abcd" in status
    reader.close()
    assert module.calls == ["init", "shutdown"]


def test_open_nvml_here_never_raises():
    # The real library: unavailable on a machine without a driver, a reader on a GPU machine.
    reader, status = open_nvml("cuda")
    if reader is None:
        assert status.startswith("NVML unavailable: ")
    else:
        assert reader.used_bytes() > 0
        reader.close()


def test_profile_modes_measures_every_mode_and_phase_on_the_cpu():
    modes = [Mode.resident(), *offload_modes([2], [1, 2], [True, False])]
    lines: list[str] = []
    profile = profile_modes(lambda: build_preset("tiny"), modes, "cpu", steps=2, progress=lines.append)
    assert [run.label for run in profile.runs] == [mode.label for mode in modes]
    assert len(lines) == len(modes) * 2 and lines[0].startswith("[1/5] resident: step 1/2")
    for run in profile.runs:
        assert run.error is None and len(run.step_times_s) == 2
        assert run.host_rss_peak_bytes == max(p.host_rss_peak_bytes for p in run.phases.values())
        assert run.device_peak_allocated_bytes is None and run.nvml_peak_used_bytes is None
    offloaded = profile.runs[1]
    assert offloaded.host_model_bytes >= offloaded.parameter_bytes > 0
    assert offloaded.device_slot_bytes > 0 and offloaded.host_pool_peak_bytes > 0
    assert offloaded.host_pinned_bytes == 0
    assert profile.resident() is profile.runs[0]
    peak, what, label = profile.offloaded_peak()
    assert peak == max(r.host_rss_peak_bytes for r in profile.runs[1:]) and "host RSS" in what
    assert label in [r.label for r in profile.runs[1:]]
    # Every sample belongs to a mode that ran, in a known phase.
    assert {s.label for s in profile.samples} == {r.label for r in profile.runs}
    assert {s.phase for s in profile.samples} <= {"setup", "forward", "backward", "optimizer", "teardown"}
    json.dumps(profile.to_json())
    table = profile.table()
    assert "offload slices=2 mb=2 ckpt=off" in table and "device: unavailable (device is cpu)" in table


class FailsOnLargeBatches(nn.Module):
    """Raises an out-of-memory error when it sees more than ``rows`` rows, as a full device would."""

    def __init__(self, rows: int, error: type[Exception] = torch.cuda.OutOfMemoryError) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.rows = rows
        self.error = error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.rows:
            raise self.error("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.linear(x)


def failing_preset(rows: int, error: type[Exception] = torch.cuda.OutOfMemoryError) -> Preset:
    model = nn.Sequential(nn.Linear(4, 4), FailsOnLargeBatches(rows, error), nn.Linear(4, 2))
    return Preset("failing", "fails above a batch size", model,
                  lambda batch, device: (torch.randn(batch, 4, device=device), None),
                  lambda output, target: output.square().mean(), batch_size=8)


def test_a_mode_that_runs_out_of_memory_is_reported_and_the_next_one_runs():
    # Four microbatches of 2 rows fit; the whole batch of 8 does not.
    modes = [Mode.resident(), Mode.offload(2, 4)]
    profile = profile_modes(lambda: failing_preset(rows=2), modes, "cpu", steps=1)
    resident, offloaded = profile.runs
    assert resident.error == "out of memory" and "Tried to allocate" in resident.notes["error"]
    assert offloaded.error is None and offloaded.step_time_s > 0
    assert profile.ratios_to_resident(offloaded)["host_rss_peak"] is None
    assert "out of memory" in profile.table()
    profile_without_offload = profile_modes(lambda: failing_preset(rows=2), [Mode.offload(2, 1)], "cpu", steps=1)
    assert profile_without_offload.offloaded_peak()[0] is None  # a budget check cannot pass on a failed mode


@pytest.mark.parametrize(("steps", "step_time", "phase_time"), [
    (1, "step: time of the one step (the first: it also allocates the optimizer's state)", "and time per phase"),
    (2, "step: median step time after the first", "and median time per phase"),
])
def test_the_table_says_what_its_times_are_for_one_step_and_for_several(steps, step_time, phase_time):
    # With --steps 1 the figure is the first step's: "median step time after the first" said otherwise.
    table = profile_modes(lambda: failing_preset(rows=8), [Mode.offload(2)], "cpu", steps=steps).table()
    header, *rest = table.splitlines()
    assert header.endswith(f"{steps} step(s) on cpu, AdamW; {step_time}; x res: ratio to resident"), header
    assert f"peak host RSS {phase_time}" in rest


def test_a_mode_that_fails_otherwise_raises_with_its_name():
    with pytest.raises(ModeFailed, match=r"mode 'offload slices=2 mb=1 ckpt=on' failed: ValueError: CUDA out"):
        profile_modes(lambda: failing_preset(rows=2, error=ValueError), [Mode.offload(2)], "cpu", steps=1)


def test_profile_modes_rejects_bad_requests():
    build = lambda: build_preset("tiny")  # noqa: E731
    with pytest.raises(ValueError, match="no modes"):
        profile_modes(build, [], "cpu")
    with pytest.raises(ValueError, match="steps must be at least 1"):
        profile_modes(build, [Mode.resident()], "cpu", steps=0)
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        profile_modes(build, [Mode.resident()], "cpu", optimizer="lion")
    with pytest.raises(ValueError, match="unknown mode kind 'swap'"):
        profile_modes(build, [Mode("swap")], "cpu")


def test_a_compute_dtype_mode_counts_the_half_precision_copies():
    modes = offload_modes([2], compute_dtypes=[None, torch.bfloat16])
    assert [m.label for m in modes] == ["offload slices=2 mb=1 ckpt=on", "offload slices=2 mb=1 ckpt=on bf16"]
    profile = profile_modes(lambda: build_preset("tiny"), modes, "cpu", steps=1)
    plain, half = profile.runs
    assert (plain.compute_dtype, half.compute_dtype) == (None, "bfloat16")
    assert plain.host_model_bytes < half.host_model_bytes < 2 * plain.host_model_bytes  # + the bf16 shadow
    assert half.error is None and half.step_time_s > 0


def test_host_buffer_bytes_reads_the_model_buffers():
    model = OffloadModel(build_preset("tiny").model, device="cpu", num_slices=3)
    held = host_buffer_bytes(model)
    slices = model._engine.slices
    assert held["model"] == sum(s.storage.host_nbytes for s in slices)
    assert held["model"] >= sum(p.numel() * p.element_size() for p in model.parameters())
    assert held["slots"] == 2 * max(s.storage.device_nbytes for s in slices)
    assert held["pool"] == 0 and held["shadow"] == 0 and held["pinned"] is False
    half = OffloadModel(build_preset("tiny").model, device="cpu", num_slices=3, compute_dtype=torch.bfloat16)
    assert 0 < host_buffer_bytes(half)["shadow"] < held["model"]


# -- presets ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", preset_names())
def test_presets_build_and_train(name):
    small = {"tiny": {}, "mlp": {"width": 32, "depth": 2, "in_features": 16, "classes": 5},
             "transformer": {"n_layers": 2, "d_model": 32, "n_heads": 4, "seq_len": 16, "vocab": 50}}[name]
    preset = build_preset(name, **small)
    assert preset.name == name and isinstance(preset.model, nn.Sequential) and "\n" not in preset.description
    assert all(p.device.type == "cpu" for p in preset.model.parameters())
    x, y = preset.make_batch(3, "cpu")
    loss = preset.loss(preset.model(x), y)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in preset.model.parameters())
    # The same settings build the same weights and the same batch.
    again = build_preset(name, **small)
    for a, b in zip(preset.model.parameters(), again.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(again.make_batch(3, "cpu")[0], x, rtol=0, atol=0)


def test_transformer_preset_shape_and_offloading():
    preset = build_preset("transformer", n_layers=3, d_model=32, n_heads=2, seq_len=12, vocab=40)
    layers = list(preset.model)
    assert len(layers) == 1 + 3 + 2  # embedding, blocks, final LayerNorm, head
    assert isinstance(layers[-2], nn.LayerNorm) and layers[-1].weight.shape == (40, 32)
    assert layers[-1].weight is not layers[0].token.weight  # untied, as in the recorded benchmarks
    x, y = preset.make_batch(2, "cpu")
    assert x.shape == y.shape == (2, 12) and x.dtype == torch.int64
    torch.testing.assert_close(x[:, 1:], y[:, :-1], rtol=0, atol=0)  # next-token targets
    block_input = torch.randn(2, 12, 32)
    assert layers[1](block_input).shape == block_input.shape
    # Causal: changing the last position leaves earlier outputs unchanged.
    changed = block_input.clone()
    changed[:, -1] += 1
    torch.testing.assert_close(layers[1](changed)[:, :-1], layers[1](block_input)[:, :-1], rtol=0, atol=0)
    reference = build_preset("transformer", n_layers=3, d_model=32, n_heads=2, seq_len=12, vocab=40).model
    offloaded = OffloadModel(preset.model, device="cpu", num_slices=4)
    torch.testing.assert_close(offloaded(x), reference(x), rtol=0, atol=0)


def test_preset_overrides_make_larger_variants():
    assert set(preset_settings("transformer")) >= {"d_model", "n_layers", "n_heads", "seq_len", "vocab"}
    assert set(preset_settings("mlp")) >= {"width", "depth"}
    small, large = build_preset("mlp", width=16, depth=2), build_preset("mlp", width=32, depth=4)
    assert large.parameter_bytes > small.parameter_bytes and large.settings["depth"] == 4
    assert len(build_preset("transformer", n_layers=5, d_model=16, n_heads=2).model) == 1 + 5 + 2


@pytest.mark.parametrize(("name", "overrides", "match"), [
    ("huge", {}, "unknown preset 'huge'; choose from tiny, mlp, transformer"),
    ("mlp", {"heads": 2}, "preset 'mlp' has no setting 'heads'"),
    ("mlp", {"width": 0}, "width must be an int of at least 1"),
    ("transformer", {"d_model": 30, "n_heads": 4}, "not divisible by n_heads"),
    ("transformer", {"dropout": 1.5}, r"dropout must be a number in \[0, 1\)"),
])
def test_build_preset_rejects(name, overrides, match):
    with pytest.raises(ValueError, match=match):
        build_preset(name, **overrides)


def test_preset_from_factory(tmp_path, monkeypatch):
    (tmp_path / "user_models.py").write_text(textwrap.dedent("""
        from torch import nn

        def build():
            return nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3))

        def not_sequential():
            return nn.Linear(2, 2)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    preset = preset_from_factory("user_models:build", [6], vocab=10)
    x, target = preset.make_batch(5, "cpu")
    assert x.shape == (5, 6) and x.dtype == torch.int64 and int(x.max()) < 10 and target is None
    assert preset.loss(preset.model(x), target).dim() == 0
    floats = preset_from_factory("user_models:build", [2, 3])
    assert floats.make_batch(4, "cpu")[0].shape == (4, 2, 3)
    with pytest.raises(TypeError, match="user_models:not_sequential returned a Linear"):
        preset_from_factory("user_models:not_sequential", [2])
    with pytest.raises(ValueError, match="has no callable 'missing'"):
        preset_from_factory("user_models:missing", [2])


# -- on a GPU -------------------------------------------------------------------------------------------


@CUDA
def test_offloading_lowers_the_peak_allocated_device_memory():
    build = lambda: build_preset("mlp", width=1024, depth=8, batch_size=64)  # noqa: E731
    profile = profile_modes(build, [Mode.resident(), Mode.offload(4)], "cuda", steps=2)
    resident, offloaded = profile.runs
    assert resident.error is None and offloaded.error is None
    assert offloaded.device_peak_allocated_bytes < resident.device_peak_allocated_bytes
    assert offloaded.device_peak_reserved_bytes >= offloaded.device_peak_allocated_bytes
    # Pinned host buffers hold at least the parameters' host copies.
    assert offloaded.host_pinned_bytes >= offloaded.host_model_bytes >= offloaded.parameter_bytes
    assert profile.offloaded_peak()[1] == "peak allocated device memory"
    if "nvml" not in profile.unavailable:
        assert offloaded.nvml_peak_used_bytes > 0


@CUDA
def test_without_pynvml_a_gpu_run_still_reports_allocator_figures(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    profile = profile_modes(lambda: build_preset("tiny"), [Mode.resident(), Mode.offload(2)], "cuda", steps=1)
    assert profile.unavailable["nvml"].startswith("NVML unavailable: cannot import pynvml")
    for run in profile.runs:
        assert run.nvml_peak_used_bytes is None and run.device_peak_allocated_bytes > 0


def test_mode_rejects_an_unsupported_compute_dtype():
    with pytest.raises(ValueError, match="compute_dtype must be None, torch.bfloat16 or torch.float16"):
        Mode.offload(2, compute_dtype=torch.float32)


def test_host_allocation_failure_counts_as_out_of_memory():
    from offload.profiling.runner import _out_of_memory

    assert _out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"))
    assert _out_of_memory(MemoryError())
    assert not _out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
