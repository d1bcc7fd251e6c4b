"""The autograd Function that runs a sliced model forward and walks it backward slice by slice.

Only the autograd protocol lives here; the rest is cut along its notes:

- ``offload/walk/slice_walk.py``: when each slice is on the device (Note: [The walk], Note: [Buffers]);
- ``records.py``: what forward leaves for backward (Note: [Checkpoints and kept graphs]);
- ``slice_graph.py``: one slice on one microbatch as autograd sees it (Note: [Boundary
  gradients], Note: [Device copies while autograd runs a slice]);
- ``gradients.py``: which gradients a backward produces and their way to the host (Note:
  [Gradients through autograd]);
- ``call.py``: the structure of one call's input and output.

The loop over slices stays inside one Function, explicit: that is what lets every microbatch of
a slice run while the slice is loaded once, and the recompute replay each run exactly.

Note: [Forward-mode AD inside a layer]
    A layer may use forward-mode AD itself (``make_dual`` and ``unpack_dual`` inside its forward,
    for a Jacobian-vector term). PyTorch runs a Function's forward with forward-mode AD switched
    off, and its backward with it on: the layer would get no tangent in forward and one in the
    recompute, another output and another gradient than the plain model's. So the call records
    the switch where the model was called (``Call.forward_grad_enabled``), and every forward run
    and every recompute runs under it.

Note: [The caller's saved-tensor hooks]
    The plain model's forward packs what it saves through the caller's saved-tensor hooks, and its
    backward packs nothing. The walk's graphs are its own: its forward saves through the model's
    hooks (references to a slot, offloaded, or dropped for a recompute), and a recompute saves in
    backward. So the Function's apply and every slice's backward run under :func:`identity_hooks`,
    innermost, which keep a caller's hooks (``save_on_cpu``, a lossy pack for activation
    compression, a counter) away from both, as from the plain model's backward.

    1. ``torch.autograd.graph.allow_mutation_on_saved_tensors()`` is such hooks too: the caller may
       change the model's input in place between forward and backward, and autograd clones the
       saved tensor first. A kept graph (or a small save an offloaded one keeps) would save the
       caller's tensor itself, out of the block's sight, and refuse backward as changed in place.
       Inside that block every strided tensor of the model's input enters slice 0 through a copy
       (Note: [Leaves enter through a copy] in ``slice_graph.py``), which the graph saves and the
       caller cannot change; a recompute's leaves are the walk's copies anyway.

Note: [A backward inside a compiled function]
    ``loss.backward()`` inside a ``torch.compile``'d function (a training step compiled whole) is a
    graph break: Dynamo (torch 2.13, ``trace_autograd_ops`` off) runs it eagerly, but its frame hook
    stays on, so every Python frame the autograd engine calls on this thread is Dynamo's to compile,
    the walk's backward among them (the model's call runs eagerly: Note: [Compiled around the walk]
    in ``offload/modeling/compiled.py``). Traced, the kept last slice's ``leaf.data = view``
    (``_kept_entry_tensors`` in ``slice_graph.py``) became a ``set_`` replayed from a graph, and
    that slice's parameters were left with ``.grad`` None, silently (every parameter with one
    slice); the walk's copies and events gain nothing from tracing anyway. So ``backward``, where
    Dynamo traces it (``torch.compiler.is_compiling()``, which it reads as true), calls itself
    again through ``torch.compiler.disable``, which turns the hook off for every frame under it:
    the plain model's gradients, bit for bit, in the compiled function as outside it. The eager
    version is made at the first forward, never traced (Dynamo would trace the making, and warn),
    as the model's call's is (``EagerUnderDynamo``); an eager backward does not go through it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.forward_ad as forward_ad

from ..walk.activation_policy import ActivationPlan
from ..walk.claims import WalkClaim
from ..walk.engine import Engine
from ..streams.labels import label
from ..walk.microbatch import split_leaves
from ..walk.slice_walk import SliceWalk
from .call import Call
from .gradients import BackwardGradients, retain_graph_requested, split_output_grads
from . import outside_gradients, refusals
from .records import BoundaryLoader, CallRecord, ForwardRecords, OffloadedGraph
from .slice_graph import Boundary, differentiate, graph_of, is_differentiable, requires_grad, run_forward


class OffloadFunction(torch.autograd.Function):
    """Forward over all slices without a graph (checkpointing) and a backward that walks them in reverse.

    Called as ``OffloadFunction.apply(engine, call, plan, num_microbatches, *input_tensors, *params)``, where
    ``plan`` is the model's :class:`~offload.walk.activation_policy.ActivationPlan`.
    """

    @classmethod
    def apply(cls, *args: Any) -> Any:
        # Before autograd sees the call: Note: [Transforms the walk refuses] in refusals.py.
        refusals.refuse_at_call(args[1], args[4:])
        _prepare_eager_backward()  # never traced: the model's call runs eagerly under Dynamo
        return super().apply(*args)

    @staticmethod
    def forward(ctx: Any, engine: Engine, call: Call, plan: ActivationPlan, num_microbatches: int,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        # Before anything of the engine's is read or written: Note: [One walk at a time] in slice_walk.py.
        with WalkClaim(engine, "a forward"):
            return _walk_forward(ctx, engine, call, plan, num_microbatches, tensors)

    @staticmethod
    def jvp(ctx: Any, *grad_inputs: Any) -> Any:
        raise RuntimeError(refusals.FORWARD_AD)  # a tangent apply did not see (on a parameter, say)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if torch.compiler.is_compiling() and _EAGER_BACKWARD is not None:
            # Dynamo traces this frame: run it again with Dynamo off (Note: [A backward inside a
            # compiled function]).
            return _EAGER_BACKWARD(ctx, *grad_outputs)
        if torch.is_grad_enabled():
            raise RuntimeError(refusals.DOUBLE_BACKWARD)
        _refuse_compiled_autograd()
        # Autograd runs backward in the caller's inference mode (loss.backward() under
        # torch.inference_mode(), which the plain model's nodes do not mind): the recompute must build
        # a graph, and the gradients' watch reads accumulation nodes through views, neither of which
        # inference mode allows.
        with torch.inference_mode(False), WalkClaim(ctx.run.engine, "a backward"):
            return _walk_backward(ctx, grad_outputs)


#: ``OffloadFunction.backward`` with Dynamo off for every frame under it, made by the first
#: forward, outside any tracing; ``None`` before (Note: [A backward inside a compiled function]).
_EAGER_BACKWARD: Callable[..., tuple[torch.Tensor | None, ...]] | None = None


def _prepare_eager_backward() -> None:
    global _EAGER_BACKWARD
    if _EAGER_BACKWARD is None:
        # Dynamo is imported already: the model's construction made its call's eager version.
        _EAGER_BACKWARD = torch.compiler.disable(OffloadFunction.backward)


def _walk_forward(ctx: Any, engine: Engine, call: Call, plan: ActivationPlan, num_microbatches: int,
                  tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``OffloadFunction.forward`` under its claim: the slices walked in order, each run on every
    microbatch, what backward needs recorded."""
    input_tensors = tensors[:call.num_input_tensors]
    leaves = call.input_with(input_tensors)
    microbatches, split = split_leaves(leaves, num_microbatches)
    in_cached_block = refusals.refuse_cached_parametrizations(engine, split.count)
    plan.check_recomputed([bool(s.storage.companions) for s in engine.slices])
    records = ForwardRecords(engine, split.count, plan)
    # Chunks and device copies are made under no_grad, so remember what the caller's inputs required.
    input_requires_grad = requires_grad(leaves)
    engine.milestones.forward_started(call)
    with SliceWalk.forward(engine) as walk:
        boundary: list[Boundary] = []
        for m, mb_leaves in enumerate(microbatches):
            records.checkpoint_boundary(0, m, mb_leaves, call.input_spec, input_requires_grad)
            boundary.append(Boundary(walk.load_inputs(mb_leaves), call.input_spec, input_requires_grad))
        for i, views in walk:
            records.start_slice(i)
            leaving: list[Boundary] = []
            for m, entering in enumerate(boundary):
                # Note: [Forward-mode AD inside a layer].
                with label(f"offload::forward slice {i}"), forward_ad._set_fwd_grad_enabled(call.forward_grad_enabled):
                    out, changed = run_forward(engine, records, i, m, views, entering)
                if changed:
                    walk.buffers_changed()
                    records.after_changing_run(i, m)
                walk.compute_queued()
                records.checkpoint_boundary(i + 1, m, out.leaves, out.spec, out.requires)
                leaving.append(out)
            boundary = leaving
        walk.finish()

    requires = [any(flags) for flags in zip(*(b.requires for b in boundary))]
    # Outputs that alias another are rebuilt outside (Note: [Outputs that alias each other] in call.py).
    outputs = call.returning([b.leaves for b in boundary], boundary[0].spec, split.sizes, requires)
    output_requires = [requires[p] for p in call.output_tensor_positions]
    non_differentiable = [o for o, wanted in zip(outputs, output_requires)
                          if not wanted or not is_differentiable(o)]
    if non_differentiable:
        ctx.mark_non_differentiable(*non_differentiable)
    ctx.run = CallRecord.of(engine, call, split, records, input_tensors)
    outside_gradients.called(engine, ctx)  # Note: [Adding onto earlier gradients], step 2
    ctx.save_for_backward(*records.saved_for_backward())
    if in_cached_block:
        refusals.forward_done(engine)
    return outputs


