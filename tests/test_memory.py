"""Host memory: every byte in memory_footprint(), gradients added into .grad slice by slice (Note:
[Gradients added in place] in offload/autograd/accumulation.py) with autograd's results bit for bit."""

from __future__ import annotations

import copy
import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from offload import DiskTier, OffloadModel, OffloadOptimizer, estimate_memory, is_recomputing
from offload.model import engine_of
from offload.planning.shapes import profile_layers
from offload.streams.disk import page_aligned
from offload.streams.flat_views import _align
from offload.streams.pinned import size_class

from .helpers import DEVICES, HostStepped, Scale, footprint_after_steps

EXACT = {"rtol": 0.0, "atol": 0.0}
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def network(seed: int = 0, width: int = 32, layers: int = 6) -> nn.Sequential:
    torch.manual_seed(seed)
    modules: list[nn.Module] = []
    for _ in range(layers):
        modules += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*modules[:-1])


def slice_grad_bytes(model: OffloadModel) -> int:
    """The largest slice's gradient bytes, each gradient at an aligned offset as the buffers lay them out."""
    return max(sum(_align(e.shape.numel() * e.dtype.itemsize) for e in s.storage.params)
               for s in model._engine.slices)


@pytest.mark.parametrize("set_to_none", [False, True])
@pytest.mark.parametrize("backwards", [1, 2], ids=["one-backward", "two-backwards"])
@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_training_equals_the_plain_optimizer_and_keeps_one_gradient_copy(set_to_none, backwards, compute_dtype,
                                                                          device):
    plain = network()
    model = OffloadModel(copy.deepcopy(plain), device=device, num_slices=3, compute_dtype=compute_dtype)
    reference = plain.to(device)
    ours = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    # On a GPU the reference's optimizer steps host copies, as OffloadModel's does (see HostStepped).
    theirs = HostStepped(reference, lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True))
    grads_before: list[torch.Tensor] | None = None
    for step in range(3):
        for k in range(backwards):
            x = torch.randn(5, 32, generator=torch.Generator().manual_seed(10 * step + k)).to(device)
            model(x).float().square().mean().backward()
            with torch.autocast(device, dtype=compute_dtype or torch.float32, enabled=compute_dtype is not None):
                reference(x).float().square().mean().backward()
        if compute_dtype is None:
            for p, q in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad, q.grad.cpu(), **EXACT)
        if not set_to_none and grads_before is not None:
            # zero_grad(set_to_none=False) keeps the very tensors, as the plain optimizer does
            assert all(p.grad is g for p, g in zip(model.parameters(), grads_before))
        ours.step()
        theirs.step()
        ours.zero_grad(set_to_none=set_to_none)
        theirs.zero_grad(set_to_none=set_to_none)
        grads_before = [p.grad for p in model.parameters()]
    if compute_dtype is None:
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.detach(), q.detach().cpu(), **EXACT)
    footprint = model.memory_footprint()
    # One copy of the gradients (in .grad) and a window of at most two slices' buffers besides it.
    held = sum(p.numel() * 4 for p in model.parameters())
    activations = 3 * 5 * 32 * 4
    gradients = footprint.host_gradients + footprint.host_pool_idle + footprint.host_activations
    # Accumulating over backwards adds onto the earlier gradients too (Note: [Adding onto earlier gradients]).
    assert gradients <= held + 2 * slice_grad_bytes(model) + activations
    assert footprint.host_optimizer_state == 2 * held


def test_the_second_copy_of_the_gradients_is_gone():
    """The measure the in-place path exists for: with .grad kept across steps, the pool holds
    two slices' gradient buffers, not a second copy of every gradient."""
    model = OffloadModel(network(layers=8), device="cpu", num_slices=8)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    for _ in range(3):
        model(torch.randn(4, 32)).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    footprint = model.memory_footprint()
    beside_grad = footprint.host_pool_idle + footprint.host_activations
    activations = 8 * 4 * 32 * 4  # a boundary activation per slice, kept idle for the next step
    assert beside_grad <= 2 * slice_grad_bytes(model) + activations
    assert beside_grad < footprint.host_gradients / 2


def test_hooks_see_each_new_gradient_and_fire_once():
    plain = network()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=3)
    seen: dict[str, list[torch.Tensor]] = {"ours": [], "theirs": []}
    accumulated = {"ours": 0, "theirs": 0}
    for key, module in (("ours", model), ("theirs", plain)):
        first = next(iter(module.parameters()))
        first.register_hook(lambda g, key=key: seen[key].append(g.clone()))
        last = list(module.parameters())[-1]
        last.register_post_accumulate_grad_hook(lambda p, key=key: accumulated.__setitem__(key, accumulated[key] + 1))
    for _ in range(3):
        x = torch.randn(5, 32)
        model(x).square().sum().backward()
        plain(x).square().sum().backward()
        model.zero_grad(set_to_none=False)
        plain.zero_grad(set_to_none=False)
    assert len(seen["ours"]) == len(seen["theirs"]) == 3 and accumulated["ours"] == accumulated["theirs"] == 3
    for got, want in zip(seen["ours"], seen["theirs"]):
        torch.testing.assert_close(got, want, **EXACT)
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **EXACT)


def test_autograd_grad_and_backward_inputs_leave_other_grads_alone():
    plain = network()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=3)
    x = torch.randn(5, 32)
    for module in (model, plain):
        module(x).square().sum().backward()
        module.zero_grad(set_to_none=False)
        module(x).square().sum().backward()
        module.zero_grad(set_to_none=False)  # zeros that a backward may add into in place
    before = [p.grad.clone() for p in model.parameters()]
    ours = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    theirs = torch.autograd.grad(plain(x).sum(), list(plain.parameters()))
    for got, want, p, old in zip(ours, theirs, model.parameters(), before):
        torch.testing.assert_close(got, want, **EXACT)
        assert torch.equal(p.grad, old)  # torch.autograd.grad accumulates nothing
    some = list(model.parameters())[:2]
    model(x).sum().backward(inputs=some)
    plain(x).sum().backward(inputs=list(plain.parameters())[:2])
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **EXACT)


