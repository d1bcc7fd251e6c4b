"""Checkpoints after what went wrong around a save: a replacing save killed between its commit's
renames leaves the previous checkpoint loadable by its name and through ``latest``, before any
save puts it back; a save under a path that cannot hold a directory is refused before anything is
written, with one clear error on every rank, none left waiting; a save after an update that failed
part way is refused, so ``latest`` keeps naming the last good checkpoint, until that is loaded. See
Note: [Atomic save] in offload/checkpoint/commit.py, Note: [An update that failed part way] in
offload/optimizing/partial_failure.py."""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import contextlib
import errno

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from offload import (CheckpointError, HostUpdateError, OffloadModel, OffloadOptimizer, is_recomputing,
                     latest_checkpoint, load_checkpoint, save_checkpoint)
from offload.streams import disk

from .checkpoint_workers import counting_model
from .helpers import join_or_kill, killed_by_itself
from .test_optimizer import assert_same

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


@pytest.mark.parametrize("name", ["step-1 ", " step-1", "step-1\n", "\tstep-1"])
def test_a_save_under_a_name_that_starts_or_ends_with_whitespace_is_refused_before_anything_is_written(tmp_path, name):
    """``latest`` names it exactly; read back stripped, it named a checkpoint that is not there."""
    with pytest.raises(ValueError, match=rf"(?s)cannot save a checkpoint named {re.escape(repr(name))} .*starts or "
                                         r"ends with whitespace.*Choose a name without, such as 'step-1'\."):
        save_checkpoint(tmp_path / "ckpt" / name, *counting_model())
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("target", [".", "", "ckpt/.."])
def test_a_save_to_a_path_that_names_no_directory_of_its_own_is_refused_before_anything_is_written(
        tmp_path, monkeypatch, target):
    """Saved into, the working directory was written through, then its commit failed renaming '.'."""
    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=rf"cannot save a checkpoint at '{re.escape(str(Path(target)))}': it names no "
                                         r"directory of its own .*Save to a named subdirectory, such as "):
        save_checkpoint(target, *counting_model())
    assert os.listdir(tmp_path) == ["ckpt"] and os.listdir(tmp_path / "ckpt") == []


def test_latest_names_the_checkpoint_as_it_was_saved_less_a_line_ending(tmp_path):
    model, optimizer = counting_model()
    save_checkpoint(tmp_path / "step-1", model, optimizer, extra={"step": 1})
    # An earlier version saved names ending with a space: the checkpoint is there under that name.
    (tmp_path / "step-1").rename(tmp_path / "step-1 ")
    (tmp_path / "latest").write_text("step-1 ")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-1 "
    assert load_checkpoint(latest_checkpoint(tmp_path), model, optimizer) == {"step": 1}
    (tmp_path / "step-1 ").rename(tmp_path / "step-1")
    (tmp_path / "latest").write_text("step-1\n")  # as an editor, or echo, writes it
    assert latest_checkpoint(tmp_path) == tmp_path / "step-1"


@pytest.mark.parametrize("written", ["", "\n", ".", "..", "../step-1", b"\xff\xfe"],
                         ids=["empty", "a line ending", "dot", "dot-dot", "a path", "not text"])
def test_a_latest_that_names_no_checkpoint_is_damaged_and_says_which_are_there(tmp_path, written):
    """Empty, ``latest`` named the directory itself, whose load then named it again, in a loop."""
    model, optimizer = counting_model()
    save_checkpoint(tmp_path / "step-1", model, optimizer)
    save_checkpoint(tmp_path / "step-2", model, optimizer)
    latest = tmp_path / "latest"
    latest.write_bytes(written if isinstance(written, bytes) else written.encode())
    damaged = rf"^{re.escape(str(latest))} is damaged: it (is empty|holds '.*'|is not text), not the name of the last "
    with pytest.raises(CheckpointError, match=damaged + r"checkpoint saved in .*Pass load_checkpoint\(\) one of the "
                                                        r"checkpoints there by its path \(newest first: step-2, "
                                                        r"step-1\), or write the name"):
        latest_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=damaged):
        load_checkpoint(tmp_path, model, optimizer)  # the directory saved into, as if it were a checkpoint
    for name in ("step-1", "step-2"):
        shutil.rmtree(tmp_path / name)
    with pytest.raises(CheckpointError, match=damaged + r".* holds no checkpoint: restore one from a copy, or start "
                                                        r"afresh"):
        latest_checkpoint(tmp_path)


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


