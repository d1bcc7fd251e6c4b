"""The checks the plain optimizer makes of a step before it changes anything, made by ``step()``
before the first slice's update, so that a step the plain optimizer refuses as a whole is refused
as a whole. What it does not hold: the update of a slice (``offload/tiers/slice_update.py``) or
what a failure part way leaves (``partial_failure.py``).

Note: [A step refused as a whole]
    A ``torch.optim`` class steps a parameter group in one call of its update, whose first part
    (``_init_group``, and the checks of the functional update before its loop) reads every
    parameter of the group: ``fused=True`` refuses a complex parameter, or one on a device with no
    fused kernel; ``capturable=True`` one off the devices that capture; Adam a sparse gradient;
    ``foreach=True`` a tensor ``lr`` without ``capturable``. Raised there, nothing has changed. An
    OffloadOptimizer steps each slice's share of the group with a call of its own, in slice order
    (``offload/tiers/slice_update.py``): the same refusal would come from the first slice holding
    such a parameter, after the slices before it were updated, as a ``HostUpdateError`` that
    latches a mix of two steps and refuses saves until a reload (Note: [An update that failed part
    way] in ``partial_failure.py``). So ``step()`` first rehearses the class's own step over
    stand-ins (:func:`rehearse`), and raises what it raises, as the plain optimizer does:

    1. The group: the first with a gradient. The plain optimizer refuses a later group's step
       after it updated the groups before it; an OffloadOptimizer's slices cut across the groups,
       so that refusal is left to its slices' updates, and the ``HostUpdateError`` says why.
    2. The stand-ins: one parameter of one element for each kind of parameter with a dense
       gradient in that group (its dtype, device, number of dimensions and ``requires_grad``), in
       the group's order, each zero with a zero gradient, in a group that copies the group's
       hyperparameters. What those checks read (dtype, device, flags, the type of each
       hyperparameter) is the plain one's, met in the same order: the first stand-in refused is
       of the kind of the plain optimizer's first refused parameter, and the exception and
       message are the plain class's.
    3. The classes: PyTorch's own (their ``step`` and ``_init_group`` from ``torch.optim``), whose
       checks read no values and whose step keeps nothing outside its instance and draws nothing
       (rule 1 of Note: [An optimizer that draws random numbers] in ``random_draws.py``). Another
       class's step (bitsandbytes', torchao's, a subclass's own ``step``) may keep process-wide
       tables, draw random numbers or compile itself: it is not rehearsed, and its refusals come
       from the slices' updates.
    4. Not rehearsed: parameters whose gradient is not dense (a sparse embedding's: a class that
       refuses it, Adam, refuses it in its slice's update), and parameters of a tensor subclass.
    5. When: in each ``step()`` that starts the step's updates, before them: not in one that
       follows a backward that started them (``update_in_backward``; the first step of such an
       optimizer starts nothing in backward, and is rehearsed). A rehearsal is a look at each
       parameter of the group, a throwaway instance of the class and one call of its step over a
       few elements: about 0.3 ms for 200 parameters on the CPU, beside an update of milliseconds
       at least.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..tiers.slice_update import step_unhooked
from .plan import snapshot


def rehearse(optimizer: Any) -> None:
    """Run ``optimizer``'s class's step over stand-ins of the parameters with a gradient of its
    first group that has one (Note: [A step refused as a whole]), built from its class, keyword
    arguments and groups; nothing of ``optimizer`` is written.

    Raises:
        Exception: what the plain optimizer's step raises before changing anything, as it raises it.
    """
    if not _rehearsed(optimizer.optimizer_class):
        return
    for group in optimizer.param_groups:
        stand_ins = _stand_ins(group["params"])
        if stand_ins is None:
            continue  # no gradient in this group: the plain optimizer changes nothing of it either
        if stand_ins:
            rehearsal = optimizer.optimizer_class([{**snapshot(group), "params": stand_ins}],
                                                  **optimizer.optimizer_kwargs)
            rehearsal._offload_inner = True  # the model's engines are not its business (settled_steps.py)
            step_unhooked(rehearsal)
        return


def _rehearsed(optimizer_class: type[torch.optim.Optimizer]) -> bool:
    """Whether ``optimizer_class``'s step is PyTorch's own (rule 3): its ``step`` and its
    ``_init_group``, if it has one, come from ``torch.optim`` (a subclass may add only settings)."""
    methods = [getattr(optimizer_class, name) for name in ("step", "_init_group") if hasattr(optimizer_class, name)]
    return all(getattr(method, "__module__", "").startswith("torch.optim.") for method in methods)


def _stand_ins(params: list[torch.Tensor]) -> list[nn.Parameter] | None:
    """A stand-in for each kind of parameter of ``params`` with a dense gradient, in order (rule
    2); ``None`` when none of ``params`` has a gradient."""
    kinds: dict[tuple[Any, ...], None] = {}
    graded = False
    for p in params:
        if p.grad is None:
            continue
        graded = True
        if type(p) in (torch.Tensor, nn.Parameter) and p.grad.layout == torch.strided:
            kinds.setdefault((p.dtype, p.device, p.dim(), p.requires_grad))
    if not graded:
        return None
    stand_ins = []
    for dtype, device, dims, requires_grad in kinds:
        stand_in = nn.Parameter(torch.zeros((1,) * dims, dtype=dtype, device=device), requires_grad=requires_grad)
        stand_in.grad = torch.zeros_like(stand_in)
        stand_ins.append(stand_in)
    return stand_ins