def test_a_parameter_used_outside_the_model_sums_like_autograd_after_zero_grad():
    plain = network()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=3)
    for _ in range(2):
        x = torch.randn(5, 32)
        for module in (model, plain):
            weight = next(iter(module.parameters()))
            (module(x).square().sum() + weight.square().sum()).backward()
            module.zero_grad(set_to_none=False)  # zeros: where the sum is exact
    x = torch.randn(5, 32)
    for module in (model, plain):
        weight = next(iter(module.parameters()))
        (module(x).square().sum() + weight.square().sum()).backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **EXACT)


def test_a_user_reference_to_grad_sees_the_gradient_added():
    plain = network()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=2)
    x = torch.randn(5, 32)
    for module in (model, plain):
        module(x).sum().backward()
        module.zero_grad(set_to_none=False)
    held = next(iter(model.parameters())).grad
    model(2 * x).sum().backward()
    plain(2 * x).sum().backward()
    torch.testing.assert_close(held, next(iter(plain.parameters())).grad, **EXACT)


def test_footprint_counts_every_category_per_parameter():
    model = OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=torch.bfloat16)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    model(torch.randn(4, 32)).float().sum().backward()
    optimizer.step()
    optimizer.synchronize()
    footprint = model.memory_footprint()
    count = sum(p.numel() for p in model.parameters())
    assert footprint.parameters == count
    per = footprint.per_parameter()
    assert 4.0 <= per["host_masters"] < 4.3 and 2.0 <= per["host_shadows"] < 2.2
    assert per["host_optimizer_state"] == 8.0 and 4.0 <= per["host_gradients"] < 4.3
    assert footprint.host_copies == footprint.host_masters and footprint.disk == 0
    assert footprint.host_total == sum(footprint.host_categories().values())
    table = str(footprint)
    for name in ("host_masters", "host_shadows", "host_gradients", "host_optimizer_state", "device_slots", "disk"):
        assert name in table
    del optimizer
    gc.collect()  # its inner optimizers refer back to it
    assert model.memory_footprint().host_optimizer_state == 0  # only living optimizers count


# -- the planner -------------------------------------------------------------------------------------


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("optimizer_class, kwargs, name", [
    (torch.optim.AdamW, {"lr": 1e-2, "fused": True}, "adamw"),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "fused": True}, "sgd-momentum"),
    (torch.optim.SGD, {"lr": 0.1, "fused": True}, "sgd"),
    (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True, "fused": True}, "adam"),
], ids=["adamw", "sgd-momentum", "sgd", "adam-amsgrad"])
@pytest.mark.parametrize("num_slices", [2, 5])
@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen-base"])
@pytest.mark.parametrize("resident", [0, 1, 2], ids=["streamed", "one-resident", "two-resident"])
def test_the_estimate_matches_the_footprint(compute_dtype, optimizer_class, kwargs, name, num_slices, frozen,
                                            resident):
    plain = nn.Sequential(nn.Linear(48, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 40), nn.Linear(40, 64), nn.ReLU(), nn.Linear(64, 8))
    if frozen:  # as under LoRA: most of the model frozen, gradients and state for the rest only
        for k in (0, 1, 3, 5):
            plain[k].requires_grad_(False)
    plan = estimate_memory(plain, num_slices=num_slices, compute_dtype=compute_dtype, optimizer=name, device="cpu",
                           resident_slices=resident, amsgrad=kwargs.get("amsgrad", False))
    model = OffloadModel(plain, device="cpu", num_slices=num_slices, compute_dtype=compute_dtype,
                         resident_slices=resident)
    optimizer = OffloadOptimizer(model, optimizer_class, **kwargs)
    for _ in range(2):
        model(torch.randn(4, 48)).float().sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    optimizer.synchronize()
    footprint = model.memory_footprint()
    for category in ("masters", "shadows", "gradients", "optimizer_state"):
        assert plan.host_categories()[category] == footprint.host_categories()[category], category
    for category in ("resident", "resident_gradients", "resident_optimizer_state"):
        assert plan.device_categories()[category] == footprint.device_categories()[category], category
    assert plan.parameters == footprint.parameters and plan.device_slots == footprint.device_slots
    assert (plan.device_resident > 0) == (resident > 0) and plan.disk == footprint.disk == 0
    # The pool also keeps the (small) boundary activations the planner was not told about.
    activations = num_slices * 4 * 64 * 4  # a boundary activation per slice, at most 4 x 64 float32
    pooled = footprint.host_pool_idle + footprint.host_activations
    assert plan.host_pool_idle <= pooled <= plan.host_pool_idle + activations


class _Table(nn.Module):
    """A layer of a buffer alone: its slice loads from its host copy, with nothing to cast."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.linspace(0, 1, 64 * 64).reshape(64, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.table.to(x.dtype)


@pytest.mark.parametrize("middle", [_Table, lambda: nn.Linear(64, 64).to(torch.bfloat16)],
                         ids=["buffers-alone", "in-the-compute-dtype"])
@pytest.mark.parametrize("masters", ["ram", "disk"])
def test_a_slice_that_casts_nothing_has_no_shadow_and_no_masters_file_in_the_estimate(tmp_path, masters, middle):
    """Its host copy, and its gradients, stay in RAM even with masters on disk."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(64, 64), middle(), nn.Linear(64, 64))
    plan = estimate_memory(plain, num_slices=3, compute_dtype=torch.bfloat16, optimizer="adamw", device="cpu",
                           masters=masters)
    model = OffloadModel(plain, device="cpu", num_slices=3, compute_dtype=torch.bfloat16,
                         masters=DiskTier(tmp_path) if masters == "disk" else None)
    assert [s.storage.shadow is None for s in engine_of(model).slices] == [False, True, False]
    footprint = footprint_after_steps(model, lambda: torch.randn(4, 64), fused=True)
    for category in ("masters", "shadows", "gradients", "optimizer_state", "disk_window"):
        assert plan.host_categories()[category] == footprint.host_categories()[category], category
    assert plan.disk == footprint.disk