# -- an update that failed part way ------------------------------------------------------------------


class FlakyLayer(nn.Module):
    """A layer whose recompute (in backward) raises while :attr:`failing` is this layer."""

    failing: FlakyLayer | None = None

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if FlakyLayer.failing is self and is_recomputing():
            raise ValueError("a failing backward")
        return torch.tanh(self.linear(x))


@contextlib.contextmanager
def failing_backward(layer: FlakyLayer):
    FlakyLayer.failing = layer
    try:
        with pytest.raises(ValueError, match="a failing backward"):
            yield
    finally:
        FlakyLayer.failing = None


def flaky_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[FlakyLayer() for _ in range(6)])


def loss_at(model: nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 8, generator=generator)
    return (model(x) - y).pow(2).mean()


def by_slice(model: nn.Module) -> list[dict[str, Any]]:
    """One parameter group per slice of :func:`flaky_layers` in three slices (two layers each)."""
    return [{"params": [p for k in pair for p in getattr(model, str(k)).parameters()]}
            for pair in ((0, 1), (2, 3), (4, 5))]


def trained(optimizer_kwargs: dict[str, Any], steps: int, groups: bool = False):
    """The plain AdamW and OffloadOptimizer on twins of :func:`flaky_layers`, both trained ``steps`` steps."""
    plain = flaky_layers()
    plain_optimizer = torch.optim.AdamW(by_slice(plain) if groups else plain.parameters(), lr=1e-2, fused=True)
    model = OffloadModel(flaky_layers(), device="cpu", num_slices=3)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, by_slice(model) if groups else None, lr=1e-2, fused=True,
                                 **optimizer_kwargs)
    train_on([(plain, plain_optimizer), (model, optimizer)], range(steps))
    return plain, plain_optimizer, model, optimizer


def train_on(runs, steps) -> None:
    for step in steps:
        for model, optimizer in runs:
            loss_at(model, step).backward()
            optimizer.step()
            optimizer.zero_grad()


def assert_the_mix_is_refused(directory, model, optimizer, what: str) -> None:
    """``save_checkpoint`` (with ``keep_last``, which would delete the good checkpoint) and
    ``state_dict()`` refuse the mix, saying what it is; ``latest`` still names ``step-2``."""
    for _ in range(2):  # remembered, not said once
        with pytest.raises(RuntimeError, match=rf"mix two steps: {what}.*save_checkpoint\(\) would use that mix; "
                                               r"load the last checkpoint first"):
            save_checkpoint(directory / "step-3", model, optimizer, keep_last=1)
        with pytest.raises(RuntimeError, match=rf"mix two steps: {what}.*state_dict\(\) would use that mix"):
            optimizer.state_dict()
    assert latest_checkpoint(directory) == directory / "step-2"
    assert sorted(os.listdir(directory)) == ["latest", "step-2"]


def assert_the_last_checkpoint_trains_on(tmp_path, plain, plain_optimizer, model, optimizer) -> None:
    """Loading the last checkpoint (step 2's) ends the refusal, and training on from it is the
    plain optimizer's, bit for bit, and saves."""
    load_checkpoint(latest_checkpoint(tmp_path), model, optimizer)
    optimizer.zero_grad()
    train_on([(plain, plain_optimizer), (model, optimizer)], range(2, 5))
    assert_same(plain, plain_optimizer, model, optimizer)
    save_checkpoint(tmp_path / "step-5", model, optimizer)


def test_a_backward_that_failed_after_starting_updates_is_never_saved_and_loading_the_last_checkpoint_trains_on(
        tmp_path):
    """With ``update_in_backward``, a backward that raised in slice 0's recompute after slices 1
    and 2 were updated leaves the parameters mixing two steps: saves and ``state_dict()`` refuse
    them until a load, ``step()`` refuses, and loading the last checkpoint (``latest`` still names
    it) trains on as the plain optimizer, bit for bit."""
    plain, plain_optimizer, model, optimizer = trained({"update_in_backward": True}, 2)
    save_checkpoint(tmp_path / "step-2", model, optimizer)
    with failing_backward(getattr(model, "0")):  # slice 0's gradients land last
        loss_at(model, 2).backward()
    optimizer.zero_grad()
    what = r"a backward raised after update_in_backward had started the update of slices \[1, 2\]"
    assert_the_mix_is_refused(tmp_path, model, optimizer, what)
    with pytest.raises(RuntimeError, match=r"a backward since the last step\(\) raised after it had started"):
        optimizer.step()
    assert_the_mix_is_refused(tmp_path, model, optimizer, what)
    assert_the_last_checkpoint_trains_on(tmp_path, plain, plain_optimizer, model, optimizer)


