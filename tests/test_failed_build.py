"""A build of ``OffloadModel`` that raises part way leaves the user's layers as they were: every
parameter and buffer in memory of its own, with its values, none of it in a host buffer or file
mapping the build made, the files' disk space given back, and the layers training as a fresh
model's do (Note: [A build that raises] in offload/streams/take_in.py)."""

from __future__ import annotations

import errno
import gc
import os
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from offload import DiskTier, DiskTierError, OffloadModel
from offload.streams import mapped, take_in
from offload.streams.copies import CopyStreams
from offload.walk import engine

from .helpers import DEVICES

BF16 = torch.bfloat16
#: Each slice of :func:`layers` in three has a masters' file and a gradients' file on disk.
FILES = 6


def layers(seed: int = 0) -> nn.Sequential:
    """Three slices' worth, each with a Linear (so each casts, and with masters on disk has files);
    the first with a BatchNorm's buffers."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def tensors_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict([*model.named_parameters(), *model.named_buffers()])


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in tensors_of(model).items()}


class Made(list):
    """The (address, bytes) of each host buffer and file mapping builds make: :attr:`buffers` keeps
    the host buffers alive, so that no later allocation takes their addresses; a mapping that is
    gone (:func:`mappings_in`) is checked so."""

    buffers: list[torch.Tensor]
    files: int = 0


def made_by_the_build(monkeypatch) -> Made:
    """What builds make from now on (:class:`Made`)."""
    made = Made()
    made.buffers = []
    empty_host, init = CopyStreams.empty_host, mapped.MappedFile.__init__

    def recorded_empty_host(self, nbytes, host_device):
        buffer = empty_host(self, nbytes, host_device)
        made.append((buffer.data_ptr(), nbytes))
        made.buffers.append(buffer)
        return buffer

    def recorded_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append((self.address, self.nbytes))
        made.files += 1

    monkeypatch.setattr(CopyStreams, "empty_host", recorded_empty_host)
    monkeypatch.setattr(mapped.MappedFile, "__init__", recorded_init)
    return made


def failing_at(monkeypatch, owner, name: str, k: int, error: Callable[[], BaseException]) -> None:
    """``owner.name`` raising ``error()`` at its ``k``-th call (from 0), as itself otherwise. A new
    exception: one kept here would keep its traceback, and the build's frames, alive."""
    real = getattr(owner, name)
    calls = []

    def call(*args, **kwargs):
        calls.append(1)
        if len(calls) == k + 1:
            raise error()
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, call)


def assert_as_they_were(model: nn.Module, before: dict[str, torch.Tensor], made: Made) -> None:
    """Every parameter and buffer of ``model`` holds its values ``before`` in memory of its own on
    its device of before, in none of the memory ``made``, and not pinned."""
    tensors = tensors_of(model)
    assert tensors.keys() == before.keys()
    starts = set()
    for name, tensor in tensors.items():
        assert type(tensor) is (nn.Parameter if name in dict(model.named_parameters()) else torch.Tensor)
        assert tensor.device == before[name].device and not tensor.is_pinned(), name
        storage = tensor.untyped_storage()
        assert not any(address <= storage.data_ptr() < address + nbytes for address, nbytes in made), name
        assert storage.nbytes() == tensor.numel() * tensor.element_size(), name
        starts.add(storage.data_ptr())
        assert torch.equal(tensor, before[name]), name
    assert len(starts) == len(tensors)


def mappings_in(directory) -> list[str]:
    """The lines of this process's memory map of files in ``directory`` (deleted ones too)."""
    with open("/proc/self/maps") as maps:
        return [line for line in maps if str(directory) in line]


def blocks_held_in(directory) -> int | None:
    """The disk blocks of the files in ``directory`` that this process holds open (unlinked ones
    too), or ``None`` when it holds none."""
    held = None
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory)):
                held = (held or 0) + os.stat(f"/proc/self/fd/{fd}").st_blocks
        except OSError:  # the listing's own descriptor, closed since
            continue
    return held


def assert_trains_as_a_fresh_model(model: nn.Module) -> None:
    """A plain step on ``model`` (training mode: the BatchNorm's statistics move too) gives what
    it gives on a fresh :func:`layers`."""
    fresh = layers()
    for net in (model, fresh):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
        net(x).square().mean().backward()
        optimizer.step()
    for name, tensor in tensors_of(fresh).items():
        assert torch.equal(tensors_of(model)[name], tensor), name


