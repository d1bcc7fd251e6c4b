"""How a sequence of layers is cut into slices.

This file holds the partition rule only: it looks at sizes and returns index ranges. It does not
move, copy or pin anything.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def layer_nbytes(layer: nn.Module) -> int:
    """Bytes a layer's parameters and buffers occupy, each tensor counted once (tied weights)."""
    seen: set[int] = set()
    total = 0
    for tensor in _tensors_of(layer):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def _tensors_of(layer: nn.Module) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    for module in layer.modules():
        tensors.extend(p for p in module._parameters.values() if p is not None)
        tensors.extend(b for b in module._buffers.values() if b is not None)
    return tensors


def partition(layer_bytes: Sequence[int], num_slices: int) -> list[range]:
    """Cut layers ``0..n-1`` into ``min(num_slices, n)`` contiguous, non-empty ranges.

    The largest slice sets the size of the device slots, so the cut minimises the largest slice's
    bytes. Among cuts that reach that minimum it fills slices from the front, keeping at least
    one layer for every slice still to come, so no slice is ever empty.

    Args:
        layer_bytes: bytes of each layer, in order.
        num_slices: requested number of slices; clamped to the number of layers.

    Raises:
        ValueError: if there are no layers or ``num_slices < 1``.

    Example::

        >>> partition([4, 4, 4, 4], 2)
        [range(0, 2), range(2, 4)]
    """
    n = len(layer_bytes)
    if n == 0:
        raise ValueError("cannot partition an empty sequence of layers")
    if num_slices < 1:
        raise ValueError(f"num_slices must be at least 1, got {num_slices}")
    k = min(num_slices, n)
    cap = _smallest_feasible_cap(layer_bytes, k)

    ranges: list[range] = []
    start = 0
    for slices_left in range(k, 0, -1):
        if slices_left == 1:
            ranges.append(range(start, n))
            break
        end = start + 1  # every slice holds at least one layer
        size = layer_bytes[start]
        # Grow while the cap allows and enough layers remain for the slices after this one.
        while end < n - (slices_left - 1) and size + layer_bytes[end] <= cap:
            size += layer_bytes[end]
            end += 1
        ranges.append(range(start, end))
        start = end
    return ranges


def _smallest_feasible_cap(layer_bytes: Sequence[int], k: int) -> int:
    """The least cap such that the layers fit in at most ``k`` contiguous groups of at most cap bytes."""
    low, high = max(layer_bytes), sum(layer_bytes)
    while low < high:
        mid = (low + high) // 2
        if _groups_needed(layer_bytes, mid) <= k:
            high = mid
        else:
            low = mid + 1
    return low


def _groups_needed(layer_bytes: Sequence[int], cap: int) -> int:
    groups, size = 1, 0
    for nbytes in layer_bytes:
        if size + nbytes > cap:
            groups += 1
            size = 0
        size += nbytes
    return groups
