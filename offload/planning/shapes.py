"""What each layer of a model computes and keeps for one batch, found without computing it.

:func:`profile_layers` runs the model's forward and backward on fake tensors (``FakeTensorMode``
on the CPU: shapes and dtypes, no data, nothing allocated), layer by layer, and counts
for each layer its floating-point operations (``torch.utils.flop_counter``; a mixture of experts'
grouped matmuls too: Note: [Grouped matmuls on fake tensors]), the bytes autograd
saves for its backward and the bytes of its output (the next layer's input: a boundary
activation where a slice ends). The model itself is not touched: its parameters and buffers are
replaced, for the run, by fake tensors of the same shapes (in ``compute_dtype`` where the device
copies would be: not a batch or instance norm's parameters, which keep their dtype), so a model
built on the meta device, or a real one with its weights, profiles alike.

Fake tensors rather than plain meta ones because Hugging Face models look at values on the way
(a mask's ``.all()``, packed-sequence checks) and skip those looks for fake tensors, as they do
under ``torch.compile``; and fake *CPU* tensors because operators pick their kernels by device:
on the meta device ``scaled_dot_product_attention`` takes its math path and saves the whole
attention matrix, where a real device's fused kernel saves the output and its log-sum-exp
(``tests/test_planning.py`` checks the saved bytes against a real run's).

This file measures shapes only; what the bytes mean for memory is ``planner.py``'s business, what
the operations cost in time ``timing.py``'s.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from .loss_chunks import RepeatedChunks, chunked_head
from .working_bytes import NodeBytes, TransientBytes
from ..streams.host_storage import keeping_their_dtype
from ..walk.structures import flatten, tensors_in, unflatten


@dataclass(frozen=True)
class LayerProfile:
    """One layer's work and memory for the whole batch.

    Attributes:
        forward_flops: floating-point operations of its forward.
        backward_flops: of its backward (the model's backward shared out by forward operations:
            autograd runs one backward for all layers).
        saved: what autograd saves for its backward, as ``{storage id: bytes}``, parameters left
            out (they are in the device slot already); a tensor saved by two layers of a slice is
            one storage, counted once when a slice's layers are joined.
        output_bytes: the tensors it returns (each storage once).
        summing: bytes its backward holds beyond ``saved`` while it adds up the gradients of a
            tensor that two operations read (Note: [Gradients summed in backward]).
        transient: the most bytes its forward holds at once beyond what it saves and returns
            (Note: [Working bytes beyond the saved] in ``working_bytes.py``).
    """

    forward_flops: int
    backward_flops: int
    saved: dict[int, int]
    output_bytes: int
    summing: int = 0
    transient: int = 0

    @property
    def saved_bytes(self) -> int:
        return sum(self.saved.values())


@dataclass(frozen=True)
class ModelProfile:
    """Every layer's :class:`LayerProfile` for one batch, and the input's bytes."""

    layers: list[LayerProfile]
    input_bytes: int
    batch_size: int

    @property
    def forward_flops(self) -> int:
        return sum(layer.forward_flops for layer in self.layers)

    @property
    def backward_flops(self) -> int:
        return sum(layer.backward_flops for layer in self.layers)

    def slice_input_bytes(self, ranges: Sequence[range]) -> list[int]:
        """Bytes entering each slice (its boundary activation), whole batch."""
        outputs = [self.input_bytes] + [layer.output_bytes for layer in self.layers]
        return [outputs[r.start] for r in ranges]

    def checkpointed_bytes(self, ranges: Sequence[range], num_microbatches: int) -> int:
        """Bytes of the boundary activations a step offloads and loads back: every slice's input
        but the last microbatch's into the last slice, whose graph is kept instead (backward
        starts there; ``ForwardRecords.keeps_graph`` in ``offload/autograd/records.py``)."""
        inputs = self.slice_input_bytes(ranges)
        return sum(inputs[:-1]) + inputs[-1] * (num_microbatches - 1) // num_microbatches

    def recomputed_flops(self, ranges: Sequence[range], num_microbatches: int) -> int:
        """Operations the backward's recompute repeats: every slice's forward but the kept graph's."""
        last = sum(self.layers[k].forward_flops for k in ranges[-1])
        return self.forward_flops - last // num_microbatches

    def slice_largest_saved(self, ranges: Sequence[range]) -> list[int]:
        """Each slice's largest saved tensor: about what its backward produces at once beside them."""
        return [max((max(self.layers[k].saved.values(), default=0) for k in r), default=0) for r in ranges]

    def slice_output_bytes(self, ranges: Sequence[range]) -> list[int]:
        return [self.layers[r.stop - 1].output_bytes for r in ranges]

    def slice_saved_bytes(self, ranges: Sequence[range]) -> list[int]:
        """Bytes a slice's graph saves for backward, whole batch, each storage once."""
        result = []
        for r in ranges:
            saved: dict[int, int] = {}
            for k in r:
                saved.update(self.layers[k].saved)
            result.append(sum(saved.values()))
        return result


