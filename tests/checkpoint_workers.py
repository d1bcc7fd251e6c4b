"""What each fresh process runs in ``test_checkpoint.py`` (spawned processes import it from here).

A job runs on one process (no process group) or on several (gloo over a file store in the test's
directory, as ``dist_workers.py`` does), and saves what the test compares to
``directory/<tag>.<rank>.pt``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from offload import OffloadModel, OffloadOptimizer, latest_checkpoint, load_checkpoint, save_checkpoint
from offload.optimizer import local_state_dict  # sharded, a rank's own share (state_dict() refuses it)

from .stream_scenarios import tied_mlp

TIMEOUT_S = 8
MICROSTEPS = 2  # gradient accumulation: two backwards per step


def run(rank: int, world_size: int, directory: str, job: str, kwargs: dict[str, Any], store: str = "store") -> None:
    """Run ``job``; several ranks meet through the file ``directory/store`` (one per job: a file
    store keeps the keys of the groups that used it before)."""
    if world_size == 1:
        JOBS[job](rank, world_size, directory, **kwargs)
        return
    store = dist.FileStore(os.path.join(directory, store), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        JOBS[job](rank, world_size, directory, **kwargs)
    finally:
        dist.destroy_process_group()


def batch(step: int, micro: int, rank: int, world_size: int, rows: int = 4) -> torch.Tensor:
    """Rank ``rank``'s rows of micro-step ``micro`` of step ``step``."""
    whole = torch.randn(world_size * rows, 8, generator=torch.Generator().manual_seed(1000 + 10 * step + micro))
    return whole.chunk(world_size)[rank]


def build(world_size: int, compute_dtype: torch.dtype | None, device: str = "cpu", num_slices: int = 3,
          disk_tier: str | None = None):
    """A run's model, optimizer, scheduler and scaler: an embedding tied to the head across
    slices, dropout, AdamW with a step schedule and a dynamic loss scale; the moments in files
    under ``disk_tier`` when given."""
    group = dist.group.WORLD if world_size > 1 else None
    model = OffloadModel(tied_mlp(), device=device, num_slices=num_slices, compute_dtype=compute_dtype,
                         process_group=group)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, disk_tier=disk_tier)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    # A small growth interval, so the scale changes within the test's few steps.
    scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=2.0**10, growth_interval=2)
    return model, optimizer, scheduler, scaler


def train(rank: int, world_size: int, directory: str, *, tag: str, steps: int, compute_dtype: str | None,
          save_at: int | None = None, resume: bool = False, seed: int = 0, device: str = "cpu",
          disk_tier: bool = False) -> None:
    """Train ``steps`` steps (from the checkpoint in ``directory/ckpt`` when ``resume``), saving
    after step ``save_at``; save the losses, parameters and state. With ``disk_tier``, the
    moments are kept in files under ``directory/tier``."""
    dtype = None if compute_dtype is None else getattr(torch, compute_dtype)
    torch.manual_seed(seed + rank)  # each rank's dropout draws its own numbers
    model, optimizer, scheduler, scaler = build(world_size, dtype, device,
                                                disk_tier=os.path.join(directory, "tier") if disk_tier else None)
    start = 0
    if resume:
        torch.manual_seed(12345)  # a fresh process's generators: the checkpoint must restore them
        extra = load_checkpoint(latest_checkpoint(os.path.join(directory, "ckpt")), model, optimizer)
        scheduler.load_state_dict(extra["scheduler"])
        scaler.load_state_dict(extra["scaler"])
        start = extra["step"]
    losses = []
    for step in range(start, steps):
        for micro in range(MICROSTEPS):
            sync = micro == MICROSTEPS - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                loss = model(batch(step, micro, rank, world_size).to(device)).float().pow(2).mean() / MICROSTEPS
                scaler.scale(loss).backward()
            losses.append(loss.item())
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad()
        if step + 1 == save_at:
            save_checkpoint(os.path.join(directory, "ckpt", f"step-{step + 1}"), model, optimizer,
                            extra={"step": step + 1, "scheduler": scheduler.state_dict(),
                                   "scaler": scaler.state_dict()})
    optimizer.synchronize()
    result = {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
              "optimizer": local_state_dict(optimizer), "scale": scaler.get_scale(),
              "lr": [g["lr"] for g in optimizer.param_groups], "rng": torch.get_rng_state(),
              "device_rng": torch.cuda.get_rng_state() if device.startswith("cuda") else None}
    torch.save(result, os.path.join(directory, f"{tag}.{rank}.pt"))


