"""Bad inputs to the memory profiler are refused before anything runs, each in one clear line.

``scripts/profile_memory.py`` answers a bad argument with a one-line error and exit status 2
(docs/profiling.md); an output path it cannot write, a device it cannot measure on and a
``--model`` factory that raises are bad arguments too, found before the first mode runs, so a
long run never ends in a traceback that loses its measurements. The API (:func:`profile_modes`,
:class:`Mode`, :meth:`Profile.write_csv`, :meth:`Profile.plot`) raises ``ValueError`` or an
``OSError`` that says what is wrong, at the call.
"""

from __future__ import annotations

import argparse
import os
import textwrap
from pathlib import Path

import pytest
import torch

from offload.cli.device_argument import device_argument
from offload.planning.presets import build_preset
from offload.profiling import Mode, Profile, profile_modes
from offload.profiling.outputs import check_output_path

from .test_profiling import assert_one_line_error, load_script, run_script


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
