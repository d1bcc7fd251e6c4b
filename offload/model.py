"""``OffloadModel``: the user-facing wrapper around an ``nn.Sequential``: its settings checked, its
layers adopted into an engine, and its forward. What it hands off: where it computes and how
``.to()`` moves that (``offload/modeling/placement.py``), reads that wait for pending host updates
(``offload/modeling/settled.py``), copies and pickles (``offload/modeling/copying.py``), its layers read as
``nn.Sequential``'s and fixed once cut (``offload/modeling/structure.py``), the walk itself (``offload/walk/``,
``offload/autograd/``)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from . import per_tensor_warning
from .arguments import int_at_least, resident_count
from .autograd import Call, OffloadFunction, flatten_input, refusals
from .autograd.accumulation import mark_zeroed
from .autograd.function import identity_hooks
from .streams.gradient_files import back_in_files, gradients_in_files, zeroed_in_files
from .streams.host_storage import check_memory_held_once
from .streams.take_in import given_back_on_failure
from .tiers.master_files import watch_loads
from .data_parallel import DataParallel, out_of_step_on_failure, refuse_parallel_wrapper
from .walk.activation_policy import ActivationPlan, OffloadActivations
from .walk.claims import MOVE, WalkClaim
from .walk.engine import Engine
from .grad_scaler import warn_about_plain_grad_scalers
from .planning.footprint import MemoryFootprint, measure as measure_footprint
from .walk.slicing import layer_nbytes, partition
from .walk.streamed import streamed_forward
from .modeling.placement import compute_target, existing_device, host_conversion, may_move_compute, stays_on_compute
from .modeling.compiled import EAGER_RUN_REASON, EagerUnderDynamo, refuse_export
from .modeling.copying import CopiedByLayers
from .modeling.structure import FixedStructure, check_layers_unchanged

#: Slices of an ``nn.Sequential`` when ``num_slices`` is not given (fewer where it has fewer layers).
DEFAULT_NUM_SLICES = 3


class OffloadModel(CopiedByLayers, FixedStructure):
    """Train an ``nn.Sequential`` whose parameters live in host memory.

    The layers are cut into slices. Forward loads each slice to ``device`` just before it runs
    while the next one is already being copied in, keeps each slice's input (its *boundary
    activation*) on ``offload_device``, and returns the output on ``device``. Backward walks the
    slices in reverse: it reloads each slice and its boundary activation, re-runs the slice with
    the same random numbers and autocast state, and sends the parameter gradients back to the
    host, where autograd accumulates them into ``.grad`` as usual. Only about two slices'
    parameters and one slice's activations are on the device at any time.

    The cost: with ``checkpoint_activation=True`` every slice but the last runs forward twice
    (once more in backward), and every slice's parameters cross the host-device link about twice
    per step, gradients once.

    The wrapped layers become this module's children under their original names, so
    ``state_dict()`` keys match the plain ``nn.Sequential``'s and checkpoints move freely between
    the two. The parameters stay the same ``nn.Parameter`` objects (now in host memory, pinned when
    ``device`` is CUDA): an optimizer built on the original model's parameters or on
    ``OffloadModel.parameters()`` trains the model. ``model[k]``, ``len(model)`` and iteration read
    the layers as on ``nn.Sequential``; setting, adding or deleting one afterwards is refused (Note:
    [Layers fixed at wrapping] in ``offload/modeling/structure.py``), changes inside one are followed.

    Args:
        model: an ``nn.Sequential`` (sliced automatically), or a list of modules that are used as
            the slices exactly as given (``num_slices`` is then ignored). Subclasses of
            ``nn.Sequential`` that override ``forward`` are rejected: slicing would bypass it.
        device: where the layers compute, e.g. ``"cuda"`` or ``"cpu"``.
        offload_device: where parameters and boundary activations live between uses.
        num_slices: how many slices to cut an ``nn.Sequential`` into (default 3, or one a layer
            where there are fewer; more than the layers warns). Slices are balanced by parameter
            and buffer bytes. More slices: less device memory, more, smaller copies.
        checkpoint_activation: keep only slice inputs (on ``offload_device``) and recompute in
            backward; the default, because it is what saves memory. With ``False`` every slice's
            activations stay on ``device`` until backward, as in the plain model (parameters are
            still offloaded): faster, but activation memory grows with depth.
        num_microbatches: run every slice on this many chunks of the batch (dim 0), one after
            another, so activations of one chunk are on the device at a time. A batch with fewer
            rows than this uses one microbatch per row. Layers that mix rows (BatchNorm in
            training mode) see microbatches, not the whole batch, and random layers draw their
            numbers per microbatch: outputs equal running the plain layers slice by slice on each
            chunk in turn, which equals the plain model only for ``num_microbatches=1``.
        compute_dtype: ``torch.bfloat16`` or ``torch.float16`` to compute in half precision while
            the host copies stay in their dtype (float32 masters for the optimizer). Device copies
            of floating-point parameters are made, and transferred, in this dtype: half the bytes
            of float32 per load. Parameters of batch and instance norms and all buffers keep
            their dtype: they are small, and those kernels take a half-precision input with
            float32 weights and statistics on every device. Other norms (LayerNorm, GroupNorm,
            RMSNorm) compute in this dtype, as under ``model.to(dtype)``, because their CUDA
            kernels refuse mixed dtypes. Floating-point inputs
            are cast to this dtype and outputs come out in it; gradients are cast to the
            parameter's dtype on the device and travel back in it, into ``.grad``. The cost: a cast of every
            parameter on the host once per forward, into a pinned shadow buffer.
        process_group: a ``torch.distributed`` process group to train data-parallel over (every
            rank builds the same model and passes the same group): rank 0's parameters and
            buffers are taken at construction, and gradients are averaged across the group slice
            by slice during backward (see ``offload/data_parallel.py``). ``None``: one process.
        masters: where the float32 masters (the host copies) live: ``None`` in host RAM; a
            :class:`~offload.DiskTier` (or a directory path) in files on that disk, read in around
            each slice's update by :class:`~offload.OffloadOptimizer` and dropped after, so RAM
            holds a few slices' masters at a time (Note: [Masters on disk] in
            ``offload/tiers/master_files.py``, ``docs/disk-tier.md``). Needs ``compute_dtype``: loads read
            the half-precision shadow, which stays in RAM unless ``shadows="disk"``.
        shadows: ``"disk"`` (with ``masters``) keeps no shadow in RAM: each load casts its slice's masters, read
            from the disk, into two pinned buffers (Note: [Shadows on disk] in ``offload/streams/shadow_staging.py``).
        offload_activations: an :class:`~offload.OffloadActivations` naming slices whose saved
            activations go to host memory during forward and come back before their backward,
            instead of being recomputed (or kept on ``device``); ``None``: none. Saves the
            recompute at the cost of link traffic and host memory (``docs/memory.md``).
        resident_slices: how many of the first slices stay on ``device``, with their gradients and
            optimizer state, updated there in ``step()`` by the same optimizer class: no link
            traffic, no host update; about 16 bytes of device memory per parameter under AdamW
            (Note: [Resident slices] in ``offload/streams/resident_storage.py``, ``docs/optimizer.md``).

    Raises:
        TypeError: ``model`` is neither an ``nn.Sequential`` nor a list of modules (a
            ``DistributedDataParallel``, ``DataParallel`` or FSDP module says to pass ``process_group``
            instead), or an argument has the wrong type.
        ValueError: ``num_slices < 1``, ``num_microbatches < 1``, ``resident_slices`` below 0 or above
            the number of slices (or with a ``process_group``), an empty model, a device that
            does not exist on this machine, a tensor shared between two slices, a process group
            whose backend cannot reduce on ``device``, or ranks whose models differ.
        RuntimeError: ``process_group`` without an initialised ``torch.distributed``.

    Example::

        >>> model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
        >>> model = OffloadModel(model, device="cuda", num_slices=2)
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> loss = nn.functional.cross_entropy(model(x), y)
        >>> loss.backward()
        >>> optimizer.step()
    """

    #: What a deep copy takes over as it is (CopiedByLayers builds the engine anew around the layers).
    _copied_settings = ("_compute_dtype", "num_microbatches", "checkpoint_activation", "offload_activations",
                        "device", "offload_device", "training", "_masters", "_resident_slices", "_shadows")
    _pickled_before = {"offload_activations": None, "_resident_slices": 0, "_shadows": "ram"}  # settings added later

    def __init__(
        self,
        model: nn.Sequential | Sequence[nn.Module],
        device: torch.device | str | int,
        offload_device: torch.device | str | int = "cpu",
        num_slices: int | None = None,
        checkpoint_activation: bool = True,
        num_microbatches: int = 1,
        compute_dtype: torch.dtype | None = None,
        process_group: Any = None,
        masters: Any = None,
        offload_activations: OffloadActivations | None = None,
        resident_slices: int = 0,
        shadows: str = "ram",
    ) -> None:
        super().__init__()
        named_groups = _slice_groups(model, None if num_slices is None else int_at_least("num_slices", num_slices, 1))
        self._resident_slices = _resident_count(resident_slices, len(named_groups), process_group)
        if compute_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"compute_dtype must be None, torch.bfloat16 or torch.float16, got {compute_dtype!r}")
        self._compute_dtype = compute_dtype
        self.num_microbatches = int_at_least("num_microbatches", num_microbatches, 1)
        self.checkpoint_activation, self.offload_activations = _activation_settings(
            checkpoint_activation, offload_activations, len(named_groups))
        self.device, self.offload_device = _places(device, offload_device, masters)
        self._masters = masters
        self._shadows = _shadows_place(shadows, masters)
        if self.device.type == "cuda" and self.offload_device.type == "cpu":
            # Host gradients on CUDA: a plain torch.amp.GradScaler races over them (Note: [Loss scaling
            # with host gradients] in grad_scaler.py).
            warn_about_plain_grad_scalers()
        self._adopt(named_groups)
        with given_back_on_failure(self._engine.slices):  # ranks that disagree: Note: [A build that raises]
            self._data_parallel = None if process_group is None else _data_parallel(self, process_group)

    def _adopt(self, named_groups: list[tuple[list[str], list[nn.Module]]]) -> None:
        for names, layers in named_groups:
            for name, layer in zip(names, layers):
                self.add_module(name, layer)
        self._engine = Engine(named_groups, self.device, self.offload_device, compute_dtype=self.compute_dtype,
                              masters=self.__dict__.get("_masters"),
                              resident_slices=self.__dict__.get("_resident_slices", 0),
                              shadows=self.__dict__.get("_shadows", "ram"))
        watch_loads(self, self._engine.master_files)  # a failed write-back refuses saves until a load
        self._warned_microbatch_batchnorm = False
        per_tensor_warning.install()
        _RUN.prepare()  # outside any tracing (Note: [Compiled around the walk] in offload/modeling/compiled.py)

    # -- data parallelism ----------------------------------------------------------------------

    @property
    def process_group(self) -> Any:
        """The process group gradients are averaged over, or ``None``."""
        data_parallel = self.__dict__.get("_data_parallel")
        return None if data_parallel is None else data_parallel.group

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards and backwards in this block keep their gradients local, as under
        ``DistributedDataParallel.no_sync()``: the first backward of a forward outside it averages
        the accumulated total. A no-op without a ``process_group``."""
        data_parallel = self.__dict__.get("_data_parallel")
        if data_parallel is None:
            yield
            return
        with data_parallel.no_sync():
            yield

    # -- pending host updates ------------------------------------------------------------------
    # See Note: [Overlapped host update] in offload/optimizer.py: whatever hands out the host
    # copies waits for OffloadOptimizer's pending updates first (SettledModule's reads, this, and
    # CopiedByLayers's copies).

    def zero_grad(self, set_to_none: bool = True) -> None:
        _zero_grad(self, super().zero_grad, set_to_none)

    # -- inspection --------------------------------------------------------------------------

    @property
    def partition(self) -> tuple[tuple[str, ...], ...]:
        """Names of the layers in each slice, in order."""
        return tuple(tuple(s.names) for s in self._engine.slices)

    @property
    def num_slices(self) -> int:
        return self._engine.num_slices

    @property
    def resident_slices(self) -> int:  # Note: [Resident slices]
        return self._engine.num_resident

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype layers compute in, fixed at construction. A pickle from before it was read-only
        holds it as ``compute_dtype``."""
        return self.__dict__.get("_compute_dtype", self.__dict__.get("compute_dtype"))

    @compute_dtype.setter
    def compute_dtype(self, value: Any) -> None:
        # The engine made its device copies and shadows in the dtype given at construction; a new
        # one would cast the inputs and not the parameters.
        raise AttributeError(
            f"OffloadModel.compute_dtype is fixed when the model is built (it is {self.compute_dtype}); "
            f"build the model with compute_dtype={value!r} instead: OffloadModel(layers, device=..., "
            f"compute_dtype={value!r})")

    def memory_footprint(self) -> MemoryFootprint:
        """What offloading holds in memory right now (see :class:`MemoryFootprint`), after the
        pending host updates (they create and move optimizer state while it is counted) and, with
        masters on disk, after their pending write-backs."""
        engine = self._engine
        self._settle()
        if engine.master_files is not None:
            engine.master_files.wait()  # pages are in RAM until their write-back drops them
        return measure_footprint(engine, engine.optimizers, engine.disk_tiers)

    def extra_repr(self) -> str:
        return _settings(self)

    # -- forward -----------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped layers on one input, as ``nn.Sequential.forward`` does.

        Raises:
            TypeError: keyword arguments, or not exactly one positional argument.
            RuntimeError: under ``torch.export`` or ``torch.jit.trace`` (Note: [Exported or traced] in
                ``offload/modeling/compiled.py``).
        """
        refuse_export()
        return _RUN(self, *args, **kwargs)  # Note: [Compiled around the walk] in offload/modeling/compiled.py

    def _activation_plan(self) -> ActivationPlan:
        return ActivationPlan.of(self.checkpoint_activation, self.offload_activations, self._engine.num_slices)

    # -- placement ---------------------------------------------------------------------------

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> OffloadModel:
        """Follow ``.to()``, ``.cuda()``, ``.cpu()``, ``.double()``, ``.half()``: see Note: [Moving an
        OffloadModel] in ``offload/modeling/placement.py``."""
        with WalkClaim(self._engine, MOVE):  # before anything moves or waits: Note: [One walk at a time], rule 4
            self._settle()
            engine = self._engine
            at_home = gradients_in_files(s.storage for s in engine.slices)  # Note: [Gradients on disk]
            target = compute_target(fn, self.device, self.offload_device)
            if target != self.device and may_move_compute(engine, self.device, self.offload_device, target,
                                                          self.__dict__.get("_data_parallel") is not None):
                # The host copies stay on offload_device (re-laid out, and pinned when target is CUDA);
                # the device slots, copy streams and buffers are built anew for target.
                self.device = target
                self._adopt([(list(s.names), list(s.layers)) for s in engine.slices])
                for optimizer in list(engine.optimizers):  # they step the new engine from now on
                    optimizer._follow(self._engine)
                if self.device.type == "cuda" and self.offload_device.type == "cpu":
                    warn_about_plain_grad_scalers()  # as a model built there: [Loss scaling with host gradients]
            convert = host_conversion(fn, self.offload_device)
            if convert is not None:  # else a move alone: the host copies stay as they are
                super()._apply(stays_on_compute(convert, self.offload_device, self._engine.num_resident), recurse)
                self._engine.refresh()
                back_in_files((s.storage for s in self._engine.slices), at_home)  # _apply moved them to RAM
        return self


