"""The stream-ordering checker as one context manager."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import TracebackType

import torch

from ..streams.backend import using_backend
from .dispatch import AccessRecorder
from .memory import DEVICE, MemoryTracker, Race
from .simulator import Dependency, SimulatedBackend


class StreamOrderingError(RuntimeError):
    """Raised at the offending operation when the checker is asked to fail fast."""


class StreamChecker:
    """Run a block with simulated CUDA stream semantics on the CPU and check every access.

    Models built inside the block (``OffloadModel(..., device="cpu")``) take the asynchronous code
    path, on a simulated backend whose copies are deferred (see ``simulator.py``); every tensor
    operation in the block, the model's and the caller's, is checked for races against them.

    Args:
        schedule: when deferred copies run: ``"late"``, ``"issue"`` or ``"random"``.
        seed: seed of the random schedule.
        fail_fast: raise :class:`StreamOrderingError` at the first race instead of collecting.
        leave_out: dependencies to skip, to prove that the checker notices each one missing.
        device: the simulated device, which models built inside name. On ``"cpu"`` a CPU tensor
            the caller passes in is on the device already. ``"cpu:0"`` is another device as far
            as the package's comparisons go (``torch.device("cpu", 0) != torch.device("cpu")``),
            so a caller's CPU input takes the way it takes to a GPU: copied on the host into a
            pooled pinned buffer, then loaded. Compute's own tensors compare as not on that
            device either, so only models that recompute no slice run there as on a GPU
            (``checkpoint_activation=False``, or walks without a graph): a checkpoint would keep
            its boundary activations as host tensors and stage them on the host for the recompute.

    Attributes:
        races: what was found, in order, without repeats.
        dependencies: every ordering the copy engine asked for.

    Example::

        >>> with StreamChecker(schedule="late") as checker:
        ...     model = OffloadModel(layers, device="cpu", num_slices=3)
        ...     model(x).sum().backward()
        >>> assert not checker.races, checker.summary()
    """

    def __init__(self, schedule: str = "late", seed: int = 0, fail_fast: bool = False,
                 leave_out: Callable[[Dependency], bool] | None = None, device: torch.device | str = "cpu") -> None:
        self.races: list[Race] = []
        self._seen: set[Race] = set()
        self.fail_fast = fail_fast
        self.tracker = MemoryTracker(self._report)
        self.backend = SimulatedBackend(self.tracker, self._report, schedule, seed, leave_out, device)
        self._stack = contextlib.ExitStack()

    @property
    def dependencies(self) -> set[Dependency]:
        return self.backend.dependencies

    @property
    def left_out(self) -> set[Dependency]:
        """The dependencies actually skipped (a mutation that skipped nothing proves nothing)."""
        return self.backend.left_out

    def _report(self, race: Race) -> None:
        if race in self._seen:
            return
        self._seen.add(race)
        self.races.append(race)
        if self.fail_fast:
            raise StreamOrderingError(str(race))

    def on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Declare ``tensor`` device memory, as ``tensor.to(device)`` would make it on a GPU:
        operations on it count as compute from now on. Returns it."""
        record = self.tracker.tracked(tensor)
        if record is not None:
            record.where = DEVICE
        return tensor

    def summary(self, limit: int = 20) -> str:
        lines = [f"{len(self.races)} stream-ordering problem(s):"] + [f"  {race}" for race in self.races[:limit]]
        return "\n".join(lines)

    def __enter__(self) -> StreamChecker:
        self._stack.enter_context(using_backend(self.backend))
        self._stack.enter_context(AccessRecorder(self.backend))
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        try:
            # What is still queued runs eventually; the program has ended.
            self.backend.run_all()
            self.backend.collect()
        finally:
            self._stack.close()
