"""Where each parameter's gradient lies in a slice's gradient buffer: the same layout on the
device (the buffers microbatches are summed in), in the pooled host buffers gradients land in,
and in a slice's gradient file (Note: [Gradients on disk] in ``gradient_files.py``).

Note: [Sparse gradients take no room]
    A parameter whose gradient autograd gives sparse (the weight of an ``nn.Embedding`` or
    ``nn.EmbeddingBag`` built with ``sparse=True``) never lands in a slice's gradient buffer: its
    indices and values travel on their own (``GradientOffloader._offload_sparse``). Laid out at its
    dense size, it took that much room for nothing in every landing buffer on the host (the
    largest slice's size serves every slice) and, with several microbatches, in both device
    buffers: 2 GB each for a 128k x 4096 float32 embedding. So it is laid out with a place that
    takes no room (``GradientPlace.sparse``), known before the first backward from where it is
    registered (:func:`gives_sparse_gradient`); the planner counts it so (``SliceLayout.
    sparse_gradient_bytes``). Under data parallelism (a subscriber that rewrites the gradients)
    every gradient is laid out dense: the average refuses a sparse one, and the host's needs a
    place for each gradient a rank lacks. A slice's gradient file (masters on disk) keeps a place
    for it, never written.

    A guess that misses is safe: a sparse gradient of a parameter with a dense place travels on
    its own as before, and a dense gradient of one with a place that takes no room (the weight
    also read by another operation of the slice, where autograd sums the two into a dense one)
    travels on its own too, in a pooled host buffer of its size, summed over microbatches out of
    place. Nothing is ever written at a place that takes no room.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .flat_views import _align, _itemsize, typed_view
from .slice_entries import Entry


@dataclass(frozen=True)
class GradientPlace:
    """Where one parameter's gradient sits in a slice's gradient buffer (device and host alike)."""

    offset: int
    dtype: torch.dtype
    shape: torch.Size
    stride: tuple[int, ...] | None = None  # the parameter's, where it is not row-major: .grad takes its layout
    #: Expected sparse: the place takes no room in the buffer (Note: [Sparse gradients take no room]).
    sparse: bool = False

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        if self.sparse:
            raise AssertionError("OffloadModel internal error: a gradient viewed at a place that takes no room")
        return typed_view(flat, self.offset, self.dtype, self.shape, self.stride)


def gives_sparse_gradient(registered: Iterable[tuple[nn.Module, str]]) -> bool:
    """Whether autograd gives a parameter registered at ``registered`` (module, name) a sparse
    gradient: each of them is the weight of an ``nn.Embedding`` or ``nn.EmbeddingBag`` built
    with ``sparse=True`` (Note: [Sparse gradients take no room])."""
    places = list(registered)
    return bool(places) and all(isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and name == "weight"
                                and bool(module.sparse) for module, name in places)


def lay_out_gradients(entries: Sequence[Entry], needed: Sequence[bool], sparse: Sequence[bool] = ()
                      ) -> tuple[list[GradientPlace | None], int]:
    """Where each needed parameter's gradient goes in a slice's gradient buffer (``None`` where
    none is needed), one after the other, aligned; and the bytes they take. Those ``sparse``
    marks get a place that takes no room (Note: [Sparse gradients take no room])."""
    offset = 0
    places: list[GradientPlace | None] = []
    for k, (entry, want) in enumerate(zip(entries, needed)):
        if not want:
            places.append(None)
        elif k < len(sparse) and sparse[k]:
            places.append(GradientPlace(offset, entry.dtype, entry.shape, entry.stride, sparse=True))
        else:
            places.append(GradientPlace(offset, entry.dtype, entry.shape, entry.stride))
            offset = _align(offset + entry.shape.numel() * _itemsize(entry.dtype))
    return places, offset


def sparse_parameters(layers: Iterable[nn.Module]) -> set[int]:
    """The ids of the parameters registered in ``layers`` whose gradient comes sparse, every place
    they are registered there considered (:func:`gives_sparse_gradient`): what the planner counts."""
    registered: dict[int, list[tuple[nn.Module, str]]] = {}
    for layer in layers:
        for module in layer.modules():
            for name, p in module._parameters.items():
                if p is not None:
                    registered.setdefault(id(p), []).append((module, name))
    return {key for key, places in registered.items() if gives_sparse_gradient(places)}


def sparse_entries(entries: Sequence[Entry]) -> list[bool]:
    """Per entry, whether autograd gives it a sparse gradient (:func:`gives_sparse_gradient`)."""
    return [gives_sparse_gradient((site.module, site.name) for site in entry.sites) for entry in entries]


class SparseParameters:
    """Per slice's parameters (a list of entries, by its identity), whether each one's gradient
    comes sparse (:func:`sparse_entries`): found once, not every backward (a few microseconds a
    slice). A slice laid out anew has a new list, found anew; :meth:`clear` lets the old ones go."""

    def __init__(self) -> None:
        self._found: dict[int, tuple[Sequence[Entry], list[bool]]] = {}

    def of(self, entries: Sequence[Entry]) -> list[bool]:
        found = self._found.get(id(entries))
        if found is None or found[0] is not entries:
            found = self._found[id(entries)] = (entries, sparse_entries(entries))
        return found[1]

    def clear(self) -> None:
        self._found.clear()
