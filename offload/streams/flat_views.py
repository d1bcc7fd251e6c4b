"""Tensors that lie in a flat byte buffer: the alignment of their entries, the dense strides a copy
keeps, and the three kinds of tensor over a buffer's bytes: a typed view, an alias that counts its
own in-place writes, and a view under a storage of its own (Note: [A storage per host copy] in
``host_storage.py``).

And :func:`views_outside`: whether a tensor's memory is part of another tensor's, which a layout
cannot keep; :func:`first_overlap`: which of several tensors share memory, and
:func:`overlaps_itself`: whether a tensor's elements share memory, which a layout cannot keep
either. It holds no buffer and lays out nothing: a slice's host copies are laid out in
``host_storage.py``, its gradients in ``gradients.py``, its resident copies in ``resident_storage.py``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

#: Byte alignment of gradient buffers' entries: keeps typed views legal and vector loads aligned.
ALIGNMENT = 64
#: Entries of a slice start, and end, at multiples of this many *elements* of their own dtype, on
#: the host and on the device alike: consecutive entries of one dtype pair then sit at the same
#: element offsets in the host buffer and in the shadow, so one cast covers a whole run of them.
ALIGN_ELEMENTS = 16
#: Where the buffers begin, on both sides: a multiple of every entry alignment, so the buffer
#: region has the same byte layout on the host and on the device (write-backs copy it as bytes).
BUFFER_REGION_ALIGNMENT = 256


def _align(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def dense_stride(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The strides of a tensor whose elements lie densely in another order than row-major
    (``channels_last``, a transposed weight), or ``None`` for a row-major or not dense one.

    Host copies, device copies and gradients keep such a layout: kernels choose by it (a
    convolution with a ``channels_last`` weight runs another algorithm, with other rounding), and
    autograd gives ``.grad`` the parameter's layout. Anything else is laid out row-major.
    """
    if tensor.is_contiguous():
        return None
    expected = 1
    for dim in sorted(range(tensor.dim()), key=lambda d: tensor.stride(d)):
        if tensor.shape[dim] != 1 and tensor.stride(dim) != expected:
            return None
        expected *= tensor.shape[dim]
    return tuple(tensor.stride())


def flat_alias(tensor: torch.Tensor) -> torch.Tensor | None:
    """The memory of a row-major or :func:`dense_stride` tensor as one 1-D tensor (collectives
    want contiguous tensors, and an elementwise operation does not care in which order), or
    ``None`` for a tensor that is not dense."""
    if tensor.is_contiguous():
        return tensor.view(-1)
    if dense_stride(tensor) is None:
        return None
    flat = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    flat.set_(tensor.untyped_storage(), tensor.storage_offset(), (tensor.numel(),))
    return flat


