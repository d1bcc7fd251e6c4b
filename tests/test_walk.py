"""The slice walk on its own: order, prefetch, leaving a slice, the end and the failure path.

See Note: [The walk] in ``offload/walk/slice_walk.py``. The walks' effect on results (buffers written back,
recomputes exact, failures leaving the plain model's state) is tested through the model in
``test_semantics.py``, ``test_faults.py`` and ``test_streamcheck.py``.
"""

import pytest
import torch
from torch import nn

from offload import OffloadModel
from offload.model import engine_of
from offload.streams.slot import SlotState
from offload.walk.slice_walk import SliceWalk


def _engine(num_slices):
    torch.manual_seed(0)
    model = OffloadModel(nn.Sequential(*[nn.Linear(4, 4) for _ in range(num_slices)]), device="cpu",
                         num_slices=num_slices)
    return engine_of(model)


def test_a_forward_walk_visits_every_slice_and_loads_the_next_on_acquiring_when_it_is_only_a_copy(monkeypatch):
    engine = _engine(4)
    prefetched = []
    prefetch = engine.slots.prefetch
    monkeypatch.setattr(engine.slots, "prefetch", lambda index: (prefetched.append(index), prefetch(index)))
    seen = []
    with SliceWalk.forward(engine) as walk:
        for index, views in walk:
            seen.append(index)
            assert len(views) == len(engine.slices[index].storage.entries)
            assert engine.slots.loads == min(index + 2, 4)  # the next slice's load issued before this one's compute
            walk.compute_queued()
            walk.compute_queued()  # a second microbatch: nothing more to prefetch
            assert engine.slots.loads == min(index + 2, 4)
        walk.finish()
    assert seen == [0, 1, 2, 3]
    assert prefetched == [0, 1, 1, 1, 2, 2, 2, 3, 3, 3]  # each acquire, the next slice, the first compute's no-op


class _PendingUpdate:
    """An update's event, not done until the walk waits for it."""

    def __init__(self) -> None:
        self.waited = False

    def query(self) -> bool:
        return self.waited

    def synchronize(self) -> None:
        self.waited = True


def test_a_forward_walk_loads_a_slice_whose_update_is_not_done_once_the_first_compute_is_queued():
    # Note: [The walk], step 2: waiting for the update then overlaps compute already queued.
    engine = _engine(4)
    update = _PendingUpdate()
    engine.updates.submitted(2, update)
    with SliceWalk.forward(engine) as walk:
        for index, _ in walk:
            if index == 1:
                assert engine.slots.loads == 2 and not update.waited
            walk.compute_queued()
            if index == 1:
                assert engine.slots.loads == 3 and update.waited
        walk.finish()
    assert not engine.updates.pending()


def test_a_backward_walk_loads_the_next_slice_once_the_first_compute_is_queued():
    # Its boundary activations' loads would queue behind the next slice's on the load stream.
    engine = _engine(4)
    with SliceWalk.backward(engine, lowest=0) as walk:
        for index, _ in walk:
            loads = engine.slots.loads
            walk.compute_queued()
            assert engine.slots.loads == loads + (index > 0)
        walk.finish()


def test_a_backward_walk_goes_from_the_last_slice_down_to_the_lowest():
    engine = _engine(4)
    with SliceWalk.backward(engine, lowest=1) as walk:
        seen = [index for index, _ in walk]
        walk.finish()
    assert seen == [3, 2, 1]
    with SliceWalk.backward(engine, lowest=4) as walk:
        assert [index for index, _ in walk] == []
        walk.finish()


@pytest.mark.parametrize("restored", [False, True])
def test_a_slot_whose_buffers_were_restored_is_loaded_again(restored):
    engine = _engine(2)
    with SliceWalk.forward(engine) as walk:
        for index, _ in walk:
            walk.compute_queued()
        walk.finish()
    # Both slices are in the slots now; a backward walk does not reload a current one.
    with SliceWalk.backward(engine, lowest=0) as walk:
        for index, _ in walk:
            if index == 1 and restored:
                walk.buffers_restored()
        walk.finish()
    states = {slot.slice_index: slot.state for slot in engine.slots._slots}
    assert states[1] is (SlotState.STALE if restored else SlotState.CURRENT)
    loads = engine.slots.loads
    with SliceWalk.backward(engine, lowest=1) as walk:
        for _ in walk:
            pass
        walk.finish()
    assert engine.slots.loads == loads + restored


def test_a_walk_left_without_its_end_is_an_internal_error():
    engine = _engine(2)
    with pytest.raises(RuntimeError, match="internal error in the slice walk: left without finish"):
        with SliceWalk.forward(engine) as walk:
            for _ in walk:
                walk.compute_queued()


def test_a_failure_inside_a_walk_reaches_the_caller_and_leaves_no_slot_held():
    engine = _engine(3)
    with pytest.raises(ValueError, match="inside slice 1"):
        with SliceWalk.forward(engine) as walk:
            for index, _ in walk:
                walk.compute_queued()
                if index == 1:
                    raise ValueError("inside slice 1")
    assert all(slot.state is SlotState.EMPTY and not slot.in_use for slot in engine.slots._slots)
    with SliceWalk.forward(engine) as walk:  # the next walk loads every slice afresh
        assert [index for index, _ in walk] == [0, 1, 2]
        walk.finish()
