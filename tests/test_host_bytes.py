"""The host memory bytes a step touches (``offload/planning/host_bytes.py``): the count per
parameter for each optimizer and path, against the bytes each pass reads and writes; the planner's
host update timed from it; and the host memory bandwidth probe ``offload calibrate`` records."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from offload.cli.calibrate import host_memory_bandwidth
from offload.planning import host_bytes
from offload.planning.host_bytes import HostBytes, host_bytes_per_step
from offload.planning.planner import slice_layout
from offload.planning.rates import GPU_DEFAULTS, HOST_DEFAULT, UPDATE_BYTES_PER_PARAMETER
from offload.planning.timing import StepConfig, estimate_step_time

N = 1_000_000


def per_parameter(**kwargs) -> dict[str, float]:
    return host_bytes_per_step(N, **kwargs).per_parameter(N)


def test_adamw_in_one_pass_with_bf16_gradients_touches_28_bytes_a_parameter():
    """The issue's minimum: the bf16 gradient read (2), the master read and written (8), both
    moments read and written (16), the bf16 shadow written in the same pass (2)."""
    count = per_parameter(compute_dtype=torch.bfloat16, gradient_dtype=torch.bfloat16, shadow_in_update=True)
    assert count == {"update": 28.0, "shadow": 0.0, "gradients": 2.0, "loads": 4.0, "total": 34.0}


def test_two_passes_count_the_shadow_pass():
    """Without the one-pass kernel the update reads float32 gradients (28 bytes with master and
    moments), then a pass of its own re-reads every master (4) to write the shadow (2); the device
    writes float32 gradients (4) and two loads a step read the bf16 shadow (2 each)."""
    count = per_parameter(compute_dtype=torch.bfloat16, shadow_in_update=False)
    assert count == {"update": 28.0, "shadow": 6.0, "gradients": 4.0, "loads": 4.0, "total": 42.0}
    assert host_bytes_per_step(N, compute_dtype=torch.bfloat16, shadow_in_update=False).host_update == 34 * N


def test_todays_path_writes_the_shadow_in_the_update_and_reads_float32_gradients():
    """The library's update (Note: [One-pass update]): float32 gradients (4), master (8), moments
    (16), the shadow written in the same pass (2); no shadow pass."""
    count = per_parameter(compute_dtype=torch.bfloat16)
    assert count == {"update": 30.0, "shadow": 0.0, "gradients": 4.0, "loads": 4.0, "total": 38.0}
    assert host_bytes_per_step(N, compute_dtype=torch.bfloat16).host_update == 30 * N


@pytest.mark.parametrize("optimizer, amsgrad, update", [("adamw", False, 28), ("adam", False, 28), ("adamw", True, 36),
                                                        ("sgd-momentum", False, 20), ("sgd", False, 12),
                                                        (None, False, 0)])
def test_each_optimizer_reads_and_writes_its_state(optimizer, amsgrad, update):
    """Without a compute dtype: no shadow; the loads read the float32 masters. The update's count
    is the rates' bytes per parameter (what the host update rate is measured in)."""
    count = per_parameter(optimizer=optimizer, amsgrad=amsgrad, loads_per_step=1.5)
    assert count == {"update": update, "shadow": 0.0, "gradients": 4.0, "loads": 6.0, "total": update + 10.0}
    if not amsgrad:
        assert update == UPDATE_BYTES_PER_PARAMETER[optimizer]


def test_parameters_count_in_their_own_dtype():
    """A bf16 parameter's master, gradient and moments are 2 bytes each; an integer one gets no shadow."""
    count = host_bytes_per_step({torch.bfloat16: 10, torch.float32: 5}, compute_dtype=torch.float16,
                                shadow_in_update=False)
    assert count == HostBytes(update=10 * 14 + 5 * 28, shadow=10 * 4 + 5 * 6, gradients=10 * 2 + 5 * 4,
                              loads=2 * (10 * 2 + 5 * 2))
    assert host_bytes_per_step({torch.int64: 3}, compute_dtype=torch.bfloat16, optimizer=None).loads == 2 * 3 * 8


def test_measured_copies_replace_the_counted_ones():
    count = host_bytes_per_step(N, compute_dtype=torch.bfloat16).with_copies(loaded=7, offloaded=11)
    assert (count.loads, count.gradients, count.update, count.shadow) == (7, 11, 30 * N, 0)
    assert count.to_json()["total"] == 30 * N + 18


def test_what_it_cannot_count_it_says():
    with pytest.raises(ValueError, match="'adagrad' are not known; pass the one of"):
        host_bytes_per_step(N, optimizer="adagrad")
    with pytest.raises(ValueError, match="amsgrad"):
        host_bytes_per_step(N, optimizer="sgd", amsgrad=True)
    with pytest.raises(ValueError, match=">= 0"):
        host_bytes_per_step(-1)


