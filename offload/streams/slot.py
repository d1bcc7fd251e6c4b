"""A device slot's state: its memory and which slice it holds (``device_slots.py`` keeps the slots,
``slot_buffers.py`` and ``slot_references.py`` reach the slices in them)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .backend import Event


class SlotState(enum.Enum):
    """What a slot's memory holds."""

    EMPTY = enum.auto()  # nothing usable: never loaded, forgotten, or its last load raised
    CURRENT = enum.auto()  # slice_index as loaded (once ``ready`` completes), unchanged since: no load needed
    STALE = enum.auto()  # slice_index, but the host copy may have changed (a new forward) or the device copy did


@dataclass
class Slot:
    """One device slot: a byte buffer sized for the largest slice, and what it holds."""

    data: torch.Tensor
    slice_index: int | None = None  # None exactly when EMPTY
    state: SlotState = SlotState.EMPTY
    ready: Event | None = None
    free: Event | None = None
    written_back: Event | None = None  # the write-back that reads this slot's buffers
    in_use: bool = False  # acquired: reserved for compute until released
    last_used: int = 0
    views: list[torch.Tensor] = field(default_factory=list)
    # Device copies of each slice this slot has held, made once: creating them costs more Python
    # time than a small slice's copy.
    view_cache: dict[int, list[torch.Tensor]] = field(default_factory=dict)
