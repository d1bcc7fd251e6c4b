"""Shadows off RAM: ``OffloadModel(..., masters=DiskTier(path), shadows="disk")`` keeps no shadow
per slice; each load casts the slice's masters, read in from their file, into a window of
staging buffers. Results are bit for bit those of the same model with its shadows in RAM, RAM
holds the window, and the wait before a buffer is cast into again is needed (Note: [Shadows on
disk] in offload/streams/shadow_staging.py)."""

from __future__ import annotations

import copy
import errno
import json
import os
import re
import threading
from dataclasses import replace

import pytest
import torch
from torch import nn

from offload import (DiskTier, DiskTierError, OffloadModel, OffloadOptimizer, estimate_memory, latest_checkpoint,
                     load_checkpoint, save_checkpoint)
from offload.streamcheck import Dependency, StreamChecker
from offload.streams import host_storage, mapped
from offload.streams.shadow_staging import STAGING_BUFFERS

from .helpers import DEVICES
from .test_masters_on_disk import resident
from .test_optimizer import OPTIMIZERS, assert_same, loss_of, network

pytestmark = pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")

BF16 = torch.bfloat16


def twins(tmp_path, cls=torch.optim.AdamW, kwargs=None, device="cpu", num_slices=3, state_tier=False,
          layers=network, optimizer_kwargs=None, **model_kwargs):
    """The same model and optimizer, masters on disk, with the shadows in RAM and on disk."""
    runs = []
    for shadows in ("ram", "disk"):
        (tmp_path / shadows).mkdir()
        model = OffloadModel(layers(), device=device, num_slices=num_slices, compute_dtype=BF16,
                             masters=DiskTier(tmp_path / shadows / "masters"), shadows=shadows, **model_kwargs)
        tier = DiskTier(tmp_path / shadows / "state") if state_tier else None
        runs.append((model, OffloadOptimizer(model, cls, disk_tier=tier, **(kwargs or {"lr": 1e-2}),
                                             **(optimizer_kwargs or {}))))
    return runs


def train(runs, steps, first=0, backwards=1):
    """Each run's losses, step by step."""
    losses = [[] for _ in runs]
    for step in range(first, first + steps):
        for (model, optimizer), seen in zip(runs, losses):
            optimizer.zero_grad()
            for micro in range(backwards):
                loss = loss_of(model, 10 * step + micro) / backwards
                loss.backward()
                seen.append(loss.detach())
            optimizer.step()
    return losses


def assert_runs_equal(runs, losses):
    (ram_model, ram), (model, optimizer) = runs
    assert all(torch.equal(a, b) for a, b in zip(*losses))
    assert_same(ram_model, ram, model, optimizer)


def staged(model):
    """Whether no slice keeps a shadow of its own: every streamed one stages its loads."""
    storages = [s.storage for s in model._engine.slices if not s.storage.resident]
    return all(st.shadow is None and st.staged for st in storages)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_tier", [False, True], ids=["state-in-ram", "state-on-disk"])
@pytest.mark.parametrize("cls, kwargs", [p for p in OPTIMIZERS if p.id in ("AdamW-default", "AdamW-fused",
                                                                         "SGD-momentum")])
def test_steps_equal_the_shadows_in_ram(cls, kwargs, state_tier, device, tmp_path):
    runs = twins(tmp_path, cls, kwargs, device, state_tier=state_tier)
    assert staged(runs[1][0]) and not staged(runs[0][0])
    losses = train(runs, 4)
    assert_runs_equal(runs, losses)


@pytest.mark.parametrize("fused", [False, True])
def test_accumulation_clipping_and_a_grad_scaler_skip(fused, tmp_path):
    runs = twins(tmp_path, torch.optim.AdamW, {"lr": 1e-2, "fused": fused}, state_tier=True)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**8) for _ in runs]
    losses = [[] for _ in runs]
    for step in range(4):
        for (model, optimizer), scaler, seen in zip(runs, scalers, losses):
            for micro in range(3):
                loss = loss_of(model, 10 * step + micro) / 3
                if step == 2 and micro == 1:
                    loss = loss * float("inf")  # an overflow: the step is skipped
                scaler.scale(loss).backward()
                seen.append(loss.detach())
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=step % 2 == 0)
    runs[1][1].synchronize()
    assert resident(runs[1][0]) == 0  # the casts dropped the masters they read in
    assert_runs_equal(runs, losses)