def test_an_update_that_raised_part_way_is_never_saved_and_loading_the_last_checkpoint_trains_on(tmp_path):
    """An update that raised in slice 1 (a learning rate it cannot use) after slice 0 was updated
    leaves the parameters mixing two steps: its HostUpdateError says so once; a save after it (a
    retry, an emergency save) refuses, and so does ``state_dict()``, until a load, also after a
    step() that trains on; loading the last checkpoint trains on as the plain optimizer, bit for bit."""
    plain, plain_optimizer, model, optimizer = trained({}, 2, groups=True)
    save_checkpoint(tmp_path / "step-2", model, optimizer)
    loss_at(model, 2).backward()
    optimizer.param_groups[1]["lr"] = "not a number"
    optimizer.step()
    optimizer.param_groups[1]["lr"] = 1e-2
    optimizer.zero_grad()
    with pytest.raises(HostUpdateError, match="while updating slice 1"):
        save_checkpoint(tmp_path / "step-3", model, optimizer)
    what = r"an update failed part way: slice\(s\) 0 updated, slice\(s\) 1 raised in its update and may be partly "
    assert_the_mix_is_refused(tmp_path, model, optimizer, what)
    loss_at(model, 3).backward()
    optimizer.step()  # training on the mix: the caller's choice
    optimizer.zero_grad()
    assert_the_mix_is_refused(tmp_path, model, optimizer, what)
    assert_the_last_checkpoint_trains_on(tmp_path, plain, plain_optimizer, model, optimizer)


def test_an_update_that_failed_before_changing_anything_refuses_nothing(tmp_path, monkeypatch):
    """The first slice's state cannot be read: its update raises before it begins, and the worker
    skips the others. Every slice is as it was, so nothing is refused: the save goes through, and
    training on is the plain optimizer's that skipped that batch, bit for bit."""
    plain, plain_optimizer, model, optimizer = trained({"disk_tier": tmp_path / "tier"}, 2)
    optimizer.synchronize()
    real = os.preadv

    def preadv(fd, buffers, offset):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("slice-00000.state"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset)

    monkeypatch.setattr(disk.os, "preadv", preadv)
    loss_at(model, 2).backward()
    optimizer.step()
    with pytest.raises(HostUpdateError, match="slice 0 was left as it was.*the slices after it were left as they were"):
        optimizer.synchronize()
    monkeypatch.setattr(disk.os, "preadv", real)
    optimizer.zero_grad()
    plain_optimizer.zero_grad()
    save_checkpoint(tmp_path / "ckpt" / "step-3", model, optimizer)
    assert latest_checkpoint(tmp_path / "ckpt") == tmp_path / "ckpt" / "step-3"
    optimizer.state_dict()
    train_on([(plain, plain_optimizer), (model, optimizer)], range(3, 5))
    assert_same(plain, plain_optimizer, model, optimizer)


# -- an interrupt while loading ----------------------------------------------------------------------


