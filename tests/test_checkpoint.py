"""Checkpoints: exact resume in a fresh process on one rank and two, resharding 2 -> 1 and 1 -> 2,
atomic saves under SIGKILL, clear errors before anything is loaded, and interchange with the plain
model and optimizer. See Note: [Checkpoint layout] in offload/checkpoint/contents.py and Note: [Atomic save] in
offload/checkpoint/commit.py."""

from __future__ import annotations

import copy
import itertools
import json
import os
import random
import shutil
import time
import uuid
import weakref

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from offload import (CheckpointError, OffloadModel, OffloadOptimizer, latest_checkpoint, load_checkpoint,
                     save_checkpoint)

from .checkpoint_workers import counting_model
from .helpers import CUDA, join_or_kill, killed_by_itself
from .stream_scenarios import tied_mlp

#: Seconds a job's processes get before they are killed and the test fails.
DEADLINE_S = 120

# Processes fork from a server that imported these once (see test_distributed.py).
mp.set_forkserver_preload(["torch", "torch._dynamo", "tests.checkpoint_workers"])


def spawn(job: str, tmp_path, world: int, tag: str | None = None, **kwargs) -> list:
    """Run ``job`` in ``world`` fresh processes; return what each saved under ``tag``."""
    from . import checkpoint_workers

    if tag is not None:
        kwargs["tag"] = tag
    store = f"store-{uuid.uuid4().hex}"
    ranks = mp.start_processes(checkpoint_workers.run, args=(world, str(tmp_path), job, kwargs, store),
                               nprocs=world, join=False, start_method="forkserver")
    join_or_kill(ranks, DEADLINE_S, f"job {job!r}")
    if tag is None:
        return []
    return [torch.load(tmp_path / f"{tag}.{rank}.pt", weights_only=False) for rank in range(world)]


def assert_same_run(resumed: dict, whole: dict, k: int, microsteps: int = 2) -> None:
    assert resumed["losses"] == whole["losses"][k * microsteps:]  # every loss, bit for bit
    assert resumed["params"].keys() == whole["params"].keys()
    for name in whole["params"]:
        assert torch.equal(resumed["params"][name], whole["params"][name]), name
    want, got = whole["optimizer"], resumed["optimizer"]
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys() and want["state"]
    for index, state in want["state"].items():
        for key, value in state.items():
            assert torch.equal(got["state"][index][key], value), (index, key)
    assert resumed["scale"] == whole["scale"] and resumed["lr"] == whole["lr"]
    assert torch.equal(resumed["rng"], whole["rng"])
    if whole["device_rng"] is not None:
        assert torch.equal(resumed["device_rng"], whole["device_rng"])


@pytest.mark.parametrize("world, dtype, device, disk_tier", [
    (1, None, "cpu", False), (1, "bfloat16", "cpu", False), (2, "bfloat16", "cpu", False),
    (2, "bfloat16", "cpu", True), pytest.param(1, "bfloat16", "cuda", False, marks=CUDA),
], ids=["1rank-float32", "1rank-bf16", "2ranks-bf16", "2ranks-bf16-disk-tier", "1rank-bf16-cuda"])
def test_resume_in_a_fresh_process_is_bit_identical_to_the_uninterrupted_run(tmp_path, world, dtype, device,
                                                                            disk_tier):
    # With a disk tier, each rank saves and loads the moments of the parameters it updates a slice
    # at a time (Notes: [Slice-by-slice save], [Slice-by-slice load]).
    k = 3
    run = {"compute_dtype": dtype, "device": device, "disk_tier": disk_tier}
    whole = spawn("train", tmp_path, world, tag="whole", steps=2 * k, **run)
    first = spawn("train", tmp_path, world, tag="first", steps=k, save_at=k, **run)
    resumed = spawn("train", tmp_path, world, tag="resumed", steps=2 * k, resume=True, **run)
    for rank in range(world):
        assert first[rank]["losses"] == whole[rank]["losses"][:k * 2]
        assert_same_run(resumed[rank], whole[rank], k)
    # The run is not trivially repeatable: the loss scale moved, dropout drew, the rate decayed.
    assert whole[0]["scale"] != 2.0**10 and whole[0]["lr"] != [1e-2]
    saved = sorted(os.listdir(tmp_path / "ckpt"))
    assert saved == ["latest", f"step-{k}"]


