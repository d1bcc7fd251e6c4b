"""Loading a checkpoint into an OffloadOptimizer with a disk tier, a slice at a time: the resume is
exact (also with Adam's amsgrad, SGD's momentum, groups, a parameter without state, masters on
disk, tied parameters), about one slice's state is in host memory at a time, items out of order
(or filled on several threads) are still right, state saved in another dtype is cast as
load_state_dict() casts it, a write that fails is a DiskTierError with the state loaded, and a
read that fails part way leaves an optimizer that refuses to step or save until a load succeeds. See Note: [Slice-by-slice load] in
offload/checkpoint/slice_load_planner.py; the two-rank cases are in test_checkpoint.py."""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import weakref

import pytest
import torch
from torch import nn

from offload import DiskTier, DiskTierError, OffloadModel, OffloadOptimizer, load_checkpoint, save_checkpoint
from offload.optimizing.tier_plumbing import TierPlumbing
from offload.tiers.disk_tier import Place
from offload.checkpoint.slice_load_planner import SliceWritingLoadPlanner

from .disk_full import refuse_allocating

SLICES = 8


@pytest.fixture
def run(tmp_path):
    """Build, step and compare twins of one model: 8 slices of Linear(32, 32), AdamW."""
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(32, 32) for _ in range(SLICES)])
    x = torch.randn(8, 32)

    class Run:
        @staticmethod
        def build(tier_dir=None):
            model = OffloadModel(copy.deepcopy(layers), device="cpu", num_slices=SLICES)
            tier = None if tier_dir is None else DiskTier(tmp_path / tier_dir)
            return model, OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, disk_tier=tier)

        @staticmethod
        def steps(model, optimizer, n):
            losses = []
            for _ in range(n):
                loss = model(x).square().sum()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
            return losses

    return Run


def assert_same_state(got, want):
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys() and want["state"]
    for index, state in want["state"].items():
        assert got["state"][index].keys() == state.keys(), index
        for key, value in state.items():
            assert got["state"][index][key].dtype == value.dtype, (index, key)
            assert torch.equal(got["state"][index][key], value), (index, key)


def state_tensors_in_ram(optimizer):
    return [key for state in optimizer.state.values() for key, v in state.items()
            if isinstance(v, torch.Tensor) and v.dim() > 0]


class Opened:
    """Watches the slices the planner opens: their order, and the bytes of the storages behind
    the tensors DCP loads into that are still alive after each opening."""

    def __init__(self, monkeypatch):
        self.indices: list[int] = []
        self.live_after_open: list[int] = []
        self.refs: list[weakref.ref] = []
        real = TierPlumbing.open_slice_load

        def opening(plumbing, index, saved):
            opened = real(plumbing, index, saved)
            self.indices.append(index)
            self.refs += [weakref.ref(t.untyped_storage()) for ts in opened.tensors.values() for t in ts.values()]
            self.live_after_open.append(self.live_bytes())
            return opened

        monkeypatch.setattr(TierPlumbing, "open_slice_load", opening)

    def live_bytes(self):
        # Storages, not tensors: a view of a buffer keeps the whole buffer (counted once).
        storages = {s.data_ptr(): s.nbytes() for s in (ref() for ref in self.refs) if s is not None}
        return sum(storages.values())


