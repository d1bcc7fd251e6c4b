"""Data parallelism over a gloo group of two processes on this machine (``dist_workers.py``)."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
import torch.multiprocessing as mp

from offload import OffloadModel, OffloadOptimizer
from offload import data_parallel
from offload.data_parallel import check_group
from offload.optimizing.sharding import owners as _owners
from offload.planning.presets import build_preset
from offload.streams import StreamBackend, using_backend

from .dist_workers import batchnorm_network, branch_data, branch_network, data, network

WORLD = 2
#: Averaging two ranks' gradients adds in another order than one process over the whole batch.
ROUNDING = {"rtol": 1e-5, "atol": 1e-6}
#: Seconds a job's ranks get before they are killed and the test fails: far above a job's few
#: seconds, even on a loaded machine, and far below a CI timeout.
DEADLINE_S = 120

# Ranks fork from a server process that imported these once. A freshly spawned process would
# import torch again, and torch._dynamo at its first optimizer: seconds apiece, most of a job's time.
mp.set_forkserver_preload(["torch", "torch._dynamo", "tests.dist_workers"])


def spawn(job: str, tmp_path, world: int = WORLD, backend: str = "gloo", deadline_s: float = DEADLINE_S) -> list:
    """Run ``job`` on ``world`` ranks; return what each saved.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank raised.
        pytest.fail.Exception: the ranks were still running after ``deadline_s`` (they are killed).
    """
    from . import dist_workers

    ranks = mp.start_processes(dist_workers.run, args=(world, str(tmp_path), job, backend), nprocs=world,
                               join=False, start_method="forkserver")
    deadline = time.monotonic() + deadline_s
    # join() raises, after terminating the other ranks, as soon as one rank fails.
    while not ranks.join(timeout=max(deadline - time.monotonic(), 0.0)):
        if time.monotonic() >= deadline:
            hung = [rank for rank, process in enumerate(ranks.processes) if process.is_alive()]
            for process in ranks.processes:
                if process.is_alive():
                    process.kill()
                process.join()
            pytest.fail(f"job {job!r}: ranks {hung} of {world} were still running after {deadline_s} s and were "
                        "killed (a collective that never completes?)")
    results = []
    for rank in range(world):
        path = os.path.join(tmp_path, f"{job}.{rank}.pt")
        results.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
    return results


def one_process(make, steps=3, clip=None):
    """The plain model on the whole batch (the mean loss over every rank's rows)."""
    model = network(seed=0)
    optimizer = make(list(model.parameters()))
    for step in range(steps):
        optimizer.zero_grad()
        model(data(step, WORLD)).pow(2).mean().backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return model, optimizer


def test_ranks_agree_with_each_other_and_with_one_process(tmp_path):
    results = spawn("train", tmp_path)
    for name, make in (("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True)),
                       ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True))):
        # Ranks began from different seeds: rank 0's weights were taken, and they stay identical.
        for a, b in zip(results[0][name], results[1][name]):
            assert torch.equal(a, b)
        reference, _ = one_process(make)
        for got, want in zip(results[0][name], reference.parameters()):
            torch.testing.assert_close(got, want.detach(), **ROUNDING)


def test_no_sync_accumulates_locally_then_averages_the_total(tmp_path):
    results = spawn("no_sync", tmp_path)
    reference = network(seed=0)
    for micro in range(3):
        (reference(data(micro, WORLD)).pow(2).mean() / 3).backward()
    for a, b, want in zip(results[0], results[1], reference.parameters()):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, want.grad, **ROUNDING)


