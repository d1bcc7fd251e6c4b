"""Data parallelism on ``torch.distributed``: every process trains its own OffloadModel on its share
of the batch, and the gradients are averaged across the process group slice by slice.

Note: [Gradient averaging]
    At construction every rank checks that its model has rank 0's structure, then takes rank 0's
    parameters and buffers. In backward, each slice's gradients are averaged across the group as
    soon as they exist, while backward goes on with the slices before it (a milestone subscriber,
    ``offload/walk/milestones.py``): with a gloo group on the host copies of the gradients, in a host
    worker once they have landed; with NCCL on the device, on a communication stream, before they
    leave (Note: [Device collectives] in ``offload/streams/collectives.py``). When backward
    returns they are averaged and final on the host, and autograd accumulates them into
    ``.grad`` as usual. Averaging the per-rank gradients of per-rank mean losses gives the
    gradient of the mean loss over the concatenated batch, up to the order of the additions.

    ``no_sync()``, as DDP's: the forwards and backwards inside it leave their gradients local
    (accumulated into ``.grad``); the first backward of a forward outside it averages the local
    total, that backward's gradients included.

    A parameter may have a gradient on some ranks and not on others (a branch one rank takes, an
    expert no token of one rank reached, a parameter only the ``no_sync`` steps used). Every rank
    averages every parameter of each slice that backward needs, as DDP with
    ``find_unused_parameters=True`` does: a missing gradient counts as zeros (it is zero-filled in
    the slice's host buffer, at its place), so that every rank reduces the same memory and ends
    with the same gradients. Before the sums, one small all-reduce of a header counts per parameter
    the ranks that had a gradient; one that none had keeps ``.grad`` as it was (``None``), as in one
    process. (This host path; the device path, NCCL's, averages only what each rank has, and needs
    every rank to produce the same gradients.)

Note: [Ranks that disagree on requires_grad]
    ``requires_grad`` is compared at construction, but may change after it (a layer unfrozen after a
    warm-up). Each slice's gradients lie compactly over the parameters this rank computes, so ranks
    that changed it differently would sum unrelated memory (same sizes) or make gloo abort the
    process (other sizes). So every synced backward issues, on every rank, one header per slice
    with parameters, in slice order, even for a slice this rank computes no gradient of (issued
    when backward passes it, or at the end for the slices it never reached): per parameter of the
    slice, ``needed + (world size + 1) * present`` (and two entries more: Note: [A forward that
    raised]). Its size is the same on every rank, and its sum is waited for before the sums: a
    parameter that some ranks compute and others do not raises a ``CollectiveError`` naming it on
    every rank, before any sum is issued. The cost: one small all-reduce per slice and synced backward (one for each slice
    without gradients too), and its round trip before the slice's sums. The headers of slices
    without gradients here are issued together and waited for in order
    (``HostCollectives.agree``): frozen layers cost about one round trip between two slices with
    gradients, not one each.

    BatchNorm running statistics stay per rank (use one rank's, or ``nn.SyncBatchNorm`` semantics
    are not provided).

Note: [A forward that raised]
    A forward that raised on one rank only (an out-of-memory error that the loop catches to skip the
    batch) leaves that rank a step behind the others, which went on to that step's backward: its
    next backward's averages would pair with their previous step's. A local flag cannot tell this
    from a forward that raised on every rank alike (a bad input), after which the ranks are still
    in step. So each rank counts its synced forwards that raised, and every header carries the
    count and its square: the square of the counts' sum is ``world size`` times the sum of their
    squares only when every rank's count is the same; otherwise every rank raises a
    ``CollectiveError`` before any sum.

Note: [Gradient hooks see the average]
    Autograd runs a parameter's own hooks (``register_hook``, ``register_post_accumulate_grad_hook``)
    on what backward returns for it, and the model's backward returns the averaged gradients (Note:
    [Gradient averaging]): a hook sees the average over the ranks, the same on every rank, where
    under ``DistributedDataParallel`` it sees this rank's local gradient and the average comes
    after it. A linear hook (a scale) gives the same result either way; one that is not (a clamp,
    ``nan_to_num``, noise per rank, a per-rank statistic) does not. The hooks cannot run before
    the average: the slices' sums start while backward goes on, and autograd runs the hooks only
    once backward has returned. So the first synced backward with several ranks that finds a
    hooked parameter warns, naming them and what to do (a hook that must see the local gradient:
    ``DistributedDataParallel`` around an OffloadModel built without ``process_group``). The look
    is two attribute reads per parameter (about 0.1 us for both), made at every synced backward
    until it has warned, so hooks registered after some steps are found too.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .walk.engine import Engine
from .walk.milestones import Subscriber
from .streams import PendingGradients, SliceGradients
from .streams.collectives import CollectiveError, DeviceCollectives, HostCollectives, runs, waiting_for_the_group
from .streams.flat_views import empty_in_layout, flat_alias, typed_view


#: What the construction's collectives build, for their errors (``waiting_for_the_group``).
BUILDING = "data-parallel OffloadModel"


def check_group(group: Any, device: torch.device) -> str:
    """The group's backend, after checking that it is usable with ``device``.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        ValueError: the backend cannot reduce where this model's gradients are.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "process_group was given but torch.distributed is not initialised: call "
            "torch.distributed.init_process_group(...) first (torchrun sets up its environment), then pass "
            "process_group=torch.distributed.group.WORLD or a group from torch.distributed.new_group()")
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and device.type != "cuda":
        raise ValueError(
            f"a NCCL process group reduces CUDA tensors, and this model computes on {device}: use a gloo group "
            "(torch.distributed.new_group(backend='gloo')) or device='cuda'")
    return backend


