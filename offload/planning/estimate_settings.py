"""What :func:`~offload.planning.planner.estimate_memory` accepts: the optimizer's state per
parameter, and the settings :class:`~offload.OffloadModel` would refuse, refused with its words (a
prediction for a model that cannot be built would mislead), a model's dtypes under a compute dtype
included."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..arguments import int_at_least
from ..streams.dtype_refusals import refuse_narrow_masters, refuse_norms_in_another_dtype
from ..streams.host_storage import FLOAT32_LAYERS, keeping_their_dtype
from ..streams.sites import Site
from ..streams.slice_entries import Entry
from ..walk.slicing import layer_nbytes, partition

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


def check_dtypes(layers: object, compute_dtype: torch.dtype | None, num_slices: int) -> None:
    """Refuse, as :class:`~offload.OffloadModel` refuses it when it wraps ``layers`` (an
    ``nn.Module``; counts have no dtypes to refuse) cut into ``num_slices`` slices, a batch or
    instance norm in neither float32 nor ``compute_dtype``, or a parameter narrower than
    ``compute_dtype`` (Note: [Masters narrower than the compute dtype] in
    ``offload/streams/dtype_refusals.py``). The checks are the model's own, applied slice by slice
    in its order (``_set_device_dtypes`` in ``offload/streams/host_storage.py``), so the first
    refusal and its words are the model's.

    Raises:
        ValueError: what the model raises for the first slice it refuses.
    """
    if compute_dtype is None or not isinstance(layers, nn.Module):
        return
    modules = list(layers.children()) or [layers]
    held: set[int] = set()  # parameters an earlier slice holds: a later one borrows them
    for r in partition([layer_nbytes(layer) for layer in modules], num_slices):
        sliced = [modules[k] for k in r]
        refuse_norms_in_another_dtype([(path, m) for layer in sliced for path, m in layer.named_modules()
                                       if isinstance(m, FLOAT32_LAYERS)], compute_dtype)
        params = _parameter_entries(sliced)
        own = [e for e in params if id(e.tensor) not in held]
        refuse_narrow_masters(own + [e for e in params if id(e.tensor) in held], sliced,
                              keeping_their_dtype(sliced), compute_dtype, wrapping=True)
        held.update(id(e.tensor) for e in own)


def _parameter_entries(layers: Sequence[nn.Module]) -> list[Entry]:
    """The parameters registered in ``layers``, each once with its sites, in the order a slice
    collects them (``collect_entries`` in ``offload/streams/slice_entries.py``, without its
    warnings and its other refusals: the estimate asks only for the dtypes)."""
    sites: dict[int, tuple[torch.Tensor, list[Site]]] = {}
    for layer in layers:
        for module in layer.modules():
            for name, tensor in module._parameters.items():
                if tensor is not None:
                    sites.setdefault(id(tensor), (tensor, []))[1].append(Site(module, name, True))
    return [Entry(tensor, tuple(places), tensor.shape, tensor.dtype, tensor.dtype) for tensor, places in sites.values()]