def test_a_resume_into_a_disk_tier_is_exact_and_holds_one_slice_at_a_time(run, tmp_path, monkeypatch):
    model, optimizer = run.build("a")
    run.steps(model, optimizer, 3)
    save_checkpoint(tmp_path / "ck", model, optimizer)
    saved = copy.deepcopy(optimizer.state_dict())
    # The uninterrupted run, and the same checkpoint loaded without a tier (through load_state_dict).
    losses = run.steps(model, optimizer, 2)
    in_ram, in_ram_optimizer = run.build()
    load_checkpoint(tmp_path / "ck", in_ram, in_ram_optimizer)

    opened = Opened(monkeypatch)
    resumed, resumed_optimizer = run.build("b")
    load_checkpoint(tmp_path / "ck", resumed, resumed_optimizer)
    tier = resumed_optimizer._tier
    slice_bytes = max(record.nbytes for record in tier.records.values())  # one slice's file, in pages
    assert opened.indices == list(range(SLICES))  # each slice opened once, in order
    assert max(opened.live_after_open) == slice_bytes  # the slice being loaded; the others written and freed
    assert opened.live_bytes() == tier.window_nbytes == slice_bytes  # what is left is the window's buffer
    assert all(record.place is Place.DISK for record in tier.records.values())
    assert state_tensors_in_ram(resumed_optimizer) == []  # only the step counts
    assert_same_state(resumed_optimizer.state_dict(), saved)
    assert_same_state(resumed_optimizer.state_dict(), in_ram_optimizer.state_dict())
    assert run.steps(resumed, resumed_optimizer, 2) == losses
    assert_same_state(resumed_optimizer.state_dict(), optimizer.state_dict())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters()))

    # In place, into the optimizer that trained on (its window holds three buffers): it rewinds.
    opened.indices.clear()
    load_checkpoint(tmp_path / "ck", model, optimizer)
    assert opened.indices == list(range(SLICES))
    assert_same_state(optimizer.state_dict(), saved)
    assert run.steps(model, optimizer, 2) == losses
    assert_same_state(optimizer.state_dict(), resumed_optimizer.state_dict())


def test_items_out_of_order_are_still_exact(run, tmp_path, monkeypatch):
    # DCP reads items in the order of the final plan: shuffled, slices interleave and several are
    # open at once; each is written once its last item is in.
    model, optimizer = run.build("a")
    run.steps(model, optimizer, 2)
    save_checkpoint(tmp_path / "ck", model, optimizer)
    saved = copy.deepcopy(optimizer.state_dict())
    real_finish_plan = SliceWritingLoadPlanner.finish_plan
    open_at_once = []

    def shuffled(self, plan):
        plan = real_finish_plan(self, plan)
        random.Random(0).shuffle(plan.items)
        return plan

    real_resolve = SliceWritingLoadPlanner.resolve_tensor

    def resolve(self, item):
        tensor = real_resolve(self, item)
        open_at_once.append(len(self._open))
        return tensor

    monkeypatch.setattr(SliceWritingLoadPlanner, "finish_plan", shuffled)
    monkeypatch.setattr(SliceWritingLoadPlanner, "resolve_tensor", resolve)
    opened = Opened(monkeypatch)
    resumed, resumed_optimizer = run.build("b")
    load_checkpoint(tmp_path / "ck", resumed, resumed_optimizer)
    assert sorted(opened.indices) == list(range(SLICES)) and max(open_at_once) > 2
    assert state_tensors_in_ram(resumed_optimizer) == []
    assert_same_state(resumed_optimizer.state_dict(), saved)
    assert run.steps(resumed, resumed_optimizer, 2) == run.steps(model, optimizer, 2)
    assert_same_state(resumed_optimizer.state_dict(), optimizer.state_dict())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=["bf16", "float64"])
def test_state_saved_in_another_dtype_is_cast_as_load_state_dict_casts_it(run, tmp_path, dtype):
    # Moments saved in another dtype than the parameters' (here by a plain optimizer whose state
    # was converted): torch.optim's load_state_dict() casts them to the parameters' dtype, and the
    # load into a disk tier gives the same bytes.
    model, optimizer = run.build()
    run.steps(model, optimizer, 2)
    plain = nn.Sequential(*[nn.Linear(32, 32) for _ in range(SLICES)])
    plain.load_state_dict(model.state_dict())
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True)
    plain_optimizer.load_state_dict(optimizer.state_dict())
    for state in plain_optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = (state[key] * 1.001).to(dtype)  # values a float32 -> dtype -> float32 trip changes
    save_checkpoint(tmp_path / "ck", plain, plain_optimizer)
    in_ram, in_ram_optimizer = run.build()
    load_checkpoint(tmp_path / "ck", in_ram, in_ram_optimizer)
    on_disk, on_disk_optimizer = run.build("t")
    load_checkpoint(tmp_path / "ck", on_disk, on_disk_optimizer)
    assert all(record.place is Place.DISK for record in on_disk_optimizer._tier.records.values())
    got = on_disk_optimizer.state_dict()
    assert_same_state(got, in_ram_optimizer.state_dict())
    assert {v.dtype for s in got["state"].values() for k, v in s.items() if k != "step"} == {torch.float32}
    assert run.steps(on_disk, on_disk_optimizer, 2) == run.steps(in_ram, in_ram_optimizer, 2)
    assert_same_state(on_disk_optimizer.state_dict(), in_ram_optimizer.state_dict())


