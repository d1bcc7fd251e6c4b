"""What the autograd Function refuses to run under, each with what to do instead.

The Function walks every slice through host memory in one call and differentiates each slice
itself in backward. PyTorch's own ways to transform a Function need rules it does not have, and
fail deep inside with messages that name no OffloadModel; these checks say so at the call.

Note: [Transforms the walk refuses]
    1. ``torch.func`` transforms (``vmap``, ``jvp``, ``jacfwd``) run a Function
       only through a batching or forward-mode rule of its own; the walk's copies and pooled host
       buffers have none. Refused at the call while one is active and a graph is built; without
       a graph (``torch.no_grad()``) the slices stream through as any forward, and ``vmap``,
       ``jvp`` and ``jacfwd`` work (the walk's loads run outside the transform).
       (``grad``, ``vjp`` and ``jacrev`` refuse the saved-tensor hooks the model enters first;
       :func:`note_refused_hooks` adds what to do to their error.)
    2. Forward-mode AD (``torch.autograd.forward_ad``): the Function has no ``jvp``. Refused at the
       call when an input carries a tangent; under ``torch.no_grad()`` the input's tangents go
       through the layers as in the plain model. A tangent on a parameter or buffer (a dual tensor
       passed through ``torch.func.functional_call``) is refused in every mode, at the model's
       call: the walk copies what the layers register into its host buffers by value (Note:
       [Tensors substituted for a call] in ``offload/streams/host_storage.py``), which would drop
       the tangent, silently.
    3. ``torch.autograd.grad(..., is_grads_batched=True)`` runs backward once over a batch of
       output gradients (vmapped). Input gradients go through the recompute batched as in the
       plain model; parameter gradients would have to go through the host buffers, a batch at a
       time, which they cannot: refused when any is wanted.
    4. ``torch.nn.utils.parametrize.cached()``: the plain model computes a parametrized weight
       once for the whole block and sums every use's gradient before differentiating it. Each run
       here computes it again from its own device copy (Note: [Parametrizations cached around a
       run] in ``offload/walk/binding.py``): the same for one forward on one microbatch, another
       rounding for a second forward in the block or a second microbatch, which are refused.
    5. ``torch.func.functional_call`` with tensors a ``torch.func`` transform wraps (``grad`` or
       ``jacrev`` over the parameters, ``vmap`` over stacked ones): the model lays out every
       tensor its layers register in one host buffer a slice, and a wrapped tensor has no memory
       of its own to lay out. Refused before the layout is touched, at the model's call.
    6. ``torch.autograd.graph.disable_saved_tensors_hooks()``: the model enters saved-tensor
       hooks whenever it builds a graph (its checkpointing keeps, offloads or drops what autograd
       saves through them), which the block refuses with the caller's message;
       :func:`note_refused_hooks` adds a note naming OffloadModel. Under ``torch.no_grad()``
       nothing is saved and the model runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.autograd.forward_ad as forward_ad
from torch.nn.utils import parametrize

from ..walk.engine import Engine
from .gradients import needed_grads

_NO_GRAD = "Under torch.no_grad() the model runs without a graph and this works"

FUNC_TRANSFORMS = (
    "OffloadModel: torch.func transforms (vmap, jvp, jacfwd) cannot run OffloadModel while it builds "
    "a graph: its forward walks the slices through host memory inside one autograd Function, which has no "
    f"batching or forward-mode rule. {_NO_GRAD} for vmap, jvp and jacfwd; for gradients use torch.autograd.grad or "
    "torch.autograd.functional (jacobian, vjp), or the plain model (docs/api.md, Limitations).")

FORWARD_AD = (
    "OffloadModel: forward-mode AD (a dual tensor from torch.autograd.forward_ad.make_dual) is not supported "
    "while OffloadModel builds a graph for backward: it walks the slices inside one autograd Function, which has "
    f"no jvp rule. {_NO_GRAD} for tangents on the model's input: run the forward under torch.no_grad() and they "
    "go through the layers as in the plain model (tangents on the parameters are refused in every mode; "
    "docs/api.md, Limitations).")

PARAMETER_TANGENTS = (
    "OffloadModel: forward-mode AD with respect to the model's parameters or buffers is not supported: {name} "
    "carries a tangent (a dual tensor from torch.autograd.forward_ad.make_dual, passed through "
    "torch.func.functional_call). OffloadModel copies every parameter and buffer of a slice into one host buffer "
    "by value, which would drop the tangent. Give tangents to the model's input only (under torch.no_grad(), they "
    "go through the layers as in the plain model), or use the plain model (docs/api.md, Limitations).")

DOUBLE_BACKWARD = (
    "OffloadModel does not support double backward (create_graph=True, e.g. for a gradient penalty; "
    "torch.autograd.functional.jvp, hvp, vhp and hessian differentiate twice too): the recomputed slices are "
    "differentiated once. For a Jacobian-vector product with respect to the input use torch.func.jvp (or "
    "torch.autograd.forward_ad) with the model called under torch.no_grad(); compute the other terms on a model "
    "that is not offloaded.")

BATCHED_PARAMETER_GRADS = (
    "OffloadModel: torch.autograd.grad(..., is_grads_batched=True) cannot give the model's parameter gradients: "
    "backward brings each slice's parameter gradients to the host through pooled buffers, which a batch of "
    "gradients cannot go through. Ask for the input gradients only (those work batched), or for the parameter "
    "gradients one row of grad_outputs at a time (a loop of torch.autograd.grad with retain_graph=True), or use "
    "the plain model (docs/api.md, Limitations).")

CACHED_PARAMETRIZATIONS = (
    "OffloadModel: {what} inside one torch.nn.utils.parametrize.cached() block, on a model with parametrized "
    "layers. The plain model computes each parametrization once for the whole block and differentiates it once; "
    "OffloadModel computes it again in each run, from that run's device copy, so the gradients would differ in "
    "rounding. Call the model once per cached() block with num_microbatches=1, or enter cached() inside the layer "
    "that reuses its weight (docs/api.md, Limitations).")

TRANSFORMED_TENSORS = (
    "OffloadModel: torch.func.functional_call passed the model tensors that a torch.func transform wraps (grad, "
    "jacrev or vjp over the parameters, jvp or jacfwd over them, vmap over stacked ones), {name} among them. "
    "OffloadModel lays out every parameter and buffer of a slice in one host buffer, and a transform's tensor has no "
    "memory of its own to lay out. For gradients with respect to the parameters use "
    "torch.autograd.grad(loss, list(model.parameters())), or pass functional_call plain tensors that require grad "
    "and call torch.autograd.grad over them; forward-mode derivatives with respect to the parameters (jvp, jacfwd) "
    "need the plain model (docs/api.md, Limitations).")

FUNC_GRADIENT_HOOKS = (
    "OffloadModel: while it builds a graph, OffloadModel runs its slices under saved-tensor hooks (its activation "
    "checkpointing keeps, offloads or drops what autograd saves through them), which torch.func.grad, vjp, jacrev "
    "and hessian refuse. Use torch.autograd.grad instead (torch.autograd.functional.jacobian or vjp for those); a "
    "Hessian needs double backward, which OffloadModel refuses: use the plain model (docs/api.md, Limitations).")

DISABLED_HOOKS = (
    "OffloadModel: while it builds a graph, OffloadModel runs its slices under saved-tensor hooks, which its "
    "activation checkpointing needs (they keep, offload or drop what autograd saves), and "
    "torch.autograd.graph.disable_saved_tensors_hooks() refuses them. Call the model outside that block, or under "
    "torch.no_grad() if no gradient is wanted (docs/api.md, Limitations).")

#: In ``parametrize``'s cache, a forward of the engine with this id has run in the open block. A
#: parametrization's key is ``(id(module), name)``, and no module has an engine's id.
_FORWARD_MARK = "OffloadModel forward"


def refuse_at_call(call: Any, tensors: Sequence[Any]) -> None:
    """Rules 1 and 2 of Note: [Transforms the walk refuses], before the Function runs on
    ``tensors`` (the call's input tensors, then the parameters)."""
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(FUNC_TRANSFORMS)
    if forward_ad._current_level >= 0 and any(
            isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None
            for t in tensors[:call.num_input_tensors]):
        raise RuntimeError(FORWARD_AD)


def refuse_transformed_tensors(engine: Engine) -> None:
    """Rule 5 of Note: [Transforms the walk refuses], before the model's call lays out again what
    its layers register."""
    if not torch._C._are_functorch_transforms_active():
        return  # the common case: no transform, no wrapped tensor
    wrapped = _registered(engine, torch._C._functorch.is_functorch_wrapped_tensor)
    if wrapped is not None:
        raise RuntimeError(TRANSFORMED_TENSORS.format(name=wrapped))


def refuse_parameter_tangents(engine: Engine) -> None:
    """Rule 2 of Note: [Transforms the walk refuses] for the parameters and buffers, before the
    model's call lays out again what its layers register (which would drop a tangent)."""
    if forward_ad._current_level < 0:
        return  # the common case: no dual level open, no tangent
    dual = _registered(engine, lambda t: forward_ad.unpack_dual(t).tangent is not None)
    if dual is not None:
        raise RuntimeError(PARAMETER_TANGENTS.format(name=dual))


def _registered(engine: Engine, matches: Callable[[torch.Tensor], bool]) -> str | None:
    """The name of the first parameter or buffer the layers register (or a call substituted for
    one) that ``matches``; ``None`` if none does."""
    for s in engine.slices:
        for layer_name, layer in zip(s.names, s.layers):
            named = [*layer.named_parameters(layer_name, remove_duplicate=False),
                     *layer.named_buffers(layer_name, remove_duplicate=False)]
            found = next((name for name, t in named if matches(t)), None)
            if found is not None:
                return found
    return None


def note_refused_hooks(error: RuntimeError) -> None:
    """Add what to do, as a note (PEP 678), to ``error``: PyTorch's refusal of the saved-tensor
    hooks the model enters to build a graph (rules 1 and 6 of Note: [Transforms the walk
    refuses]), which the caller then re-raises."""
    note = FUNC_GRADIENT_HOOKS if torch._C._are_functorch_transforms_active() else DISABLED_HOOKS
    error.add_note(note)


def refuse_cached_parametrizations(engine: Engine, num_microbatches: int) -> bool:
    """Rule 4 of Note: [Transforms the walk refuses], before a forward that builds a graph; whether
    the forward runs inside a ``cached()`` block on parametrized layers (then :func:`forward_done`
    marks the block once it succeeded)."""
    if not parametrize._cache_enabled:
        return False  # the common case: one read of a module global
    if not any(parametrize.is_parametrized(m) for s in engine.slices for m in s.modules()):
        return False
    if num_microbatches > 1:
        raise RuntimeError(CACHED_PARAMETRIZATIONS.format(what=f"a forward in {num_microbatches} microbatches"))
    if (id(engine), _FORWARD_MARK) in parametrize._cache:
        raise RuntimeError(CACHED_PARAMETRIZATIONS.format(what="a second forward that builds a graph"))
    return True


def forward_done(engine: Engine) -> None:
    """Mark the open ``cached()`` block: a forward of ``engine`` ran in it (the block's end clears it)."""
    parametrize._cache[(id(engine), _FORWARD_MARK)] = True  # type: ignore[index]


def refuse_batched_grads(ctx: Any, num_inputs: int, num_params: int,
                         grad_outputs: Sequence[torch.Tensor | None]) -> None:
    """Rule 3 of Note: [Transforms the walk refuses]."""
    if not any(g is not None and torch._C._functorch.is_legacy_batchedtensor(g) for g in grad_outputs):
        return
    if any(needed_grads(ctx, num_inputs + num_params)[num_inputs:]):
        raise RuntimeError(BATCHED_PARAMETER_GRADS)