def _walk_backward(ctx: Any, grad_outputs: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
    """``OffloadFunction.backward`` once its checks passed: the slices walked in reverse, each
    recomputed (or its kept graph taken) and differentiated, microbatch by microbatch."""
    saved = ctx.saved_tensors  # raises PyTorch's own error on a second backward without retain_graph
    run: CallRecord = ctx.run
    refusals.refuse_batched_grads(ctx, run.call.num_input_tensors, len(run.engine.parameters()), grad_outputs)
    run.check_versions()
    retain_graph = retain_graph_requested()
    grads = BackwardGradients(ctx, run)
    count = run.split.count
    # Gradients of the current slice's outputs, per microbatch, aligned with its output leaves.
    grad_out = split_output_grads(run, grad_outputs)
    loader = BoundaryLoader(run.engine, run.records, saved)
    with SliceWalk.backward(run.engine, grads.lowest) as walk, grads:
        for i, views in walk:
            grads.begin(i)
            grad_in: list[list[torch.Tensor | None]] = [[] for _ in range(count)]
            for m in reversed(range(count)):
                # One step ahead: the next microbatch, or the next slice's first.
                if m > 0 or i > grads.lowest:
                    loader.prefetch(*((i, m - 1) if m > 0 else (i - 1, count - 1)))
                record = run.records.take(i, m, retain_graph)
                with label(f"offload::backward slice {i}"), _shielded_from_callers_hooks(), \
                        forward_ad._set_fwd_grad_enabled(run.call.forward_grad_enabled):
                    graph = graph_of(run.engine, record, run.autocast, saved, loader, i, m, views, retain_graph)
                    if graph.restored_buffers:
                        walk.buffers_restored()
                    grad_in[m], param_grads = differentiate(run.engine, i, graph, grad_out[m],
                                                            grads.per_slice_needed[i], grads.wants_input_grads(i))
                    if isinstance(record, OffloadedGraph):
                        record.saves.release()
                    del graph, record
                grads.add(param_grads, [*grad_in[m], *grad_out[m]])
                del param_grads  # held by the slice's gradients until they leave, not through the next slice
                walk.compute_queued()
            grads.leave(i)
            grad_out = grad_in
        grads.land()
        walk.finish()
    return (None, None, None, None, *grads.results(grad_out))


#: Why a backward under compiled autograd is refused, and what to do.
COMPILED_AUTOGRAD = (
    "OffloadModel's backward walk (copies to and from host memory, slice by slice) runs eagerly, and compiled "
    "autograd cannot trace it: run this backward without compiled autograd (outside "
    "torch._dynamo.compiled_autograd._enable(...), with torch._dynamo.config.compiled_autograd = False). Layers "
    "compiled before wrapping still compile their own forward and backward (docs/api.md, Limitations)")


def _refuse_compiled_autograd() -> None:
    """Raise :data:`COMPILED_AUTOGRAD` in a compiled-autograd region, where PyTorch's own error
    (Dynamo tracing the walk) names neither OffloadModel nor what to do."""
    # Not imported: compiled autograd cannot be on; importing Dynamo here would cost a second.
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
    if compiled_autograd is not None and getattr(compiled_autograd, "in_compiled_autograd_region", False):
        raise RuntimeError(COMPILED_AUTOGRAD)


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def identity_hooks() -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks that keep tensors as they are: innermost, they keep the caller's away
    from what the walk saves (Note: [The caller's saved-tensor hooks])."""
    return torch.autograd.graph.saved_tensors_hooks(_identity, _identity)


def _shielded_from_callers_hooks() -> contextlib.AbstractContextManager[object]:
    """:func:`identity_hooks` around a slice's backward; nothing in a backward inside
    ``disable_saved_tensors_hooks()``, which refuses them and has no hooks of the caller's under
    it (it refuses to start over any)."""
    if not torch._C._autograd._saved_tensors_hooks_is_enabled():
        return contextlib.nullcontext()
    # No caller's hooks around the backward (the common case): nothing to shield from, and a
    # recompute's saves then take no Python call each. PyTorch before 2.6 cannot tell: shielded.
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is not None and top(False) is None:
        return contextlib.nullcontext()
    return identity_hooks()
