"""The step-time model charges the shadow (the host's cast of the masters a load reads) only for the
parameters that have one, as the model and the memory estimate count them: none for a parameter
already in the compute dtype, nor for a batch or instance norm's, which keeps float32
(``FLOAT32_LAYERS`` in ``offload/streams/host_storage.py``; ``SliceLayout.casts``). And the shape
profile gives those norms' parameters float32 stand-ins, as the model's device copies are."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from offload import OffloadModel
from offload.model import engine_of
from offload.planning import host_bytes
from offload.planning.host_bytes import host_bytes_per_step
from offload.planning.planner import slice_layout
from offload.planning.rates import HOST_DEFAULT
from offload.planning.shapes import _fake_state, profile_layers
from offload.planning.timing import StepConfig, estimate_step_time, traffic
from offload.streams.host_storage import keeping_their_dtype

BF16 = torch.bfloat16
ONE_PASS = [pytest.param(True, id="one-pass"), pytest.param(False, id="two-passes")]


def linears(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(64, 64) for _ in range(4))).to(dtype)


def with_norm() -> nn.Sequential:
    """A norm between two linear layers: alone in its slice with three slices, beside the last with two."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 64))


def update_seconds(layout, config: StepConfig) -> float:
    return estimate_step_time(layout, None, config, HOST_DEFAULT, device="cpu", device_seconds=(0.01, 0.02)).update


def test_the_norms_parameters_are_those_the_model_keeps_in_their_dtype():
    model = with_norm()
    assert keeping_their_dtype(list(model)) == {id(model[1].weight), id(model[1].bias)}


@pytest.mark.parametrize("in_update", ONE_PASS)
def test_a_model_already_in_the_compute_dtype_has_no_shadow_to_time(in_update, monkeypatch):
    """A bf16 model under bf16: loads read its masters, nothing is cast; its host update is the one
    of the same model without a compute dtype."""
    monkeypatch.setattr(host_bytes, "SHADOW_IN_UPDATE", in_update)
    shadowed = slice_layout(linears(BF16), num_slices=2, compute_dtype=BF16)
    plain = slice_layout(linears(BF16), num_slices=2)
    assert shadowed.casts == [False, False] and shadowed.cast_trainable_bytes == [0, 0]
    config = StepConfig(num_slices=2, compute_dtype=BF16)
    moved, without = traffic(shadowed, None, config), traffic(plain, None, dataclasses.replace(config, compute_dtype=None))
    assert moved.shadow == 0
    parameters = 4 * (64 * 64 + 64)
    # Master and state read and written (2 bytes each), the gradient read: no shadow written.
    assert moved.update == without.update == (2 * 2 + 2 + 2 * 2 * 2) * parameters
    assert update_seconds(shadowed, config) == update_seconds(plain, dataclasses.replace(config, compute_dtype=None))


@pytest.mark.parametrize("in_update", ONE_PASS)
@pytest.mark.parametrize("num_slices", [3, 2], ids=["norm-alone", "norm-mixed"])
def test_a_batch_norms_parameters_have_no_shadow_to_time(num_slices, in_update, monkeypatch):
    """The shadow's bytes are the linear layers' alone, as the host bytes' count of the model has them."""
    monkeypatch.setattr(host_bytes, "SHADOW_IN_UPDATE", in_update)
    layout = slice_layout(with_norm(), num_slices=num_slices, compute_dtype=BF16)
    moved = traffic(layout, None, StepConfig(num_slices=num_slices, compute_dtype=BF16))
    linear, norm = 2 * (64 * 64 + 64), 2 * 64
    counted = host_bytes_per_step(with_norm(), compute_dtype=BF16)
    assert (moved.update, moved.shadow) == (counted.update, counted.shadow)
    if in_update:  # the shadow (2 bytes) written in the update's pass, for the linear layers only
        assert (moved.update, moved.shadow) == (30 * linear + 28 * norm, 0)
    else:  # a pass of its own: the master read (4), the shadow written (2)
        assert (moved.update, moved.shadow) == (28 * (linear + norm), 6 * linear)


def test_a_norms_slice_alone_has_no_masters_file_and_stages_nothing():
    """With the masters and shadows on disk, only a slice whose load casts has files and stages."""
    layout = slice_layout(with_norm(), num_slices=3, compute_dtype=BF16)
    assert layout.casts == [True, False, True]
    moved = traffic(layout, None, StepConfig(num_slices=3, compute_dtype=BF16, masters="disk", shadows="disk"))
    cast = [0, 2]
    assert moved.disk_read == moved.disk_write == sum(layout.host_bytes[k] + layout.gradient_bytes[k] for k in cast)
    assert moved.forward_staged == sum(layout.host_bytes[k] for k in cast)
    assert moved.backward_staged == layout.host_bytes[0]  # slices 1 and 2 stay in the slots


@pytest.mark.parametrize("in_update", ONE_PASS)
def test_a_float32_model_under_bf16_is_timed_as_before(in_update, monkeypatch):
    """Every parameter cast: the figures this model gave before the shadow followed the casts."""
    monkeypatch.setattr(host_bytes, "SHADOW_IN_UPDATE", in_update)
    parameters = 4 << 20
    layout = slice_layout([1 << 20] * 4, num_slices=4, compute_dtype=BF16)
    config = StepConfig(num_slices=4, compute_dtype=BF16)
    moved = traffic(layout, None, config)
    assert (moved.update, moved.shadow) == ((30 * parameters, 0) if in_update else (28 * parameters, 6 * parameters))
    expected = (30 * parameters / HOST_DEFAULT.host_update if in_update
                else 28 * parameters / HOST_DEFAULT.host_update + 6 * parameters / HOST_DEFAULT.host_memory)
    assert update_seconds(layout, config) == pytest.approx(expected, rel=1e-12)
    staged = traffic(layout, None, dataclasses.replace(config, masters="disk", shadows="disk"))
    assert staged.forward_staged == 4 * (4 << 20) and staged.backward_staged == 2 * (4 << 20)
    assert staged.disk_read == 2 * 4 * (4 << 20)  # masters and gradients


def test_the_shape_profile_keeps_a_norms_parameters_in_the_models_dtype():
    """The profile's stand-ins have the dtypes of the model's device copies: float32 for the batch
    norm, bf16 for the linear layers; and the profile runs the model in them."""
    layers = with_norm()
    stand_ins = {id(p): _fake_state(layer, BF16)[name] for layer in layers for name, p in layer.named_parameters()}
    model = OffloadModel(with_norm(), device="cpu", num_slices=3, compute_dtype=BF16)
    built = {name: entry.device_dtype for s in engine_of(model).slices for entry in s.storage.params
             for name in [next(n for n, p in model.named_parameters() if p is entry.tensor)]}
    ours = {name: stand_ins[id(p)].dtype for name, p in layers.named_parameters()}
    assert {name.removeprefix("layers."): dtype for name, dtype in built.items()} == ours
    assert ours["1.weight"] == ours["1.bias"] == torch.float32 and ours["0.weight"] == BF16
    profile = profile_layers(layers, lambda: torch.randn(8, 64), compute_dtype=BF16)
    assert profile.layers[1].output_bytes == 8 * 64 * 2  # a bf16 input normalised: a bf16 output