def test_the_host_gradient_window_is_sized_by_the_streamed_slices():
    """A resident slice's gradients stay on the device; the host buffers that the streamed slices'
    gradients land in need only the largest streamed slice's size. Here slice 0 (resident) is the
    larger: its size must not reach the host pool."""
    plain = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 16), nn.Linear(16, 16))
    model = OffloadModel(plain, device="cpu", num_slices=2, resident_slices=1)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    for _ in range(3):
        model(torch.randn(4, 64)).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    streamed = model._engine.slices[1].storage
    largest_streamed = sum(_align(e.shape.numel() * e.dtype.itemsize) for e in streamed.params)
    assert largest_streamed < sum(_align(e.shape.numel() * e.dtype.itemsize)
                                  for e in model._engine.slices[0].storage.params)
    assert max(b.data.numel() for b in model._engine.pool.buffers()) <= largest_streamed


def test_with_the_masters_on_disk_the_first_steps_land_gradients_in_buffers_of_the_later_size(tmp_path):
    """Gradients copied to their files land in buffers of the largest slice's size. Backward meets
    the small slices first here: buffers sized as they came would hold the small ones beside the
    largest's for two steps, more host memory than the later steps and the plan."""
    def plain() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 64), nn.Linear(64, 64),
                             nn.Linear(64, 8))

    profile = profile_layers(plain(), lambda: torch.zeros(4, 256), compute_dtype=torch.bfloat16)
    plan = estimate_memory(plain(), num_slices=5, compute_dtype=torch.bfloat16, device="cpu", masters="disk",
                           profile=profile)
    model = OffloadModel(plain(), device="cpu", num_slices=5, compute_dtype=torch.bfloat16,
                         masters=DiskTier(tmp_path))
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, fused=True)
    pools = []
    for _ in range(3):
        model(torch.randn(4, 256)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        pools.append(model.memory_footprint().host_pool)
    optimizer.close()
    assert pools == [plan.host_pool] * 3


def test_resident_slices_are_refused_by_the_estimate_as_by_the_model():
    for bad, error in ((-1, ValueError), (3, ValueError), (1.0, TypeError), (True, TypeError)):
        with pytest.raises(error) as estimated:
            estimate_memory(network(), num_slices=2, resident_slices=bad)
        with pytest.raises(error) as built:
            OffloadModel(network(), device="cpu", num_slices=2, resident_slices=bad)
        assert str(estimated.value) == str(built.value)


def test_the_estimate_predicts_the_resident_set_within_five_percent(tmp_path):
    """The process's RSS growth while training 40 M parameters (benchmarks/bench_host_memory.py, in
    its own process), against estimate_memory's host and (on the CPU, host) device bytes."""
    out = tmp_path / "host_memory.json"
    subprocess.run([sys.executable, str(BENCHMARKS / "bench_host_memory.py"), "--params", "40e6", "--slices", "4",
                    "--json", str(out)], check=True, timeout=300, capture_output=True, env=_env_with_package())
    result = json.loads(out.read_text())
    assert 0.95 <= result["estimate_vs_rss"] <= 1.05, result["footprint"]
    assert result["estimate_vs_footprint"] == pytest.approx(1.0, abs=0.01)
    # The lean layout: masters, one copy of the gradients, two moments and a window of two slices.
    assert result["host_bytes_per_param_total"] <= 16.5 + 2 * 4 / 4 + 0.1


def test_state_and_masters_on_disk_are_counted_there():
    counts = [1_000_000] * 8
    ram = estimate_memory(counts, num_slices=4, compute_dtype=torch.bfloat16)
    state = estimate_memory(counts, num_slices=4, compute_dtype=torch.bfloat16, optimizer_state="disk")
    both = estimate_memory(counts, num_slices=4, compute_dtype=torch.bfloat16, optimizer_state="disk", masters="disk")
    n = 8_000_000
    assert ram.disk == 0 and ram.host_optimizer_state == 8 * n and ram.pinned_bytes > 0
    # RAM keeps the tier's window: three of the four slices' state, each slice's file in whole pages.
    assert state.host_disk_window == 3 * page_aligned(8 * n // 4)
    # On disk: each slice's file, in whole pages.
    assert state.disk == 4 * page_aligned(8 * n // 4)
    assert state.host_total == ram.host_total - 8 * n + state.host_disk_window
    assert both.host_masters == 0 and both.host_shadows == 2 * n
    # The gradients go to files beside the masters (Note: [Gradients on disk]); in RAM each slice's
    # are a pinned pool buffer, in its size class.
    assert both.host_gradients == 0 and ram.host_gradients == 4 * size_class(4 * n // 4)
    assert 0 <= both.disk - (state.disk + ram.host_masters + 4 * n) < 2 * 4 * 4096  # files per slice, in pages
    # The window: three slices' state and, while the optimizer steps, three slices' masters and gradients.
    assert both.host_disk_window == state.host_disk_window + 2 * 3 * page_aligned(4 * n // 4)  # files: whole pages
    assert "disk" in str(both)


def test_the_planner_refuses_what_it_cannot_count():
    with pytest.raises(ValueError, match="optimizer must be one of"):
        estimate_memory([10], optimizer="lion")
    with pytest.raises(ValueError, match="optimizer_state must be 'ram' or 'disk'"):
        estimate_memory([10], optimizer_state="nvme")
    with pytest.raises(ValueError, match="needs layers with parameters"):
        estimate_memory(nn.Sequential(nn.ReLU()))


class TiedHead(nn.Module):
    """An output head that computes with the embedding's weight (tie_word_embeddings)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.weight = embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


@pytest.mark.parametrize("head_norm", [False, True], ids=["head-alone", "head-with-norm"])
@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("resident", [0, 1], ids=["streamed", "one-resident"])
def test_a_weight_tied_across_slices_is_counted_once_as_the_model_holds_it(compute_dtype, resident, head_norm):
    """The embedding's slice holds the weight, the head's borrows it (Note: [Tied parameters across
    slices]): masters, shadow, gradient and state once; a place in the head's slot; in the pool,
    the two tied slices' landing buffers held through the backward beside the one the middle
    slice's gradients pass through (Note: [A tied weight's gradients summed in place]). With a norm
    beside the head (a Llama's last slice), the norm's .grad keeps its whole landing buffer, the
    head's place in it included, even where the embedding is resident and that place goes unused."""
    def tied() -> nn.Sequential:
        torch.manual_seed(0)
        embedding = nn.Embedding(500, 32)
        head = nn.Sequential(nn.LayerNorm(32), TiedHead(embedding)) if head_norm else TiedHead(embedding)
        return nn.Sequential(embedding, nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), head)

    profile = profile_layers(tied(), lambda: torch.zeros(4, 8, dtype=torch.long), compute_dtype=compute_dtype)
    plan = estimate_memory(tied(), num_slices=3, compute_dtype=compute_dtype, device="cpu", resident_slices=resident,
                           profile=profile)
    model = OffloadModel(tied(), device="cpu", num_slices=3, compute_dtype=compute_dtype, resident_slices=resident)
    footprint = footprint_after_steps(model, lambda: torch.randint(0, 500, (4, 8)), fused=True)
    assert plan.parameters == footprint.parameters == 500 * 32 + 2 * (32 * 32 + 32) + (64 if head_norm else 0)
    assert model.partition[-1] == ("4",)
    for category in ("masters", "shadows", "gradients", "optimizer_state"):
        assert plan.host_categories()[category] == footprint.host_categories()[category], category
    # After the step the boundary activations' buffers are idle, which the plan counts as in use.
    assert plan.host_pool == footprint.host_pool
    assert plan.host_total == footprint.host_total
    for category in ("slots", "resident", "resident_gradients", "resident_optimizer_state"):
        assert plan.device_categories()[category] == footprint.device_categories()[category], category


@pytest.mark.parametrize("frozen", [False, True], ids=["without-parameters", "frozen"])
def test_the_disk_windows_count_the_slices_the_tiers_serve(frozen, tmp_path):
    """Slices without state (a ReLU in a slice of its own, or frozen layers) between those with
    state do not narrow the windows: the tier serves, and the update reads in, only slices with
    state; and the state's files are counted as laid out, each in whole pages."""
    def layers() -> nn.Sequential:
        torch.manual_seed(0)
        between = (lambda: nn.Linear(37, 37).requires_grad_(False)) if frozen else nn.ReLU
        return nn.Sequential(nn.Linear(37, 37), between(), nn.Linear(37, 37), between(), nn.Linear(37, 37),
                             between(), nn.Linear(37, 37))

    plan = estimate_memory(layers(), num_slices=7, device="cpu", compute_dtype=torch.bfloat16,
                           optimizer_state="disk", masters="disk")
    model = OffloadModel(layers(), device="cpu", num_slices=7, compute_dtype=torch.bfloat16,
                         masters=DiskTier(tmp_path / "masters"))
    footprint = footprint_after_steps(model, lambda: torch.randn(4, 37), disk_tier=DiskTier(tmp_path / "state"), fused=True)
    page = page_aligned(1)
    # Three slices' state (AdamW's two moments of 37 x 37 + 37 floats: 3 pages), masters and
    # gradients (2 pages each).
    assert plan.host_disk_window == footprint.host_disk_window == 3 * (3 + 2 + 2) * page
    assert plan.disk == footprint.disk


def test_amsgrads_third_state_tensor_is_counted_in_ram_and_on_disk(tmp_path):
    """``max_exp_avg_sq`` is one more parameter-sized tensor of state: in RAM, and in the state's
    files and their window on disk."""
    def layers() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*(nn.Linear(37, 37) for _ in range(4)))

    for optimizer_state in ("ram", "disk"):
        plain = estimate_memory(layers(), num_slices=4, device="cpu", optimizer="adam", optimizer_state=optimizer_state)
        plan = estimate_memory(layers(), num_slices=4, device="cpu", optimizer="adam", optimizer_state=optimizer_state,
                               amsgrad=True)
        model = OffloadModel(layers(), device="cpu", num_slices=4)
        tier = {"disk_tier": DiskTier(tmp_path / optimizer_state)} if optimizer_state == "disk" else {}
        optimizer = OffloadOptimizer(model, torch.optim.Adam, lr=1e-3, amsgrad=True, fused=True, **tier)
        for _ in range(2):
            model(torch.randn(4, 37)).sum().backward()
            optimizer.step()
        optimizer.synchronize()
        footprint = model.memory_footprint()
        optimizer.close()
        assert plan.host_optimizer_state == footprint.host_optimizer_state
        assert plan.disk == footprint.disk and plan.host_disk_window == footprint.host_disk_window
        if optimizer_state == "ram":
            assert plan.host_optimizer_state == plain.host_optimizer_state * 3 // 2
        else:
            assert plan.disk > plain.disk and plan.host_disk_window > plain.host_disk_window


def test_amsgrad_is_refused_beside_an_optimizer_without_it():
    with pytest.raises(ValueError, match="amsgrad is Adam's and AdamW's option, not 'sgd-momentum'"):
        estimate_memory([10, 10], num_slices=2, optimizer="sgd-momentum", amsgrad=True)
    with pytest.raises(TypeError, match="amsgrad must be a bool"):
        estimate_memory([10, 10], num_slices=2, amsgrad="yes")


def test_the_estimate_refuses_what_the_model_refuses():
    for settings in ({"num_microbatches": 0}, {"num_microbatches": -2}, {"compute_dtype": torch.float32},
                     {"num_slices": 0}):
        with pytest.raises(ValueError) as estimated:
            estimate_memory(network(), device="cpu", **{"num_slices": 2} | settings)
        with pytest.raises(ValueError) as built:
            OffloadModel(network(), device="cpu", **{"num_slices": 2} | settings)
        assert str(estimated.value) == str(built.value), settings
    with pytest.raises(ValueError, match="num_slices must be at least 1, got 0"):
        estimate_memory(100, num_slices=0)  # not "no parameters": the count is cut into no slices
    with pytest.raises(ValueError, match="activation_bytes must be at least 0, got -5"):
        estimate_memory([10, 10], num_slices=2, activation_bytes=-5)


def _env_with_package() -> dict[str, str]:
    """The benchmark's environment; its resident set depends on the thread count (a thread's stack
    and malloc arena: 0.97-1.02 of the estimate from 16 threads to 2), so both are pinned."""
    env = dict(os.environ, OMP_NUM_THREADS="2", MALLOC_ARENA_MAX="2")
    env["PYTHONPATH"] = os.pathsep.join([str(BENCHMARKS.parent), env.get("PYTHONPATH", "")])
    return env


def test_a_backward_that_fails_part_way_leaves_the_zeroed_gradients_as_they_were():
    """Later slices were added into .grad when an earlier slice's recompute fails: they are zeroed
    again (rule 6), as autograd, which adds nothing when backward raises, would leave them."""

    class FailOnce(nn.Module):
        armed = False

        def forward(self, x):
            if self.armed and torch.is_grad_enabled() and is_recomputing():
                self.armed = False
                raise RuntimeError("simulated failure in a recompute")
            return x

    plain = nn.Sequential(*network(layers=3)[:2], FailOnce(), *network(layers=3)[2:])
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=3)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True)
    x = torch.randn(5, 32)
    for module, opt in ((model, optimizer), (plain, reference)):
        module(x).square().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    failing = next(m for m in model.modules() if isinstance(m, FailOnce))
    failing.armed = True
    loss = model(x).square().sum()
    with pytest.raises(RuntimeError, match="simulated failure"):
        loss.backward()
    del loss
    assert all(torch.equal(p.grad, torch.zeros_like(p)) and not p.grad.signbit().any() for p in model.parameters())
    for module, opt in ((model, optimizer), (plain, reference)):
        module(x).square().sum().backward()
        opt.step()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **EXACT)
        torch.testing.assert_close(p.detach(), q.detach(), **EXACT)


