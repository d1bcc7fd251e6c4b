"""The stream-ordering checker (``offload.streamcheck``): the asynchronous copy path, on the CPU.

Three parts:

- every training scenario of ``stream_scenarios.py`` (and the staged ones here, on a simulated
  device where the caller's CPU tensors do not live), under every schedule of deferred copies,
  gives bit for bit what the synchronous path gives, and the race checker finds nothing;
- the checker itself can fail: hand-made mistakes are reported, as the right kind of race;
- every ordering the copy engine asks for is needed: leaving any one out is caught by some
  scenario, except the safety nets listed in Note: [Orderings the end of a walk covers]
  (``offload/streams/copies.py``), which a test keeps honest too.
"""

from __future__ import annotations

import gc
import warnings
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer
from offload.kernels import build as kernel_build
from offload.streamcheck import SCHEDULES, Dependency, StreamChecker, StreamOrderingError
from offload.streamcheck.clocks import COMPUTE, Epoch, VectorClock
from offload.streamcheck.memory import MemoryTracker, Race
from offload.streams import CopyStreams
from offload.streams.flat_views import flat_exporter, own_storage_view

from .stream_scenarios import SCENARIOS, Build, build_on_cpu, inputs, mlp, state


class Masked(nn.Module):
    """A linear layer whose output is scaled by a mask that goes whole to every microbatch."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, mask = inputs
        return self.linear(x) * mask[: x.shape[-1]]


def host_inputs_staged(build: Build) -> list[torch.Tensor]:
    """Pageable CPU inputs to a model on another device, two microbatches of ``(x, mask)``: each
    input is copied on the host into a pooled pinned buffer and loaded from there
    (``ActivationOffloader.load_host``). Each microbatch's rows of ``x`` and the mask have the
    same size, so within one forward they take the same buffer in turn: each copy into it after
    the load that read it last. Two training steps, then a forward without a graph."""
    torch.manual_seed(0)
    slices = [nn.Sequential(Masked(8), nn.Tanh()), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 3)]
    # Kept graphs: a recompute would compare compute's tensors with the device (StreamChecker's
    # ``device``). The first slice resident: no load of its own is queued after the inputs' on the
    # load stream, so that compute's wait for it cannot stand in for the wait for the inputs.
    model = build(slices, num_microbatches=2, checkpoint_activation=False, resident_slices=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mask = torch.linspace(0.5, 1.5, 16)  # 64 bytes, as each microbatch's 2 rows of x; no batch dimension
    seen: list[torch.Tensor] = []
    for step in range(2):
        optimizer.zero_grad(set_to_none=True)
        out = model((inputs(step, rows=4), mask))
        out.pow(2).mean().backward()
        optimizer.step()
        seen.append(out.detach().clone())
    with torch.no_grad():
        seen.append(model((inputs(2, rows=4), mask)).clone())
    return seen + state(model)


#: The simulated device of the staged scenarios: not ``torch.device("cpu")``, where the caller's CPU
#: tensors live, so they reach it as they reach a GPU (StreamChecker's ``device``).
STAGING_DEVICE = torch.device("cpu", 0)
STAGED = {f.__name__: f for f in (host_inputs_staged,)}
#: Every scenario the checker runs; the staged ones, small, first (the mutation test stops at the first
#: scenario that notices).
CHECKED = {**STAGED, **SCENARIOS}


def device_of(name: str) -> torch.device:
    return STAGING_DEVICE if name in STAGED else torch.device("cpu")


def checker_for(name: str, **kwargs: Any) -> StreamChecker:
    """A checker whose simulated device is scenario ``name``'s."""
    return StreamChecker(device=device_of(name), **kwargs)


