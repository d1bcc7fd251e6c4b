"""One slice's state in the disk tier: where it is (``optimizer.state``, its file, or held in RAM),
its file's layout, and the moves between ``optimizer.state``, a window buffer and the file
(Note: [Disk tier pipeline] in ``offload/tiers/disk_tier.py``). What it does not hold: when the
moves run (``disk_tier.py``), the window's buffers (``state_window.py``) or the directory
(``state_files.py``)."""

from __future__ import annotations

import enum
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..streams.disk import AlignedBuffer, DiskTierError, StateFile, page_aligned
from ..streams.flat_views import dense_stride
from .state_files import StateFiles
from .state_window import Buffer, Region, Window, WindowSlot

#: Each state tensor starts at a multiple of this many bytes in a slice's file (vector loads).
TENSOR_ALIGNMENT = 64

#: Per parameter, its state tensors by key.
SliceState = dict[torch.Tensor, dict[str, torch.Tensor]]


class Place(enum.Enum):
    """Where a slice's state is between updates."""

    RAM = "in optimizer.state"  # no state on disk yet (before its first update, or after loading)
    DISK = "on disk"  # in the slice's file; optimizer.state keeps only the scalars
    HELD = "held in RAM"  # its write failed: the buffer it was written from holds it


@dataclass(frozen=True)
class Field:
    """One state tensor of a slice's file."""

    position: int  # the parameter's position in the slice
    key: str  # its name in the parameter's state ("exp_avg")
    dtype: torch.dtype
    shape: torch.Size
    stride: tuple[int, ...]
    offset: int  # bytes from the start of the file
    nbytes: int

    def view(self, buffer: Buffer) -> torch.Tensor:
        flat = buffer.tensor[self.offset:self.offset + self.nbytes].view(self.dtype)
        return flat.as_strided(self.shape, self.stride)