def test_the_planner_times_the_shadow_pass_from_the_count_over_host_memory(monkeypatch):
    """Two passes: the host update with a bf16 shadow takes the update alone plus the shadow's pass,
    6 bytes per parameter over the host's memory bandwidth: measured where the rates have it,
    otherwise twice the copy rate (a copied byte is read and written). One pass: the update's own
    rate over its 2 more bytes."""
    monkeypatch.setattr(host_bytes, "SHADOW_IN_UPDATE", False)
    layers = [1 << 20] * 4
    config = StepConfig(num_slices=4)
    plain = slice_layout(layers, num_slices=4)
    shadowed = slice_layout(layers, num_slices=4, compute_dtype=torch.bfloat16)

    def update(rates, layout, compute_dtype) -> float:
        return estimate_step_time(layout, None, dataclasses.replace(config, compute_dtype=compute_dtype), rates,
                                  device="cpu", device_seconds=(0.01, 0.02)).update

    parameters = 4 << 20
    assert HOST_DEFAULT.host_memory_bandwidth is None and HOST_DEFAULT.host_memory == 2 * HOST_DEFAULT.host_copy
    assert update(HOST_DEFAULT, plain, None) == pytest.approx(28 * parameters / HOST_DEFAULT.host_update)
    for rates in (HOST_DEFAULT, dataclasses.replace(HOST_DEFAULT, host_memory_bandwidth=100e9)):
        shadow = update(rates, shadowed, torch.bfloat16) - update(rates, plain, None)
        assert shadow == pytest.approx(6 * parameters / rates.host_memory)
    monkeypatch.setattr(host_bytes, "SHADOW_IN_UPDATE", True)
    shadow = update(HOST_DEFAULT, shadowed, torch.bfloat16) - update(HOST_DEFAULT, plain, None)
    assert shadow == pytest.approx(2 * parameters / HOST_DEFAULT.host_update)
    measured = dataclasses.replace(HOST_DEFAULT, host_memory_bandwidth=100e9)
    assert measured.host_memory == 100e9
    # A GPU's defaults planned with this host's calibration take its memory bandwidth too.
    assert GPU_DEFAULTS["a100"].with_host(measured).host_memory_bandwidth == 100e9


def test_the_host_memory_probe_counts_a_copy_read_and_written():
    before = torch.get_num_threads()
    rate = host_memory_bandwidth(16 * 2**20, repeats=3, num_threads=1)
    assert 1e8 < rate < 1e13 and torch.get_num_threads() == before
    with pytest.raises(ValueError, match="positive"):
        host_memory_bandwidth(16 * 2**20, num_threads=0)


def test_the_library_paths_flags_set_the_defaults(monkeypatch):
    """What the library's update does (one pass or two, the gradients' dtype) is the count's default,
    and so the planner's: a fused pass reading bf16 gradients is the issue's 28 bytes, no shadow pass."""
    layout = slice_layout([1 << 20] * 4, num_slices=4, compute_dtype=torch.bfloat16)
    config = StepConfig(num_slices=4, compute_dtype=torch.bfloat16)

    def planned() -> float:
        return estimate_step_time(layout, None, config, HOST_DEFAULT, device="cpu", device_seconds=(0.01, 0.02)).update

    monkeypatch.setattr(host_bytes, "SHADOW_IN_UPDATE", False)
    two_passes = planned()
    monkeypatch.setattr(host_bytes, "SHADOW_IN_UPDATE", True)
    monkeypatch.setattr(host_bytes, "GRADIENTS_IN_COMPUTE_DTYPE", True)
    assert per_parameter(compute_dtype=torch.bfloat16) == {"update": 28.0, "shadow": 0.0, "gradients": 2.0,
                                                           "loads": 4.0, "total": 34.0}
    one_pass = planned()
    assert one_pass == pytest.approx(28 * (4 << 20) / HOST_DEFAULT.host_update) and one_pass < two_passes


def test_a_parameter_already_in_the_compute_dtype_has_no_shadow():
    """OffloadModel loads a slice already in the compute dtype from its masters: no shadow to write,
    the loads read the masters. A bf16 parameter's update: master (4), gradient (2), moments (8)."""
    for in_update in (True, False):
        count = host_bytes_per_step({torch.bfloat16: N}, compute_dtype=torch.bfloat16, shadow_in_update=in_update)
        assert count.per_parameter(N) == {"update": 14.0, "shadow": 0.0, "gradients": 2.0, "loads": 4.0,
                                          "total": 20.0}
        assert count == host_bytes_per_step({torch.bfloat16: N}, compute_dtype=None)


def test_a_modules_batch_norms_keep_their_dtype_and_have_no_shadow():
    """Given the module, its batch and instance norms' parameters (float32 under a compute dtype,
    as OffloadModel keeps them: FLOAT32_LAYERS) count as without a compute dtype; the rest as a
    count per dtype would, and frozen parameters not at all."""
    layers = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.InstanceNorm1d(32, affine=True),
                           nn.Linear(32, 8), nn.Linear(8, 8).requires_grad_(False))
    linear, norms = 64 * 32 + 32 + 32 * 8 + 8, 4 * 32
    counted = host_bytes_per_step(layers, compute_dtype=torch.bfloat16, shadow_in_update=False)
    cast = host_bytes_per_step(linear, compute_dtype=torch.bfloat16, shadow_in_update=False)
    kept = host_bytes_per_step(norms, compute_dtype=None)
    assert counted == HostBytes(*(a + b for a, b in zip(dataclasses.astuple(cast), dataclasses.astuple(kept))))
    assert counted.shadow == 6 * linear and counted.loads == 2 * (2 * linear + 4 * norms)
    assert host_bytes_per_step(layers, compute_dtype=None) == host_bytes_per_step(linear + norms)