def views_outside(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory is part of a larger tensor's: its storage holds bytes beyond the
    tensor's own extent, as after ``p.data = flat[a:b].view_as(p)`` (which leaves no ``_base``) or
    for a view ``flat[a:b]``. An in-place change through that larger tensor changes this one too
    (Note: [Tensors that view another's memory] in ``host_storage.py``).

    A view over all of its base's memory does not count: whether anything else holds that base
    cannot be told, and layers register such buffers over bases of their own (Hugging Face's
    ``position_ids``, ``torch.arange(n).expand(1, -1)``). Nor does an empty or meta tensor, or one
    without a storage (a wrapper subclass).
    """
    if tensor.numel() == 0 or tensor.is_meta or tensor.layout != torch.strided:
        return False
    try:
        nbytes = tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # "Cannot access storage of TensorWrapper"
        return False
    extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return nbytes > extent * tensor.element_size()


def overlaps_itself(tensor: torch.Tensor) -> bool:
    """Whether two of ``tensor``'s elements lie at one memory location: a stride 0 over more than
    one element (``t.expand(4, 4)``), or strides that step onto each other (an ``as_strided``
    view). A copy of it holds each element apart, so it is another tensor than the one written
    (Note: [Parameters whose elements overlap] in ``host_storage.py``). An empty, meta or
    not strided tensor does not count.

    The dimensions sorted by stride (those of one element left out) cannot overlap when each
    stride reaches past everything the smaller ones span: every tensor built by views of dense
    memory passes so. Others are decided by listing their elements' offsets.
    """
    if tensor.numel() <= 1 or tensor.is_meta or tensor.layout != torch.strided:
        return False
    dims = sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride()) if size > 1)
    if dims[0][0] == 0:
        return True
    span = 0  # the furthest offset the dimensions of smaller strides reach
    for stride, size in dims:
        if stride <= span:
            break
        span += (size - 1) * stride
    else:
        return False
    offsets = torch.zeros(1, dtype=torch.int64)
    for stride, size in dims:
        offsets = (offsets[:, None] + torch.arange(size, dtype=torch.int64) * stride).view(-1)
    return offsets.unique().numel() < offsets.numel()


def memory_span(tensor: torch.Tensor) -> tuple[str, int, int] | None:
    """The device and the byte range ``[start, end)`` of a dense tensor's elements (row-major or
    :func:`dense_stride`), which then cover the range exactly; ``None`` for one whose memory is
    compared no further: empty, meta, not strided, without a storage (a wrapper subclass), or not
    dense (an expanded or strided view, whose range holds others' elements between its own)."""
    if tensor.numel() == 0 or tensor.is_meta or tensor.layout != torch.strided:
        return None
    if not tensor.is_contiguous() and dense_stride(tensor) is None:
        return None
    try:
        start = tensor.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):  # "Cannot access data pointer of Tensor ..."
        return None
    return str(tensor.device), start, start + tensor.numel() * tensor.element_size()


def first_overlap(tensors: Sequence[torch.Tensor], watched: Sequence[bool]) -> tuple[int, int] | None:
    """Indices of two of ``tensors`` whose memory overlaps, one of them at least ``watched``, in
    the order of ``tensors``, or ``None``: distinct tensors over one memory, which a layout gives
    memory of their own (Note: [Parameters over one memory] in ``host_storage.py``). Only
    :func:`memory_span`'s dense tensors count. One pass over the tensors sorted by address,
    keeping the one that reaches furthest."""
    spans = [(span, i) for i, span in enumerate(map(memory_span, tensors)) if span is not None]
    furthest: tuple[str, int, int] | None = None  # device, end and index of the furthest reaching so far
    furthest_watched: tuple[str, int, int] | None = None  # the same among the watched ones
    for (device, start, end), i in sorted(spans):
        other = furthest if watched[i] else furthest_watched
        if other is not None and other[0] == device and other[1] > start:
            return min(other[2], i), max(other[2], i)
        if furthest is None or furthest[0] != device or end > furthest[1]:
            furthest = (device, end, i)
        if watched[i] and (furthest_watched is None or furthest_watched[0] != device or end > furthest_watched[1]):
            furthest_watched = (device, end, i)
    return None


def typed_view(flat: torch.Tensor, offset: int, dtype: torch.dtype, shape: torch.Size,
               stride: tuple[int, ...] | None = None) -> torch.Tensor:
    """A ``dtype`` view of ``shape`` into the byte tensor ``flat`` starting at byte ``offset``,
    row-major or with the dense ``stride`` of :func:`dense_stride`."""
    nbytes = shape.numel() * _itemsize(dtype)
    elements = flat[offset:offset + nbytes].view(dtype)
    return elements.view(shape) if stride is None else elements.as_strided(shape, stride)


def alias(flat: torch.Tensor, offset: int, dtype: torch.dtype, shape: torch.Size,
          stride: tuple[int, ...] | None = None) -> torch.Tensor:
    """Like :func:`typed_view`, but a tensor of its own rather than a view of ``flat``.

    Views share their base's version counter, so an in-place update of one buffer would look to
    autograd like a change of every tensor in the slot. An alias made with ``set_`` shares only
    the memory and counts its own in-place writes, like a separately allocated tensor would.
    """
    itemsize = _itemsize(dtype)
    # A tensor created inside inference_mode would be an inference tensor, which training code
    # may not update in place later; these aliases outlive the call that creates them.
    with torch.inference_mode(False):
        tensor = torch.empty(0, dtype=dtype, device=flat.device)
        tensor.set_(flat.untyped_storage(), (flat.storage_offset() + offset) // itemsize, shape,
                    stride if stride is not None else torch.empty(shape, device="meta").stride())
    return tensor


def empty_in_layout(shape: torch.Size, stride: tuple[int, ...] | None, dtype: torch.dtype,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """New memory for a tensor of ``shape``, row-major or with the dense ``stride`` of :func:`dense_stride`."""
    return torch.empty_strided(shape, stride or torch.empty(shape, device="meta").stride(), dtype=dtype, device=device)


def flat_exporter(flat: torch.Tensor) -> ctypes.Array[ctypes.c_ubyte] | None:
    """A Python buffer over the bytes of the CPU tensor ``flat`` that keeps ``flat`` alive, for
    :func:`own_storage_view`; ``None`` for an empty one (Note: [A storage per host copy])."""
    if flat.numel() == 0:
        return None
    exporter = (ctypes.c_ubyte * flat.numel()).from_address(flat.data_ptr())
    # from_address holds no reference to the memory's owner: this one does, for as long as a
    # storage made over the exporter lives.
    exporter.flat = flat  # type: ignore[attr-defined]
    return exporter


def own_storage_view(exporter: ctypes.Array[ctypes.c_ubyte] | None, offset: int, dtype: torch.dtype,
                     shape: torch.Size, stride: tuple[int, ...] | None = None) -> torch.Tensor:
    """Like :func:`typed_view` into the buffer ``exporter`` covers, but under a storage of its own:
    the storage starts at the tensor's first byte and holds exactly its bytes, aliasing the
    buffer's memory (no copy), and keeps the buffer alive (Note: [A storage per host copy]).

    An empty tensor gets an empty storage of its own.
    """
    nbytes = shape.numel() * _itemsize(dtype)
    # Tensors made under inference_mode could not be updated in place by training code later;
    # these outlive the call that makes them.
    with torch.inference_mode(False):
        if nbytes == 0:
            return empty_in_layout(shape, stride, dtype)
        assert exporter is not None
        elements = torch.frombuffer(exporter, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype)
        return elements.view(shape) if stride is None else elements.as_strided(shape, stride)
