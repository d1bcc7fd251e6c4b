"""``OffloadOptimizer.step`` under ``torch.compile``: it runs eagerly, a graph break at its call
(through ``EagerUnderDynamo`` in ``offload/modeling/compiled.py``, as the model's walk does).

Note: [A compiled step]
    ``torch.compile(optimizer.step)`` would have Dynamo trace the step as it traces a
    ``torch.optim`` one, through its own view of the optimizer: that view sets ``capturable=True``
    in every parameter group (for CUDA graphs), so the groups the step hands to the host worker
    said ``capturable=True`` on CPU tensors, and AdamW asserted in the worker; SGD's update ran
    eagerly with nothing said. The host update cannot be compiled at all: it runs later, on the
    worker, through the inner optimizer's eager step. So the step runs eagerly under Dynamo, reading
    the real parameter groups, and the update equals an eager ``torch.optim`` step's, not a
    compiled one's (``docs/optimizer.md``). A closure passed to it runs eagerly too.

    That step waits for the updates it started before it returns (:func:`waiting`): Dynamo
    compiles the rest of the caller right after the graph break, and ``torch.compiler.is_compiling()``
    is one flag for the whole process, so an update still running on the worker then would take
    ``torch.optim``'s branch for compiled code (the for-loop and ``foreach`` Adam and AdamW: 1 ulp
    off). Compiling the step gains nothing, and costs that overlap with the next forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: What ``torch.compile(optimizer.step, fullgraph=True)`` says of the graph break at the step.
EAGER_STEP_REASON = (
    "OffloadOptimizer.step hands each slice's update to a host worker that runs the optimizer eagerly, outside "
    "any compiled graph: it runs eagerly here too, so it cannot compile with fullgraph=True. Call "
    "optimizer.step() uncompiled, or compile it without fullgraph=True; the update equals an eager torch.optim "
    "step's (docs/optimizer.md)")


def waiting(step: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """``step(optimizer, closure)``, then a wait for the updates it started (Note: [A compiled step])."""

    def step_and_wait(optimizer: Any, closure: Any) -> Any:
        loss = step(optimizer, closure)
        optimizer.synchronize()  # before Dynamo compiles the caller's rest: is_compiling() is process-wide
        return loss

    return step_and_wait
