"""What one forward leaves for its backward: per slice and microbatch, a checkpoint or a kept graph.

Vocabulary as in Note: [Glossary] (``offload/__init__.py``).

Note: [Checkpoints and kept graphs]
    For every slice ``i`` and microbatch ``m``, forward leaves one of two records for backward:

    - a *checkpoint*: the slice's boundary activation (offloaded to the host), the CPU and device
      generator states just before the slice ran, and, if the run changed the slice's buffers,
      the buffers as they were before it (rule 3 of Note: [Buffers] in ``offload/walk/slice_walk.py``).
      Backward loads the boundary activation and re-runs the slice under the same generator and
      autocast state, so dropout draws the same masks.
    - a *kept graph*: the slice ran with grad enabled in forward and autograd's graph is kept.

    - an *offloaded graph*: the slice ran with grad enabled and autograd's graph is kept, but
      every tensor the graph saved went to the host as it was produced (Note: [Offloaded saved
      tensors] in ``offload/streams/saved_activations.py``). The record holds the graph's
      outputs and boundary leaves as gradient edges and data-less leaves, so that no activation
      of the slice stays on the device; backward loads the saved tensors one step ahead.

    Which one each slice leaves is the model's activation plan (Note: [Three ways to keep a
    slice's activations] in ``offload/walk/activation_policy.py``): recomputed slices leave
    checkpoints, kept slices kept graphs, offloaded slices offloaded graphs. The last microbatch
    of the last slice is always a kept graph: it is the first thing backward needs, so it is
    neither reloaded nor recomputed. Kept and offloaded graphs save slot memory only as slot
    references (see ``offload/streams/device_slots.py``), so slots can be reused while they wait.

    Records hold indices into the tensors the call saves with ``ctx.save_for_backward``, never the
    tensors themselves, so autograd frees them with the graph (Note: [Gradients through autograd]
    in ``offload/autograd/gradients.py``).

Note: [Offloaded graph leaves]
    An offloaded graph is differentiated with respect to its boundary leaves that need a gradient,
    so its record keeps them, and autograd's graph holds them too (each leaf's accumulation node):
    with its data, a leaf would keep the slice's input on the device until backward. After the run
    the record drops the data, and the memory goes when the boundary lets the input go.

    1. No layer sees the leaf itself: it enters its slice through a copy, or where its elements
       overlap through a view of itself (Note: [Leaves enter through a copy] in
       ``slice_graph.py``). A hook that captures a slice's input (a pre-hook on its first layer,
       for features or activation statistics) keeps the values the plain model's hook sees, after
       forward and after backward, in memory that only the hook's reference holds.
    2. The leaf keeps its shape, dtype and device, over one element read at every index (NaN). A
       backward from outside the model that reaches it (a term on a captured slice input in the
       loss) adds into its ``.grad`` as into any leaf's, and rule 1 of Note: [Activations used
       outside the model] in ``slice_graph.py`` refuses it saying what to do; over no element,
       autograd's accumulation failed first, with a size mismatch that named nothing.
    3. Only what opens autograd's internals reaches the leaf's values and reads NaN: ``._base``
       of a captured input that entered as a view, or the graph walked by hand from ``grad_fn``.

Note: [Leaves that pass through]
    Some boundary leaves cross every slice unchanged: a causal LM's rotary tables (``cos`` and
    ``sin``) travel from the embedding to every decoder layer beside the hidden states. Offloading
    them again at every boundary cost two of every three activation offloads of a Llama step: a
    device snapshot, a copy to the host and their events each, on the thread that launches the
    forward. A checkpoint's leaf that is the same memory, viewed alike (storage, offset, sizes,
    strides, dtype), at the same version as at the boundary before, shares that boundary's saved
    leaf: the same host copy and ticket. Backward loads it once and hands the device copy to
    every recompute that starts from it (each differentiates a detached alias of its own); a
    recompute that changes it in place (the slice whose forward changed it, which backward meets
    first) moves its version past the one it had when loaded, and the recomputes after it load
    their own (one handed out ahead before the change is loaded again when its run comes). The
    copy stays on the device until the last recompute that shares it has taken it, where each
    recompute's own copy lived one slice.

    - Each slice's outputs are detached, so the leaf is a new tensor at every boundary; a detached
      tensor shares its source's version counter, autograd's count of in-place changes, so a leaf
      changed in place in between is offloaded anew.
    - The memory is the same allocation, not a later one at the same address, because the tensor
      seen at the boundary before is still alive (held weakly here, by the walk's boundary list
      there) when the next boundary compares. The conjugate and negative bits are compared too:
      ``c.conj()`` is the same memory, viewed alike, and other values.
    - A change that autograd does not count (a write through ``.data``, or through another
      tensor over the same memory made with ``set_``) goes unseen here, as it goes unseen by
      autograd's own saved tensors. Inference tensors keep no version and subclasses of Tensor
      may have no memory of their own: those are offloaded at every boundary, as before.
    - A leaf that needs a gradient enters its slice through a copy (Note: [Leaves enter through a
      copy] in ``slice_graph.py``), so one passed on unchanged leaves as other memory: a mixture of
      experts' router logits, which cross every later slice to the loss (Note: [Router logits] in
      ``offload/integrations/transformers_router.py``), were offloaded again at every boundary,
      L(L-1)/2 offloads for L layers. An output that is such a copy itself (the very tensor, so no
      later tensor at the same address), at the version it had when made and over the same memory
      (``.data =`` gives it other memory), shares the saved leaf of the leaf it copies
      (:meth:`ForwardRecords.passed_through`). A write through ``.data`` in place goes unseen, as
      above: the recompute of the slices after it would start from the values before it.

Note: [Sparse boundary leaves]
    A sparse tensor may cross slice boundaries: a graph network's adjacency, which every layer
    passes on beside the features. Its memory is its indices and values, not one storage, so it
    can neither be offloaded into a host buffer nor told by where it lies (Note: [Leaves that
    pass through]).

    1. One that needs no gradient is kept in a checkpoint as it is, the tensor itself, until
       backward, where the recompute starts from a detached alias of it as from any leaf: not
       offloaded, so it stays where it is (the compute device) until the backward walk has passed
       the slice. Usually it is the model's input passed on, whose memory every boundary shares.
    2. One that needs a gradient is refused where it enters a slice, naming the slice
       (``slice_graph.py``): it would enter the slice through a copy (Note: [Leaves enter through
       a copy] there) and its gradient would cross the boundary, which the walk's copies and
       sums do for strided memory only. Within one slice autograd handles it as in the plain
       model.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import TreeSpec

from ..walk.engine import Engine
from ..walk.microbatch import Split
from ..streams import DeviceSlots, Event, OffloadTicket
from ..streams.saved_activations import SavedActivations
from ..walk.activation_policy import ActivationMode, ActivationPlan
from ..walk.module_state import AttributeSnapshot, AttributeTracker
from ..walk.steps import read_by_forward, stepped_since, steps_of
from .call import Call
from .replay import AutocastState, LibraryRng, LibraryRngCapture, capture_rng


@dataclass
class SavedLeaf:
    """A boundary leaf in a checkpoint: a saved tensor (``stash``) with its offload ticket, or a value."""

    stash: int | None = None
    ticket: OffloadTicket | None = None
    value: Any = None
    uses: int = 1  # checkpoints whose leaf it is (Note: [Leaves that pass through])


@dataclass
class Checkpoint:
    """A checkpointed run: what its recompute starts from."""

    inputs: list[SavedLeaf]
    spec: TreeSpec
    requires: list[bool]  # per input leaf: whether it required grad in forward (Note: [Boundary gradients])
    cpu_rng: int = -1
    device_rng: int | None = None
    library_rng: LibraryRng | None = None  # Python's and NumPy's generators (replay.py)
    buffers: tuple[int, OffloadTicket] | None = None  # saved tensor of the buffers before the run
    # The layers' plain attributes before the run, where some run of the slice changed them
    # (Note: [Attribute state] in offload/walk/module_state.py).
    attributes: AttributeSnapshot | None = None

    def rng_states(self, saved: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None, LibraryRng | None]:
        """The CPU, device and library generator states the run started from."""
        return saved[self.cpu_rng], saved[self.device_rng] if self.device_rng is not None else None, self.library_rng

    def restore_buffers(self, slots: DeviceSlots, index: int, saved: Sequence[torch.Tensor]) -> bool:
        """Put the buffers back on the device as the run found them; whether there was anything to restore."""
        if self.buffers is None:
            return False
        stash_index, ticket = self.buffers
        slots.buffers.restore_buffers(index, saved[stash_index], ticket)
        return True


@dataclass
class KeptGraph:
    """A run whose graph autograd keeps until backward.

    The graph's outputs (with their grad_fn) and parameter leaves are held here rather than saved:
    a saved output shares its version counter with the tensor returned to the caller, which may
    update it in place as freely as the plain model's output; the leaves are slot tensors whose
    values are read through slot references. Backward releases both.
    """

    outputs: list[torch.Tensor | None]
    inputs: list[int | None]  # saved tensors: the detached boundary leaves
    params: list[torch.Tensor]

    def saved_inputs(self, saved: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        return [saved[k] if k is not None else None for k in self.inputs]


@dataclass
class OffloadedGraph:
    """A run whose graph autograd keeps until backward, with its saved tensors on the host.

    Attributes:
        outputs: gradient edges of the graph's outputs that require grad (``None`` elsewhere):
            the edges, not the tensors, so that the outputs' memory is freed with the boundary.
        inputs: the boundary leaves that require grad, their data dropped after the run (autograd
            needs only the leaf to differentiate with respect to it; Note: [Offloaded graph
            leaves]); ``None`` elsewhere.
        params: parameter leaves, over slot memory read through slot references.
        saves: the saved tensors, offloaded.
    """

    outputs: list[Any]
    inputs: list[torch.Tensor | None]
    params: list[torch.Tensor]
    saves: SavedActivations


Record = Checkpoint | KeptGraph | OffloadedGraph


def _without_data(leaf: torch.Tensor) -> torch.Tensor:
    """``leaf`` with its data dropped (Note: [Offloaded graph leaves]): a leaf's gradient takes its
    shape from the graph's metadata, so a graph differentiates with respect to it without its values."""
    # One element read at every index: the leaf's shape stays, for a backward from outside (rule 2).
    leaf.data = leaf.data.new_full((), float("nan")).expand(leaf.shape)
    return leaf


