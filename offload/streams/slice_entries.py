"""What a slice holds: its parameters and buffers, each tensor once with every place it is
registered (:class:`Entry`, :func:`collect_entries`), the quantisation state that travels with a
4-bit weight (its *companions*), the runs of entries one cast covers, and a cheap test that nothing
was registered in its layers since they were laid out (:class:`RegisteredTensors`).

It does not place the entries in memory (``slice_layout.py``) or copy them (``host_storage.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .flat_views import _itemsize, dense_stride
from .quantized import (RUN_STATE, device_state, device_weight, is_8bit_weight, settle_8bit_layer, state_at,
                        state_tensors)
from .sites import Site
from .watched_hooks import WatchedHooks

@dataclass
class Entry:
    """One parameter or buffer of a slice.

    Attributes:
        tensor: the host copy: the user's own ``nn.Parameter`` or buffer object.
        sites: every place it is registered (more than one for tied weights).
        device_dtype: dtype of the device copy; differs from ``tensor.dtype`` only under a
            compute dtype.
        host_offset / device_offset: byte offsets into the host buffer and into a device slot.
        stride: the tensor's own strides where it is dense but not row-major (see
            :func:`dense_stride`): every copy of it (host, shadow, device) and its gradient keep them.
        borrowed: a parameter an earlier slice holds (tied weights): it has no host offset here,
            and a load copies it into this slice's slot from that slice's host copy (Note: [Tied
            parameters across slices]).
    """

    tensor: torch.Tensor
    sites: tuple[Site, ...]
    shape: torch.Size
    dtype: torch.dtype
    device_dtype: torch.dtype
    host_offset: int = 0
    device_offset: int = 0
    borrowed: bool = False
    stride: tuple[int, ...] | None = None
    companions: list[Entry] = field(default_factory=list)
    state_path: str = ""

    @property
    def is_parameter(self) -> bool:
        return bool(self.sites) and self.sites[0].is_parameter


def collect_entries(layers: Sequence[nn.Module]) -> tuple[list[Entry], list[Entry]]:
    """The parameters and buffers registered anywhere in ``layers``, each tensor once."""
    by_id: dict[int, tuple[torch.Tensor, list[Site]]] = {}
    order: list[int] = []
    for layer in layers:
        for module in layer.modules():
            for is_parameter, table in ((True, module._parameters), (False, module._buffers)):
                for name, tensor in table.items():
                    if tensor is None:
                        continue
                    if id(tensor) not in by_id:
                        by_id[id(tensor)] = (tensor, [])
                        order.append(id(tensor))
                    by_id[id(tensor)][1].append(Site(module, name, is_parameter))
    params: list[Entry] = []
    buffers: list[Entry] = []
    for key in order:
        tensor, sites = by_id[key]
        if len({site.is_parameter for site in sites}) > 1:
            raise ValueError("a tensor is registered both as a parameter and as a buffer; OffloadModel cannot place it")
        if tensor.is_sparse or tensor.layout != torch.strided:
            raise ValueError(f"only dense (strided) parameters and buffers are supported, got layout {tensor.layout}")
        entry = Entry(tensor, tuple(sites), tensor.shape, tensor.dtype, tensor.dtype, stride=dense_stride(tensor))
        entry.companions = _companions(entry)
        _warn_laid_out_anew(entry)
        (params if sites[0].is_parameter else buffers).append(entry)
    return params, buffers


def _warn_laid_out_anew(entry: Entry) -> None:
    """Warn that a parameter which is not dense (a strided view such as ``t[:, ::2]``) gets its host
    and device copies laid out row-major, so the kernels that read it (a matmul) may round otherwise
    than in the plain model. Keeping its gaps would mean sizing every copy, shadow, gradient and
    checkpoint by its extent instead of its elements; a dense copy made before wrapping costs
    nothing. Once laid out it is row-major, so a later layout does not warn again; a plain tensor in
    its place (Note: [Tensors substituted for a call] in ``host_storage.py``) keeps its memory and is
    not warned about."""
    tensor = entry.tensor
    if (not entry.is_parameter or not isinstance(tensor, nn.Parameter) or tensor.is_meta or entry.stride is not None
            or tensor.is_contiguous()):
        return
    site = entry.sites[0]
    warnings.warn(
        f"OffloadModel: parameter '{site.name}' of {type(site.module).__name__} is not dense (shape "
        f"{tuple(tensor.shape)}, strides {tensor.stride()}); its host and device copies are laid out row-major, so "
        "the kernels that read it (a matmul) may round differently and gradients can differ from the plain model's "
        "in the last bits. Make it dense before wrapping (nn.Parameter(t.contiguous())): the same values, in a "
        "layout OffloadModel keeps, bit for bit",
        UserWarning, stacklevel=2)


def _companions(entry: Entry) -> list[Entry]:
    """The companion entries of a quantized weight, ``[]`` for any other tensor (Note: [Quantized
    weights] in ``quantized.py``)."""
    site = entry.sites[0]
    found = state_tensors(entry.tensor, f"'{site.name}' of {type(site.module).__name__}", site.module)
    for path, tensor in found:
        if tensor.layout != torch.strided or not tensor.is_contiguous():
            raise ValueError(f"'{site.name}' of {type(site.module).__name__}: its quantisation state's {path} is not "
                             "a dense row-major tensor; OffloadModel cannot place it")
    return [Entry(tensor, (), tensor.shape, tensor.dtype, tensor.dtype, state_path=path) for path, tensor in found]


def companions_of(own: Sequence[Entry], borrowed: Sequence[Entry], held_elsewhere: Collection[int]) -> list[Entry]:
    """The companions a slice holds: those of its own 4-bit weights, in order.

    Raises:
        ValueError: a 4-bit weight tied across slices, or a state tensor that two weights share
            or that an earlier slice holds (Note: [Quantized weights] in ``quantized.py``, rule 4).
    """
    for entry in borrowed:
        if entry.companions:
            raise ValueError(
                f"the 4-bit weight '{entry.sites[0].name}' of {type(entry.sites[0].module).__name__} is shared by two "
                "slices; put the layers that share it in one slice")
    companions = [c for entry in own for c in entry.companions]
    seen: set[int] = set()
    for companion in companions:
        if id(companion.tensor) in seen or id(companion.tensor) in held_elsewhere:
            raise ValueError(
                f"two 4-bit weights share the tensor at '{companion.state_path}' of their quantisation state; "
                "OffloadModel moves each state with its weight, so give each weight a state of its own "
                "(copy.deepcopy the QuantState) before wrapping")
        seen.add(id(companion.tensor))
    return companions


def states_replaced(params: Sequence[Entry]) -> bool:
    """Whether a 4-bit weight among ``params`` holds another quantisation state than its
    companions (a weight quantized again): the slice must be laid out again."""
    return any(state_at(entry.tensor, c.state_path, entry.sites[0].module) is not c.tensor
               for entry in params for c in entry.companions)


def settle_8bit_layers(params: Sequence[Entry]) -> None:
    """Put every layer of an 8-bit weight among ``params``, now in the host buffer, in the form its
    forward leaves it in, over that weight's host copies (:func:`settle_8bit_layer`)."""
    for entry in params:
        if entry.companions and is_8bit_weight(entry.tensor):
            for site in entry.sites:
                settle_8bit_layer(site.module, entry.tensor, entry.companions[0].tensor)