@dataclass
class SliceRecord:
    """One slice's state in the tier, and the moves of it between ``optimizer.state`` (``state``
    below), its buffer and its file.

    Note: [State edited between steps]
        Between updates the file holds the slice's state tensors and ``state[p]`` only the scalars
        (AdamW's ``step``); code that edits ``state[p]`` as it would a plain optimizer's gets what
        that optimizer would do:

        1. A tensor assigned under a key the file holds (``state[p]["exp_avg"] = torch.zeros_like(p)``)
           is the state from then on: the update attaches only the keys ``state[p]`` lacks, so the
           optimizer steps the assigned tensor, and the detach copies it into the buffer, to be
           written (the file is laid out anew).
        2. A reset (``optimizer.state.clear()``, ``optimizer.state = defaultdict(dict)``,
           ``del optimizer.state[p]``, ``optimizer.state[p] = {}``, ``optimizer.state[p].clear()``)
           drops the parameter's state from the file: the record keeps the dict each parameter's
           tensors were taken out of (``owners``), and a parameter whose dict is another one, or
           none, or emptied of the scalars it kept, gets nothing attached; the optimizer starts its
           state afresh, as in RAM. A slice all of whose parameters were reset, and whose update
           made no state, holds nothing any more (:meth:`reset`). The one reset this cannot see is
           ``state[p].clear()`` of a dict that was empty already (SGD's, whose momentum is all of its
           state): ``del optimizer.state[p]`` resets it.
        3. What hands out the state between updates (``state_dict()``, checkpoints, a slice laid out
           anew) reads only the tensors that still stand (:meth:`standing`): assigned ones come from
           ``state[p]``, and a reset parameter's are gone, as they are for the plain optimizer.

        In-place changes of the attached views (the optimizer's own, or a hook's inside the update)
        stay where they are, in the buffer, as before; assigned and fresh tensors are copied into
        their places when the layout is the same, so the window does not grow for them. The cost
        at each update is a dict look-up per parameter (its owner). After a load the dicts the
        load made are the owners (:meth:`own`, from :meth:`StateTier.adopt`).
        ``tests/test_disk_tier.py`` checks each case against the plain optimizer, bit for bit.
    """

    index: int
    params: list[torch.Tensor]
    file: StateFile | None = None
    layout: list[Field] | None = None
    nbytes: int = 0  # the file's size: the layout's bytes, in whole pages
    place: Place = Place.RAM
    buffer: Buffer | None = None  # between its read and its write, or while held
    slot: WindowSlot | None = None
    dirty: bool = False  # the buffer holds state the file does not
    read_error: OSError | None = None
    write_error: OSError | None = None
    reported: bool = True  # its write error was raised to the caller
    #: Per position of a parameter with state in the file: its dict in ``state`` when the tier took
    #: the tensors out, and whether scalars stayed in it (Note: [State edited between steps]).
    owners: dict[int, tuple[dict[str, Any], bool]] = field(default_factory=dict)

    def read(self, slot: WindowSlot, region: Region | None) -> None:
        """Read the file into ``slot``'s buffer (``region``, the slice's place in the arena, else the
        slot's own, grown if needed); a failure is kept in ``read_error`` for the update to raise."""
        self.read_error = None
        self.slot = slot
        slot.take(region)
        if self.place is Place.HELD:
            return  # its buffer holds it
        if self.place is Place.RAM:
            # Its state is in RAM (the optimizer's first step makes it there): it needs no buffer
            # until its detach copies the state in, and the slot's own goes now, so that state
            # takes its pages' place instead of coming on top of them (a place in the arena stays).
            if isinstance(slot.buffer, AlignedBuffer):
                slot.buffer = None
            self.buffer = slot.buffer
            return
        if slot.buffer is None or slot.buffer.nbytes < self.nbytes:
            slot.buffer = AlignedBuffer(self.nbytes)
        assert self.file is not None
        try:
            self.file.read(slot.buffer, self.nbytes)
        except OSError as error:
            self.read_error = error
            return
        self.buffer = slot.buffer

    def attach(self, state: Any) -> None:
        """Views of the buffer into ``state``, in the layout's order, of the tensors that still stand
        there (Note: [State edited between steps]): a key already there keeps its tensor."""
        if self.place is Place.RAM:
            return
        assert self.buffer is not None and self.layout is not None
        position, held = -1, None
        for f in self.layout:  # in order of position: one look-up of each parameter's dict
            if f.position != position:
                position, held = f.position, self._owned(state, f.position)
            if held is not None:
                held.setdefault(f.key, f.view(self.buffer))

    def standing(self, state: Any) -> list[tuple[Field, dict[str, Any]]]:
        """The layout's fields whose tensor is still its parameter's state in ``state``, each with the
        parameter's dict there: not one assigned since, nor of a parameter whose state was reset
        (rules 1 and 2 of Note: [State edited between steps])."""
        return [(f, held) for f in self.layout or ()
                if (held := self._owned(state, f.position)) is not None and f.key not in held]

    def _owned(self, state: Any, position: int) -> dict[str, Any] | None:
        """The dict in ``state`` of the parameter at ``position`` if its state in the file still
        stands (rule 2 of Note: [State edited between steps]), else ``None``."""
        held = state.get(self.params[position])
        owner, had_scalars = self.owners.get(position, (None, False))
        # Another dict, or none, or emptied of the scalars it kept: the parameter's state was reset.
        return held if held is not None and held is owner and (held or not had_scalars) else None

    def own(self, state: Any) -> None:
        """The dicts of ``state`` that hold the scalars of the slice's parameters now are the ones the
        state in the file goes with (after a load, Note: [State edited between steps])."""
        self.owners = {}
        for f in self.layout or ():
            if f.position not in self.owners:
                held = state.setdefault(self.params[f.position], {})
                self.owners[f.position] = (held, bool(held))

    def detach(self, state: Any) -> bool:
        """Take the slice's state tensors out of ``state`` into the buffer; whether state from
        elsewhere was copied in (created by the optimizer, or loaded: it is freed now)."""
        dicts = {position: state[p] for position, p in enumerate(self.params) if p in state}
        found = [(position, key, value) for position, held in dicts.items()
                 for key, value in held.items() if goes_to_disk(value)]
        note_state_kept_in_ram(state, self.params)
        if not found:
            if self.layout is not None:
                self.reset()  # every parameter's state was reset, and the update made none
            return False
        layout, nbytes = layout_of(found)
        buffer = self.buffer
        same = self.layout is not None and buffer is not None and _shape_of(layout) == _shape_of(self.layout)
        # The attached views (updated in place) are in their places already.
        placed = [same and buffer is not None and value.data_ptr() == buffer.data_ptr() + f.offset
                  for f, (_, _, value) in zip(layout, found)]
        in_place = all(placed)
        if not in_place:
            # A tensor inside the buffer out of its place could be overwritten before it is copied;
            # the others (assigned between steps: Note: [State edited between steps]) go to their places.
            inside = buffer is not None and any(
                not at and buffer.data_ptr() <= value.data_ptr() < buffer.data_ptr() + buffer.nbytes
                for at, (_, _, value) in zip(placed, found))
            if buffer is None or buffer.nbytes < nbytes or inside:
                fresh = AlignedBuffer(nbytes)
                slot = self.slot
                if slot is not None and (slot.buffer is None or slot.buffer is buffer):
                    slot.buffer = fresh  # the window's buffer grows (it is this slice's until its write)
                buffer, placed = fresh, [False] * len(found)
            for f, (_, _, value), at in zip(layout, found, placed):
                if not at:
                    f.view(buffer).copy_(value)
        for f in layout:
            del dicts[f.position][f.key]
        self.owners = {f.position: (dicts[f.position], bool(dicts[f.position])) for f in layout}
        self.layout, self.nbytes, self.buffer, self.dirty = layout, nbytes, buffer, True
        return not in_place

    def write(self, files: StateFiles) -> None:
        """Write the buffer to the file (opened in ``files`` the first time); a failure leaves the
        state held in the buffer (Note: [Disk tier failures] in ``offload/tiers/disk_tier.py``)."""
        if not self.dirty:
            return  # its update did not run (an earlier update failed): the file is current
        assert self.buffer is not None
        try:
            if self.file is None:
                self.file = files.open(self.index)
            self.file.reserve(self.nbytes)
            self.file.write(self.buffer, self.nbytes)
        except OSError as error:
            if self.place is not Place.HELD or self.write_error is None:
                self.reported = False
            self.write_error = error
            self.place = Place.HELD
            if isinstance(self.buffer, Region):
                # Its place in the arena goes to the slices three on (Note: [The window's arena], rule 5).
                self.buffer = self.buffer.copy()
            slot = self.slot
            if slot is not None and slot.buffer is self.buffer:
                slot.buffer = None  # the buffer stays with the slice; the window takes a new one
            return
        self.place, self.dirty, self.write_error, self.reported = Place.DISK, False, None, True
        self.buffer = None

    def copies(self, window: Window, state: Any) -> SliceState:
        """Copies of the slice's state tensors that still stand in ``state`` (:meth:`standing`), read
        from its file into ``window``'s scratch buffer (or from its held buffer); every write must be
        done."""
        fields = self.standing(state) if self.place is not Place.RAM else []
        if not fields:
            return {}
        buffer = self.buffer
        if self.place is Place.DISK:
            buffer = window.scratch(self.nbytes)
            assert self.file is not None
            try:
                self.file.read(buffer, self.nbytes)
            except OSError as error:
                raise DiskTierError(f"could not read the optimizer state of slice {self.index} from "
                                    f"{error.filename}: {error.strerror}") from error
        assert buffer is not None
        out: SliceState = {}
        for f, _ in fields:
            out.setdefault(self.params[f.position], {})[f.key] = f.view(buffer).clone(
                memory_format=torch.preserve_format)
        return out

    def restore(self, state: Any, window: Window) -> None:
        """Bring the slice's state back into ``state`` (``optimizer.state``), read through
        ``window``: the tier keeps nothing of it any more (its parameters changed)."""
        for param, tensors in self.copies(window, state).items():
            state[param].update(tensors)
        self.place, self.buffer = Place.RAM, None

    def stand_ins(self, state: Any) -> SliceState:
        """Stand-ins of the state tensors on disk that still stand in ``state`` (:meth:`standing`),
        the file unread: each has the tensor's shape and dtype over a single element (zero strides)."""
        if self.place is Place.RAM:
            return {}
        out: SliceState = {}
        for f, _ in self.standing(state):
            out.setdefault(self.params[f.position], {})[f.key] = torch.zeros((), dtype=f.dtype).expand(f.shape)
        return out

    def reset(self) -> None:
        """The slice holds no state in the tier (its file, if any, is overwritten at its next write)."""
        self.place, self.layout, self.buffer, self.dirty = Place.RAM, None, None, False
        self.write_error, self.reported, self.owners = None, True, {}


