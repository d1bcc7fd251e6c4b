"""Which parameters' gradients backward adds into ``.grad`` itself, slice by slice.

Note: [Gradients added in place]
    Backward hands autograd every parameter's gradient when it returns, after the last slice
    (Note: [Gradients through autograd] in ``function.py``). Where ``.grad`` already holds a
    gradient (``zero_grad(set_to_none=False)``, or accumulation over several backwards), autograd
    then adds the returned gradients into it: until it does, every slice's new gradients sit on
    the host beside the old ones, a second copy of all gradients (4 bytes per float32
    parameter). So where the result is the same, backward adds each slice's gradients into
    ``.grad`` on the host as soon as they land (``GradientOffloader.accumulate``) and returns
    ``None`` for that parameter: a window of two slices' gradient buffers replaces the second
    copy. The addition is autograd's own (``.grad += new``, in the parameter's dtype), so
    ``.grad`` ends bit for bit where autograd would leave it.

    Autograd could notice the difference only through what sees the new gradient before it is
    added, or through when it is added, so a parameter takes this path only when all of these
    hold, and otherwise goes through autograd as before:

    1. this backward accumulates into ``.grad`` (``.backward()``, with the parameter among its
       ``inputs`` if given): ``torch.autograd.grad`` returns gradients instead;
    2. ``.grad`` is a dense host tensor of the parameter's dtype and shape;
    3. no hook sees the gradient: the parameter has no tensor hooks (``register_hook``) and no
       post-accumulate-grad hooks;
    4. the parameter is an input of the walk once (a weight tied across slices is not: autograd
       sums its slices' gradients first);
    5. nothing else acts on the host gradients per slice (data parallelism averages them on
       their way: its milestones subscribe to the walk);
    6. ``.grad`` holds the zeros that ``zero_grad(set_to_none=False)`` of the OffloadModel or of an
       OffloadOptimizer wrote (:func:`mark_zeroed`), unchanged since (its version counter says
       so), and no other call of the model in this backward has its walk still to come (Note:
       [Several calls of the model in one backward] in ``outside_gradients.py``). A backward
       that fails part way has added some slices already, where autograd would have added
       nothing: zeroing them again (:func:`restore_zeroed`) puts back exactly what was there.
       Autograd sums every other gradient of the parameter, ``s`` (what earlier calls of the
       model returned, a penalty on the weights), and adds the sum onto ours: ``(0 + ours) + s``
       equals ``0 + (s + ours)`` bit for bit, signed zeros included (which does not hold for any
       ``.grad`` but zeros), wherever ours would have been autograd's last addition. It is with
       one call of the model and one use outside it; with several calls the last walk adds in
       place, and a use outside the model whose node runs after it (one computed before the
       model's first call, its sequence number the lower) is added after ours instead, another
       rounding: ``ours + (a + b)`` for ``(a + ours) + b``.

    Gradients accumulated over several backwards without zeroing in between (and ``.grad``
    zeroed by a plain ``torch.optim`` optimizer) are added in place too once a watched backward
    has seen that no gradient from outside the model reaches the parameter, and otherwise go
    through autograd, two copies and all (Note: [Adding onto earlier gradients] in
    ``outside_gradients.py``); summing microbatches on the device (``num_microbatches``) needs
    neither. The other exception: the backward
    that starts the optimizer's update (Note: [Update in backward] in
    ``offload/optimizing/in_backward.py``) takes any ``.grad`` that rule 2 allows. That backward
    checks that no gradient of a parameter arrives from outside the model, which is what rule 6
    guards against; what it gives up is rule 6's undo: if it fails part way, the slices already
    added cannot be taken out again, and its error says so.

    What the rules cannot see, because PyTorch offers no way to inspect it: a hook registered on
    the parameter's accumulation node itself (``p.view_as(p).grad_fn.next_functions[0][0]``,
    where gradient-bucketing libraries put theirs) receives ``None`` for such a parameter; and a
    gradient from outside the model that autograd would add after ours (a parameter used more
    than once outside the model in the same graph, or, with the model called more than once,
    once before its first call) gets the contributions added in another order than autograd's
    (``ours + (a + b)`` against ``(a + ours) + b``), equal up to rounding, not bit for bit. Both
    happen only after ``zero_grad(set_to_none=False)`` of the OffloadModel or an OffloadOptimizer;
    ``zero_grad()`` (``set_to_none=True``, PyTorch's default) never takes this path.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from typing import Any

import torch

from ..walk.engine import engines_holding


def in_place_targets(ctx: Any, params: Sequence[torch.Tensor], first_edge: int, needed: Sequence[bool],
                     walk_observed: bool, any_grad: Container[int] = (), onto_earlier: Container[int] = (),
                     last_call: bool = True) -> tuple[list[torch.Tensor | None], list[bool]]:
    """Per parameter of the walk, the ``.grad`` its gradient is added into on the host, or
    ``None`` where autograd receives it (see Note: [Gradients added in place]); and whether it
    could be added in place but for what ``.grad`` holds (rules 1 to 5 hold, and ``.grad`` is
    empty or of the parameter's kind: a backward watches those, Note: [Adding onto earlier
    gradients] in ``outside_gradients.py``).

    Args:
        ctx: the Function's context in backward.
        params: the walk's parameters, in the order of its inputs (a tied one more than once).
        first_edge: the index of the first parameter among the Function's tensor inputs.
        needed: per parameter, whether this backward produces its gradient.
        walk_observed: something rewrites the walk's gradients per slice (rule 5).
        any_grad: ids of the parameters whose rule 6 is waived (those whose update the backward
            starts: the others keep rule 6, and a gradient from outside the model stays exact).
        onto_earlier: ids of the parameters whose rule 6 is waived because no gradient from
            outside the model reaches them (Note: [Adding onto earlier gradients]).
        last_call: no other call of the model in this backward has its walk still to come (rule 6).
    """
    targets: list[torch.Tensor | None] = [None] * len(params)
    candidates = [False] * len(params)
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    if walk_observed or will_execute is None:
        return targets, candidates
    appearances: dict[int, int] = {}
    for p in params:
        appearances[id(p)] = appearances.get(id(p), 0) + 1
    edges = ctx.next_functions
    for k, p in enumerate(params):
        if not needed[k] or appearances[id(p)] != 1:
            continue  # rule 4
        if not p.is_leaf:
            # Rule 1: autograd accumulates into a leaf's .grad only (a non-leaf passed to
            # torch.func.functional_call, MAML's fast weights, hands its gradient on), and reading a
            # non-leaf's .grad warns.
            continue
        grad = p.grad
        if grad is not None and (grad.device != p.device or grad.dtype != p.dtype or grad.shape != p.shape
                                 or grad.layout != torch.strided or grad.requires_grad):
            continue  # rule 2
        if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None):
            continue  # rule 3
        node = edges[first_edge + k][0] if first_edge + k < len(edges) else None
        if node is None:
            continue
        try:
            accumulates = bool(will_execute(node))
        except RuntimeError:
            accumulates = False  # torch.autograd.grad: it refuses to say for a leaf (rule 1)
        if not accumulates:
            continue
        candidates[k] = True
        if grad is not None and (id(p) in any_grad or id(p) in onto_earlier or last_call and still_zeroed(p, grad)):
            targets[k] = grad  # rule 6, or its waivers
    return targets, candidates


def mark_zeroed(params: Iterable[torch.Tensor]) -> None:
    """Remember that ``params``' ``.grad`` were just zeroed in place (rule 6)."""
    for p in params:
        if p.grad is not None:
            _remember(p, p.grad)


