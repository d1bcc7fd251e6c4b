"""What the profiler runs: a :class:`Mode` is one way to run the model, resident or offloaded.

Holds :class:`Mode` and :func:`offload_modes` (every combination of offload settings). Running a
mode and measuring it is :mod:`offload.profiling.measure`; running several in turn is
:mod:`offload.profiling.runner`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Mode:
    """One way to run the model.

    Attributes:
        kind: ``"resident"`` (the plain model on the device, in its own dtype) or ``"offload"``
            (wrapped in :class:`~offload.OffloadModel` with the settings below, which are its
            arguments of the same names; ignored for ``resident``).

    Raises:
        ValueError: an unknown kind or compute dtype, or ``num_slices`` or ``num_microbatches``
            that is not a positive int.
    """

    kind: str
    num_slices: int = 1
    num_microbatches: int = 1
    checkpoint_activation: bool = True
    compute_dtype: torch.dtype | None = None

    @classmethod
    def resident(cls) -> Mode:
        return cls("resident")

    def __post_init__(self) -> None:
        if self.kind not in ("resident", "offload"):
            raise ValueError(f"unknown mode kind {self.kind!r}; use 'resident' or 'offload'")
        if self.compute_dtype is not None and self.compute_dtype not in _DTYPE_NAMES:
            raise ValueError(f"compute_dtype must be None, torch.bfloat16 or torch.float16, got {self.compute_dtype}")
        # Checked here, not when OffloadModel is built: a bad mode fails before the first mode runs.
        for name in ("num_slices", "num_microbatches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @classmethod
    def offload(cls, num_slices: int = 3, num_microbatches: int = 1, checkpoint_activation: bool = True,
                compute_dtype: torch.dtype | None = None) -> Mode:
        return cls("offload", num_slices, num_microbatches, checkpoint_activation, compute_dtype)

    @property
    def label(self) -> str:
        return self.label_ran(self.num_slices)

    def label_ran(self, slices_ran: int) -> str:
        """The label of this mode once it ran as ``slices_ran`` slices: OffloadModel makes no more
        slices than the model has layers, so a mode asked for more says both, e.g.
        ``offload slices=7 (asked 100) mb=1 ckpt=on``, and two modes that ran alike do not read as
        different."""
        if self.kind == "resident":
            return "resident"
        checkpoint = "on" if self.checkpoint_activation else "off"
        precision = f" {_DTYPE_NAMES[self.compute_dtype]}" if self.compute_dtype is not None else ""
        asked = f" (asked {self.num_slices})" if slices_ran != self.num_slices else ""
        return f"offload slices={slices_ran}{asked} mb={self.num_microbatches} ckpt={checkpoint}{precision}"


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def offload_modes(slices: Sequence[int], microbatches: Sequence[int] = (1,), checkpoint: Sequence[bool] = (True,),
                  compute_dtypes: Sequence[torch.dtype | None] = (None,)) -> list[Mode]:
    """Every combination of the given offload settings, in order."""
    return [Mode.offload(s, m, c, d) for s in slices for m in microbatches for c in checkpoint for d in compute_dtypes]
