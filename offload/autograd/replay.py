"""The state a recompute must reproduce: random number generators and autocast.

Captured once per slice and microbatch in forward, restored around that slice's recompute in
backward. Restoring the CPU generator alone is not enough (dropout on CUDA draws from the device
generator), and restoring one state for the whole model is wrong (every slice and microbatch
starts from a different point of the sequence). Python's own generator, and NumPy's global one
once NumPy is loaded, are part of it (:class:`LibraryRng`): a layer drop decided by
``random.random()`` must take the same branch in the recompute. A generator a layer keeps as an
attribute (``torch.Generator``, ``random.Random``, NumPy's) is restored with the layer's attributes
(Note: [Attribute state]). An optimizer's draws are kept out of the window a recompute replays
(Note: [An optimizer that draws random numbers] in ``offload/optimizing/random_draws.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class AutocastState:
    """Autocast settings of the compute device and of the CPU at capture time."""

    device_type: str
    device_kwargs: dict[str, Any] | None
    cpu_kwargs: dict[str, Any]

    @staticmethod
    def capture(device: torch.device) -> AutocastState:
        def kwargs(device_type: str) -> dict[str, Any]:
            return {
                "enabled": torch.is_autocast_enabled(device_type),
                "dtype": torch.get_autocast_dtype(device_type),
                "cache_enabled": torch.is_autocast_cache_enabled(),
            }

        device_kwargs = (
            kwargs(device.type)
            if device.type != "cpu" and torch.amp.is_autocast_available(device.type)
            else None
        )
        return AutocastState(device.type, device_kwargs, kwargs("cpu"))

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.device_kwargs is not None:
                stack.enter_context(torch.autocast(self.device_type, **self.device_kwargs))
            stack.enter_context(torch.autocast("cpu", **self.cpu_kwargs))
            yield


@contextlib.contextmanager
def autocast_cache_disabled() -> Iterator[None]:
    """Run the block without autocast's cache of casted weights.

    Autocast keeps the half-precision copy of every parameter it casts while the parameter
    requires grad, until the caller's outermost ``torch.autocast`` block ends. The checkpointed
    forward runs every slice on parameters that require grad (Note: [Boundary gradients] in
    ``slice_graph.py``), so with the cache on, each slice's device copy of its weights in half
    precision would stay on the device until then: half the model, resident, which is what
    offloading avoids. Without the cache every use casts afresh, to the same values; that run
    keeps no graph, so how the casts would meet in backward does not matter there (the recompute,
    which backward uses, keeps the cache as the plain model does).

    Only while autocast is on: without it nothing is cast, so the cache is unused, and the flag is
    part of the global state Dynamo guards a compiled graph on. Flipping it there made every layer
    compiled before wrapping compile once more for this run, and the extra graphs took Dynamo
    over its recompile limit, past which layers run uncompiled and round differently.

    Under autocast the flag is still flipped, at the cost of that second graph per compiled layer.
    Keeping it on and emptying the cache after the slice would drop the casts the caller's own
    weights made earlier in the same autocast block (PyTorch can empty only the whole cache): a
    weight used again after this model would be cast twice, and its two gradients would meet in
    full precision instead of in half precision as in the plain model.
    """
    if not _autocast_on():
        yield
        return
    previous = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(previous)


def _autocast_on() -> bool:
    """Whether any device's autocast is on (the cache serves them all)."""
    return any(torch.is_autocast_enabled(device_type) for device_type in _AUTOCAST_DEVICE_TYPES
               if torch.amp.is_autocast_available(device_type))


#: The device types whose autocast this process may turn on.
_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla", "ipu", "maia", "privateuseone")


def device_generator_initialized(device: torch.device) -> bool:
    """Whether reading the device generator is free of side effects.

    Don't eagerly initialize the CUDA context by accident: a model whose compute device is the CPU
    must not touch CUDA at all.
    """
    return device.type == "cuda" and torch.cuda.is_initialized()


