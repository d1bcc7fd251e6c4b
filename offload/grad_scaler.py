"""``offload.GradScaler``: ``torch.amp.GradScaler`` made correct for gradients that live on the host.

Note: [Loss scaling with host gradients]
    ``torch.amp.GradScaler`` keeps its scale on the loss's device and brings it, and the inf flag,
    to each gradient's device with ``non_blocking=True``. For a device gradient that is ordered by
    the stream. For a host gradient (an OffloadModel's ``.grad``) it is a device-to-host copy into
    a pinned block that the CPU kernel (``_amp_foreach_non_finite_check_and_unscale_``) reads at
    once, before the copy has landed if kernels are still queued ahead of it: the gradients are
    multiplied by whatever the block held, and the copy, landing late, overwrites the flag the
    kernel set, so an overflow no longer skips the step. The fused path has the same race twice:
    ``GradScaler.step`` checks for infs that way, and a fused optimizer over host parameters
    brings ``grad_scale`` to the host with another non-blocking copy.

    This subclass brings the scale and the flag to the host with blocking copies (a scalar each,
    once per step: the wait is for the compute queued before, which ``step()`` waits for anyway
    when it reads the flag), and hands a fused optimizer with host parameters its ``grad_scale``
    and ``found_inf`` on the host. Gradients on a device are handled as the parent does. The
    results are the parent's, bit for bit, wherever the parent's copies land in time.

    ``unscale_`` also forgets the norms computed in backward of the gradients it unscales (Note:
    [Norms from backward] in ``offload/optimizing/backward_norms.py``): they are the scaled
    values', and the kernel leaves the version counters that would tell ``clip_grad_norm_`` so.

    A plain ``torch.amp.GradScaler`` stepping host gradients while its scale is on CUDA warns once
    (``warn_about_plain_grad_scalers``, installed when an OffloadModel is built on CUDA).
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections import defaultdict
from typing import Any

import torch
from torch.amp.grad_scaler import OptState
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .clipping import forget_norms_unscaled

_HOST = torch.device("cpu")


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor``, complete when this returns."""
    # Blocking: the CPU reads it next (Note: [Loss scaling with host gradients]).
    return tensor.to(_HOST, copy=True)


def _has_host_params(optimizer: torch.optim.Optimizer) -> bool:
    return any(p.device.type == "cpu" for group in optimizer.param_groups for p in group["params"])


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for host gradients: use it instead of ``torch.amp.GradScaler``
    with an :class:`~offload.OffloadModel` on CUDA. See Note: [Loss scaling with host gradients].

    It takes the same arguments and is used the same way; its ``state_dict()`` loads into
    ``torch.amp.GradScaler`` and back. Cost: one blocking copy of a scalar per ``unscale_`` and
    per fused ``step``.

    Example::

        >>> scaler = offload.GradScaler("cuda")
        >>> scaler.scale(loss).backward()
        >>> scaler.unscale_(optimizer)
        >>> scaler.step(optimizer)
        >>> scaler.update()
    """

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        # The parent's loop, with the scale and flag for host gradients copied by blocking copies.
        grads: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    if not allow_fp16 and param.grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    if param.grad.is_sparse:
                        if param.grad.dtype is torch.float16:
                            # Duplicate indices of scaled fp16 values may overflow once summed: check the sum.
                            param.grad = param.grad.coalesce()
                        to_unscale = param.grad._values()
                    else:
                        to_unscale = param.grad
                    grads[to_unscale.device][to_unscale.dtype].append(to_unscale)
            # Norms taken in backward (norms_in_backward) are of the scaled values, and the unscaling
            # kernel leaves the version counters that would tell a clip so as they were.
            forget_norms_unscaled(optimizer)
            found_infs: dict[torch.device, torch.Tensor] = {}
            for device, by_dtype in grads.items():
                if device.type == "cpu":
                    device_inv_scale, found_infs[device] = _to_host(inv_scale), _to_host(found_inf)
                else:
                    # Stream-ordered on the device, as the parent does it.
                    device_inv_scale = inv_scale.to(device, non_blocking=True, copy=True)
                    found_infs[device] = found_inf.to(device, non_blocking=True, copy=True)
                for same_dtype in by_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(same_dtype, found_infs[device], device_inv_scale)
        return found_infs

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``torch.amp.GradScaler.step``; a fused optimizer with host parameters gets ``grad_scale``
        and ``found_inf`` on the host."""
        if not (self._enabled and getattr(optimizer, "_step_supports_amp_scaling", False)
                and "closure" not in kwargs and _has_host_params(optimizer)):
            return super().step(optimizer, *args, **kwargs)
        scale, _ = self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.READY:
            self._check_inf_per_device(optimizer)
        # From a tensor: with no gradient checked the parent's sum is the int 0, which is no flag to hand over.
        found_inf = sum((_to_host(flag) for flag in state["found_inf_per_device"].values()),
                        torch.zeros((), dtype=torch.float32))
        # As the parent: after unscale_ the gradients are unscaled already; else the optimizer unscales.
        optimizer.grad_scale = (getattr(optimizer, "grad_scale", None) if state["stage"] is OptState.UNSCALED
                                else _to_host(scale) * getattr(optimizer, "grad_scale", 1))
        optimizer.found_inf = found_inf
        try:
            result = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale, optimizer.found_inf
        state["stage"] = OptState.STEPPED
        return result