def _run(model: OffloadModel, *args: Any, **kwargs: Any) -> Any:
    """The forward: the walk on one input, through the autograd Function where a graph is wanted."""
    _check_one_input(args, kwargs)
    engine = model._engine
    check_layers_unchanged(model._modules, engine.slices)  # Note: [Layers fixed at wrapping]
    refusals.refuse_transformed_tensors(engine)  # before the refresh would lay them out
    refusals.refuse_parameter_tangents(engine)  # likewise: the layout copies values, not tangents
    engine.refresh()
    _warn_microbatch_batchnorm(model)
    leaves, spec = flatten_input(args[0], model.compute_dtype)
    params = engine.parameters()
    needs_graph = torch.is_grad_enabled() and (
        any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves)
        or any(p.requires_grad for p in params)
    )
    _refuse_meta(model, leaves, needs_graph)
    if not needs_graph:
        return streamed_forward(engine, leaves, spec, model.num_microbatches)
    call, input_tensors = Call.taking(leaves, spec)
    # Saved tensors are packed when apply returns: the identity hooks keep any hooks the caller
    # has active (save_on_cpu, say) away from them. They are already on the host or in pooled
    # buffers whose copies may still be in flight.
    with _identity_hooks(), out_of_step_on_failure(model.__dict__.get("_data_parallel")):
        outputs = OffloadFunction.apply(
            engine, call, model._activation_plan(), model.num_microbatches, *input_tensors, *params,
        )
    return call.output_with(outputs)