class ForwardRecords:
    """The records of one call, per slice and microbatch, and the tensors saved for them.

    Forward writes them; :meth:`saved_for_backward` then hands the saved tensors to autograd, and
    backward reads them back through the tensors autograd returns.

    Args:
        engine: the model's slices and copy machinery.
        count: microbatches in the call.
        plan: what each slice leaves (Note: [Checkpoints and kept graphs]).
    """

    def __init__(self, engine: Engine, count: int, plan: ActivationPlan) -> None:
        self.engine = engine
        self.count = count
        self.plan = plan
        self.num_slices = engine.num_slices
        self.grid: list[list[Record | None]] = [[None] * count for _ in range(self.num_slices)]
        # Always one tensor, so that a second backward without retain_graph meets autograd's own
        # "freed" error even when nothing else was saved.
        self._saved: list[torch.Tensor] | None = [torch.empty(0)]
        # The running slice's buffers as its next run finds them, or None where that is the host
        # copy (rule 3 of Note: [Buffers]).
        self._buffers_before_run: tuple[int, OffloadTicket] | None = None
        # The running slice's plain attributes per run; only recomputes need them.
        self._attributes: AttributeTracker | None = None
        # The last checkpoint whose library generators were captured, with them: a run that left
        # them as it found them has nothing to replay (replay.py).
        self._last_library: tuple[Checkpoint, LibraryRng] | None = None
        self._capture_library = LibraryRngCapture()
        # Boundary leaves offloaded so far, by memory and view: the tensor last seen there (weakly),
        # its version then and its saved leaf (Note: [Leaves that pass through]).
        self._offloaded: dict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor], int, SavedLeaf]] = {}

    def mode(self, i: int, m: int) -> ActivationMode:
        """What run ``(i, m)`` leaves for backward."""
        if i == self.num_slices - 1 and m == self.count - 1:
            return ActivationMode.KEEP
        return self.plan.modes[i]

    def keeps_graph(self, i: int, m: int) -> bool:
        return self.mode(i, m) is not ActivationMode.RECOMPUTE

    def new_saves(self) -> SavedActivations:
        """Where an offloaded run packs its saved tensors."""
        return SavedActivations(self.engine.activations, self.engine.slots, self.plan.min_bytes)

    # -- forward: writing ------------------------------------------------------------------------

    def _save(self, tensor: torch.Tensor) -> int:
        assert self._saved is not None, "records are written in forward only"
        self._saved.append(tensor)
        return len(self._saved) - 1

    def checkpoint_boundary(self, i: int, m: int, leaves: Sequence[Any], spec: TreeSpec,
                            requires: list[bool]) -> None:
        """Keep what enters slice ``i`` on microbatch ``m`` if that run is checkpointed."""
        if i < self.num_slices and not self.keeps_graph(i, m):
            self.grid[i][m] = Checkpoint([self._saved_leaf(x) for x in leaves], spec, requires)

    def _saved_leaf(self, leaf: Any) -> SavedLeaf:
        """A boundary leaf for the recompute: tensors on the compute device go to the host, once
        for every boundary they cross unchanged (Note: [Leaves that pass through])."""
        if not isinstance(leaf, torch.Tensor):
            return SavedLeaf(value=leaf)
        if leaf.layout in SPARSE_LAYOUTS:  # Note: [Sparse boundary leaves]
            return SavedLeaf(stash=self._save(leaf))
        if leaf.device != self.engine.device:
            return SavedLeaf(stash=self._save(leaf))
        if leaf.is_inference() or type(leaf) is not torch.Tensor:  # no version to compare; a subclass's memory
            host, ticket = self.engine.activations.offload(leaf)
            return SavedLeaf(stash=self._save(host), ticket=ticket)
        where = where_read(leaf)
        known = self._offloaded.get(where)
        if known is not None and known[0]() is not None and known[1] == leaf._version:
            saved = known[2]
            saved.uses += 1
        else:
            host, ticket = self.engine.activations.offload(leaf)
            saved = SavedLeaf(stash=self._save(host), ticket=ticket)
        self._offloaded[where] = (weakref.ref(leaf), leaf._version, saved)
        return saved

    def passed_through(self, sources: Sequence[Any], entered: Sequence[tuple[int, Any, int, Any]],
                       outputs: Sequence[Any], detached: Sequence[Any]) -> None:
        """Outputs of a run that are a copy a leaf entered through (``entered``: its position, the
        copy held weakly, its version and memory then; Note: [Leaves enter through a copy]),
        unchanged, share that leaf's saved leaf at the next boundary, as a leaf passed on as it is
        does (Note: [Leaves that pass through], last item). ``detached``: the outputs as the next
        boundary gets them."""
        if not entered:
            return
        copies = {id(copy()): (k, copy, version, where) for k, copy, version, where in entered if copy() is not None}
        for out, leaf in zip(outputs, detached):
            hit = copies.get(id(out))
            if hit is None or hit[1]() is not out or out._version != hit[2] or where_read(out) != hit[3]:
                continue  # not the copy itself, or changed since it was made (in place, or given other memory)
            source = sources[hit[0]]
            known = self._offloaded.get(where_read(source))
            if known is not None and known[0]() is source and known[1] == source._version:
                self._offloaded[where_read(leaf)] = (weakref.ref(leaf), leaf._version, known[2])

    def keep_graph(self, i: int, m: int, outputs: Sequence[Any], graph_leaves: Sequence[Any],
                   params: list[torch.Tensor]) -> None:
        self.grid[i][m] = KeptGraph(
            outputs=[o if isinstance(o, torch.Tensor) else None for o in outputs],
            inputs=[self._save(x) if isinstance(x, torch.Tensor) else None for x in graph_leaves],
            params=params,
        )

    def offload_graph(self, i: int, m: int, outputs: Sequence[Any], graph_leaves: Sequence[Any],
                      params: list[torch.Tensor], saves: SavedActivations) -> None:
        """Keep offloaded run ``(i, m)``'s graph by its edges, its leaves without their data."""
        self.grid[i][m] = OffloadedGraph(
            outputs=[torch.autograd.graph.get_gradient_edge(o) if isinstance(o, torch.Tensor) and o.requires_grad
                     else None for o in outputs],
            inputs=[_without_data(x) if isinstance(x, torch.Tensor) and x.requires_grad else None
                    for x in graph_leaves],
            params=params,
            saves=saves,
        )

    def save_rng(self, i: int, m: int) -> None:
        """Keep the generator states checkpointed run ``(i, m)`` starts from."""
        record = self.grid[i][m]
        assert isinstance(record, Checkpoint)
        cpu_state, device_state = capture_rng(self.engine.device)
        record.cpu_rng = self._save(cpu_state)
        record.device_rng = self._save(device_state) if device_state is not None else None
        library = self._capture_library()
        if self._last_library is not None and self._last_library[1].same_as(library):
            self._last_library[0].library_rng = None  # that run drew nothing from them
        record.library_rng = library
        self._last_library = (record, library)

    def start_slice(self, i: int) -> None:
        """A slice's first run finds its buffers as the host copy holds them."""
        self._buffers_before_run = None
        recomputes = any(self.mode(i, m) is ActivationMode.RECOMPUTE for m in range(self.count))
        self._attributes = AttributeTracker(self.engine.slices[i].modules()) if recomputes else None

    def attributes_before_run(self, m: int) -> None:
        if self._attributes is not None:
            self._attributes.before_run(m)

    def attributes_after_run(self, i: int, m: int) -> None:
        """After every run, kept graphs included (a later run's change must not reach an earlier
        checkpoint's recompute): each checkpoint keeps the plain attributes its run started from
        (references only; runs that change nothing share one capture)."""
        tracker = self._attributes
        if tracker is None:
            return
        tracker.after_run()
        record = self.grid[i][m]
        if isinstance(record, Checkpoint):
            record.attributes = tracker.start_of(m)

    def _buffers_found(self, i: int) -> tuple[int, OffloadTicket]:
        """The buffers as the running slice's next run finds them, saved: until a run changed
        them, a snapshot of the host copy (the write-back at the slice's end overwrites it)."""
        if self._buffers_before_run is None:
            storage = self.engine.slices[i].storage
            if storage.resident:  # device memory (Note: [Resident slices]): copied off like a slot's
                host, ticket = self.engine.activations.offload(storage.buffer_bytes())
            else:
                host, ticket = self.engine.activations.copy_on_host(storage.buffer_bytes())
            self._buffers_before_run = (self._save(host), ticket)
        return self._buffers_before_run

    def buffers_changed_by(self, i: int, m: int) -> None:
        """Checkpointed run ``(i, m)`` changed the buffers: keep them as it found them."""
        record = self.grid[i][m]
        assert isinstance(record, Checkpoint)
        record.buffers = self._buffers_found(i)

    def buffers_kept_by(self, i: int, m: int) -> None:
        """Checkpointed run ``(i, m)`` changed no buffer: after an earlier run of the slice changed
        them, it found them as that run left them (rule 3 of Note: [Buffers])."""
        record = self.grid[i][m]
        assert isinstance(record, Checkpoint)
        record.buffers = self._buffers_before_run

    def after_changing_run(self, i: int, m: int) -> None:
        """Run ``(i, m)`` changed the buffers (a kept graph's run too). The checkpointed runs
        before it changed none and found the host copy, which the slice's write-back overwrites:
        the first change keeps it for them. If the next run is checkpointed, keep the buffers as
        they are now for it."""
        earlier = [record for record in self.grid[i][:m] if isinstance(record, Checkpoint) and record.buffers is None]
        if earlier:
            found = self._buffers_found(i)
            for record in earlier:
                record.buffers = found
        if m + 1 < self.count and not self.keeps_graph(i, m + 1):
            host, ticket = self.engine.activations.offload(self.engine.slots.buffers.buffer_region(i))
            self._buffers_before_run = (self._save(host), ticket)

    def saved_for_backward(self) -> list[torch.Tensor]:
        """The saved tensors, for ``ctx.save_for_backward``; the records no longer hold them."""
        saved, self._saved = self._saved, None
        self._offloaded.clear()  # forward is over: nothing more to share
        self._last_library = None  # nor a run to compare the next one's generators with (take() lets records go)
        assert saved is not None
        return saved

    # -- backward: reading -----------------------------------------------------------------------

    def take(self, i: int, m: int, retain_graph: bool) -> Record:
        """Run ``(i, m)``'s record, let go unless the graph is retained: a kept graph's tensors, and a
        checkpointed run's generator states and snapshots, which a loss kept past its backward (a
        loop's ``losses.append(loss)``) would otherwise keep alive, ~35 KB a step for four slices."""
        record = self.grid[i][m]
        if record is None:
            raise RuntimeError(
                "Trying to backward through the graph a second time: an earlier backward through this "
                "OffloadModel's output (one that raised part way too) let go what its slices saved for it. "
                "Specify retain_graph=True in the first backward, or run the forward again")
        if not retain_graph:
            self.grid[i][m] = None
        return record