def profile_layers(layers: nn.Sequential, make_input: Callable[[], Any], *,
                   compute_dtype: torch.dtype | None = None) -> ModelProfile:
    """Profile ``layers`` on the batch ``make_input()`` builds, on fake tensors.

    Args:
        layers: the ``nn.Sequential`` (each child is a layer; nothing in it changes).
        make_input: returns the model's input; it is called under ``FakeTensorMode`` with the
            CPU as default device, so ``torch.zeros(8, 512, dtype=torch.long)`` in it is free.
        compute_dtype: as :class:`~offload.OffloadModel` takes it: floating-point parameters and
            inputs are in it, as the device copies are.

    Raises:
        RuntimeError: the forward failed on fake tensors (an operation that reads values); the
            message names the layer.

    Example::

        >>> profile = profile_layers(model, lambda: torch.zeros(8, 1024, dtype=torch.long))
        >>> profile.forward_flops, profile.slice_saved_bytes([range(0, len(model))])
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    children = list(layers.children()) or [layers]
    # The stand-ins stay in place through the backward too: a layer that checkpoints inside
    # (a chunked loss) recomputes with them there.
    grouped = _GroupedMatmulInAnyDtype() if _grouped_mm_op() is not None else contextlib.nullcontext()
    # A chunked loss's chunks, each shape run once: Note: [Loss chunks profiled once].
    chunks = RepeatedChunks(_flop_counter)
    with FakeTensorMode(allow_non_fake_inputs=True), torch.device("cpu"), grouped, \
            contextlib.ExitStack() as stand_ins:
        x = _cast_inputs(make_input(), compute_dtype)
        input_bytes, batch = _nbytes(x), _batch_size(x)
        forward, saved, outputs, transient, sums, last = _forward(children, x, compute_dtype, stand_ins, chunks)
        with NodeBytes() as nodes:  # what each node of the backward makes: Note: [Working bytes beyond the saved]
            backward = _backward_flops(last)
        summed = sums.beyond_saved(nodes.made)
        skipped_forward, skipped_backward = chunks.flops()
    forward = [flops + skipped_forward.get(index, 0) for index, flops in enumerate(forward)]
    backward += skipped_backward
    total = sum(forward) or 1
    layer_profiles = [LayerProfile(f, round(backward * f / total), s, o, g, t)
                      for f, s, o, g, t in zip(forward, saved, outputs, summed, transient)]
    return ModelProfile(layers=layer_profiles, input_bytes=input_bytes, batch_size=batch)


def _forward(children: list[nn.Module], x: Any, compute_dtype: torch.dtype | None, stand_ins: contextlib.ExitStack,
             chunks: RepeatedChunks) -> tuple[list[int], list[dict[int, int]], list[int], list[int],
                                              _SummedGradients, Any]:
    forward: list[int] = []
    saved: list[dict[int, int]] = []
    outputs: list[int] = []
    transient: list[int] = []
    sums = _SummedGradients()
    for index, layer in enumerate(children):
        replacements = _fake_state(layer, compute_dtype)
        # Entered first, so it exits last: Note: [The layers' own tensors put back].
        stand_ins.enter_context(_put_back(layer))
        # What torch.func.functional_call does, kept open until the backward has run.
        stand_ins.enter_context(_reparametrize_module(layer, replacements, tie_weights=True))
        stand_ins.enter_context(chunks.patched(layer, index))
        held = {_storage_id(t) for t in replacements.values()}
        layer_saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if isinstance(t, torch.Tensor) and _storage_id(t) not in held:
                layer_saved[_storage_id(t)] = t.untyped_storage().nbytes()
                sums.saving(_storage_id(t))
            return t

        try:
            with _flop_counter() as counter, _without_fake_kernel_log(), _MatmulInOneDtype(), \
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), TransientBytes() as made:
                x = layer(x)
        except Exception as error:
            raise RuntimeError(f"profiling layer {index} ({type(layer).__name__}) on fake tensors failed: "
                               f"{error}") from error
        forward.append(counter.get_total_flops())
        transient.append(made.most_beyond(layer_saved, {_storage_id(t) for t in tensors_in(x)}))
        sums.layer_built(x, layer_saved, chunks.made_by_chunks if chunked_head(layer) else None)
        saved.append(chunks.as_looped(layer_saved))
        outputs.append(_nbytes(x))
    return forward, saved, outputs, transient, sums, x


# Note: [Gradients summed in backward]
#     A tensor that two operations differentiate gets a gradient from each, and autograd adds
#     them up (in the ``InputBuffer`` of the node that made the tensor) out of place: the two and
#     their sum exist at once, three gradients of its size. LoRA is where it counts: a linear's
#     frozen base and its adapter both read its input, so the backward of a decoder's
#     ``down_proj``, the first to run, sums two gradients of the layer's largest activation while
#     nearly all it saved is still there, where a full fine-tune produces one (a frozen weight has
#     no gradient, so a frozen base alone has nothing to sum). Counted as one gradient the size of
#     the largest saved tensor, a bfloat16 LoRA's device working set was 16 to 28 % over the
#     estimate (``tests/test_planning.py`` measures it). Where a sum comes late (the input of a
#     full fine-tune's query, key and value projections), what the layer saved is mostly freed:
#     the backward runs the nodes made last first and frees what each saved as it goes.
#     :class:`_SummedGradients` finds the sums in the graph a layer built (edges from its nodes
#     into one input of one node, two or more, sized by that input's metadata) and counts, at the
#     second of them to run, the saved tensors that a node made no later saved (by the sequence
#     number autograd gives its nodes in order), and the larger of the three gradients at the sum
#     and, while the second node runs, the waiting gradient, that node's incoming gradients and
#     what its operations make in the profile's backward (Note: [Working bytes beyond the saved] in
#     ``working_bytes.py``, rule 2: an RMSNorm's ``pow`` makes three of its input's size). A
#     parameter's gradient (an ``AccumulateGrad``) is left out: it is the slice's gradients,
#     counted apart; so are the sums of a chunked loss's chunks, which run once per shape (Note:
#     [Loss chunks profiled once]), in an order whose sums are not the loop's: not the head's norm
#     before them, whose sum comes at two slices beside the last decoder's saved tensors.


class _SummedGradients:
    """What each layer's backward holds beyond its saved tensors while it sums gradients (Note:
    [Gradients summed in backward]): call :meth:`saving` from the layer's pack hook, then
    :meth:`layer_built` with what it returned and saved, and after the backward
    :meth:`beyond_saved` with what its nodes made."""

    def __init__(self) -> None:
        self._walked: set[Any] = set()  # the graph's nodes that earlier layers built
        self._saved_after: dict[int, int] = {}  # a storage's first saver's sequence number, plus one
        # The next node's sequence number (not in every PyTorch: then every saved tensor counts).
        self._next_node = getattr(torch._C._autograd, "_get_sequence_nr", lambda: 0)
        # Per layer, its sums: (the second node's sequence number, the saved bytes then held less
        # the layer's, the summed gradient's bytes, the node's incoming gradients' bytes).
        self._sums: list[list[tuple[int, int, int, int]]] = []

    def saving(self, storage: int) -> None:
        self._saved_after.setdefault(storage, self._next_node())

    def layer_built(self, output: Any, saved: dict[int, int], skipped: Callable[[int], bool] | None) -> None:
        """Find the sums in the graph the layer built (``saved`` its saved bytes by storage), but
        those whose nodes ``skipped`` says (by sequence number) are not the real run's."""
        consumers: dict[tuple[Any, int], list[tuple[int, Any]]] = {}
        nodes = [t.grad_fn for t in tensors_in(output) if t.grad_fn is not None]
        while nodes:
            node = nodes.pop()
            if node in self._walked:
                continue
            self._walked.add(node)
            for target, position in node.next_functions:
                if target is not None and target.name() != "torch::autograd::AccumulateGrad":
                    consumers.setdefault((target, position), []).append((node._sequence_nr(), node))
                    nodes.append(target)
        total, sums = sum(saved.values()), []
        for (target, position), made in consumers.items():
            if skipped is not None and any(skipped(number) for number, _ in made):
                continue
            if len(made) > 1 and hasattr(target, "_input_metadata"):  # the engine's record of the input
                second, node = sorted(made, key=lambda m: m[0])[-2]
                held = sum(saved[s] for s, after in self._saved_after.items() if after <= second + 1 and s in saved)
                incoming = sum(_metadata_bytes(m) for m in getattr(node, "_input_metadata", ()))
                sums.append((second, held - total, _metadata_bytes(target._input_metadata[position]), incoming))
        self._sums.append(sums)
        self._saved_after.clear()

    def beyond_saved(self, made: dict[int, int]) -> list[int]:
        """Per layer, the bytes beyond its saved ones at the sum that holds the most, given what
        each node of the backward made (by sequence number; a node not there made one gradient)."""
        return [max([0] + [held + max(3 * size, size + incoming + made.get(second, size))
                           for second, held, size, incoming in sums]) for sums in self._sums]