def test_sharded_offload_optimizer(tmp_path):
    results = spawn("sharded", tmp_path)
    reference, plain = one_process(lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), clip=0.5)
    for dtype in ("None", "torch.bfloat16"):
        mine, theirs = results[0][dtype], results[1][dtype]
        for a, b in zip(mine["params"], theirs["params"]):
            assert torch.equal(a, b)
        torch.testing.assert_close(mine["outputs"], theirs["outputs"], rtol=0, atol=0)
        # Each rank keeps the optimizer state of its own share only.
        assert mine["owned"] + theirs["owned"] == len(list(reference.parameters()))
        assert 0 < mine["owned"] < len(list(reference.parameters()))
        assert theirs["state"] is None
        full = mine["state"]
        loaded = torch.optim.AdamW(network(seed=0).parameters(), lr=1e-2, fused=True)
        loaded.load_state_dict(full)  # gathers into a plain optimizer's checkpoint
        if dtype == "None":
            for got, want in zip(mine["params"], reference.parameters()):
                torch.testing.assert_close(got, want.detach(), **ROUNDING)
            want_state = plain.state_dict()["state"]
            for k in want_state:
                for key in want_state[k]:
                    torch.testing.assert_close(full["state"][k][key], want_state[k][key], **ROUNDING)


def test_a_sharded_state_dict_refuses_and_its_advice_resumes_as_one_process(tmp_path):
    """Each rank holds only its share of a sharded optimizer's state; saved as the whole (``if rank
    == 0: torch.save(optimizer.state_dict())``), it would load without a word and restart the
    other rank's parameters with fresh moments. So state_dict() refuses on every rank, saying what
    to do (Note: [A sharded state_dict()]); consolidated_state_dict(to=0), saved on rank 0, resumes
    in one process as the plain optimizer on the whole batch. Unsharded, state_dict() is whole."""
    results = spawn("sharded_state_dict", tmp_path)
    parameters = len(list(network(seed=0).parameters()))
    for rank, result in enumerate(results):
        refused = result["state_dict True"]
        assert isinstance(refused, str), "a sharded state_dict() handed out one rank's share"
        assert f"rank {rank} of {WORLD} keeps the optimizer state of only the parameters it updates" in refused
        assert "optimizer.consolidated_state_dict(to=0) on every rank" in refused
        assert "offload.save_checkpoint(path, model, optimizer) on every rank" in refused
        whole = result["state_dict False"]  # unsharded: every rank's own state_dict() is whole
        assert len(whole["state"]) == parameters
        assert (result["consolidated True"] is None) == (rank == 1)  # gathered on rank 0, None on the others
    saved = results[0]["consolidated True"]
    assert len(saved["state"]) == parameters
    for index, state in results[0]["state_dict False"]["state"].items():
        for key, value in state.items():
            assert torch.equal(saved["state"][index][key], value), (index, key)
    # Resume in one process from what rank 0 saved, one more step on the whole batch.
    model = OffloadModel(network(seed=0), device="cpu", num_slices=3)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    model.load_state_dict(results[0]["model True"])
    optimizer.load_state_dict(saved)
    model(data(2, WORLD)).pow(2).mean().backward()
    optimizer.step()
    optimizer.synchronize()
    reference, _ = one_process(lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True))
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.detach(), want.detach(), **ROUNDING)


def test_sharded_update_keeps_each_ranks_state_on_its_disk(tmp_path):
    results = spawn("sharded_disk", tmp_path)
    for rank, result in enumerate(results):
        in_ram, on_disk = result["False"], result["True"]
        for a, b in zip(in_ram["params"], on_disk["params"]):
            assert torch.equal(a, b)
        assert on_disk["directory"] != results[1 - rank]["True"]["directory"]
        assert f"offload-state-rank{rank}-" in on_disk["directory"]
        # Its own share's moments only (two float32 tensors per parameter), in page-sized files.
        owned = on_disk["owned_elements"]
        assert 0 < owned < sum(p.numel() for p in network(seed=0).parameters())
        assert 8 * owned <= on_disk["disk_bytes"] <= 8 * owned + 4096 * len(on_disk["files"])
    state_in_ram, state_on_disk = results[0]["False"]["state"], results[0]["True"]["state"]
    assert state_in_ram["state"].keys() == state_on_disk["state"].keys()
    for k, values in state_in_ram["state"].items():
        for key, value in values.items():
            assert torch.equal(value, state_on_disk["state"][k][key]), (k, key)


@pytest.mark.parametrize("preset, world", [("mlp", 2), ("mlp", 8), ("transformer", 2), ("transformer", 8),
                                           ("tiny", 3)])