class BoundaryLoader:
    """Loads checkpointed boundary activations to the device one step ahead of their recompute, and
    an offloaded graph's saved tensors one step ahead of its backward."""

    def __init__(self, engine: Engine, records: ForwardRecords, saved: Sequence[torch.Tensor]) -> None:
        self.engine = engine
        self.records = records
        self.saved = saved
        # Per run loaded ahead: its leaves as saved, as loaded, their ready events, and the version
        # each shared one had when handed out.
        self._loaded: dict[tuple[int, int], tuple[list[SavedLeaf], list[Any], list[Event | None], list[int | None]]] = {}
        self._shared = SharedCopies()

    def prefetch(self, i: int, m: int) -> None:
        record = self.records.grid[i][m]
        if isinstance(record, OffloadedGraph):
            record.saves.load()
            return
        if not isinstance(record, Checkpoint) or (i, m) in self._loaded:
            return
        leaves: list[Any] = []
        events: list[Event | None] = []
        for leaf in record.inputs:
            if leaf.stash is None:
                leaves.append(leaf.value)
                events.append(None)
                continue
            host = self.saved[leaf.stash]
            if leaf.ticket is not None:
                tensor, ready = self._load(leaf, host)
            elif host.device != self.engine.device:
                tensor, ready = self.engine.activations.load_host(host)
            else:
                tensor, ready = host, None
            leaves.append(tensor)
            events.append(ready)
        handed = [t._version if leaf.uses > 1 and leaf.ticket is not None else None
                  for leaf, t in zip(record.inputs, leaves)]
        self._loaded[(i, m)] = (record.inputs, leaves, events, handed)

    def _load(self, leaf: SavedLeaf, host: torch.Tensor, reuse: bool = True) -> tuple[torch.Tensor, Event | None]:
        """An offloaded leaf on the device: a shared one's copy is loaded once and serves every
        recompute that starts from it (:meth:`take` loads another where one changed it)."""
        assert leaf.ticket is not None
        known = self._shared.copy_of(leaf) if leaf.uses > 1 and reuse else None
        if known is not None:
            return known
        tensor, ready = self.engine.activations.load(leaf.ticket, host)
        if leaf.uses > 1:
            self._shared.keep(leaf, tensor, ready)
        return tensor, ready

    def take(self, i: int, m: int) -> list[Any]:
        self.prefetch(i, m)
        inputs, leaves, events, handed = self._loaded.pop((i, m))
        for k, version in enumerate(handed):
            if version is None:  # not a shared copy
                continue
            # A shared copy handed out one step ahead, changed in place since by the recompute
            # that ran in between: this run loads its own.
            if leaves[k]._version != version:
                leaves[k], events[k] = self._load(inputs[k], self.saved[inputs[k].stash], reuse=False)
            self._shared.taken(inputs[k])
        for event in events:
            self.engine.copies.wait_ready(event)
        return leaves