# -- the warning for a plain scaler ---------------------------------------------------------------

_installed = False
_warned = False
_install_lock = threading.Lock()


def warn_about_plain_grad_scalers() -> None:
    """From now on, warn once when a plain ``torch.amp.GradScaler`` whose scale is on a device steps
    an optimizer with host gradients (a global optimizer step pre-hook; installed once)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        _installed = True
    register_optimizer_step_pre_hook(_check_scaler)


def _scale_on_a_device(scaler: torch.amp.GradScaler) -> bool:
    scale = getattr(scaler, "_scale", None)
    return scale is not None and scale.device.type != "cpu"


#: The code of the scalers' methods that call ``optimizer.step`` (this module's ``step`` calls it
#: itself for a fused optimizer over host parameters).
_SCALER_STEP_CODE = frozenset(
    [getattr(torch.amp.GradScaler, name).__code__ for name in ("step", "_maybe_opt_step")
     if hasattr(torch.amp.GradScaler, name)] + [GradScaler.step.__code__])


def _calling_scaler(depth: int = 8) -> torch.amp.GradScaler | None:
    """The ``torch.amp.GradScaler`` whose ``step`` called the optimizer, if one did (called from
    the optimizer's ``step`` or from a hook of it, which is two frames up).

    Only a scaler method's own frame has its locals read: reading ``f_locals`` of any other frame
    (the user's training loop) would leave a snapshot of its variables on that frame, keeping
    alive whatever the loop deletes afterwards (``del optimizer``) until the function returns.
    """
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code in _SCALER_STEP_CODE:
            owner = frame.f_locals.get("self")
            return owner if isinstance(owner, torch.amp.GradScaler) else None
        frame = frame.f_back
    return None


def _check_scaler(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    global _warned
    if _warned:
        return
    scaler = _calling_scaler()
    if scaler is None or isinstance(scaler, GradScaler) or not _scale_on_a_device(scaler):
        return
    if not any(p.grad is not None and p.grad.device.type == "cpu"
               for group in optimizer.param_groups for p in group["params"]):
        return
    _warned = True
    warnings.warn("a torch.amp.GradScaler with its scale on the device is stepping gradients on the host (an "
                  "OffloadModel's): it copies the scale and the inf flag to the host without waiting, and the CPU "
                  "may read them before they land, unscaling by a stale value and missing an overflow. Use "
                  "offload.GradScaler instead (same arguments, same state_dict)", RuntimeWarning, stacklevel=4)