@pytest.mark.parametrize("saved_on, loaded_on", [(2, 1), (1, 2)], ids=["2to1", "1to2"])
def test_a_checkpoint_reshards_by_name_onto_another_number_of_ranks(tmp_path, saved_on, loaded_on):
    spawn("train", tmp_path, saved_on, tag="source", steps=2, compute_dtype=None, save_at=2)
    whole = spawn("reshard", tmp_path, saved_on, tag="saved", source="ckpt", compute_dtype=None)
    loaded = spawn("reshard", tmp_path, loaded_on, tag="loaded", source="ckpt", compute_dtype=None)
    want = whole[0]["consolidated"]  # the whole state, gathered from the ranks that saved it
    for rank in range(loaded_on):
        for name, value in whole[0]["params"].items():
            assert torch.equal(loaded[rank]["params"][name], value), name
    got = loaded[0]["consolidated"]
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys() and len(want["state"]) == len(whole[0]["params"])
    for index, state in want["state"].items():
        for key, value in state.items():
            assert torch.equal(got["state"][index][key], value), (index, key)
    if saved_on > 1:  # each rank wrote the state it owns, nothing was gathered
        from torch.distributed.checkpoint import FileSystemReader

        storage = FileSystemReader(latest_checkpoint(tmp_path / "ckpt")).read_metadata().storage_data
        files = {info.relative_path for index, info in storage.items() if index.fqn.startswith("optim/state/")}
        assert files == {"__0_0.distcp", "__1_0.distcp"}
    if loaded_on > 1:  # each rank reads only the state it updates
        owned = [len(r["optimizer"]["state"]) for r in loaded]
        assert sum(owned) == len(want["state"]) and all(0 < n < len(want["state"]) for n in owned)


def test_each_rank_saves_its_disk_tiers_state_and_it_reshards_onto_one_rank(tmp_path):
    # Sharded, each rank's tier holds the moments of the parameters it updates; each rank writes
    # them from its own tier, slice by slice (Note: [Slice-by-slice save]), and one rank loads all,
    # into an optimizer without a tier and into one with a tier. Into the tier, most slices have
    # items in both ranks' files, which DCP reads one after the other: the slices are loaded out
    # of order, several at once (Note: [Slice-by-slice load]), and the state is the same.
    tier = spawn("train", tmp_path, 2, tag="tier", steps=2, compute_dtype=None, save_at=2, disk_tier=True)
    want = {index: state for rank in tier for index, state in rank["optimizer"]["state"].items()}
    assert all(len(rank["optimizer"]["state"]) < len(want) for rank in tier)  # sharded
    for disk_tier in (False, True):
        loaded = spawn("reshard", tmp_path, 1, tag="loaded", source="ckpt", compute_dtype=None,
                       disk_tier=disk_tier)[0]
        got = loaded["consolidated"]["state"]
        assert got.keys() == want.keys() and len(want) == len(loaded["params"])
        for index, state in want.items():
            assert state.keys() == got[index].keys() == {"step", "exp_avg", "exp_avg_sq"}
            for key, value in state.items():
                assert torch.equal(got[index][key], value), (disk_tier, index, key)
        for name, value in tier[0]["params"].items():
            assert torch.equal(loaded["params"][name], value), name
        if disk_tier:
            assert loaded["all_on_disk"] and loaded["state_tensors_in_ram"] == 0
            assert loaded["most_slices_open"] > 1


# -- atomic saves ------------------------------------------------------------------------------------


