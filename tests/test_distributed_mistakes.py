"""Mistakes of a data-parallel run that went silent or gave poor errors: each now raises an error
that says what went wrong and what to do. The multi-process ones run in one spawned group of two
gloo processes (``dist_mistake_workers.py``), each mistake on a group with a short timeout."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
import torch.multiprocessing as mp

from offload import OffloadModel

from .dist_workers import data, network

WORLD = 2
#: Seconds the ranks get before they are killed and the test fails: the mistakes take a few
#: timeouts of dist_mistake_workers.SHORT_S each, far less even on a loaded machine.
DEADLINE_S = 150

mp.set_forkserver_preload(["torch", "torch._dynamo", "tests.dist_workers", "tests.dist_mistake_workers"])


@pytest.fixture(scope="module")
def mistakes(tmp_path_factory) -> list[dict]:
    """What each rank saw of every mistake (one spawn for all of them: each costs seconds of imports)."""
    from . import dist_mistake_workers

    directory = tmp_path_factory.mktemp("mistakes")
    ranks = mp.start_processes(dist_mistake_workers.run, args=(WORLD, str(directory)), nprocs=WORLD, join=False,
                               start_method="forkserver")
    deadline = time.monotonic() + DEADLINE_S
    while not ranks.join(timeout=max(deadline - time.monotonic(), 0.0)):  # raises as soon as one rank fails
        if time.monotonic() >= deadline:
            for process in ranks.processes:
                if process.is_alive():
                    process.kill()
                process.join()
            pytest.fail(f"the ranks were still running after {DEADLINE_S} s and were killed")
    return [torch.load(os.path.join(directory, f"mistakes.{rank}.pt"), weights_only=False) for rank in range(WORLD)]


@pytest.mark.parametrize("case, name", [("same_slice", "2.bias"), ("whole_slice", "0.weight")])
def test_ranks_that_change_requires_grad_differently_are_told_on_every_rank(mistakes, case, name):
    """Frozen after construction on one rank only: every rank raises, naming the parameter, before
    any sum (Note: [Ranks that disagree on requires_grad]): neither gradients summed as another
    parameter's nor a process aborted by gloo."""
    for rank in range(WORLD):
        said = mistakes[rank][case]
        assert said.startswith("CollectiveError: the ranks disagree on which parameters get gradients"), said
        assert f"1 of 2 ranks compute one for {name}" in said and "every rank must change it the same way" in said


def test_a_forward_that_raised_on_one_rank_is_told_on_every_rank(mistakes):
    """The out-of-memory skip on one rank: the others went on to that step's backward, so the next
    backward's headers carry other counts of failed forwards, and every rank raises before any sum
    instead of pairing other steps' gradients (Note: [A forward that raised])."""
    first, second = mistakes[1]["forward_fails"]
    assert first.startswith("RuntimeError") and "mat1 and mat2" in first
    told = "CollectiveError: a forward of this model (with autograd, outside no_sync()) raised on some ranks and not"
    assert second.startswith(told), second
    assert "1 so far on rank 1, 1 on the 2 ranks together" in second
    assert mistakes[0]["forward_fails"][0].startswith(told), mistakes[0]["forward_fails"]
    assert mistakes[0]["forward_fails"][1].startswith("CollectiveError: OffloadModel: a backward of this model failed")


def test_a_forward_that_raised_on_every_rank_alike_leaves_them_in_step(mistakes):
    for rank in range(WORLD):
        first, second = mistakes[rank]["forward_fails_everywhere"]
        assert first.startswith("RuntimeError") and "mat1 and mat2" in first
        assert second == "ok"


def test_a_state_read_on_one_rank_before_the_first_step_compares_nothing(mistakes):
    """The plan the read makes is compared with the other ranks' at the step, which every rank calls."""
    assert [mistakes[rank]["state_read_alone"] for rank in range(WORLD)] == ["stepped"] * WORLD


def test_ranks_whose_sharded_optimizers_differ_are_told_so(mistakes):
    for rank in range(WORLD):
        said = mistakes[rank]["other_groups"]
        assert said.startswith("ValueError: the sharded OffloadOptimizer of rank"), said
        assert "every rank must pass the same parameter groups" in said and "in slice 0: " in said
    said = mistakes[0]["plain_on_one_rank"]  # rank 1 steps a plain SGD: rank 0 waits in vain for it
    assert said.startswith("CollectiveError: comparing the sharded OffloadOptimizer's plan"), said
    assert "not a plain torch.optim optimizer on some ranks" in said
    # The same wait where one rank's backward was synced and another's was not (no_sync() on one rank).
    assert "every rank must run the same synced backwards (no_sync() around the same ones)" in said


@pytest.mark.parametrize("name, called", [("save_alone", "save_checkpoint"), ("load_alone", "load_checkpoint")])
def test_a_checkpoint_called_on_rank_0_alone_says_every_rank_must_call_it(mistakes, name, called):
    said = mistakes[0][name]
    assert said.startswith(f"CheckpointError: {called} is collective: every rank of the process group must call it"), said
    assert name not in mistakes[1]


