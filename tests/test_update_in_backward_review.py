"""Review of OffloadOptimizer(update_in_backward=True): cases beside the specification in
tests/test_update_in_backward.py where the option once differed from training without it (Note:
[Update in backward] in ``offload/optimizing/in_backward.py``)."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch

from offload import OffloadModel, OffloadOptimizer
from offload.optimizing.in_backward import BackwardUpdates

from .test_optimizer import batch, network

pytestmark = pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")

NUM_SLICES = 3


def _collected(ref: weakref.ref, seconds: float = 5.0) -> bool:
    """Whether ``ref``'s object goes once collected; the update worker may hold its last task a
    moment after it finished."""
    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        if ref() is None or time.monotonic() > deadline:
            return ref() is None
        time.sleep(0.01)


@pytest.mark.parametrize("update_in_backward", [False, True])
def test_an_optimizer_dropped_while_the_model_lives_is_freed(update_in_backward):
    """The model's walk holds the subscriber that starts updates from backward; were it to hold
    the optimizer, the optimizer and its state (two float32 copies of the model for AdamW) would
    live as long as the model."""
    model = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, update_in_backward=update_in_backward)
    for step in range(2):
        model(batch(step)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    ref = weakref.ref(optimizer)
    del optimizer
    assert _collected(ref)
    # ... and its subscriber goes with it: it holds the update worker.
    assert not [s for s in model._engine.milestones.subscribers if isinstance(s, BackwardUpdates)]
    # The model trains on with a new optimizer.
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, update_in_backward=update_in_backward)
    for step in range(2):
        model(batch(step)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