def run_state_positions(params: Sequence[Entry]) -> list[int]:
    """Where among a slice's entries (its parameters first) the 8-bit weights are, whose device
    copies carry the state their layers run with (:func:`bind_device_weights`).

    Known once the slice is laid out, so that binding swaps states at these entries alone and a
    slice without 8-bit layers looks at none of its entries for one."""
    return [i for i, entry in enumerate(params) if entry.companions and is_8bit_weight(entry.tensor)]


def bind_device_weights(tensors: list[torch.Tensor], views: Sequence[torch.Tensor], params: Sequence[Entry]) -> None:
    """Replace in ``tensors`` (one per entry of a slice: its parameters, then its companions in
    the order of their weights, then its buffers) each quantized weight's device copy by
    :func:`device_weight` over the same bytes; an 8-bit one carries the state its layer runs with
    (:func:`device_state`), which binding swaps in."""
    k = len(params)
    for i, entry in enumerate(params):
        if entry.companions:
            count = len(entry.companions)
            tensors[i] = device_weight(entry.tensor, views[i], [c.state_path for c in entry.companions],
                                       views[k:k + count])
            if is_8bit_weight(entry.tensor):
                setattr(tensors[i], RUN_STATE, device_state(entry.sites[0].module, views[i], views[k]))
            k += count