def test_each_rank_updates_about_its_share_of_the_model(preset, world):
    """The sharded update's ranks own ``1 / world`` of the elements, give or take one parameter."""
    model = OffloadModel(build_preset(preset).model, device="cpu", num_slices=8)
    slices = [[entry.tensor for entry in s.storage.params] for s in model._engine.slices]
    owners = _owners(slices, world)
    load = [0] * world
    for params, mine in zip(slices, owners):
        for p, owner in zip(params, mine):
            load[owner] += p.numel()
    total = sum(load)
    largest = max(p.numel() for params in slices for p in params)
    assert max(load) / total <= 1 / world + largest / total, f"a rank owns {max(load) / total:.2f} of the elements"
    assert len({rank for mine in owners for rank in mine}) == world


def test_a_parameter_tied_across_slices_trains_as_in_one_process(tmp_path):
    from .dist_workers import tied_data, tied_steps
    from .stream_scenarios import tied_mlp

    results = spawn("tied", tmp_path)
    reference = tied_mlp().eval()
    tied_steps(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True),
               lambda i: tied_data(i, WORLD))
    for a, b, want in zip(results[0], results[1], reference.parameters()):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, want.detach(), **ROUNDING)


def test_parameters_in_other_memory_layouts_train_as_in_one_process(tmp_path):
    from .dist_workers import layouts_data, layouts_network

    results = spawn("layouts", tmp_path)
    reference = layouts_network(seed=0)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    for step in range(3):
        reference(layouts_data(step, WORLD)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    for (a, stride), (b, _), want in zip(results[0], results[1], reference.parameters()):
        assert torch.equal(a, b) and stride == want.stride()
        torch.testing.assert_close(a, want.detach(), **ROUNDING)


def test_ranks_with_different_models_are_refused(tmp_path):
    errors = spawn("different_models", tmp_path)
    for error in errors:
        assert error is not None and "differs from rank 0's" in error


def test_a_group_added_to_a_sharded_optimizer_keeps_the_state_of_the_others(tmp_path):
    """A group added after two steps (a layer unfrozen) makes a new plan of owners; parameters keep
    the rank that holds their state, so AdamW's moments and step counts go on as the plain
    optimizer's over the whole batch (a new owner would start them over: 0.03 apart)."""
    from .dist_workers import unfreeze_at_step_2, unfreezing_data, unfreezing_layers

    results = spawn("sharded_add_param_group", tmp_path)
    model = nn.Sequential(*unfreezing_layers())
    plain = torch.optim.AdamW([{"params": list(model.parameters())[2:]}], lr=1e-2, fused=True)
    unfreeze_at_step_2(model, plain, unfreezing_data)
    for a, b, want in zip(results[0]["params"], results[1]["params"], model.parameters()):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, want.detach(), **ROUNDING)
    want_state = plain.state_dict()["state"]
    got_state = results[0]["state"]["state"]
    assert sorted(got_state) == sorted(want_state)
    for k in want_state:
        for key in want_state[k]:
            torch.testing.assert_close(got_state[k][key], want_state[k][key], **ROUNDING)


def test_a_load_that_one_rank_refuses_is_refused_on_every_rank(tmp_path):
    """Rank 1's path holds no checkpoint: it raises before any collective, and rank 0, instead of
    waiting for it in one, raises a CheckpointError naming rank 1 and why."""
    errors = spawn("load_missing_on_one_rank", tmp_path)
    assert errors[1].startswith("no checkpoint at ") and "checkpoint-typo" in errors[1]
    assert errors[0].startswith("nothing was loaded, since another rank refused: rank 1: CheckpointError: no "
                                "checkpoint at ")


def test_a_load_that_one_rank_fails_as_it_ends_raises_on_every_rank(tmp_path):
    """Rank 1's set_extra_state raises after the read: it raises its own error, and rank 0, instead
    of waiting for it at the end of the load, a CheckpointError naming it and what was loaded. The
    keys the optimizer's state_dict post-hooks added are rank 0's, on every rank."""
    results = spawn("load_hook_fails_on_one_rank", tmp_path)
    assert results[1]["error"] == "ValueError: set_extra_state refuses on rank 1"
    assert results[0]["error"].startswith("CheckpointError: the load did not finish on every rank: the model holds "
                                          "the checkpoint's tensors")
    assert results[0]["error"].endswith("rank 1: ValueError: set_extra_state refuses on rank 1")
    assert results[0]["seen"] == [0]


