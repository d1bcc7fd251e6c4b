"""Bad inputs to the memory profiler are refused before anything runs, each in one clear line.

``scripts/profile_memory.py`` answers a bad argument with a one-line error and exit status 2
(docs/profiling.md); an output path it cannot write, a device it cannot measure on and a
``--model`` factory that raises are bad arguments too, found before the first mode runs, so a
long run never ends in a traceback that loses its measurements. The API (:func:`profile_modes`,
:class:`Mode`, :meth:`Profile.write_csv`, :meth:`Profile.plot`) raises ``ValueError`` or an
``OSError`` that says what is wrong, at the call.

And what the profiler says about the inputs it took: a mode is labelled with the slices it ran
as, the profile names its model even when every mode ran out of memory, and ``--optimizer``'s help
names what the modes step. The benchmarks ``bench_hugepages.py`` and ``bench_lora.py`` refuse
sizes they cannot measure with argparse's error, as the other benchmarks do.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import sys
import textwrap
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from offload.cli.device_argument import device_argument
from offload.planning.presets import build_preset, preset_from_factory
from offload.profiling import Mode, Profile, profile_modes
from offload.profiling.measure import OPTIMIZERS
from offload.profiling.outputs import check_output_path

from .test_profiling import ROOT, assert_one_line_error, load_script, run_script


@pytest.fixture
def script(monkeypatch):
    """The script, loaded in this process, whose modes must never run: each test here is of an
    input refused before the first mode."""
    module = load_script()

    def no_run(*args, **kwargs):
        raise AssertionError("a mode ran before the bad argument was refused")

    monkeypatch.setattr(module, "profile_modes", no_run)
    return module


def refused(script, capsys, *args: str) -> str:
    """Run the script on ``args``; it must exit with status 2. Its one line of stderr."""
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--steps", "1", "--device", "cpu", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert_one_line_error(err)
    return err.strip()


# -- output paths, before the first mode ----------------------------------------------------------


@pytest.mark.parametrize("flag", ["--json", "--csv", "--plot"])
def test_an_output_path_that_is_a_directory_is_refused_before_any_mode_runs(script, capsys, tmp_path, flag):
    line = refused(script, capsys, "--preset", "tiny", flag, str(tmp_path))
    assert f"{flag}: '{tmp_path}' is a directory; give the path of a file" in line


def test_an_output_under_a_file_is_refused_before_any_mode_runs(script, capsys, tmp_path):
    (tmp_path / "a_file").write_text("")
    line = refused(script, capsys, "--preset", "tiny", "--json", str(tmp_path / "a_file" / "run.json"))
    assert f"--json: cannot write '{tmp_path / 'a_file' / 'run.json'}': '{tmp_path / 'a_file'}' is not a directory" \
        in line
    line = refused(script, capsys, "--preset", "tiny", "--csv", str(tmp_path / "a_file" / "sub" / "t.csv"))
    assert line.startswith("profile_memory.py: error: --csv: cannot write ") and "Not a directory" in line


def test_an_output_where_no_file_can_be_made_is_refused(script, capsys):
    # /proc takes no new files, whoever asks (os.access alone says the superuser may write there).
    line = refused(script, capsys, "--preset", "tiny", "--csv", "/proc/timeline.csv")
    assert "--csv: cannot write '/proc/timeline.csv': cannot make a file in '/proc'" in line


def test_a_directory_output_ends_the_real_script_at_once_with_status_2(tmp_path):
    result = run_script("--preset", "tiny", "--steps", "1", "--device", "cpu", "--json", str(tmp_path))
    assert result.returncode == 2
    assert_one_line_error(result.stderr, f"--json: '{tmp_path}' is a directory")
    assert result.stdout == "" and os.listdir(tmp_path) == []  # no mode ran, nothing was written


def test_check_output_path_says_what_is_wrong_and_leaves_nothing(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"the CSV: cannot write '.*/missing/t\.csv': its directory "
                                                r"'.*/missing' does not exist"):
        check_output_path(tmp_path / "missing" / "t.csv", "the CSV")
    check_output_path(tmp_path / "t.csv", "the CSV")
    assert os.listdir(tmp_path) == []  # the probe file is gone
    (tmp_path / "t.csv").write_text("kept")
    check_output_path(tmp_path / "t.csv", "the CSV")
    assert (tmp_path / "t.csv").read_text() == "kept"


def test_writing_a_profile_to_a_directory_is_a_clear_error(tmp_path):
    profile = Profile("model", "cpu", 1, 1, "AdamW", [], [], {}, {})
    with pytest.raises(IsADirectoryError, match=r"the CSV: '.*' is a directory; give the path of a file"):
        profile.write_csv(str(tmp_path))
    # Checked before matplotlib is imported: the same answer with or without it.
    with pytest.raises(IsADirectoryError, match=r"the plot: '.*' is a directory; give the path of a file"):
        profile.plot(str(tmp_path))


# -- devices ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "fragment"), [
    ("meta", "meta: the layers compute on cpu, cuda or cuda:N, not meta"),
    ("gpu0", "gpu0 is not a device: use cpu, cuda or cuda:N"),
    ("cuda", "cuda: this machine has no CUDA device; use --device cpu"),
])
def test_a_device_the_profiler_cannot_measure_on_is_refused_while_parsing(script, capsys, monkeypatch, text, fragment):
    """In the words of the commands and the other scripts (``device_argument``), not the library's."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(argparse.ArgumentTypeError) as expected:
        device_argument(text)
    assert str(expected.value) == fragment
    assert refused(script, capsys, "--preset", "tiny", "--device", text) == \
        f"profile_memory.py: error: argument --device: {fragment}"


