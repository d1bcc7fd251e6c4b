"""The gradients of one backward: which ones it must produce, and each slice's gradients on their
way from its graphs to the host, with the milestones between (``offload/walk/milestones.py``).

Note: [Gradients through autograd]
    The host parameters are inputs of the Function and backward returns their gradients, on the
    host. Autograd itself then runs hooks, accumulates into ``.grad`` (or hands the gradients to
    ``torch.autograd.grad``), so every PyTorch semantic holds: accumulation across backwards,
    ``retain_graph``, ``inputs=``, hooks firing once. Everything a backward needs is saved with
    ``ctx.save_for_backward`` or released by backward itself, so autograd frees it with the graph
    and a second backward without ``retain_graph`` fails exactly as in PyTorch. Double backward
    (``create_graph=True``) is refused with an error: the recompute's graph is not differentiable
    twice.

Note: [A slice's gradients on their way]
    For each slice the backward walk visits, in order:

    1. *begin*: if this backward needs any of the slice's parameter gradients, the copy engine
       starts collecting them (``GradientOffloader.begin``);
    2. *add*: each microbatch's gradients, taken from its graph, are added (summed on the device
       from the second microbatch on), each in dense memory of its own (:func:`_unshared`);
    3. *produced*: after the slice's last microbatch, subscribers see the device sums
       (``gradients_produced``) and may rewrite them in place (a device average);
    4. *offload*, then *leaving*: the copy to the host starts, and subscribers see it in flight
       (``gradients_leaving``) while backward goes on with the slices before;
    5. *landed*: after the walk's last slice, every slice's gradients are waited for on the host
       (``gradients_landed``), and handed to autograd as the parameters' gradients.

Note: [A tied weight's gradients summed in place]
    A weight tied across slices is an input of the Function once per slice that computes with it,
    and each of those slices brings its gradient to the host in a pooled buffer of its own. Handed
    to autograd as they are, the engine would sum them into a new tensor outside the pool, of the
    weight's size (an embedding's, every step) while the pooled buffers go idle, and in the order
    it adds a node's outputs (by input index: the first slice's first), where the plain model's
    backward meets the last slice's use first: with three uses or more, another rounding.
    Backward adds them itself instead, last slice first, into the first slice's buffer (the last
    addition puts the sum of the others onto it: addition commutes exactly), and returns that
    buffer once: the plain model's sum, bit for bit, and ``.grad`` lies in the pool as every
    other parameter's does. Where the first slice's gradient is in its gradient file (masters on
    disk: Note: [Gradients on disk]), whose write-back is queued as it lands, the sum stays in the
    last slice's pooled buffer instead, and the file keeps the first slice's part (a borrowing
    slice's gradients have no file). Gradients that cannot be added in place (another dtype, which
    the engine would cast first; a sparse gradient) are left to the engine, as before.

    With the model called more than once in one backward (a siamese pair), the plain model meets
    the last call's uses first, then the call's before: ``((h2 + e2) + h1) + e1``. Each call
    returning its own sum would make autograd add ``(h2 + e2) + (h1 + e1)``, so a walk whose
    later calls each take the weight leaves its sum to them instead of returning it (step 2 of
    Note: [Several calls of the model in one backward] in ``outside_gradients.py``), and the next
    walk's sum starts from it, in its buffer: the plain model's sum again, in no more memory than
    autograd's buffer held. A sum in a gradient file stays where it is, returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..walk.microbatch import join_input_grads, split_like
from ..streams import PendingGradients, SliceGradients
from ..streams.flat_views import flat_alias
from . import outside_gradients
from .accumulation import in_place_targets, restore_zeroed, still_zeroed
from .hook_errors import UPDATES_MAY_HAVE_RUN, note_hook_errors
from .records import CallRecord


def retain_graph_requested() -> bool:
    """Whether the running backward was called with ``retain_graph=True``."""
    getter = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if getter is None else bool(getter())


def needed_grads(ctx: Any, count: int) -> list[bool]:
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


def _accumulates(ctx: Any, first_edge: int, needed: Sequence[bool]) -> bool:
    """Whether this backward adds the model's parameter gradients into ``.grad`` (``.backward()``)
    rather than returning them (``torch.autograd.grad``, which refuses to say for a leaf)."""
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    if will_execute is None or not any(needed):
        return False
    edges = ctx.next_functions
    k = next(k for k, wanted in enumerate(needed) if wanted)
    node = edges[first_edge + k][0] if first_edge + k < len(edges) else None
    if node is None:
        return False
    try:
        return bool(will_execute(node))
    except RuntimeError:
        return False


def _starts(sizes: Sequence[int]) -> list[int]:
    """Where each slice's parameters start among the walk's parameters."""
    starts, offset = [], 0
    for size in sizes:
        starts.append(offset)
        offset += size
    return starts


def split_output_grads(run: CallRecord, grad_outputs: Sequence[torch.Tensor | None]) -> list[list[Any]]:
    """The gradients of the Function's outputs, per microbatch, aligned with the last slice's output leaves."""
    call = run.call
    per_position: dict[int, list[torch.Tensor | None]] = {}
    for position, grad in zip(call.output_tensor_positions, grad_outputs):
        per_position[position] = split_like(grad, run.split.sizes)
    num_leaves = len(call.output_leaves)
    return [[per_position[p][m] if p in per_position else None for p in range(num_leaves)]
            for m in range(run.split.count)]


class BackwardGradients:
    """Which gradients one backward produces, and the journey of each slice's to the host
    (Note: [A slice's gradients on their way]).

    Args:
        ctx: the Function's context (what this backward asks for).
        run: the forward's record.
    """

    def __init__(self, ctx: Any, run: CallRecord) -> None:
        # - What this backward must produce
        self.run = run
        engine = run.engine
        num_inputs = len(run.input_meta)
        sizes = [len(s.storage.params) for s in engine.slices]
        needed = needed_grads(ctx, num_inputs + sum(sizes))
        # A parameter frozen since forward (requires_grad_(False)) gets no gradient, as autograd's
        # accumulation skips a leaf that no longer requires grad: nothing is computed for it here.
        needed[num_inputs:] = [wanted and p.requires_grad for wanted, p in zip(needed[num_inputs:], engine.parameters())]
        self.inputs_needed = needed[:num_inputs]
        # Where each slice's parameters start among the walk's parameters.
        self._starts = _starts(sizes)
        self.per_slice_needed = [needed[num_inputs + start:num_inputs + start + size]
                                 for start, size in zip(self._starts, sizes)]
        #: The lowest slice backward must reach: 0 for input gradients, else the first slice with
        #: a needed parameter gradient (the number of slices if there is none).
        self.lowest = 0 if any(self.inputs_needed) else next(
            (i for i, flags in enumerate(self.per_slice_needed) if any(flags)), engine.num_slices)
        # - Who hears of each slice's final gradients (Note: [Update in backward])
        milestones = engine.milestones
        accumulates = _accumulates(ctx, num_inputs, needed[num_inputs:])
        milestones.backward_started(run.call, accumulates)
        self.final_wanted = milestones.wants_final_gradients(run.call)
        # - Where each gradient goes: per slice, the .grad backward adds it into itself, or None
        #   where autograd receives it (Note: [Gradients added in place] in accumulation.py)
        params = engine.parameters()
        final = milestones.final_parameters(run.call) if self.final_wanted else set()
        # Final gradients are read to start updates (Note: [Update in backward]) only where a subscriber
        # names parameters; the norms of Note: [Norms from backward] name none.
        self._starts_updates = bool(final)
        # The model's other calls in this backward, and each parameter's edge, which says whether
        # they take what this walk leaves (Note: [Several calls of the model in one backward])
        self._calls = outside_gradients.calls_in_backward(engine, ctx)
        self._edges = ctx.next_functions[num_inputs:]
        verdicts = outside_gradients.Verdicts.now()
        clean = {id(p) for p in params if id(p) in verdicts.clean} if accumulates and not self._calls.others else set()
        into, candidates = in_place_targets(ctx, params, num_inputs, needed[num_inputs:], milestones.rewrite_gradients,
                                            any_grad=final, onto_earlier=clean, last_call=not self._calls.later)
        self._into = [into[start:start + size] for start, size in zip(self._starts, sizes)]
        # Gradients go to their slice's file once landed (Note: [Gradients on disk]) unless
        # something rewrites them on their way (host averaging reads the landed views).
        self._homes = not milestones.rewrite_gradients
        # What a failed backward can zero again: .grad that held zeros (rule 6); the others (taken
        # by the backward that starts the update, or added onto earlier gradients) cannot be undone.
        self._undoable = {id(t): p for p, t in zip(params, into) if t is not None and still_zeroed(p, t)}
        self._watched = self._watch(params, into, candidates, final, verdicts.known)
        # - Gradients on their way
        self._slice: SliceGradients | None = None  # the current slice's, while its microbatches run
        self._pending: list[tuple[int, PendingGradients]] = []
        # Slices whose final gradients are not announced yet: (index, pending, per parameter its
        # gradient as .grad will hold it) - announced once their in-place additions are done.
        self._unannounced: list[tuple[int, PendingGradients, list[torch.Tensor | None]]] = []
        self._announced = False  # whether a slice's final gradients were announced (its update may run)

    def _watch(self, params: Sequence[torch.Tensor], into: Sequence[torch.Tensor | None], candidates: Sequence[bool],
               final: set[int], known: frozenset[int]) -> set[int]:
        """Watch, until this backward ends, the parameters added onto earlier gradients and those not
        ``known`` yet (Note: [Adding onto earlier gradients], step 1); their ids. The update in backward
        watches its own (``final``)."""
        chosen = []
        for p, target, candidate in zip(params, into, candidates):
            if not candidate or id(p) in final:
                continue
            onto_earlier = target is not None and id(target) not in self._undoable
            if onto_earlier or id(p) not in known:
                chosen.append((p, onto_earlier))
        if chosen:
            names = self.run.engine.parameter_names()
            outside_gradients.watch(chosen, lambda p: names.get(id(p), "a parameter"))
        return {id(p) for p, _ in chosen}

    def wants_input_grads(self, i: int) -> bool:
        """Whether slice ``i``'s graphs must give gradients for their boundary inputs."""
        return i > self.lowest or (i == 0 and any(self.inputs_needed))

    def begin(self, i: int) -> None:
        engine = self.run.engine
        needed = self.per_slice_needed[i]
        storage = engine.slices[i].storage
        params = storage.params
        self._slice = (engine.gradients.begin(params, needed, self._into[i], engine.stays_on_device(params),
                                              home=storage.gradient_home if self._homes else None,
                                              sparse_apart=not engine.milestones.rewrite_gradients)
                       if any(needed) else None)

    def add(self, param_grads: Sequence[torch.Tensor | None], others: Sequence[Any]) -> None:
        """One microbatch's parameter gradients; ``others`` are the tensors they must not share memory with."""
        if self._slice is not None:
            self._slice.add(_unshared(param_grads, others))

    def leave(self, i: int) -> None:
        """Slice ``i``'s microbatches are done: its gradients leave for the host."""
        if self._slice is None:
            return
        engine, token = self.run.engine, self.run.call
        engine.milestones.gradients_produced(token, i, self._slice)
        pending = engine.gradients.offload(self._slice, label=f"offload::offload gradients slice {i}")
        self._pending.append((i, pending))
        engine.milestones.gradients_leaving(token, i, pending)
        if self.final_wanted:
            self._unannounced.append((i, pending, self._final(i, pending)))
        engine.gradients.accumulate([p for _, p in self._pending])
        self._announce()
        self._slice = None

    def _final(self, i: int, pending: PendingGradients) -> list[torch.Tensor | None]:
        """Per parameter of slice ``i``, its gradient as ``.grad`` will hold it after this
        backward: the ``.grad`` it is added into, or the host view autograd adopts, or ``None``
        where this backward produced none."""
        return [target if target is not None and view is not None else view
                for target, view in zip(self._into[i], pending.host_views)]

    def _announce(self) -> None:
        """Tell the subscribers of every slice whose gradients are final on the host (added into
        ``.grad`` where they go there), in the order the slices left."""
        engine, token = self.run.engine, self.run.call
        while self._unannounced and self._unannounced[0][1].settled:
            i, pending, final = self._unannounced.pop(0)
            self._announced = True
            engine.milestones.gradients_final(token, i, final, pending.ready)

    def __enter__(self) -> BackwardGradients:
        # Every slice's host buffer size before the first lands (GradientOffloader.expect).
        engine = self.run.engine
        # A host average needs every gradient laid out dense (Note: [Sparse gradients take no room]).
        engine.gradients.expect(tuple(map(tuple, self.per_slice_needed)), lambda: (
            (s.storage.params, flags, engine.stays_on_device(s.storage.params))
            for s, flags in zip(engine.slices, self.per_slice_needed)),
            sparse_apart=not engine.milestones.rewrite_gradients)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            return
        if self._watched or self.final_wanted or self._calls.others:
            # The backward's end, which judges what it watched and drops what walks carried, never comes.
            outside_gradients.abandon()
        # A failed backward leaves .grad as autograd would: rule 6 of Note: [Gradients added in place].
        kept = self._kept()
        added = [g for _, p in self._pending for g in p.added]
        restore_zeroed((self._undoable[id(g)], g) for g in added if id(g) in self._undoable)
        if not isinstance(exc[0], BaseException):
            return
        if self._updates_may_have_run():
            exc[0].add_note(UPDATES_MAY_HAVE_RUN)
        elif kept:
            exc[0].add_note(
                "OffloadModel: this backward had added some slices' gradients into .grad, onto those of earlier "
                "backwards (Note: [Adding onto earlier gradients]), and that cannot be undone: .grad holds part of "
                "this backward. Zero the gradients (zero_grad()) and run the accumulation again.")

    def _kept(self) -> bool:
        """Whether backward added gradients into a ``.grad`` that a failure cannot zero again."""
        return any(id(g) not in self._undoable for _, p in self._pending for g in p.added)

    def _updates_may_have_run(self) -> bool:
        """Whether this backward may have started the optimizer's update of some slice: a slice
        announced may have, whether its gradients went into .grad or (with .grad None) were to be
        handed to autograd."""
        return self._starts_updates and (self._announced or self._kept())

    def land(self) -> None:
        """Every slice's gradients on the host: the optimizer reads them next, and may overwrite
        the host copies the loads read."""
        engine = self.run.engine
        engine.gradients.finish([p for _, p in self._pending])
        self._announce()
        engine.milestones.gradients_landed(self.run.call, dict(self._pending))

    def results(self, grad_in: list[list[torch.Tensor | None]] | None) -> list[torch.Tensor | None]:
        """The gradients backward returns for the Function's tensor arguments (inputs, then
        parameters), given the lowest slice's boundary input gradients when it is slice 0."""
        engine = self.run.engine
        param_results: list[torch.Tensor | None] = [None] * sum(len(s.storage.params) for s in engine.slices)
        for i, grads in self._pending:
            for j, g in enumerate(grads.host_views):
                param_results[self._starts[i] + j] = g
        _sum_tied(engine.parameters(), param_results, _in_gradient_files(engine, self._pending), self._calls,
                  self._edges)
        if self._watched or self.final_wanted:  # the update in backward watches its own
            outside_gradients.returned(zip(engine.parameters(), param_results))
        if self._updates_may_have_run():
            # Autograd runs the parameters' own hooks after this returns (Note: [Hook errors after
            # updates started] in hook_errors.py).
            note_hook_errors(engine.parameters())
        return [*self._input_grads(grad_in if self.lowest == 0 else None), *param_results]

    def _input_grads(self, grad_in: list[list[torch.Tensor | None]] | None) -> list[torch.Tensor | None]:
        """Gradients of the model's input tensors, joined over microbatches, on each input's device."""
        run = self.run
        results: list[torch.Tensor | None] = []
        for k, position in enumerate(run.call.tensor_positions):
            if grad_in is None or not self.inputs_needed[k]:
                results.append(None)
                continue
            per_mb = [grad_in[m][position] if grad_in[m] else None for m in range(run.split.count)]
            shape, dtype, device = run.input_meta[k]
            grad = join_input_grads(per_mb, run.split.sizes, run.split.carries_batch[position], shape[1:], dtype)
            if grad is not None and grad.device != device:
                grad = run.engine.copies.to_host(grad, device)
            results.append(grad)
        return results


def _in_gradient_files(engine: Any, pending: Sequence[tuple[int, PendingGradients]]) -> set[int]:
    """Ids of the landed gradients that are views of their slice's gradient file (Note: [Gradients
    on disk]): their write-back is on its way."""
    in_files = set()
    for i, grads in pending:
        home = engine.slices[i].storage.gradient_home
        if home is not None:
            start, end = home.file.address, home.file.address + home.file.nbytes
            in_files.update(id(g) for g in grads.host_views
                            if g is not None and g.layout == torch.strided and start <= g.data_ptr() < end)
    return in_files


def _sum_tied(params: Sequence[torch.Tensor], results: list[torch.Tensor | None], in_files: set[int],
              calls: outside_gradients.CallsInBackward, edges: Sequence[Any]) -> None:
    """Sum each tied weight's slices' gradients into one of their pooled buffers, in place, in the
    plain model's order, onto what an earlier call's walk left; leave the sum to later calls' walks
    where they take it (Note: [A tied weight's gradients summed in place])."""
    places: dict[int, list[int]] = {}
    for k, p in enumerate(params):
        places.setdefault(id(p), []).append(k)
    for ks in places.values():
        if len(ks) < 2:
            continue  # not tied
        p = params[ks[0]]
        present = [k for k in ks if results[k] is not None]
        earlier = calls.carried.pop(id(p), None)
        if not all(_addable(g, p) and g.shape == p.shape for g in (results[k] for k in present)):
            if earlier is not None:  # not seen: the walks of one model produce gradients of one kind
                free = [k for k in ks if results[k] is None]
                k = free[0] if free else present[0]
                results[k] = earlier if results[k] is None else earlier + results[k]
            continue
        if earlier is None and len(present) < 2 and not calls.later:
            continue  # one gradient or none: nothing to sum, nobody to leave it to
        total = _sum_in_order(earlier, [results[k] for k in present], in_files)
        if total is None:
            continue
        for k in present:
            results[k] = None
        edge = edges[ks[0]][0] if ks[0] < len(edges) else None
        if id(total) not in in_files and edge is not None and calls.all_later_take(edge):
            calls.carried[id(p)] = total  # Note: [Several calls of the model in one backward], step 2
        else:
            results[(present or ks)[0]] = total


def _sum_in_order(earlier: torch.Tensor | None, grads: Sequence[torch.Tensor],
                  in_files: set[int]) -> torch.Tensor | None:
    """``earlier``, then one call's slices' gradients of a tied weight, summed as the plain model's
    backward meets them: ``((earlier + g_n) + ...) + g_1``, last slice first, in one of their buffers.

    The first slice's buffer takes the sum (the last addition puts the rest onto it: addition
    commutes exactly), unless it is in a gradient file, whose write-back has been queued: then the
    running sum's buffer keeps it. ``earlier`` (an earlier walk's sum) is never in a file.
    """
    order = [earlier, *reversed(grads)] if earlier is not None else list(reversed(grads))
    if not order:
        return None
    total, first = order[0], (order.pop() if len(order) > 1 else None)
    for g in order[1:]:
        total.add_(g)
    if first is None:
        return total
    return total.add_(first) if id(first) in in_files else first.add_(total)


def _addable(grad: torch.Tensor, param: torch.Tensor) -> bool:
    return (grad.layout == torch.strided and grad.dtype == param.dtype and grad.device == param.device
            and not grad.requires_grad)


def _unshared(param_grads: Sequence[torch.Tensor | None], others: Sequence[Any]) -> list[torch.Tensor | None]:
    """The parameter gradients, each in dense memory of its own.

    Autograd may return one tensor as several gradients: ``x + p`` with equal shapes gives ``p``,
    ``x`` and the upstream gradient the same tensor, and the input's gradient goes on to the previous
    slice. A milestone subscriber may rewrite a slice's gradients in place (the device average
    does), which must reach neither the previous slice nor a second parameter, so a gradient that
    shares memory with another is copied; usually none does, and nothing is copied. For the same
    rewrite, and for collectives, which take a gradient's memory as one run, a gradient that is not
    dense is made so: ``p.sum()`` gives ``p`` an expanded gradient, one element seen through
    stride 0. A dense one in another layout (a ``channels_last`` weight's) stays as it is. A
    sparse gradient is never rewritten in place (microbatches are summed out of place, and it
    leaves for the host by copies of its indices and values), so it stays as it is too.
    """
    taken = {t.untyped_storage().data_ptr() for t in others
             if isinstance(t, torch.Tensor) and t.layout == torch.strided}
    unshared: list[torch.Tensor | None] = []
    for g in param_grads:
        if g is not None and g.layout == torch.strided:
            pointer = g.untyped_storage().data_ptr()
            if pointer in taken or flat_alias(g) is None:
                g = g.clone(memory_format=torch.contiguous_format)
            else:
                taken.add(pointer)
        unshared.append(g)
    return unshared
