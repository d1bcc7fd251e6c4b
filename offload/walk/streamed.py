"""Forward without autograd: under ``torch.no_grad()`` / ``torch.inference_mode()``, or when
nothing requires grad.

Slices stream through the device slots exactly as in a training forward (the same
:class:`~offload.walk.slice_walk.SliceWalk`), but nothing is kept for backward: no boundary activations, no
generator states, no graphs.
"""

from __future__ import annotations

from typing import Any

from torch.utils._pytree import TreeSpec

from .engine import Engine
from ..streams.labels import label
from .microbatch import join_outputs, split_leaves
from .slice_walk import SliceWalk
from .structures import flatten, unflatten


def streamed_forward(engine: Engine, leaves: list[Any], spec: TreeSpec, num_microbatches: int) -> Any:
    """Run every slice over every microbatch and return the joined output structure."""
    microbatches, split = split_leaves(leaves, num_microbatches)
    with SliceWalk.forward(engine) as walk:
        boundary = [(walk.load_inputs(mb), spec) for mb in microbatches]
        for i, views in walk:
            s = engine.slices[i]
            next_boundary = []
            for in_leaves, in_spec in boundary:
                with label(f"offload::forward slice {i}"):
                    result = s.run_on_device(engine.slots, s.entry_tensors(views), unflatten(list(in_leaves), in_spec))
                if result.buffers_changed:
                    walk.buffers_changed()
                next_boundary.append(flatten(result.output, f"slice {i}'s output"))
                walk.compute_queued()
            boundary = next_boundary
        walk.finish()
    joined = join_outputs([out_leaves for out_leaves, _ in boundary], split.sizes)
    return unflatten(joined, boundary[0][1])