class SharedCopies:
    """The device copies of the leaves that several checkpoints share (Note: [Leaves that pass
    through]), by saved tensor: one each, handed out while no recompute has changed it in place
    since it was loaded, and let go once the last checkpoint that shares it has taken it."""

    def __init__(self) -> None:
        self._copies: dict[int | None, tuple[torch.Tensor, Event | None, int]] = {}
        self._left: dict[int | None, int] = {}

    def copy_of(self, leaf: SavedLeaf) -> tuple[torch.Tensor, Event | None] | None:
        known = self._copies.get(leaf.stash)
        if known is None or known[0]._version != known[2]:
            return None
        return known[0], known[1]

    def keep(self, leaf: SavedLeaf, tensor: torch.Tensor, ready: Event | None) -> None:
        self._copies[leaf.stash] = (tensor, ready, tensor._version)

    def taken(self, leaf: SavedLeaf) -> None:
        left = self._left.get(leaf.stash, leaf.uses) - 1
        self._left[leaf.stash] = left
        if left <= 0:
            self._copies.pop(leaf.stash, None)


@dataclass
class CallRecord:
    """Everything backward needs from its forward except the saved tensors (held by ``ctx``)."""

    engine: Engine
    call: Call
    split: Split
    records: ForwardRecords
    param_versions: list[tuple[int, ...]]
    steps: int  # OffloadOptimizer steps of the engine so far (Note: [A step between a forward and its backward])
    read: frozenset[int]  # the tensors the forward read in the parameters' places (the same Note)
    autocast: AutocastState
    input_meta: list[tuple[torch.Size, torch.dtype, torch.device]]  # per input tensor

    @classmethod
    def of(cls, engine: Engine, call: Call, split: Split, records: ForwardRecords,
           input_tensors: Sequence[torch.Tensor]) -> CallRecord:
        """The record of a forward that just ran."""
        return cls(engine, call, split, records,
                   param_versions=[s.storage.param_versions() for s in engine.slices],
                   steps=steps_of(engine), read=read_by_forward(engine),
                   autocast=AutocastState.capture(engine.device),
                   input_meta=[(t.shape, t.dtype, t.device) for t in input_tensors])

    def check_versions(self) -> None:
        """Refuse a backward after the parameters changed in place since forward: stepped by an
        OffloadOptimizer (Note: [A step between a forward and its backward] in
        ``offload/walk/steps.py``) or written by the user."""
        if stepped_since(self.engine, self.steps, self.read):
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                "operation: OffloadOptimizer.step() updated the OffloadModel's parameters between this forward and "
                "its backward, so backward would compute gradients at parameters the forward never used. Call "
                "loss.backward() before optimizer.step(), and run the forward again after a step (in a GAN loop: "
                "step a model's optimizer only once every backward through that model's forward is done)."
            )
        for s, recorded in zip(self.engine.slices, self.param_versions):
            if s.storage.param_versions() != recorded:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: a parameter of slice {s.index} ({', '.join(s.names)}) changed between forward "
                    "and backward (for example optimizer.step() before backward). Run backward before updating "
                    "parameters."
                )


#: Layouts whose memory is no one storage: indices and values (Note: [Sparse boundary leaves]).
SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def where_read(leaf: torch.Tensor) -> tuple[Any, ...]:
    """A tensor's memory and how it is read (Note: [Leaves that pass through])."""
    return (leaf.untyped_storage().data_ptr(), leaf.storage_offset(), leaf.shape, leaf.stride(), leaf.dtype,
            leaf.is_conj(), leaf.is_neg())
