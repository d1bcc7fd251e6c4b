"""The state a recompute must reproduce: random number generators and autocast.

Captured once per slice and microbatch in forward, restored around that slice's recompute in
backward. Restoring the CPU generator alone is not enough (dropout on CUDA draws from the device
generator), and restoring one state for the whole model is wrong (every slice and microbatch
starts from a different point of the sequence).
"""

from __future__ import annotations

import contextlib
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
    """
    previous = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(previous)


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


@contextlib.contextmanager
def replaying_rng(device: torch.device, cpu_state: torch.Tensor, device_state: torch.Tensor | None) -> Iterator[None]:
    """Run the block from the captured generator states; the generators continue afterwards
    exactly where they were before the block."""
    devices = [device] if device_state is not None else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.set_rng_state(cpu_state)
        if device_state is not None:
            torch.cuda.set_rng_state(device_state, device)
        yield
