"""Paths as users give them: symbolic links beside the checkpoints, several processes saving into
one directory, ``~``, and a path that names something other than what a function loads."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from offload import CheckpointError, DiskTier, latest_checkpoint, load_checkpoint, save_checkpoint
from offload.checkpoint import checkpoint_files
from offload.checkpoint.commit import clean_up, partial_directory, pending_latest
from offload.cli.finetune_resume import resume_failure
from offload.cli.finetune_args import build_parser, check_paths
from offload.streams.disk import make_directory

from .test_checkpoint import trained

REPOSITORY = Path(__file__).resolve().parent.parent


def quiet_save(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a problem tidying fails the test
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return save_checkpoint(*args, **kwargs)


# -- symbolic links beside the checkpoints ---------------------------------------------------------


def test_keep_last_neither_counts_nor_moves_a_link_to_a_checkpoint(tmp_path):
    model, optimizer = trained()
    directory, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    quiet_save(elsewhere / "final", model, optimizer)  # the oldest checkpoint, linked among the others
    directory.mkdir()
    (directory / "final").symlink_to(elsewhere / "final")
    for step in range(1, 5):
        quiet_save(directory / f"step-{step}", model, optimizer, keep_last=2)
    assert sorted(os.listdir(directory)) == ["final", "latest", "step-3", "step-4"]
    assert (directory / "final").is_symlink() and (elsewhere / "final" / "offload.json").is_file()
    assert latest_checkpoint(directory) == directory / "step-4"


def test_a_link_an_earlier_version_moved_aside_goes_back_and_saves_go_on(tmp_path):
    model, optimizer = trained()
    quiet_save(tmp_path / "elsewhere" / "final", model, optimizer)
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / ".final.removed").symlink_to(tmp_path / "elsewhere" / "final")
    quiet_save(directory / "step-1", model, optimizer, keep_last=1)
    assert sorted(os.listdir(directory)) == ["final", "latest", "step-1"]
    assert (directory / "final").is_symlink() and (tmp_path / "elsewhere" / "final" / "offload.json").is_file()


# -- several processes saving into one directory ---------------------------------------------------


def test_a_save_leaves_another_live_saves_partial_directory_and_pending_latest(tmp_path):
    """A live save holds its partial directory's lock in another process; another's clean-up
    leaves its files alone, and removes them once that process is gone."""
    theirs = tmp_path / "theirs"
    partial, pending = partial_directory(theirs), pending_latest(theirs)
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"x")
    pending.write_text("theirs")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys
        descriptor = os.open({str(partial)!r}, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        print("locked", flush=True)
        sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        quiet_save(tmp_path / "ours", *trained())
        assert partial.is_dir() and (partial / "__0_0.distcp").is_file() and pending.is_file()
        assert latest_checkpoint(tmp_path) == tmp_path / "ours"
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    clean_up(tmp_path)  # its process is gone: what it left is a leftover
    assert sorted(os.listdir(tmp_path)) == ["latest", "ours"]


def test_keep_last_leaves_the_checkpoint_latest_names_though_older(tmp_path):
    """Another run's save that finished later may have named an older checkpoint: a resume from
    ``latest`` must still find it."""
    from offload.checkpoint.commit import _beyond

    model, optimizer = trained()
    for name in ("a", "b", "c"):
        quiet_save(tmp_path / name, model, optimizer)
    (tmp_path / "latest").write_text("a")
    assert _beyond(tmp_path / "c", 1) == [tmp_path / "b"]


def test_the_pending_latest_is_named_after_its_checkpoint(tmp_path):
    assert pending_latest(tmp_path / "a") != pending_latest(tmp_path / "b")


def test_a_checksum_that_cannot_be_read_back_is_raised_by_the_save_not_printed_by_its_thread(tmp_path, monkeypatch):
    printed = []
    monkeypatch.setattr("threading.excepthook", printed.append)
    stream = checkpoint_files._SummingStream(open(tmp_path / "data.distcp", "wb"), tmp_path / "gone.distcp")
    stream.fileno()  # starts the summing thread, which finds no file
    with pytest.raises(FileNotFoundError):
        stream.checksum()
    stream.raw.close()
    assert printed == []


# -- ~ -------------------------------------------------------------------------------------------


def test_latest_checkpoint_and_load_checkpoint_expand_the_home_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    model, optimizer = trained()
    quiet_save(tmp_path / "ck" / "step-1", model, optimizer, extra={"step": 1})
    assert latest_checkpoint("~/ck") == tmp_path / "ck" / "step-1"
    assert load_checkpoint("~/ck/step-1", model, optimizer) == {"step": 1}


def test_save_checkpoint_and_a_disk_tier_expand_the_home_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    model, optimizer = trained()
    quiet_save("~/ck/step-1", model, optimizer)
    assert latest_checkpoint(tmp_path / "home" / "ck") == tmp_path / "home" / "ck" / "step-1"
    assert DiskTier("~/tier").path == f"{tmp_path}/home/tier"
    assert DiskTier(Path("~/tier")).path == tmp_path / "home" / "tier"
    assert not (tmp_path / "~").exists()


def test_offload_plan_and_calibrate_expand_the_home_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    from offload.cli import calibrate, plan

    (tmp_path / "rates.json").write_text("{}")  # checked for, not read, by the parser
    args = plan.parse_args(["--preset", "tiny", "--disk-dir=~", "--rates=~/rates.json"])
    assert (args.disk_dir, args.rates) == (str(tmp_path), tmp_path / "rates.json")
    seen = {}

    def save_rates(rates, out):
        seen["out"] = out
        raise StopIteration  # nothing measured to print

    monkeypatch.setattr(calibrate, "calibrate", lambda directory, device: seen.setdefault("dir", directory))
    monkeypatch.setattr(calibrate, "save_rates", save_rates)
    with pytest.raises(StopIteration):
        calibrate.main(["--dir=~/disk", "--out=~/rates.json"])
    assert seen == {"dir": tmp_path / "disk", "out": tmp_path / "rates.json"}


def test_a_save_whose_path_is_a_link_is_refused_as_a_link(tmp_path):
    model, optimizer = trained()
    quiet_save(tmp_path / "step-1", model, optimizer)
    (tmp_path / "best").symlink_to(tmp_path / "step-1")
    with pytest.raises(FileExistsError, match=r"best: it is a symbolic link \(to .*step-1\).*directory it points to"):
        quiet_save(tmp_path / "best", model, optimizer)
    assert (tmp_path / "best").is_symlink()


def test_a_disk_directory_starting_with_a_tilde_is_refused_not_made_here(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=rf"DiskTier path ~/tier starts with '~', .*pass {tmp_path}/home/tier"):
        make_directory(Path("~/tier"), "DiskTier path")
    assert not (tmp_path / "~").exists()


def test_offload_finetune_expands_the_home_directory_in_its_path_options(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    args = build_parser().parse_args(["--out=~/tuned", "--disk-tier=~/tier", "--eval-file=~/eval.txt"])
    assert (args.out, args.disk_tier, args.eval_file) == (tmp_path / "tuned", tmp_path / "tier",
                                                          tmp_path / "eval.txt")


# -- a path that names something else --------------------------------------------------------------


def test_load_checkpoint_of_the_directory_of_checkpoints_names_the_latest(tmp_path):
    model, optimizer = trained()
    quiet_save(tmp_path / "step-1", model, optimizer)
    with pytest.raises(CheckpointError, match=rf"{tmp_path} is the directory checkpoints were saved into, not a "
                                              rf"checkpoint: its latest names {tmp_path}/step-1.*latest_checkpoint"):
        load_checkpoint(tmp_path, model, optimizer)


def test_offload_finetune_resume_of_the_checkpoints_directory_names_the_checkpoint(tmp_path, capsys):
    checkpoints = tmp_path / "run" / "checkpoints"
    quiet_save(checkpoints / "step-2", *trained())
    parser = build_parser()
    args = parser.parse_args(["--out", str(tmp_path / "other"), "--resume", str(checkpoints)])
    with pytest.raises(SystemExit):
        check_paths(parser, args)
    assert (f"--resume {checkpoints} is the directory checkpoints were saved into, not a checkpoint: its latest names "
            f"{checkpoints}/step-2; pass --resume {checkpoints}/step-2, or --resume latest with --out "
            f"{tmp_path}/run") in capsys.readouterr().err
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(checkpoints, *trained())
    line = resume_failure(argparse.Namespace(resume=checkpoints, out=tmp_path / "other"), refused.value)
    assert f"pass --resume {checkpoints}/step-2" in line and str(tmp_path / "other") not in line


@pytest.mark.parametrize("made", ["missing", "checkpoint"])
def test_load_causal_lm_refuses_what_is_not_a_model_folder_in_one_line(tmp_path, made):
    from offload.integrations.transformers import load_causal_lm
    path = tmp_path / "model"
    if made == "checkpoint":
        quiet_save(path, *trained())
        with pytest.raises(ValueError, match=r"is a checkpoint of save_checkpoint\(\), not a model folder.*"
                                             r"load_checkpoint\(path, model, optimizer\)"):
            load_causal_lm(path, "cpu")
    else:
        with pytest.raises(FileNotFoundError, match=rf"load_causal_lm: {path} does not exist; pass a local model"):
            load_causal_lm(path, "cpu")


def test_the_load_checkpoint_script_checks_its_paths_before_loading(tmp_path):
    script = REPOSITORY / "scripts" / "load_checkpoint.py"
    quiet_save(tmp_path / "ck", *trained())
    cases = {(str(tmp_path / "nope"),): "no such directory",
             (str(tmp_path / "ck"),): "is a checkpoint of save_checkpoint()",
             (str(tmp_path), "--json", str(tmp_path / "nodir" / "x.json")): "its directory does not exist"}
    for argv, expected in cases.items():
        done = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and expected in done.stderr and "Traceback" not in done.stderr, done.stderr
