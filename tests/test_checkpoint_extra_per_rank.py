"""Each rank's ``extra`` is its own (Note: [Extra per rank] in offload/checkpoint/contents.py): a
data-parallel checkpoint gives each rank back the one it saved, writes one that every rank passed
once, and, resumed on another number of ranks, gives rank 0's with a warning when the ranks saved
different values (silently when they saved the same). A checkpoint of the layout earlier releases
wrote (every rank's under one key, of which DCP kept one) loads as before. One spawn of two ranks
(``checkpoint_rank_workers.py``) writes them all; this process resumes on one."""

from __future__ import annotations

import warnings

import pytest

from offload import load_checkpoint

from .checkpoint_rank_workers import network
from .test_checkpoint_rank_paths import spawn


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The checkpoints ``own``, ``same`` and ``old`` under ``ckpt``, and what each rank saw."""
    directory = tmp_path_factory.mktemp("extra-per-rank")
    return directory, spawn("save_extra_per_rank", directory)


def load_on_one_process(path) -> tuple[object, list[str]]:
    """What a load of ``path`` in this process (no process group) returns, and what it warns."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # DCP's word that it loads without a process group, which offload filters (ranks.py); "always" lets it through.
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
        loaded = load_checkpoint(path, network())
    return loaded, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def test_each_rank_loads_the_extra_it_saved(saved):
    """Before the fix, both ranks offered theirs under ``extra`` and DCP kept rank 1's: rank 0
    loaded ``{"rank": 1, ...}``, silently."""
    _, outcomes = saved
    for rank, outcome in enumerate(outcomes):
        own = outcome["own"]
        assert own["loaded"] == {"rank": rank, "position": [10 * rank, rank]}, rank
        assert own["warned"] == [] and own["keys"] == ["extra", "extra/1"]
    # Each rank's extra is written: the room check counts both.
    assert [o["own"]["counted"] for o in outcomes] == [sum(o["own"]["pickled"] for o in outcomes)] * 2


def test_an_extra_the_same_on_every_rank_is_written_once_and_loads_on_every_rank(saved):
    _, outcomes = saved
    for outcome in outcomes:
        same = outcome["same"]
        assert same["loaded"] == {"step": 1, "seen": [0, 1, 2]} and same["warned"] == []
        assert same["keys"] == ["extra"]  # as a save before per-rank extras wrote it
        assert same["counted"] == outcomes[0]["same"]["pickled"]


def test_a_resume_on_another_number_of_ranks_gets_rank_0s_extra_warning_when_the_ranks_saved_different_ones(saved):
    directory, _ = saved
    loaded, warned = load_on_one_process(directory / "ckpt" / "own")
    assert loaded["rank"] == 0 and loaded["position"].tolist() == [0, 0]
    assert len(warned) == 1, warned
    assert warned[0].startswith(f"checkpoint {directory / 'ckpt' / 'own'} was saved on 2 ranks whose extra values "
                                "differ (rank 1 saved another value than rank 0), and is loaded on 1: load_checkpoint "
                                "returns rank 0's extra on every rank."), warned[0]
    loaded, warned = load_on_one_process(directory / "ckpt" / "same")
    assert loaded["step"] == 1 and loaded["seen"].tolist() == [0, 1, 2] and warned == []


def test_a_checkpoint_with_every_ranks_extra_under_one_key_loads_as_before(saved):
    """The layout of releases before per-rank extras: each rank offered its extra as ``extra``,
    DCP kept one; every rank, and a resume on one process, loads that one, silently (the checkpoint
    does not say whether the ranks' differed)."""
    directory, outcomes = saved
    kept = outcomes[0]["old"]["loaded"]
    assert kept in ({"rank": 0}, {"rank": 1})
    for outcome in outcomes:
        assert outcome["old"]["loaded"] == kept and outcome["old"]["warned"] == []
        assert outcome["old"]["keys"] == ["extra"]
    assert load_on_one_process(directory / "ckpt" / "old") == (kept, [])