def test_ranks_that_cut_the_model_into_other_slices_are_refused(tmp_path):
    """Gradients are averaged slice by slice: ranks whose slices differ would pair all-reduces of
    other sizes (a gloo abort), so construction refuses them on every rank."""
    errors = spawn("different_slices", tmp_path)
    for error in errors:
        assert error is not None and "rank 1 cuts the model into other slices than rank 0" in error
        assert "pass the same num_slices" in error


def branch_reference(steps: int, firsts: list[float]) -> tuple[list, list]:
    """One process on the whole batch, rank r's rows taking the branch ``firsts[r]`` picks: the
    first backward's gradients and the parameters after ``steps`` steps of SGD with momentum."""
    model = branch_network(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads = None
    for step in range(steps):
        for rank, first in enumerate(firsts):
            (model(branch_data(step, rank, first)).pow(2).mean() / len(firsts)).backward()
        if grads is None:
            grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
    return grads, [p.detach() for p in model.parameters()]


def test_a_parameter_that_only_some_ranks_use_is_averaged_with_zeros_from_the_others(tmp_path):
    """Rank 0 takes one branch and rank 1 another, as DDP(find_unused_parameters=True) would average
    them: every rank ends with the whole batch's gradient, a parameter no rank used keeps no
    gradient, and the ranks' updates (plain and sharded) agree with one process."""
    results = spawn("uneven_branch", tmp_path)
    want_grads, want_params = branch_reference(3, [1.0, -1.0])
    assert want_grads[4] is None and want_grads[0] is not None and want_grads[2] is not None  # c; a; b
    for key in ("2-False", "2-True", "3-False", "3-True"):
        mine, theirs = results[0][key], results[1][key]
        for a, b, want in zip(mine["grads"], theirs["grads"], want_grads):
            assert (a is None) == (b is None) == (want is None), key
            if want is not None:
                assert torch.equal(a, b), key
                torch.testing.assert_close(a, want, **ROUNDING)
        for a, b, want in zip(mine["params"], theirs["params"], want_params):
            assert torch.equal(a, b), key
            torch.testing.assert_close(a, want, **ROUNDING)


def test_a_parameter_used_only_under_no_sync_is_averaged_by_the_next_synced_backward(tmp_path):
    results = spawn("branch_in_no_sync", tmp_path)
    model = branch_network(seed=0)
    for micro, first in ((0, 1.0), (1, -1.0)):
        for rank in range(WORLD):
            (model(branch_data(micro, rank, first)).pow(2).mean() / 2 / WORLD).backward()
    for slices in (3, 4):
        for a, b, want in zip(results[0][slices], results[1][slices], model.parameters()):
            assert (a is None) == (b is None) == (want.grad is None)
            if want.grad is not None:
                assert torch.equal(a, b)
                torch.testing.assert_close(a, want.grad, **ROUNDING)


def test_ranks_that_freeze_different_parameters_are_refused(tmp_path):
    errors = spawn("frozen_on_one_rank", tmp_path)
    for error in errors:
        assert error is not None and "differs from rank 0's" in error and "requires_grad=False" in error


def test_own_collectives_after_step_and_two_models_on_one_group_do_not_race_the_library(tmp_path):
    """A logged all-reduce of the loss and a barrier right after each step, and a second model on
    the same group, while the sharded updates' broadcasts are queued: Note: [A private group for
    the worker]."""
    results = spawn("own_collectives", tmp_path)
    assert results[0]["logged"] == results[1]["logged"]
    # Freed with their models, each model's collectives worker ends its thread.
    assert [result["collectives threads left"] for result in results] == [0, 0]
    references = [network(seed=0), network(seed=1)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in references]
    logged = []
    for step in range(4):
        for model, optimizer in zip(references, optimizers):
            losses = [model(rows).pow(2).mean() for rows in data(step, WORLD).chunk(WORLD)]
            (sum(losses) / WORLD).backward()
            optimizer.step()
            optimizer.zero_grad()
            logged.append(sum(loss.item() for loss in losses) / WORLD)
    torch.testing.assert_close(torch.tensor(results[0]["logged"]), torch.tensor(logged), **ROUNDING)
    for k, reference in enumerate(references):
        for a, b, want in zip(results[0]["params"][k], results[1]["params"][k], reference.parameters()):
            assert torch.equal(a, b)
            torch.testing.assert_close(a, want.detach(), **ROUNDING)


def test_a_model_on_a_group_whose_ranks_joined_different_groups_trains(tmp_path):
    """The worker's private group is named alike on every rank of the model's group, however many
    other groups each joined (Note: [A private group for the worker])."""
    results = spawn("overlapping_groups", tmp_path, world=3)
    reference = network(seed=0)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    for step in range(2):
        sum(reference(rows).pow(2).mean() for rows in data(step, 2).chunk(2)).div(2).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert results[2] is None
    for a, b, want in zip(results[0], results[1], reference.parameters()):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, want.detach(), **ROUNDING)


