"""``clip_grad_norm_``: ``torch.nn.utils.clip_grad_norm_``'s result, bit for bit, with the host
gradients' norms computed on several threads.

Note: [Norms on several threads]
    PyTorch computes a CPU tensor's 2-norm on one thread (its vectorised path reduces the last
    dimension into one output, and one output is one thread's work), so ``clip_grad_norm_`` over an
    offloaded model's float32 host gradients reads them at one core's bandwidth: 345-446 ms for
    3.54 GB on the H200's host (``benchmarks/results/h200-2026-11-28``), most of a clipped step.

    Here each tensor's norm is the same PyTorch call, made on a pool of threads, the largest
    tensors first and the small ones in bundles. Each call runs under the caller's intra-op thread
    count (``torch.set_num_threads`` in the pool's thread), so a norm PyTorch does split over
    threads splits as it would on the caller's thread: the per-tensor norms are the caller's, bit
    for bit. They are then combined as PyTorch combines them (grouped by device and dtype in its
    own order, stacked, one more norm), and the scaling is PyTorch's ``clip_grads_with_norm_``.
    Only 2-norms of float32, float64 and bfloat16 CPU tensors go to the pool (the vectorised
    one-thread path: the pool's threads add bandwidth, not oversubscription); every other norm is
    PyTorch's, on the caller's thread.

    A tensor's own norm cannot be split without changing its rounding (each vector lane sums its
    elements in order), so the largest tensor bounds the time: a 525 M-element embedding's
    gradient still takes one thread's 2.1 GB.

    Multiplying by a clip coefficient of exactly one is left out when every gradient is on the CPU
    (where reading the coefficient costs nothing): the product is each value itself, so the
    gradients are the same bits (a signalling NaN stays signalling instead of becoming quiet). That
    is every step whose norm is below ``max_norm``, and every step of a ``max_norm`` of infinity,
    which Hugging Face's ``Trainer`` clips with only to log the norm. Not for a 0-norm: it counts
    a NaN as any non-zero and stays finite, and PyTorch's bfloat16 product sets a quiet NaN's sign.

    A norm computed before the call, as each slice's gradients landed in backward (Note: [Norms
    from backward] in ``offload/optimizing/backward_norms.py``), is taken instead of computed again
    when the gradient is still what it was then.
"""

from __future__ import annotations

import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.utils import clip_grads_with_norm_

try:  # PyTorch's own grouping and foreach rules, so the norms are combined in its order.
    from torch.nn.utils.clip_grad import (_device_has_foreach_support, _group_tensors_by_device_and_dtype,
                                          _has_foreach_support)
except ImportError:  # pragma: no cover - a PyTorch without them clips with its own function
    _group_tensors_by_device_and_dtype = None

#: The dtypes whose 2-norm PyTorch computes on one thread (see Note: [Norms on several threads]).
POOLED_DTYPES = (torch.float32, torch.float64, torch.bfloat16)

#: Tensors below this many bytes share a task: a task's fixed cost (tens of microseconds) would
#: otherwise outweigh reading a layer norm's weight.
_BUNDLE_BYTES = 8 << 20

_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


