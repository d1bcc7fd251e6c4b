"""How a tensor lies in memory, kept wherever a tensor crosses a boundary or is copied.

Note: [Layouts]
    Kernels choose by layout: a ``channels_last`` convolution runs another algorithm than a
    row-major one, an elementwise kernel on a strided view takes its scalar loop instead of the
    vectorised one, a CUDA reduction starts its vectorised loads after a different number of
    leading elements when the data pointer is not aligned. Each choice rounds differently, so a
    tensor that reaches a layer in another layout than in the plain model gives other bits.

    1. Every tensor the package copies on the way into a layer keeps its *layout*: its shape, its
       strides, and the alignment of its first element within :data:`ALIGNMENT` bytes. That is
       the model input entering the first slice (Note: [Leaves enter through a copy] in
       ``offload/autograd/slice_graph.py``), a boundary activation offloaded for a checkpoint and
       loaded for the recompute, and a host input loaded to the device.
    2. A copy holds the *addressed memory*: every element from the tensor's first to its last,
       gaps included (a device copy also leading elements that keep the alignment; a host copy
       is never computed on, and its pooled buffers keep one size from step to step). For a dense tensor in
       any order (row-major, ``channels_last``, a transposed weight) that is exactly its
       elements. A strided view with gaps (``x[..., ::2]``) costs its gaps as well: the same
       memory the plain model keeps alive through the view's base. An expanded tensor (stride 0)
       costs less than its number of elements.
    3. A tensor whose elements overlap (an ``expand``) cannot be the destination of a copy, so
       one that enters a slice needing a gradient enters as a view of itself instead of a copy;
       an in-place first layer fails on it, as it does in the plain model (with autograd's leaf
       message rather than the overlap one).

    Parameters keep theirs through ``dense_stride`` in ``flat_views.py``; gradients take
    their parameter's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Alignment kept for a copy's first element, in bytes: covers every vectorised load width
#: kernels choose by (16 bytes on CUDA today) with room to spare.
ALIGNMENT = 64


def overlaps(tensor: torch.Tensor) -> bool:
    """Whether two of the tensor's elements may share memory (an ``expand``).

    Taken by increasing stride, each dim must step over everything the smaller ones address. A
    layout without overlap whose dims interleave (only ``as_strided`` makes one) is taken as
    overlapping: it enters a slice as a view (rule 3 of Note: [Layouts]).
    """
    reach = 0  # how far past an element the dims so far reach
    for stride, size in sorted((s, n) for s, n in zip(tensor.stride(), tensor.shape) if n > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


@dataclass(frozen=True)
class Layout:
    """Shape, strides and alignment of a tensor (Note: [Layouts]).

    Attributes:
        size: the shape.
        stride: the strides.
        lead: elements a device copy keeps before the first one so that it keeps its alignment.
        span: elements from the first addressed to the last, gaps included (0 when empty).
    """

    size: torch.Size
    stride: tuple[int, ...]
    lead: int
    span: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Layout:
        if tensor.numel() == 0:
            return cls(tensor.shape, tuple(tensor.stride()), 0, 0)
        span = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
        itemsize = tensor.element_size()
        lead = tensor.data_ptr() % ALIGNMENT // itemsize
        return cls(tensor.shape, tuple(tensor.stride()), lead, span)

    def addressed(self, tensor: torch.Tensor) -> torch.Tensor:
        """The memory ``tensor`` (of this layout) addresses, first element to last, as one 1-D view."""
        return tensor.as_strided((self.span,), (1,), tensor.storage_offset())

    def on(self, memory: torch.Tensor) -> torch.Tensor:
        """The tensor of this layout over ``memory``: 1-D, :attr:`span` elements (what
        :meth:`addressed` returned, or a copy of it)."""
        return memory.as_strided(self.size, self.stride, memory.storage_offset())

    def empty(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new, uninitialised tensor of this layout, its first element aligned as the original's."""
        memory = torch.empty(self.lead + self.span, dtype=dtype, device=device)
        # A tensor of its own over that memory, not a view: autograd records an in-place copy
        # into a view as a copy into its base, and differentiates through both.
        return torch.empty(0, dtype=dtype, device=device).set_(memory.untyped_storage(), self.lead, self.size,
                                                              self.stride)


def copy_keeping_layout(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a tensor whose elements do not overlap, in its layout, recorded by autograd like
    ``clone`` (which lays out a tensor with gaps row-major)."""
    return Layout.of(tensor).empty(tensor.dtype, tensor.device).copy_(tensor)