#: :func:`_run` as ``forward`` calls it: eagerly while Dynamo traces the call, made on the first construction.
_RUN = EagerUnderDynamo(_run, EAGER_RUN_REASON)


@contextlib.contextmanager
def _identity_hooks() -> Iterator[None]:
    """Saved-tensor hooks that keep tensors as they are (see :func:`_run`; the backward runs under
    them too: Note: [The caller's saved-tensor hooks] in ``offload/autograd/function.py``). Where
    PyTorch refuses them (``disable_saved_tensors_hooks()``, ``torch.func.grad``), its error says
    only what the caller said, naming no OffloadModel: a note says why the model needs them and
    what to do."""
    hooks = identity_hooks()
    try:
        hooks.__enter__()
    except RuntimeError as error:
        refusals.note_refused_hooks(error)
        raise
    try:
        yield
    finally:
        hooks.__exit__(None, None, None)


def _zero_grad(model: OffloadModel, zero: Callable[..., None], set_to_none: bool) -> None:
    """``OffloadModel.zero_grad``: ``zero`` (``nn.Module.zero_grad``) after the check that the
    model's OffloadOptimizer makes in its own ``zero_grad()`` under ``update_in_backward`` (a batch
    skipped after the backward that started updates is refused, zeroing nothing; one skipped
    before starts the accumulation again: Note: [Update in backward]). The optimizer's
    subscriber to the model's walks makes it: this module cannot import the optimizer's."""
    engine = model._engine
    for subscriber in list(engine.milestones.subscribers):
        check = getattr(subscriber, "before_zero_grad", None)
        if check is not None:
            check()
    if set_to_none:
        zero(set_to_none=True)
        return
    with zeroed_in_files([s.storage for s in engine.slices], model.parameters()):
        zero(set_to_none=False)
    mark_zeroed(model.parameters())  # zeros the next backward may add into as slices land


