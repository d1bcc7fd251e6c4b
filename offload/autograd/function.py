"""The autograd Function that runs a sliced model forward and walks it backward slice by slice.

Vocabulary as in Note: [Glossary] (``offload/__init__.py``).

Note: [Checkpoints and kept graphs]
    For every slice ``i`` and microbatch ``m``, forward leaves one of two records for backward:

    - a *checkpoint*: the slice's boundary activation (offloaded to the host), the CPU and device
      generator states just before the slice ran, and, if the run changed the slice's buffers,
      the buffers as they were before it. Backward loads the boundary activation and re-runs the
      slice under the same generator and autocast state, so dropout draws the same masks.
    - a *kept graph*: the slice ran with grad enabled in forward and autograd's graph is kept.

    With ``checkpoint_activation=True`` only the last microbatch of the last slice is a kept
    graph: it is the first thing backward needs, so it is neither reloaded nor recomputed. With
    ``checkpoint_activation=False`` every record is a kept graph and activations stay on the
    device. Kept graphs save slot memory only as slot references (see
    ``offload/streams/device_slots.py``), so slots can be reused while they wait.

    A slice's graph starts from leaves (the boundary activations, detached); each leaf that needs a
    gradient enters the slice through a copy, so a first layer that works in place on its input
    (``ReLU(inplace=True)``) behaves as in the plain model, where its input is not a leaf.

Note: [Boundary gradients]
    Every tensor that crosses a slice boundary requires grad exactly when it does in the plain
    model: an attention mask computed from token ids, or rotary tables carried beside the hidden
    states, do not. Kernels look at the flag (``scaled_dot_product_attention`` picks its
    implementation by it), so a different flag means different bits, and a flag set without need
    makes every slice compute a gradient nobody uses. Forward therefore runs every slice with grad
    enabled, as the plain model does, and learns each output's flag from autograd itself; a
    checkpointed run saves nothing (its graph is dropped as soon as the flags are read), so its
    activations are freed as under ``no_grad``. The flags travel with the boundary: the next
    slice's leaves, the checkpoint's recompute (even where backward wants no gradient for an
    input, so that it takes the forward's kernels), and the Function's outputs (one that requires
    no grad in the plain model is marked non-differentiable).

Note: [Device copies while autograd runs a slice]
    A layer may run part of its own forward again while autograd differentiates it: a
    ``torch.utils.checkpoint`` inside the layer, or a Hugging Face model with gradient
    checkpointing enabled, recomputes during the slice's backward. The layers must see the device
    copies then too, not the host copies that are bound again between runs; so the slice's
    tensors are bound (``Engine.bound``) for as long as autograd runs the slice's graph, a kept
    graph's parameter leaves pointed at the slot that holds the slice at that time.

Note: [Gradients through autograd]
    The host parameters are inputs of the Function and backward returns their gradients, on the
    host. Autograd itself then runs hooks, accumulates into ``.grad`` (or hands the gradients to
    ``torch.autograd.grad``), so every PyTorch semantic holds: accumulation across backwards,
    ``retain_graph``, ``inputs=``, hooks firing once. Everything a backward needs is saved with
    ``ctx.save_for_backward`` or released by backward itself, so autograd frees it with the graph
    and a second backward without ``retain_graph`` fails exactly as in PyTorch. Double backward
    (``create_graph=True``) is refused with an error: the recompute's graph is not differentiable
    twice. Where ``.grad`` holds a gradient already, backward adds each slice's gradients into it
    itself as they land, when autograd's result is the same (Note: [Gradients added in place] in
    ``accumulation.py``).

Note: [Buffers]
    Buffers are the only device data a forward may change (running statistics, counters). A run
    counts as changing them if it wrote to a slot tensor in place (a version counter moved),
    reassigned a buffer, or holds a normalisation layer that tracks running statistics in
    training mode (its kernel updates them without bumping any version counter). After a slice's
    microbatches ran, changed buffers are written back to the host copies; unchanged slices send
    nothing back. For exact recompute, a run that changed the buffers keeps them as they were
    before it: for the first microbatch that is still the host copy (written back only after the
    last one), for a later one it is the device copy the previous run left, offloaded right
    after that run when it changed anything. Backward restores them on the device before
    re-running; the recompute's own updates are discarded, so running statistics are updated once
    per forward, never by backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from ..engine import Engine
from ..labels import label
from ..microbatch import Split, join_input_grads, join_outputs, split_leaves, split_like
from ..streams import Event, OffloadTicket, PendingGradients
from ..streams.host_storage import flat_alias
from .accumulation import in_place_targets, restore_zeroed
from .recompute_state import recomputing
from .replay import AutocastState, autocast_cache_disabled, capture_rng, replaying_rng


@dataclass(eq=False)  # compared and hashed by identity: milestone subscribers key on it
class Call:
    """One call's bookkeeping shared between the model and the Function (never stored on the module).

    The model fills in the input side; the Function's forward fills in the output side, which the
    model needs to rebuild the output structure around the tensors autograd returns.
    """

    input_spec: TreeSpec
    input_leaves: list[Any]  # tensors replaced by None: they travel as Function arguments
    tensor_positions: list[int]
    output_spec: TreeSpec | None = None
    output_leaves: list[Any] = field(default_factory=list)
    output_tensor_positions: list[int] = field(default_factory=list)


# -- records kept from forward for backward -----------------------------------------------------


@dataclass
class _SavedLeaf:
    """A boundary leaf in a checkpoint: a saved tensor (``stash``) with its offload ticket, or a value."""

    stash: int | None = None
    ticket: OffloadTicket | None = None
    value: Any = None


@dataclass
class _Checkpoint:
    inputs: list[_SavedLeaf]
    spec: TreeSpec
    requires: list[bool]  # per input leaf: whether it required grad in forward (Note: [Boundary gradients])
    cpu_rng: int = -1
    device_rng: int | None = None
    buffers: tuple[int, OffloadTicket] | None = None  # saved tensor of the buffers before the run


@dataclass
class _KeptGraph:
    # The graph's outputs (with their grad_fn) and parameter leaves are held here rather than
    # saved: a saved output shares its version counter with the tensor returned to the caller,
    # which may update it in place as freely as the plain model's output; the leaves are slot
    # tensors whose values are read through slot references. Backward releases both.
    outputs: list[torch.Tensor | None]
    inputs: list[int | None]  # saved tensors: the detached boundary leaves
    params: list[torch.Tensor]


class _Stash:
    """Collects the tensors one call saves for backward; records refer to them by index."""

    def __init__(self) -> None:
        # Always one tensor, so that a second backward without retain_graph meets autograd's own
        # "freed" error even when nothing else was saved.
        self.tensors: list[torch.Tensor] = [torch.empty(0)]

    def add(self, tensor: torch.Tensor) -> int:
        self.tensors.append(tensor)
        return len(self.tensors) - 1


@dataclass
class _Run:
    """Everything backward needs from forward except saved tensors."""

    engine: Engine
    call: Call
    split: Split
    records: list[list[_Checkpoint | _KeptGraph | None]]
    param_versions: list[tuple[int, ...]]
    autocast: AutocastState
    input_meta: list[tuple[torch.Size, torch.dtype, torch.device]]  # per input tensor


def _is_differentiable(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def _requires_grad(leaves: Sequence[Any]) -> list[bool]:
    return [isinstance(x, torch.Tensor) and x.requires_grad for x in leaves]


def _discard(tensor: torch.Tensor) -> None:
    return None


def _never_unpacked(packed: None) -> torch.Tensor:
    raise RuntimeError("internal error: a checkpointed forward's graph was differentiated")


def _saving_nothing() -> torch.autograd.graph.saved_tensors_hooks:
    """Hooks under which a graph saves nothing: a checkpointed forward builds one only to learn
    what its outputs require, so its activations are freed as soon as they are used, as under
    ``no_grad``. Innermost hooks win, so the caller's hooks (``save_on_cpu``) see nothing either."""
    return torch.autograd.graph.saved_tensors_hooks(_discard, _never_unpacked)


