"""Forward without autograd: under ``torch.no_grad()`` / ``torch.inference_mode()``, or when
nothing requires grad.

Slices stream through the device slots exactly as in a training forward, but nothing is kept for
backward: no boundary activations, no generator states, no graphs.
"""

from __future__ import annotations

from typing import Any

from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from .engine import Engine
from .labels import label
from .microbatch import join_outputs, split_leaves
from .streams import Event


def streamed_forward(engine: Engine, leaves: list[Any], spec: TreeSpec, num_microbatches: int) -> Any:
    """Run every slice over every microbatch and return the joined output structure."""
    microbatches, split = split_leaves(leaves, num_microbatches)
    boundary = [(engine.to_device(mb), spec) for mb in microbatches]
    buffer_events: list[Event | None] = []
    engine.slots.forget_contents()
    acquired: int | None = None  # the slice running now, if any
    try:
        for i in range(engine.num_slices):
            views = engine.slots.acquire(i)
            acquired = i
            changed = False
            next_boundary = []
            for m, (in_leaves, in_spec) in enumerate(boundary):
                with label(f"offload::forward slice {i}"):
                    result = engine.run_slice(i, engine.entry_tensors(i, views), tree_unflatten(list(in_leaves), in_spec))
                changed |= result.buffers_changed
                next_boundary.append(tree_flatten(result.output))
                if m == 0 and i + 1 < engine.num_slices:
                    # Once this slice's first compute is queued, so a load's CPU work overlaps it.
                    engine.slots.prefetch(i + 1)
            if changed:
                buffer_events.append(engine.slots.write_back_buffers(i))
            engine.slots.release(i)
            acquired = None
            boundary = next_boundary
        # Buffers are host state the caller may read as soon as this returns, and host copies the
        # loads read may be overwritten right after it (rule 4 of [Copy ordering]).
        engine.copies.wait_host_all(buffer_events)
        engine.copies.wait_loads_done()
    except BaseException:
        if acquired is not None:
            engine.keep_buffers_of_failed_run(acquired)
        engine.slots.invalidate()
        raise
    joined = join_outputs([out_leaves for out_leaves, _ in boundary], split.sizes)
    return tree_unflatten(joined, boundary[0][1])
