"""A slice's tensors taken into the memory its build made, and given back when the build raises.

What this file holds: the move of each held tensor into its place in a slice's host buffer
(:func:`take_in`; a tensor on the meta device takes its memory unwritten there, for a loader that
fills it: :func:`filled_by_caller`, :func:`adopt_meta`), and the undo of a build that raises
(Note: [A build that raises]): where the tensors were before (:func:`origins_of`), each given
memory of its own there again and the space of the build's files given back (:func:`give_back`),
and a model's slices given back when its build raises (:func:`given_back_on_failure`). What it
does not: lay the slice out or decide what it holds (``SliceStorage`` in ``host_storage.py``,
whose ``build`` calls these), or the files (``mapped.py``).

Note: [A build that raises]
    A slice's build points each tensor it holds into memory the model made: the slice's host
    buffer (pinned memory; with masters on disk, a mapping of an unlinked file) or, for a resident
    slice, device memory. The layers' parameters are the same Python objects, so a build that
    raises part way (the disk full at a later slice's masters or gradients, no memory for a
    shadow or the device slots, an interrupt) would leave them there: views of a buffer that
    nothing else uses any more, page-locked RAM, or a mapping that keeps the disk space the error
    asks to free (the file is unlinked: ``df`` cannot say where it went) and that training the
    layers plainly afterwards reads and writes (an I/O error there is a ``SIGBUS``). So:

    1. before a build moves anything, it records each held tensor's device and address
       (:func:`given_back_if_raising`);
    2. a build that raises gives back what it moved (:func:`give_back`): each tensor whose
       device or address changed gets memory of its own on its device of before, with its values
       (masters on disk are read in first, so that a read error is an error, not a ``SIGBUS``),
       and one that came from the meta device goes back there, its memory never written. Tensors
       not moved yet and substitutes (which keep their memory) are left alone;
    3. then the files that build made give their blocks back at once
       (``MappedFile.give_space_back``), whoever still refers to the mapping (the exception's
       traceback holds the frames that made it, for as long as the caller keeps the exception),
       and the slice drops what the build made for what it held before: its RAM goes with the
       last reference;
    4. a model whose build raises after some slices were built (at a later slice, at the device
       slots, a warning turned into an error) gives back every slice built so far
       (:func:`given_back_on_failure`, around the slices' build in ``Engine.__init__``).

    The cost is a copy of each tensor moved, on failure only. Making every file before moving
    any tensor would catch a full disk, but neither the other failures nor an interrupt. A failed
    layout of a built model (a refresh) gives back the slice it was laying out, and only that
    one: the others stay laid out, and the next forward lays that slice out again
    (``SliceStorage.moved``). ``tests/test_failed_build.py`` fails builds at each of their files
    and allocations.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .flat_views import empty_in_layout, flat_exporter, own_storage_view
from .quantized import is_8bit_weight, settle_8bit_layer
from .slice_entries import Entry

#: True while a loader builds slices whose tensors are on the meta device (see
#: :func:`filled_by_caller`).
_FILLED_BY_CALLER = contextvars.ContextVar("offload_host_copies_filled_by_caller", default=False)


@contextlib.contextmanager
def filled_by_caller() -> Iterator[None]:
    """Within this block, a slice's tensors on the meta device get host copies that are laid out
    and allocated but not written: the caller fills them (``offload/loading/sequential.py`` reads them from a
    checkpoint). The tensors stay the same Python objects, now holding host memory, so tied
    weights stay tied. Outside it a meta tensor is refused: it has no values to copy."""
    token = _FILLED_BY_CALLER.set(True)
    try:
        yield
    finally:
        _FILLED_BY_CALLER.reset(token)


def adopt_meta(entry: Entry, host: torch.Tensor) -> None:
    """Give ``entry``'s tensor, on the meta device, the memory of ``host`` (laid out, not written:
    the caller of :func:`filled_by_caller` fills it); outside that block, refuse it.

    A meta tensor cannot take host memory through ``.data`` (another tensor type): the whole tensor
    is swapped instead (:func:`swap_memory`).
    """
    if not _FILLED_BY_CALLER.get():
        raise ValueError(
            f"'{entry.sites[0].name}' of {type(entry.sites[0].module).__name__} is on the meta device and has no "
            "values to copy; build the model on real memory, or load it from a checkpoint with "
            "offload.load_sequential (offload.integrations.transformers.load_causal_lm for Hugging Face models)"
        )
    swap_memory(entry.tensor, host)


def swap_memory(tensor: torch.Tensor, memory: torch.Tensor) -> None:
    """Give ``tensor`` the memory ``memory`` where ``.data`` cannot (from or to the meta device, a
    tensor type of its own): the whole tensor is swapped, keeping the Python object, its class and
    its attributes, so tied weights stay tied."""
    if isinstance(tensor, nn.Parameter):
        # Of the parameter's own class: a bitsandbytes Params4bit stays one (Note: [Quantized weights]).
        memory = torch.Tensor._make_subclass(type(tensor), memory, tensor.requires_grad)
    else:
        # Not a view: the swap would make the tensor one, and a later layout's ``.data`` keeps a
        # view's base, which holds this memory alive beside the new one (the quantisation
        # state's tensors and the buffers of every slice laid out again).
        memory = memory.detach().requires_grad_(tensor.requires_grad)
    memory.__dict__.update(tensor.__dict__)
    torch.utils.swap_tensors(tensor, memory)


def _is_substitute(entry: Entry, host_device: torch.device) -> bool:
    """Whether ``entry`` is a tensor put in a parameter's place for one call, which the layout
    copies but does not take in (Note: [Tensors substituted for a call]): a plain tensor, not an
    ``nn.Parameter``, on the host."""
    tensor = entry.tensor
    return entry.is_parameter and not isinstance(tensor, nn.Parameter) and tensor.device == host_device


def take_in(held: Sequence[Entry], flat: torch.Tensor) -> list[tuple[Entry, torch.Tensor]]:
    """Copy each of ``held`` into its place in the host buffer ``flat``, under a storage of its own,
    and point the tensor's ``.data`` there; a tensor on the meta device takes that memory unwritten
    (:func:`adopt_meta`). Returns the substitutes, copied and left as they are, each with its host
    copy (Note: [Tensors substituted for a call])."""
    exporter = flat_exporter(flat)
    substitutes = []
    for entry in held:
        host = own_storage_view(exporter, entry.host_offset, entry.dtype, entry.shape, entry.stride)
        if entry.tensor.is_meta:
            adopt_meta(entry, host)
            continue
        host.copy_(entry.tensor.detach())
        if _is_substitute(entry, host.device):
            substitutes.append((entry, host))
        else:
            # Same object, new storage: optimizers and user references keep working.
            entry.tensor.data = host
    return substitutes


#: Where a tensor was: its device, and the address of its memory.
Origin = tuple[torch.device, int]


def origins_of(entries: Sequence[Entry]) -> list[Origin]:
    """Where each tensor of ``entries`` is now (Note: [A build that raises], rule 1)."""
    return [(entry.tensor.device, entry.tensor.data_ptr()) for entry in entries]


def give_back_tensors(entries: Sequence[Entry], origins: Sequence[Origin]) -> None:
    """Give each tensor of ``entries`` that left its place in ``origins`` memory of its own there
    again, with its values; a meta one goes back to the meta device (Note: [A build that raises],
    rule 2). An 8-bit layer settled over the memory it left is settled over the new one."""
    moved_from = set()
    for entry, (device, address) in zip(entries, origins):
        tensor = entry.tensor
        if tensor.device == device and tensor.data_ptr() == address:
            continue  # not moved yet, or a substitute
        moved_from.add(tensor.data_ptr())
        with torch.inference_mode(False):  # training code updates it in place later
            memory = empty_in_layout(entry.shape, entry.stride, entry.dtype, device)
        if device.type == "meta":
            swap_memory(tensor, memory)
            continue
        with torch.no_grad():
            memory.copy_(tensor.detach())
        tensor.data = memory
    for entry in entries:
        if entry.companions and is_8bit_weight(entry.tensor):
            for site in entry.sites:
                codes = getattr(getattr(site.module, "state", None), "CB", None)
                if codes is not None and codes.data_ptr() in moved_from:
                    settle_8bit_layer(site.module, entry.tensor, entry.companions[0].tensor)


#: What a slice holds its memory in, which a build replaces: the host buffer, the masters' file, the
#: gradients' home and the shadow (``SliceStorage`` attributes).
_MEMORY = ("flat", "masters_file", "gradient_home", "shadow")


@contextlib.contextmanager
def given_back_if_raising(storage: Any) -> Iterator[None]:
    """Around the move of a slice's held tensors into the memory its build makes
    (``SliceStorage.build``): record where each is now (``storage.origins``, rule 1 of Note: [A
    build that raises]), and if the block raises, :func:`give_back` what it moved and made,
    keeping the memory the slice held before (a built model's, laid out again)."""
    storage.origins = origins_of(storage.held)
    before = tuple(getattr(storage, name, None) for name in _MEMORY)
    try:
        yield
    except BaseException:
        give_back(storage, before)
        raise


def give_back(storage: Any, before: Sequence[Any] = (None,) * len(_MEMORY)) -> None:
    """Undo the last build of ``storage`` (a ``SliceStorage``; Note: [A build that raises], rules
    2 and 3): each tensor it moved gets memory of its own again, where it was, with its values;
    the files the build made give their space back, and the slice holds the memory ``before``
    (in the order of :data:`_MEMORY`) instead of what it made.

    Raises:
        OSError: masters on disk could not be read in, naming the file; their tensors stay there.
    """
    kept = dict(zip(_MEMORY, before))
    masters_file, home = (getattr(storage, name, None) for name in ("masters_file", "gradient_home"))
    masters_file = None if masters_file is kept["masters_file"] else masters_file
    home = None if home is kept["gradient_home"] else home
    if masters_file is not None:
        masters_file.read_in(write=False)  # a read error is an error here, not a SIGBUS in the copies
    give_back_tensors(storage.held, storage.origins)
    for file in (masters_file, None if home is None else home.file):
        if file is not None:
            file.give_space_back()
    for name, memory in kept.items():
        setattr(storage, name, memory)
    storage.substitutes = ()  # their host copies lie in the buffer the build made


@contextlib.contextmanager
def given_back_on_failure(slices: Sequence[Any]) -> Iterator[None]:
    """Around a model's build: if it raises, each of ``slices`` built so far (each with its
    ``storage``) gives back what its build moved and made, the last first (Note: [A build that
    raises], rule 4). The exception is raised on as it was."""
    try:
        yield
    except BaseException:
        for built in reversed(slices):
            give_back(built.storage)
        raise
