"""Saving an offloaded model with the libraries people save models with keeps every tensor.

Libraries that write a state dict take tensors sharing a storage for tied ones: safetensors refuses
them, Accelerate keeps one per storage and drops the rest. Every host copy has a storage of its own
over its slice's flat buffer (Note: [A storage per host copy] in
``offload/streams/host_storage.py``), so an offloaded model saves and loads as the plain one does.
Here: the storages themselves (own, aliasing, alive as long as a tensor is), Python's and
PyTorch's copies and saves, and safetensors, each compared bit for bit with the plain model, and
the host memory a save takes. Accelerate: ``tests/test_accelerate.py``.
"""

from __future__ import annotations

import copy
import gc
import io
import json
import os
import pickle
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from offload import DiskTier, OffloadModel, load_sequential
from offload.streams.mapped import mapping_supported

from .helpers import CUDA
from .stream_scenarios import Unembed
from .test_tied import Embed

safetensors_torch = pytest.importorskip("safetensors.torch", reason='safetensors is not installed: pip install -e ".[test]"')

EXACT = {"rtol": 0.0, "atol": 0.0}
BF16 = torch.bfloat16
ROOT = Path(__file__).resolve().parents[1]


def layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 16), nn.BatchNorm1d(16),
                         nn.Linear(16, 4))


def tied_layers() -> nn.Sequential:
    torch.manual_seed(0)
    table = nn.Embedding(13, 8)
    return nn.Sequential(Embed(table), nn.Linear(8, 8), nn.Tanh(), Unembed(table))


#: The ways host copies are laid out: in RAM, with a bfloat16 shadow, with the masters in a mapped file.
SETTINGS = ["ram", "compute_dtype", pytest.param("masters_on_disk", marks=pytest.mark.skipif(
    not mapping_supported(), reason="masters on disk need Linux 5.14 or later (MADV_POPULATE_WRITE)"))]


def offloaded(plain: nn.Module, setting: str, tmp_path: Path, device: str = "cpu") -> OffloadModel:
    options = {"ram": {}, "compute_dtype": {"compute_dtype": BF16},
               "masters_on_disk": {"compute_dtype": BF16, "masters": DiskTier(tmp_path / "masters")}}[setting]
    tmp_path.mkdir(parents=True, exist_ok=True)  # DiskTier makes the last level of its directory only
    return OffloadModel(copy.deepcopy(plain), device=device, num_slices=3, **options)


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        torch.testing.assert_close(got[name], value, msg=lambda m: f"{name}: {m}", **EXACT)


def stored(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


# -- the storages -----------------------------------------------------------------------------------


@pytest.mark.parametrize("setting", SETTINGS)
def test_every_host_copy_has_a_storage_of_its_own_in_its_slices_buffer(setting, tmp_path):
    model = offloaded(layers(), setting, tmp_path)
    for s in model._engine.slices:
        flat = s.storage.flat
        for entry in s.storage.held:
            tensor = entry.tensor
            # Its own storage: from its first byte, its bytes only ...
            assert stored(tensor) == (tensor.data_ptr(), tensor.numel() * tensor.element_size())
            # ... over the slice's buffer, where a load reads it (no second copy).
            assert tensor.data_ptr() == flat.data_ptr() + entry.host_offset
    assert model.memory_footprint().host_masters <= sum(s.storage.host_nbytes for s in model._engine.slices)
    if setting != "masters_on_disk":  # their pages in RAM, none between steps
        assert model.memory_footprint().host_masters == sum(s.storage.host_nbytes for s in model._engine.slices)


def test_a_model_loaded_from_the_meta_device_has_storages_of_its_own(tmp_path):
    plain = layers()
    safetensors_torch.save_file(plain.state_dict(), tmp_path / "weights.safetensors")
    model = load_sequential(layers, tmp_path / "weights.safetensors", "cpu", num_slices=3)
    for tensor in model.state_dict().values():
        assert stored(tensor) == (tensor.data_ptr(), tensor.nbytes)
    safetensors_torch.save_file(model.state_dict(), tmp_path / "again.safetensors")
    assert_same_state(safetensors_torch.load_file(tmp_path / "again.safetensors"), plain.state_dict())


def test_tensors_share_a_storage_where_the_plain_models_do():
    plain = tied_layers()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=3)
    assert len(model._engine.slices) == 3  # the embedding's slice holds the table, the last one borrows it

    def sharing(module: nn.Module) -> list[set[str]]:
        by_storage: dict[tuple[int, int], set[str]] = {}
        for name, tensor in module.state_dict().items():
            by_storage.setdefault(stored(tensor), set()).add(name)
        return sorted(by_storage.values(), key=sorted)

    assert sharing(model) == sharing(plain)
    assert {"0.table.weight", "3.table.weight"} in sharing(model)