def _graph_inputs(leaves: Sequence[Any], requires: Sequence[bool]) -> tuple[list[Any], list[Any]]:
    """Leaves to differentiate with respect to, and what the slice receives in their place
    (call with grad enabled: the copies must be part of the graph).

    See Note: [Checkpoints and kept graphs] for why a leaf that needs a gradient enters through a copy.
    """
    graph_leaves: list[Any] = []
    fed: list[Any] = []
    for leaf, wants in zip(leaves, requires):
        if not isinstance(leaf, torch.Tensor):
            graph_leaves.append(leaf)
            fed.append(leaf)
            continue
        detached = leaf.detach().requires_grad_(wants and _is_differentiable(leaf))
        graph_leaves.append(detached)
        fed.append(detached.clone() if detached.requires_grad else detached)
    return graph_leaves, fed


def _param_leaves(views: Sequence[torch.Tensor], engine: Engine, index: int) -> list[torch.Tensor]:
    """What a graph of slice ``index`` runs with: parameter leaves over the device copies, buffers as they are."""
    return [
        view.detach().requires_grad_(entry.tensor.requires_grad) if entry.is_parameter else view
        for view, entry in zip(views, engine.slices[index].storage.entries)
    ]


class OffloadFunction(torch.autograd.Function):
    """Forward over all slices without a graph (checkpointing) and a backward that walks them in reverse.

    Called as ``OffloadFunction.apply(engine, call, checkpoint, num_microbatches, *input_tensors, *params)``.
    """

    @staticmethod
    def forward(ctx: Any, engine: Engine, call: Call, checkpoint: bool, num_microbatches: int,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        num_inputs = len(call.tensor_positions)
        input_tensors = tensors[:num_inputs]
        leaves = list(call.input_leaves)
        for position, tensor in zip(call.tensor_positions, input_tensors):
            leaves[position] = tensor
        microbatches, split = split_leaves(leaves, num_microbatches)
        count = split.count
        n = engine.num_slices
        stash = _Stash()

        # Chunks and device copies are made under no_grad, so remember what the caller's inputs required.
        input_requires_grad = _requires_grad(leaves)

        def keeps_graph(i: int, m: int) -> bool:
            return not checkpoint or (i == n - 1 and m == count - 1)

        records: list[list[Any]] = [[None] * count for _ in range(n)]
        # The boundary entering the current slice, per microbatch, on the device, with what each leaf
        # requires (Note: [Boundary gradients]).
        boundary: list[tuple[list[Any], TreeSpec, list[bool]]] = []
        written_back: list[Event | None] = []
        engine.slots.forget_contents()
        engine.milestones.forward_started(call)
        acquired: int | None = None  # the slice running now, if any
        try:
            for m, mb_leaves in enumerate(microbatches):
                if not keeps_graph(0, m):
                    records[0][m] = _Checkpoint([_checkpoint_leaf(engine, stash, x) for x in mb_leaves], call.input_spec,
                                                input_requires_grad)
                boundary.append((engine.to_device(mb_leaves), call.input_spec, input_requires_grad))
            for i in range(n):
                views = engine.slots.acquire(i)
                acquired = i
                buffers_changed = False
                before_run: tuple[int, OffloadTicket] | None = None  # None: as the host copy holds them
                next_boundary: list[tuple[list[Any], TreeSpec, list[bool]]] = []
                for m in range(count):
                    in_leaves, in_spec, requires = boundary[m]
                    with label(f"offload::forward slice {i}"):
                        if keeps_graph(i, m):
                            with torch.enable_grad(), engine.slots.saved_tensors_hooks():
                                graph_leaves, fed = _graph_inputs(in_leaves, requires)
                                entry_tensors = _param_leaves(views, engine, i)
                                result = engine.run_slice(i, entry_tensors, tree_unflatten(fed, in_spec))
                            out_leaves, out_spec = tree_flatten(result.output)
                            records[i][m] = _KeptGraph(
                                outputs=[o if isinstance(o, torch.Tensor) else None for o in out_leaves],
                                inputs=[stash.add(x) if isinstance(x, torch.Tensor) else None for x in graph_leaves],
                                params=[t for t, e in zip(entry_tensors, engine.slices[i].storage.entries)
                                        if e.is_parameter],
                            )
                        else:
                            record = records[i][m]
                            cpu_state, device_state = capture_rng(engine.device)
                            record.cpu_rng = stash.add(cpu_state)
                            record.device_rng = stash.add(device_state) if device_state is not None else None
                            # With grad enabled, as in the plain model, so that every output requires
                            # grad exactly as there and kernels that look at it choose alike; nothing
                            # is saved (Note: [Boundary gradients]).
                            with torch.enable_grad(), _saving_nothing(), autocast_cache_disabled():
                                _, fed = _graph_inputs(in_leaves, requires)
                                result = engine.run_slice(i, _param_leaves(views, engine, i),
                                                          tree_unflatten(fed, in_spec))
                                del fed
                            if result.buffers_changed:
                                if before_run is None:
                                    host, ticket = engine.snapshot_host_buffers(i)
                                    before_run = (stash.add(host), ticket)
                                record.buffers = before_run
                            out_leaves, out_spec = tree_flatten(result.output)
                        out_requires = _requires_grad(out_leaves)
                        out_leaves = [o.detach() if isinstance(o, torch.Tensor) else o for o in out_leaves]
                        run_changed_buffers = result.buffers_changed
                        del result  # frees the graph of a checkpointed run right away
                    if run_changed_buffers:
                        buffers_changed = True
                        if m + 1 < count and not keeps_graph(i, m + 1):
                            host, ticket = engine.offload_buffers(i)
                            before_run = (stash.add(host), ticket)
                    if m == 0 and i + 1 < n:
                        # Issued once this slice's first compute is queued, so that the CPU work of a
                        # load (a shadow refresh) overlaps it.
                        engine.slots.prefetch(i + 1)
                    if i + 1 < n and not keeps_graph(i + 1, m):
                        records[i + 1][m] = _Checkpoint([_checkpoint_leaf(engine, stash, o) for o in out_leaves],
                                                        out_spec, out_requires)
                    next_boundary.append((out_leaves, out_spec, out_requires))
                if buffers_changed:
                    written_back.append(engine.slots.write_back_buffers(i))
                engine.slots.release(i)
                acquired = None
                boundary = next_boundary
            # Buffers are host state the user may read right after forward, and the host copies
            # the loads read may be overwritten right after it (an optimizer step on earlier
            # gradients, load_state_dict): rule 4 of [Copy ordering].
            engine.copies.wait_host_all(written_back)
            engine.copies.wait_loads_done()
        except BaseException:
            if acquired is not None:
                engine.keep_buffers_of_failed_run(acquired)
            engine.slots.invalidate()
            raise

        joined = join_outputs([out for out, _, _ in boundary], split.sizes)
        call.output_spec = boundary[0][1]
        call.output_tensor_positions = [p for p, leaf in enumerate(joined) if isinstance(leaf, torch.Tensor)]
        call.output_leaves = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in joined]
        outputs = tuple(joined[p] for p in call.output_tensor_positions)
        output_requires = [any(flags[p] for _, _, flags in boundary) for p in call.output_tensor_positions]
        non_differentiable = [o for o, wanted in zip(outputs, output_requires)
                              if not wanted or not _is_differentiable(o)]
        if non_differentiable:
            ctx.mark_non_differentiable(*non_differentiable)

        ctx.run = _Run(
            engine=engine,
            call=call,
            split=split,
            records=records,
            param_versions=[s.storage.param_versions() for s in engine.slices],
            autocast=AutocastState.capture(engine.device),
            input_meta=[(t.shape, t.dtype, t.device) for t in input_tensors],
        )
        ctx.save_for_backward(*stash.tensors)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():
            raise RuntimeError(
                "OffloadModel does not support double backward (create_graph=True, e.g. for a gradient "
                "penalty): the recomputed slices are differentiated once. Compute such terms on a model "
                "that is not offloaded."
            )
        saved = ctx.saved_tensors  # raises PyTorch's own error on a second backward without retain_graph
        run: _Run = ctx.run
        engine = run.engine
        _check_versions(run)
        keep_graph = _keep_graph()
        num_inputs = len(run.input_meta)
        num_params = sum(len(s.storage.params) for s in engine.slices)
        needed = _needed_grads(ctx, num_inputs + num_params)
        inputs_needed = needed[:num_inputs]
        per_slice_needed: list[list[bool]] = []
        offset = num_inputs
        for s in engine.slices:
            per_slice_needed.append(needed[offset:offset + len(s.storage.params)])
            offset += len(s.storage.params)
        n = engine.num_slices
        count = run.split.count
        lowest = 0 if any(inputs_needed) else next((i for i, f in enumerate(per_slice_needed) if any(f)), n)

        # Gradients of the current slice's outputs, per microbatch, aligned with its output leaves.
        grad_out = _split_output_grads(run, grad_outputs)
        loader = _BoundaryLoader(engine, run, saved)
        steps = [(i, m) for i in reversed(range(lowest, n)) for m in reversed(range(count))]
        pending: list[tuple[int, PendingGradients]] = []
        # Note: [Gradients added in place]: per slice, the .grad each gradient is added into.
        into = _split_per_slice(engine, in_place_targets(ctx, engine.parameters(), num_inputs, needed[num_inputs:],
                                                         bool(engine.milestones.subscribers)))
        try:
            for step, (i, m) in enumerate(steps):
                if m == count - 1:
                    views = engine.slots.acquire(i)
                    slice_grads = (engine.gradients.begin(engine.slices[i].storage.params, per_slice_needed[i], into[i])
                                   if any(per_slice_needed[i]) else None)
                    grad_in: list[list[torch.Tensor | None]] = [[] for _ in range(count)]
                    restored = False
                if step + 1 < len(steps):
                    loader.prefetch(*steps[step + 1])
                record = run.records[i][m]
                wants_input_grads = i > lowest or (i == 0 and any(inputs_needed))
                with label(f"offload::backward slice {i}"):
                    if isinstance(record, _KeptGraph):
                        outputs, params = record.outputs, record.params
                        inputs = [saved[k] if k is not None else None for k in record.inputs]
                        entry_tensors = _kept_entry_tensors(engine, i, record, views)
                        if not keep_graph:
                            run.records[i][m] = None
                        retain = keep_graph
                    elif isinstance(record, _Checkpoint):
                        restored |= record.buffers is not None
                        outputs, inputs, params, entry_tensors = _recompute(engine, run, saved, loader, i, m, record,
                                                                            views)
                        retain = False
                    else:
                        raise RuntimeError("internal error: backward reached a record that was already released")
                    # See Note: [Device copies while autograd runs a slice].
                    with engine.bound(i, entry_tensors), _naming_reentrant_checkpoints(engine, i):
                        in_grads, param_grads = _differentiate(outputs, grad_out[m], inputs, params,
                                                               per_slice_needed[i], wants_input_grads, retain)
                    del outputs, inputs, params, entry_tensors
                grad_in[m] = in_grads
                if slice_grads is not None:
                    slice_grads.add(_unshared(param_grads, [*in_grads, *grad_out[m]]))
                del param_grads  # held by slice_grads until they leave, not through the next slice
                if m == count - 1 and i - 1 >= lowest:
                    # After this slice's first compute is queued: see the forward walk.
                    engine.slots.prefetch(i - 1)
                if m == 0:
                    if slice_grads is not None:
                        engine.milestones.gradients_produced(run.call, i, slice_grads)
                        pending.append((i, engine.gradients.offload(
                            slice_grads, label=f"offload::offload gradients slice {i}")))
                        engine.milestones.gradients_leaving(run.call, i, pending[-1][1])
                        engine.gradients.accumulate([p for _, p in pending])
                    if restored:
                        engine.slots.mark_stale(i)
                    engine.slots.release(i)
                    grad_out = grad_in
            # The optimizer reads the gradients next, and may overwrite the host copies the loads read.
            engine.gradients.finish([p for _, p in pending])
            engine.milestones.gradients_landed(run.call, dict(pending))
            engine.copies.wait_loads_done()
        except BaseException:
            engine.slots.invalidate()
            restore_zeroed(g for _, p in pending for g in p.added)  # Note: [Gradients added in place], rule 6
            raise
        finally:
            engine.pool.end_step()

        param_results: list[torch.Tensor | None] = [None] * num_params
        starts = [0]
        for s in engine.slices:
            starts.append(starts[-1] + len(s.storage.params))
        for i, grads in pending:
            for j, g in enumerate(grads.host_views):
                param_results[starts[i] + j] = g
        input_results = _input_grads(run, grad_out if lowest == 0 else None, inputs_needed)
        return (None, None, None, None, *input_results, *param_results)


