"""Where each parameter's gradient lies in a slice's gradient buffer: the same layout on the
device (the buffers microbatches are summed in), in the pooled host buffers gradients land in,
and in a slice's gradient file (Note: [Gradients on disk] in ``gradient_files.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .flat_views import _align, _itemsize, typed_view
from .slice_entries import Entry


@dataclass(frozen=True)
class GradientPlace:
    """Where one parameter's gradient sits in a slice's gradient buffer (device and host alike)."""

    offset: int
    dtype: torch.dtype
    shape: torch.Size
    stride: tuple[int, ...] | None = None  # the parameter's, where it is not row-major: .grad takes its layout

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return typed_view(flat, self.offset, self.dtype, self.shape, self.stride)


def lay_out_gradients(entries: Sequence[Entry], needed: Sequence[bool]) -> tuple[list[GradientPlace | None], int]:
    """Where each needed parameter's gradient goes in a slice's gradient buffer (``None`` where
    none is needed), one after the other, aligned; and the bytes they take."""
    offset = 0
    places: list[GradientPlace | None] = []
    for entry, want in zip(entries, needed):
        if not want:
            places.append(None)
            continue
        places.append(GradientPlace(offset, entry.dtype, entry.shape, entry.stride))
        offset = _align(offset + entry.shape.numel() * _itemsize(entry.dtype))
    return places, offset
