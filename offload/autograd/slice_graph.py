"""Running one slice on one microbatch as autograd must see it: in forward (a graph kept, or a
checkpointed run that keeps nothing) and in backward (the graph kept, or rebuilt by a recompute,
then differentiated).

The walk (``offload/walk/slice_walk.py``) has put the slice on the device; the records
(``offload/autograd/records.py``) hold what forward left for backward.

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

Note: [Leaves enter through a copy]
    A slice's graph starts from leaves (the boundary activations, detached); each leaf that needs a
    gradient enters the slice through a copy, so a first layer that works in place on its input
    (``ReLU(inplace=True)``) behaves as in the plain model, where its input is not a leaf. The
    copy keeps the leaf's layout, a strided view's gaps included (Note: [Layouts] in
    ``offload/streams/layouts.py``); a leaf whose elements overlap (an ``expand``) cannot be
    copied into its own layout and enters as a view of itself (rule 3 there).

    What the copy cannot give: in the plain model such a layer writes the caller's tensor (or
    refuses, for a leaf that requires grad), and code that reads the input again after the call
    (a residual or a gate outside the model) sees the written values. Here the layer writes the
    copy and the caller's tensor keeps its values; autograd cannot be made to record a write into
    the caller's tensor from inside the model. So the first run of the first slice (microbatch 0)
    compares each entering copy's version before and after it, and a write is told in a warning
    naming the slice's layers and what to do (make the layer out of place).

Note: [Boundary leaves that alias each other]
    A layer may hand the next the same tensor twice (``(h, h)``: hidden states and the residual
    stream), or a tensor and a view of it, and a model input may hold one tensor twice
    (``{"x": x, "y": x}``). In the plain model each is one tensor, and autograd sums the
    gradients of all its uses in its own order into it. Detached one leaf a place, they would be
    summed per place in the slice's graph and again across places in the graph before: the same
    values in another order, other rounding. So a slice's leaves that alias each other (the rules
    of Note: [Outputs that alias each other] in ``offload/autograd/call.py``: the same memory,
    read alike and with the same need for a gradient, one holding the other) are detached once:
    the base enters as any leaf does, each other leaf enters as the base itself or a view over
    what the base entered as, and only the base is differentiated with respect to. Where the
    leaves reach the slice in one memory: a kept or offloaded graph, and a recompute whose leaves
    are the same tensor, which the checkpoint saves once (Note: [Leaves that pass through] in
    ``records.py``); a recompute's view of another leaf is loaded on its own, and stays a leaf of
    its own there, summed as before.

Note: [Device copies while autograd runs a slice]
    A layer may run part of its own forward again while autograd differentiates it: a
    ``torch.utils.checkpoint`` inside the layer, or a Hugging Face model with gradient
    checkpointing enabled, recomputes during the slice's backward. The layers must see the device
    copies then too, not the host copies that are bound again between runs; so the slice's
    tensors are bound (``Slice.bound``) for as long as autograd runs the slice's graph, a kept
    graph's parameter leaves pointed at the slot that holds the slice at that time.

Note: [Parameters a layer casts in forward]
    A layer may replace a parameter's data in its forward: bitsandbytes' ``Linear4bit`` runs
    ``bias.data = bias.data.to(x.dtype)`` when its bias is not in its compute dtype (a float32
    bias, as ``prepare_model_for_kbit_training`` leaves it, under ``bnb_4bit_compute_dtype=
    torch.bfloat16``). The run's leaf then enters the graph in the new dtype, autograd's gradient
    for it comes out in that dtype, and it is cast to the parameter's where it is read (Note:
    [Gradients in the compute dtype] in ``offload/streams/gradients.py``); microbatches sum in
    float32.

    1. A kept graph's leaves are pointed at the slot again before backward (``leaf.data = view``,
       Note: [Device copies while autograd runs a slice]). For a leaf in another dtype (or on
       another device) than its slot's that assignment makes PyTorch drop the leaf's gradient
       accumulator, the one the graph reaches: ``torch.autograd.grad`` would return ``None`` for
       it, and the parameter would get no gradient, silently (with microbatches, only the
       recomputed ones' share). Such a leaf keeps the memory the layer gave it instead: its own,
       which no slice writes, holding what the forward used.
    2. A recompute runs on fresh leaves, which the layer casts again before using them.
    3. The host copy keeps its dtype: the cast reaches the run's leaf only. The plain model's
       parameter stays in the compute dtype from its first forward on, and its optimizer steps it
       there; the offloaded model steps its float32 master (``docs/lora.md``).

Note: [Layers that differentiate in forward]
    A layer may differentiate, inside its forward, a graph built during it (an energy's gradient
    as a force: ``torch.autograd.grad(e, x, create_graph=True)``); autograd then unpacks what that
    graph saved while the slice is still running. By mode (Note: [Three ways to keep a slice's
    activations] in ``offload/walk/activation_policy.py``):

    1. *Kept graph*: works as in the plain model, ``create_graph`` or not. A saved slot tensor
       resolves to a tensor of its own over the slot (``SlotReferences.resolve``), so a graph that
       saves it again is not taken to be changed in place when the slot is loaded again.
    2. *Recompute*: the forward saves nothing (Note: [Boundary gradients]), so there is nothing to
       differentiate; the unpack refuses, saying to pass ``checkpoint_activation=False``. Keeping
       the saved tensors until the run ends would cost every checkpointed run its activations.
    3. *Offload*: the saved tensors are on their way to the host until the slice's backward loads
       them; the unpack refuses likewise (``SavedActivations``).

Note: [Activations used outside the model]
    A forward hook (or pre-hook) may capture an activation inside the model and add a term on it to
    the loss (deep supervision, feature matching, a perceptual loss). In the plain model that
    term's gradient flows on into the layers before. Here it cannot: each slice's graph starts from
    detached leaves, and the walk carries gradients across boundaries only from the model's output.

    1. A slice's boundary input (what a pre-hook on its first layer sees) is its leaf's entering
       copy: the term's gradient would stop in the leaf's ``.grad``, and the layers before would
       get wrong gradients, silently. So each boundary leaf of a forward run that needs a
       gradient carries a hook that fires when a gradient is added into its ``.grad``, and raises
       naming the slice. Only a backward from outside the model adds there: the walk's own
       backward calls ``torch.autograd.grad``, which returns gradients and adds into no
       ``.grad``. One hook object a slice, registered on forward's leaves only (a recompute's
       leaves are the walk's); about 2 us a leaf (``register_post_accumulate_grad_hook``).
    2. A kept graph's parameter leaves carry it too: its saved tensors that are not slot memory
       (the input of a first layer whose input needs no gradient, an embedding's indices) unpack
       from outside, so the term's gradient would stop in a parameter leaf's ``.grad``. A
       checkpointed or offloaded run's saved tensors all refuse to unpack before the slice's
       backward (rule 3), so its parameter leaves go without, which spares a checkpointed
       decoder layer's nine parameters some 17 us a run; a branch that reaches a parameter
       through operations that save nothing (a bias added to an input that needs no gradient,
       and nothing else) goes unseen there.
    3. An activation a layer made: its graph reaches what the slice's forward saved, which a
       checkpointed forward discards (``_never_unpacked`` refuses), an offloaded one has sent to
       the host (``SavedActivations``), and a kept graph holds as references to a slot that
       backward has not acquired (``SlotReferences.resolve`` refuses); the first and the last
       name this cause first.
    4. Autograd runs the branch built inside forward before the model's own node (it was made
       later), so the refusal comes before the walk's backward has added into any parameter's
       ``.grad``: ``zero_grad`` and the next step train as before.

    Return the activation from the model as part of its output instead.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import TreeSpec

from ..walk.engine import Engine
from ..walk.module_state import attributes_as_started
from ..walk.structures import flatten, unflatten
from ..streams.layouts import copy_keeping_layout, overlaps
from ..walk.activation_policy import ActivationMode
from .call import bases_among
from .records import (SPARSE_LAYOUTS, BoundaryLoader, Checkpoint, ForwardRecords, KeptGraph, OffloadedGraph,
                      where_read)
from .recompute_state import discarded_graph, recomputing
from .replay import AutocastState, autocast_cache_disabled, replaying_rng


@dataclass
class Boundary:
    """What crosses into a slice on one microbatch: flattened leaves, on the device, with what each
    requires (Note: [Boundary gradients])."""

    leaves: list[Any]
    spec: TreeSpec
    requires: list[bool]


def is_differentiable(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def requires_grad(leaves: Sequence[Any]) -> list[bool]:
    return [isinstance(x, torch.Tensor) and x.requires_grad for x in leaves]


def _discard(tensor: torch.Tensor) -> None:
    return None


def _never_unpacked(index: int, packed: None) -> torch.Tensor:
    raise RuntimeError(
        f"OffloadModel: a layer in slice {index} saved tensors for backward, which the slice's checkpointed "
        "forward does not keep (the slice runs again in backward), and autograd asked for them before the "
        "slice's backward. Most likely an activation made inside the OffloadModel was used outside it: "
        "captured by a forward hook or stored in an attribute, then used in the loss (deep supervision, "
        "feature matching, a perceptual loss). Its gradient cannot reach the layers before it: return the "
        "activation from the model as part of its output instead (Note: [Activations used outside the "
        "model]). Otherwise a layer in the slice differentiated, inside its forward, a graph built during "
        "that forward (torch.autograd.grad or .backward() in forward, as for a force from an energy): pass "
        "checkpoint_activation=False (the slice keeps its graph, as in the plain model), and leave the slice "
        "out of offload_activations. If neither, this is an internal error of OffloadModel (Note: [Layers "
        "that differentiate in forward])")


def _used_outside(index: int, leaf: torch.Tensor) -> None:
    raise RuntimeError(
        f"OffloadModel: a backward from outside the model reached the graph slice {index} built in forward (at "
        "its input or at a parameter of its layers): an activation made inside the OffloadModel was used outside "
        "it, captured by a forward hook (a pre-hook on the slice's first layer sees the slice's input) or stored "
        "in an attribute, then used in the loss. Its gradient cannot reach the layers before it nor the "
        "parameters, which would get wrong gradients. Return the activation from the model as part of its "
        "output instead (Note: [Activations used outside the model]). A layer that calls .backward() inside its "
        "forward reaches it too: use torch.autograd.grad there")


@functools.cache
def _outside_hook(index: int) -> functools.partial[None]:
    """Slice ``index``'s hook on its forward's leaves: one object, made once (rules 1 and 2 of
    Note: [Activations used outside the model])."""
    return functools.partial(_used_outside, index)


def _refuse_gradients_from_outside(index: int, graph_leaves: Sequence[Any], entry_tensors: Sequence[torch.Tensor]
                                   ) -> None:
    """Make the leaves of slice ``index``'s forward that need a gradient (its boundary leaves, and
    its parameter leaves where given) raise if one is added into their ``.grad`` (rules 1 and 2 of
    Note: [Activations used outside the model])."""
    hook = _outside_hook(index)
    for leaf in (*graph_leaves, *entry_tensors):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.is_leaf:
            leaf.register_post_accumulate_grad_hook(hook)


def _saving_nothing(index: int) -> torch.autograd.graph.saved_tensors_hooks:
    """Hooks under which slice ``index``'s graph saves nothing: a checkpointed forward builds one
    only to learn what its outputs require, so its activations are freed as soon as they are used,
    as under ``no_grad``. Innermost hooks win, so the caller's hooks (``save_on_cpu``) see nothing
    either. A layer that differentiates its graph inside forward is refused (Note: [Layers that
    differentiate in forward])."""
    return torch.autograd.graph.saved_tensors_hooks(_discard, functools.partial(_never_unpacked, index))


def _graph_inputs(leaves: Sequence[Any], requires: Sequence[bool], copy_all: bool = False
                  ) -> tuple[list[Any], list[Any]]:
    """Leaves to differentiate with respect to (``None`` for one another holds), and what the slice
    receives in their place (call with grad enabled: the copies must be part of the graph; Note:
    [Leaves enter through a copy], Note: [Boundary leaves that alias each other]); ``copy_all``:
    strided leaves that need no gradient enter through a copy too (rule 1 of Note: [The caller's
    saved-tensor hooks] in ``function.py``)."""
    wants = [isinstance(x, torch.Tensor) and wanted and is_differentiable(x) for x, wanted in zip(leaves, requires)]
    held_by = bases_among(leaves, wants)
    graph_leaves: list[Any] = list(leaves)
    fed: list[Any] = list(leaves)
    for k, (leaf, wanted) in enumerate(zip(leaves, wants)):
        if isinstance(leaf, torch.Tensor) and k not in held_by:
            graph_leaves[k] = detached = leaf.detach().requires_grad_(wanted)
            copied = wanted or copy_all and leaf.layout == torch.strided
            fed[k] = _entering(detached) if copied else detached
    for k, base in held_by.items():  # its gradient reaches the base's leaf through the view, as in the plain model
        graph_leaves[k] = None
        fed[k] = _view_over(fed[base], leaves[base], leaves[k])
    return graph_leaves, fed


def _forward_inputs(entering: Boundary, i: int, m: int) -> tuple[list[Any], list[Any], list[tuple[torch.Tensor, int]],
                                                                  list[tuple[int, Any, int, Any]]]:
    """:func:`_graph_inputs` for slice ``i``'s run on microbatch ``m`` in forward, with the copies the
    model's input enters through and their versions on the first run, to be compared after it (Note:
    [Leaves enter through a copy]; none on the other runs), and every copy a leaf entered through, by
    its position, held weakly, with its version and memory (for ``ForwardRecords.passed_through``)."""
    _refuse_sparse_gradients(entering, i)
    # Rule 1 of Note: [The caller's saved-tensor hooks] in function.py (a module global the block sets).
    copy_all = i == 0 and torch.autograd.graph._allow_mutation_on_saved_tensors_enabled
    graph_leaves, fed = _graph_inputs(entering.leaves, entering.requires, copy_all)
    copies = [(k, t) for k, (t, leaf) in enumerate(zip(fed, graph_leaves))
              if isinstance(leaf, torch.Tensor) and leaf.requires_grad and t is not leaf]
    entered = [(k, weakref.ref(t), t._version, where_read(t)) for k, t in copies]
    watched = [(t, t._version) for _, t in copies] if i == 0 and m == 0 else []
    return graph_leaves, fed, watched, entered


def _refuse_sparse_gradients(entering: Boundary, i: int) -> None:
    """Raise where a sparse leaf that needs a gradient enters slice ``i`` (rule 2 of Note: [Sparse
    boundary leaves] in ``records.py``)."""
    for leaf, wanted in zip(entering.leaves, entering.requires):
        if wanted and isinstance(leaf, torch.Tensor) and leaf.layout in SPARSE_LAYOUTS:
            source = "the model's input" if i == 0 else f"slice {i - 1}'s output"
            raise RuntimeError(
                f"OffloadModel: slice {i} receives a sparse tensor ({leaf.layout}, shape {tuple(leaf.shape)}) that "
                f"needs a gradient, from {source}. A gradient cannot cross a slice boundary to a sparse tensor "
                "(Note: [Sparse boundary leaves] in offload/autograd/records.py). Pass it dense (.to_dense()), "
                "or make the sparse tensor from dense ones inside the slice that uses it (num_slices, or a layer "
                "that does both); a sparse tensor that needs no gradient (an adjacency matrix) crosses as it is")


def _warn_if_input_written(engine: Engine, watched: Sequence[tuple[torch.Tensor, int]]) -> None:
    """Warn where slice 0's first run wrote a copy the model's input entered through (Note:
    [Leaves enter through a copy])."""
    if all(t._version == version for t, version in watched):
        return
    # Attributed to this line, so that the default filter shows it once a process, not once a step.
    warnings.warn(
        f"OffloadModel: a layer of the first slice (layers {', '.join(engine.slices[0].names)}) wrote the model's "
        "input in place (nn.ReLU(inplace=True), x.add_(...)), and the input needs a gradient. Such an input enters "
        "the model through a copy, so the layer wrote the copy and your tensor keeps its values, where the plain "
        "model changes it (or refuses, for a leaf that requires grad): code that reads the input again after the "
        "call sees other values than with the plain model. Make that layer out of place (nn.ReLU(), x.add(...)), "
        "or apply the step to the input before calling the model (docs/api.md, Layouts)")


def _view_over(fed_base: torch.Tensor, base: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    """``leaf``, which ``base`` holds, as a view of what the base is fed as: the base itself where
    the two are alike, else the same place in it (an entering copy keeps the base's strides)."""
    if leaf.shape == base.shape and leaf.stride() == base.stride() and leaf.storage_offset() == base.storage_offset():
        return fed_base
    offset = fed_base.storage_offset() + leaf.storage_offset() - base.storage_offset()
    return fed_base.as_strided(leaf.shape, leaf.stride(), offset)


def _entering(leaf: torch.Tensor) -> torch.Tensor:
    """What a leaf that needs a gradient enters its slice as (Note: [Leaves enter through a copy])."""
    return leaf.view_as(leaf) if overlaps(leaf) else copy_keeping_layout(leaf)


def _param_leaves(views: Sequence[torch.Tensor], engine: Engine, index: int) -> list[torch.Tensor]:
    """What a graph of slice ``index`` runs with: parameter leaves over the device copies, buffers as they are."""
    return engine.slices[index].entry_tensors(views)


def _params_among(entry_tensors: Sequence[torch.Tensor], engine: Engine, index: int) -> list[torch.Tensor]:
    return [t for t, e in zip(entry_tensors, engine.slices[index].storage.entries) if e.is_parameter]


# -- forward ----------------------------------------------------------------------------------------


def run_forward(engine: Engine, records: ForwardRecords, i: int, m: int, views: Sequence[torch.Tensor],
                entering: Boundary) -> tuple[Boundary, bool]:
    """Run slice ``i`` on microbatch ``m`` in forward, leaving its record.

    Returns what leaves the slice (outputs detached) and whether the run changed its buffers.
    """
    s = engine.slices[i]
    records.attributes_before_run(m)
    mode = records.mode(i, m)
    if mode is ActivationMode.OFFLOAD:
        saves = records.new_saves()
        with torch.enable_grad(), saves.hooks():
            graph_leaves, fed, watched, entered = _forward_inputs(entering, i, m)
            entry_tensors = _param_leaves(views, engine, i)
            result = s.run_on_device(engine.slots, entry_tensors, unflatten(fed, entering.spec))
            del fed
        saves.seal()
        out_leaves, out_spec = flatten(result.output, f"slice {i}'s output")
        records.offload_graph(i, m, out_leaves, graph_leaves, _params_among(entry_tensors, engine, i), saves)
    elif mode is ActivationMode.KEEP:
        with torch.enable_grad(), engine.slots.references.saved_tensors_hooks():
            graph_leaves, fed, watched, entered = _forward_inputs(entering, i, m)
            entry_tensors = _param_leaves(views, engine, i)
            result = s.run_on_device(engine.slots, entry_tensors, unflatten(fed, entering.spec))
        out_leaves, out_spec = flatten(result.output, f"slice {i}'s output")
        records.keep_graph(i, m, out_leaves, graph_leaves, _params_among(entry_tensors, engine, i))
    else:
        records.save_rng(i, m)
        # With grad enabled, as in the plain model, so that every output requires grad exactly as
        # there and kernels that look at it choose alike; nothing is saved (Note: [Boundary gradients]).
        with torch.enable_grad(), _saving_nothing(i), autocast_cache_disabled(), discarded_graph():
            graph_leaves, fed, watched, entered = _forward_inputs(entering, i, m)
            entry_tensors = _param_leaves(views, engine, i)
            result = s.run_on_device(engine.slots, entry_tensors, unflatten(fed, entering.spec))
            del fed
        if result.buffers_changed:
            records.buffers_changed_by(i, m)
        else:
            records.buffers_kept_by(i, m)
        out_leaves, out_spec = flatten(result.output, f"slice {i}'s output")
    _warn_if_input_written(engine, watched)
    _refuse_gradients_from_outside(i, graph_leaves, entry_tensors if mode is ActivationMode.KEEP else ())
    if m == 0:
        _refuse_outside_leaves(i, out_leaves, graph_leaves, entry_tensors)
    records.attributes_after_run(i, m)
    out_requires = requires_grad(out_leaves)
    detached = [o.detach() if isinstance(o, torch.Tensor) else o for o in out_leaves]
    records.passed_through(entering.leaves, entered, out_leaves, detached)
    # The caller drops the result here, which frees a checkpointed run's graph right away.
    return Boundary(detached, out_spec, out_requires), result.buffers_changed


#: The node that adds a leaf's gradient into its ``.grad``: a leaf of the graph.
_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad


def _refuse_outside_leaves(i: int, outputs: Sequence[Any], graph_leaves: Sequence[Any],
                           entry_tensors: Sequence[torch.Tensor]) -> None:
    """Raise if slice ``i``'s run reached a parameter that requires grad other than its own (Note:
    [Leaves outside the slice]).

    Note: [Leaves outside the slice]
        Backward differentiates each slice with respect to its boundary leaves and the parameters
        registered in its layers, which is all autograd can reach through the Function. A layer
        may reach another tensor that requires grad: a parameter captured by a forward hook, held
        in a plain attribute, or another layer's weight referenced directly instead of registered
        (tied) in this layer too. The plain model gives it a gradient; the walk would not, and
        nothing downstream could tell. So the first microbatch of every slice run in forward looks
        at the accumulation nodes its graph reaches (the graph is built anyway, to learn what the
        outputs require: Note: [Boundary gradients]) and refuses an ``nn.Parameter`` it does not
        own, with what to do instead; once per slice and step, not per microbatch.

        Parameters only: a plain tensor leaf may be made inside the run, and then nothing reads its
        gradient in the plain model either. ``enable_input_require_grads()`` (which PEFT's
        ``prepare_model_for_kbit_training`` and Hugging Face's gradient checkpointing call) makes
        a frozen embedding's output a new leaf that requires grad, so that checkpointed layers
        after it keep a graph. A plain tensor made to require grad before the forward and reached
        by a hook or an attribute goes unseen: train parameters.
    """
    known = {id(t) for t in (*graph_leaves, *entry_tensors) if isinstance(t, torch.Tensor)}
    pending = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    seen: set[Any] = set()
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node) is not _ACCUMULATE_GRAD:
            pending += [next_node for next_node, _ in node.next_functions]
            continue
        variable = node.variable
        if isinstance(variable, nn.Parameter) and id(variable) not in known:
            raise RuntimeError(
                f"OffloadModel: slice {i} used a parameter that requires grad (shape {tuple(variable.shape)}, "
                f"{variable.dtype}) that is not registered in its layers. Backward differentiates each slice "
                "with respect to its inputs and its layers' parameters only, so this one would get no "
                "gradient. This happens with a parameter captured by a forward hook or held in a plain "
                "attribute, or another layer's weight referenced directly. Register it as a parameter of a "
                "layer of the model (tie a shared weight by assigning the same nn.Parameter to both layers), "
                "or detach it (requires_grad_(False)) if it needs no gradient. If it is a weight of an earlier "
                "slice, an activation reached this slice inside an object OffloadModel does not open (an "
                "instance of a plain class): pass it in a tuple, dict, namedtuple or dataclass (Note: "
                "[Containers pytree keeps whole] in offload/walk/structures.py)."
            )