# -- forward helpers ------------------------------------------------------------------------------


def _split_per_slice(engine: Engine, values: Sequence[Any]) -> list[list[Any]]:
    """``values`` (one per parameter of the walk, slice after slice) as one list per slice."""
    per_slice: list[list[Any]] = []
    offset = 0
    for s in engine.slices:
        per_slice.append(list(values[offset:offset + len(s.storage.params)]))
        offset += len(s.storage.params)
    return per_slice


def _checkpoint_leaf(engine: Engine, stash: _Stash, leaf: Any) -> _SavedLeaf:
    """Keep a boundary leaf for the recompute: tensors on the compute device go to the host."""
    if not isinstance(leaf, torch.Tensor):
        return _SavedLeaf(value=leaf)
    if leaf.device != engine.device:
        return _SavedLeaf(stash=stash.add(leaf))
    host, ticket = engine.activations.offload(leaf)
    return _SavedLeaf(stash=stash.add(host), ticket=ticket)


# -- backward helpers -----------------------------------------------------------------------------


def _keep_graph() -> bool:
    """Whether the running backward was called with ``retain_graph=True``."""
    getter = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if getter is None else bool(getter())


def _needed_grads(ctx: Any, count: int) -> list[bool]:
    """Per tensor argument of forward, whether this backward must produce its gradient.

    ``ctx.needs_input_grad`` says what requires grad; the engine knows what this particular
    backward asks for (``inputs=`` or ``torch.autograd.grad``). Where it cannot tell, assume needed.
    """
    requires = list(ctx.needs_input_grad[4:4 + count])
    edges = list(ctx.next_functions)
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    needed = []
    for k, required in enumerate(requires):
        if not required:
            needed.append(False)
            continue
        node = edges[k][0] if k < len(edges) else None
        if node is None or will_execute is None:
            needed.append(True)
            continue
        try:
            needed.append(bool(will_execute(node)))
        except RuntimeError:
            needed.append(True)
    return needed


