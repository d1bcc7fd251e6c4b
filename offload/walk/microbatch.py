"""Splitting a batch into microbatches and joining the results back.

A batch is any nested structure (tensor, tuple, list, dict) that flattens into leaves. The batch
size is dim 0 of the first tensor leaf that has a dim 0. A tensor leaf *carries the batch* when
its dim 0 has exactly that size; those leaves are cut along dim 0, every other leaf (a shared
mask, a config value) goes whole to every microbatch.

Nothing here moves data between devices.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Split:
    """How one batch was cut.

    Attributes:
        sizes: rows in each microbatch; one entry when the batch was not cut.
        carries_batch: for each flattened leaf, whether it was cut along dim 0.
    """

    sizes: tuple[int, ...]
    carries_batch: tuple[bool, ...]

    @property
    def count(self) -> int:
        return len(self.sizes)


def batch_size(leaves: Sequence[Any]) -> int | None:
    """Dim 0 of the first tensor leaf that has one, or None."""
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return int(leaf.shape[0])
    return None


def split_leaves(leaves: Sequence[Any], num_microbatches: int) -> tuple[list[list[Any]], Split]:
    """Cut flattened batch leaves into at most ``num_microbatches`` microbatches.

    A batch with fewer rows than ``num_microbatches`` is cut into one microbatch per row; a batch
    with no tensor that has a dim 0 is not cut. Microbatch sizes differ by at most one row.

    Returns:
        The leaves of each microbatch (views of the input, no copies), and the :class:`Split`.
    """
    rows = batch_size(leaves)
    carries = tuple(
        isinstance(leaf, torch.Tensor) and leaf.dim() >= 1 and rows is not None and leaf.shape[0] == rows
        for leaf in leaves
    )
    if rows is None or num_microbatches == 1 or rows <= 1:
        return [list(leaves)], Split((rows if rows is not None else 0,), carries)
    count = min(num_microbatches, rows)
    sizes = tuple(rows // count + (1 if m < rows % count else 0) for m in range(count))
    per_leaf = [
        torch.split(leaf, sizes, dim=0) if cut else [leaf] * count for leaf, cut in zip(leaves, carries)
    ]
    return [[chunks[m] for chunks in per_leaf] for m in range(count)], Split(sizes, carries)


def join_outputs(outputs: Sequence[Sequence[Any]], sizes: Sequence[int],
                 leave_out: Collection[int] = ()) -> list[Any]:
    """Join the flattened outputs of each microbatch into the outputs of the whole batch.

    Tensor leaves that carry each microbatch's rows are concatenated along dim 0; non-tensor leaves
    are taken from the first microbatch. With one microbatch nothing is joined. Positions in
    ``leave_out`` (outputs rebuilt from another one: Note: [Outputs that alias each other] in
    ``offload/autograd/call.py``) are ``None``.

    Raises:
        ValueError: with several microbatches, a tensor output does not carry the batch dimension,
            so there is no way to join it.
    """
    if len(outputs) == 1:
        return [None if position in leave_out else leaf for position, leaf in enumerate(outputs[0])]
    joined: list[Any] = []
    for position, per_microbatch in enumerate(zip(*outputs)):
        if position in leave_out or not isinstance(per_microbatch[0], torch.Tensor):
            joined.append(None if position in leave_out else per_microbatch[0])
            continue
        if not all(t.dim() >= 1 and t.shape[0] == rows for t, rows in zip(per_microbatch, sizes)):
            raise ValueError(
                f"output leaf {position} (shape {tuple(per_microbatch[0].shape)}) does not carry the "
                f"batch dimension (microbatch sizes {list(sizes)}), so it cannot be joined across "
                "microbatches; use num_microbatches=1 or return only per-row tensors from the last layer"
            )
        joined.append(torch.cat(per_microbatch, dim=0))
    return joined


def view_in_joined(bases: Sequence[torch.Tensor], views: Sequence[torch.Tensor], joined: torch.Tensor,
                   ) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
    """Where the view each microbatch's output leaf takes of its base (``views`` of ``bases``) lies
    in the joined base: size, stride, and storage offset from the joined base's; ``None`` where it
    does not carry over.

    With several microbatches the view carries over only where each microbatch's base is laid out
    as ``joined`` and the view keeps all of its rows with its dim-0 stride, the rest alike in every
    microbatch (Note: [Outputs that alias each other] in ``offload/autograd/call.py``, rule 3).
    """
    first = views[0]
    offsets = [v.storage_offset() - b.storage_offset() for v, b in zip(views, bases)]
    if len(views) == 1:
        return tuple(first.shape), first.stride(), offsets[0]
    carries = all(
        b.stride() == joined.stride() and v.dim() >= 1 and v.shape[0] == b.shape[0] and v.stride(0) == b.stride(0)
        and v.shape[1:] == first.shape[1:] and v.stride() == first.stride() and offset == offsets[0]
        for v, b, offset in zip(views, bases, offsets)
    )
    if not carries:
        return None
    return (int(joined.shape[0]), *first.shape[1:]), first.stride(), offsets[0]


def split_like(leaf: torch.Tensor | None, sizes: Sequence[int]) -> list[torch.Tensor | None]:
    """Cut a gradient of a joined output tensor back into per-microbatch gradients.

    With one microbatch nothing was joined, whatever the output's dim 0 (e.g. rows of B*T); with
    several, :func:`join_outputs` concatenated every tensor output along dim 0.
    """
    if leaf is None:
        return [None] * len(sizes)
    if len(sizes) == 1:
        return [leaf]
    return list(torch.split(leaf, list(sizes), dim=0))


def join_input_grads(grads: Sequence[torch.Tensor | None], rows: Sequence[int], was_split: bool,
                     trailing_shape: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
    """Join per-microbatch gradients of one input leaf.

    A leaf that was cut gets its microbatch gradients concatenated (zeros where a microbatch gave
    none); a leaf that went whole to every microbatch gets their sum.
    """
    if all(g is None for g in grads):
        return None
    if not was_split:
        total: torch.Tensor | None = None
        for g in grads:
            if g is not None:
                total = g if total is None else total + g
        return total
    parts = [
        g if g is not None else torch.zeros((n, *trailing_shape), dtype=dtype, device=_device_of(grads))
        for g, n in zip(grads, rows)
    ]
    return torch.cat(parts, dim=0)


def _device_of(grads: Sequence[torch.Tensor | None]) -> torch.device:
    return next(g.device for g in grads if g is not None)