def test_a_checkpoint_holds_rank_0s_buffers(tmp_path):
    """BatchNorm's running statistics differ between ranks: the checkpoint holds rank 0's, every one
    of them, and every rank loads those."""
    results = spawn("batchnorm_checkpoint", tmp_path)
    names = [name for name, _ in batchnorm_network(seed=0).named_buffers() if "running" in name]
    assert len(names) == 4
    for name in names:
        assert not torch.equal(results[0]["saved"][name], results[1]["saved"][name]), name
        for rank in range(WORLD):
            assert torch.equal(results[rank]["loaded"][name], results[0]["saved"][name]), (rank, name)


def test_a_rank_that_fails_does_not_leave_the_others_waiting_forever(tmp_path):
    results = spawn("one_rank_fails", tmp_path)
    assert results[1] == "failed before backward"
    assert results[0] is not None and "averaging the gradients of slice" in results[0] and "rank 0 of 2" in results[0]


def test_a_rank_whose_backward_failed_refuses_the_next_step_and_the_others_are_told(tmp_path):
    """Its collectives are out of step with the others' (they averaged on): the next forward is
    refused, as DistributedDataParallel refuses it, instead of pairing other slices' gradients."""
    results = spawn("backward_fails_on_one_rank", tmp_path)
    assert results[1] is not None and results[1].startswith("OffloadModel: a backward of this model failed on rank 1")
    assert results[0] is not None and results[0].startswith("CollectiveError: averaging the gradients of slice")


def test_a_job_that_hangs_is_killed_at_the_deadline(tmp_path):
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"ranks \[0, 1\] of 2 were still running after 2 s"):
        spawn("hangs", tmp_path, deadline_s=2)
    assert time.monotonic() - started < 30


def test_a_process_group_needs_torch_distributed():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        OffloadModel(network(seed=0), device="cpu", process_group=object())


def test_nccl_cannot_reduce_a_cpu_model(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match="gloo group"):
        check_group(object(), torch.device("cpu"))


def test_sharding_without_a_group_is_refused():
    model = OffloadModel(network(seed=0), device="cpu", num_slices=2)
    with pytest.raises(ValueError, match="needs a process group"):
        OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, shard=True)


