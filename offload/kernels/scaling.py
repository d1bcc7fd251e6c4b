"""A clip's scaling of some gradients, owed until something reads them: the one-pass kernel
multiplies them as it reads them for the update; any other reader gets them multiplied first
(Note: [Scaling in the update] in ``offload/optimizing/deferred_scaling.py``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


class OwedScaling:
    """``clip_grads_with_norm_``'s product, ``grad.mul_(coefficient)``, not yet done on ``grads``.

    Args:
        grads: host gradients (contiguous, distinct).
        coefficient: the clip's 0-d coefficient, on the CPU.
    """

    def __init__(self, grads: Sequence[torch.Tensor], coefficient: torch.Tensor) -> None:
        self.coefficient = coefficient
        self._owed = {g.data_ptr(): g for g in grads}
        # The memory the owed gradients live in: a tensor in none of it reads none of them, found
        # at once (an update's other operations take every parameter's step count, say).
        self._storages = {g.untyped_storage().data_ptr() for g in grads}

    def owes(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is, whole, one of the gradients still to be scaled."""
        owed = self._owed.get(tensor.data_ptr())
        return owed is not None and owed.dtype == tensor.dtype and owed.numel() == tensor.numel()

    def folds(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether every one of ``tensors`` is a whole float32 gradient still owed, so that a kernel
        can multiply them as it reads them (then :meth:`taken`)."""
        return self.coefficient.dtype == torch.float32 and all(self.owes(t) and t.dtype == torch.float32
                                                                  for t in tensors)

    def taken(self, tensors: Iterable[torch.Tensor]) -> None:
        """``tensors`` were scaled by a kernel as it read them."""
        for t in tensors:
            self._owed.pop(t.data_ptr(), None)

    def apply(self, tensors: Iterable[object]) -> None:
        """Scale, now, the owed gradients any of ``tensors`` reads (a view of one included), before
        an operation reads them."""
        for t in tensors:
            if (self._owed and isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type == "cpu"
                    and t.untyped_storage().data_ptr() in self._storages):
                for start in [k for k, g in self._owed.items() if _overlap(t, k, g)]:
                    self._scale(self._owed.pop(start))

    def apply_rest(self) -> None:
        """Scale every gradient still owed."""
        owed, self._owed = list(self._owed.values()), {}
        for grad in owed:
            self._scale(grad)

    def _scale(self, grad: torch.Tensor) -> None:
        with torch.no_grad():
            grad.mul_(self.coefficient)


def _overlap(t: torch.Tensor, start: int, grad: torch.Tensor) -> bool:
    """Whether ``t``'s memory overlaps ``grad``'s (contiguous, beginning at ``start``)."""
    if t.numel() == 0:
        return False
    end = t.data_ptr() + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()
    return t.data_ptr() < start + grad.numel() * grad.element_size() and start < end
