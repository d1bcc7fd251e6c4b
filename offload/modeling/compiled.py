"""``OffloadModel`` under ``torch.compile`` and ``torch.export``: its walk runs eagerly, a graph
break at the model's call, and an export or ``torch.jit.trace`` of the model is refused.
:class:`EagerUnderDynamo` also runs ``OffloadOptimizer.step`` eagerly
(``offload/optimizing/eager_step.py``).

Note: [Compiled around the walk]
    Under ``torch.compile(model)`` Dynamo would trace into the walk: the copy engine, its events
    and pooled buffers, which it cannot trace (fake tensors of the pool's sizes fail) and which
    gains nothing from it. The walk runs eagerly instead, a graph break at the model's call;
    layers compiled themselves (``torch.compile(layer)`` before wrapping) compile as they would
    anywhere. The eager version is made on the first construction, outside any tracing (Dynamo would
    trace the making, and warn); importing Dynamo takes a second, which the first ``torch.optim``
    step takes anyway. ``torch.compile(model, fullgraph=True)`` refuses the break: its error gives
    :data:`EAGER_RUN_REASON` (torch 2.8 and later take a reason).

Note: [Exported or traced]
    ``torch.export.export`` (non-strict, the default) runs the forward on fake tensors with no
    Dynamo to honour the graph break, so the walk reached a fake tensor's data pointer; strict
    export gave ``fullgraph=True``'s message, about compiling; ``torch.jit.trace`` failed inside
    PyTorch (``unordered_map::at``). None named OffloadModel. The walk copies through host memory
    and cannot be part of an exported program, so forward refuses with :data:`EXPORT_REFUSED`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

#: What ``torch.compile(model, fullgraph=True)`` says of the graph break at the model's call.
EAGER_RUN_REASON = (
    "OffloadModel's walk (copies to and from host memory, slice by slice) runs eagerly, outside the compiled "
    "graph, so the wrapped model cannot compile with fullgraph=True. Compile the layers before wrapping them "
    "(OffloadModel(nn.Sequential(*[torch.compile(layer) for layer in layers]), ...)), or compile the wrapped "
    "model without fullgraph=True (docs/api.md, Limitations)")

#: Why an OffloadModel is not exported or traced, and what to do (Note: [Exported or traced]).
EXPORT_REFUSED = (
    "OffloadModel cannot be exported (torch.export) or traced (torch.jit.trace): its walk copies through host "
    "memory, slice by slice, and runs eagerly; OffloadModel only trains and infers eagerly (or under "
    "torch.compile, with a graph break at its call). Export the plain layers instead, the nn.Sequential you "
    "wrapped, with the trained weights (docs/api.md, Limitations)")


class EagerUnderDynamo:
    """``fn``, run eagerly when Dynamo traces its call (Note: [Compiled around the walk]).

    The disabled version is made by :meth:`prepare`, outside any tracing (Dynamo would trace the
    making, and warn), so importing this module does not import Dynamo (a second).
    """

    def __init__(self, fn: Callable[..., Any], reason: str, traced: Callable[..., Any] | None = None) -> None:
        self.fn = fn
        self.reason = reason
        self.traced = fn if traced is None else traced  # what runs, eagerly, where Dynamo traces the call
        self.disabled: Callable[..., Any] | None = None

    def prepare(self) -> None:
        if self.disabled is None:
            # Dynamo's error under fullgraph=True names the reason (torch 2.8 and later take one).
            takes_reason = "reason" in inspect.signature(torch.compiler.disable).parameters
            self.disabled = torch.compiler.disable(self.traced, **({"reason": self.reason} if takes_reason else {}))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        compiling = torch.compiler.is_compiling() and self.disabled is not None
        return (self.disabled if compiling else self.fn)(*args, **kwargs)


def refuse_export() -> None:
    """Raise :data:`EXPORT_REFUSED` under ``torch.export`` (either mode) or ``torch.jit.trace``."""
    is_exporting = getattr(torch.compiler, "is_exporting", None)  # torch 2.5 and later
    if (is_exporting is not None and is_exporting()) or torch.jit.is_tracing():
        raise RuntimeError(EXPORT_REFUSED)
