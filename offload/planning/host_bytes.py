"""The host memory bytes one optimizer step touches, by category: the count the planner's time
model and the benchmarks' bound both divide by a host memory bandwidth.

A step's host work is memory traffic: the optimizer reads and writes every streamed trainable
parameter's master, gradient and state (``update``); the compute-dtype shadow that loads read is
written from the masters (``shadow``: a pass of its own today, re-reading every master; none when
the update writes it in the same pass); the device writes the gradients into host memory
(``gradients``) and reads the shadow, or the masters without one, for every load (``loads``). The
copies are DMA traffic, not the CPU's, but they share the same DRAM with the update.

What it does not count: caches (every byte is counted once per pass, as STREAM counts a copy),
the boundary activations (a benchmark that measures the copy engine's bytes passes them with
:meth:`HostBytes.with_copies`), the disk tier's files, and an optimizer it does not know (it says
so rather than guess).

Example::

    >>> from offload.planning.host_bytes import host_bytes_per_step
    >>> count = host_bytes_per_step(1_000_000, compute_dtype=torch.bfloat16, gradient_dtype=torch.bfloat16,
    ...                             shadow_in_update=True)
    >>> count.per_parameter(1_000_000)["update"]   # 2 (gradient) + 8 (master) + 16 (moments) + 2 (shadow)
    28.0
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..streams.host_storage import keeping_their_dtype

#: Per-element state tensors each optimizer reads and writes in its update, by the names
#: :func:`~offload.estimate_memory` takes (AdamW's two moments, SGD's momentum buffer).
STATE_TENSORS = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0, None: 0}

#: Whether the library's host update writes the shadow in the pass that updates the masters. It
#: does for fused Adam, AdamW and SGD where the one-pass kernel builds (Note: [One-pass update] in
#: ``offload/kernels/one_pass.py``); other optimizers, or a machine where it does not build, cast the
#: updated masters into the shadow after the optimizer's step, a second pass over every master.
SHADOW_IN_UPDATE = True

#: Whether the device offloads a parameter's gradient in the compute dtype, which the host update
#: then reads. Today it does not: it casts the gradient up to the parameter's own dtype first.
GRADIENTS_IN_COMPUTE_DTYPE = False


@contextlib.contextmanager
def shadow_pass(in_update: bool) -> Iterator[None]:
    """Count (and so plan) the shadow as written by the update (``in_update``) or by a pass of its
    own, whatever this library's update does: to predict a run measured before the one-pass
    update, or one without it."""
    global SHADOW_IN_UPDATE
    saved, SHADOW_IN_UPDATE = SHADOW_IN_UPDATE, in_update
    try:
        yield
    finally:
        SHADOW_IN_UPDATE = saved


@dataclass(frozen=True)
class HostBytes:
    """Host memory bytes one step touches (read plus written), by category.

    Attributes:
        update: the optimizer's pass: masters read and written, gradients read, per-element state
            read and written, and the shadow written when the same pass writes it.
        shadow: a separate pass writing the shadow: every master read, the shadow written
            (0 without a compute dtype, or when the update writes it).
        gradients: the gradients written into host memory by the device's offloads.
        loads: the shadow (or the masters) read by the loads to the device.
    """

    update: int = 0
    shadow: int = 0
    gradients: int = 0
    loads: int = 0

    @property
    def host_update(self) -> int:
        """What the host's own update work touches: the update and the shadow pass."""
        return self.update + self.shadow

    @property
    def total(self) -> int:
        return self.update + self.shadow + self.gradients + self.loads

    def with_copies(self, loaded: int, offloaded: int) -> HostBytes:
        """These bytes with the copies' categories measured (a copy engine's loaded and offloaded
        bytes, boundary activations included) instead of counted."""
        return dataclasses.replace(self, loads=int(loaded), gradients=int(offloaded))

    def per_parameter(self, parameters: int) -> dict[str, float]:
        """Each category and the total over ``parameters``."""
        count = max(parameters, 1)
        return {name: value / count for name, value in self.to_json().items()}

    def to_json(self) -> dict[str, int]:
        return dataclasses.asdict(self) | {"total": self.total}