def _check_versions(run: _Run) -> None:
    for s, recorded in zip(run.engine.slices, run.param_versions):
        if s.storage.param_versions() != recorded:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: a parameter of slice {s.index} ({', '.join(s.names)}) changed between forward and "
                "backward (for example optimizer.step() before backward). Run backward before updating parameters."
            )


def _split_output_grads(run: _Run, grad_outputs: Sequence[torch.Tensor | None]) -> list[list[Any]]:
    call = run.call
    count = run.split.count
    per_position: dict[int, list[torch.Tensor | None]] = {}
    for position, grad in zip(call.output_tensor_positions, grad_outputs):
        per_position[position] = split_like(grad, run.split.sizes)
    num_leaves = len(call.output_leaves)
    return [[per_position[p][m] if p in per_position else None for p in range(num_leaves)] for m in range(count)]


class _BoundaryLoader:
    """Loads checkpointed boundary activations to the device one step ahead of their recompute."""

    def __init__(self, engine: Engine, run: _Run, saved: Sequence[torch.Tensor]) -> None:
        self.engine = engine
        self.run = run
        self.saved = saved
        self._loaded: dict[tuple[int, int], tuple[list[Any], list[Event | None]]] = {}

    def prefetch(self, i: int, m: int) -> None:
        record = self.run.records[i][m]
        if not isinstance(record, _Checkpoint) or (i, m) in self._loaded:
            return
        leaves: list[Any] = []
        events: list[Event | None] = []
        for leaf in record.inputs:
            if leaf.stash is None:
                leaves.append(leaf.value)
                continue
            host = self.saved[leaf.stash]
            if leaf.ticket is not None:
                tensor, ready = self.engine.activations.load(leaf.ticket, host)
            elif host.device != self.engine.device:
                tensor, ready = self.engine.activations.load_host(host)
            else:
                tensor, ready = host, None
            leaves.append(tensor)
            events.append(ready)
        self._loaded[(i, m)] = (leaves, events)

    def take(self, i: int, m: int) -> list[Any]:
        self.prefetch(i, m)
        leaves, events = self._loaded.pop((i, m))
        for event in events:
            self.engine.copies.wait_ready(event)
        return leaves


