"""Data-parallel checkpoints whose ranks name different things: a save with another path on each
rank (or ranks that share no filesystem) and a load of another checkpoint on each rank are refused
on every rank, in time, with nothing written, committed, deleted or loaded
(``checkpoint_rank_workers.py`` runs the ranks)."""

from __future__ import annotations

import json
import uuid

import torch.multiprocessing as mp

from offload import load_checkpoint

from .checkpoint_rank_workers import TIMEOUT_S, network
from .helpers import join_or_kill

#: Seconds a job's ranks get before they are killed and the test fails.
DEADLINE_S = 120

# Ranks fork from a server that imported these once (see test_distributed.py).
mp.set_forkserver_preload(["torch", "torch._dynamo", "tests.checkpoint_rank_workers"])


def spawn(job: str, tmp_path) -> list[dict]:
    """Run ``job`` on two ranks; what each returned."""
    from . import checkpoint_rank_workers

    ranks = mp.start_processes(checkpoint_rank_workers.run, args=(2, str(tmp_path), job, f"store-{uuid.uuid4().hex}"),
                               nprocs=2, join=False, start_method="forkserver")
    join_or_kill(ranks, DEADLINE_S, f"job {job!r}")
    return [json.loads((tmp_path / f"{job}.{rank}.json").read_text()) for rank in range(2)]


def assert_refused_in_time(outcome: dict, *phrases: str) -> None:
    assert outcome["raised"] == "CheckpointError", outcome
    assert outcome["seconds"] < TIMEOUT_S / 2, outcome  # told by the other rank, not timed out waiting for it
    for phrase in phrases:
        assert phrase in outcome["message"], (phrase, outcome["message"])


def assert_only_step_1(tmp_path) -> None:
    """The first checkpoint is all there is, ``latest`` names it, and it loads whole."""
    directory = tmp_path / "ckpt"
    assert sorted(entry.name for entry in directory.iterdir()) == ["latest", "step-1"]
    assert (directory / "latest").read_text() == "step-1"
    assert load_checkpoint(directory / "step-1", network()) == {"step": 1}


def test_a_save_with_another_path_on_each_rank_is_refused_before_anything_is_written(tmp_path):
    """Each rank passes ckpt/step-2-rank<r> (keep_last=1): before the fix, rank 0 committed a
    checkpoint without rank 1's file, moved latest to it and deleted step-1 for keep_last."""
    outcomes = spawn("save_on_other_paths", tmp_path)
    for rank, outcome in enumerate(outcomes):
        assert_refused_in_time(outcome, f"cannot save checkpoint {tmp_path / 'ckpt' / f'step-2-rank{rank}'}: the "
                                        "ranks were given different paths",
                               f"rank 0: {tmp_path.resolve() / 'ckpt' / 'step-2-rank0'}; "
                               f"rank 1: {tmp_path.resolve() / 'ckpt' / 'step-2-rank1'}",
                               "Nothing was written", "Pass the same path on every rank")
    assert outcomes[0]["message"].partition(":")[2] == outcomes[1]["message"].partition(":")[2]
    assert_only_step_1(tmp_path)  # no partial directory of either rank either


def test_a_save_whose_ranks_share_no_filesystem_is_removed_and_refused_on_every_rank(tmp_path):
    """One path on both ranks, but rank 1's files land where rank 0 does not see them: rank 0 finds
    them missing before the commit, removes what it wrote, rank 1 what it wrote, and both raise;
    step-1 is neither replaced as latest nor deleted for keep_last."""
    outcomes = spawn("save_without_a_shared_filesystem", tmp_path)
    for outcome in outcomes:
        assert_refused_in_time(outcome, f"could not save checkpoint {tmp_path / 'ckpt' / 'step-2'}: rank 0, which "
                                        "commits it, does not find rank 1's __1_0.distcp in",
                               "the ranks do not see one filesystem there",
                               f"the previous checkpoint, {tmp_path / 'ckpt' / 'step-1'}, is intact",
                               "Save on every rank to a directory they all see")
    assert outcomes[0]["message"] == outcomes[1]["message"]
    assert outcomes[1]["left on rank 1's disk"] == []
    assert_only_step_1(tmp_path)


def test_a_load_of_another_checkpoint_on_each_rank_is_refused_before_anything_is_loaded(tmp_path):
    """Rank 0 loads step-1 and rank 1 step-2, and then both step-2 by one path that holds step-1 on
    rank 1's filesystem: refused on both ranks, naming each rank's checkpoint, the model and
    optimizer untouched. A copy of step-2 elsewhere is the same checkpoint: it loads."""
    outcomes = spawn("load_other_checkpoints", tmp_path)
    step_1, step_2 = tmp_path.resolve() / "ckpt" / "step-1", tmp_path.resolve() / "ckpt" / "step-2"
    for rank, outcome in enumerate(outcomes):
        assert_refused_in_time(outcome["other paths"], "the ranks were given different checkpoints",
                               f"(rank 0: {step_1}, saved ", f"; rank 1: {step_2}, saved ", "Nothing was loaded",
                               "Pass the same checkpoint on every rank")
        assert_refused_in_time(outcome["one path"], f"cannot load checkpoint {tmp_path / 'ckpt' / 'step-2'}: the ranks "
                                                    "were given different checkpoints",
                               f"(rank 0: {step_2}, saved ", f"; rank 1: {step_1}, saved ")
        assert outcome["unchanged by the refusals"], rank
        assert outcome["a copy"]["raised"] is None, outcome["a copy"]
        assert outcome["a copy"]["result"] == {"step": 2}
        assert outcome["loaded alike"] and outcome["loaded the saved model"], rank