def _metadata_bytes(metadata: Any) -> int:
    numel = 1
    for size in metadata.shape:
        numel *= size
    return numel * metadata.dtype.itemsize


@contextlib.contextmanager
def _without_fake_kernel_log() -> Any:
    """``FakeTensorMode`` logs a failing kernel's traceback before it raises; the RuntimeError
    :func:`_forward` raises names the layer and the reason, so that log is a second, longer copy
    (on a command's stderr: ``offload plan --input-shape`` of the wrong size)."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    disabled = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = disabled


#: The matrix multiplies ``nn.Linear`` and ``torch.matmul`` dispatch to.
_MATMULS = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "_addmm_activation")


class _MatmulInOneDtype(TorchDispatchMode):
    """Refuse a matrix multiply of integer and floating-point operands, as every real kernel does
    (``mat1 and mat2 must have the same dtype``) and the fake ones do not: token ids fed to a
    first ``nn.Linear`` (``offload plan --vocab``) would be planned, and the model fail on its
    first batch. Mixed floating dtypes are left alone: the stand-ins' dtypes follow the compute
    dtype as the device copies do, not every cast a real run makes."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in _MATMULS:
            dtypes = {t.dtype for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            if len(dtypes) > 1 and not all(dtype.is_floating_point for dtype in dtypes):
                names = " and ".join(sorted(str(dtype).removeprefix("torch.") for dtype in dtypes))
                raise RuntimeError(f"{func.overloadpacket.__name__} of {names} operands: a matrix multiply takes "
                                   "one dtype, and a real run refuses it")
        return func(*args, **kwargs)


# Note: [Grouped matmuls on fake tensors]
#     Hugging Face's mixture-of-experts layers (Mixtral, Qwen3-MoE, ...) run their experts as
#     ``torch._grouped_mm`` (``experts_implementation="grouped_mm"``, transformers'
#     ``integrations/moe.py``): one matmul over the tokens sorted by expert, ``offs`` saying where
#     each expert's rows end. Two things in torch fall short of what a real run does:
#     1. Its meta kernel, which fake tensors run, checks what the CUDA fast path takes and refuses
#        every dtype but bfloat16; the real kernels take float32 and float16 too (the CPU's, and
#        CUDA's loop of matmuls beside its fast path). :class:`_GroupedMatmulInAnyDtype` answers
#        those calls with the output the real kernel returns: its shape, the inputs' dtype,
#        contiguous. Autograd sits above it, so what it saves is what the real run saves, in the
#        real run's dtype. Calls the meta kernel takes, and any others (an ``out_dtype``), go on
#        to it.
#     2. ``FlopCounterMode`` has no formula for it and counts the experts as nothing, in every
#        dtype. :func:`_grouped_mm_flop` counts them as the matmuls they are: ``offs`` is data,
#        unknown on fake tensors, so every row is taken to belong to an expert, as it does
#        without expert parallelism. The other experts implementations are no way around this:
#        ``"eager"`` loops over the experts with shapes read from the routing (data), and
#        ``"batched_mm"`` gathers a weight matrix per token and saves those, bytes no grouped run
#        keeps.


class _GroupedMatmulInAnyDtype(TorchDispatchMode):
    """Outputs for the ``torch._grouped_mm`` calls the meta kernel refuses for their dtype
    (Note: [Grouped matmuls on fake tensors], rule 1)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _grouped_mm_op().default and _refused_for_dtype(*args, **kwargs):
            return _grouped_mm_output(*args)
        return func(*args, **kwargs)


def _refused_for_dtype(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                       bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> bool:
    return (mat_a.dtype == mat_b.dtype and mat_a.dtype.is_floating_point and mat_a.dtype != torch.bfloat16
            and bias is None and out_dtype is None)


def _grouped_mm_output(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None) -> torch.Tensor:
    # The layouts of torch's own shape rule (_create_grouped_mm_output_tensor): groups along the
    # rows of a 2-D mat_a (the forward, the input's gradient), along the contraction of two 2-D
    # ones (the weight's gradient), along the columns of a 2-D mat_b, or a batch of matmuls.
    torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3), lambda: "grouped_mm takes 2-D or 3-D operands")
    torch._check(mat_a.size(-1) == mat_b.size(-2), lambda: "contraction dimension of mat_a and mat_b must match")
    torch._check((offs is None) == (mat_a.dim() == 3 and mat_b.dim() == 3), lambda: "offs goes with a 2-D operand")
    if mat_a.dim() == 2:
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)] if mat_b.dim() == 2 else [mat_a.size(0), mat_b.size(-1)]
    else:
        size = [mat_a.size(1), mat_b.size(1)] if mat_b.dim() == 2 else [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    return torch.empty(size, dtype=mat_a.dtype, device=mat_a.device)


def _grouped_mm_flop(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """Operations of a ``torch._grouped_mm``, every row in a group (Note: [Grouped matmuls on fake
    tensors], rule 2): each output element is a dot product over the contraction, except that a
    3-D ``mat_a`` by a 2-D ``mat_b`` gives each group its own columns."""
    if len(a_shape) == 3 and len(b_shape) == 2:
        return 2 * a_shape[1] * a_shape[2] * b_shape[1]
    rows = 1
    for size in a_shape:
        rows *= size
    return 2 * rows * b_shape[-1]


def _grouped_mm_op() -> Any:
    """``aten._grouped_mm``, or ``None`` in a PyTorch that has none (before 2.8)."""
    return getattr(torch.ops.aten, "_grouped_mm", None)


def _cpu_attention_flop(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, out_shape: Any = None,
                        **kwargs: Any) -> int:
    """Scores and their product with the values, each query head against its key head: with
    grouped-query attention (``enable_gqa``, which Hugging Face passes where there is no mask) the
    keys and values have fewer heads. Counted here, not by torch's ``sdpa_flop_count``, which
    refuses those shapes before 2.13."""
    batch, heads, queries, width = query_shape
    keys, value_width = key_shape[-2], value_shape[-1]
    return 2 * batch * heads * queries * keys * (width + value_width)


def _cpu_attention_backward_flop(grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any,
                                 *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """The scores again, the gradients of the scores and of the values, then of the queries and
    the keys: five products, counted per query head as torch's ``sdpa_backward_flop_count`` does."""
    batch, heads, queries, width = query_shape
    keys, value_width = key_shape[-2], value_shape[-1]
    return 2 * batch * heads * queries * keys * (3 * width + 2 * value_width)


def _cpu_attention_flops() -> dict[Any, Any]:
    """FLOP formulas for the CPU's flash attention and its backward, as torch 2.15 counts them."""
    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flop,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward_flop}