def test_profile_modes_without_cuda_says_so(monkeypatch):
    build = lambda: build_preset("tiny")  # noqa: E731
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device 'cuda' was requested, but CUDA is not available here; use cpu"):
        profile_modes(build, [Mode.offload(2)], device="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="device 'cuda:3' was requested, but there are 1 CUDA devices"):
        profile_modes(build, [Mode.offload(2)], device="cuda:3")
    with pytest.raises(ValueError, match="cannot profile on device 'meta'"):
        profile_modes(build, [Mode.offload(2)], device="meta")
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        profile_modes(build, [Mode.offload(2)], device="gpu0")


# -- models and modes ---------------------------------------------------------------------------------


def test_a_model_factory_that_raises_is_one_line_naming_it(script, capsys, tmp_path, monkeypatch):
    (tmp_path / "raising_factory_models.py").write_text(textwrap.dedent("""
        def build():
            raise RuntimeError("no weights here\\nsecond line")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    line = refused(script, capsys, "--model", "raising_factory_models:build", "--input-shape", "4")
    assert line == ("profile_memory.py: error: --model raising_factory_models:build: the factory raised "
                    "RuntimeError: no weights here")


@pytest.mark.parametrize(("make", "message"), [
    (lambda: Mode.offload(0), "num_slices must be a positive int, got 0"),
    (lambda: Mode.offload(2, 0), "num_microbatches must be a positive int, got 0"),
    (lambda: Mode.offload(-1), "num_slices must be a positive int, got -1"),
    (lambda: Mode.offload(2.5), "num_slices must be a positive int, got 2.5"),
    (lambda: Mode.offload(True), "num_slices must be a positive int, got True"),
])
def test_mode_rejects_slices_and_microbatches_that_are_not_positive_ints(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_model_with_every_parameter_frozen_is_refused_before_any_mode_runs(script, capsys, tmp_path, monkeypatch):
    """Not autograd's "element 0 of tensors does not require grad" from inside the first mode."""
    (tmp_path / "frozen_factory_models.py").write_text(textwrap.dedent("""
        from torch import nn

        def frozen():
            return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4)).requires_grad_(False)

        def half_frozen():
            model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
            model[0].requires_grad_(False)
            return model
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    line = refused(script, capsys, "--model", "frozen_factory_models:frozen", "--input-shape", "8")
    assert line == ("profile_memory.py: error: frozen_factory_models:frozen returned an nn.Sequential whose 4 "
                    "parameters are all frozen (requires_grad=False): there is nothing to train; unfreeze the ones "
                    "to train (requires_grad_(True)) before returning it")
    # One trainable layer is enough: only a model with nothing to train is refused.
    assert preset_from_factory("frozen_factory_models:half_frozen", (8,)).parameter_bytes == 4 * (72 + 36)


def test_profile_modes_refuses_a_first_build_with_nothing_to_train_before_any_mode_runs():
    def build():
        builds.append(1)
        preset = build_preset("tiny")
        preset.model.requires_grad_(False)
        return preset

    builds: list[int] = []
    with pytest.raises(ValueError, match=r"build\(\) returned a preset whose model is an nn.Sequential whose 8 "
                                         r"parameters are all frozen \(requires_grad=False\): there is nothing to "
                                         r"train; unfreeze"):
        profile_modes(build, [Mode.resident(), Mode.offload(2)], device="cpu", steps=1)
    assert builds == [1]  # the warm-up's build, checked before its step
    empty = dataclasses.replace(build_preset("tiny"), model=nn.Sequential(nn.GELU()))
    with pytest.raises(ValueError, match=r"model is an nn.Sequential without parameters: there is nothing to"):
        profile_modes(lambda: empty, [Mode.offload(1)], device="cpu", steps=1)


# -- what the table and the JSON say ------------------------------------------------------------------


def test_the_optimizer_help_says_what_the_modes_step():
    """The modes step a fused torch.optim optimizer over model.parameters() (OPTIMIZERS); no
    OffloadOptimizer is built."""
    help_text = " ".join(load_script().build_parser().format_help().split())
    line = help_text[help_text.rindex("--optimizer {adamw,sgd}"):]  # after the usage line
    assert line.startswith("--optimizer {adamw,sgd} what every mode steps over model.parameters(): "
                           "torch.optim.AdamW or SGD, with fused=True (default: adamw)")
    assert "OffloadOptimizer" not in help_text
    parameter = nn.Parameter(torch.zeros(2))
    for name, cls in (("adamw", torch.optim.AdamW), ("sgd", torch.optim.SGD)):
        optimizer = OPTIMIZERS[name][1]([parameter], 1e-3)
        assert type(optimizer) is cls and optimizer.defaults["fused"] is True


def test_a_mode_asked_for_more_slices_than_layers_is_labelled_with_the_slices_it_ran():
    """The tiny preset has 7 layers: OffloadModel runs 100 asked slices as 7. The label, the
    JSON's num_slices, the table and the samples (which the CSV and the plot group by label)
    say so."""
    modes = [Mode.offload(7), Mode.offload(100)]
    with pytest.warns(UserWarning, match="num_slices=100 is more than the model's 7 layers"):
        profile = profile_modes(lambda: build_preset("tiny"), modes, device="cpu", steps=1)
    assert [run.label for run in profile.runs] == ["offload slices=7 mb=1 ckpt=on",
                                                   "offload slices=7 (asked 100) mb=1 ckpt=on"]
    assert [run["num_slices"] for run in profile.to_json()["runs"]] == [7, 7]
    assert "\noffload slices=7 (asked 100) mb=1 ckpt=on " in profile.table()
    assert {s.label for s in profile.samples} == {run.label for run in profile.runs}
    assert Mode.offload(100, 2, False, torch.bfloat16).label_ran(7) == \
        "offload slices=7 (asked 100) mb=2 ckpt=off bf16"


def test_when_every_mode_runs_out_of_memory_the_profile_still_names_the_model():
    """Not the placeholder "model", nor batch 0: the warm-up's build names them."""
    def out_of_memory(rows, device):
        raise MemoryError(f"out of memory for {rows} rows")

    preset = dataclasses.replace(build_preset("tiny"), make_batch=out_of_memory, batch_size=5)
    profile = profile_modes(lambda: preset, [Mode.resident(), Mode.offload(2)], device="cpu", steps=1)
    assert [run.error for run in profile.runs] == ["out of memory", "out of memory"]
    assert profile.description == f"tiny: {preset.description}" and profile.batch_size == 5
    assert profile.table().startswith(f"tiny: {preset.description}; batch 5, 1 step(s) on cpu")
    assert profile.to_json()["description"] == f"tiny: {preset.description}"


# -- the sampling interval ----------------------------------------------------------------------------


@pytest.mark.parametrize("milliseconds", ["nan", "inf", "0", "-1", "1e30"])
def test_a_sample_interval_the_sampler_cannot_wait_is_refused(script, capsys, milliseconds):
    """At 0 or nan the sampler's wait returns at once and its thread spins; at inf (or past
    threading.TIMEOUT_MAX) the wait overflows in that thread."""
    line = refused(script, capsys, "--preset", "tiny", "--sample-interval", milliseconds)
    assert line == (f"profile_memory.py: error: --sample-interval must be a positive number of milliseconds, at "
                    f"most 9.22e+12; got {float(milliseconds)}")


@pytest.mark.parametrize("seconds", [0, 0.0, -1, float("nan"), float("inf"), 1e30, True, "5"])
def test_profile_modes_refuses_a_sample_interval_the_sampler_cannot_wait(seconds):
    def build():
        raise AssertionError("a mode was built before the bad interval was refused")

    with pytest.raises(ValueError, match=rf"sample_interval_s must be a positive number of seconds, at most "
                                         rf"9.22e\+09; got {re.escape(repr(seconds))}"):
        profile_modes(build, [Mode.offload(2)], device="cpu", steps=1, sample_interval_s=seconds)


# -- the benchmarks' edge sizes -----------------------------------------------------------------------


def load_benchmark(name: str, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # for their json_output.py
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def benchmark_refused(capsys, main: Callable[[], object]) -> str:
    """``main`` must end in argparse's error (status 2, no traceback); its error line."""
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].count("error:") == 1
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(("args", "message"), [
    (["--steps", "0"], "--tensors, --rounds and --steps must be at least 1"),
    (["--tensors", "0"], "--tensors, --rounds and --steps must be at least 1"),
    (["--rounds", "0"], "--tensors, --rounds and --steps must be at least 1"),
    (["--params", "1", "--tensors", "2"], "--params must be at least --tensors (2): each tensor holds --params / "
                                          "--tensors values; got 1"),
    (["--params", "nan"], "--params must be at least --tensors (2)"),
])
def test_bench_hugepages_refuses_sizes_it_cannot_measure(capsys, monkeypatch, args, message):
    bench = load_benchmark("bench_hugepages", monkeypatch)
    monkeypatch.setattr(sys, "argv", ["bench_hugepages.py", "--params", "1e5", *args])
    monkeypatch.setattr(bench, "adamw", lambda *a: pytest.fail("measured before the bad size was refused"))
    assert message in benchmark_refused(capsys, bench.main)


@pytest.mark.parametrize(("args", "message"), [
    (["--hidden", "32"], "--hidden 32: the model has one attention head per 64 features; give 64 or more"),
    (["--hidden", "576"], "--hidden 576: its 9 attention heads (one per 64 features) are not a multiple of its 2 "
                          "key-value heads (one per 256); give a multiple of 256, or less than 512"),
    (["--steps", "0"], "--hidden, --layers, --vocab, --lora-r, --num-slices, --microbatches, --batch-size, "
                       "--seq-len, --steps must be at least 1"),
])
def test_bench_lora_refuses_sizes_that_make_no_model(capsys, monkeypatch, args, message):
    bench = load_benchmark("bench_lora", monkeypatch)
    monkeypatch.setattr(sys, "argv", ["bench_lora.py"])  # argparse's prog
    assert benchmark_refused(capsys, lambda: bench.parse_args(args)) == f"bench_lora.py: error: {message}"
    assert bench.attention_heads(512) == (8, 2) and bench.attention_heads(100) == (1, 1)