def check_counting_checkpoint(path, model=None, optimizer=None) -> int:
    """Load a checkpoint of ``keep_saving``: every value is its number, which it returns."""
    if model is None:
        model, optimizer = counting_model()
    counter = load_checkpoint(path, model, optimizer)["counter"]
    for name, p in model.named_parameters():
        assert torch.all(p == counter), name
        assert torch.all(optimizer.state[p]["momentum_buffer"] == counter), name
    return counter


def test_a_save_killed_at_any_moment_leaves_the_last_checkpoint_whole(tmp_path):
    from . import checkpoint_workers

    context = mp.get_context("forkserver")
    generator = random.Random(0)
    directory = tmp_path / "ckpt"
    model, optimizer = counting_model()
    checked: set[tuple[str, int]] = set()
    last = 0
    interrupted = 0
    # Thirty kills, and more (up to sixty) until five landed inside a save: on a fast, idle machine
    # a save is a smaller share of the time between kills.
    for kills in itertools.count(1):
        if kills > 60 or (kills > 30 and interrupted >= 5):
            break
        (tmp_path / "saving").unlink(missing_ok=True)
        child = context.Process(target=checkpoint_workers.run, args=(0, 1, str(tmp_path), "keep_saving", {}))
        child.start()
        deadline = time.monotonic() + 30
        while not (tmp_path / "saving").exists():
            assert child.is_alive() and time.monotonic() < deadline, "the saving process died or never began"
            time.sleep(0.002)
        time.sleep(generator.uniform(0.0, 0.25))  # a few saves' time
        child.kill()  # SIGKILL: nothing runs after it
        child.join()
        interrupted += any(entry.name.endswith(".partial") for entry in directory.iterdir())
        # The last checkpoint saved loads, and is newer than the one before this process.
        latest = latest_checkpoint(directory)
        assert latest is not None
        counter = check_counting_checkpoint(latest, model, optimizer)
        assert counter > last, "the latest checkpoint is not the newest"
        last = counter
        checked.add((latest.name, latest.stat().st_mtime_ns))  # whole: checked just now (the child is dead)
        # Every checkpoint that is visible is complete (each checked once).
        for entry in directory.iterdir():
            if entry.is_dir() and not entry.name.startswith("."):
                if (entry.name, entry.stat().st_mtime_ns) not in checked:
                    check_counting_checkpoint(entry, model, optimizer)
                    checked.add((entry.name, entry.stat().st_mtime_ns))
        # keep_last=3, and one more when the kill fell between a commit and the removal it allows.
        assert len([e for e in directory.iterdir() if not e.name.startswith(".") and e.is_dir()]) <= 4
    assert last >= 30, "each process completes a save before it is killed"
    assert interrupted >= 5, "too few kills landed inside a save"


@pytest.mark.parametrize("renames", [0, 1], ids=["before-its-renames", "between-its-renames"])
def test_a_save_killed_in_its_commit_leaves_hidden_files_the_next_save_clears(tmp_path, renames):
    """Killed before the commit's first rename, nothing new is visible; between the checkpoint's
    rename and latest's, the new checkpoint is whole and latest names the previous one. What the
    killed save left is hidden, read by nothing, and gone after the next save."""
    from . import checkpoint_workers

    assert killed_by_itself(checkpoint_workers.run, (0, 1, str(tmp_path), "killed_in_commit", {"renames": renames}),
                            DEADLINE_S)
    directory = tmp_path / "ckpt"
    visible = sorted(e.name for e in directory.iterdir() if not e.name.startswith("."))
    assert visible == ["latest", "step-2"] + (["step-3"] if renames else [])
    assert any(e.name.startswith(".") for e in directory.iterdir())  # what the killed save left
    assert latest_checkpoint(directory) == directory / "step-2"
    for name in visible[1:]:
        assert check_counting_checkpoint(directory / name) == int(name.removeprefix("step-"))
    if not renames:
        with pytest.raises(CheckpointError, match=r"no checkpoint at .*step-3: not a directory \(a save of it was "
                                                  r"interrupted: .*\.step-3\.partial is incomplete\)"):
            load_checkpoint(directory / "step-3", *counting_model())
    save_checkpoint(directory / "step-4", *counting_model(), extra={"counter": 4}, keep_last=1)
    assert sorted(os.listdir(directory)) == ["latest", "step-4"]


