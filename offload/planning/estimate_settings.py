"""What :func:`~offload.planning.planner.estimate_memory` accepts: the optimizer's state per
parameter, and the settings :class:`~offload.OffloadModel` would refuse, refused with its words (a
prediction for a model that cannot be built would mislead)."""

from __future__ import annotations

import torch

from ..arguments import int_at_least

#: Optimizer state per parameter, in units of the parameter's own element size.
STATE_ELEMENTS = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0, None: 0}
_PLACES = ("ram", "disk")


def state_elements(optimizer: str | None, amsgrad: bool = False) -> int:
    """Optimizer state per trained parameter, in the parameter's own elements: Adam's and AdamW's
    ``amsgrad=True`` keeps a third tensor, ``max_exp_avg_sq``, as large as the parameter."""
    if optimizer not in STATE_ELEMENTS:
        known = sorted(k for k in STATE_ELEMENTS if k)
        raise ValueError(f"optimizer must be one of {known} or None, got {optimizer!r}")
    if not isinstance(amsgrad, bool):
        raise TypeError(f"amsgrad must be a bool, got {type(amsgrad).__name__}")
    if amsgrad and optimizer not in ("adam", "adamw"):
        raise ValueError(f"amsgrad is Adam's and AdamW's option, not {optimizer!r}'s: pass amsgrad=False")
    return STATE_ELEMENTS[optimizer] + amsgrad


def check_settings(num_slices: object, num_microbatches: object, activation_bytes: object,
                   compute_dtype: torch.dtype | None) -> None:
    int_at_least("num_slices", num_slices, 1)
    int_at_least("num_microbatches", num_microbatches, 1)
    int_at_least("activation_bytes", activation_bytes, 0)
    if compute_dtype not in (None, torch.bfloat16, torch.float16):
        raise ValueError(f"compute_dtype must be None, torch.bfloat16 or torch.float16, got {compute_dtype!r}")


def check_places(optimizer: str | None, optimizer_state: str, masters: str, compute_dtype: torch.dtype | None,
                 shadows: str = "ram", amsgrad: bool = False) -> None:
    state_elements(optimizer, amsgrad)
    for name, place in (("optimizer_state", optimizer_state), ("masters", masters), ("shadows", shadows)):
        if place not in _PLACES:
            raise ValueError(f"{name} must be 'ram' or 'disk', got {place!r}")
    if masters == "disk" and compute_dtype is None:
        raise ValueError("masters='disk' needs a compute_dtype, as OffloadModel(..., masters=...) does: loads "
                         "read the shadow in that dtype, kept in RAM")
    if shadows == "disk" and masters != "disk":
        raise ValueError("shadows='disk' casts each load from the masters on disk, as OffloadModel(..., "
                         "shadows='disk') does: it needs masters='disk'")