# -- backward ---------------------------------------------------------------------------------------


@dataclass
class SliceGraph:
    """One slice-microbatch graph, ready to differentiate.

    Attributes:
        outputs: the graph's outputs, flattened.
        inputs: its boundary leaves (those that need a gradient require grad).
        params: its parameter leaves, over the slice's device copy.
        entry_tensors: every storage entry's tensor it runs with (Note: [Device copies while
            autograd runs a slice]).
        retain: whether differentiating keeps the graph (a kept graph under ``retain_graph``).
        restored_buffers: a recompute loaded the buffers forward's run found over the slice's
            (rule 4 of Note: [Buffers] in ``offload/walk/slice_walk.py``).
    """

    outputs: list[Any]
    inputs: list[Any]
    params: list[torch.Tensor]
    entry_tensors: list[torch.Tensor]
    retain: bool
    restored_buffers: bool = False


def graph_of(engine: Engine, record: Checkpoint | KeptGraph | OffloadedGraph, autocast: AutocastState,
             saved: Sequence[torch.Tensor], loader: BoundaryLoader, i: int, m: int,
             views: Sequence[torch.Tensor], retain_graph: bool) -> SliceGraph:
    """The graph of slice ``i`` on microbatch ``m``: the one forward kept (its saved tensors loaded
    back if they were offloaded), or a recompute."""
    if isinstance(record, OffloadedGraph):
        # Loaded one step ahead (BoundaryLoader.prefetch); the first run backward reaches, or a
        # second backward through a retained graph, loads here.
        record.saves.wait()
        return SliceGraph(record.outputs, record.inputs, record.params,
                          _kept_entry_tensors(engine, i, record, views), retain_graph)
    if isinstance(record, KeptGraph):
        return SliceGraph(record.outputs, record.saved_inputs(saved), record.params,
                          _kept_entry_tensors(engine, i, record, views), retain_graph)
    return _recompute(engine, record, autocast, saved, loader, i, m, views)