def refuse_parallel_wrapper(model: Any) -> None:
    """Refuse PyTorch's data-parallel wrappers around the layers, saying what to use instead.

    Raises:
        TypeError: ``model`` is a ``DistributedDataParallel``, ``DataParallel`` or FSDP module.
    """
    # By name, among PyTorch's own classes: importing FSDP to compare would cost every construction.
    wrapper = next((cls.__name__ for cls in type(model).__mro__ if cls.__module__.startswith("torch.") and cls.__name__
                    in ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel", "FSDPModule")), None)
    if wrapper is None:
        return
    raise TypeError(
        f"OffloadModel got a {type(model).__name__} ({wrapper}): it takes the plain layers, and trains "
        "data-parallel by itself. Wrap the layers inside it (an nn.Sequential; the wrapper's .module) and pass "
        "process_group=torch.distributed.group.WORLD (after torch.distributed.init_process_group()): every rank "
        "averages the gradients slice by slice and the host update is sharded (docs/distributed.md). "
        "DistributedDataParallel around the OffloadModel works too")


class DataParallel(Subscriber):
    """The gradient-averaging subscriber of one model; see Note: [Gradient averaging].

    Args:
        engine: the model's engine.
        group: the process group.
        named_tensors: the model's parameters and buffers by name (for the structure check and the
            broadcast from rank 0).
    """

    rewrites_gradients = True  # it averages them on their way

    def __init__(self, engine: Engine, group: Any, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        backend = check_group(group, engine.device)
        self.engine = engine
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.on_device = "nccl" in backend
        self.host = None if self.on_device else HostCollectives(engine.copies, group, BUILDING)
        self.device_collectives = DeviceCollectives(engine.copies, group) if self.on_device else None
        self.sync = True
        # Synced backwards started and not landed: one that failed left the ranks' collectives out of
        # step (the others went on with theirs), and the next forward refuses to pair them wrongly.
        self._unlanded = 0
        # Synced forwards with a graph that raised, counted in every header: where one rank's loop
        # skipped a batch that the others trained on, the counts differ (Note: [A forward that raised]).
        self.forward_failures = 0
        # Alone, the average is the local gradient (Note: [Gradient hooks see the average]).
        self._hooks_told = self.world_size == 1
        self._names = {id(t): name for name, t in named_tensors}  # for messages
        # Per synced backward, the next slice whose header is owed (Note: [Ranks that disagree on requires_grad]).
        self._next: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._sync_of: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self._events: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()
        self._included: weakref.WeakKeyDictionary[Any, list[torch.Tensor]] = weakref.WeakKeyDictionary()
        self._local: dict[int, torch.Tensor] = {}  # parameters whose .grad holds local, unaveraged sums
        # Per backward, per slice: its gradients' places (from gradients_produced, for the host
        # average), then which of them every rank lacks, counted beside the average.
        self._places: weakref.WeakKeyDictionary[Any, dict[int, SliceGradients]] = weakref.WeakKeyDictionary()
        self._counts: weakref.WeakKeyDictionary[Any, list[tuple[int, list[int], torch.Tensor]]] = (
            weakref.WeakKeyDictionary())
        # NCCL's object collectives stage their bytes on the *current* CUDA device, which is cuda:0
        # unless the caller set it: every rank would then use GPU 0. Run them on this model's device.
        on_model_device = (torch.cuda.device(engine.device) if engine.device.type == "cuda"
                           else contextlib.nullcontext())
        with on_model_device:
            _check_structure(engine, group, self.world_size, named_tensors)
            _take_rank_zeros(engine, group, self.on_device, named_tensors)

    # -- no_sync -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    # -- milestones --------------------------------------------------------------------------------

    def forward_started(self, token: Any) -> None:
        if self._unlanded and self.world_size > 1:  # alone, a rank pairs with nobody
            raise CollectiveError(
                f"OffloadModel: a backward of this model failed on rank {self.rank} while the ranks averaged its "
                "gradients: the other ranks' averaging went on, and this rank's next "
                "ones would be paired with theirs wrongly (other slices' or steps' gradients). Stop every rank and "
                "restart them from the last checkpoint; a batch to skip (after an out-of-memory error, say) must be "
                "skipped on every rank, before its forward")
        if self.device_collectives is not None:
            # Every backward before this forward ended: its gradients landed, or it failed and the
            # copy engine's drain waited for the communication stream. Either way its reductions
            # are done, and their handles (which hold the gradients) can go.
            self.device_collectives.landed()
        self._sync_of[token] = self.sync
        self._events[token] = []
        self._included[token] = []
        self._places[token] = {}
        self._counts[token] = []

    def _local_grads(self, token: Any, index: int, needed: list[bool]) -> list[torch.Tensor | None]:
        """The local sums (from forwards under no_sync) to include in this slice's average."""
        extra: list[torch.Tensor | None] = []
        for entry, wanted in zip(self.engine.slices[index].storage.params, needed):
            p = entry.tensor
            local = self._local.get(id(p)) if wanted else None
            # A tied parameter appears in several slices: its local sum joins one average only.
            if (local is not None and local is p and p.grad is not None
                    and not any(q is p for q in self._included[token])):
                extra.append(p.grad)
                self._included[token].append(p)
            else:
                extra.append(None)
        return extra

    def _refuse_sparse(self, index: int, gradients: list[torch.Tensor | None]) -> None:
        """Averaging takes each slice's gradients as dense memory; a sparse one (indices and values)
        would be averaged as something it is not."""
        entries = self.engine.slices[index].storage.params
        sparse = [f"{type(entry.sites[0].module).__name__}.{entry.sites[0].name}"
                  for entry, g in zip(entries, gradients) if g is not None and g.is_sparse]
        if sparse:
            raise RuntimeError(
                f"data parallelism averages dense gradients, and {', '.join(sparse)} in slice {index} received a "
                "sparse one: build the layer with sparse=False (nn.Embedding(..., sparse=False)) to train it with "
                "process_group, or train without process_group")

    def backward_started(self, token: Any, accumulates: bool) -> None:
        if self._sync_of.get(token, True):
            if not self._hooks_told:  # first: a warning turned into an error leaves nothing issued
                self._hooks_told = warn_of_hooks(self.engine, self._names, self.world_size)
            self._unlanded += 1
            self._next[token] = len(self.engine.slices) - 1

    def gradients_produced(self, token: Any, index: int, grads: SliceGradients) -> None:
        if not self._sync_of.get(token, True):
            return
        if not self.on_device:
            self._places.setdefault(token, {})[index] = grads  # its places, for gradients_leaving
            return
        tensors = grads.device_tensors()
        self._refuse_sparse(index, tensors)
        extra = self._local_grads(token, index, [t is not None for t in tensors])
        present = [t for t in tensors if t is not None]
        for tensor, local in zip(tensors, extra):
            if tensor is not None and local is not None:
                moved, ready = self.engine.copies.to_device(local)
                self.engine.copies.wait_ready(ready)
                tensor.add_(moved)
        assert self.device_collectives is not None
        grads.reduced = self.device_collectives.average(present)

    def gradients_leaving(self, token: Any, index: int, pending: PendingGradients) -> None:
        if self.on_device or not self._sync_of.get(token, True):
            return
        assert self.host is not None
        views = pending.host_views
        self._refuse_sparse(index, views)
        grads = self._places[token].pop(index)
        self._headers_down_to(token, index + 1)  # the slices backward passed without gradients here
        self._next[token] = index - 1
        extra = self._local_grads(token, index, [place is not None for place in grads.places])
        needed = [j for j, place in enumerate(grads.places) if place is not None]
        missing = _zeros_at_places(grads, views, self.engine.device)
        for j, zeros in missing.items():
            views[j] = zeros  # handed to autograd, averaged, unless no rank had a gradient (gradients_landed)
        present = [j in needed and (j not in missing or extra[j] is not None) for j in range(len(grads.places))]
        header = self._header(index, [place is not None for place in grads.places], present)

        def prepare() -> None:  # in the worker: the pooled buffer is this slice's once the offload landed
            for zeros in missing.values():
                zeros.zero_()
            for j in needed:
                if extra[j] is not None:
                    views[j].add_(extra[j])  # type: ignore[union-attr]

        spans = runs([views[j] for j in needed])  # type: ignore[misc]
        event = self.host.average(spans, prepare, header[0], after=[pending.ready],
                                  what=f"averaging the gradients of slice {index}", agreed=header[1])
        self._events.setdefault(token, []).append(event)
        self._counts.setdefault(token, []).append((index, needed, header[0]))

    def _header(self, index: int, needed: list[bool], present: list[bool]) -> tuple[torch.Tensor, Any]:
        """Slice ``index``'s header and the check of its sum (Note: [Ranks that disagree on requires_grad])."""
        failed = self.forward_failures  # with its square: the sums tell whether every rank's is the same
        header = torch.tensor([int(n) + (self.world_size + 1) * int(p) for n, p in zip(needed, present)]
                              + [failed, failed * failed], dtype=torch.int64)
        return header, functools.partial(self._agree, index, needed)

    def _agree(self, index: int, needed: list[bool], summed: torch.Tensor) -> None:
        """In the worker, before the sums: raise when some ranks compute a gradient of a parameter of
        slice ``index`` that others do not, or when their counts of failed forwards differ
        (``summed``: the header's sum over the ranks)."""
        failed, squares = summed[-2:].tolist()
        if failed * failed != squares * self.world_size:  # equal only when every rank's count is the same
            raise CollectiveError(
                f"a forward of this model (with autograd, outside no_sync()) raised on some ranks and not on others "
                f"({self.forward_failures} so far on rank {self.rank}, {failed} on the {self.world_size} ranks "
                "together): a rank that skipped a batch the others trained on pairs its gradients with another "
                "step's. A batch to skip (after an out-of-memory error, say) must be skipped on every rank, before "
                "its forward. Stop every rank and restart them from the last checkpoint")
        for j, count in enumerate((summed[:-2] % (self.world_size + 1)).tolist()):
            if count not in (0, self.world_size):
                name = self._names.get(id(self.engine.slices[index].storage.params[j].tensor), f"parameter {j}")
                raise CollectiveError(
                    f"the ranks disagree on which parameters get gradients: {count} of {self.world_size} ranks compute "
                    f"one for {name} (slice {index}), and rank {self.rank} {'does' if needed[j] else 'does not'}. "
                    "requires_grad is checked at construction only; every rank must change it the same way (freeze "
                    "and unfreeze the same parameters on every rank). Stop every rank and restart them from the last "
                    "checkpoint")

    def _headers_down_to(self, token: Any, stop: int) -> None:
        """Issue the headers owed, from the next slice down to ``stop``, of slices without gradients
        on this rank (Note: [Ranks that disagree on requires_grad])."""
        assert self.host is not None
        first = index = self._next.get(token, -1)
        headers = []
        while index >= stop:
            count = len(self.engine.slices[index].storage.params)
            if count:
                headers.append(self._header(index, [False] * count, [False] * count))
            index -= 1
        self._next[token] = index
        if headers:
            self._events.setdefault(token, []).append(self.host.agree(
                headers, what=f"checking the gradients of slices {first} down to {stop} with the other ranks"))

    def gradients_landed(self, token: Any, pending: dict[int, PendingGradients]) -> None:
        sync = self._sync_of.get(token, True)
        if sync and self.host is not None:
            self._headers_down_to(token, 0)  # the slices backward did not reach
        events = self._events.get(token, [])
        self._events[token] = []
        for event in events:
            self.engine.copies.wait_host(event)  # raises CollectiveError if a rank failed
        if sync:
            self._unlanded = max(0, self._unlanded - 1)
        for index, needed, summed in self._counts.pop(token, []):
            counts = (summed // (self.world_size + 1)).tolist()
            for j in needed:
                if counts[j] == 0 and index in pending:
                    pending[index].host_views[j] = None  # no rank had one: .grad stays as it was
        if self.device_collectives is not None:
            self.device_collectives.landed()  # the offloads after the reductions have completed
        landed = [(entry.tensor, view) for index, p in pending.items()
                  for entry, view in zip(self.engine.slices[index].storage.params, p.host_views) if view is not None]
        if sync:
            for p in self._included.get(token, []):
                p.grad = None  # the averaged total autograd receives replaces the local sum
            self._included[token] = []
            for p, _ in landed:
                self._local.pop(id(p), None)
        else:
            for p, _ in landed:
                self._local[id(p)] = p


def _check_structure(engine: Engine, group: Any, world_size: int, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Raise unless every rank of ``group`` built rank 0's model and cut it into the same slices."""
    # requires_grad too: a parameter one rank trains and another freezes would leave the ranks
    # reducing different gradients (changed later: Note: [Ranks that disagree on requires_grad]).
    mine = [f"{name} ({tuple(t.shape)}, {t.dtype}, requires_grad={t.requires_grad})" for name, t in named_tensors]
    # The slices too: gradients are averaged, and a sharded update's parameters exchanged, slice
    # by slice, so ranks that cut the model differently would pair collectives of other sizes.
    partition = [list(s.names) for s in engine.slices]
    everyone: list[Any] = [None] * world_size
    with waiting_for_the_group(BUILDING, dist.get_rank(group), world_size, "comparing its structure with rank 0's"):
        dist.all_gather_object(everyone, (mine, partition), group=group)
    first, first_cut = everyone[0]
    for rank, (theirs, cut) in enumerate(everyone):
        if theirs != first:
            difference = next(((a, b) for a, b in zip(first, theirs) if a != b),
                              (f"{len(first)} tensors", f"{len(theirs)} tensors"))
            raise ValueError(
                f"rank {rank}'s model differs from rank 0's (first difference: rank 0 has {difference[0]}, rank "
                f"{rank} has {difference[1]}); every rank must build the same model before wrapping it")
        if cut != first_cut:
            raise ValueError(
                f"rank {rank} cuts the model into other slices than rank 0 (rank 0: {_slices_text(first_cut)}; "
                f"rank {rank}: {_slices_text(cut)}); gradients are averaged slice by slice, so every rank must "
                "pass the same num_slices (or the same slices) to OffloadModel")


def _take_rank_zeros(engine: Engine, group: Any, on_device: bool,
                     named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Replace every rank's parameters and buffers by rank 0's (``on_device``: through the device,
    for NCCL)."""
    source = dist.get_global_rank(group, 0)
    waiting = functools.partial(waiting_for_the_group, BUILDING, dist.get_rank(group), dist.get_world_size(group),
                                "taking rank 0's parameters and buffers")
    # Masters on disk that a broadcast read or wrote go back to their files a slice at a time
    # (the tensors come slice by slice, parameters then buffers; Note: [Masters on disk]).
    holder = {id(entry.tensor): s.storage for s in engine.slices for entry in s.storage.held}
    touched = None
    with torch.no_grad():
        for _, whole in named_tensors:
            storage = holder.get(id(whole))
            if touched is not None and storage is not touched:
                touched.release_masters()
            touched = storage
            # Its memory as one contiguous run (collectives want that): a channels_last or
            # transposed parameter's too.
            flat = flat_alias(whole)
            tensor = whole if flat is None else flat
            staged = tensor.to(engine.device) if on_device else tensor
            with waiting():
                # As bytes: the same bits, in every dtype (gloo sends no int16, uint16, uint32 or float8).
                dist.broadcast(staged if flat is None else staged.view(torch.uint8), src=source, group=group)
            if staged is not tensor:
                tensor.copy_(staged.cpu())
    if touched is not None:
        touched.release_masters()


@contextlib.contextmanager
def out_of_step_on_failure(data_parallel: DataParallel | None) -> Iterator[None]:
    """Around a forward with autograd: count it when it raises on a synced data-parallel model (Note:
    [A forward that raised])."""
    try:
        yield
    except BaseException:
        if data_parallel is not None and data_parallel.sync:
            data_parallel.forward_failures += 1
        raise


def warn_of_hooks(engine: Engine, names: dict[int, str], world_size: int) -> bool:
    """Warn that the gradient hooks of the model's parameters see the average, if any has one
    (Note: [Gradient hooks see the average]); whether it warned. ``names``: the parameters' by id."""
    hooked = {id(p): names.get(id(p), f"a parameter of slice {s.index}") for s in engine.slices
              for p in (entry.tensor for entry in s.storage.params)
              if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)}
    if not hooked:
        return False
    listed = list(hooked.values())
    listed_text = ", ".join(listed[:5]) + (f" and {len(listed) - 5} more" if len(listed) > 5 else "")
    warnings.warn(
        f"OffloadModel(process_group=...): the gradient hooks of {listed_text} (register_hook, "
        f"register_post_accumulate_grad_hook) receive the gradient already averaged over the {world_size} ranks, "
        "the same on every rank, not this rank's own as under DistributedDataParallel: a hook that is not linear "
        "(a clamp, nan_to_num, noise or a statistic per rank) gives other results than DDP. For a hook that must "
        "see the local gradient, build the OffloadModel without process_group and wrap it in "
        "DistributedDataParallel (docs/distributed.md)", UserWarning, stacklevel=3)
    return True


def _zeros_at_places(grads: SliceGradients, views: list[torch.Tensor | None],
                     device: torch.device) -> dict[int, torch.Tensor]:
    """Per needed parameter of the slice that has no gradient on this rank, memory for zeros at its
    place in the slice's host buffer (the one the others landed in, or a new one when none did), so
    that the slice's gradients lie as on every other rank; a gradient kept on the device gets
    memory of its own, as the others' there have. Zeroed by the caller, once the buffer is free."""
    keep = grads.keep or [False] * len(grads.places)
    buffer = None
    for view, place, kept in zip(views, grads.places, keep):
        if view is not None and place is not None and not kept:
            flat = flat_alias(view)
            assert flat is not None, "a landed gradient is dense"
            start = flat.storage_offset() * flat.element_size() - place.offset
            buffer = torch.empty(0, dtype=torch.uint8)
            buffer.set_(flat.untyped_storage(), start, (grads.nbytes,))
            break
    missing: dict[int, torch.Tensor] = {}
    for j, (view, place, kept) in enumerate(zip(views, grads.places, keep)):
        if view is not None or place is None:
            continue
        if kept:
            missing[j] = empty_in_layout(place.shape, place.stride, place.dtype, device)
            continue
        if buffer is None:
            buffer = torch.empty(grads.nbytes, dtype=torch.uint8)
        missing[j] = typed_view(buffer, place.offset, place.dtype, place.shape, place.stride)
    return missing


def _slices_text(cut: list[list[str]]) -> str:
    """Slices by their layers' names: ``[0, 1] [2, 3]``."""
    return " ".join(f"[{', '.join(names)}]" for names in cut)