def test_update_in_backward_over_accumulated_backwards(tmp_path):
    runs = twins(tmp_path, torch.optim.AdamW, {"lr": 1e-2, "fused": True}, num_slices=4,
                 optimizer_kwargs={"update_in_backward": True, "accumulation_steps": 2})
    losses = train(runs, 3, backwards=2)
    assert_runs_equal(runs, losses)


def test_resident_slices_and_a_weight_tied_across_slices(tmp_path):
    def tied():
        layers = network()
        layers[7] = nn.Linear(16, 16)
        layers[7].weight = layers[2].weight  # slice 2 borrows it from slice 1 (its holder), both staged
        return layers

    runs = twins(tmp_path, torch.optim.AdamW, {"lr": 1e-2, "fused": True}, num_slices=4, layers=tied,
                 resident_slices=1)
    model = runs[1][0]
    assert model._engine.slices[0].storage.resident and staged(model)
    assert any(s.storage.borrowed for s in model._engine.slices)
    losses = train(runs, 3)
    assert_runs_equal(runs, losses)


def test_a_checkpoint_resumes_exactly(tmp_path):
    def build(name):
        (tmp_path / name).mkdir()
        model = OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=BF16,
                             masters=tmp_path / name / "m", shadows="disk")
        return model, OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, disk_tier=tmp_path / name / "s")

    whole = build("whole")
    train([whole], 4)
    first = build("first")
    train([first], 2)
    save_checkpoint(tmp_path / "ckpt" / "step-2", *first)
    resumed = build("resumed")
    load_checkpoint(latest_checkpoint(tmp_path / "ckpt"), *resumed)
    assert resident(resumed[0]) == 0
    train([resumed], 2, first=2)
    assert_same(*whole, *resumed)


def test_ram_holds_the_staging_window_only(tmp_path):
    def layers():  # slices of unequal size: the window is two buffers of the largest one's shadow
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 256), nn.Linear(256, 64),
                             *[nn.Linear(64, 64) for _ in range(5)])

    (ram_model, ram), (model, optimizer) = runs = twins(tmp_path, layers=layers, num_slices=8)
    for step in range(2):
        for m, o in runs:
            m(torch.randn(4, 64, generator=torch.Generator().manual_seed(step))).float().pow(2).mean().backward()
            o.step()
            o.zero_grad()
    optimizer.synchronize()
    storages = [s.storage for s in model._engine.slices]
    largest = max(st.load_nbytes for st in storages)
    assert staged(model) and all(len(ram_model._engine.slices[k].storage.shadow) == st.load_nbytes
                                 for k, st in enumerate(storages))
    footprint, in_ram = model.memory_footprint(), ram_model.memory_footprint()
    assert footprint.host_shadows == STAGING_BUFFERS * largest < in_ram.host_shadows
    assert footprint.host_total == in_ram.host_total - in_ram.host_shadows + footprint.host_shadows
    # An evaluation forward reads every slice's masters in to cast them, and drops them again.
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert torch.equal(model(x), ram_model(x))
    assert resident(model) == 0
    assert model.memory_footprint().host_shadows == footprint.host_shadows


def test_the_disk_bytes_each_load_reads(tmp_path):
    runs = twins(tmp_path, torch.optim.AdamW, {"lr": 1e-2, "fused": True}, num_slices=4)
    train(runs, 1)
    read = []
    for model, optimizer in runs:
        optimizer.synchronize()  # expires the shadows in RAM: the next forward casts them again
        before = model._engine.master_files.counters.read_bytes
        train([(model, optimizer)], 2, first=1)
        optimizer.synchronize()
        read.append(model._engine.master_files.counters.read_bytes - before)
    slices = runs[1][0]._engine.slices
    masters = [s.storage.masters_file.nbytes for s in slices]
    grads = sum(s.storage.gradient_home.file.nbytes for s in slices)
    # Each step's updates read every slice's masters and gradients. Shadows in RAM: the first
    # forward casts them from the masters once more. On disk: every load reads its slice's
    # masters, the forward's four and the backward's reloads of the two not left in the slots.
    assert read[0] == 2 * (sum(masters) + grads) + sum(masters)
    assert read[1] == 2 * (sum(masters) + grads) + 2 * (sum(masters) + sum(masters[:2]))


