"""``offload calibrate``'s answers to bad input: one line on stderr, exit status 2, and before
any measuring (a minute), so that a mistyped flag is not found out after the work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import offload.cli.calibrate
from offload.cli.main import main


def _not_measured(*args: object, **kwargs: object) -> None:
    raise AssertionError("calibrate() ran: the bad input was not refused before measuring")


def calibrate_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """``offload calibrate ARGS``'s error line, checked to be the only line, with exit status 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("offload calibrate: error: "), lines[0]
    return lines[0]


@pytest.fixture
def where(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working directory, with a file and a folder in it; no cache of the user's written, nothing measured."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(offload.cli.calibrate, "calibrate", _not_measured)
    (tmp_path / "a_file").write_text("")
    (tmp_path / "a_dir").mkdir()
    return tmp_path


BAD_INPUTS = {
    "an unknown device": (["--device", "tpu"], "argument --device: tpu is not a device: use cpu, cuda or cuda:N"),
    "a device calibrate does not measure": (["--device", "meta"], "argument --device: meta: the layers compute on cpu, cuda or cuda:N, not meta"),
    "a cuda device past the last": (["--device", "cuda:99"], "argument --device: cuda:99: "),
    "dir a file": (["--dir", "a_file"], "--dir a_file: not a directory"),
    # As a disk tier and `offload plan --disk-dir`: only the last level is made.
    "dir without its parent": (["--dir", "none/a/b"], "--dir none/a/b: its parent directory"),
    "out a directory": (["--out", "a_dir"], "--out: 'a_dir' is a directory"),
    "out under a file": (["--out", "a_file/rates.json"], "'a_file' is not a directory"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_a_bad_input_is_one_line_with_exit_status_2_before_measuring(case, where, capsys):
    args, fragment = BAD_INPUTS[case]
    assert fragment in calibrate_error(capsys, "--out", "rates.json", *args)
    assert not (where / "none").exists()


def test_cuda_without_a_cuda_device_is_refused_before_measuring(where, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "--device: cuda: this machine has no CUDA device; use --device cpu" in calibrate_error(capsys, "--device", "cuda", "--out", "rates.json")


class Measuring(Exception):
    """Raised where the measuring would start: the arguments were taken."""


def test_out_in_folders_not_made_yet_is_taken(where, monkeypatch):
    # The default's folder (~/.cache/offload) may not exist on a first run: save_rates makes it.
    def measuring(*args: object) -> None:
        raise Measuring

    monkeypatch.setattr(offload.cli.calibrate, "calibrate", measuring)
    with pytest.raises(Measuring):
        main(["calibrate", "--out", "new/folders/rates.json", "--device", "cpu"])


def test_out_whose_folders_cannot_be_made_is_refused_before_measuring(where, capsys):
    """Under /proc nothing can be made, though ``os.access`` says root may write there: the folders
    are made and probed before the minute of measuring, not found unmakeable when the rates are saved."""
    line = calibrate_error(capsys, "--out", "/proc/offload-none/rates.json", "--device", "cpu")
    assert line.startswith("offload calibrate: error: --out /proc/offload-none/rates.json: cannot make its directory "
                           "under /proc ("), line
    assert line.endswith("); give a path in a directory this process can write to"), line


def test_out_under_a_file_deeper_down_is_refused_before_measuring(where, capsys):
    line = calibrate_error(capsys, "--out", "a_file/new/rates.json", "--device", "cpu")
    assert "--out a_file/new/rates.json: cannot make its directory under" in line and "a_file" in line, line


def test_the_folders_made_for_out_are_probed(where, monkeypatch):
    def measuring(*args: object) -> None:
        raise Measuring

    monkeypatch.setattr(offload.cli.calibrate, "calibrate", measuring)
    with pytest.raises(Measuring):
        main(["calibrate", "--out", "made/here/rates.json", "--device", "cpu"])
    assert (where / "made" / "here").is_dir() and list((where / "made" / "here").iterdir()) == []