@dataclass
class LoadingSlice:
    """A slice's state being loaded from a checkpoint (:meth:`StateTier.begin_load`): its file's
    layout, and the buffer in that layout that the loader fills through ``tensors``."""

    record: SliceRecord
    layout: list[Field]
    nbytes: int
    buffer: Buffer
    window: Window  # where the buffer goes back once written
    tensors: SliceState = field(default_factory=dict)  # views of buffer

    @classmethod
    def of(cls, record: SliceRecord, like: SliceState, window: Window) -> LoadingSlice:
        """The load of ``record``'s slice: a buffer from ``window`` laid out as the slice's file would
        be for the tensors of ``like`` (as :meth:`SliceRecord.detach` lays it out), and a view of it
        for each of them in ``tensors``."""
        found = [(position, key, value) for position, p in enumerate(record.params) if p in like
                 for key, value in like[p].items()]
        assert found and len(found) == sum(map(len, like.values())), \
            f"internal error: state to load into slice {record.index} is not of its parameters"
        layout, nbytes = layout_of(found)
        buffer = window.for_load(nbytes)
        loading = cls(record, layout, nbytes, buffer, window)
        for f in layout:
            loading.tensors.setdefault(record.params[f.position], {})[f.key] = f.view(buffer)
        return loading

    def store(self, files: StateFiles) -> None:
        """Make the filled buffer the slice's state and write it to the slice's file; the buffer goes
        back to the window once written (the slice keeps a copy, held, when the write fails)."""
        record = self.record
        record.reset()  # whatever the slice held is replaced
        record.layout, record.nbytes, record.buffer, record.dirty = self.layout, self.nbytes, self.buffer, True
        record.slot = None  # a failed write keeps the buffer with the slice
        record.write(files)
        if record.buffer is not self.buffer:  # written, or held in a copy
            self.window.returned(self.buffer)
        self.tensors = {}