def engine_of(model: OffloadModel) -> Engine:
    """The model's slices and copy machinery (internal: for ``OffloadOptimizer`` and the repository's
    scripts, not part of the public API). Reading it waits for nothing, unlike the model's
    submodules and parameters, which wait for pending host updates."""
    return model.__dict__["_engine"]


# -- argument checking ------------------------------------------------------------------------------


def _data_parallel(model: OffloadModel, process_group: Any) -> DataParallel:
    """The averaging of the model's gradients over ``process_group``, told of each slice's backward
    by the walk's milestones; it takes rank 0's parameters and buffers now."""
    named = list(nn.Module.named_parameters(model)) + list(nn.Module.named_buffers(model))
    data_parallel = DataParallel(model._engine, process_group, named)
    model._engine.milestones.subscribe(data_parallel)
    return data_parallel


def _activation_settings(checkpoint_activation: Any, offload_activations: Any,
                         num_slices: int) -> tuple[bool, OffloadActivations | None]:
    """``checkpoint_activation`` and ``offload_activations``, checked against the model's slices."""
    if not isinstance(checkpoint_activation, bool):
        raise TypeError(f"checkpoint_activation must be a bool, got {type(checkpoint_activation).__name__}")
    if offload_activations is not None and not isinstance(offload_activations, OffloadActivations):
        raise TypeError(f"offload_activations must be an offload.OffloadActivations or None, got "
                        f"{type(offload_activations).__name__}")
    if offload_activations is not None:
        offload_activations.chosen(num_slices)  # an index out of range fails here, not in forward
    return checkpoint_activation, offload_activations