def test_a_write_failing_while_loading_is_a_disk_tier_error_and_the_state_is_loaded(run, tmp_path, monkeypatch):
    model, optimizer = run.build("a")
    run.steps(model, optimizer, 2)
    save_checkpoint(tmp_path / "ck", model, optimizer, extra={"step": 2})
    saved = copy.deepcopy(optimizer.state_dict())
    rng = torch.get_rng_state()
    refusing = refuse_allocating(monkeypatch, "slice-00002.state")
    resumed, resumed_optimizer = run.build("b")
    torch.manual_seed(12345)
    with pytest.raises(DiskTierError) as raised:
        load_checkpoint(tmp_path / "ck", resumed, resumed_optimizer)
    message = str(raised.value)
    assert "slice-00002.state" in message and "slice(s) 2 " in message and "No space left" in message
    assert "The state is loaded" in message and "held in RAM" in message
    assert torch.equal(torch.get_rng_state(), rng)  # the load finished before it raised
    tier = resumed_optimizer._tier
    assert [r.index for r in tier.records.values() if r.place is Place.HELD] == [2]
    assert all(r.place is Place.DISK for r in tier.records.values() if r.index != 2)
    # Nothing silently wrong: the whole state is the saved one (slice 2's from where it is held).
    assert_same_state(resumed_optimizer.state_dict(), saved)
    # Still full: step() raises and updates nothing. Space freed: it writes slice 2 and trains on exactly.
    with pytest.raises(DiskTierError, match="This call to step\\(\\) updated nothing"):
        run.steps(resumed, resumed_optimizer, 1)
    resumed_optimizer.zero_grad()
    refusing.clear()
    assert run.steps(resumed, resumed_optimizer, 2) == run.steps(model, optimizer, 2)
    assert all(r.place is Place.DISK for r in tier.records.values())
    assert_same_state(resumed_optimizer.state_dict(), optimizer.state_dict())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters()))


def test_without_a_disk_tier_nothing_changes(run, tmp_path, monkeypatch):
    model, optimizer = run.build()
    run.steps(model, optimizer, 1)
    save_checkpoint(tmp_path / "ck", model, optimizer)
    monkeypatch.setattr(SliceWritingLoadPlanner, "__init__", lambda *a, **k: pytest.fail("planner used"))
    resumed, resumed_optimizer = run.build()
    load_checkpoint(tmp_path / "ck", resumed, resumed_optimizer)
    assert_same_state(resumed_optimizer.state_dict(), optimizer.state_dict())


def damage(checkpoint, key):
    """Overwrite the bytes of the saved item ``key`` in place: the files keep their lengths, so only
    reading the item fails. The checkpoint's checksums are dropped, as in one saved before they
    were recorded: with them the load refuses before reading anything (tests/test_checkpoint_files.py),
    and these tests are about a read that fails part way."""
    from torch.distributed.checkpoint import FileSystemReader

    info_file = checkpoint / "offload.json"
    info = json.loads(info_file.read_text())
    info.pop("crc32", None)
    info_file.write_text(json.dumps(info))
    for index, item in FileSystemReader(checkpoint).read_metadata().storage_data.items():
        if index.fqn == key:
            with open(checkpoint / item.relative_path, "r+b") as file:
                file.seek(item.offset)
                file.write(b"\x07" * item.length)
            return
    raise AssertionError(f"{key} is not in {checkpoint}")