def _recompute(engine: Engine, run: _Run, saved: Sequence[torch.Tensor], loader: _BoundaryLoader, i: int, m: int,
               record: _Checkpoint, views: Sequence[torch.Tensor]
               ) -> tuple[list[Any], list[Any], list[torch.Tensor], list[torch.Tensor]]:
    """Re-run slice ``i`` on microbatch ``m`` with a graph, exactly as forward ran it.

    Returns its outputs, its input leaves, its parameter leaves and every entry's tensor it ran with.
    """
    leaves = loader.take(i, m)
    if record.buffers is not None:
        stash_index, ticket = record.buffers
        engine.slots.restore_buffers(i, saved[stash_index], ticket)
    device_rng = saved[record.device_rng] if record.device_rng is not None else None
    with replaying_rng(engine.device, saved[record.cpu_rng], device_rng), run.autocast.applied(), \
            torch.enable_grad(), recomputing():
        # The leaves require grad as in forward even where this backward wants no input gradient:
        # the recompute must take the forward's kernels (Note: [Boundary gradients]).
        graph_leaves, fed = _graph_inputs(leaves, record.requires)
        entry_tensors = _param_leaves(views, engine, i)
        # Autocast's cache stays on here, as in the plain model: a weight used twice is cast once,
        # and the two uses' gradients meet in half precision, as there.
        result = engine.run_slice(i, entry_tensors, tree_unflatten(fed, record.spec))
    # Leaving the replayed autocast empties the cache unless the caller's own autocast block is
    # still open (a backward inside it): then the cache would keep this slice's casts until that
    # block ends. The recompute's graph holds what its backward needs.
    if _autocast_open(engine.device):
        torch.clear_autocast_cache()
    outputs, _ = tree_flatten(result.output)
    params = [t for t, e in zip(entry_tensors, engine.slices[i].storage.entries) if e.is_parameter]
    return outputs, graph_leaves, params, entry_tensors


