"""Where a slice's entries lie: each one's byte offset in the host buffer and in a device slot, and
the sizes and regions that follow from them (the layout ``host_storage.py``'s docstring describes).
It places entries only: allocating the buffer and moving the tensors into it is ``host_storage.py``'s
job, collecting the entries ``slice_entries.py``'s."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .flat_views import ALIGN_ELEMENTS, BUFFER_REGION_ALIGNMENT, _align, _itemsize
from .slice_entries import Entry


@dataclass(frozen=True)
class SliceLayout:
    """The sizes and regions of one laid-out slice, in bytes.

    Attributes:
        host_nbytes: the host buffer: what the slice holds, in the host dtypes.
        load_nbytes: what a load copies into a slot: what the slice holds, in the device dtypes;
            borrowed parameters follow it in the slot.
        device_nbytes: a slot's size, borrowed parameters included.
        host_buffer_region / buffer_region: ``(start, end)`` of the buffers in the host buffer and in
            a slot, empty at the end when the slice has none: one contiguous region each, so the
            buffers can be snapshotted and written back on their own.
    """

    host_nbytes: int
    load_nbytes: int
    device_nbytes: int
    host_buffer_region: tuple[int, int]
    buffer_region: tuple[int, int]


def lay_out(held: Sequence[Entry], buffers: Sequence[Entry], borrowed: Sequence[Entry]) -> SliceLayout:
    """Set each entry's ``host_offset`` and ``device_offset``, and return the sizes that follow.

    ``held`` (the parameters, then ``buffers``, its tail) lie in that order in the host buffer and in
    a slot, each aligned to :data:`~offload.streams.flat_views.ALIGN_ELEMENTS` elements of its dtype
    there, the buffers' region to ``BUFFER_REGION_ALIGNMENT`` bytes. ``borrowed`` parameters (Note:
    [Tied parameters across slices] in ``host_storage.py``) have no host offset (-1) and lie after
    the loaded bytes in the slot, where a second copy puts them.
    """
    host_end = device_end = 0
    for entry in held:
        if buffers and entry is buffers[0]:
            host_end = _align(host_end, BUFFER_REGION_ALIGNMENT)
            device_end = _align(device_end, BUFFER_REGION_ALIGNMENT)
        host_align = ALIGN_ELEMENTS * _itemsize(entry.dtype)
        device_align = ALIGN_ELEMENTS * _itemsize(entry.device_dtype)
        entry.host_offset = _align(host_end, host_align)
        entry.device_offset = _align(device_end, device_align)
        host_end = _align(entry.host_offset + entry.shape.numel() * _itemsize(entry.dtype), host_align)
        device_end = _align(entry.device_offset + entry.shape.numel() * _itemsize(entry.device_dtype), device_align)
    first = buffers[0] if buffers else None
    host_buffer_region = (first.host_offset if first else host_end, host_end)
    buffer_region = (first.device_offset if first else device_end, device_end)
    load_nbytes = device_end
    for entry in borrowed:
        align = ALIGN_ELEMENTS * _itemsize(entry.device_dtype)
        entry.host_offset = -1
        entry.device_offset = _align(device_end, align)
        device_end = _align(entry.device_offset + entry.shape.numel() * _itemsize(entry.device_dtype), align)
    return SliceLayout(host_end, load_nbytes, device_end, host_buffer_region, buffer_region)