@pytest.mark.parametrize("into", ["fresh", "trained"])
def test_a_read_failing_mid_load_leaves_an_optimizer_that_refuses_to_step_or_save_until_a_load_succeeds(
        run, tmp_path, into):
    # DCP reads the steps first, then the slices in order: slices 0 to 2 are written into the
    # tier with the checkpoint's moments before slice 3's fails to read. Stepping on would mix
    # (a fresh optimizer has no step for them: its update raised a KeyError), and a save would
    # write that mix: both refuse, saying why, until a load succeeds.
    from torch.distributed.checkpoint.api import CheckpointException

    model, optimizer = run.build("a")
    run.steps(model, optimizer, 2)
    save_checkpoint(tmp_path / "ck", model, optimizer)
    saved = copy.deepcopy(optimizer.state_dict())
    losses = run.steps(model, optimizer, 2)
    shutil.copytree(tmp_path / "ck", tmp_path / "damaged")
    damage(tmp_path / "damaged", "optim/state/3.weight/exp_avg_sq")

    resumed, resumed_optimizer = run.build("b")
    if into == "trained":
        run.steps(resumed, resumed_optimizer, 3)
    with pytest.raises(CheckpointException) as raised:
        load_checkpoint(tmp_path / "damaged", resumed, resumed_optimizer)
    assert "slice(s) 0, 1, 2" in "\n".join(getattr(raised.value, "__notes__", []))
    for call in (lambda: run.steps(resumed, resumed_optimizer, 1), resumed_optimizer.state_dict,
                 lambda: save_checkpoint(tmp_path / "mix", resumed, resumed_optimizer)):
        with pytest.raises(RuntimeError, match="partly loaded.*damaged.*slice\\(s\\) 0, 1, 2"):
            call()
    resumed_optimizer.zero_grad()
    assert not (tmp_path / "mix").exists()
    load_checkpoint(tmp_path / "ck", resumed, resumed_optimizer)  # the retry, from a good copy
    assert_same_state(resumed_optimizer.state_dict(), saved)
    assert run.steps(resumed, resumed_optimizer, 2) == losses
    assert_same_state(resumed_optimizer.state_dict(), optimizer.state_dict())


def test_a_read_failing_before_any_slice_is_written_refuses_too(run, tmp_path):
    # The steps were read in place already, and on several ranks a rank that went on would wait
    # for the others at its next collective: every failed load refuses, written slices or not.
    from torch.distributed.checkpoint.api import CheckpointException

    model, optimizer = run.build("a")
    run.steps(model, optimizer, 2)
    save_checkpoint(tmp_path / "ck", model, optimizer)
    damage(tmp_path / "ck", "optim/state/0.weight/exp_avg")
    resumed, resumed_optimizer = run.build("b")
    with pytest.raises(CheckpointException):
        load_checkpoint(tmp_path / "ck", resumed, resumed_optimizer)
    with pytest.raises(RuntimeError, match="partly loaded.*before writing any slice.*step"):
        resumed_optimizer.state_dict()


def test_a_reader_loading_items_on_several_threads_is_still_exact(run, tmp_path, monkeypatch):
    # DCP's FileSystemReader resolves, fills and commits one item at a time on one thread; other
    # storage readers fill items on a pool of threads. The planner opens, counts and writes the
    # slices under a lock: two threads resolving a slice's first items at once open it once.
    import io
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.futures import Future

    import offload.checkpoint.loader

    threads = set()

    class ThreadedReader(FileSystemReader):
        def read_data(self, plan, planner):
            def read(item):
                threads.add(threading.get_ident())
                info = self.storage_data[item.storage_index]
                with open(os.path.join(self.path, info.relative_path), "rb") as file:
                    file.seek(info.offset)
                    data = io.BytesIO(file.read(info.length))
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, data)
                    return
                tensor = torch.load(data, map_location="cpu", weights_only=True)
                tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
                target = planner.resolve_tensor(item).detach()
                target.copy_(tensor)
                planner.commit_tensor(item, target)

            with ThreadPoolExecutor(4) as pool:
                list(pool.map(read, plan.items))
            done: Future = Future()
            done.set_result(None)
            return done

    real_open = TierPlumbing.open_slice_load

    def slow_open(plumbing, index, saved):
        time.sleep(0.05)  # the other threads resolve the slice's other items meanwhile
        return real_open(plumbing, index, saved)

    model, optimizer = run.build("a")
    run.steps(model, optimizer, 2)
    save_checkpoint(tmp_path / "ck", model, optimizer)
    saved = copy.deepcopy(optimizer.state_dict())
    monkeypatch.setattr(offload.checkpoint.loader, "FileSystemReader", ThreadedReader)
    monkeypatch.setattr(TierPlumbing, "open_slice_load", slow_open)
    resumed, resumed_optimizer = run.build("b")
    load_checkpoint(tmp_path / "ck", resumed, resumed_optimizer)
    assert len(threads) > 1
    assert all(record.place is Place.DISK for record in resumed_optimizer._tier.records.values())
    assert_same_state(resumed_optimizer.state_dict(), saved)
    assert run.steps(resumed, resumed_optimizer, 2) == run.steps(model, optimizer, 2)