def test_an_existing_checkpoint_is_replaced_whole_and_latest_follows(tmp_path):
    model, optimizer = counting_model()
    for counter in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(counter)
                optimizer.state[p]["momentum_buffer"].fill_(counter)
        save_checkpoint(tmp_path / "a", model, optimizer, extra={"counter": counter})
    assert check_counting_checkpoint(tmp_path / "a") == 2
    assert latest_checkpoint(tmp_path) == tmp_path / "a"
    assert sorted(os.listdir(tmp_path)) == ["a", "latest"]
    assert latest_checkpoint(tmp_path / "nothing") is None


def test_a_save_and_a_load_neither_repeat_a_warning_already_shown_nor_show_dcps_single_process_one(tmp_path):
    # A fresh interpreter: pytest runs each test under warning filters of its own.
    import subprocess
    import sys

    script = f"""
import warnings
from torch import nn
from offload import OffloadModel, load_checkpoint, save_checkpoint

def seen_once():
    warnings.warn("a warning a user has seen once", FutureWarning)

model = OffloadModel(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), device="cpu", num_slices=2)
seen_once()
save_checkpoint({str(tmp_path / "a")!r}, model)
load_checkpoint({str(tmp_path / "a")!r}, model)
seen_once()
"""
    done = subprocess.run([sys.executable, "-W", "default", "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("a warning a user has seen once") == 1, done.stderr
    assert "torch.distributed is disabled" not in done.stderr


def test_a_save_clears_what_killed_saves_left(tmp_path):
    model = OffloadModel(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), device="cpu", num_slices=2)
    save_checkpoint(tmp_path / "step-1", model)
    save_checkpoint(tmp_path / "step-2", model)
    save_checkpoint(tmp_path / "step-3", model)
    (tmp_path / ".step-5.partial").mkdir()  # killed while writing
    os.replace(tmp_path / "step-2", tmp_path / ".step-2.replaced")  # killed between a replacement's renames
    os.replace(tmp_path / "step-3", tmp_path / ".step-3.removed")  # killed while keep_last removed it
    (tmp_path / ".step-3.removed" / "offload.json").unlink()
    save_checkpoint(tmp_path / "step-1", model)
    (tmp_path / ".step-1.replaced").mkdir()  # killed after its replacement took its name
    save_checkpoint(tmp_path / "step-4", model)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-1", "step-2", "step-4"]
    load_checkpoint(tmp_path / "step-2", model)


def test_keep_last_removes_the_oldest(tmp_path):
    model = OffloadModel(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), device="cpu", num_slices=2)
    (tmp_path / "unrelated").mkdir()
    for step in range(1, 6):
        save_checkpoint(tmp_path / f"step-{step}", model, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-4", "step-5", "unrelated"]
    with pytest.raises(ValueError, match="keep_last must be a positive int"):
        save_checkpoint(tmp_path / "x", model, keep_last=0)


# -- mismatches: clear errors, nothing loaded --------------------------------------------------------


def trained(compute_dtype=None, num_slices=3):
    torch.manual_seed(0)
    model = OffloadModel(tied_mlp(), device="cpu", num_slices=num_slices, compute_dtype=compute_dtype)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    for step in range(2):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def snapshot(model, optimizer):
    return ({n: t.clone() for n, t in model.state_dict().items()},
            {k: {n: v.clone() for n, v in s.items()} for k, s in optimizer.state_dict()["state"].items()},
            [dict(g) for g in optimizer.state_dict()["param_groups"]])


def assert_untouched(before, model, optimizer):
    after = snapshot(model, optimizer)
    assert before[0].keys() == after[0].keys() and all(torch.equal(before[0][n], after[0][n]) for n in before[0])
    assert before[1].keys() == after[1].keys()
    assert all(torch.equal(before[1][k][n], after[1][k][n]) for k in before[1] for n in before[1][k])
    assert before[2] == after[2]


def corrupt_truncate(path):
    (data,) = path.glob("*.distcp")
    with open(data, "r+b") as stream:
        stream.truncate(data.stat().st_size // 2)


def corrupt_missing_data(path):
    (data,) = path.glob("*.distcp")
    data.unlink()


def corrupt_missing_metadata(path):
    (path / ".metadata").unlink()


def corrupt_missing_info(path):
    (path / "offload.json").unlink()


@pytest.mark.parametrize("corrupt, message", [
    (corrupt_truncate, r"incomplete: __0_0\.distcp has \d+ bytes, \d+ expected \(truncated\)"),
    (corrupt_missing_data, r"incomplete: __0_0\.distcp is missing"),
    (corrupt_missing_metadata, r"incomplete: \.metadata is missing"),
    (corrupt_missing_info, r"incomplete: offload\.json is missing"),
], ids=["truncated", "missing-data", "missing-metadata", "missing-info"])
def test_an_incomplete_checkpoint_is_refused_before_anything_loads(tmp_path, corrupt, message):
    save_checkpoint(tmp_path / "c", *trained())
    corrupt(tmp_path / "c")
    model, optimizer = trained()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)  # different from what was saved
    before = snapshot(model, optimizer)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path / "c", model, optimizer)
    assert_untouched(before, model, optimizer)


