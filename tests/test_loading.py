"""``offload.load_sequential``: an ``OffloadModel`` built on the meta device and filled from a
safetensors checkpoint (Note: [Loading slice by slice] in ``offload/loading/sequential.py``), against the same
layers built on real memory and wrapped the ordinary way.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import offload
from offload import OffloadModel

from .helpers import DEVICES, assert_same_grads

EXACT = {"rtol": 0.0, "atol": 0.0}


class Scaled(nn.Module):
    """A layer with a non-persistent buffer, computed at construction and never stored."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.register_buffer("scale", self.compute_scale(width), persistent=False)

    @staticmethod
    def compute_scale(width: int) -> torch.Tensor:
        return torch.arange(1, width + 1, dtype=torch.float32) / width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 16), nn.BatchNorm1d(16),
                         nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))


def build_tied() -> nn.Sequential:
    """An embedding whose weight the output projection shares, slices apart."""
    torch.manual_seed(0)
    embedding, head = nn.Embedding(11, 16), nn.Linear(16, 11, bias=False)
    head.weight = embedding.weight
    return nn.Sequential(embedding, nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), head)


def build_scaled() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), Scaled(16), nn.Linear(16, 4))


def init_scaled(module: nn.Module) -> None:
    module.scale.copy_(Scaled.compute_scale(module.scale.numel()))


def save(model: nn.Module, path, dtype: torch.dtype | None = None, drop: tuple[str, ...] = ()) -> None:
    state = {k: v if dtype is None or not v.is_floating_point() else v.to(dtype)
             for k, v in model.state_dict().items() if k not in drop}
    save_file(state, str(path))


def backward_both(model: nn.Module, reference: nn.Module, x: torch.Tensor) -> None:
    got, want = model(x), reference(x)
    torch.testing.assert_close(got, want, **EXACT)
    got.square().sum().backward()
    want.square().sum().backward()
    assert_same_grads(model, reference, **EXACT)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_slices", [1, 3, 8])
@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_loaded_model_equals_the_wrapped_one(tmp_path, device, num_slices, compute_dtype):
    save(build(), tmp_path / "model.safetensors")
    reference = OffloadModel(build(), device, num_slices=num_slices, compute_dtype=compute_dtype)
    model = offload.load_sequential(build, tmp_path, device, num_slices=num_slices, compute_dtype=compute_dtype)
    assert model.partition == reference.partition
    for (name, got), (_, want) in zip(model.state_dict(keep_vars=True).items(),
                                      reference.state_dict(keep_vars=True).items()):
        assert got.device == want.device and got.is_pinned() == want.is_pinned(), name
        torch.testing.assert_close(got, want, **EXACT, msg=name)
    # Every byte in the host buffers, as for a wrapped model: nothing allocated on the side.
    assert model.memory_footprint() == reference.memory_footprint()
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1)).to(device)
    backward_both(model, reference, x)


def test_a_bfloat16_checkpoint_fills_float32_masters(tmp_path):
    save(build(), tmp_path / "weights.safetensors", dtype=torch.bfloat16)
    reference = build().to(torch.bfloat16).float()  # the same rounding, then float32
    model = offload.load_sequential(build, tmp_path / "weights.safetensors", "cpu", num_slices=3,
                                    dtype=torch.float32)
    for (name, got), (_, want) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got, want, **EXACT, msg=name)
    kept = offload.load_sequential(build, tmp_path / "weights.safetensors", "cpu", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in kept.parameters())