def reshard(rank: int, world_size: int, directory: str, *, tag: str, source: str, compute_dtype: str | None,
            disk_tier: bool = False) -> None:
    """Load the checkpoint in ``directory/<source>`` on this many ranks; save what each rank holds.
    With ``disk_tier``, into an optimizer that keeps its moments in files under
    ``directory/load-tier``, noting how many slices were being loaded at once at most."""
    dtype = None if compute_dtype is None else getattr(torch, compute_dtype)
    model, optimizer, _, _ = build(world_size, dtype,
                                   disk_tier=os.path.join(directory, "load-tier") if disk_tier else None)
    open_slices = [0, 0]  # now, at most

    def counted_open(index, saved):  # Note: [Slice-by-slice load]: opened at a slice's first item
        opened = type(optimizer._disk).open_slice_load(optimizer._disk, index, saved)
        store = opened.store
        open_slices[0] += 1
        open_slices[1] = max(open_slices)

        def counted_store():
            open_slices[0] -= 1
            store()

        opened.store = counted_store
        return opened

    optimizer._disk.open_slice_load = counted_open
    load_checkpoint(latest_checkpoint(os.path.join(directory, source)), model, optimizer)
    on_disk = optimizer._tier is not None and all(r.place.name == "DISK" for r in optimizer._tier.records.values())
    result = {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
              "optimizer": local_state_dict(optimizer), "consolidated": optimizer.consolidated_state_dict(to=0),
              "most_slices_open": open_slices[1], "all_on_disk": on_disk,
              "state_tensors_in_ram": sum(v.dim() > 0 for s in optimizer.state.values() for v in s.values())}
    torch.save(result, os.path.join(directory, f"{tag}.{rank}.pt"))


def counting_model() -> tuple[OffloadModel, OffloadOptimizer]:
    """A model and an optimizer with momentum state (a few MiB: a save takes a while)."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 8))
    model = OffloadModel(layers, device="cpu", num_slices=3)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, fused=True)
    for p in model.parameters():
        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)  # what a first step would leave
    return model, optimizer


def fill(model: OffloadModel, optimizer: OffloadOptimizer, counter: int) -> None:
    """Every parameter and momentum of a :func:`counting_model` set to ``counter``."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(counter)
            optimizer.state[p]["momentum_buffer"].fill_(counter)


def killed_in_commit(rank: int, world_size: int, directory: str, *, renames: int) -> None:
    """Save step-1 and step-2 in ``directory/ckpt`` (``keep_last=1``), then step-3, killed
    (SIGKILL: nothing runs after it) once its commit has made ``renames`` renames."""
    model, optimizer = counting_model()
    real = os.replace
    made = [0]

    def replace(source: Any, target: Any) -> None:
        if made[0] == renames:
            os.kill(os.getpid(), signal.SIGKILL)
        made[0] += 1
        real(source, target)

    for counter in (1, 2, 3):
        if counter == 3:
            os.replace = replace  # this process's last save
        fill(model, optimizer, counter)
        save_checkpoint(os.path.join(directory, "ckpt", f"step-{counter}"), model, optimizer,
                        extra={"counter": counter}, keep_last=1)


def keep_saving(rank: int, world_size: int, directory: str) -> None:
    """Save checkpoints step-n, step-n+1, ... (n: one past the latest) until killed, each with
    every parameter and momentum filled with its number; ``directory/saving`` appears once the
    first of them is saved (the first save of a process is the slowest: the kills fall in the
    others, which any save of a long run resembles)."""
    model, optimizer = counting_model()
    latest = latest_checkpoint(os.path.join(directory, "ckpt"))
    counter = 0 if latest is None else load_checkpoint(latest, model, optimizer)["counter"]
    while True:
        counter += 1
        fill(model, optimizer, counter)
        save_checkpoint(os.path.join(directory, "ckpt", f"step-{counter}"), model, optimizer,
                        extra={"counter": counter}, keep_last=3)
        if not os.path.exists(os.path.join(directory, "saving")):
            with open(os.path.join(directory, "saving"), "w"):
                pass


JOBS = {f.__name__: f for f in (train, reshard, keep_saving, killed_in_commit)}