def restore_zeroed(targets: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Zero again the ``.grad`` a failed backward added into, given as ``(parameter, .grad)``
    pairs, and remember them as zeroed (rule 6)."""
    with torch.no_grad():
        for p, grad in targets:
            grad.zero_()
            _remember(p, grad)


# What was zeroed lives on the engines that hold the parameter (``Engine.zeroed_gradients``), by
# the parameter's id, with the ``.grad``'s id, address and version counter as it was zeroed: no
# weak reference to either, which would stop torch.utils.swap_tensors (``.to(dtype)`` under
# torch.__future__.set_swap_module_params_on_conversion swaps each ``.grad`` too). A ``.grad``
# replaced since by another tensor at the same id and address, at the same version, would be
# taken for the zeroed one.


def _mark(grad: torch.Tensor) -> tuple[int, int, int]:
    # A sparse .grad has no address of its own; it is never added into in place (rule 2) anyway.
    return id(grad), grad.data_ptr() if grad.layout == torch.strided else 0, grad._version


def _remember(p: torch.Tensor, grad: torch.Tensor) -> None:
    for engine in engines_holding(p):
        engine.zeroed_gradients[id(p)] = _mark(grad)


def still_zeroed(p: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether ``grad``, ``p``'s ``.grad``, holds the zeros :func:`mark_zeroed` remembered, unchanged since."""
    engines = engines_holding(p)
    return bool(engines) and all(e.zeroed_gradients.get(id(p)) == _mark(grad) for e in engines)