def _autocast_open(device: torch.device) -> bool:
    return torch.is_autocast_enabled("cpu") or (device.type != "cpu" and torch.is_autocast_enabled(device.type))


@contextlib.contextmanager
def _naming_reentrant_checkpoints(engine: Engine, index: int) -> Iterator[None]:
    """Turn the reentrant checkpoint's refusal of ``torch.autograd.grad`` into advice that names
    the layers: the user never passed the argument PyTorch's message tells them to remove."""
    try:
        yield
    except RuntimeError as error:
        if "use_reentrant=True" not in str(error) or ".grad()" not in str(error):
            raise
        names = ", ".join(engine.slices[index].names)
        raise RuntimeError(
            f"a layer in slice {index} ({names}) uses torch.utils.checkpoint with use_reentrant=True, which "
            "cannot run inside OffloadModel's backward (it refuses torch.autograd.grad). Use "
            "use_reentrant=False (PyTorch's recommended form; for Hugging Face models, "
            "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})), or leave "
            "the checkpointing to OffloadModel, which already recomputes each slice."
        ) from error


def _kept_entry_tensors(engine: Engine, index: int, record: _KeptGraph, views: Sequence[torch.Tensor]
                        ) -> list[torch.Tensor]:
    """What slice ``index``'s layers must see while autograd runs a graph kept from forward: its
    parameter leaves, pointed at the slot that holds the slice now (it may have moved), and the
    buffers there."""
    params = iter(record.params)
    tensors: list[torch.Tensor] = []
    for view, entry in zip(views, engine.slices[index].storage.entries):
        if entry.is_parameter:
            leaf = next(params)
            leaf.data = view  # same leaf (the graph's), current memory
            tensors.append(leaf)
        else:
            tensors.append(view)
    return tensors