def interrupting_the_read(monkeypatch, at: int, raised: type[BaseException] = KeyboardInterrupt) -> None:
    """``raised`` from inside DCP's read of its ``at``-th tensor item, once: as a Ctrl-C (or
    SIGTERM, under ``offload-finetune``) landing in the middle of a load does."""
    from torch.distributed.checkpoint import filesystem

    real = filesystem.narrow_tensor_by_index
    calls = []

    def narrow_tensor_by_index(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(None)
        if len(calls) == at:
            raise raised
        return real(*args, **kwargs)

    monkeypatch.setattr(filesystem, "narrow_tensor_by_index", narrow_tensor_by_index)


@pytest.mark.parametrize("raised", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("tier", [False, True], ids=["in-ram", "disk-tier"])
def test_an_interrupt_while_loading_is_raised_as_itself_and_a_load_after_it_trains_on(tmp_path, monkeypatch, tier,
                                                                                      raised):
    """DCP catches whatever its read raises, a Ctrl-C too, and raises its CheckpointException for
    it, which an ``except KeyboardInterrupt`` misses. The interrupt is raised as itself, with the
    note saying what is partly loaded, as a save's is; loading again trains on as the plain
    optimizer, bit for bit."""
    plain, plain_optimizer, model, optimizer = trained({"disk_tier": tmp_path / "tier"} if tier else {}, 2)
    save_checkpoint(tmp_path / "step-2", model, optimizer)
    train_on([(model, optimizer)], [2])  # away from the checkpoint: the second load has all to restore
    # 12 parameters, then their steps (in RAM either way), then the moments, 8 a slice: slice 0's
    # are loaded (into the tier's file), slice 1's under way.
    interrupting_the_read(monkeypatch, at=35, raised=raised)
    with pytest.raises(raised) as interrupted:
        load_checkpoint(tmp_path / "step-2", model, optimizer)
    assert type(interrupted.value) is raised
    notes = getattr(interrupted.value, "__notes__", [])
    if tier:
        (note,) = notes
        assert re.fullmatch(r"offload: the optimizer's state is partly loaded: .*slice\(s\) 0\b.*It refuses to step or "
                            r"be saved until a load succeeds: load a checkpoint again\.", note, re.DOTALL), note
        with pytest.raises(RuntimeError, match="partly loaded"):
            optimizer.state_dict()
    else:
        assert notes == []
    assert_the_last_checkpoint_trains_on(tmp_path, plain, plain_optimizer, model, optimizer)


def test_an_interrupt_while_reading_the_4bit_formats_is_raised_as_itself(tmp_path, monkeypatch):
    """The 4-bit weights' packed states are read by a load of their own, before anything is
    loaded (Note: [Packed quantisation state]): an interrupt there is raised as itself too."""
    import warnings

    with warnings.catch_warnings():  # its optional CPU kernels ("pip install kernels") are not needed
        warnings.simplefilter("ignore")
        bnb = pytest.importorskip("bitsandbytes")

    def four_bit(seed: int) -> nn.Sequential:
        torch.manual_seed(seed)
        layer = bnb.nn.Linear4bit(64, 64, compute_dtype=torch.float32, compress_statistics=True, quant_type="nf4")
        layer.weight = bnb.nn.Params4bit(torch.randn(64, 64), requires_grad=False, compress_statistics=True,
                                         quant_type="nf4", module=layer)
        return nn.Sequential(layer.to("cpu"), nn.Linear(64, 64))

    save_checkpoint(tmp_path / "s", four_bit(1))
    model = four_bit(2)
    before = {name: value.clone() for name, value in model.state_dict().items() if isinstance(value, torch.Tensor)}
    interrupting_the_read(monkeypatch, at=1)
    with pytest.raises(KeyboardInterrupt) as interrupted:
        load_checkpoint(tmp_path / "s", model)
    assert type(interrupted.value) is KeyboardInterrupt
    after = model.state_dict()
    assert all(torch.equal(after[name], value) for name, value in before.items())  # nothing was loaded
    load_checkpoint(tmp_path / "s", model)
    saved = four_bit(1)
    x = torch.randn(4, 64)
    torch.testing.assert_close(model(x), saved(x), rtol=0, atol=0)


def test_offload_finetune_terminated_while_resuming_ends_with_its_one_line(tmp_path, capsys, monkeypatch):
    """SIGTERM (``Terminated``, a KeyboardInterrupt) during ``--resume``'s load: the run's one stop
    line and exit status 143, not DCP's CheckpointException and a traceback."""
    pytest.importorskip("transformers")
    pytest.importorskip("datasets")
    from offload.cli import finetune as cli

    from .helpers import cli_result

    flags = ["--device", "cpu", "--no-progress", "--out", str(tmp_path), "--save-every", "1", "--batch-size", "2",
             "--seq-len", "16", "--num-slices", "3"]
    code, _, err = cli_result(cli.main, [*flags, "--steps", "1"], capsys)
    assert code == 0, err[-3000:]
    interrupting_the_read(monkeypatch, at=1, raised=cli.Terminated)
    code, _, err = cli_result(cli.main, [*flags, "--steps", "2", "--resume", "latest"], capsys)
    assert code == 143, err[-3000:]
    assert "Traceback" not in err and "CheckpointException" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("terminated "), last
