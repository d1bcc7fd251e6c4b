"""How each slice keeps what its backward needs: recomputed, kept on the device, or offloaded.

Note: [Three ways to keep a slice's activations]
    Backward needs, for every slice and microbatch, the tensors autograd saved while the slice ran
    forward. There are three ways to have them then, chosen per slice:

    1. *Recompute* (``checkpoint_activation=True``, the default): forward keeps only the boundary
       activation (offloaded to the host) and backward re-runs the slice with the same generator,
       autocast and buffer state. Costs one more forward of the slice on the device; moves one
       boundary activation each way.
    2. *Kept graph* (``checkpoint_activation=False``): autograd's graph stays on the device until
       backward, as in the plain model. Costs device memory that grows with depth; moves nothing.
    3. *Offload* (:class:`OffloadActivations`): autograd's graph is kept, but every tensor it saves
       goes to pinned host memory as it is produced and comes back, one step ahead, before the
       slice's backward; nothing is re-run. Costs link traffic (every saved byte, each way) and
       host memory; the device holds the saved tensors of at most the run computing and the one
       being loaded. Tensors that are the slice's parameters (or views of them) are not copied:
       they are read from the slot again (slot references in ``offload/streams/device_slots.py``).
       Tensors under ``min_bytes`` stay on the device: their copies cost more in latency than the
       memory they free.

    Offload beats recompute when moving a run's saved bytes takes less time than the recompute's
    compute (``docs/memory.md``, "Offloading activations instead of recomputing").

    The last microbatch of the last slice keeps its graph on the device whatever the policy says:
    it is the first thing backward needs, so neither a recompute nor a round trip over the link
    could start earlier than it is needed.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class ActivationMode(enum.Enum):
    """How one slice keeps what its backward needs (Note: [Three ways to keep a slice's activations])."""

    RECOMPUTE = enum.auto()  # boundary activation to the host; the slice runs again in backward
    KEEP = enum.auto()  # the graph and its saved tensors stay on the device
    OFFLOAD = enum.auto()  # the graph is kept; its saved tensors go to the host and come back


#: Default ``min_bytes``: below this, a saved tensor's copy costs more (a launch, an event, a pooled
#: buffer) than the device memory it frees.
DEFAULT_MIN_BYTES = 64 * 1024


@dataclass(frozen=True)
class OffloadActivations:
    """Which slices offload their saved activations to the host instead of recomputing them
    (Note: [Three ways to keep a slice's activations]).

    Give either ``slices`` or ``last``. Slices not chosen keep activations as
    ``checkpoint_activation`` says (recompute, or a graph kept on the device).

    Trade-off: an offloaded slice runs forward once instead of twice, and moves every tensor its
    layers save for backward (typically several times its boundary activation) to the host and
    back; it wins where the link is fast compared with the device's compute (large batches, long
    sequences, PCIe 5, NVLink-C2C). Host memory grows by those saved tensors, in pooled pinned
    buffers reused from step to step.

    Args:
        slices: indices of the slices to offload (negative indices count from the end).
        last: offload the last ``last`` slices (the ones backward reaches first, whose
            activations wait the least on the host).
        min_bytes: saved tensors smaller than this stay on the device.

    Raises:
        ValueError: both or neither of ``slices`` and ``last``, a negative ``last`` or
            ``min_bytes``, or (when the model is built) an index out of range.
        TypeError: an argument of the wrong type.

    Example::

        >>> model = OffloadModel(layers, device="cuda", num_slices=8,
        ...                      offload_activations=OffloadActivations(last=3))
    """

    slices: tuple[int, ...] | None = None
    last: int | None = None
    min_bytes: int = DEFAULT_MIN_BYTES

    def __post_init__(self) -> None:
        if (self.slices is None) == (self.last is None):
            raise ValueError("OffloadActivations takes exactly one of slices=[...] (slice indices) or last=k "
                             "(the last k slices)")
        if self.slices is not None:
            if isinstance(self.slices, (str, bytes)) or not isinstance(self.slices, Sequence):
                raise TypeError(f"slices must be a list of slice indices, got {type(self.slices).__name__}")
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in self.slices):
                raise TypeError(f"slices must hold ints, got {list(self.slices)!r}")
            object.__setattr__(self, "slices", tuple(self.slices))
        if self.last is not None and (not isinstance(self.last, int) or isinstance(self.last, bool)
                                      or self.last < 0):
            raise ValueError(f"last must be a non-negative int, got {self.last!r}")
        if not isinstance(self.min_bytes, int) or isinstance(self.min_bytes, bool) or self.min_bytes < 0:
            raise ValueError(f"min_bytes must be a non-negative int, got {self.min_bytes!r}")

    def chosen(self, num_slices: int) -> frozenset[int]:
        """The indices of the slices to offload in a model of ``num_slices`` slices.

        Raises:
            ValueError: an index out of range.
        """
        if self.last is not None:
            return frozenset(range(max(0, num_slices - self.last), num_slices))
        assert self.slices is not None
        bad = [i for i in self.slices if not -num_slices <= i < num_slices]
        if bad:
            raise ValueError(f"OffloadActivations(slices={list(self.slices)}) names slice(s) {bad}, but the model "
                             f"has {num_slices} slices (indices 0 to {num_slices - 1}, or negative from the end)")
        return frozenset(i % num_slices for i in self.slices)


@dataclass(frozen=True)
class ActivationPlan:
    """What every slice of one model does with its activations, resolved from the model's settings.

    Attributes:
        modes: one per slice.
        min_bytes: saved tensors smaller than this stay on the device in an offloaded slice.
    """

    modes: tuple[ActivationMode, ...]
    min_bytes: int = DEFAULT_MIN_BYTES

    @classmethod
    def of(cls, checkpoint_activation: bool, offload: OffloadActivations | None, num_slices: int) -> ActivationPlan:
        otherwise = ActivationMode.RECOMPUTE if checkpoint_activation else ActivationMode.KEEP
        if offload is None:
            return cls((otherwise,) * num_slices)
        chosen = offload.chosen(num_slices)
        modes = tuple(ActivationMode.OFFLOAD if i in chosen else otherwise for i in range(num_slices))
        return cls(modes, offload.min_bytes)

    @property
    def recomputes(self) -> bool:
        """Whether any slice is recomputed (only recomputes need the layers' plain attributes)."""
        return ActivationMode.RECOMPUTE in self.modes

    def check_recomputed(self, four_bit: Sequence[bool]) -> None:
        """Refuse a kept or offloaded graph for the slices marked in ``four_bit`` (those holding a
        quantized weight): rule 5 of Note: [Quantized weights] in ``offload/streams/quantized.py``.

        Raises:
            ValueError: such a slice is not recomputed.
        """
        for index, (mode, quantized) in enumerate(zip(self.modes, four_bit)):
            if quantized and mode is not ActivationMode.RECOMPUTE:
                how = "keep its graph (checkpoint_activation=False)" if mode is ActivationMode.KEEP else \
                    "offload its saved activations (OffloadActivations)"
                raise ValueError(
                    f"slice {index} holds quantized weights (bitsandbytes Linear4bit or Linear8bitLt) and would {how}; "
                    "bitsandbytes keeps a quantized weight on its autograd context, where a later slot is never seen, "
                    "so such slices are recomputed: use checkpoint_activation=True (the default), and "
                    "OffloadActivations only for slices without quantized weights")
