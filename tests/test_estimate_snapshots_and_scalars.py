"""``estimate_memory`` counts two things the model keeps in host RAM that bytes per slice alone do
not tell: the buffers a checkpointed run of a slice with running statistics keeps for its recompute
(rule 3 of Note: [Buffers] in ``offload/walk/slice_walk.py``), and, with the optimizer's disk tier,
the state of a 0-d parameter, which the tier leaves in RAM (``goes_to_disk`` in
``offload/tiers/state_slice.py``). Each category equals the measured footprint after three steps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload.walk.engine as engine_module
from offload import DiskTier, MemoryFootprint, OffloadModel, estimate_memory
from offload.planning.shapes import profile_layers
from offload.streams.host_buffers import HostBufferPool

from .helpers import Scale, footprint_after_steps

# Batch statistics per microbatch are beside the point here.
pytestmark = pytest.mark.filterwarnings("ignore:OffloadModel with num_microbatches > 1 runs BatchNorm")

HOST = ("masters", "shadows", "gradients", "optimizer_state", "disk_window")
DEVICE = ("slots", "resident", "resident_gradients", "resident_optimizer_state")


class _Table(nn.Module):
    """A constant buffer (a mask, a lookup table) beside the norm: in the same buffer region."""

    def __init__(self, width: int, rows: int | None = None) -> None:
        super().__init__()
        rows = rows or width
        self.register_buffer("table", torch.linspace(0, 1, rows * width).reshape(rows, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.table[:x.shape[-1]].to(x.dtype)


class _SizedPool(HostBufferPool):
    """The pool as the engine builds it where it pins (CUDA): buffers in the size classes."""

    def __init__(self, allocate, size_class=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(allocate, engine_module.size_class)


def _normed(table: bool, frozen_norm: bool = False, rows: int | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(64)
    if frozen_norm:  # its running statistics left as they are: nothing changes in forward
        norm.eval()
    middle = nn.Sequential(norm, _Table(64, rows)) if table else norm
    return nn.Sequential(nn.Linear(32, 64), middle, nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 16))


def _assert_as_planned(plan: MemoryFootprint, footprint: MemoryFootprint) -> None:
    for category in HOST:
        assert plan.host_categories()[category] == footprint.host_categories()[category], category
    for category in DEVICE:
        assert plan.device_categories()[category] == footprint.device_categories()[category], category
    # After the step the boundary activations' and the buffers' copies are idle, which the plan
    # counts as in use.
    assert plan.host_pool == footprint.host_pool
    assert plan.host_total == footprint.host_total
    assert plan.disk == footprint.disk


@pytest.mark.parametrize("table", [False, True], ids=["norm", "norm-and-table"])
@pytest.mark.parametrize("num_microbatches", [1, 3])
@pytest.mark.parametrize("num_slices, resident", [(1, 0), (3, 0), (3, 1), (3, 2), (2, 0)],
                         ids=["one-slice", "three-slices", "one-resident", "two-resident", "two-slices"])
@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_buffers_kept_for_a_recompute_of_running_statistics_are_counted(table, num_microbatches, num_slices,
                                                                              resident, compute_dtype):
    """Every checkpointed run of the norm's slice (each microbatch's, but the last slice's last, whose
    graph is kept) keeps the slice's whole buffer region, a resident slice's too."""
    make_input = lambda: torch.randn(6, 32)  # noqa: E731
    profile = profile_layers(_normed(table), make_input, compute_dtype=compute_dtype)
    plan = estimate_memory(_normed(table), num_slices=num_slices, num_microbatches=num_microbatches,
                           compute_dtype=compute_dtype, device="cpu", profile=profile, resident_slices=resident)
    model = OffloadModel(_normed(table), device="cpu", num_slices=num_slices, num_microbatches=num_microbatches,
                         compute_dtype=compute_dtype, resident_slices=resident)
    _assert_as_planned(plan, footprint_after_steps(model, make_input, steps=3, fused=True))
    # The norm with the first layer (no table), or alone (with it): before the last slice.
    assert num_slices == 1 or "1" not in model.partition[-1]


def test_a_norm_in_eval_mode_keeps_no_copy_of_its_buffers():
    """A norm left in eval mode inside a model that trains (its statistics frozen) changes nothing
    in forward: the estimate reads the mode the layers are passed in, as the model reads the mode
    they run in."""
    make_input = lambda: torch.randn(6, 32)  # noqa: E731
    profile = profile_layers(_normed(True, frozen_norm=True), make_input)
    plan = estimate_memory(_normed(True, frozen_norm=True), num_slices=3, num_microbatches=3, device="cpu",
                           profile=profile)
    trained = estimate_memory(_normed(True), num_slices=3, num_microbatches=3, device="cpu", profile=profile)
    # Three checkpointed runs, each of the region: the two statistics, the count (16 int64
    # elements, as aligned), the table.
    assert trained.host_activations - plan.host_activations == 3 * (2 * 64 * 4 + 16 * 8 + 64 * 64 * 4)
    model = OffloadModel(_normed(True, frozen_norm=True), device="cpu", num_slices=3, num_microbatches=3)
    _assert_as_planned(plan, footprint_after_steps(model, make_input, steps=3, fused=True))


def test_pinned_copies_of_the_buffers_are_counted_in_their_size_class(monkeypatch):
    """On CUDA the pool allocates each copy in its size class (``offload/streams/pinned.py``): a
    model on the CPU whose pool rounds as a pinned one does holds what the estimate for CUDA counts."""
    monkeypatch.setattr(engine_module, "HostBufferPool", _SizedPool)
    rows = 5700  # a table of 5700 x 64 float32 beside the norm: 1,459,840 bytes of region, between two classes
    make_input = lambda: torch.randn(6, 32)  # noqa: E731
    profile = profile_layers(_normed(True, rows=rows), make_input)
    plan = estimate_memory(_normed(True, rows=rows), num_slices=3, num_microbatches=2, device="cuda", profile=profile)
    exact = estimate_memory(_normed(True, rows=rows), num_slices=3, num_microbatches=2, device="cpu", profile=profile)
    region = 2 * 64 * 4 + 16 * 8 + rows * 64 * 4
    assert engine_module.size_class(region) > region
    assert plan.host_activations - exact.host_activations == 2 * (engine_module.size_class(region) - region)
    model = OffloadModel(_normed(True, rows=rows), device="cpu", num_slices=3, num_microbatches=2)
    assert model.partition[1] == ("1",)
    _assert_as_planned(plan, footprint_after_steps(model, make_input, steps=3, fused=True))


def _scaled(scalars: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), *(Scale() for _ in range(scalars)), nn.Linear(8, 8))


@pytest.mark.parametrize("num_slices, scalars", [(3, 1), (4, 2), (2, 1), (1, 2)],
                         ids=["alone", "two-alone", "beside-a-linear", "one-slice"])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("resident", [0, 1])
def test_with_the_state_on_disk_a_0d_parameters_state_stays_in_ram(num_slices, scalars, amsgrad, resident, tmp_path):
    """The tier's files hold the state of the parameters with a dimension only: a slice of scalars
    alone has no file and no place in the window, and the scalars' moments count in RAM."""
    plan = estimate_memory(_scaled(scalars), num_slices=num_slices, optimizer="adamw", amsgrad=amsgrad,
                           optimizer_state="disk", device="cpu", resident_slices=resident)
    model = OffloadModel(_scaled(scalars), device="cpu", num_slices=num_slices, resident_slices=resident)
    footprint = footprint_after_steps(model, lambda: torch.randn(4, 8), steps=3, fused=True, amsgrad=amsgrad,
                                      disk_tier=DiskTier(tmp_path))
    for category in HOST:
        assert plan.host_categories()[category] == footprint.host_categories()[category], category
    for category in DEVICE:
        assert plan.device_categories()[category] == footprint.device_categories()[category], category
    assert plan.disk == footprint.disk
    streamed = [layer for part in model.partition[resident:] for layer in part]
    in_ram = sum(isinstance(model[int(k)], Scale) for k in streamed) * (3 if amsgrad else 2) * 4
    assert footprint.host_optimizer_state == in_ram