def _places(device: Any, offload_device: Any, masters: Any) -> tuple[torch.device, torch.device]:
    """``device`` and ``offload_device`` as devices of this machine, where parameters (and ``masters``
    on disk, backed by host memory) can live between uses."""
    device, offload_device = existing_device(device, "device"), existing_device(offload_device, "offload_device")
    if offload_device.type == "meta":
        raise ValueError("offload_device='meta' holds no data, and the parameters live there between uses; pass "
                         "offload_device='cpu'. To size a model without building it, use offload.estimate_memory")
    if masters is not None and offload_device.type != "cpu":
        raise ValueError(f"masters on disk are host memory backed by a file; offload_device must be 'cpu', got "
                         f"{offload_device}")
    return device, offload_device


def _shadows_place(shadows: Any, masters: Any) -> str:
    """``shadows`` checked: ``"disk"`` only with ``masters`` on disk, which it is cast from."""
    if shadows not in ("ram", "disk"):
        raise ValueError(f"shadows must be 'ram' or 'disk', got {shadows!r}")
    if shadows == "disk" and masters is None:
        raise ValueError("shadows='disk' casts each load from the masters on disk; pass masters=DiskTier(path) "
                         "too, or keep shadows='ram'")
    return shadows


def _settings(model: OffloadModel) -> str:
    """``extra_repr``: the settings, and each slice's layers and bytes."""
    slices = ", ".join(f"[{_span(s.names)}: {_size(s.storage.host_nbytes)}]" if not s.storage.resident
                       else f"[{_span(s.names)}: {_size(s.storage.nbytes)} resident]" for s in model._engine.slices)
    precision = f"compute_dtype={model.compute_dtype}, " if model.compute_dtype is not None else ""
    files = model._engine.master_files
    masters = f"masters on disk in {files.directory}, " if files is not None else ""
    if model.__dict__.get("_shadows", "ram") == "disk":
        masters += "shadows staged from disk, "
    offloaded = model.offload_activations
    activations = f"offload_activations={offloaded}, " if offloaded is not None else ""
    return (
        f"device={model.device}, offload_device={model.offload_device}, "
        f"checkpoint_activation={model.checkpoint_activation}, {activations}"
        f"num_microbatches={model.num_microbatches}, "
        f"{precision}{masters}slices={slices}"
    )


