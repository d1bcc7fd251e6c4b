"""Tier directories that killed processes left: the next tier made in the same place names them
(a warning; the full-disk error), and never one a running process, another machine or ``keep=True``
still owns."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from offload import DiskTier, DiskTierError, OffloadModel, OffloadOptimizer
from offload.tiers import leftovers

from .disk_full import report_free
from .test_optimizer import network

LEFT = "left by processes that no longer run"


def make_tier(root, **tier):
    """An optimizer with its state in ``root``, and the warnings its construction gave."""
    model = OffloadModel(network(), device="cpu", num_slices=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, disk_tier=DiskTier(root, **tier))
    return optimizer, [w for w in caught if "DiskTier" in str(w.message)]


def killed_training(root) -> str:
    """Run a training that keeps its state in ``root``, SIGKILL it after a step; its tier directory."""
    code = textwrap.dedent(f"""
        import time, torch
        from offload import DiskTier, OffloadModel, OffloadOptimizer
        from tests.test_optimizer import network
        model = OffloadModel(network(), device="cpu", num_slices=3)
        optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, disk_tier=DiskTier({str(root)!r}))
        model(torch.ones(2, 6)).sum().backward()
        optimizer.step()
        optimizer.synchronize()
        print(optimizer._disk.tier.directory, flush=True)
        time.sleep(120)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        directory = child.stdout.readline().strip()
        assert directory, "the child printed no directory"
        alive, seen = make_tier(root)
        assert seen == [], "a running training's directory was named as left behind"
        alive.close()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        child.stdout.close()
    assert os.path.isdir(directory)  # a killed process removes nothing
    return directory


def test_a_killed_trainings_directory_is_named_by_the_next_tier(tmp_path):
    directory = killed_training(tmp_path)
    optimizer, seen = make_tier(tmp_path)
    assert len(seen) == 1 and seen[0].filename == __file__, seen  # at the user's OffloadOptimizer(...)
    message = str(seen[0].message)
    assert f"1 disk tier directory in {tmp_path} (" in message and LEFT in message and directory in message
    assert str(optimizer._disk.tier.directory) not in message  # not its own
    assert "Delete it if no training uses it" in message
    optimizer.close()
    assert os.path.isdir(directory)  # named, never deleted


def test_the_full_disk_error_names_them(tmp_path, monkeypatch):
    directory = killed_training(tmp_path)
    report_free(monkeypatch, 4096)
    model = OffloadModel(network(), device="cpu", num_slices=3)
    with pytest.raises(DiskTierError, match="Free space there, or point DiskTier at a disk with room. 1 disk tier "
                                            rf"directory in {tmp_path} \(\d.* KiB\) was {LEFT}.*{directory}"):
        OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, disk_tier=tmp_path)


def write_owner(root, name, **changes):
    directory = root / f"offload-state-{name}"
    directory.mkdir()
    (directory / "slice-00000.state").write_bytes(b"x" * 8192)
    owner = {**leftovers._this_process(), **changes}
    (directory / leftovers.OWNER).write_text(json.dumps(owner))
    return directory


def test_only_this_machines_processes_that_ended_are_named(tmp_path):
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = write_owner(tmp_path, "gone", pid=int(ended.stdout), started=None)
    reused = write_owner(tmp_path, "reused", started=-1)  # this pid, but a process that started at another time
    restarted = write_owner(tmp_path, "restarted", boot="another boot")
    write_owner(tmp_path, "running")  # this process
    write_owner(tmp_path, "elsewhere", host=socket.gethostname() + "-other", pid=int(ended.stdout))
    write_owner(tmp_path, "container", pids="pid:[0]", pid=int(ended.stdout))  # its pids are not ours to see
    kept = write_owner(tmp_path, "kept", pid=int(ended.stdout))
    (kept / "manifest.json").write_text("{}")  # keep=True closed it: kept on purpose
    unknown = tmp_path / "offload-state-unknown"
    unknown.mkdir()  # no owner's record
    named = dict(leftovers.left_behind(tmp_path))
    expected = {gone, reused} | ({restarted} if leftovers._boot_id() is not None else set())
    assert set(named) == expected, sorted(map(str, named))
    assert all(nbytes >= 8192 for nbytes in named.values())
    optimizer, seen = make_tier(tmp_path)
    assert len(seen) == 1 and f"{len(expected)} disk tier directories" in str(seen[0].message)
    assert "were left" in str(seen[0].message) and "Delete them" in str(seen[0].message)
    optimizer.close()


def test_a_tier_kept_on_purpose_or_closed_is_not_named(tmp_path):
    optimizer, seen = make_tier(tmp_path, keep=True)
    optimizer.close()  # keeps its files, with a manifest
    closed, _ = make_tier(tmp_path)
    closed.close()  # removes its directory
    after, seen = make_tier(tmp_path)
    assert seen == [] and leftovers.left_behind(tmp_path) == []
    after.close()