def test_a_missing_checkpoint_says_an_interrupted_save_left_it_partial(tmp_path):
    (tmp_path / ".c.partial").mkdir()
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*c: not a directory \(a save of it was interrupted"):
        load_checkpoint(tmp_path / "c", *trained())


def other_model(tmp_path):
    model = OffloadModel(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3)), device="cpu", num_slices=2)
    return model, OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)


def other_slicing(tmp_path):
    return trained(num_slices=2)


def other_optimizer(tmp_path):
    model, _ = trained()
    return model, OffloadOptimizer(model, torch.optim.SGD, lr=1e-2, momentum=0.9, fused=True)


def other_groups(tmp_path):
    model, _ = trained()
    params = list(model.parameters())
    return model, OffloadOptimizer(model, torch.optim.AdamW, [{"params": params[:2]}, {"params": params[2:]}], lr=1e-2,
                                   fused=True)


def other_shapes(tmp_path):
    torch.manual_seed(0)
    layers = tied_mlp()
    layers[1] = nn.Linear(8, 8, bias=False)
    layers[4] = nn.Linear(8, 8).double()
    model = OffloadModel(layers, device="cpu", num_slices=3)
    return model, OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)


@pytest.mark.parametrize("make, message", [
    (other_model, r"holds another model: 0\.table\.weight is not in the model; .*; 0\.weight is not in the checkpoint"),
    (other_slicing, r"cut into 3 slices, this one has 2; slice 0 differs \(0 there, 0\.\.3 here\)\. Build the "
                    r"OffloadModel with the saved run's num_slices"),
    (other_optimizer, r"holds the state of AdamW, not of SGD"),
    (other_groups, r"holds 1 parameter group\(s\), the optimizer has 2, and parameters changed group: 1\.bias "
                   r"\(group 0 there, group 1 here\); .*\. Build the optimizer with the saved run's groups .*, "
                   r"load\.$"),
    (other_shapes, r"holds another model: 1\.bias is not in the model; 4\.weight is float32\[8, 8\] there, "
                   r"float64\[8, 8\] here"),
], ids=["model", "slicing", "optimizer", "groups", "dtype-and-missing"])
def test_a_checkpoint_of_something_else_names_what_differs_and_loads_nothing(tmp_path, make, message):
    save_checkpoint(tmp_path / "c", *trained())
    model, optimizer = make(tmp_path)
    before = snapshot(model, optimizer)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path / "c", model, optimizer)
    assert_untouched(before, model, optimizer)


