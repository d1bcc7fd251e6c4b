"""Checkpoints after what went wrong around a save: a replacing save killed between its commit's
renames leaves the previous checkpoint loadable by its name and through ``latest``, before any
save puts it back; a save under a path that cannot hold a directory is refused before anything is
written, with one clear error on every rank, none left waiting. See Note: [Atomic save] in
offload/checkpoint/commit.py."""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import time
import uuid
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from offload import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint

from .checkpoint_workers import counting_model
from .helpers import join_or_kill, killed_by_itself

#: Seconds a test's processes get before they are killed and the test fails.
DEADLINE_S = 120
#: The process group's timeout: a rank left waiting fails with it, well inside the deadline.
GROUP_TIMEOUT_S = 30

# Processes fork from a server that imported these once (see test_checkpoint.py).
mp.set_forkserver_preload(["torch", "torch._dynamo", "tests.checkpoint_workers"])


def random_fill(model, optimizer, seed: int) -> dict[str, torch.Tensor]:
    """Every parameter and momentum of a :func:`counting_model` drawn from ``seed``; returns them."""
    generator = torch.Generator().manual_seed(seed)
    values = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
            optimizer.state[p]["momentum_buffer"].copy_(torch.randn(p.shape, generator=generator))
            values[name] = p.detach().clone()
            values[f"{name}/momentum_buffer"] = optimizer.state[p]["momentum_buffer"].clone()
    return values


def killed_replacing(directory: str) -> None:
    """Save ``directory/ckpt/last``, keep what it holds in ``directory/saved.pt``, then save ``last``
    again with other values, killed (SIGKILL: nothing runs after it) between the commit's two
    renames: the old checkpoint moved to ``.last.replaced``, the new one not yet in its place."""
    model, optimizer = counting_model()
    path = os.path.join(directory, "ckpt", "last")
    torch.save(random_fill(model, optimizer, seed=1), os.path.join(directory, "saved.pt"))
    save_checkpoint(path, model, optimizer, extra={"step": 1})
    real = os.replace

    def replace(source: Any, target: Any) -> None:
        real(source, target)
        if str(target).endswith(".last.replaced"):
            os.kill(os.getpid(), signal.SIGKILL)

    random_fill(model, optimizer, seed=2)
    os.replace = replace
    save_checkpoint(path, model, optimizer, extra={"step": 2})


def assert_loads_as_saved(path, saved: dict[str, torch.Tensor]) -> None:
    model, optimizer = counting_model()  # other values than those saved
    assert load_checkpoint(path, model, optimizer) == {"step": 1}
    for name, p in model.named_parameters():
        assert torch.equal(p, saved[name]), name  # bit for bit
        assert torch.equal(optimizer.state[p]["momentum_buffer"], saved[f"{name}/momentum_buffer"]), name


def test_a_replacing_save_killed_between_its_renames_leaves_the_previous_checkpoint_loadable(tmp_path):
    """A run that always saves to ``last`` is killed between the renames of a save: a fresh process
    loads before it saves, so the previous checkpoint must load from where it waits, by its name
    and through ``latest``, and the load renames nothing; the next save puts things right."""
    assert killed_by_itself(killed_replacing, (str(tmp_path),), DEADLINE_S)
    directory = tmp_path / "ckpt"
    left = sorted(os.listdir(directory))
    assert left == [".last.partial", ".last.replaced", ".latest.last.pending", "latest"]
    saved = torch.load(tmp_path / "saved.pt")
    assert latest_checkpoint(directory) == directory / "last"
    assert_loads_as_saved(directory / "last", saved)
    assert_loads_as_saved(latest_checkpoint(directory), saved)
    assert sorted(os.listdir(directory)) == left  # loading moved nothing
    # A checkpoint that is not there still says so, and a partial save of it, when there is one.
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*other: not a directory$"):
        load_checkpoint(directory / "other", *counting_model())
    (directory / ".other.partial").mkdir()
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*other: not a directory \(a save of it was "
                                              r"interrupted: .*\.other\.partial is incomplete\)"):
        load_checkpoint(directory / "other", *counting_model())
    # The next save puts the old checkpoint back, then replaces it, and tidies the rest.
    model, optimizer = counting_model()
    replacement = random_fill(model, optimizer, seed=3)
    save_checkpoint(directory / "last", model, optimizer, extra={"step": 3})
    assert sorted(os.listdir(directory)) == ["last", "latest"]
    loaded, loaded_optimizer = counting_model()
    assert load_checkpoint(latest_checkpoint(directory), loaded, loaded_optimizer) == {"step": 3}
    for name, p in loaded.named_parameters():
        assert torch.equal(p, replacement[name]), name


# -- paths that cannot hold a checkpoint -------------------------------------------------------------