def test_the_estimate_rounds_pinned_gradient_buffers_to_their_size_class():
    # On CUDA the pool's pinned buffers of 1 MiB and more come in size classes (streams/pinned.py).
    counts = [3_000_000] * 4  # 12 MB of float32 gradients per slice: between two classes
    host = estimate_memory(counts, num_slices=4, device="cpu")
    pinned = estimate_memory(counts, num_slices=4, device="cuda")
    assert host.host_pool_idle == 2 * 12_000_000
    assert pinned.host_pool_idle == 2 * size_class(12_000_000) > host.host_pool_idle


def accumulate(module: nn.Module, steps: int, backwards: int, penalty: Callable[[int, int], bool] = lambda s, k: False,
               twice: bool = False, device: str = "cpu") -> None:
    """``steps`` rounds of ``backwards`` backwards each, zeroing with ``zero_grad()`` between rounds;
    ``penalty(step, k)``: whether that backward's loss adds a penalty on the first weight (a
    gradient from outside the model); ``twice``: each loss calls the model twice."""
    weight = next(iter(module.parameters()))
    for step in range(steps):
        module.zero_grad()
        for k in range(backwards):
            x = torch.randn(5, 32, generator=torch.Generator().manual_seed(10 * step + k)).to(device)
            loss = module(x).square().mean() + (module(2 * x).sum() if twice else 0)
            if penalty(step, k):
                loss = loss + weight.square().sum()
            loss.backward()