def test_the_estimate_counts_the_staging_window(tmp_path):
    layers = nn.Sequential(*[nn.Linear(128, 128) for _ in range(8)])
    plan = estimate_memory(copy.deepcopy(layers), num_slices=4, compute_dtype=BF16, optimizer="adamw",
                           optimizer_state="disk", masters="disk", shadows="disk", device="cpu")
    in_ram = estimate_memory(copy.deepcopy(layers), num_slices=4, compute_dtype=BF16, optimizer="adamw",
                             optimizer_state="disk", masters="disk", device="cpu")
    model = OffloadModel(layers, device="cpu", num_slices=4, compute_dtype=BF16, masters=tmp_path / "m",
                         shadows="disk")
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, fused=True, disk_tier=tmp_path / "s")
    for _ in range(2):
        model(torch.randn(4, 128)).float().sum().backward()
        optimizer.step()
    optimizer.synchronize()
    measured = model.memory_footprint()
    assert measured.host_shadows == plan.host_shadows == in_ram.host_shadows // 2  # two of four slices' shadows
    assert plan.host_total == in_ram.host_total - in_ram.host_shadows // 2


def casts_by_thread(model, monkeypatch):
    """Each cast into a staging buffer from now on, as (its slice, whether it ran on the calling
    thread)."""
    casts = []
    slice_of = {s.storage.flat.data_ptr(): s.index for s in model._engine.slices}
    real = host_storage._cast_into

    def cast_into(shadow, flat, *args):
        casts.append((slice_of[flat.data_ptr()], threading.current_thread() is threading.main_thread()))
        real(shadow, flat, *args)

    monkeypatch.setattr(host_storage, "_cast_into", cast_into)
    return casts


def test_each_load_after_a_walks_first_is_cast_ahead_on_a_worker(tmp_path, monkeypatch):
    runs = twins(tmp_path, torch.optim.AdamW, {"lr": 1e-2, "fused": True}, num_slices=4)
    model = runs[1][0]
    casts = casts_by_thread(model, monkeypatch)
    losses = train([runs[1]], 2)
    # Per step: the forward's four loads, the first cast on the calling thread, and the backward's
    # reloads of slices 1 and 0 (2 and 3 stay in the slots), both cast ahead.
    assert casts == 2 * [(0, True), (1, False), (2, False), (3, False), (1, False), (0, False)]
    assert model._engine.staging.ahead is None  # no walk leaves a cast ahead behind
    monkeypatch.undo()
    assert_runs_equal(runs, train([runs[0]], 2) + losses)


def test_a_read_that_fails_ahead_of_a_load_raises_at_that_load(tmp_path, monkeypatch):
    runs = twins(tmp_path, torch.optim.AdamW, {"lr": 1e-2, "fused": True}, num_slices=4)
    model = runs[1][0]
    failing = model._engine.slices[2].storage.masters_file
    real = mapped.MappedFile.read_in
    failed_on = []

    def read_in(self, write=True):
        if self is failing:
            failed_on.append(threading.current_thread())
            raise OSError(errno.EIO, os.strerror(errno.EIO), self.path)
        real(self, write)

    monkeypatch.setattr(mapped.MappedFile, "read_in", read_in)
    message = (rf"^Input/output error \(errno 5\) in {re.escape(failing.path)}, the file that holds a slice's "
               r"float32 masters .* reload the last checkpoint$")  # as a read on the loading thread says it
    with pytest.raises(DiskTierError, match=message):
        loss_of(model, 0)
    # The read failed on the worker; the load of slice 2 raised it, and issued no copy.
    assert failed_on != [threading.main_thread()] and len(failed_on) == 1 and model._engine.slots.loads == 2
    monkeypatch.setattr(mapped.MappedFile, "read_in", real)
    losses = train(runs, 2)  # the failed forward left nothing behind: the runs still agree
    assert_runs_equal(runs, losses)