def test_a_checkpoint_without_optimizer_state_asks_for_optimizer_none(tmp_path):
    model, optimizer = trained()
    save_checkpoint(tmp_path / "c", model)
    with pytest.raises(CheckpointError, match="holds no optimizer state; load it with optimizer=None"):
        load_checkpoint(tmp_path / "c", model, optimizer)
    assert load_checkpoint(tmp_path / "c", model) is None


def test_the_optimizer_must_step_the_models_parameters(tmp_path):
    model, _ = trained()
    stray = nn.Parameter(torch.zeros(2))
    optimizer = OffloadOptimizer(model, torch.optim.SGD, [*model.parameters(), stray], lr=0.1, fused=True)
    with pytest.raises(ValueError, match="steps a parameter that is not in the model"):
        save_checkpoint(tmp_path / "c", model, optimizer)


# -- interchange with the plain model and optimizer ---------------------------------------------------


def plain_steps(model, optimizer, steps, seed):
    torch.manual_seed(seed)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_checkpoint_moves_between_offload_and_the_plain_model_and_optimizer(tmp_path):
    model, optimizer = trained()
    save_checkpoint(tmp_path / "offload", model, optimizer, extra={"step": 2})
    plain = tied_mlp()
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True)
    assert load_checkpoint(tmp_path / "offload", plain, plain_optimizer) == {"step": 2}
    # The same state, then the same training.
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
    want = optimizer.state_dict()
    got = plain_optimizer.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for index, state in want["state"].items():
        for key, value in state.items():
            assert torch.equal(got["state"][index][key], value)
    assert plain_steps(model, optimizer, 2, seed=7) == plain_steps(plain, plain_optimizer, 2, seed=7)
    # And back: the plain run's checkpoint continues in an OffloadModel.
    save_checkpoint(tmp_path / "plain", plain, plain_optimizer)
    torch.manual_seed(1)
    back = OffloadModel(tied_mlp(), device="cpu", num_slices=2)
    back_optimizer = OffloadOptimizer(back, torch.optim.AdamW, lr=1e-2, fused=True)
    load_checkpoint(tmp_path / "plain", back, back_optimizer)
    assert plain_steps(back, back_optimizer, 2, seed=8) == plain_steps(plain, plain_optimizer, 2, seed=8)
    for p, q in zip(back.parameters(), plain.parameters()):
        assert torch.equal(p, q)


def test_what_a_checkpoint_holds(tmp_path):
    """The layout of Note: [Checkpoint layout], which other DCP readers rely on."""
    model, optimizer = trained(compute_dtype=torch.bfloat16)
    save_checkpoint(tmp_path / "c", model, optimizer, extra={"step": 2})
    from torch.distributed.checkpoint import FileSystemReader

    keys = set(FileSystemReader(tmp_path / "c").read_metadata().state_dict_metadata)
    names = [n for n, _ in model.named_parameters()]
    assert {f"model/{n}" for n in model.state_dict()} <= keys
    assert {f"optim/state/{n}/{k}" for n in names for k in ("exp_avg", "exp_avg_sq", "step")} <= keys
    assert {"optim/param_groups", "rng/0", "extra"} <= keys
    assert "optim/state/5.table.weight/exp_avg" not in keys  # the tied head's state is its first name's
    info = json.loads((tmp_path / "c" / "offload.json").read_text())
    assert info["partition"] == [list(s) for s in model.partition] and info["optimizer"] == "AdamW"
    assert info["tensors"]["1.weight"] == {"shape": [8, 8], "dtype": "float32"}  # the masters, not the shadow
    # Format 3 (wrapped optimizer state: Note: [Wrapped state]; extra as {"value": extra}), and a
    # format this version does not know is refused before anything is loaded, saying so. Formats 1
    # and 2 load in their own layout: tests/test_checkpoint_extra_and_damage.py writes extra as they did.
    assert info["format"] == 3
    assert load_checkpoint(tmp_path / "c", model, optimizer) == {"step": 2}
    (tmp_path / "c" / "offload.json").write_text(json.dumps({**info, "format": 4}))
    before = snapshot(model, optimizer)
    with pytest.raises(CheckpointError, match="has format 4; this version reads 1, 2 and 3 .a newer offload wrote it"):
        load_checkpoint(tmp_path / "c", model, optimizer)
    assert_untouched(before, model, optimizer)
    shutil.rmtree(tmp_path / "c")