@torch.no_grad()
def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None, *,
                    num_threads: int | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``, with the same result bit for bit, computing the norms of
    CPU gradients on ``num_threads`` threads (default ``torch.get_num_threads()``). See Note:
    [Norms on several threads].

    Use it wherever the training clips an offloaded model's gradients (``OffloadOptimizer``'s
    gradients are on the host): ``offload.clip_grad_norm_(model.parameters(), 1.0)``.

    Raises:
        ValueError: ``num_threads`` is not a positive int.
        RuntimeError: as ``torch.nn.utils.clip_grad_norm_`` (a non-finite norm with
            ``error_if_nonfinite=True``, ``foreach=True`` on a device without foreach kernels).
    """
    if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                    or num_threads < 1):
        raise ValueError(f"num_threads must be a positive int or None, got {num_threads!r}")
    if _group_tensors_by_device_and_dtype is None:  # pragma: no cover
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    else:
        generator = isinstance(parameters, types.GeneratorType)
        parameters = list(parameters)
        if generator and not parameters:  # a filter that kept nothing would turn clipping off unsaid
            warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=3)
    for scaler in list(_scalers):
        scaler.settle(parameters)  # an earlier clip's scaling, handed to an update worker, writes these gradients
    grads = [p.grad for p in parameters if p.grad is not None]
    total_norm = total_grad_norm(grads, norm_type, error_if_nonfinite, foreach, num_threads=num_threads)
    for listener in _clip_listeners:
        listener(parameters)  # a clip by one writes nothing for what compares the gradients to see
    if grads and not _coefficient_is_one(grads, max_norm, norm_type, total_norm):
        _scale(parameters, max_norm, total_norm, foreach)
    return total_norm


def _scale(parameters: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor, foreach: bool | None) -> None:
    """PyTorch's ``clip_grads_with_norm_``, the gradients an optimizer scales in its update
    (Note: [Scaling in the update] in ``offload/optimizing/deferred_scaling.py``) handed to it,
    multiplied by the coefficient PyTorch computes, in the same operation."""
    taken: set[int] = set()
    with_grads = [p for p in parameters if p.grad is not None]
    # foreach=True: PyTorch's own path (and error). A parameter listed twice PyTorch scales twice.
    if _scalers and foreach is not True and len({id(p) for p in with_grads}) == len(with_grads):
        # PyTorch's coefficient, on the total norm's device (a resident slice's, when it is listed
        # first), then on the CPU, as PyTorch copies it there for the CPU gradients.
        coefficient = torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0).to("cpu")
        for scaler in list(_scalers):
            taken |= scaler.take([p for p in with_grads if id(p) not in taken], coefficient)
    rest = [p for p in parameters if id(p) not in taken]
    if rest:
        clip_grads_with_norm_(rest, max_norm, total_norm, foreach)


@torch.no_grad()
def total_grad_norm(tensors: Sequence[torch.Tensor], norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None, *, num_threads: int | None = None) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm`` of ``tensors``, bit for bit, with the CPU tensors' norms on
    several threads."""
    tensors = list(tensors)
    norm_type = float(norm_type)
    if not tensors:
        return torch.tensor(0.0)
    first_device = tensors[0].device
    norms: list[torch.Tensor] = []
    for (device, dtype), ([device_tensors], _) in _group_tensors_by_device_and_dtype([tensors]).items():
        if device.type == "cpu" and norm_type == 2.0 and dtype in POOLED_DTYPES:
            # PyTorch's foreach norm on the CPU is this same call, one tensor at a time.
            norms.extend(_host_norms(device_tensors, num_threads))
        elif (foreach is None and _has_foreach_support(device_tensors, device)) or (
                foreach and _device_has_foreach_support(device)):
            norms.extend(torch._foreach_norm(device_tensors, norm_type))
        elif foreach:
            raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
        else:
            norms.extend(torch.linalg.vector_norm(g, norm_type) for g in device_tensors)
    total_norm = torch.linalg.vector_norm(torch.stack([norm.to(first_device) for norm in norms]), norm_type)
    if error_if_nonfinite and torch.logical_or(total_norm.isnan(), total_norm.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`")
    return total_norm


def _host_norms(tensors: list[torch.Tensor], num_threads: int | None) -> list[torch.Tensor]:
    """Each host tensor's 2-norm: the one backward computed where the tensor is unchanged since, the
    others computed now, on the pool. A norm from backward of a parameter no call compared yet is
    computed again and compared (Note: [Norms from backward], "checked"); one whose norm was
    non-finite or zero stays unchecked."""
    found = _known_norms(tensors)
    todo = [i for i, f in enumerate(found) if f is None or f[0].param not in f[1].checked]
    computed = dict(zip(todo, pooled_norms([tensors[i] for i in todo], 2.0, num_threads)))
    compared = [(i, *found[i]) for i in todo if found[i] is not None]  # type: ignore[misc]
    differ = [known.name for i, known, _ in compared if not _same_bits(known.norm, computed[i])]
    if differ:
        for source in {id(source): source for _, _, source in compared}.values():
            source.forget()
        shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
        raise RuntimeError(
            f"clip_grad_norm_: the gradient of {shown} changed after backward computed its norm "
            "(OffloadOptimizer(norms_in_backward=True)) in a way PyTorch's version counter does not see: a write "
            "through .grad.data, torch.amp.GradScaler's unscale_ (offload.GradScaler's is seen), a collective such "
            "as dist.all_reduce. Nothing was clipped. Build the OffloadOptimizer without norms_in_backward for this "
            "training loop.")
    for _, known, source in compared:
        if _comparison_tells(known.norm):
            source.checked.add(known.param)
    return [computed[i] if i in computed else found[i][0].norm for i in range(len(tensors))]  # type: ignore[index]


def _comparison_tells(norm: torch.Tensor) -> bool:
    """Whether equal norms before and after a write would show it: unscaling (or averaging) a
    gradient that is non-finite or zero leaves its norm as it was, so such a comparison checks
    nothing, and the parameter's next norm from backward is compared again (a first step that
    overflowed would otherwise have every later clip trust norms of still-scaled gradients)."""
    return bool(torch.isfinite(norm)) and bool(norm != 0)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(1).view(torch.uint8), b.reshape(1).view(torch.uint8))


# -- norms computed ahead (Note: [Norms from backward] in offload/optimizing/backward_norms.py) ---------

class NormSource(Protocol):
    """What computes norms ahead of :func:`clip_grad_norm_` (``BackwardNorms``)."""

    #: Ids of the parameters whose norm from here a call compared with one computed anew, bit for bit.
    checked: set[int]
    #: It offers nothing more (its norms are dropped where found).
    closed: bool

    def settle(self) -> None:
        """Wait until the norms being computed are known."""

    def forget(self) -> None:
        """Forget every norm computed so far."""


@dataclass(frozen=True)
class KnownNorm:
    """A gradient's 2-norm computed ahead, valid while the gradient is the same memory, unchanged."""

    storage: StorageWeakRef  # the gradient's memory, without keeping it alive
    version: int  # the gradient's version counter when the norm was taken
    intra_op: int  # the intra-op thread count it was computed under
    norm: torch.Tensor
    name: str  # the parameter's, for errors
    param: int  # the parameter's id
    source: weakref.ref[Any]  # the NormSource, weakly: the registry must not keep a model's engine alive


#: Where a gradient lies (storage, offset, dtype, shape, strides) -> its norm computed ahead.
_known: dict[tuple[Any, ...], KnownNorm] = {}
_sources: weakref.WeakSet[Any] = weakref.WeakSet()
_known_lock = threading.Lock()


def _place(t: torch.Tensor) -> tuple[Any, ...]:
    return t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape), t.stride()


class GradientScaler(Protocol):
    """What scales gradients later, for :func:`clip_grad_norm_` (``DeferredScaling``)."""

    def settle(self, params: Sequence[torch.Tensor]) -> None:
        """Wait until the scaling handed over so far of these parameters' gradients has run."""

    def take(self, params: Sequence[torch.Tensor], coefficient: torch.Tensor) -> set[int]:
        """Hand over the scaling of some of these parameters' gradients by ``coefficient``; their ids."""


_scalers: weakref.WeakSet[Any] = weakref.WeakSet()
_clip_listeners: list[Callable[[Sequence[torch.Tensor]], None]] = []


def add_clip_listener(listener: Callable[[Sequence[torch.Tensor]], None]) -> None:
    """Have every :func:`clip_grad_norm_` that clips call ``listener`` with its parameters first
    (``update_in_backward``'s check: Note: [Update in backward] in ``offload/optimizing/in_backward.py``)."""
    _clip_listeners.append(listener)


def add_scaler(scaler: GradientScaler) -> None:
    """Let :func:`clip_grad_norm_` hand gradients to ``scaler`` to scale (and wait for it before it reads them)."""
    _scalers.add(scaler)


def add_source(source: NormSource) -> None:
    """Let :func:`clip_grad_norm_` wait for ``source`` before it looks for norms computed ahead."""
    _sources.add(source)


def remember_norms(source: NormSource, tensors: Sequence[torch.Tensor], norms: Sequence[torch.Tensor],
                   versions: Sequence[int], params: Sequence[tuple[str, int]]) -> None:
    """Keep the norms ``source`` computed, ``versions`` being each tensor's version counter read
    before its norm was, ``params`` each one's parameter (name, id)."""
    intra_op = torch.get_num_threads()
    held = weakref.ref(source)
    with _known_lock:
        for t, norm, version, (name, param) in zip(tensors, norms, versions, params):
            _known[_place(t)] = KnownNorm(StorageWeakRef(t.untyped_storage()), version, intra_op, norm, name, param,
                                          held)


def forget_norms(source: NormSource) -> None:
    with _known_lock:
        for key in [key for key, known in _known.items() if known.source() in (source, None)]:
            del _known[key]


def forget_norms_unscaled(optimizer: Any) -> None:
    """Forget every norm computed ahead, the gradients being about to be written in a way their
    version counters do not see (``offload.GradScaler.unscale_``): the next clip computes them
    anew, as without the norms from backward. Computations still running keep nothing (each
    source's generation moves on) and nobody waits for them. ``optimizer``'s own norms from
    backward stop: under a scaler that unscales every step they would only be thrown away."""
    norms = getattr(optimizer, "_norms", None)
    if norms is not None:
        norms.unscaled = True
    for source in list(_sources):
        source.forget()


def _known_norms(tensors: Sequence[torch.Tensor]) -> list[tuple[KnownNorm, NormSource] | None]:
    """Per tensor, its norm computed ahead and who computed it, if the tensor is the same memory,
    unchanged since, and this thread computes norms under the same intra-op thread count; else ``None``."""
    for source in list(_sources):
        source.settle()
    if not _known:
        return [None] * len(tensors)
    intra_op = torch.get_num_threads()
    found: list[tuple[KnownNorm, NormSource] | None] = []
    with _known_lock:
        for t in tensors:
            key = _place(t) if t.layout == torch.strided else None  # sparse: PyTorch's own error, later
            known = _known.get(key) if key is not None else None
            source = known.source() if known is not None else None
            if known is not None and (source is None or source.closed):
                del _known[key]
            elif (source is not None and not known.storage.expired() and t._version == known.version
                    and known.intra_op == intra_op and known.storage == StorageWeakRef(t.untyped_storage())):
                found.append((known, source))
                continue
            found.append(None)
    return found


def pooled_norms(tensors: list[torch.Tensor], norm_type: float, num_threads: int | None) -> list[torch.Tensor]:
    """Each tensor's ``vector_norm``, computed on the pool, in the order of ``tensors``."""
    intra_op = torch.get_num_threads()
    workers = num_threads or intra_op
    if workers == 1 or len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors) < _BUNDLE_BYTES:
        return [torch.linalg.vector_norm(t, norm_type) for t in tensors]
    results: list[torch.Tensor | None] = [None] * len(tensors)

    def run(indices: list[int]) -> None:
        torch.set_num_threads(intra_op)
        with torch.no_grad():  # grad mode is per thread: the caller's no_grad does not reach here
            for i in indices:
                results[i] = torch.linalg.vector_norm(tensors[i], norm_type)

    futures = [_pool(workers).submit(run, task) for task in _tasks(tensors)]
    for future in futures:
        future.result()
    return results  # type: ignore[return-value]


def _tasks(tensors: list[torch.Tensor]) -> list[list[int]]:
    """The tensors' indices in tasks, largest first (the pool takes them in order, so the long ones
    start first); tensors under :data:`_BUNDLE_BYTES` share tasks of about that size."""
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].numel() * tensors[i].element_size())
    tasks: list[list[int]] = []
    bundle: list[int] = []
    bundle_bytes = 0
    for i in order:
        nbytes = tensors[i].numel() * tensors[i].element_size()
        if nbytes >= _BUNDLE_BYTES:
            tasks.append([i])
            continue
        bundle.append(i)
        bundle_bytes += nbytes
        if bundle_bytes >= _BUNDLE_BYTES:
            tasks.append(bundle)
            bundle, bundle_bytes = [], 0
    if bundle:
        tasks.append(bundle)
    return tasks


def _pool(workers: int) -> ThreadPoolExecutor:
    with _pools_lock:
        pool = _pools.get(workers)
        if pool is None:
            pool = _pools[workers] = ThreadPoolExecutor(workers, thread_name_prefix="offload-norm")
        return pool


def _coefficient_is_one(grads: list[torch.Tensor], max_norm: float, norm_type: float | str,
                        total_norm: torch.Tensor) -> bool:
    """Whether ``clip_grads_with_norm_`` would multiply every gradient by exactly one, read only
    where that costs no device synchronisation (every gradient on the CPU), and where the product
    could not tell: a "0-norm" (a count of non-zeros) is finite beside a quiet NaN, which
    PyTorch's bfloat16 product rewrites (its sign set), so that product is left to PyTorch."""
    if any(g.device.type != "cpu" for g in grads) or total_norm.device.type != "cpu" or float(norm_type) == 0.0:
        return False
    clip_coef = max_norm / (total_norm + 1e-6)
    return bool(torch.clamp(clip_coef, max=1.0) == 1.0)