def capture_rng(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU generator state and, when the compute device is CUDA, its generator state."""
    cpu_state = torch.get_rng_state()
    device_state = torch.cuda.get_rng_state(device) if device_generator_initialized(device) else None
    return cpu_state, device_state


@dataclass(frozen=True)
class LibraryRng:
    """The global generators outside PyTorch that a layer may draw from: Python's ``random`` and,
    when NumPy is loaded, ``numpy.random``'s (never imported for this); :class:`LibraryRngCapture`
    takes them. Each state is about 8 KB, kept per checkpointed run until backward."""

    python: Any
    numpy: Any | None

    def same_as(self, other: LibraryRng) -> bool:
        """Whether the two are the same states (``False`` where that cannot be told cheaply)."""
        if self.python != other.python or (self.numpy is None) != (other.numpy is None):
            return False
        if self.numpy is other.numpy:
            return True
        if not (isinstance(self.numpy, tuple) and isinstance(other.numpy, tuple)):
            return False  # another bit generator's dict: replayed, which is never wrong
        # NumPy's legacy state: (name, key array, position, cached Gaussian flag, cached Gaussian).
        return (self.numpy[0] == other.numpy[0] and self.numpy[2:] == other.numpy[2:]
                and bool((self.numpy[1] == other.numpy[1]).all()))

    def set(self) -> None:
        random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)


class LibraryRngCapture:
    """Takes :class:`LibraryRng` before each checkpointed run of one forward.

    Python's state costs about 12 µs to take; NumPy's (``get_state``) about 40 µs, so it is taken
    again only when its generator moved: a run that draws nothing from NumPy costs a 2.5 KB read of
    the generator's raw state instead. Unchanged raw state is the same whole state unless a Gaussian
    was cached (a cached one is handed out without moving anything else), so a state with one
    cached is taken afresh every time.

    Not seen: a layer that sets these states itself in forward. ``numpy.random.set_state`` may
    bring a cached Gaussian back without moving the raw state; and a run that draws and then puts
    a generator back as it found it is judged to have drawn nothing (ForwardRecords.save_rng),
    and its recompute draws from where the generator is at backward.
    """

    def __init__(self) -> None:
        self._numpy_state: Any = None
        self._numpy_raw: bytes | None = None

    def __call__(self) -> LibraryRng:
        numpy = sys.modules.get("numpy")
        return LibraryRng(random.getstate(), None if numpy is None else self._numpy(numpy))

    def _numpy(self, numpy: Any) -> Any:
        raw = _mt19937_raw_state(numpy)
        state = self._numpy_state
        if raw is None or raw != self._numpy_raw or not isinstance(state, tuple) or state[3]:
            state = numpy.random.get_state()
            self._numpy_state, self._numpy_raw = state, raw
        return state


#: MT19937's raw state: 624 32-bit words and the position in them.
_MT19937_STATE_BYTES = 624 * 4 + 4


def _mt19937_raw_state(numpy: Any) -> bytes | None:
    """The raw state of NumPy's global generator where it is the default MT19937 and NumPy can
    name it (``get_bit_generator``, NumPy 1.25 and later); else ``None``."""
    get_bit_generator = getattr(numpy.random, "get_bit_generator", None)
    if get_bit_generator is None:
        return None
    generator = get_bit_generator()
    if type(generator).__name__ != "MT19937":
        return None
    return ctypes.string_at(generator.ctypes.state_address, _MT19937_STATE_BYTES)


@contextlib.contextmanager
def replaying_rng(device: torch.device, cpu_state: torch.Tensor, device_state: torch.Tensor | None,
                  library: LibraryRng | None = None) -> Iterator[None]:
    """Run the block from the captured generator states; the generators continue afterwards
    exactly where they were before the block."""
    devices = [device] if device_state is not None else []
    found = None if library is None else LibraryRngCapture()()
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.set_rng_state(cpu_state)
        if device_state is not None:
            torch.cuda.set_rng_state(device_state, device)
        if library is not None:
            library.set()
        try:
            yield
        finally:
            if found is not None:
                found.set()