def test_pytorchs_data_parallel_wrappers_are_refused_with_process_group_as_the_advice(tmp_path):
    with pytest.raises(TypeError, match=r"got a DataParallel \(DataParallel\).*process_group=torch.distributed"):
        OffloadModel(nn.DataParallel(network(seed=0)), device="cpu")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with pytest.raises(TypeError, match=r"DistributedDataParallel.*docs/distributed.md.*around the OffloadModel"):
            OffloadModel(nn.parallel.DistributedDataParallel(network(seed=0)), device="cpu")
        # The other way round works: DistributedDataParallel around an OffloadModel.
        wrapped = nn.parallel.DistributedDataParallel(OffloadModel(network(seed=0), device="cpu", num_slices=2))
        wrapped(data(0, 1)).pow(2).mean().backward()
        assert all(p.grad is not None for p in wrapped.parameters())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case, doing", [("bad_argument", "making its private gloo group"),
                                         ("structure", "comparing its structure with rank 0's"),
                                         ("broadcast", "taking rank 0's parameters and buffers")])
def test_a_rank_that_fails_while_building_leaves_the_others_an_error_that_says_so(mistakes, case, doing):
    """Rank 1 raised while building its data-parallel model, before one of the collectives that
    building issues: rank 0 waits the group's timeout, then raises a CollectiveError that says what
    it waited for and where to look, not gloo's bare "Wait timeout"."""
    said = mistakes[0][f"construction_{case}"]
    assert said.startswith("CollectiveError: building the data-parallel OffloadModel waited for the other ranks of "
                           f"its process group and failed on rank 0 of 2, {doing}: "), said
    assert "Every rank of the group must build the same data-parallel OffloadModel on it, in the same order" in said
    assert "another rank probably failed or stopped first: look at its error" in said
    own = mistakes[1][f"construction_{case}"]
    assert own.startswith("ValueError: compute_dtype must be" if case == "bad_argument"
                          else "ValueError: rank 1 failed here"), own
    assert mistakes[0][f"construction_{case}_s"] < 60  # the short group's timeout, not the default 30 minutes


def test_gradient_hooks_of_a_data_parallel_model_see_the_average_and_are_warned_of(mistakes):
    """Note: [Gradient hooks see the average]: the hook gets the same average on every rank, and the
    first synced backward with a hooked parameter warns once, naming them; neither a backward
    without hooks nor one under no_sync() (local gradients) warns."""
    average = (mistakes[0]["hooks_local"] + mistakes[1]["hooks_local"]) / 2
    for rank in range(WORLD):
        torch.testing.assert_close(mistakes[rank]["hooks_seen_synced"], average, rtol=0, atol=0)
        unhooked, under_no_sync, first, second = mistakes[rank]["hooks_warned"]
        assert unhooked == [] and under_no_sync == [] and second == [], mistakes[rank]["hooks_warned"]
        assert len(first) == 1 and first[0].startswith(
            "OffloadModel(process_group=...): the gradient hooks of 2.weight, 4.bias (register_hook, "), first
        assert "build the OffloadModel without process_group and wrap it in DistributedDataParallel" in first[0]


def test_ddp_around_an_offload_model_gives_hooks_the_local_gradient_as_ddp_does(mistakes):
    """What the warning advises: a hook on a parameter of DistributedDataParallel(OffloadModel(...))
    sees this rank's own gradient, and a clamping hook trains exactly as under DDP over the layers."""
    for rank in range(WORLD):
        local = mistakes[rank]["hooks_local"]
        seen_ddp, said_ddp, grads_ddp = mistakes[rank]["hooks_ddp"]
        seen, said, grads = mistakes[rank]["hooks_ddp_offload"]
        assert len(seen) == len(seen_ddp) == 1 and said == said_ddp == []
        torch.testing.assert_close(seen_ddp[0], local, rtol=0, atol=0)
        torch.testing.assert_close(seen[0], local, rtol=0, atol=0)
        for theirs, ours in zip(grads_ddp, grads, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert not torch.equal(mistakes[0]["hooks_local"], mistakes[1]["hooks_local"])  # the ranks' batches differ


def test_buffers_of_dtypes_gloo_cannot_send_are_taken_from_rank_0_bit_for_bit(mistakes):
    zero = mistakes[0]["odd_buffers"]
    assert len(zero) == 8, mistakes[0].get("buffers_gloo_cannot_send")
    assert zero["0.scalar"].item() == 5 and zero["0.scalar"].dtype == torch.int16
    for name, tensor in mistakes[1]["odd_buffers"].items():
        assert tensor.dtype == zero[name].dtype
        assert torch.equal(tensor.reshape(-1).view(torch.uint8), zero[name].reshape(-1).view(torch.uint8)), name