def goes_to_disk(value: Any) -> bool:
    """Whether a state value is one the tier keeps in a file: a dense CPU tensor with a dimension,
    and a plain one (Note: [Low-bit state stays in RAM])."""
    return (type(value) is torch.Tensor and value.dim() > 0 and value.layout == torch.strided
            and value.device.type == "cpu" and not value.requires_grad
            and (value.is_contiguous() or dense_stride(value) is not None))


def note_state_kept_in_ram(state: Any, params: Sequence[torch.Tensor]) -> None:
    """Warn (once per kind) of per-element state the tier leaves in RAM.

    Note: [Low-bit state stays in RAM]
        torchao's low-bit optimizers keep each moment as a tensor subclass (8- or 4-bit codes
        and a scale per block) whose bytes are not its values: copying it into a file buffer would
        store the float values it stands for, and the update would read back another kind of
        state. The tier leaves such state in ``optimizer.state``; it is already a quarter (8-bit)
        or an eighth (4-bit) of float32 AdamW's. ``tests/test_lowbit_optimizers.py`` checks the
        results stay bit-identical with the tier configured.
    """
    for p in params:
        for value in state.get(p, {}).values():
            kind = type(value)
            if (isinstance(value, torch.Tensor) and kind is not torch.Tensor and value.dim() > 0
                    and kind not in KEPT_IN_RAM_NOTED):
                KEPT_IN_RAM_NOTED.add(kind)
                warnings.warn(f"the disk tier keeps plain tensors only: optimizer state of type {kind.__name__} "
                              "stays in RAM (for torchao's low-bit optimizers, already a quarter or less of "
                              "float32 AdamW's state)", stacklevel=2)


#: Kinds of state :func:`note_state_kept_in_ram` has warned of.
KEPT_IN_RAM_NOTED: set[type] = set()


def layout_of(found: Sequence[tuple[int, str, torch.Tensor]]) -> tuple[list[Field], int]:
    """A slice's file for its state tensors ``found`` ((position, key, tensor), in that order):
    each tensor's place, and the file's size in whole pages. One function for a step's
    (:meth:`SliceRecord.detach`) and a load's (:meth:`StateTier.begin_load`): the file a step
    reads back is laid out as the one it wrote."""
    fields = []
    offset = 0
    for position, key, value in found:
        nbytes = value.numel() * value.element_size()
        fields.append(Field(position, key, value.dtype, value.shape, tuple(value.stride()), offset, nbytes))
        offset += _aligned(nbytes)
    return fields, file_nbytes([f.nbytes for f in fields])


def file_nbytes(tensor_nbytes: Sequence[int]) -> int:
    """The size of a slice's file holding tensors of ``tensor_nbytes`` bytes, laid out as
    :func:`layout_of` lays them (each at a multiple of :data:`TENSOR_ALIGNMENT`, the file in whole
    pages): what the planner counts for the tier's window before the state exists."""
    return page_aligned(sum(_aligned(n) for n in tensor_nbytes[:-1]) + tensor_nbytes[-1]) if tensor_nbytes else 0


def _aligned(nbytes: int) -> int:
    return -(-nbytes // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT


def _shape_of(layout: Sequence[Field]) -> list[tuple[Any, ...]]:
    return [(f.position, f.key, f.dtype, f.shape, f.stride) for f in layout]