@pytest.mark.parametrize("k", range(FILES))
def test_a_full_disk_at_any_file_of_the_build_leaves_the_layers_as_they_were(k, tmp_path, monkeypatch):
    made = made_by_the_build(monkeypatch)
    failing_at(monkeypatch, mapped.os, "posix_fallocate", k, lambda: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    model = layers()
    before = snapshot(model)
    with pytest.raises(DiskTierError, match="No space left on device") as raised:
        OffloadModel(model, device="cpu", num_slices=3, compute_dtype=BF16, masters=DiskTier(tmp_path))
    assert made.files == k  # the files made before the one that failed
    # While the exception (and the frames of the build in its traceback) is still held.
    assert_as_they_were(model, before, made)
    assert mappings_in(tmp_path) == [] and blocks_held_in(tmp_path) is None
    del raised
    assert_trains_as_a_fresh_model(model)


@pytest.mark.parametrize("k", range(6))
def test_no_host_memory_part_way_leaves_the_layers_as_they_were(k, monkeypatch):
    """Masters in RAM: each slice's host buffer, then its shadow, and the k-th cannot be had."""
    made = made_by_the_build(monkeypatch)
    failing_at(monkeypatch, CopyStreams, "empty_host", k, lambda: RuntimeError("out of memory (simulated)"))
    model = layers()
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="simulated"):
        OffloadModel(model, device="cpu", num_slices=3, compute_dtype=BF16)
    assert len(made) == k and made.files == 0
    assert_as_they_were(model, before, made)
    assert_trains_as_a_fresh_model(model)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("resident_slices", [0, 1])
@pytest.mark.parametrize("on_disk", [False, True], ids=["masters-in-ram", "masters-on-disk"])
def test_a_failure_after_every_slice_was_built_gives_them_all_back(on_disk, resident_slices, device, tmp_path,
                                                                   monkeypatch):
    """The device slots cannot be had (on CUDA the host buffers are pinned: given back, the
    layers' tensors are not; a resident slice's come back from the device)."""
    made = made_by_the_build(monkeypatch)
    monkeypatch.setattr(engine, "DeviceSlots", failing_slots)
    model = layers()
    before = snapshot(model)
    with pytest.raises(torch.OutOfMemoryError, match="simulated") as raised:
        OffloadModel(model, device=device, num_slices=3, compute_dtype=BF16, resident_slices=resident_slices,
                     masters=DiskTier(tmp_path) if on_disk else None)
    # Every slice was built: its host buffer or masters' file, and its shadow (and gradients' file).
    assert len(made) == (3 - resident_slices) * (3 if on_disk else 2)
    assert_as_they_were(model, before, made)
    assert mappings_in(tmp_path) == [] and blocks_held_in(tmp_path) is None
    del raised
    assert_trains_as_a_fresh_model(model)


def test_ranks_that_refuse_the_model_give_its_layers_back(monkeypatch):
    """Data parallelism is set up after the slices are built: ranks whose models differ raise
    there, and the layers come back as from any other failure."""
    import offload.model
    made = made_by_the_build(monkeypatch)

    def disagreeing(*args, **kwargs):
        raise RuntimeError("ranks whose models differ (simulated)")

    monkeypatch.setattr(offload.model, "DataParallel", disagreeing)
    model = layers()
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="simulated"):
        OffloadModel(model, device="cpu", num_slices=3, process_group=object())
    assert len(made) == 3
    assert_as_they_were(model, before, made)
    assert_trains_as_a_fresh_model(model)


def test_a_loader_whose_read_fails_gives_back_the_space_its_build_took(tmp_path, monkeypatch):
    """load_sequential builds the slices, then reads the checkpoint into them: a read that fails
    (a shard missing or unreadable) gives the masters' files back while the caller holds the error."""
    import offload
    from safetensors.torch import save_file
    from offload.loading import sequential
    save_file(layers().state_dict(), str(tmp_path / "weights.safetensors"))

    def failing_read(self, model):
        raise OSError(errno.EIO, "Input/output error (simulated)")

    monkeypatch.setattr(sequential._Plan, "read", failing_read)
    masters = tmp_path / "masters"
    with pytest.raises(OSError, match="simulated") as raised:
        offload.load_sequential(layers, tmp_path / "weights.safetensors", "cpu", num_slices=3, compute_dtype=BF16,
                                masters=DiskTier(masters))
    assert blocks_held_in(masters) in (None, 0)
    del raised
    gc.collect()
    assert mappings_in(masters) == [] and blocks_held_in(masters) is None