def _flop_counter() -> FlopCounterMode:
    """A FLOP counter that counts what torch's own leaves out: grouped matmuls (Note: [Grouped
    matmuls on fake tensors], rule 2) and the attention kernel fake tensors run, the CPU's flash
    attention, which torch counts as the CUDA kernels' same product from 2.15 on and as nothing
    before: a plan should not change with the PyTorch it was made under."""
    mapping = _cpu_attention_flops()
    grouped = _grouped_mm_op()
    if grouped is not None:
        mapping[grouped] = _grouped_mm_flop
    return FlopCounterMode(display=False, custom_mapping=mapping)


def _backward_flops(output: Any) -> int:
    tensors = [t for t in tensors_in(output) if t.requires_grad]
    if not tensors:
        return 0
    with _flop_counter() as counter:
        torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])
    return counter.get_total_flops()


# Note: [The layers' own tensors put back]
#     ``_reparametrize_module`` puts each original back by name where the name then is, and a
#     forward that re-registers a name moves it: PEFT's ``lora.ParamWrapper`` (LoRA on a mixture of
#     experts' fused ``gate_up_proj`` / ``down_proj``) wraps the parameter in a ``torch.nn.utils.
#     parametrize`` parametrization for the forward and removes it after, which registers the
#     plain fake stand-in back as a buffer. The original parameter was then restored into
#     ``_buffers``, so the experts' base weights left the layers' parameters and ``offload plan
#     --lora-r`` counted (and sized the plan by) what was left. Each module's ``_parameters`` and
#     ``_buffers`` are copied before the profile and put back, as they were, after it.