def _recompute(engine: Engine, record: Checkpoint, autocast: AutocastState, saved: Sequence[torch.Tensor],
               loader: BoundaryLoader, i: int, m: int, views: Sequence[torch.Tensor]) -> SliceGraph:
    """Re-run slice ``i`` on microbatch ``m`` with a graph, exactly as forward ran it."""
    leaves = loader.take(i, m)
    restored = record.restore_buffers(engine.slots, i, saved)
    with attributes_as_started(record.attributes), replaying_rng(engine.device, *record.rng_states(saved)), autocast.applied(), \
            torch.enable_grad(), recomputing():
        # The leaves require grad as in forward even where this backward wants no input gradient:
        # the recompute must take the forward's kernels (Note: [Boundary gradients]).
        graph_leaves, fed = _graph_inputs(leaves, record.requires)
        entry_tensors = _param_leaves(views, engine, i)
        # Autocast's cache stays on here, as in the plain model: a weight used twice is cast once,
        # and the two uses' gradients meet in half precision, as there.
        result = engine.slices[i].run_on_device(engine.slots, entry_tensors, unflatten(fed, record.spec))
    # Leaving the replayed autocast empties the cache unless the caller's own autocast block is
    # still open (a backward inside it): then the cache would keep this slice's casts until that
    # block ends. The recompute's graph holds what its backward needs.
    if _autocast_open(engine.device):
        torch.clear_autocast_cache()
    outputs, _ = flatten(result.output, f"slice {i}'s output")
    return SliceGraph(outputs, graph_leaves, _params_among(entry_tensors, engine, i), entry_tensors, retain=False,
                      restored_buffers=restored)