def failing_slots(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory (simulated) for the device slots")


def test_an_interrupt_while_a_slice_takes_its_tensors_in_gives_the_space_back_at_once(tmp_path, monkeypatch):
    """The interrupt lands in the middle of the second slice's moves: its traceback holds the
    mapping they were moving into, whose blocks are given back all the same."""
    made = made_by_the_build(monkeypatch)
    # Slice 0 holds a Linear's weight and bias and a BatchNorm's four tensors: 7 is the second
    # slice's second tensor.
    failing_at(monkeypatch, take_in, "own_storage_view", 7, KeyboardInterrupt)
    model = layers()
    before = snapshot(model)
    with pytest.raises(KeyboardInterrupt) as raised:
        OffloadModel(model, device="cpu", num_slices=3, compute_dtype=BF16, masters=DiskTier(tmp_path))
    assert_as_they_were(model, before, made)
    assert model[3].weight.untyped_storage().data_ptr() != before["3.weight"].untyped_storage().data_ptr()
    assert mappings_in(tmp_path) != [] and blocks_held_in(tmp_path) == 0
    del raised
    gc.collect()
    assert mappings_in(tmp_path) == [] and blocks_held_in(tmp_path) is None
    assert_trains_as_a_fresh_model(model)


def test_a_model_on_the_meta_device_for_a_loader_goes_back_there(monkeypatch):
    """Under ``filled_by_caller`` (a loader builds the slices, then fills them): what had taken
    host memory goes back to the meta device, the same Python objects, a parameter still one."""
    with torch.device("meta"):
        model = layers()
    objects = {name: (tensor, type(tensor), tensor.requires_grad) for name, tensor in tensors_of(model).items()}
    failing_at(monkeypatch, CopyStreams, "empty_host", 4, lambda: RuntimeError("out of memory (simulated)"))
    with take_in.filled_by_caller(), pytest.raises(RuntimeError, match="simulated"):
        OffloadModel(model, device="cpu", num_slices=3, compute_dtype=BF16)
    for name, tensor in tensors_of(model).items():
        assert tensor.is_meta, name
        assert (tensor, type(tensor), tensor.requires_grad) == objects[name]


def test_an_8bit_layer_computes_over_the_memory_its_weight_gets_back(monkeypatch):
    """A ``Linear8bitLt`` computes with ``state.CB`` over its weight's codes (Note: [Quantized
    weights], rule 6): given back, the state follows the weight out of the host buffer."""
    with warnings.catch_warnings():  # its optional CPU kernels ("pip install kernels") are not needed
        warnings.simplefilter("ignore")
        bnb = pytest.importorskip("bitsandbytes")

    def eight_bit() -> nn.Sequential:
        torch.manual_seed(0)
        linear, quantized = nn.Linear(16, 16), bnb.nn.Linear8bitLt(16, 16, has_fp16_weights=False, threshold=0.0)
        quantized.load_state_dict(linear.state_dict())
        return nn.Sequential(nn.Linear(6, 16), quantized.to("cpu"), nn.Tanh(), nn.Linear(16, 3))

    made = made_by_the_build(monkeypatch)
    failing_at(monkeypatch, CopyStreams, "empty_host", 3, lambda: RuntimeError("out of memory (simulated)"))
    model = eight_bit()
    with pytest.raises(RuntimeError, match="simulated"):
        OffloadModel(model, device="cpu", num_slices=2, compute_dtype=BF16)
    assert model[1].state.CB.data_ptr() == model[1].weight.data_ptr()
    assert not any(address <= model[1].weight.data_ptr() < address + nbytes for address, nbytes in made)
    x = torch.randn(4, 6)
    with torch.no_grad():
        assert torch.equal(model(x), eight_bit()(x))