def _edge_case(name, tmp_path):
    """(build(tier_dir), inputs) for one of the optimizers and models the edge-case test resumes."""
    from .stream_scenarios import tied_mlp

    torch.manual_seed(0)
    if name == "tied":
        layers, x, slices = tied_mlp(), torch.randint(0, 11, (4, 3)), 3
    else:
        layers, x, slices = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)]), torch.randn(4, 16), 6
    if name == "groups-frozen":
        layers[2].requires_grad_(False)  # in the optimizer, never stepped: no state

    def build(tier_dir):
        tier = DiskTier(tmp_path / tier_dir)
        kwargs = {"compute_dtype": torch.bfloat16, "masters": DiskTier(tmp_path / "masters")} if name in (
            "masters-bf16", "tied") else {}
        model = OffloadModel(copy.deepcopy(layers), device="cpu", num_slices=slices, **kwargs)
        params = list(model.parameters())
        if name == "amsgrad":
            return model, OffloadOptimizer(model, torch.optim.Adam, lr=1e-2, amsgrad=True, disk_tier=tier)
        if name == "sgd-momentum":
            return model, OffloadOptimizer(model, torch.optim.SGD, lr=1e-2, momentum=0.9, disk_tier=tier)
        if name == "groups-frozen":
            groups = [{"params": params[:4], "lr": 1e-3, "weight_decay": 0.1},
                      {"params": params[4:], "betas": (0.8, 0.9)}]
            return model, OffloadOptimizer(model, torch.optim.AdamW, groups, lr=1e-2, fused=True, disk_tier=tier)
        return model, OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, disk_tier=tier)

    return build, x


@pytest.mark.filterwarnings("ignore:Adam is stepping")  # per-tensor Adam: its step is loaded uncast
@pytest.mark.parametrize("name", ["amsgrad", "sgd-momentum", "groups-frozen", "masters-bf16", "tied"])
def test_a_resume_into_a_disk_tier_is_exact_with_other_optimizers_groups_and_models(tmp_path, name):
    # max_exp_avg_sq, SGD's momentum_buffer (no scalar in the state at all), groups with their
    # own hyperparameters and a parameter without state, the masters on disk under a bfloat16
    # compute dtype, an embedding tied across slices: into a fresh optimizer and into one that
    # trained (its files laid out by its own steps), the state and the run go on exactly.
    build, x = _edge_case(name, tmp_path)

    def steps(model, optimizer, n):
        losses = []
        for _ in range(n):
            loss = model(x).float().square().sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    model, optimizer = build("a")
    steps(model, optimizer, 2)
    save_checkpoint(tmp_path / "ck", model, optimizer)
    saved = copy.deepcopy(optimizer.state_dict())
    losses = steps(model, optimizer, 2)
    for into in ("fresh", "trained"):
        resumed, resumed_optimizer = build(f"b-{into}")
        if into == "trained":
            steps(resumed, resumed_optimizer, 3)
        load_checkpoint(tmp_path / "ck", resumed, resumed_optimizer)
        assert state_tensors_in_ram(resumed_optimizer) == []
        assert_same_state(resumed_optimizer.state_dict(), saved)
        assert steps(resumed, resumed_optimizer, 2) == losses, into
        assert_same_state(resumed_optimizer.state_dict(), optimizer.state_dict())
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters()))