def _autocast_open(device: torch.device) -> bool:
    return torch.is_autocast_enabled("cpu") or (device.type != "cpu" and torch.is_autocast_enabled(device.type))


def _kept_entry_tensors(engine: Engine, index: int, record: KeptGraph | OffloadedGraph, views: Sequence[torch.Tensor]
                        ) -> list[torch.Tensor]:
    """What slice ``index``'s layers must see while autograd runs a graph kept from forward: its
    parameter leaves, pointed at the slot that holds the slice now (it may have moved), and the
    buffers there."""
    params = iter(record.params)
    tensors: list[torch.Tensor] = []
    for view, entry in zip(views, engine.slices[index].storage.entries):
        if entry.is_parameter:
            leaf = next(params)
            # A leaf outside every slot is memory of the layer's own (bitsandbytes repacks a 4-bit weight
            # for its CPU kernel in a forward without autograd through it): no other slice wrote it.
            if entry.companions and leaf.data_ptr() != view.data_ptr() and engine.slots.owns(leaf):
                # Rule 5 of Note: [Quantized weights] in offload/streams/quantized.py.
                raise RuntimeError(
                    f"slice {index} holds a quantized weight and its graph was kept from forward, but the slice is "
                    "in another device slot now (a second forward ran before this backward): bitsandbytes keeps the "
                    "weight on its autograd context, out of OffloadModel's reach. Run backward before the next "
                    "forward, or put the last layer with a quantized weight before the last slice")
            if leaf.dtype == view.dtype and leaf.device == view.device:
                leaf.data = view  # same leaf (the graph's), current memory
            # else the layer cast the leaf's data: rule 1 of Note: [Parameters a layer casts in forward].
            tensors.append(leaf)
        else:
            tensors.append(view)
    return tensors