@contextlib.contextmanager
def _put_back(layer: nn.Module) -> Any:
    """Restores every submodule's ``_parameters`` and ``_buffers`` dicts as they were on entry
    (Note: [The layers' own tensors put back])."""
    kept = [(module, dict(module._parameters), dict(module._buffers)) for module in layer.modules()]
    try:
        yield
    finally:
        for module, parameters, buffers in kept:
            module._parameters.clear()
            module._parameters.update(parameters)
            module._buffers.clear()
            module._buffers.update(buffers)


def _fake_state(layer: nn.Module, compute_dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Fake stand-ins for the layer's parameters and buffers, by name (tied ones once), in their
    device copies' dtypes: a floating-point parameter in ``compute_dtype``, but a batch or instance
    norm's, which keeps its own as the model keeps it."""
    state: dict[str, torch.Tensor] = {}
    kept = keeping_their_dtype([layer])  # the model's own test
    for name, p in layer.named_parameters():
        cast = compute_dtype is not None and p.dtype.is_floating_point and id(p) not in kept
        dtype = compute_dtype if cast else p.dtype
        state[name] = torch.empty(p.shape, dtype=dtype).requires_grad_(p.requires_grad)
    for name, b in layer.named_buffers():
        state[name] = torch.empty(b.shape, dtype=b.dtype)
    return state


def _cast_inputs(x: Any, compute_dtype: torch.dtype | None) -> Any:
    if compute_dtype is None:
        return x
    leaves, spec = flatten(x, "the model's input")  # as OffloadModel takes it apart, a dataclass's tensors too
    cast = [t.to(compute_dtype) if isinstance(t, torch.Tensor) and t.dtype.is_floating_point else t for t in leaves]
    return unflatten(cast, spec)


def _storage_id(t: torch.Tensor) -> int:
    # The storage object's address: views of one tensor share it, fake or not.
    return t.untyped_storage()._cdata


def _nbytes(x: Any) -> int:
    # A dataclass's or a dict subclass's tensors are the walk's leaves too (Note: [Containers
    # pytree keeps whole] in offload/walk/structures.py): boundary activations it offloads.
    storages = {_storage_id(t): t.untyped_storage().nbytes() for t in tensors_in(x)}
    return sum(storages.values())


def _batch_size(x: Any) -> int:
    tensors = [t for t in tensors_in(x) if t.dim() > 0]
    return tensors[0].shape[0] if tensors else 1