def _differentiate(outputs: Sequence[Any], grads: Sequence[Any], inputs: Sequence[Any], params: Sequence[torch.Tensor],
                   params_needed: Sequence[bool], wants_input_grads: bool, retain_graph: bool
                   ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Gradients of one slice-microbatch graph w.r.t. its boundary inputs and its parameters."""
    pairs = [
        (o, g) for o, g in zip(outputs, grads)
        if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
    ]
    wrt: list[torch.Tensor] = []
    input_slots: list[int] = []
    param_slots: list[int] = []
    if wants_input_grads:
        for k, x in enumerate(inputs):
            if isinstance(x, torch.Tensor) and x.requires_grad:
                input_slots.append(k)
                wrt.append(x)
    for j, (p, want) in enumerate(zip(params, params_needed)):
        if want and p.requires_grad:
            param_slots.append(j)
            wrt.append(p)
    in_grads: list[torch.Tensor | None] = [None] * len(inputs)
    param_grads: list[torch.Tensor | None] = [None] * len(params)
    if not pairs or not wrt:
        return in_grads, param_grads
    # A kept graph's saved slot tensors resolve through the unpack hook registered when they were
    # saved; the slice was acquired above, so they resolve to its current device copy.
    results = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                  allow_unused=True, retain_graph=retain_graph)
    for k, g in zip(input_slots, results[:len(input_slots)]):
        in_grads[k] = g
    for j, g in zip(param_slots, results[len(input_slots):]):
        param_grads[j] = g
    return in_grads, param_grads


def _unshared(param_grads: Sequence[torch.Tensor | None], others: Sequence[Any]) -> list[torch.Tensor | None]:
    """The parameter gradients, each in dense memory of its own.

    Autograd may return one tensor as several gradients: ``x + p`` with equal shapes gives ``p``,
    ``x`` and the upstream gradient the same tensor, and the input's gradient goes on to the previous
    slice. A milestone subscriber may rewrite a slice's gradients in place (the device average
    does), which must reach neither the previous slice nor a second parameter, so a gradient that
    shares memory with another is copied; usually none does, and nothing is copied. For the same
    rewrite, and for collectives, which take a gradient's memory as one run, a gradient that is not
    dense is made so: ``p.sum()`` gives ``p`` an expanded gradient, one element seen through
    stride 0. A dense one in another layout (a ``channels_last`` weight's) stays as it is.
    """
    taken = {t.untyped_storage().data_ptr() for t in others if isinstance(t, torch.Tensor)}
    unshared: list[torch.Tensor | None] = []
    for g in param_grads:
        if g is not None:
            pointer = g.untyped_storage().data_ptr()
            if pointer in taken or flat_alias(g) is None:
                g = g.clone(memory_format=torch.contiguous_format)
            else:
                taken.add(pointer)
        unshared.append(g)
    return unshared


def _input_grads(run: _Run, grad_in: list[list[torch.Tensor | None]] | None,
                 inputs_needed: Sequence[bool]) -> list[torch.Tensor | None]:
    """Gradients of the model's input tensors, joined over microbatches, on each input's device."""
    call = run.call
    results: list[torch.Tensor | None] = []
    for k, position in enumerate(call.tensor_positions):
        if grad_in is None or not inputs_needed[k]:
            results.append(None)
            continue
        per_mb = [grad_in[m][position] if grad_in[m] else None for m in range(run.split.count)]
        shape, dtype, device = run.input_meta[k]
        grad = join_input_grads(per_mb, run.split.sizes, run.split.carries_batch[position], shape[1:], dtype)
        if grad is not None and grad.device != device:
            grad = run.engine.copies.to_host(grad, device)
        results.append(grad)
    return results