@pytest.mark.parametrize("case", ["plain", "penalty-from-the-start", "two-calls"])
@pytest.mark.parametrize("device", DEVICES)
def test_accumulation_over_backwards_adds_onto_earlier_gradients_exactly(case, device):
    """Note: [Adding onto earlier gradients]: the second and later backwards of an accumulation add
    each slice's gradients onto .grad as they land, as autograd would, bit for bit; where a gradient
    comes from outside the model too, they go through autograd and stay exact. On a GPU the
    reference computes there too, with its gradients on the device."""
    plain = network()
    model = OffloadModel(copy.deepcopy(plain), device=device, num_slices=3)
    plain = plain.to(device)
    penalty = (lambda s, k: True) if case == "penalty-from-the-start" else (lambda s, k: False)
    peaks = []
    real = model._engine.gradients.accumulate

    def counting(pending, in_flight=1):
        real(pending, in_flight)
        peaks.append(sum(not b.is_idle() for b in model._engine.pool.buffers() if b.data.numel() > 5 * 32))

    model._engine.gradients.accumulate = counting
    for module in (model, plain):
        if case == "two-calls":  # known clean from single calls: then two calls in each backward's graph
            accumulate(module, steps=1, backwards=2, device=device)
        accumulate(module, steps=2, backwards=3, penalty=penalty, twice=case == "two-calls", device=device)
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad.cpu(), **EXACT)
    if case == "plain":  # the gradients in .grad and two slices' buffers, never a second copy
        assert max(peaks) <= len(list(model.parameters())) + 2


def test_a_gradient_from_outside_after_adding_onto_earlier_ones_raises_then_goes_through_autograd():
    plain = network()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=3)
    accumulate(model, steps=1, backwards=2)  # clean: the next accumulations add onto earlier gradients
    # A penalty switched on mid-accumulation: .grad then differs from autograd's in rounding.
    with pytest.raises(RuntimeError, match=r"the gradient of 'weight' of a Linear in slice 0 also came from outside "
                                           r"the model.*Zero the gradients \(zero_grad\(\)\) and run this accumulation again"):
        accumulate(model, steps=1, backwards=2, penalty=lambda s, k: k == 1)
    # From then on exact: that weight's gradients go through autograd.
    accumulate(plain, steps=1, backwards=2)
    for module in (model, plain):
        accumulate(module, steps=2, backwards=3, penalty=lambda s, k: k > 0)
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **EXACT)