class RecordingBackend(StreamBackend):
    """Streams that only log the orderings asked of them; copies and device work run at once, on
    the CPU. Events are ``(stream, count)``."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.log: list[tuple] = []
        self.current = "compute"
        self.recorded = 0

    def current_stream(self):
        return self.current

    def new_stream(self, role):
        return role

    def record(self, stream):
        self.recorded += 1
        return (stream, self.recorded)

    def wait_event(self, stream, event):
        self.log.append(("wait_event", stream, event))

    def wait_stream(self, stream, other):
        self.log.append(("wait_stream", stream, other))

    def synchronize_event(self, event):
        if hasattr(event, "synchronize"):
            event.synchronize()  # a host worker's

    def synchronize_stream(self, stream):
        pass

    def copy(self, dst, src, stream, to_device):
        dst.copy_(src)
        self.log.append(("copy", stream, "to device" if to_device else "to host"))

    def mark_used(self, tensor, stream):
        self.log.append(("mark_used", stream))

    def empty_host(self, nbytes):
        return torch.empty(nbytes, dtype=torch.uint8)

    def is_pinned(self, tensor):
        return True

    @contextlib.contextmanager
    def issuing_on(self, stream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous


def test_device_averages_run_on_a_communication_stream_that_the_offload_waits_for(tmp_path, monkeypatch):
    """The NCCL path's orderings (Note: [Device collectives]), asked of a backend that records them:
    a gloo group of one process stands in for NCCL, the host for the device."""
    backend = RecordingBackend()
    reductions = []
    all_reduce = dist.all_reduce

    def recorded_all_reduce(tensor, *args, async_op=False, **kwargs):
        reductions.append((backend.current, async_op))
        return all_reduce(tensor, *args, async_op=async_op, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", recorded_all_reduce)
    monkeypatch.setattr(data_parallel, "check_group", lambda group, device: "nccl")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with using_backend(backend):
            model = OffloadModel(network(seed=0), device="cpu", num_slices=3, process_group=dist.group.WORLD)
        backend.log.clear()
        model(data(0, 1)).pow(2).mean().backward()
    finally:
        dist.destroy_process_group()
    reference = network(seed=0)
    reference(data(0, 1)).pow(2).mean().backward()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad)

    assert reductions and all(r == ("communication", True) for r in reductions)
    log = backend.log
    offloads = [k for k, entry in enumerate(log) if entry[:3] == ("copy", "offload", "to host")]
    waits = [k for k, entry in enumerate(log) if entry[:2] == ("wait_event", "offload")
             and entry[2][0] == "communication"]
    # Every slice: the communication stream waits for compute, the offload for the reduction.
    assert log.count(("wait_stream", "communication", "compute")) == 3
    assert len(waits) == 3 and all(any(w < k for k in offloads) for w in waits)
    first_offload_after = [min(k for k in offloads if k > w) for w in waits]
    assert len(set(first_offload_after)) == 3  # one wait before each slice's gradients leave
    assert log.count(("mark_used", "communication")) == len(reductions)


def test_host_averages_reduce_each_slice_in_one_collective(tmp_path, monkeypatch):
    """A slice's gradients lie side by side in one host buffer: one all-reduce covers them."""
    from offload.streams import collectives

    calls = []
    private_group = collectives.private_group

    class Counted:
        """The worker's private group, its all-reduces counted."""

        def __init__(self, group):
            self.group = private_group(group)

        def allreduce(self, tensors):
            calls.extend((t.numel(), t.dtype) for t in tensors)
            return self.group.allreduce(tensors)

        def broadcast(self, *args):
            return self.group.broadcast(*args)

    monkeypatch.setattr(collectives, "private_group", Counted)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = OffloadModel(network(seed=0), device="cpu", num_slices=3, process_group=dist.group.WORLD)
        model(data(0, 1)).pow(2).mean().backward()
    finally:
        dist.destroy_process_group()
    # Before each slice's sums, one header (int64): per parameter, the ranks with a gradient, and
    # two entries of failed forwards (Note: [A forward that raised] in offload/data_parallel.py).
    sums = [n for n, dtype in calls if dtype == torch.float32]
    counts = [n for n, dtype in calls if dtype == torch.int64]
    assert len(sums) == len(counts) == model.num_slices < len(list(model.parameters()))
    assert sum(counts) == len(list(model.parameters())) + 2 * model.num_slices
    assert sum(sums) >= sum(p.numel() for p in model.parameters())
    reference = network(seed=0)
    reference(data(0, 1)).pow(2).mean().backward()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)