def _resident_count(value: Any, num_slices: int, process_group: Any) -> int:
    value = resident_count(value, num_slices)
    if value and process_group is not None:
        raise ValueError(
            "resident_slices with a process_group is not supported: data-parallel training averages gradients on "
            "their way to the host, and a resident slice's never go there. Pass resident_slices=0")
    return value


def _slice_groups(model: Any, num_slices: int | None) -> list[tuple[list[str], list[nn.Module]]]:
    refuse_parallel_wrapper(model)  # DDP, DataParallel, FSDP: process_group= instead
    if isinstance(model, OffloadModel):
        raise TypeError("this model is already an OffloadModel; train it as it is. To change its settings (slices, "
                        "devices, dtype), wrap the original nn.Sequential again instead")
    if isinstance(model, nn.Sequential):
        if type(model).forward is not nn.Sequential.forward:
            raise TypeError(
                f"{type(model).__name__} overrides nn.Sequential.forward; OffloadModel runs the layers one after "
                "another and would bypass it. Pass a plain nn.Sequential, or a list of modules to use as slices."
            )
        names = list(model._modules)
        layers = [model._modules[name] for name in names]
        if not layers:
            raise ValueError("the nn.Sequential has no layers")
        if any(layer is None for layer in layers):
            raise ValueError("the nn.Sequential holds a None layer")
        if num_slices is not None and num_slices > len(layers):
            # Asked for, not the default: more slices than layers would mean empty ones.
            warnings.warn(f"num_slices={num_slices} is more than the model's {len(layers)} layers; using "
                          f"{len(layers)} slices, one a layer", stacklevel=3)
        _refuse_uninitialized(names, layers)
        check_memory_held_once(layers, names)  # across slices too (Note: [Parameters over one memory])
        ranges = partition([layer_nbytes(layer) for layer in layers],  # type: ignore[arg-type]
                           DEFAULT_NUM_SLICES if num_slices is None else num_slices)
        return [([names[k] for k in r], [layers[k] for k in r]) for r in ranges]  # type: ignore[misc]
    if isinstance(model, (list, tuple, nn.ModuleList)):
        modules = list(model)
        if not modules:
            raise ValueError("the list of slices is empty")
        for k, module in enumerate(modules):
            if not isinstance(module, nn.Module):
                raise TypeError(f"slice {k} is a {type(module).__name__}; every slice must be an nn.Module")
        _refuse_uninitialized([str(k) for k in range(len(modules))], modules)
        check_memory_held_once(modules, [str(k) for k in range(len(modules))])
        return [([str(k)], [module]) for k, module in enumerate(modules)]
    if hasattr(getattr(model, "config", None), "model_type"):  # a Hugging Face model, by its config
        raise TypeError(
            f"OffloadModel expects an nn.Sequential; got {type(model).__name__}, a Hugging Face model. For a causal "
            f"LM, pass its stages: from offload.integrations.transformers import causal_lm_sequential; "
            f"OffloadModel(causal_lm_sequential(model), device=...)"
        )
    raise TypeError(
        f"OffloadModel expects an nn.Sequential, or a list of nn.Module used as slices; got {type(model).__name__}. "
        f"Put its layers in an nn.Sequential if it runs them one after another"
    )