def host_bytes_per_step(parameters: int | Mapping[torch.dtype, int] | nn.Module, *,
                        param_dtype: torch.dtype = torch.float32,
                        compute_dtype: torch.dtype | None = None, optimizer: str | None = "adamw",
                        gradient_dtype: torch.dtype | None = None,
                        shadow_in_update: bool | None = None, amsgrad: bool = False,
                        loads_per_step: float = 2.0) -> HostBytes:
    """Count the host memory bytes one optimizer step touches over the streamed trainable parameters.

    Args:
        parameters: the streamed trainable parameters (resident slices' and frozen parameters
            left out: they have no host update), as a count in ``param_dtype``, a count per dtype,
            or a module (its parameters that require grad, each once, in its own dtype; those of
            its batch and instance norms, which keep their dtype under a compute dtype as
            :class:`~offload.OffloadModel` keeps them, without a shadow).
        compute_dtype: as :class:`~offload.OffloadModel` takes it: a shadow in that dtype, which the
            loads read, for each floating-point parameter in another dtype (``None``: no shadow;
            the loads read the masters, as they do for a parameter already in ``compute_dtype``).
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd-momentum"``, ``"sgd"`` or ``None`` (no update).
        gradient_dtype: the gradients' dtype on the host (``None``: as the library offloads them,
            :data:`GRADIENTS_IN_COMPUTE_DTYPE`).
        shadow_in_update: the update writes the shadow in its own pass (no separate shadow pass;
            ``None``: as the library's update does, :data:`SHADOW_IN_UPDATE`).
        amsgrad: Adam's or AdamW's third state tensor (the maximum of the second moments).
        loads_per_step: loads of each parameter a step (the forward's one and the backward's
            reload; a little less where the backward finds slices still in the slots).

    Raises:
        ValueError: an optimizer it does not count (say which of the known ones it moves like),
            ``amsgrad`` without Adam or AdamW, or a negative count.
    """
    if optimizer not in STATE_TENSORS:
        known = sorted(k for k in STATE_TENSORS if k)
        raise ValueError(f"host bytes of optimizer {optimizer!r} are not known; pass the one of {known} (or None) "
                         f"that reads and writes the same per-element state")
    if amsgrad and optimizer not in ("adam", "adamw"):
        raise ValueError(f"amsgrad is Adam's and AdamW's option, not {optimizer!r}'s")
    counts, kept = _counts(parameters, param_dtype)
    if any(n < 0 for n in counts.values()):
        raise ValueError(f"parameter counts must be >= 0, got {counts}")
    if shadow_in_update is None:
        shadow_in_update = SHADOW_IN_UPDATE
    # Those that keep their dtype are counted as without a compute dtype: no shadow.
    groups = ([(dtype, n, compute_dtype) for dtype, n in counts.items()]
              + [(dtype, n, None) for dtype, n in kept.items()])
    total = HostBytes()
    for dtype, n, cast_to in groups:
        total = _add(total, _per_element(dtype, cast_to, optimizer, gradient_dtype, shadow_in_update,
                                         amsgrad, loads_per_step), n)
    return total


def _counts(parameters: int | Mapping[torch.dtype, int] | nn.Module, param_dtype: torch.dtype
            ) -> tuple[dict[torch.dtype, int], dict[torch.dtype, int]]:
    """Counts per dtype of the parameters a compute dtype casts, and of those that keep their own
    (a module's batch and instance norms', decided by the test ``SliceStorage`` applies)."""
    if isinstance(parameters, int):
        return {param_dtype: parameters}, {}
    if not isinstance(parameters, nn.Module):
        return dict(parameters), {}
    keeping = keeping_their_dtype([parameters])
    counts: dict[torch.dtype, int] = {}
    kept: dict[torch.dtype, int] = {}
    for p in parameters.parameters():
        if p.requires_grad:
            into = kept if id(p) in keeping else counts
            into[p.dtype] = into.get(p.dtype, 0) + p.numel()
    return counts, kept


def _per_element(dtype: torch.dtype, compute_dtype: torch.dtype | None, optimizer: str | None,
                 gradient_dtype: torch.dtype | None, shadow_in_update: bool, amsgrad: bool,
                 loads_per_step: float) -> tuple[float, float, float, float]:
    """One element's bytes in each category, in :class:`HostBytes`' order."""
    master = dtype.itemsize
    # Only floating-point parameters in another dtype get a shadow (as OffloadModel casts them: a
    # slice already in the compute dtype loads from its masters); the loads read it.
    casts = compute_dtype is not None and dtype.is_floating_point and dtype != compute_dtype
    shadow = compute_dtype.itemsize if casts else 0
    offloaded = compute_dtype if GRADIENTS_IN_COMPUTE_DTYPE and shadow else dtype
    gradient = (gradient_dtype or offloaded).itemsize
    states = STATE_TENSORS[optimizer] + amsgrad
    if optimizer is None:  # gradients still land, for the user's own use of them
        return 0.0, 0.0, gradient, loads_per_step * (shadow or master)
    # The masters and each state tensor read and written, the gradient read.
    update = 2 * master + gradient + 2 * states * master
    shadow_pass = 0
    if shadow and shadow_in_update:
        update += shadow
    elif shadow:
        shadow_pass = master + shadow
    return update, shadow_pass, gradient, loads_per_step * (shadow or master)


def _add(total: HostBytes, per_element: tuple[float, float, float, float], n: int) -> HostBytes:
    update, shadow, gradients, loads = (round(b * n) for b in per_element)
    return HostBytes(total.update + update, total.shadow + shadow, total.gradients + gradients, total.loads + loads)