def test_a_save_hands_dcp_the_host_copies_themselves_not_copies(tmp_path, monkeypatch):
    """DCP copies a view out of a larger storage and holds every copy until the file is written:
    the save hands it each host copy under a storage of its own, the same memory."""
    from offload.checkpoint import saver as checkpoint

    from .dist_workers import layouts_network

    model = OffloadModel(layouts_network(seed=0), device="cpu", num_slices=2, compute_dtype=torch.bfloat16)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    model(torch.randn(2, 2, 4, 4).to(memory_format=torch.channels_last)).float().pow(2).mean().backward()
    optimizer.step()
    handed = {}
    save = checkpoint.dcp.save
    monkeypatch.setattr(checkpoint.dcp, "save", lambda state, **kw: (handed.update(state), save(state, **kw))[1])
    save_checkpoint(tmp_path / "c", model, optimizer)
    for name, p in model.state_dict().items():
        tensor = handed[f"model/{name}"]
        assert p.untyped_storage().nbytes() == p.nbytes  # its own storage (Note: [A storage per host copy])
        assert tensor.untyped_storage().nbytes() == tensor.nbytes and tensor.data_ptr() == p.data_ptr(), name
        assert tensor.stride() == p.stride() and torch.equal(tensor, p), name
    assert any(not p.is_contiguous() for p in model.parameters())  # channels_last and transposed
    plain = layouts_network(seed=1)
    load_checkpoint(tmp_path / "c", plain)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name


class SlowAdamW(torch.optim.AdamW):
    """AdamW that takes its time: its host update is still running when step() has returned."""

    def step(self, closure=None):
        time.sleep(0.3)
        return super().step(closure)


def test_a_save_waits_for_the_pending_host_updates(tmp_path):
    torch.manual_seed(0)
    model = OffloadModel(tied_mlp(), device="cpu", num_slices=3)
    optimizer = OffloadOptimizer(model, SlowAdamW, lr=1e-2, fused=True)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()
    assert model._engine.updates.pending()  # the updates run beside what follows
    save_checkpoint(tmp_path / "c", model, optimizer)
    plain = tied_mlp()
    plain_optimizer = SlowAdamW(plain.parameters(), lr=1e-2, fused=True)
    load_checkpoint(tmp_path / "c", plain, plain_optimizer)
    optimizer.synchronize()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
    assert all(int(s["step"]) == 1 for s in plain_optimizer.state.values()) and len(plain_optimizer.state) == 5


def test_loading_into_a_model_that_trained_on_rewinds_it_exactly(tmp_path):
    """Loaded in place into a model whose shadows are current and whose updates are pending, and
    into an optimizer that holds state: the run continues as it did after the save."""
    torch.manual_seed(0)
    model = OffloadModel(tied_mlp(), device="cpu", num_slices=3, compute_dtype=torch.bfloat16)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    plain_steps(model, optimizer, 2, seed=3)
    save_checkpoint(tmp_path / "c", model, optimizer)
    after_save = plain_steps(model, optimizer, 2, seed=4)
    held = [optimizer.state[p]["exp_avg"] for p in model.parameters()]
    load_checkpoint(tmp_path / "c", model, optimizer)
    assert all(optimizer.state[p]["exp_avg"] is h for p, h in zip(model.parameters(), held))  # loaded in place
    assert plain_steps(model, optimizer, 2, seed=4) == after_save