def test_device_reductions_of_a_failed_backward_are_let_go_at_the_next_forward(tmp_path, monkeypatch):
    """After a failure in backward (device out of memory, say) the handles of the reductions it
    issued, which hold gradient memory, do not outlive the next forward."""
    from .stream_scenarios import Fault, Faulty

    monkeypatch.setattr(data_parallel, "check_group", lambda group, device: "nccl")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with using_backend(RecordingBackend()):
            faulty = Faulty(6)
            model = OffloadModel(nn.Sequential(faulty, nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)),
                                 device="cpu", num_slices=3, process_group=dist.group.WORLD)
        collectives = model._data_parallel.device_collectives
        faulty.fail_backward = True
        with pytest.raises(Fault):
            model(data(0, 1)).pow(2).mean().backward()
        assert collectives._in_flight, "the later slices' reductions were issued before the failure"
        faulty.fail_backward = False
        model(data(1, 1))
        assert not collectives._in_flight
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
def test_nccl_on_one_gpu_matches_one_process(tmp_path):
    (params,) = spawn("nccl_one_gpu", tmp_path, world=1, backend="nccl")
    model = network(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for step in range(3):
        model(data(step, 1)).pow(2).mean().backward()
        if step > 0:
            optimizer.step()
            optimizer.zero_grad()
    for got, want in zip(params, model.parameters()):
        torch.testing.assert_close(got.cpu(), want.detach(), **ROUNDING)



def test_sharded_update_with_the_masters_on_disk(tmp_path):
    results = spawn("sharded_masters", tmp_path)
    mine, theirs = results
    for name in ("ram", "disk", "disk-whole-batch", "ram-one-owner", "disk-one-owner"):
        for a, b in zip(mine[name]["params"], theirs[name]["params"]):
            assert torch.equal(a, b), name
        assert torch.equal(mine[name]["outputs"], theirs[name]["outputs"]), name
        assert 0 < mine[name]["owned"] < len(mine[name]["params"])
        assert mine[name]["owned"] + theirs[name]["owned"] == len(mine[name]["params"])
    # Each slice of one parameter is updated by one rank and only received by the other.
    assert mine["disk-one-owner"]["slices_only_received"] + theirs["disk-one-owner"]["slices_only_received"] == 3
    for rank in range(WORLD):
        for layout in ("", "-one-owner"):
            in_ram, on_disk = results[rank]["ram" + layout], results[rank]["disk" + layout]
            for a, b in zip(in_ram["params"], on_disk["params"]):
                assert torch.equal(a, b), layout
            assert torch.equal(in_ram["outputs"], on_disk["outputs"]), layout
        # Building took rank 0's parameters into the files, and each step's broadcasts wrote the
        # parameters other ranks own into this rank's masters: all written back and dropped.
        for name in ("disk", "disk-whole-batch", "disk-one-owner"):
            run_ = results[rank][name]
            assert run_["resident_built"] == run_["resident_synchronized"] == run_["resident_forward"] == 0, name
    # Every rank on the whole batch: the averaged gradients are one process's, and so is the update.
    model = OffloadModel(network(seed=0), device="cpu", num_slices=3, compute_dtype=torch.bfloat16)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    for step in range(3):
        model(data(step, WORLD)).float().pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
    for got, want in zip(mine["disk-whole-batch"]["params"], model.parameters()):
        assert torch.equal(got, want.detach())


def test_device_averages_reduce_a_summation_buffer_in_one_collective(tmp_path, monkeypatch):
    """Gradients side by side in one device buffer (the sums of several microbatches) are reduced by
    one NCCL call, as the host path does (a gloo group of one process stands in for NCCL)."""
    from offload.streams import CopyStreams
    from offload.streams.collectives import DeviceCollectives

    calls = []
    all_reduce = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", counted)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        collectives = DeviceCollectives(CopyStreams(torch.device("cpu")), dist.group.WORLD)
        buffer = torch.arange(20.0)
        side_by_side = [buffer[0:6].view(2, 3), buffer[8:20].view(3, 4).t()]  # a gap, a transposed layout
        alone = torch.arange(5.0)
        assert collectives.average([*side_by_side, alone]) is None
    finally:
        dist.destroy_process_group()
    assert sorted(calls) == [5, 20]
    assert torch.equal(buffer, torch.arange(20.0)) and torch.equal(alone, torch.arange(5.0))


def test_a_sharded_update_that_failed_on_one_rank_is_raised_on_every_rank_and_never_saved(tmp_path):
    """Rank 1's part of a sharded step raised in the second layer's update. It raises its
    HostUpdateError, and rank 0, which took rank 1's parameters as they were, raises one naming
    rank 1 (Note: [A failed part of a sharded update]); both go on updating every parameter (the
    update worker no longer skips rank 1's parts for good), stay equal to each other, refuse to
    save the mix, and train on from the last checkpoint, which `latest` still names."""
    results = spawn("sharded_update_fails_on_one_rank", tmp_path)
    assert "while updating slice" in results[1]["raised"]
    assert "Sharded: what this says of slices is of this rank's part" in results[1]["raised"]
    assert "another rank did not finish its part of the sharded update (rank 1 of 2: slice(s)" in results[0]["raised"]
    assert "load the last checkpoint on every rank" in results[0]["raised"]
    for result in results:
        assert all(all(moved) for moved in result["moved"]), result["moved"]
        assert "mix two steps" in result["save"]
        assert result["latest"] == "step-1"
        assert result["loaded"] and all(result["moved after load"])
    assert "rank(s) 1 of 2 did not finish their part of a sharded update" in results[0]["save"]
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)
    for a, b in zip(results[0]["params after load"], results[1]["params after load"]):
        assert torch.equal(a, b)