def leaving_out_is_caught(dependency):
    """Whether the shadows-on-disk scenario asks for ``dependency``, runs clean with it, and is
    reported without it, at a cast into a staging buffer."""
    from .test_streamcheck import run_quietly

    name = "offload_optimizer_shadows_on_disk"
    with StreamChecker() as checker:
        run_quietly(name)
    assert dependency in checker.dependencies and not checker.races
    with StreamChecker(leave_out=lambda d: d == dependency) as checker:
        run_quietly(name)
    return checker.left_out == {dependency} and bool(checker.races) and "_cast_into" in checker.summary()


def test_leaving_out_the_wait_for_a_staging_buffer_is_caught():
    # The cast overwrites a staging buffer that an asynchronous load is still copying.
    assert leaving_out_is_caught(Dependency("synchronize_event", "wait_host", "shadow_staging.py:stage", "load"))


@pytest.mark.parametrize("dependency", [
    # The cast ahead overwrites a buffer that an asynchronous load is still copying...
    Dependency("synchronize_event", "submit", "shadow_staging.py:stage_ahead", "load"),
    # ...or reads masters that the slice's host update is still writing...
    Dependency("synchronize_event", "submit", "shadow_staging.py:stage_ahead", "host update"),
    # ...or the load copies the buffer before the cast ahead has written it.
    Dependency("synchronize_event", "wait_host", "shadow_staging.py:stage", "shadow staging"),
], ids=str)
def test_leaving_out_an_ordering_of_a_cast_ahead_is_caught(dependency):
    assert leaving_out_is_caught(dependency)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="shadows='disk' casts each load from the masters on disk; pass masters="):
        OffloadModel(network(), device="cpu", compute_dtype=BF16, shadows="disk")
    with pytest.raises(ValueError, match="shadows must be 'ram' or 'disk', got 'nvme'"):
        OffloadModel(network(), device="cpu", compute_dtype=BF16, masters=tmp_path, shadows="nvme")
    with pytest.raises(ValueError, match="shadows='disk' .* needs masters='disk'"):
        estimate_memory([100] * 4, compute_dtype=BF16, shadows="disk")


def test_copies_and_pickles_keep_the_shadows_on_disk(tmp_path):
    model = OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=BF16, masters=tmp_path, shadows="disk")
    twin = copy.deepcopy(model)
    assert staged(twin) and "shadows staged from disk" in repr(twin)
    x = torch.randn(4, 6)
    with torch.no_grad():
        assert torch.equal(model(x), twin(x))


def test_a_model_pickled_before_the_setting_existed_keeps_its_shadows_in_ram():
    model = OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=BF16)
    state = model.__getstate__()
    del state["_shadows"]
    twin = OffloadModel.__new__(OffloadModel)
    twin.__setstate__(state)
    assert twin._shadows == "ram" and not staged(twin)
    loss_of(twin, 0).backward()


LLAMA_3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
              "max_position_embeddings": 8192, "tie_word_embeddings": False}