class _RegistrationCounter:
    """Whether modules, parameters or buffers were registered in this process (``setattr`` on a
    module, ``register_*``) since a given look, told by PyTorch's global registration hooks,
    installed while a :class:`RegisteredTensors` (a slice of a live OffloadModel) watches.

    Walking every module of a model at every forward to find ones added since it was laid out
    costs about half a millisecond for 32 decoder layers; this tells in constant time that nothing
    was registered anywhere, which is the usual case. Writing into ``module._parameters`` or
    ``module._modules`` directly is not seen (binding device copies does that, and must not be).

    The hook only stores a constant and :meth:`look` does the counting. The hooks are process-wide,
    so dynamo traces them into every compiled module that registers in its forward (spectral norm's
    ``self._u = ...``), in an OffloadModel or not: a ``count += 1`` there reads the count, dynamo
    guards on its value and recompiles at every call until its recompile limit, then runs the module
    eagerly. A constant store it replays after the graph at every call with no guard; and
    ``torch.compiler.disable`` on the hook would break the graph there, which ``fullgraph=True``
    refuses. Compiled autograd (torch 2.13) cannot trace any global registration hook, of any model:
    so the hooks are removed once the last watcher is collected, and a process that has dropped its
    OffloadModels compiles other models' backward again (docs/api.md, Limitations).
    """

    count = 0  # bumped by a look that finds ``unseen`` set
    unseen = False  # set by the hook: something was registered since the last look
    hooks = WatchedHooks(nn.modules.module.register_module_module_registration_hook,
                         nn.modules.module.register_module_parameter_registration_hook,
                         nn.modules.module.register_module_buffer_registration_hook)

    @classmethod
    def watch(cls, watcher: object) -> None:
        """Install the hooks unless installed, until ``watcher`` and every other one is collected
        (nothing watching, no look compares against what goes unseen until the next watch)."""
        cls.hooks.watch(watcher, cls._registered)

    @classmethod
    def _registered(cls, module: nn.Module, name: str, value: object) -> None:
        cls.unseen = True

    @classmethod
    def look(cls) -> int:
        """A number that differs from the one any earlier look returned when something was
        registered in between, and only then."""
        if cls.unseen:
            cls.unseen = False  # before the count: a registration in between is seen by the next look
            cls.count += 1
        return cls.count


def _registrations(layers: Sequence[nn.Module]) -> list[int | str]:
    """Every module of ``layers`` and the tensors it registers, as ``id(module)`` followed by
    ``name, id(tensor)`` pairs, depth first."""
    found: list[int | str] = []
    todo = list(reversed(layers))
    while todo:
        module = todo.pop()
        found.append(id(module))
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    found += (name, id(tensor))
        todo.extend(child for child in reversed(module._modules.values()) if child is not None)
    return found


class RegisteredTensors:
    """What a slice's layers register as they are laid out, and a cheap test that this changed.

    The full comparison runs only when something was registered anywhere since the last look
    (:class:`_RegistrationCounter`); the entries keep these modules and tensors alive, so no new
    object can take one of their ids.
    """

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        _RegistrationCounter.watch(self)
        self.layers = layers
        self.counted = _RegistrationCounter.look()
        self.registrations = _registrations(layers)

    def changed(self, entries: Sequence[Entry]) -> bool:
        """Whether the layers now register other tensors than ``entries``, the ones laid out (see
        ``SliceStorage.registered_tensors_changed``)."""
        for entry in entries:
            for site in entry.sites:
                if site.table().get(site.name) is not entry.tensor:
                    return True
        counted = _RegistrationCounter.look()
        if counted == self.counted:
            return False  # nothing registered anywhere since the last look
        if _registrations(self.layers) != self.registrations:
            return True
        self.counted = counted  # registered elsewhere
        return False


def _runs(entries: Sequence[Entry]) -> list[range]:
    """Maximal runs of consecutive entries whose element offsets agree on the host and on the
    device: the same host and device dtypes, no realignment in between (see ALIGN_ELEMENTS)."""

    def continues(a: Entry, b: Entry) -> bool:
        return ((a.dtype, a.device_dtype) == (b.dtype, b.device_dtype)
                and (b.host_offset - a.host_offset) // _itemsize(a.dtype)
                == (b.device_offset - a.device_offset) // _itemsize(a.device_dtype))

    runs: list[range] = []
    start = 0
    for k in range(1, len(entries) + 1):
        if k == len(entries) or not continues(entries[start], entries[k]):
            runs.append(range(start, k))
            start = k
    return runs
