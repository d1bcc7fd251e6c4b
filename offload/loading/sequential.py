"""Building an :class:`~offload.OffloadModel` from a safetensors checkpoint, slice by slice.

Note: [Loading slice by slice]
    Loading a model the ordinary way and then wrapping it holds the model twice at the peak (the
    loaded module, then its host copies), and a checkpoint read into a state dict a third time.
    Here the model never exists anywhere but in its host copies:

    1. The layers are built on the meta device: shapes and dtypes, no memory.
    2. Every stored tensor is matched to a parameter or buffer, and the plan is checked before
       anything is allocated: a missing or unexpected key, or a shape that differs, is an error
       naming the key and the file. Tied weights are stored once under any of their names, or
       under several (each copy whole). Copies under several names are compared, a span at a time
       and in the model's dtype (``SafetensorsCheckpoint.same_values``): equal ones are read once,
       into the one tensor; one with other values is refused by ``load_sequential`` (reading
       either would silently drop the other), and is given a tensor of its own by
       ``load_causal_lm``, with a warning, as ``from_pretrained`` unties a head stored with values
       of its own. This is decided here, not while reading, because a tensor of its own changes
       the slices' layout; it costs a second read of such copies, never a second copy in memory.
    3. ``OffloadModel`` lays the slices out as usual, but each meta tensor gets its place in the
       slice's (pinned) host buffer without a copy (``filled_by_caller`` in
       ``offload/streams/host_storage.py``); the tensors stay the same objects, so ties hold.
    4. Buffers that checkpoints do not store (non-persistent ones: rotary frequencies and the
       like) are computed on real memory by the caller's ``init_buffers``, as the model's own
       initialisation does.
    5. Slice by slice, each stored tensor is read from its file straight into its host copy
       (``offload/loading/safetensors_files.py``), cast in place when the dtypes differ.
       A bitsandbytes 4-bit weight is read into a temporary and quantised into its codes and
       quantisation state (Note: [Quantizing while loading] in ``offload/loading/four_bit.py``).

    The process then holds what the model holds anyway (``memory_footprint()``) plus one tensor in
    flight when a cast is needed (and, in step 2, a span of each tied copy compared): no state
    dict, no resident memory map of the file.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..model import OffloadModel, engine_of
from ..streams.host_storage import filled_by_caller
from ..streams.take_in import given_back_on_failure
from ..streams.quantized import is_4bit_weight
from .four_bit import read_quantized, unquantized_shape
from .safetensors_files import SafetensorsCheckpoint

#: How many keys an error message lists before it says "and N more".
_LISTED = 8


@dataclass(frozen=True)
class Placement:
    """Where a stored tensor goes: the ``state_dict`` key of the layers' tensor it fills, and the
    part of that tensor it fills (a function from the tensor to a view of it), or ``None`` for all
    of it (checkpoints that store one tensor as several, such as experts stored one by one)."""

    key: str
    part: Callable[[torch.Tensor], torch.Tensor] | None = None

    def region(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.part is None else self.part(tensor)


def load_sequential(
    build: Callable[[], nn.Sequential],
    checkpoint: str | os.PathLike[str],
    device: torch.device | str | int,
    *,
    dtype: torch.dtype | None = None,
    init_buffers: Callable[[nn.Module], None] | None = None,
    **options: Any,
) -> OffloadModel:
    """Build an ``OffloadModel`` whose weights come from a safetensors checkpoint, without holding
    the model in memory twice (Note: [Loading slice by slice]).

    ``build()`` runs on the meta device, so it allocates nothing; the checkpoint must hold
    exactly the ``state_dict()`` of what it returns (``safetensors.torch.save_file(model.state_dict(),
    path)`` writes one; tied weights may be stored under any one of their names, or under several
    with equal values).

    Args:
        build: makes the ``nn.Sequential`` (or list of slices); called under
            ``torch.device("meta")``.
        checkpoint: a ``.safetensors`` file, or a folder with ``model.safetensors`` or a
            sharded checkpoint's ``model.safetensors.index.json``.
        device: the compute device, as for ``OffloadModel``.
        dtype: the dtype of the floating-point host copies (float32 masters, say, from a bfloat16
            checkpoint); ``None`` keeps what ``build`` makes. Values are cast as they are read.
        init_buffers: computes the non-persistent buffers that checkpoints do not store; called
            once for each module that registers one, after its host memory exists and before
            anything is read. Required when there are such buffers.
        options: the other arguments of ``OffloadModel`` (``num_slices``, ``compute_dtype``, ...),
            but ``process_group``: ranks would exchange values before they are read.

    Returns:
        The ``OffloadModel``, its parameters filled from the checkpoint.

    Raises:
        ValueError: a parameter or persistent buffer missing from the checkpoint, a stored tensor
            that names none, a shape that differs (each names the key and file), a tied weight
            stored under two names with different values (both named), non-persistent buffers
            without ``init_buffers``, or ``process_group`` among ``options``.
        FileNotFoundError: no safetensors checkpoint at ``checkpoint``.

    Example::

        def build():
            return nn.Sequential(*(nn.Linear(4096, 4096) for _ in range(32)))

        model = offload.load_sequential(build, "weights.safetensors", device="cuda", num_slices=8)
    """
    with torch.device("meta"):
        layers = build()
    return build_from_checkpoint(layers, SafetensorsCheckpoint(checkpoint), device, dtype=dtype,
                                 init_buffers=init_buffers, untie_differing_copies=False, **options)


def build_from_checkpoint(
    layers: nn.Sequential,
    checkpoint: SafetensorsCheckpoint,
    device: torch.device | str | int,
    *,
    dtype: torch.dtype | None = None,
    init_buffers: Callable[[nn.Module], None] | None = None,
    place: Callable[[str], Placement | None] | None = None,
    untie_differing_copies: bool = True,
    **options: Any,
) -> OffloadModel:
    """:func:`load_sequential` on layers already built on the meta device, with ``place`` saying
    where each stored tensor goes (``None``: nowhere, it is skipped); by default the stored name is
    the ``state_dict`` key.

    ``untie_differing_copies``: a tied tensor stored under several names with different values
    gives each such name a tensor of its own, holding its stored values, with a warning, as
    ``from_pretrained`` does for a tied model's head (the default, for ``load_causal_lm``), or is
    refused (``False``, for :func:`load_sequential`). Equal copies stay one tensor either way."""
    if "process_group" in options:
        raise ValueError("load_sequential builds a single-process model: load it on every rank without a "
                         "process_group (each reads the same checkpoint)")
    if dtype is not None:
        layers.to(dtype)  # on the meta device: only the dtypes change
    plan = _Plan(layers, checkpoint, place or Placement)
    if plan.buffer_owners and init_buffers is None:
        names = [f"'{name}'" for name in sorted(plan.non_persistent)]
        raise ValueError(f"the model has non-persistent buffers, which checkpoints do not store ({_listed(names)}); "
                         "pass init_buffers=fn, called with each module that registers one, to compute them")
    plan.settle_ties(layers, untie=untie_differing_copies)
    with filled_by_caller():
        model = OffloadModel(layers, device, **options)
    # A read that fails (a missing shard, a full disk for the masters) gives back what the build
    # took: the caller holding the error holds no host buffer or file (Note: [A build that raises]).
    with given_back_on_failure(model._engine.slices):
        plan.compute_buffers(init_buffers)
        plan.read(model)
    return model


class _Plan:
    """Which stored tensors fill which of the layers' tensors, checked against the layers before
    anything is allocated."""

    def __init__(self, layers: nn.Module, checkpoint: SafetensorsCheckpoint,
                 place: Callable[[str], Placement | None]) -> None:
        self.checkpoint = checkpoint
        #: state_dict key -> parameter or persistent buffer (every name of a tied tensor)
        self.targets: dict[str, torch.Tensor] = {}
        #: state_dict-style key -> non-persistent buffer: not stored, computed by init_buffers
        self.non_persistent: dict[str, torch.Tensor] = {}
        #: the modules that register non-persistent buffers, each once
        self.buffer_owners: list[nn.Module] = []
        #: id of a target -> the stored tensors that fill it, and where
        self.sources: dict[int, list[tuple[str, Placement]]] = {}
        #: ids of the targets a stored tensor of the wrong shape was meant for: told once, as misshapen
        self.misshapen: set[int] = set()
        #: the tied tensors stored whole under several names, their copies compared by settle_ties
        self.tied_copies: list[_TiedCopies] = []
        self._collect(layers)
        problems = [*self._match(place), *self._coverage()]
        if problems:
            raise ValueError(f"the checkpoint at {checkpoint.path} does not match the model; " + "; ".join(problems))

    def _collect(self, layers: nn.Module) -> None:
        for prefix, module in layers.named_modules(remove_duplicate=False):
            dot = f"{prefix}." if prefix else ""
            for name, param in module._parameters.items():
                if param is not None:
                    self.targets[dot + name] = param
            owns = False
            for name, buffer in module._buffers.items():
                if buffer is None:
                    continue
                if name in module._non_persistent_buffers_set:
                    self.non_persistent[dot + name] = buffer
                    owns = True
                else:
                    self.targets[dot + name] = buffer
            if owns and all(module is not m for m in self.buffer_owners):
                self.buffer_owners.append(module)

    def _match(self, place: Callable[[str], Placement | None]) -> list[str]:
        """Give each stored tensor its target; describe what does not fit."""
        unexpected: list[str] = []
        mismatched: list[str] = []
        for stored_name, stored in self.checkpoint.tensors.items():
            placement = place(stored_name)
            if placement is None or placement.key in self.non_persistent:
                continue  # computed, not read (old checkpoints store rotary frequencies)
            target = self.targets.get(placement.key)
            if target is None:
                unexpected.append(f"'{stored_name}' ({stored.file.name})")
                continue
            try:
                region = placement.region(_shaped_like(target))
            except (IndexError, RuntimeError):  # a part outside the tensor (an expert too many)
                region = None
            if region is None or region.shape != stored.shape:
                self.misshapen.add(id(target))
                mismatched.append(f"'{stored_name}' in {stored.file.name} has shape {tuple(stored.shape)}, the model's "
                                  f"'{placement.key}'{'' if placement.part is None else ' (its part)'} is "
                                  f"{'outside it' if region is None else tuple(region.shape)}")
                continue
            self.sources.setdefault(id(target), []).append((stored_name, placement))
        self._one_copy_per_tie()
        problems = []
        if unexpected:
            problems.append(f"stored but not in the model: {_listed(unexpected)}")
        if mismatched:
            problems.append(f"shapes differ: {_listed(mismatched)}")
        return problems

    def _one_copy_per_tie(self) -> None:
        """A tied tensor stored whole under several of its names (a ``state_dict()`` saved as it
        is lists it under each; Hugging Face checkpoints of tied models may hold the head's copy
        too) is read from its first name in the layers, as ``from_pretrained`` ties the head to
        the embedding, or else from the first stored; the other copies wait in ``tied_copies``
        for :meth:`settle_ties` to compare them with it."""
        names: dict[int, list[str]] = {}
        for key, tensor in self.targets.items():
            names.setdefault(id(tensor), []).append(key)
        for target_id, sources in self.sources.items():
            whole = [source for source in sources if source[1].part is None]
            if len(whole) < 2 or len(names[target_id]) < 2:
                continue  # not tied: two stored tensors for one is an error, told by _coverage
            kept = next((source for source in whole if source[1].key == names[target_id][0]), whole[0])
            self.sources[target_id] = [source for source in sources if source[1].part is not None or source is kept]
            others = [source for source in whole if source is not kept]
            self.tied_copies.append(_TiedCopies(self.targets[names[target_id][0]], kept, others))

    def settle_ties(self, layers: nn.Module, untie: bool) -> None:
        """Compare each tied tensor's other stored copies with the one it is read from (Note:
        [Loading slice by slice], 2). An equal copy is not read. One with other values gets a
        tensor of its own where ``untie``, before the slices are laid out; otherwise it is refused.

        Raises:
            ValueError: copies with different values, without ``untie``; or with ``untie``, names
                that share a module (registered twice), which no tensor of its own can part.
        """
        differing: list[str] = []
        for tie in self.tied_copies:
            read_name, read = tie.read
            for stored_name, placement in tie.others:
                if self.checkpoint.same_values(read_name, stored_name, tie.tensor.dtype):
                    continue
                pair = (f"'{stored_name}' ({self.checkpoint[stored_name].file.name}) and '{read_name}' "
                        f"({self.checkpoint[read_name].file.name})")
                if not untie or not self._untie(layers, placement.key, read.key):
                    differing.append(pair)
                    continue
                self.sources[id(self.targets[placement.key])] = [(stored_name, placement)]
                warnings.warn(f"the checkpoint stores {pair}, which the model ties ('{placement.key}' to "
                              f"'{read.key}'), with different values, so they are not tied: each holds its stored "
                              "values, as from_pretrained does. Save the config with tie_word_embeddings=False to say "
                              "so and silence this warning", stacklevel=4)  # load_causal_lm's caller
        if differing:
            raise ValueError(f"the checkpoint at {self.checkpoint.path} stores tied tensors under several names with "
                             f"different values, and reading one copy would drop the other: {_listed(differing)}; "
                             "store only the copy the tied tensor should hold, or untie the tensors in build() to "
                             "read each")

    def _untie(self, layers: nn.Module, key: str, kept_key: str) -> bool:
        """Give ``key`` a meta tensor of its own in place of the tied one, which ``kept_key`` keeps;
        ``False`` when the two names are one module's (registered twice) and cannot be parted."""
        owner_name, _, leaf = key.rpartition(".")
        kept_owner, _, kept_leaf = kept_key.rpartition(".")
        owner = layers.get_submodule(owner_name)
        if owner is layers.get_submodule(kept_owner) and leaf == kept_leaf:
            return False
        tied = self.targets[key]
        if leaf in owner._parameters:
            # A frozen tensor (a base under adapters) stays frozen in both places.
            own = nn.Parameter(torch.empty_like(tied), requires_grad=tied.requires_grad)
            owner._parameters[leaf] = own
        else:
            own = torch.empty_like(tied)
            owner._buffers[leaf] = own
        self.targets[key] = own
        return True

    def _coverage(self) -> list[str]:
        """Check that the stored tensors fill every target exactly once (a tied one under any name)."""
        names: dict[int, list[str]] = {}
        for key, tensor in self.targets.items():
            names.setdefault(id(tensor), []).append(f"'{key}'")
        missing: list[str] = []
        partial: list[str] = []
        for key, tensor in self.targets.items():
            if names[id(tensor)][0] != f"'{key}'" or id(tensor) in self.misshapen:
                continue  # a tied tensor's other name, or one already told under "shapes differ"
            sources = self.sources.get(id(tensor), [])
            values = _shaped_like(tensor).numel()
            covered = sum(p.region(_shaped_like(tensor)).numel() for _, p in sources)
            if covered == 0 and values > 0:
                missing.append(" or ".join(names[id(tensor)]))
            elif covered != values:
                partial.append(f"'{key}' gets {covered} of its {values} values, from {len(sources)} stored "
                               f"tensors ({_listed([repr(name) for name, _ in sources])})")
        problems = []
        if missing:
            problems.append(f"missing from the checkpoint: {_listed(missing)}")
        if partial:
            problems.append(f"filled in part: {_listed(partial)}")
        return problems

    def compute_buffers(self, init_buffers: Callable[[nn.Module], None] | None) -> None:
        """Run ``init_buffers`` on each module with non-persistent buffers, and check that it set
        every floating-point one (they start as NaN: fresh host memory holds whatever was there)."""
        if init_buffers is None:
            return
        with torch.no_grad():
            for buffer in self.non_persistent.values():
                buffer.fill_(float("nan") if buffer.is_floating_point() else 0)
            for module in self.buffer_owners:
                init_buffers(module)
            unset = [f"'{name}'" for name, buffer in self.non_persistent.items()
                     if buffer.is_floating_point() and bool(buffer.isnan().any())]
        if unset:
            raise ValueError(f"init_buffers left non-persistent buffers unset (NaN): {_listed(unset)}")

    def read(self, model: OffloadModel) -> None:
        """Read every stored tensor into its host copy, slice after slice."""
        done: set[int] = set()
        with torch.no_grad():
            for k, names in enumerate(model.partition):
                for name in names:
                    for tensor in _tensors(model._modules[name]):
                        if id(tensor) in done:
                            continue
                        done.add(id(tensor))
                        for stored_name, placement in self.sources.get(id(tensor), ()):
                            if is_4bit_weight(tensor):  # Note: [Quantizing while loading]
                                read_quantized(self.checkpoint, stored_name, tensor)
                            else:
                                self.checkpoint.read_into(stored_name, placement.region(tensor.detach()))
                # Masters on disk go there now, a slice at a time (Note: [Masters on disk]).
                engine_of(model).slices[k].storage.release_masters()


@dataclass
class _TiedCopies:
    """A tied tensor stored whole under several of its names: the stored copy it is read from, and
    the others, as ``(stored name, placement)``."""

    tensor: torch.Tensor
    read: tuple[str, Placement]
    others: list[tuple[str, Placement]]


def _shaped_like(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor of the shape ``tensor`` is stored in (a 4-bit weight's before quantisation)."""
    return torch.empty(unquantized_shape(tensor), device="meta")


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:_LISTED])
    return shown if len(items) <= _LISTED else f"{shown} and {len(items) - _LISTED} more"