def differentiate(engine: Engine, i: int, graph: SliceGraph, grads: Sequence[Any], params_needed: Sequence[bool],
                  wants_input_grads: bool) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Gradients of one slice-microbatch graph w.r.t. its boundary inputs and its parameters."""
    # See Note: [Device copies while autograd runs a slice].
    with engine.slices[i].bound(graph.entry_tensors), _naming_reentrant_checkpoints(engine, i):
        return _gradients(graph, grads, params_needed, wants_input_grads)


def _gradients(graph: SliceGraph, grads: Sequence[Any], params_needed: Sequence[bool], wants_input_grads: bool
               ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    inputs, params = graph.inputs, graph.params
    # An offloaded graph's outputs are gradient edges, present only where they require grad.
    pairs = [
        (o, g) for o, g in zip(graph.outputs, grads)
        if g is not None and (isinstance(o, torch.autograd.graph.GradientEdge)
                              or isinstance(o, torch.Tensor) and o.requires_grad)
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
    # saved; the slice was acquired by the walk, so they resolve to its current device copy.
    results = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                  allow_unused=True, retain_graph=graph.retain)
    for k, g in zip(input_slots, results[:len(input_slots)]):
        in_grads[k] = g
    for j, g in zip(param_slots, results[len(input_slots):]):
        param_grads[j] = g
    return in_grads, param_grads


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
            "activation_checkpointing_enable(activation_checkpointing_kwargs={'use_reentrant': False}), or "
            "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}) before "
            "transformers 5.24), or leave "
            "the checkpointing to OffloadModel, which already recomputes each slice."
        ) from error