def test_a_backward_that_fails_after_adding_onto_earlier_gradients_says_so(monkeypatch):
    model = OffloadModel(network(), device="cpu", num_slices=3)
    accumulate(model, steps=1, backwards=2)
    real = model._engine.gradients.accumulate
    calls = []

    def failing(pending, in_flight=1):
        real(pending, in_flight)
        calls.append(1)
        if len(calls) == 2:  # a slice's gradients added onto the earlier ones already
            raise RuntimeError("disk full")

    monkeypatch.setattr(model._engine.gradients, "accumulate", failing)
    with pytest.raises(RuntimeError, match="disk full") as failed:
        model(torch.randn(5, 32)).square().mean().backward()
    assert any("onto those of earlier backwards" in note and "run the accumulation again" in note
               for note in failed.value.__notes__)
    monkeypatch.undo()
    accumulate(model, steps=1, backwards=2)  # and the next backwards work: nothing left watching


def test_accumulation_with_the_masters_on_disk_keeps_no_gradients_in_ram(tmp_path):
    """The disk configuration with three backwards a step: the gradients live in their files and
    RAM holds two slices' landing buffers, not the model's gradients (4 bytes per parameter)."""
    model = OffloadModel(network(layers=8), device="cpu", num_slices=8, compute_dtype=torch.bfloat16,
                         masters=tmp_path / "masters")
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, disk_tier=tmp_path / "state")
    for _ in range(3):
        accumulate(model, steps=1, backwards=3)
        optimizer.step()
    optimizer.synchronize()
    footprint = model.memory_footprint()
    gradients = sum(p.numel() * 4 for p in model.parameters())
    assert footprint.host_pool_idle + footprint.host_activations <= 2 * slice_grad_bytes(model) + 8 * 5 * 32 * 4
    assert footprint.host_pool_idle < gradients / 2


class TiedScores(nn.Module):
    """A middle layer that computes with the embedding's weight (scores over the vocabulary)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.weight = embedding.weight
        self.proj = nn.Linear(embedding.num_embeddings, embedding.embedding_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.tanh(x @ self.weight.t()))


@pytest.mark.parametrize("layout", ["head-of-five", "middle-of-three"])
def test_tied_slices_share_the_landing_buffers_of_their_size(layout):
    """The pool as backward takes it: buffers of the largest slice's size serve the untied slices
    and, in turn, a tied slice of that size; a tied slice's own is held until backward ends."""
    def tied() -> nn.Sequential:
        torch.manual_seed(0)
        embedding = nn.Embedding(50, 32)
        if layout == "head-of-five":
            body = [nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 50), nn.Linear(50, 32), nn.Tanh(), nn.Linear(32, 32)]
            return nn.Sequential(embedding, *body, TiedHead(embedding))
        return nn.Sequential(embedding, TiedScores(embedding), nn.Linear(32, 32), TiedHead(nn.Embedding(50, 32)))

    slices = 5 if layout == "head-of-five" else 3
    profile = profile_layers(tied(), lambda: torch.zeros(4, 8, dtype=torch.long))
    plan = estimate_memory(tied(), num_slices=slices, device="cpu", profile=profile)
    model = OffloadModel(tied(), device="cpu", num_slices=slices)
    footprint = footprint_after_steps(model, lambda: torch.randint(0, 50, (4, 8)), fused=True)
    assert plan.host_pool == footprint.host_pool
    assert plan.host_total == footprint.host_total


def test_with_the_masters_on_disk_a_tied_weights_sum_is_counted_in_ram(tmp_path):
    """The holder's gradient is in its file; the sum, which .grad is, in the borrowing slice's pooled
    buffer (Note: [A tied weight's gradients summed in place]): RAM the plan counts."""
    def tied() -> nn.Sequential:
        torch.manual_seed(0)
        embedding = nn.Embedding(500, 32)
        return nn.Sequential(embedding, nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), TiedHead(embedding))

    profile = profile_layers(tied(), lambda: torch.zeros(4, 8, dtype=torch.long), compute_dtype=torch.bfloat16)
    plan = estimate_memory(tied(), num_slices=3, compute_dtype=torch.bfloat16, device="cpu", masters="disk",
                           profile=profile)
    model = OffloadModel(tied(), device="cpu", num_slices=3, compute_dtype=torch.bfloat16,
                         masters=DiskTier(tmp_path))
    footprint = footprint_after_steps(model, lambda: torch.randint(0, 500, (4, 8)), fused=True)
    # The footprint counts the home files' pages in RAM now (mincore): dropped after their write-back,
    # but a busy machine's page cache may keep some a while longer. What this test checks is the sum.
    in_files = sum(s.storage.gradient_home.file.resident_bytes() for s in model._engine.slices
                   if s.storage.gradient_home is not None)
    assert footprint.host_gradients - in_files == 500 * 32 * 4
    assert plan.host_gradients == footprint.host_gradients - in_files
    # The total is the same either way: pages of a home file still in RAM are the update window's,
    # which counts them apart from the rest of the window (footprint.py), not bytes beyond it.
    assert plan.host_total == footprint.host_total


def _tied_across(layout: str, vocab: int) -> nn.Sequential:
    """An embedding whose weight a later layer borrows: a head at the end, scores in the middle, or both."""
    torch.manual_seed(0)
    embedding = nn.Embedding(vocab, 32)
    body = [module for _ in range(4) for module in (nn.Linear(32, 32), nn.Tanh())]
    if layout == "head":
        return nn.Sequential(embedding, *body, TiedHead(embedding))
    tail = TiedHead(embedding) if layout == "scores-and-head" else nn.Linear(32, 32)
    return nn.Sequential(embedding, *body[:4], TiedScores(embedding), *body[4:], tail)