def _refuse_uninitialized(names: Sequence[str], layers: Sequence[nn.Module]) -> None:
    """Refuse a lazy module's parameters or buffers not made yet (``nn.LazyLinear`` before its first
    forward): they have no shape to lay out in host memory."""
    for name, layer in zip(names, layers):
        for what, tensors in (("parameter", layer.named_parameters), ("buffer", layer.named_buffers)):
            for tensor_name, tensor in tensors():
                if isinstance(tensor, (nn.parameter.UninitializedParameter, nn.parameter.UninitializedBuffer)):
                    owner = layer.get_submodule(tensor_name.rpartition(".")[0]) if "." in tensor_name else layer
                    raise ValueError(
                        f"layer {name}'s {what} {tensor_name} ({type(owner).__name__}) is not initialized yet: a "
                        "lazy module makes its tensors at its first forward, and OffloadModel lays them out in "
                        "host memory when it wraps the layers. Run one forward of the unwrapped model on a sample "
                        "batch first, or use the module's non-lazy form (nn.Linear for nn.LazyLinear)")


def _check_one_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if kwargs:
        raise TypeError(
            f"OffloadModel.forward takes one positional input, as nn.Sequential does; got keyword "
            f"argument(s) {sorted(kwargs)}. Pass them as one dict instead: model(dict(batch)) for a "
            f"tokenizer's output or a Hugging Face batch, model({{'input_ids': ..., 'attention_mask': ...}}) "
            f"in general, or pack them into a tuple."
        )
    if len(args) != 1:
        raise TypeError(f"OffloadModel.forward takes exactly one input, as nn.Sequential does; got {len(args)}")


def _refuse_meta(model: OffloadModel, leaves: Sequence[Any], needs_graph: bool) -> None:
    """Refuse a forward that would copy data out of the meta device, which holds none: an input
    there to a model that computes elsewhere (the walk copies it to the host), or, on a model that
    computes there (built so, to be moved before training), a forward autograd records (the walk
    keeps its boundary activations and gradients on the host). Without autograd a meta model
    gives the output's shape, as the unwrapped model on meta does."""
    if model.device.type == "meta":
        if needs_graph:
            raise RuntimeError(
                "OffloadModel computes on meta (device='meta' or model.to('meta')), which holds no data, and this "
                "forward records a graph: the walk would copy its boundary activations and, in backward, its "
                "gradients to the host. Move the model where it computes first (model.to('cuda') or "
                "model.to('cpu')), or run the forward under torch.no_grad() for the output's shape")
    elif any(isinstance(x, torch.Tensor) and x.is_meta for x in leaves):
        raise RuntimeError(
            f"OffloadModel computes on {model.device} and got an input on meta, which holds no data to copy there. "
            f"Pass the input on {model.device} or on the host (x.to({str(model.device)!r})), as the unwrapped model "
            "takes it; for the output's shape alone, move the model first (model.to('meta')) and run the forward "
            "under torch.no_grad()")


def _span(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _warn_microbatch_batchnorm(model: OffloadModel) -> None:
    """Once per model: BatchNorm under microbatches normalises each microbatch, not the batch."""
    if model._warned_microbatch_batchnorm or model.num_microbatches == 1 or not model.training:
        return
    # The engine's layers, not model.modules(): that would wait for pending updates.
    layers = (m for s in model._engine.slices for layer in s.layers for m in layer.modules())
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in layers):
        model._warned_microbatch_batchnorm = True
        warnings.warn(
            "OffloadModel with num_microbatches > 1 runs BatchNorm layers on each microbatch, so "
            "their batch statistics differ from the full batch's; use num_microbatches=1 for exact "
            "full-batch normalisation",
            stacklevel=3,
        )