def test_a_disk_tiers_state_is_saved_and_resumes_exactly(tmp_path, monkeypatch):
    # The state on disk is read into the checkpoint a slice at a time, each slice once, and freed
    # before the next is read (Note: [Slice-by-slice save]); it loads back into a tier.
    from torch.distributed.checkpoint import FileSystemReader

    from offload import DiskTier
    from offload.tiers.disk_tier import StateTier

    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)])
    x = torch.randn(8, 32)

    def build(tier_dir):
        model = OffloadModel(copy.deepcopy(layers), device="cpu", num_slices=8)
        return model, OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True,
                                       disk_tier=None if tier_dir is None else DiskTier(tmp_path / tier_dir))

    def step(model, optimizer):
        model(x).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    copies: list = []  # weak references to the storage of every state tensor read from the tier
    reads: list[int] = []
    live_after_read: list[int] = []  # bytes of the copies still holding memory, after each read

    def live_bytes():
        # Storages, not tensors: whoever keeps a view of a copy (DCP's writer does) keeps its memory.
        return sum(storage.nbytes() for storage in (ref() for ref in copies) if storage is not None)

    def counted_slice_state(self, index):
        state = real_slice_state(self, index)
        reads.append(index)
        copies.extend(weakref.ref(t.untyped_storage()) for tensors in state.values() for t in tensors.values())
        live_after_read.append(live_bytes())
        return state

    real_slice_state = StateTier.slice_state
    model, optimizer = build("a")
    for _ in range(3):
        step(model, optimizer)
    slice_bytes = 2 * sum(p.nbytes for p in model.parameters()) // 8  # AdamW's two moments of a slice
    monkeypatch.setattr(StateTier, "slice_state", counted_slice_state)
    save_checkpoint(tmp_path / "ck", model, optimizer)
    monkeypatch.undo()
    assert sorted(reads) == list(range(8))  # each slice read once
    assert max(live_after_read) == slice_bytes  # the slice just read, the others freed
    assert live_bytes() == 0
    # The same keys, shapes, dtypes and files as the save of the state kept in memory.
    in_memory, in_memory_optimizer = build(None)
    for _ in range(3):
        step(in_memory, in_memory_optimizer)
    save_checkpoint(tmp_path / "ck_ram", in_memory, in_memory_optimizer)
    saved, saved_in_memory = (FileSystemReader(tmp_path / name).read_metadata() for name in ("ck", "ck_ram"))
    assert saved.state_dict_metadata.keys() == saved_in_memory.state_dict_metadata.keys()
    for key, entry in saved.state_dict_metadata.items():
        if key.startswith("optim/state/"):
            other = saved_in_memory.state_dict_metadata[key]
            assert (entry.size, entry.properties) == (other.size, other.properties)
    assert sorted(os.listdir(tmp_path / "ck")) == sorted(os.listdir(tmp_path / "ck_ram"))
    for _ in range(2):
        step(model, optimizer)
    resumed, resumed_optimizer = build("b")
    load_checkpoint(tmp_path / "ck", resumed, resumed_optimizer)
    for _ in range(2):
        step(resumed, resumed_optimizer)
    for a, b in zip(optimizer.state_dict()["state"].values(), resumed_optimizer.state_dict()["state"].values()):
        assert a.keys() == b.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters()))


def test_update_in_backward_saves_and_resumes_bit_for_bit(tmp_path):
    """A checkpoint taken while the updates backward started are pending, loaded into a fresh model
    and optimizer (which check their first step again), continues the run exactly."""
    def built():
        model = OffloadModel(tied_mlp(), device="cpu", num_slices=3, compute_dtype=torch.bfloat16)
        return model, OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, update_in_backward=True)

    model, optimizer = built()
    plain_steps(model, optimizer, 3, seed=3)
    assert optimizer._in_backward.last_started  # the steps after the first started updates in backward
    save_checkpoint(tmp_path / "c", model, optimizer)
    after_save = plain_steps(model, optimizer, 3, seed=4)
    resumed, resumed_optimizer = built()
    load_checkpoint(tmp_path / "c", resumed, resumed_optimizer)
    assert plain_steps(resumed, resumed_optimizer, 3, seed=4) == after_save
    optimizer.synchronize()
    resumed_optimizer.synchronize()
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