@pytest.mark.parametrize(("layout", "vocab", "num_slices", "resident"), [
    ("head", 8, 3, 0), ("scores", 500, 3, 0), ("scores", 50, 4, 0), ("scores", 500, 3, 1),
    ("scores-and-head", 500, 3, 0)])
def test_with_the_masters_on_disk_a_holder_beside_other_gradients_lands_in_ram(tmp_path, layout, vocab, num_slices,
                                                                             resident):
    """A gradient file takes a backward's gradients only where nothing else refers to it, or each
    lands in its own .grad there (Note: [Gradients on disk]). The embedding's slice holds a linear
    layer too, whose .grad are views of its file after the first step, and the tied part has no
    .grad there: that slice's gradients land in a pooled buffer of its own size, held until the
    sum (Note: [A tied weight's gradients summed in place]), not in one of the largest slice's size
    and let go. A borrowing slice's file has no place for what it borrows: its own .grad keep its
    buffer in RAM, the last borrower's the sum too."""
    borrowers = {str(k) for k, layer in enumerate(_tied_across(layout, vocab))
                 if isinstance(layer, (TiedHead, TiedScores))}
    partition = _planned_as_trained_on_disk(lambda: _tied_across(layout, vocab), vocab, num_slices, tmp_path,
                                            resident)
    assert "1" in partition[0] and not borrowers & set(partition[0])  # a linear layer beside the holder


def _planned_as_trained_on_disk(make: Callable[[], nn.Sequential], vocab: int, num_slices: int, tmp_path: Path,
                                resident: int = 0) -> tuple[tuple[str, ...], ...]:
    """Check estimate_memory with the masters on disk against the footprint of ``make()`` trained
    three steps, category by category; return the model's partition."""
    profile = profile_layers(make(), lambda: torch.zeros(4, 8, dtype=torch.long), compute_dtype=torch.bfloat16)
    plan = estimate_memory(make(), num_slices=num_slices, compute_dtype=torch.bfloat16,
                           device="cpu", masters="disk", profile=profile, resident_slices=resident)
    model = OffloadModel(make(), device="cpu", num_slices=num_slices,
                         compute_dtype=torch.bfloat16, masters=DiskTier(tmp_path), resident_slices=resident)
    # Three steps, not two: the first lands the holder's gradients in its file (nothing refers to it
    # yet) through a buffer of the largest slice's size, which later steps do not take; the pool
    # lets it go at the end of the third (HostBufferPool.end_step), leaving the steady state.
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, fused=True)
    for _ in range(3):
        model(torch.randint(0, vocab, (4, 8))).float().sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    optimizer.synchronize()
    footprint = model.memory_footprint()
    optimizer.close()
    # As in test_with_the_masters_on_disk_a_tied_weights_sum_is_counted_in_ram: a home file's pages
    # still in RAM are the update window's, counted apart from it.
    in_files = sum(s.storage.gradient_home.file.resident_bytes() for s in model._engine.slices
                   if s.storage.gradient_home is not None)
    planned, measured = plan.host_categories(), footprint.host_categories()
    measured["gradients"] -= in_files
    measured["disk_window"] += in_files
    for category in ("masters", "shadows", "gradients", "optimizer_state", "disk_window"):
        assert planned[category] == measured[category], category
    # After the step the boundary activations' buffers are idle, which the plan counts as in use.
    assert plan.host_pool == footprint.host_pool
    assert plan.host_total == footprint.host_total
    return model.partition


class TiedMix(nn.Module):
    """A layer with no parameters of its own that computes with an embedding's weight."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.weight = embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(x @ self.weight.t()) @ self.weight


class _TwoTables(nn.Module):
    """Two embeddings in one layer, summed: one slice holds two weights that later slices borrow."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.first, self.second = nn.Embedding(vocab, 32), nn.Embedding(vocab, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first(x) + self.second(x)


def _lent_by_one_slice(layout: str, vocab: int) -> nn.Sequential:
    """A layer of two embeddings, each weight borrowed by a later layer without parameters of its
    own: the two borrowers apart, together in one layer, or apart with the embeddings' layer
    training a linear layer too."""
    torch.manual_seed(0)
    tables = _TwoTables(vocab)
    first, second = TiedMix(tables.first), TiedMix(tables.second)
    holder = nn.Sequential(tables, nn.Linear(32, 32)) if layout == "holder-trains" else tables
    if layout == "together":
        return nn.Sequential(holder, nn.Linear(32, 32), nn.Tanh(), nn.Sequential(first, second))
    return nn.Sequential(holder, first, nn.Linear(32, 32), nn.Tanh(), second)


@pytest.mark.parametrize("layout", ["apart", "together", "holder-trains"])
def test_with_the_masters_on_disk_two_weights_lent_by_one_slice_are_summed_each_in_ram(tmp_path, layout):
    """Each tied weight is summed in its own last borrowing slice's buffer (Note: [A tied weight's
    gradients summed in place]), which its .grad keeps in RAM: two weights of one holder, borrowed
    by two slices, are two such buffers, not one for the holder; borrowed by one slice, one buffer
    with a place for each."""
    layers = len(_lent_by_one_slice(layout, 500))
    partition = _planned_as_trained_on_disk(lambda: _lent_by_one_slice(layout, 500), 500, layers, tmp_path)
    assert partition == tuple((str(k),) for k in range(layers))  # each layer a slice of its own


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of the optimizer's per-element state, read off its ``state`` (each storage once)."""
    storages = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes() for values in optimizer.state.values()
                for v in values.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
    return sum(storages.values())


def _grad_bytes(model: OffloadModel, optimizer: torch.optim.Optimizer) -> int:
    """The bytes of the ``.grad`` of the model's parameters and of those the optimizer steps
    (each storage once)."""
    params = [*model.parameters(), *(p for group in optimizer.param_groups for p in group["params"])]
    storages = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes() for p in params
                if p.grad is not None}
    return sum(storages.values())