@pytest.fixture(scope="module", autouse=True)
def _frozen_heap():
    """The objects alive before this module's tests (torch, transformers, earlier tests' fixtures) left
    out of every garbage collection while they run: each ``gc.collect()`` here and each automatic one
    inside a checked run then walks only what the module's runs made, not the whole heap (a quarter
    of a second each). Garbage left by earlier tests is collected first."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


_reference_cache: dict[str, list[torch.Tensor]] = {}


def reference(name: str) -> list[torch.Tensor]:
    """The scenario on the synchronous path, computed once."""
    if name not in _reference_cache:
        _reference_cache[name] = run_quietly(name)
    return _reference_cache[name]


class LateRun(NamedTuple):
    dependencies: set[Dependency]
    races: list[Race]
    summary: str
    got: list[torch.Tensor]


_late_cache: dict[str, LateRun] = {}


def late_run(name: str) -> LateRun:
    """Scenario ``name`` under the checker with every ordering in place and the ``"late"`` schedule
    (whose runs the seed does not change), run once: what its checker saw, and its results."""
    if name not in _late_cache:
        gc.collect()
        with checker_for(name, schedule="late") as checker:
            got = run_quietly(name)
        _late_cache[name] = LateRun(set(checker.dependencies), list(checker.races), checker.summary(), got)
    return _late_cache[name]


def asked_by(name: str) -> set[Dependency]:
    """The orderings scenario ``name`` asks the copy engine for, on a checked run with every one in
    place, computed once: leaving out any other ordering changes nothing in that scenario."""
    return late_run(name).dependencies


def run_quietly(name: str) -> list[torch.Tensor]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "OffloadModel with num_microbatches > 1 runs BatchNorm")
        if name in SCENARIOS:
            return SCENARIOS[name](build_on_cpu)
        return STAGED[name](lambda layers, **kwargs: OffloadModel(layers, device=STAGING_DEVICE, **kwargs))


def same(expected: list[torch.Tensor], got: list[torch.Tensor]) -> bool:
    return len(expected) == len(got) and all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(expected, got))


# -- scenarios ------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", sorted(CHECKED))
def test_scenario_is_exact_and_race_free(name, schedule):
    expected = reference(name)
    if schedule == "late":  # the run that asked_by looks at
        races, summary, got = late_run(name)[1:]
    else:
        gc.collect()
        with checker_for(name, schedule=schedule, seed=7) as checker:
            got = run_quietly(name)
        races, summary = checker.races, checker.summary()
    assert not races, summary
    assert same(expected, got), "deferred copies changed the results"


def test_models_built_under_the_checker_take_the_asynchronous_path():
    with StreamChecker():
        model = OffloadModel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), device="cpu", num_slices=2)
    assert model._engine.copies.is_async and model._engine.pin
    assert not OffloadModel(nn.Sequential(nn.Linear(4, 4)), device="cpu")._engine.copies.is_async


# -- the checker can fail ---------------------------------------------------------------------------


def streams() -> CopyStreams:
    copies = CopyStreams(torch.device("cpu"))
    assert copies.is_async
    return copies


def pinned(copies: CopyStreams, values: torch.Tensor) -> torch.Tensor:
    host = copies.empty_host(values.numel() * values.element_size(), torch.device("cpu"))
    host = host.view(values.dtype).view(values.shape)
    host.copy_(values)
    return host


def test_reading_a_load_before_waiting_for_it_is_reported_and_reads_poison():
    with StreamChecker() as checker:
        copies = streams()
        host = pinned(copies, torch.arange(4.0))
        device = checker.on_device(torch.zeros(4))
        copies.load(device, host)
        early = (device + 0).clone()  # no wait_ready
    assert torch.isnan(early).all()
    assert any(race.kind == "write then read not ordered" for race in checker.races), checker.summary()


def test_waiting_for_the_load_is_enough():
    with StreamChecker() as checker:
        copies = streams()
        host = pinned(copies, torch.arange(4.0))
        device = torch.zeros(4)
        copies.wait_ready(copies.load(device, host))
        seen = (device + 0).clone()
    assert torch.equal(seen, torch.arange(4.0)) and not checker.races, checker.summary()


def test_overwriting_an_offload_source_too_early_is_reported_and_changes_what_arrives():
    with StreamChecker() as checker:
        copies = streams()
        device = checker.on_device(torch.arange(4.0))
        host = pinned(copies, torch.zeros(4))
        ready = copies.offload(host, device)
        device.mul_(10)  # compute overwrites the source without waiting for the offload
        copies.wait_host(ready)
        arrived = host.clone()
    assert torch.equal(arrived, torch.arange(4.0) * 10)
    assert any(race.kind == "read then write not ordered" for race in checker.races), checker.summary()


def test_host_reading_an_offload_destination_before_synchronising_is_reported():
    with StreamChecker() as checker:
        copies = streams()
        device = checker.on_device(torch.ones(4))
        host = pinned(copies, torch.zeros(4))
        copies.offload(host, device)
        host.sum()
    assert any(race.kind == "write then read not ordered" for race in checker.races), checker.summary()


def test_host_writing_a_load_source_before_the_load_ran_is_reported():
    with StreamChecker() as checker:
        copies = streams()
        host = pinned(copies, torch.arange(4.0))
        device = torch.zeros(4)
        ready = copies.load(device, host)
        host.fill_(-1.0)  # an optimizer step before the load has read its source
        copies.wait_ready(ready)
        seen = (device + 0).clone()
    assert torch.equal(seen, torch.full((4,), -1.0))
    assert any(race.kind == "read then write not ordered" for race in checker.races), checker.summary()


def test_copies_from_pageable_memory_are_reported():
    with StreamChecker() as checker:
        copies = streams()
        copies.wait_ready(copies.load(torch.zeros(4), torch.arange(4.0)))
    assert any("pageable" in race.kind for race in checker.races), checker.summary()


def test_writing_fresh_device_memory_before_queued_compute_is_reported():
    for wait in (False, True):
        with StreamChecker() as checker:
            copies = streams()
            host = pinned(copies, torch.arange(4.0))
            (checker.on_device(torch.ones(4)) + 1).sum()  # queued compute
            fresh = torch.empty(4)
            copies.wait_ready(copies.load(fresh, host, after_queued_compute=wait))
        assert any("freshly allocated" in race.kind for race in checker.races) != wait, checker.summary()


def test_freeing_device_memory_a_side_stream_still_reads_needs_a_mark():
    def offload_a_temporary(mark: bool) -> StreamChecker:
        leave_out = None if mark else (lambda dependency: dependency.kind == "mark_used")
        with StreamChecker(leave_out=leave_out) as checker:
            copies = streams()
            host = pinned(copies, torch.zeros(4))
            temporary = checker.on_device(torch.ones(4))
            ready = copies.offload(host, temporary)
            del temporary  # the caching allocator could hand the block to compute now
            (checker.on_device(torch.ones(4)) * 3).sum()
            copies.wait_host(ready)
        return checker

    assert any("freed" in race.kind for race in offload_a_temporary(mark=False).races)
    assert not offload_a_temporary(mark=True).races


def test_compute_reading_pinned_host_memory_is_reported():
    with StreamChecker() as checker:
        copies = streams()
        host = pinned(copies, torch.arange(4.0))
        device = checker.on_device(torch.ones(4))
        device + host  # a kernel cannot read the host copy
    assert any(race.kind == "compute touches pinned host memory" for race in checker.races)


def test_fail_fast_raises_at_the_offending_operation():
    with pytest.raises(StreamOrderingError, match="write then read"):
        with StreamChecker(fail_fast=True):
            copies = streams()
            host = pinned(copies, torch.arange(4.0))
            device = torch.zeros(4)
            copies.load(device, host)
            device + 0  # the device side of a load is device memory


def test_writing_a_host_copy_through_its_own_storage_before_the_load_of_the_flat_buffer_ran_is_reported():
    # A host copy has a storage of its own over the flat buffer's memory (Note: [A storage per host
    # copy]); the load reads the flat buffer: the checker must see that they are the same bytes.
    with StreamChecker() as checker:
        copies = streams()
        flat = pinned(copies, torch.arange(4.0))
        parameter = own_storage_view(flat_exporter(flat.view(torch.uint8)), 4, torch.float32, torch.Size([2]))
        assert parameter.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
        device = torch.zeros(4)
        ready = copies.load(device, flat)
        parameter.fill_(-1.0)  # an optimizer step before the load has read the slice
        copies.wait_ready(ready)
        seen = (device + 0).clone()
    assert torch.equal(seen, torch.tensor([0.0, -1.0, -1.0, 3.0]))
    assert any(race.kind == "read then write not ordered" for race in checker.races), checker.summary()


def test_a_load_that_waits_for_an_earlier_slices_update_but_not_its_own_is_caught(monkeypatch):
    # Note: [Updates in the next forward's order]: the update worker promises no order between slices,
    # so slice 0's update being done says nothing of slice 1's, though backward queued slice 1's first.
    with StreamChecker() as checker:
        model = build_on_cpu(mlp(), num_slices=4)
        optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, update_in_backward=True)
        updates = model._engine.updates
        wait = updates.wait
        for step in range(3):
            if step == 2:  # backward started every update (the first step only checks)
                assert optimizer._in_backward.last_started == {0, 1, 2, 3}
                monkeypatch.setattr(updates, "wait", lambda index: None if index == 1 else wait(index))
            model(inputs(step)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert any("host update" in str(race) for race in checker.races), checker.summary()


def test_a_host_read_during_a_one_pass_update_is_reported():
    """The one-pass host update is a C++ call that no dispatch mode sees: it shows the checker what
    it reads and writes first (Note: [One-pass update] in offload/kernels/one_pass.py), so a read
    of a master while its update may still be running is reported as it is without the kernel."""
    if kernel_build.host_kernel(wait=True) is None:
        pytest.fail(f"the one-pass kernel did not build here: {kernel_build.unavailable_reason()}")
    torch.manual_seed(0)
    with StreamChecker() as checker:
        model = build_on_cpu(nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]), num_slices=4,
                             compute_dtype=torch.bfloat16)
        optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
        master = next(model.parameters())
        model(torch.randn(6, 64)).float().pow(2).mean().backward()
        optimizer.step()  # the slices' updates, queued on the host update worker
        master.detach().sum()  # without optimizer.synchronize()
        optimizer.synchronize()
    assert [race.kind for race in checker.races if "kernel_accesses" in race.second] == [
        "read then write not ordered"], checker.summary()


@pytest.mark.parametrize("alias_first", [False, True], ids=["buffer_first", "alias_first"])
def test_storages_over_the_same_memory_share_its_history_whichever_is_seen_first(alias_first):
    races: list[Race] = []
    tracker = MemoryTracker(races.append)
    flat = torch.zeros(64, dtype=torch.uint8)
    alias = own_storage_view(flat_exporter(flat), 16, torch.float32, torch.Size([4]))
    unrelated = torch.zeros(4)
    writer, reader = VectorClock(), VectorClock()
    if alias_first:
        tracker.access(unrelated, True, Epoch(COMPUTE + 1, writer.tick(COMPUTE + 1), "earlier write"), writer)
    first, second = (alias, flat[16:32]) if alias_first else (flat[16:32], alias)
    tracker.access(first, True, Epoch(COMPUTE + 1, writer.tick(COMPUTE + 1), "side write"), writer)
    tracker.access(flat[:16], False, Epoch(COMPUTE, reader.tick(COMPUTE), "read of other bytes"), reader)
    assert not races
    tracker.access(second, False, Epoch(COMPUTE, reader.tick(COMPUTE), "unordered read"), reader)
    assert [(race.first, race.second) for race in races] == [("side write", "unordered read")]
    assert len({id(tracker.tracked(t).memory) for t in (flat, alias)}) == 1
    assert tracker.tracked(unrelated).memory is not tracker.tracked(flat).memory


def test_a_storage_freed_while_another_is_placed_is_forgotten_after(monkeypatch):
    """A tensor's finalizer may run at any allocation (the garbage collector), also in the middle of
    the tracker placing another storage: its collection waits for the placing, which holds indices
    into the sorted allocation lists."""
    from offload.streamcheck import memory

    tracker = MemoryTracker(lambda race: None)
    flat = torch.zeros(4096, dtype=torch.uint8)  # not tracked: storages over it are allocations of their own
    exporter = flat_exporter(flat)
    tensors = [own_storage_view(exporter, offset, torch.float32, torch.Size([16])) for offset in (0, 1024, 3072)]
    for t in tensors:
        tracker.tracked(t)
    dying_key = tensors[0].untyped_storage()._cdata
    real = memory.Allocation

    def allocation(*args, **kwargs):
        if dying_key in tracker.storages:  # once: the first tensor dies while the fourth is placed
            tensors.pop(0)
            tracker.collect(VectorClock(), lambda agent: False, str, only=dying_key)
        return real(*args, **kwargs)

    monkeypatch.setattr(memory, "Allocation", allocation)
    newcomer = own_storage_view(exporter, 2048, torch.float32, torch.Size([16]))  # between the last two
    tracker.tracked(newcomer)
    monkeypatch.undo()
    assert dying_key not in tracker.storages
    assert tracker._starts == sorted(tracker._starts) and len(tracker._starts) == len(tracker._allocations) == 3
    for t in [*tensors, newcomer]:
        memory_of = tracker.tracked(t).memory
        assert tracker._allocations[tracker._starts.index(memory_of.start)] is memory_of


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="schedule must be one of"):
        StreamChecker(schedule="sometimes")


def test_a_simulated_device_that_is_not_a_cpu_device_is_refused():
    with pytest.raises(ValueError, match="pass 'cpu' .* or 'cpu:0' .*, not 'cuda:0'"):
        StreamChecker(device="cuda:0")


# -- every ordering is needed ----------------------------------------------------------------------

#: Orderings that some scenario shows to be needed: leaving one out is caught.
NEEDED = [
    Dependency("mark_used", "offload", "activations.py:offload", "offload"),
    # A model is freed as soon as it is dropped, its gradient summation buffers with it
    # (retain_graph_twice drops its model as the run returns).
    Dependency("mark_used", "offload", "gradients.py:offload", "offload"),
    Dependency("mark_used", "offload_many", "gradients.py:offload", "offload"),
    Dependency("synchronize_event", "wait_host_all", "gradients.py:finish", "offload"),
    Dependency("synchronize_event", "wait_host_all", "slice_walk.py:finish", "offload"),
    Dependency("synchronize_event", "wait_loads_done", "slice_walk.py:finish", "load"),
    Dependency("synchronize_event", "wait_host", "gradients.py:accumulate", "offload"),
    Dependency("synchronize_event", "wait_host", "activations.py:copy_on_host", "offload"),
    # A caller's CPU input staged into a pooled pinned buffer (ActivationOffloader.load_host): the next
    # input of that size in the same forward (the next microbatch's rows, a mask) takes the same buffer.
    Dependency("synchronize_event", "wait_host", "activations.py:copy_on_host", "load"),
    Dependency("wait_stream", "load", "activations.py:_load_host_memory", "compute"),
    Dependency("wait_event", "wait_ready", "slice_walk.py:load_inputs", "load"),
    Dependency("synchronize_event", "wait_host", "device_slots.py:prefetch", "host update"),
    Dependency("synchronize_event", "wait_host", "settled.py:_settle", "host update"),
    Dependency("synchronize_event", "wait_host", "optimizer.py:synchronize", "host update"),
    # Update in backward (Note: [Update in backward]): a slice's update after its gradients' offload,
    # and zeroing .grad in place after the updates that read it.
    Dependency("synchronize_event", "submit", "tier_plumbing.py:submit", "offload"),
    Dependency("synchronize_event", "wait_host", "optimizer.py:zero_grad", "host update"),
    # Norms in backward (Note: [Norms from backward]): a slice's norms after its gradients' offload.
    Dependency("synchronize_event", "submit", "backward_norms.py:gradients_final", "offload"),
    # Scaling in the update (Note: [Scaling in the update]): a clip's read after the update that
    # wrote the gradients back scaled.
    Dependency("synchronize_event", "wait_host", "deferred_scaling.py:settle", "host update"),
    Dependency("synchronize_event", "submit", "data_parallel.py:gradients_leaving", "offload"),
    Dependency("synchronize_event", "submit", "sharding.py:exchange", "host update"),
    Dependency("synchronize_event", "submit", "disk_tier.py:submit", "disk write"),
    # A state buffer's write after the update that used it: the next update through that buffer
    # follows it only through the write and the read, not the worker (Note: [Updates in the next
    # forward's order]).
    Dependency("synchronize_event", "submit", "disk_tier.py:submit", "host update"),
    Dependency("synchronize_event", "wait_host", "data_parallel.py:gradients_landed", "collectives"),
    Dependency("synchronize_event", "wait_host", "device_slots.py:prefetch", "collectives"),
    # A staging buffer is cast into only after the load that read it last (Note: [Shadows on disk]).
    Dependency("synchronize_event", "wait_host", "shadow_staging.py:stage", "load"),
    # A cast ahead of its load, on the staging worker: after the load that read its buffer last and
    # after the slice's host update; the load after the cast.
    Dependency("synchronize_event", "submit", "shadow_staging.py:stage_ahead", "load"),
    Dependency("synchronize_event", "submit", "shadow_staging.py:stage_ahead", "host update"),
    Dependency("synchronize_event", "wait_host", "shadow_staging.py:stage", "shadow staging"),
    Dependency("synchronize_event", "wait_host", "settled.py:_settle", "collectives"),
    Dependency("synchronize_stream", "drain", "device_slots.py:invalidate", "load"),
    Dependency("synchronize_stream", "drain", "device_slots.py:invalidate", "offload"),
    Dependency("wait_event", "load", "activations.py:load", "offload"),
    Dependency("wait_event", "load", "device_slots.py:prefetch", "compute"),
    Dependency("wait_event", "load", "device_slots.py:prefetch", "offload"),
    Dependency("wait_event", "wait_ready", "device_slots.py:acquire", "load"),
    Dependency("wait_event", "wait_ready", "slot_buffers.py:restore_buffers", "load"),
    Dependency("wait_event", "wait_ready", "records.py:take", "load"),
    Dependency("wait_event", "wait_ready", "gradients.py:_claim_buffer", "offload"),
    Dependency("wait_stream", "load", "activations.py:load", "compute"),
    Dependency("wait_stream", "load", "slot_buffers.py:restore_buffers", "compute"),
    Dependency("wait_stream", "offload", "activations.py:offload", "compute"),
    Dependency("wait_stream", "offload", "slot_buffers.py:write_back_buffers", "compute"),
    Dependency("wait_stream", "offload", "gradients.py:offload", "compute"),
    Dependency("wait_stream", "offload_many", "gradients.py:offload", "compute"),
    Dependency("wait_stream", "offload_many", "gradients.py:_offload_sparse", "compute"),
    # Saved activations of offloaded slices (Note: [Offloaded saved tensors]).
    Dependency("mark_used", "offload", "activations.py:offload_saved", "offload"),
    Dependency("wait_stream", "offload", "activations.py:offload_saved", "compute"),
    Dependency("wait_event", "wait_ready", "saved_activations.py:wait", "load"),
    # A weight borrowed from a resident slice, cast into the slot on the compute stream (Note: [Resident slices]).
    Dependency("wait_event", "on_device", "device_slots.py:_load_borrowed", "offload"),
    # A slice's gradients cast into one buffer that is freed once its copy is issued (Note: [One copy per slice]).
    Dependency("mark_used", "offload", "gradients.py:_offload_gathered", "offload"),
    Dependency("wait_stream", "offload", "gradients.py:_offload_gathered", "compute"),
]

#: Safety nets that no scenario can expose today, each for the reason given in
#: Note: [Orderings the end of a walk covers] in offload/streams/copies.py.
COVERED = [
    Dependency("mark_used", "load", "activations.py:load", "load"),
    Dependency("mark_used", "load", "activations.py:_load_host_memory", "load"),
    Dependency("mark_used", "load", "device_slots.py:prefetch", "load"),
    Dependency("mark_used", "load", "device_slots.py:_load_borrowed", "load"),
    Dependency("wait_event", "load", "device_slots.py:_load_borrowed", "compute"),
    Dependency("mark_used", "load", "slot_buffers.py:restore_buffers", "load"),
    Dependency("mark_used", "offload", "slot_buffers.py:write_back_buffers", "offload"),
    Dependency("synchronize_event", "wait_host", "device_slots.py:prefetch", "load"),
    Dependency("wait_event", "load", "slot_buffers.py:restore_buffers", "offload"),
    Dependency("wait_event", "offload", "activations.py:offload", "load"),
    Dependency("wait_event", "offload", "activations.py:offload_saved", "load"),
    Dependency("wait_event", "offload_many", "gradients.py:offload", "load"),
    Dependency("wait_stream", "drain", "device_slots.py:invalidate", "load"),
    Dependency("wait_stream", "drain", "device_slots.py:invalidate", "offload"),
    Dependency("wait_event", "on_device", "device_slots.py:prefetch", "offload"),
    # A clip's scaling, run alone, after the work pending on its slice: whatever wrote the gradients
    # the clip read was waited for by that read (a clip between step() and the next forward reads
    # them under an update that may write them: a race the checker reports on the read itself).
    Dependency("synchronize_event", "submit", "deferred_scaling.py:submit", "host update"),
]


#: Orderings the checker cannot exercise yet. A sparse gradient summed over microbatches is freed
#: right after its offload is issued, so on CUDA its indices and values must be marked as used by the
#: offload stream, as every offload source is (rule 3 of [Copy ordering]); the checker follows a
#: sparse tensor's reads and writes through its indices and values but not its release, so leaving
#: the mark out goes unnoticed in the scenario that offloads one.
UNSEEN = [
    Dependency("mark_used", "offload_many", "gradients.py:_offload_sparse", "offload"),
]


#: Orderings of the disk tier whose absence makes a run fail loudly (an update finds no state to
#: attach: an internal assertion) instead of racing: the checker does not see the direct I/O into the tier's
#: buffers (``os.preadv`` is no PyTorch operation), only what follows from it. See Note: [Disk tier
#: pipeline] in offload/tiers/disk_tier.py.
LOUD = [
    Dependency("synchronize_event", "submit", "disk_tier.py:submit", "disk read"),  # update after its read
    # The writes done before a step's turns start afresh (Note: [The window's arena], rule 4): without
    # it the next step finds a slice's state still held by its pending write, and its update raises.
    Dependency("synchronize_event", "wait_host", "disk_tier.py:flush", "disk write"),
]


#: Orderings of masters on disk that bound host memory, not values: a shared file mapping is
#: coherent, so an access in any order sees the current bytes (Note: [Masters on disk] in
#: offload/tiers/master_files.py). Leaving one out changes no result; what each bounds is tested in
#: tests/test_masters_on_disk.py (the window, a write after its read, step() after the writes).
MEMORY_ONLY = [
    Dependency("synchronize_event", "submit", "disk_tier.py:submit", "masters read"),  # update after its read-in
    Dependency("synchronize_event", "submit", "master_files.py:read", "masters write"),  # the window
    # A slice's gradients land after the write of those that landed WINDOW slices before (Note: [Gradients on
    # disk]): the bound is tested in tests/test_gradients_on_disk.py.
    Dependency("synchronize_event", "wait_host", "master_files.py:before_landing", "masters write"),
    Dependency("synchronize_event", "submit", "master_files.py:write", "host update"),  # write-back after the update
    Dependency("synchronize_event", "submit", "master_files.py:write", "masters read"),  # ...and after its read
    Dependency("synchronize_event", "wait_host", "master_files.py:flush", "masters write"),
]


#: Orderings that decide whether work done ahead is used, not any value: without the wait for the norms
#: computed in backward, clip_grad_norm_ finds fewer of them and computes the rest itself, the same bits
#: (Note: [Norms from backward]); a norm still being computed is never taken (tests/test_backward_norms.py).
AHEAD_ONLY = [
    Dependency("synchronize_event", "wait_host_all", "backward_norms.py:settle", "gradient norms"),
]


def exposing_scenario(dependency: Dependency, raising_counts: bool) -> str | None:
    """The first scenario in which leaving ``dependency`` out shows: a race report or wrong
    results, or also a run that raises when ``raising_counts``. A needed ordering must be shown by
    the checker itself, so that a missing wait reads as a report at the offending op; a safety net
    must not break a run in any way."""
    for name in CHECKED:
        if dependency not in asked_by(name):
            continue  # never asked for there: leaving it out runs the scenario unchanged
        shown = mutated_run(dependency, name)
        if shown == "reported" or (shown == "raised" and raising_counts and not raises_unmutated(name)):
            return name
    return None


_mutated_cache: dict[tuple[Dependency, str], str] = {}


def mutated_run(dependency: Dependency, name: str) -> str:
    """Scenario ``name`` under the checker with ``dependency`` left out, run once (a test that asks
    with and without ``raising_counts`` looks at the same runs): ``"reported"`` (races or wrong
    results), ``"raised"`` or ``"unchanged"``."""
    key = (dependency, name)
    if key not in _mutated_cache:
        expected = reference(name)
        # Models and optimizers that earlier runs left to the garbage collector are finalized now,
        # not inside a checked run.
        gc.collect()
        with checker_for(name, leave_out=lambda d: d == dependency) as checker:
            try:
                got = run_quietly(name)
            except Exception:  # noqa: BLE001 - a mutation may break the run outright
                got = None
        if checker.races or (got is not None and not same(expected, got)):
            _mutated_cache[key] = "reported"
        else:
            _mutated_cache[key] = "raised" if got is None else "unchanged"
    return _mutated_cache[key]


def raises_unmutated(name: str) -> bool:
    """Whether scenario ``name`` raises with every ordering in place, checked as the mutated run
    was: a failure the left-out ordering did not cause exposes nothing."""
    gc.collect()
    try:
        with checker_for(name):
            run_quietly(name)
    except Exception as error:  # noqa: BLE001
        warnings.warn(f"scenario {name} raised with every ordering in place: {error!r}", stacklevel=2)
        return True
    return False


def test_the_lists_name_every_ordering_the_copy_engine_asks_for():
    asked: set[Dependency] = set()
    for name in CHECKED:
        asked |= asked_by(name)
    listed = set(NEEDED) | set(COVERED) | set(LOUD) | set(MEMORY_ONLY) | set(UNSEEN) | set(AHEAD_ONLY)
    assert asked == listed, f"new: {sorted(map(str, asked - listed))}; gone: {sorted(map(str, listed - asked))}"


@pytest.mark.parametrize("dependency", NEEDED, ids=str)
def test_leaving_out_a_needed_ordering_is_caught(dependency):
    assert exposing_scenario(dependency, raising_counts=False) is not None, f"nothing notices {dependency} missing"


@pytest.mark.parametrize("dependency", LOUD, ids=str)
def test_leaving_out_a_disk_tier_ordering_fails_the_run(dependency):
    assert exposing_scenario(dependency, raising_counts=False) is None, "the checker sees it now: move it to NEEDED"
    assert exposing_scenario(dependency, raising_counts=True) is not None, f"nothing notices {dependency} missing"


@pytest.mark.parametrize("name, dependency", [*(("offload_optimizer_masters_on_disk", d) for d in MEMORY_ONLY),
                                              *(("norms_in_backward", d) for d in AHEAD_ONLY)],
                         ids=lambda x: str(x))
def test_the_same_values_without_an_ordering_of_memory_or_of_work_done_ahead(name, dependency):
    expected = reference(name)
    with checker_for(name, leave_out=lambda d: d == dependency) as checker:
        got = run_quietly(name)
    assert not checker.races and same(expected, got)


@pytest.mark.parametrize("dependency", COVERED, ids=str)
def test_safety_nets_are_still_covered_by_the_end_of_a_walk(dependency):
    # If this fails, a scenario now exposes this ordering: move it to NEEDED and update the note.
    assert exposing_scenario(dependency, raising_counts=True) is None