def test_the_planner_keeps_the_shadows_off_ram_only_where_they_do_not_fit(tmp_path, monkeypatch):
    """Issue 41's target: a full fine-tune of Llama-3-8B on a 24 GB GPU with 32 GB of RAM and a disk."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no calibration of this machine: --gpu's rates
    from offload.cli import plan_models

    from .test_planning import _offload

    # Both plans profile the same model on the same batch (the host memory is no input of it): the
    # second reuses the first's profile of each compute dtype, the larger part of a plan's time.
    profiles = {}
    profile_layers = plan_models.profile_layers

    def profiled_once(layers, make_input, *, compute_dtype=None):
        if compute_dtype not in profiles:
            profiles[compute_dtype] = profile_layers(layers, make_input, compute_dtype=compute_dtype)
        return profiles[compute_dtype]

    monkeypatch.setattr(plan_models, "profile_layers", profiled_once)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_3_8B))
    chosen = {}
    for host in ("40", "32"):
        done = _offload("plan", "--hf-config", str(config), "--gpu", "rtx-4090", "--host-memory", host,
                        "--disk-dir", str(tmp_path), "--disk", "500", "--json")
        chosen[host] = json.loads(done.stdout)["chosen"]
    # With room for them the shadows stay in RAM: their loads read no disk, so the step is faster.
    assert chosen["40"]["shadows"] == "ram" and chosen["40"]["time"]["staging"] == 0
    assert chosen["32"]["fits"] and chosen["32"]["shadows"] == "disk" and chosen["32"]["masters"] == "disk"
    assert chosen["32"]["host_bytes"] <= 0.9 * 32 * 2**30 < chosen["40"]["host_bytes"]
    assert 'shadows="disk"' in chosen["32"]["code"] and "--shadows-on-disk" in chosen["32"]["finetune"]
    # Their cost is in the step: the loads' reads of the masters from the disk.
    assert chosen["32"]["time"]["staging"] > 0 and chosen["32"]["step_s"] > chosen["40"]["step_s"]


def test_the_planned_update_writes_no_shadow():
    """With the shadows on disk the host update writes only the masters: the planner's update bytes
    leave the shadow out (2 bytes a parameter under bfloat16), and no separate shadow pass."""
    from offload.planning.planner import slice_layout
    from offload.planning.timing import StepConfig, traffic

    layout = slice_layout([1_000_000] * 8, num_slices=4, compute_dtype=torch.bfloat16)
    config = StepConfig(num_slices=4, compute_dtype=torch.bfloat16, optimizer_state="disk", masters="disk")
    in_ram, on_disk = (traffic(layout, None, replace(config, shadows=place)) for place in ("ram", "disk"))
    streamed = sum(layout.trainable_counts)
    assert on_disk.shadow == 0
    assert in_ram.update + in_ram.shadow - on_disk.update == 2 * streamed


def test_the_plan_of_a_llama_shaped_model_on_disk_holds_what_it_predicts(tmp_path, monkeypatch):
    """`offload plan` chooses the disk configuration for a small Llama (the proportions of Llama 3:
    untied head, grouped key-value heads, an MLP 3.5 times as wide); trained so, as it prints,
    the model's footprint is the plan's host bytes within 5 % (the plan's pool is pinned and rounded
    to its size classes, a CPU's is not)."""
    transformers = pytest.importorskip("transformers")
    from offload import clip_grad_norm_
    from offload.cli.plan import parse_args, run_plan
    from offload.integrations.transformers import causal_lm_sequential

    config = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 896, "num_hidden_layers": 8,
              "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 4008, "max_position_embeddings": 128,
              "tie_word_embeddings": False}
    with monkeypatch.context() as cache:
        cache.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no calibration of this machine: --gpu's rates
        plan, _, _, _ = run_plan(parse_args([
            "--hf-config", json.dumps(config), "--gpu", "rtx-4090", "--device-memory", "0.05", "--host-memory", "0.1",
            "--disk-dir", str(tmp_path), "--disk", "500", "--batch-size", "2", "--seq-len", "64", "--num-slices", "8",
            "--max-grad-norm", "1"]))
    chosen = plan.chosen.config
    assert (chosen.optimizer_state, chosen.masters, chosen.shadows) == ("disk", "disk", "disk")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    model = OffloadModel(causal_lm_sequential(hf, loss_chunk_tokens=1024), device="cpu", num_slices=chosen.num_slices,
                         compute_dtype=BF16, masters=DiskTier(tmp_path / "masters"), shadows="disk",
                         resident_slices=chosen.resident_slices)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-4, fused=True, disk_tier=DiskTier(tmp_path / "state"))
    ids = torch.randint(0, config["vocab_size"], (2, 64))
    for _ in range(3):  # the steady state: the pool frees what the first step alone took after two more
        model({"input_ids": ids, "labels": ids}).sum().backward()
        clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    measured, predicted = model.memory_footprint(), plan.chosen.memory
    for category in ("masters", "shadows", "gradients", "optimizer_state", "disk_window"):
        assert predicted.host_categories()[category] == measured.host_categories()[category], category
    assert measured.host_total == pytest.approx(predicted.host_total, rel=0.05)
    assert measured.disk == pytest.approx(predicted.disk, rel=0.05)