def test_the_state_and_gradients_of_a_head_outside_the_model_are_counted():
    """A head applied after the model, in a parameter group of its own: the optimizer keeps its
    moments and it keeps its .grad (zero_grad(set_to_none=False)), both counted on the host."""
    model = OffloadModel(network(layers=3), device="cpu", num_slices=3)
    head = nn.Linear(32, 1000)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, [{"params": model.parameters()},
                                                            {"params": head.parameters(), "lr": 1e-3}],
                                 lr=1e-2, fused=True)
    for _ in range(2):
        head(model(torch.randn(5, 32))).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    optimizer.synchronize()
    footprint = model.memory_footprint()
    head_bytes = (32 * 1000 + 1000) * 4
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert _state_bytes(optimizer) == 2 * (model_bytes + head_bytes)
    assert footprint.host_optimizer_state == _state_bytes(optimizer)
    assert footprint.host_gradients == _grad_bytes(model, optimizer) >= model_bytes + head_bytes
    assert footprint.device_resident_optimizer_state == footprint.device_resident_gradients == 0
    assert footprint.parameters == sum(p.numel() for p in model.parameters())  # the model's own
    optimizer.close()


@pytest.mark.parametrize("resident", [0, 1], ids=["streamed", "one-resident"])
def test_a_weight_replaced_by_hand_keeps_its_state_and_gradient_counted_while_the_optimizer_steps_it(resident):
    """``layer.weight = nn.Parameter(...)`` with the optimizer kept: the model holds the new
    tensor, the optimizer keeps stepping the old one (as torch.optim does), with its moments and
    its .grad. Each storage counts once, where it lies: the old weight of a resident slice is in
    host memory on a CPU "device", so its state counts on the host, the rest of the slice's on the device."""
    model = OffloadModel(network(layers=3), device="cpu", num_slices=3, resident_slices=resident)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    old = model[0].weight
    for step in range(3):
        if step == 1:
            model[0].weight = nn.Parameter(torch.randn(32, 32))
        model(torch.randn(5, 32)).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    optimizer.synchronize()
    footprint = model.memory_footprint()
    assert all(p is not old for p in model.parameters()) and old in optimizer.state
    assert _state_bytes(optimizer) == 2 * sum(p.numel() * 4 for group in optimizer.param_groups
                                              for p in group["params"])
    assert footprint.host_optimizer_state + footprint.device_resident_optimizer_state == _state_bytes(optimizer)
    assert footprint.device_resident_optimizer_state == (2 * 32 * 4 if resident else 0)  # the resident bias's
    assert footprint.host_gradients + footprint.device_resident_gradients == _grad_bytes(model, optimizer)
    optimizer.close()


@pytest.mark.parametrize("cls, kwargs", [(torch.optim.AdamW, {"fused": True}), (torch.optim.NAdam, {}),
                                         (torch.optim.ASGD, {})], ids=["AdamW", "NAdam", "ASGD"])
def test_the_moments_of_a_0d_parameter_are_counted_and_its_counts_are_not(cls, kwargs):
    model = OffloadModel(nn.Sequential(nn.Linear(4, 4), Scale(), Scale(), nn.Linear(4, 3)), device="cpu",
                         num_slices=3)
    optimizer = OffloadOptimizer(model, cls, lr=1e-2, **kwargs)
    for _ in range(2):
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    optimizer.synchronize()
    per_element = sum(t.numel() * t.element_size() for state in optimizer.state.values() for key, t in state.items()
                      if key not in ("step", "mu_product", "eta", "mu"))
    assert any(t.dim() == 0 and key not in ("step", "mu_product", "eta", "mu")  # the scalars' moments among them
               for state in optimizer.state.values() for key, t in state.items())
    assert model.memory_footprint().host_optimizer_state == per_element
    if cls is torch.optim.AdamW:
        plan = estimate_memory(nn.Sequential(nn.Linear(4, 4), Scale(), Scale(), nn.Linear(4, 3)), num_slices=3,
                               optimizer="adamw", device="cpu")
        assert plan.host_optimizer_state == per_element


class _Borrowing(nn.Module):
    """A layer that computes with an earlier layer's linear layer, holding none of its own."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.tanh(x))


def _chained_ties(links: int, vocab: int) -> nn.Sequential:
    """A chain of ties: the embedding's weight borrowed by the next layer, which holds a linear
    layer that the layer after it borrows, and so on for ``links`` linear layers."""
    torch.manual_seed(0)
    embedding = nn.Embedding(vocab, 32)
    lent: nn.Module = embedding
    layers: list[nn.Module] = [embedding]
    for _ in range(links):
        linear = nn.Linear(32, 32)
        borrower = TiedMix(lent) if lent is embedding else _Borrowing(lent)
        layers.append(nn.Sequential(borrower, linear))
        lent = linear
    return nn.Sequential(*layers, _Borrowing(lent))


@pytest.mark.parametrize(("links", "resident"), [(1, 0), (2, 0), (1, 1)])
def test_with_the_masters_on_disk_a_holder_that_borrows_keeps_its_weights_sum_in_its_own_buffer(tmp_path, links,
                                                                                                 resident):
    """A slice that borrows a streamed slice's weight lands its gradients in RAM (its file has no
    place for what it borrows), so a weight it holds and lends on is summed in its own buffer, as
    with the masters in RAM, not in the last borrowing slice's (Note: [A tied weight's gradients
    summed in place]): no buffer is counted for the sum. Borrowing from a resident slice, its
    gradients are in its file, and the sum is in the last borrower's buffer again."""
    layers = len(_chained_ties(links, 500))
    partition = _planned_as_trained_on_disk(lambda: _chained_ties(links, 500), 500, layers, tmp_path, resident)
    assert partition == tuple((str(k),) for k in range(layers))  # each layer a slice of its own