@pytest.mark.parametrize("under", ["runs/step-1", "runs/more/step-1"], ids=["parent", "grandparent"])
def test_a_save_under_a_file_is_refused_before_anything_is_written(tmp_path, under):
    (tmp_path / "runs").write_text("not a directory")
    model, optimizer = counting_model()
    with pytest.raises(NotADirectoryError, match=rf"cannot save a checkpoint at .*{under}: .*runs is a file, not a "
                                                 r"directory\. Choose another path, or move .*runs away first\."):
        save_checkpoint(tmp_path / under, model, optimizer)
    assert sorted(os.listdir(tmp_path)) == ["runs"]
    assert (tmp_path / "runs").read_text() == "not a directory"


@pytest.mark.parametrize("name", ["latest", ".step-1", ".step-1.replaced"])
def test_a_save_under_a_name_the_commit_uses_is_refused_before_anything_is_written(tmp_path, name):
    with pytest.raises(ValueError, match=rf"cannot save a checkpoint named '{name}' .*Choose another name"):
        save_checkpoint(tmp_path / "ckpt" / name, *counting_model())
    assert os.listdir(tmp_path) == []


def test_latest_checkpoint_says_what_is_wrong_with_a_directory_save_checkpoint_did_not_write(tmp_path):
    (tmp_path / "runs").write_text("not a directory")
    for directory in (tmp_path / "runs", tmp_path / "runs" / "ckpt"):
        with pytest.raises(CheckpointError, match=r"no checkpoints in .*runs.*: it is not a directory \(it, or a "
                                                  r"directory above it, is a file\)"):
            latest_checkpoint(directory)
    (tmp_path / "ckpt" / "latest").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"ckpt/latest is a directory, not the file in which save_checkpoint\(\) "
                                              r"names the last checkpoint .*Rename it"):
        latest_checkpoint(tmp_path / "ckpt")
    assert latest_checkpoint(tmp_path / "nothing") is None


# -- every rank gets the error ----------------------------------------------------------------------


def save_under_a_file(rank: int, world_size: int, directory: str, store: str, found_by: str) -> None:
    """Join a gloo group of ``world_size`` through a file store, meet a save of a checkpoint whose
    parent is a file, and write what this rank raised to ``directory/outcome.<rank>.json``.

    ``found_by``: ``"check"``, every rank's check before the save; ``"prepare"``, rank 0's first
    step (the file appeared after the checks, or only rank 0 sees it), whose failure the others
    learn from the gather after it; ``"describing"``, rank 0's work and the description of its
    failure both fail (``ranks._on_rank_0`` alone)."""
    from offload.checkpoint import ranks, saver

    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(directory, store), world_size), rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    if found_by == "prepare":
        saver._check_target = lambda path: None
    outcome: dict[str, Any] = {"raised": None, "message": None}
    start = time.monotonic()
    try:
        if found_by == "describing":
            def work() -> None:
                raise OSError("the disk went away")

            def failure(error: BaseException) -> str:
                raise RuntimeError("and so did the directory")

            ranks._on_rank_0(dist.group.WORLD, rank, work, failure)
        else:
            save_checkpoint(os.path.join(directory, "runs", "step-1"), *counting_model())
    except BaseException as error:  # a gloo timeout is a RuntimeError: recorded, not hidden
        outcome = {"raised": type(error).__name__, "message": str(error), "seconds": time.monotonic() - start}
    with open(os.path.join(directory, f"outcome.{rank}.json"), "w") as file:
        json.dump(outcome, file)
    # Rank 0 carries on, as a caller that catches the error would, until rank 1 is done: a rank 1
    # left waiting then times out, instead of learning of the failure from rank 0's exit.
    while rank == 0 and not os.path.exists(os.path.join(directory, "outcome.1.json")):
        if time.monotonic() - start > 2 * GROUP_TIMEOUT_S:
            break
        time.sleep(0.05)
    dist.destroy_process_group()


@pytest.mark.parametrize("found_by, raised, message", [
    ("check", "NotADirectoryError", r"cannot save a checkpoint at .*runs/step-1: .*runs is a file"),
    ("prepare", "CheckpointError", r"could not save checkpoint .*runs/step-1: FileExistsError: .*runs'\. Nothing "
                                   r"of it was kept and any earlier checkpoint is as it was\."),
    ("describing", "CheckpointError", r"^OSError: the disk went away \(describing it failed too: RuntimeError: and "
                                      r"so did the directory\)$"),
])
def test_every_rank_raises_a_save_under_a_file_and_none_waits(tmp_path, found_by, raised, message):
    (tmp_path / "runs").write_text("not a directory")
    ranks = mp.start_processes(save_under_a_file, args=(2, str(tmp_path), f"store-{uuid.uuid4().hex}", found_by),
                               nprocs=2, join=False, start_method="forkserver")
    join_or_kill(ranks, DEADLINE_S, "the ranks")
    for rank in range(2):
        outcome = json.loads((tmp_path / f"outcome.{rank}.json").read_text())
        assert outcome["raised"] == raised, (rank, outcome)
        assert outcome["seconds"] < GROUP_TIMEOUT_S / 2, (rank, outcome)  # told, not timed out
        assert re.search(message, outcome["message"]), (rank, outcome)
    assert sorted(e.name for e in tmp_path.iterdir() if not e.name.startswith("store-")) == [
        "outcome.0.json", "outcome.1.json", "runs"]