def test_a_save_that_one_rank_refuses_is_refused_on_every_rank(tmp_path):
    """Unsharded, rank 1's update failed part way and rank 0's did not: rank 1 refuses to save the
    mix before any collective, and rank 0, instead of waiting for it in one, raises a
    CheckpointError that names rank 1 and why; `latest` still names the last good checkpoint."""
    results = spawn("update_fails_on_one_rank", tmp_path)
    assert "raised" not in results[0] and "while updating slice" in results[1]["raised"]
    assert results[1]["save"].startswith("RuntimeError: this OffloadOptimizer's parameters and state mix two steps")
    assert results[0]["save"].startswith("CheckpointError: nothing was saved, since another rank refused: "
                                         "rank 1: RuntimeError: this OffloadOptimizer's parameters")
    for result in results:
        assert result["latest"] == "step-1"
        assert result["loaded"] and all(result["moved after load"])
    for a, b in zip(results[0]["params after load"], results[1]["params after load"]):
        assert torch.equal(a, b)


def test_a_causal_lm_accumulates_under_its_own_no_sync(tmp_path, monkeypatch):
    """``OffloadedCausalLM.no_sync()`` is its OffloadModel's: the backward inside it issues no
    average, the synced one after it averages the total, and the gradients are the plain model's."""
    transformers = pytest.importorskip("transformers")
    from offload.integrations.causal_lm import OffloadedCausalLM
    from offload.streams import collectives

    calls = []
    private_group = collectives.private_group

    class Counted:
        """The worker's private group, its all-reduces counted."""

        def __init__(self, group):
            self.group = private_group(group)

        def allreduce(self, tensors):
            calls.append(len(tensors))
            return self.group.allreduce(tensors)

        def broadcast(self, *args):
            return self.group.broadcast(*args)

    def tiny():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=32))

    monkeypatch.setattr(collectives, "private_group", Counted)
    ids = torch.randint(0, 64, (2, 2, 8), generator=torch.Generator().manual_seed(1))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = OffloadedCausalLM(tiny(), "cpu", num_slices=2, process_group=dist.group.WORLD)
        assert model.process_group is model.offloaded.process_group is not None
        with model.no_sync():
            model(input_ids=ids[0], labels=ids[0]).loss.backward()
        assert calls == []
        model(input_ids=ids[1], labels=ids[1]).loss.backward()
        assert calls
    finally:
        dist.destroy_process_group()
    reference = tiny()
    for batch in ids:
        reference(input_ids=batch, labels=batch).loss.backward()
    got = dict(model.hf_model.named_parameters())
    for name, want in reference.named_parameters():
        torch.testing.assert_close(got[name].grad, want.grad, rtol=0, atol=0)