def test_a_parameter_kept_after_its_model_is_dropped_keeps_its_values():
    model = OffloadModel(layers(), device="cpu", num_slices=3)
    weight = model.get_submodule("3").weight
    want = weight.detach().clone()
    flat = weakref.ref(model._engine.slices[1].storage.flat)
    del model
    gc.collect()
    assert flat() is not None, "the slice's buffer was freed under a live parameter"
    for _ in range(3):  # memory handed out meanwhile must not be the parameter's
        torch.randn(1 << 16)
    torch.testing.assert_close(weight.detach(), want, **EXACT)
    weight.data.add_(1.0)
    torch.testing.assert_close(weight.detach(), want + 1.0, **EXACT)
    del weight
    gc.collect()
    assert flat() is None, "the slice's buffer outlived every tensor over it"


def test_a_replaced_tensor_is_laid_out_again_with_a_storage_of_its_own(tmp_path):
    plain = layers()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=3)
    with torch.no_grad():
        for module in (plain, model):
            module.get_submodule("3").weight.data = torch.full((16, 16), 0.5)
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), plain(x), **EXACT)  # the forward lays the slice out again
    weight = model.get_submodule("3").weight
    s = model._engine.slices[1]
    assert stored(weight) == (weight.data_ptr(), weight.nbytes) and s.storage.holds(weight)
    assert s.storage.flat.data_ptr() <= weight.data_ptr() < s.storage.flat.data_ptr() + s.storage.flat.numel()
    safetensors_torch.save_file(model.state_dict(), tmp_path / "model.safetensors")
    assert_same_state(safetensors_torch.load_file(tmp_path / "model.safetensors"), plain.state_dict())


@CUDA
def test_host_copies_stay_pinned_with_storages_of_their_own():
    model = OffloadModel(layers(), device="cuda", num_slices=3)
    for s in model._engine.slices:
        assert s.storage.flat.is_pinned()
        for entry in s.storage.held:
            assert entry.tensor.is_pinned(), entry.sites[0].name
            assert stored(entry.tensor)[0] == entry.tensor.data_ptr()


# -- Python's and PyTorch's copies and saves -------------------------------------------------------------


def test_copies_pickles_and_state_dicts_round_trip_exactly(tmp_path):
    plain = layers()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=3)
    want = plain.state_dict()

    twin = copy.deepcopy(model)
    assert_same_state(twin.state_dict(), want)
    assert all(stored(t)[0] == t.data_ptr() for t in twin.state_dict().values())
    assert_same_state(pickle.loads(pickle.dumps(model)).state_dict(), want)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    assert_same_state(torch.load(buffer, weights_only=False).state_dict(), want)
    shallow = copy.copy(model)
    assert all(a is b for a, b in zip(shallow.parameters(), model.parameters()))

    torch.save(model.state_dict(), tmp_path / "state.pt")
    other = OffloadModel(nn.Sequential(*[copy.deepcopy(m).apply(_scramble) for m in plain]), device="cpu", num_slices=2)
    other.load_state_dict(torch.load(tmp_path / "state.pt"))
    assert_same_state(other.state_dict(), want)
    # A saved tensor holds its own bytes, not its slice's whole buffer.
    assert (tmp_path / "state.pt").stat().st_size < 2 * sum(t.nbytes for t in want.values()) + 8192


def _scramble(module: nn.Module) -> None:
    with torch.no_grad():
        for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            tensor.add_(1)


# -- safetensors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("setting", SETTINGS)
def test_safetensors_keeps_every_tensor_and_reloads_bit_for_bit(setting, tmp_path):
    plain = layers()
    model = offloaded(plain, setting, tmp_path)
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(model.state_dict(), path)
    loaded = safetensors_torch.load_file(path)
    assert_same_state(loaded, plain.state_dict())
    other = offloaded(layers().apply(_scramble), setting, tmp_path / "other")
    other.load_state_dict(loaded, strict=True)
    assert_same_state(other.state_dict(), plain.state_dict())


# -- host memory of a save ------------------------------------------------------------------------------

def save_peak(save: str) -> dict[str, float]:
    """``benchmarks/bench_save_libraries.py``'s measurement of one save of an offloaded ~100 MB model,
    in a child process: the model's bytes and the save's peak host memory above what was resident."""
    # A fixed mmap threshold: freed buffers go back to the system, so the peak is what was live.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"}
    done = subprocess.run([sys.executable, "benchmarks/bench_save_libraries.py", "--child", save, "offload", "--mib", "96"],
                          cwd=ROOT, timeout=300, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_safetensors_save_does_not_copy_the_model():
    measured = save_peak("safetensors")
    assert measured["model_bytes"] > 100e6
    # A copy of the model would add its 100 MB (the script's control_copy shows it); measured: 0.1 MB.
    assert measured["growth_bytes"] < 0.05 * measured["model_bytes"], measured