def test_a_sharded_checkpoint(tmp_path):
    state = build().state_dict()
    keys = list(state)
    shards = {"model-00001-of-00002.safetensors": keys[:5], "model-00002-of-00002.safetensors": keys[5:]}
    for file, names in shards.items():
        save_file({k: state[k] for k in names}, str(tmp_path / file))
    weight_map = {k: file for file, names in shards.items() for k in names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model = offload.load_sequential(build, tmp_path, "cpu", num_slices=4)
    for (name, got), want in zip(model.state_dict().items(), state.values()):
        torch.testing.assert_close(got, want, **EXACT, msg=name)


@pytest.mark.parametrize("under", ["~/model.safetensors", "~"], ids=["file", "folder"])
def test_a_leading_tilde_is_the_home_directory(tmp_path, monkeypatch, under):
    """As load_causal_lm, save_checkpoint and load_checkpoint read it."""
    monkeypatch.setenv("HOME", str(tmp_path))
    save(build(), tmp_path / "model.safetensors")
    model = offload.load_sequential(build, under, "cpu", num_slices=3)
    for (name, got), want in zip(model.state_dict().items(), build().state_dict().values()):
        torch.testing.assert_close(got, want, **EXACT, msg=name)


@pytest.mark.parametrize("stored", ["0.weight", "4.weight"])
def test_tied_weights_are_stored_once_and_stay_tied(tmp_path, stored):
    other = "4.weight" if stored == "0.weight" else "0.weight"
    save(build_tied(), tmp_path / "tied.safetensors", drop=(other,))
    reference = OffloadModel(build_tied(), "cpu", num_slices=3)
    model = offload.load_sequential(build_tied, tmp_path / "tied.safetensors", "cpu", num_slices=3)
    assert getattr(model, "0").weight is getattr(model, "4").weight
    assert model.partition == reference.partition and len(model.partition) == 3
    torch.testing.assert_close(getattr(model, "0").weight, getattr(reference, "0").weight, **EXACT)
    ids = torch.tensor([[1, 4, 9], [0, 10, 3]])
    backward_both(model, reference, ids)


#: Bytes of each copy compared at a time: the default, and 12 (three float32 values) so that the
#: comparison of an 11 x 16 embedding's copies takes many spans, the last one short.
SPANS = [pytest.param(None, id="one-span"), pytest.param(12, id="many-spans")]


@pytest.mark.parametrize("span", SPANS)
def test_a_tied_weight_stored_under_each_of_its_names_is_read_once(tmp_path, monkeypatch, span):
    # A state_dict() saved as it is lists a tied weight under each name, each copy whole and equal.
    if span is not None:
        monkeypatch.setattr("offload.loading.safetensors_files._COMPARE_SPAN", span)
    state = {k: v.clone() for k, v in build_tied().state_dict().items()}
    assert "0.weight" in state and "4.weight" in state
    save_file(state, str(tmp_path / "both.safetensors"))
    reference = OffloadModel(build_tied(), "cpu", num_slices=3)
    model = offload.load_sequential(build_tied, tmp_path / "both.safetensors", "cpu", num_slices=3)
    assert getattr(model, "0").weight is getattr(model, "4").weight
    assert model.memory_footprint() == reference.memory_footprint()  # held once
    torch.testing.assert_close(getattr(model, "0").weight, state["0.weight"], **EXACT)


@pytest.mark.parametrize("span", SPANS)
@pytest.mark.parametrize("where", [(0, 0), (10, 15)], ids=["first-value", "last-value"])
def test_a_tied_weight_stored_with_different_values_is_refused(tmp_path, monkeypatch, span, where):
    # Reading either copy would drop the other without a word.
    if span is not None:
        monkeypatch.setattr("offload.loading.safetensors_files._COMPARE_SPAN", span)
    state = {k: v.clone() for k, v in build_tied().state_dict().items()}
    state["4.weight"][where] += 1.0
    save_file(state, str(tmp_path / "both.safetensors"))
    with pytest.raises(ValueError, match=r"stores tied tensors under several names with different values, and reading "
                                         r"one copy would drop the other: '4\.weight' \(both\.safetensors\) and "
                                         r"'0\.weight' \(both\.safetensors\); store only the copy the tied tensor "
                                         r"should hold, or untie the tensors in build\(\) to read each"):
        offload.load_sequential(build_tied, tmp_path / "both.safetensors", "cpu", num_slices=3)


@pytest.mark.parametrize("dtype,refused", [(None, True), (torch.bfloat16, False)], ids=["float32", "bfloat16"])
def test_tied_copies_are_compared_in_the_host_copies_dtype(tmp_path, dtype, refused):
    # Copies apart by less than bfloat16's precision are one value in bfloat16 host copies: nothing is dropped.
    state = {k: v.clone() for k, v in build_tied().state_dict().items()}
    state["0.weight"] = state["0.weight"].bfloat16().float()
    state["4.weight"] = state["0.weight"] * (1 + 2**-12)
    save_file(state, str(tmp_path / "both.safetensors"))
    if refused:
        with pytest.raises(ValueError, match="different values"):
            offload.load_sequential(build_tied, tmp_path / "both.safetensors", "cpu", num_slices=3, dtype=dtype)
        return
    model = offload.load_sequential(build_tied, tmp_path / "both.safetensors", "cpu", num_slices=3, dtype=dtype)
    assert getattr(model, "0").weight is getattr(model, "4").weight
    torch.testing.assert_close(getattr(model, "0").weight, state["0.weight"].to(dtype), **EXACT)


def test_non_persistent_buffers_are_computed_by_init_buffers(tmp_path):
    save(build_scaled(), tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"non-persistent buffers.*'1\.scale'.*init_buffers"):
        offload.load_sequential(build_scaled, tmp_path, "cpu")
    seen = []

    def init_buffers(module):
        seen.append(type(module).__name__)
        init_scaled(module)

    with pytest.raises(ValueError, match=r"init_buffers left non-persistent buffers unset \(NaN\): '1\.scale'"):
        offload.load_sequential(build_scaled, tmp_path, "cpu", init_buffers=lambda module: None)
    model = offload.load_sequential(build_scaled, tmp_path, "cpu", num_slices=2, init_buffers=init_buffers)
    assert seen == ["Scaled"]
    reference = OffloadModel(build_scaled(), "cpu", num_slices=2)
    torch.testing.assert_close(getattr(model, "1").scale, getattr(reference, "1").scale, **EXACT)
    backward_both(model, reference, torch.randn(3, 8))


def test_mismatched_checkpoints_name_the_key_and_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save(build(), path, drop=("3.bias",))
    with pytest.raises(ValueError, match=r"missing from the checkpoint: '3\.bias'"):
        offload.load_sequential(build, path, "cpu")
    state = build().state_dict()
    save_file({**state, "9.weight": torch.zeros(2)}, str(path))
    with pytest.raises(ValueError, match=r"stored but not in the model: '9\.weight' \(model\.safetensors\)"):
        offload.load_sequential(build, path, "cpu")
    save_file({**state, "3.weight": torch.zeros(16, 15)}, str(path))
    with pytest.raises(ValueError, match=r"'3\.weight' in model\.safetensors has shape \(16, 15\), the model's "
                                         r"'3\.weight' is \(16, 16\)") as raised:
        offload.load_sequential(build, path, "cpu")
    # Told once, as misshapen: the stored tensor is there, so it is not also "missing".
    assert "missing" not in str(raised.value) and str(raised.value).count("'3.weight'") == 2


def test_files_that_are_not_safetensors_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        offload.load_sequential(build, tmp_path / "absent", "cpu")
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor model.safetensors.index.json"):
        offload.load_sequential(build, tmp_path, "cpu")
    (tmp_path / "bad.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(ValueError, match="bad.safetensors is not a safetensors file"):
        offload.load_sequential(build, tmp_path / "bad.safetensors", "cpu")
    path = tmp_path / "cut.safetensors"
    save(build(), path)
    path.write_bytes(path.read_bytes()[:-8])  # the last tensor loses its end
    with pytest.raises(ValueError, match="byte range .* within the file"):
        offload.load_sequential(build, path, "cpu")


def test_a_meta_model_is_refused_outside_a_loader():
    with torch.device("meta"):
        layers = build()
    with pytest.raises(ValueError, match="is on the meta device and has no values to copy.*load_sequential"):
        OffloadModel(layers, "cpu")


def test_a_process_group_is_refused(tmp_path):
    save(build(), tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="without a process_group"):
        offload.load_sequential(build, tmp_path, "cpu", process_group=object())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("build_model", [build, build_tied, build_scaled], ids=["plain", "tied", "scaled"])
def test_resident_slices_load_from_the_checkpoint(tmp_path, device, build_model):
    """The first slices' tensors on the device (``resident_slices``, Note: [Resident slices]) are
    filled from the checkpoint as the host copies are: through a host temporary on a GPU."""
    save(build_model(), tmp_path / "model.safetensors", drop=("4.weight",) if build_model is build_tied else ())
    init = {"init_buffers": init_scaled} if build_model is build_scaled else {}
    reference = OffloadModel(build_model(), device, num_slices=3, resident_slices=2)
    model = offload.load_sequential(build_model, tmp_path, device, num_slices=3, resident_slices=2, **init)
    assert model.resident_slices == 2
    for (name, got), (_, want) in zip(model.state_dict(keep_vars=True).items(),
                                      reference.state_dict(keep_vars=True).items()):
        assert got.device == want.device, name
        torch.testing.assert_close(got, want, **EXACT, msg=name)
    x = (torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1)) if build_model is build_tied
         else torch.randn(6, 8, generator=torch.Generator().manual_seed(1))).to(device)
    backward_both(model, reference, x)
