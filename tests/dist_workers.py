"""What each rank runs in ``test_distributed.py`` (spawned processes import it from here).

Every job takes ``(rank, world_size, directory)``, joins a gloo group through a file store in
``directory`` with a short timeout, and saves what it wants compared to ``directory/<job>.<rank>.pt``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from offload import OffloadModel, OffloadOptimizer
from offload.streams.collectives import CollectiveError

TIMEOUT_S = 8


def network(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def data(step: int, world_size: int, rows: int = 4) -> torch.Tensor:
    """The whole batch of a step: rank r trains on rows [r * rows, (r + 1) * rows)."""
    return torch.randn(world_size * rows, 6, generator=torch.Generator().manual_seed(1000 + step))


def share(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return batch.chunk(world_size)[rank]


def join(rank: int, world_size: int, directory: str, backend: str = "gloo") -> None:
    store = dist.FileStore(os.path.join(directory, "store"), world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))


def save(directory: str, job: str, rank: int, value: Any) -> None:
    torch.save(value, os.path.join(directory, f"{job}.{rank}.pt"))


def run(rank: int, world_size: int, directory: str, job: str, backend: str = "gloo") -> None:
    join(rank, world_size, directory, backend)
    try:
        JOBS[job](rank, world_size, directory)
    finally:
        dist.destroy_process_group()


def train(rank: int, world_size: int, directory: str) -> None:
    """Ranks start from different seeds; SGD with momentum and AdamW, three steps each."""
    results = {}
    for name, make in (("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True)),
                       ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True))):
        model = OffloadModel(network(seed=rank), device="cpu", num_slices=3, process_group=dist.group.WORLD)
        optimizer = make(list(model.parameters()))
        for step in range(3):
            optimizer.zero_grad()
            model(share(data(step, world_size), rank, world_size)).pow(2).mean().backward()
            optimizer.step()
        results[name] = [p.detach().clone() for p in model.parameters()]
    save(directory, "train", rank, results)


def no_sync(rank: int, world_size: int, directory: str) -> None:
    """Accumulation over three micro-steps, the first two under no_sync."""
    model = OffloadModel(network(seed=0), device="cpu", num_slices=3, process_group=dist.group.WORLD)
    for micro in range(3):
        batch = share(data(micro, world_size), rank, world_size)
        if micro < 2:
            with model.no_sync():
                (model(batch).pow(2).mean() / 3).backward()
        else:
            (model(batch).pow(2).mean() / 3).backward()
    save(directory, "no_sync", rank, [p.grad.clone() for p in model.parameters()])


def sharded(rank: int, world_size: int, directory: str) -> None:
    """OffloadOptimizer updates each rank's share; float32 and bfloat16 compute."""
    results: dict[str, Any] = {}
    for dtype in (None, torch.bfloat16):
        model = OffloadModel(network(seed=0), device="cpu", num_slices=3, compute_dtype=dtype,
                             process_group=dist.group.WORLD)
        optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
        assert optimizer._collectives is not None
        for step in range(3):
            model(share(data(step, world_size), rank, world_size)).float().pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
        owned = len(optimizer.state)
        full = optimizer.consolidated_state_dict(to=0)
        results[str(dtype)] = {"params": [p.detach().clone() for p in model.parameters()], "owned": owned,
                               "state": full, "outputs": model(data(9, 1)).detach().float()}
    save(directory, "sharded", rank, results)


def different_models(rank: int, world_size: int, directory: str) -> None:
    layers = network(seed=0) if rank == 0 else nn.Sequential(nn.Linear(6, 17), nn.Tanh(), nn.Linear(17, 3))
    try:
        OffloadModel(layers, device="cpu", num_slices=2, process_group=dist.group.WORLD)
    except ValueError as error:
        save(directory, "different_models", rank, str(error))


def one_rank_fails(rank: int, world_size: int, directory: str) -> None:
    model = OffloadModel(network(seed=0), device="cpu", num_slices=3, process_group=dist.group.WORLD)
    if rank == 1:
        save(directory, "one_rank_fails", rank, "failed before backward")
        return  # leaves the step: the others wait in vain
    try:
        model(share(data(0, world_size), rank, world_size)).sum().backward()
    except CollectiveError as error:
        save(directory, "one_rank_fails", rank, str(error))


def hangs(rank: int, world_size: int, directory: str) -> None:
    """Never returns: the test's deadline must end it."""
    threading.Event().wait()


def nccl_one_gpu(rank: int, world_size: int, directory: str) -> None:
    """NCCL on one GPU: the device-side average, and the sharded update over a gloo group."""
    torch.cuda.set_device(0)
    model = OffloadModel(network(seed=0), device="cuda", num_slices=3, process_group=dist.group.WORLD)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True,
                                 process_group=dist.new_group(backend="gloo"), shard=True)
    for step in range(3):
        with model.no_sync() if step == 0 else torch.enable_grad():
            model(share(data(step, 1), 0, 1).cuda()).pow(2).mean().backward()
        if step > 0:
            optimizer.step()
            optimizer.zero_grad()
    save(directory, "nccl_one_gpu", rank, [p.detach().clone() for p in model.parameters()])


def tied_data(step: int, world_size: int, rows: int = 4) -> torch.Tensor:
    return torch.randn(world_size * rows, 8, generator=torch.Generator().manual_seed(2000 + step))


def tied_steps(model: nn.Module, optimizer: torch.optim.Optimizer, batches) -> None:
    """Two steps of three micro-steps each; ``batches(i)`` is micro-step i's batch."""
    for step in range(2):
        for micro in range(3):
            sync = micro == 2 or not isinstance(model, OffloadModel)
            with contextlib.nullcontext() if sync else model.no_sync():
                (model(batches(step * 3 + micro)).pow(2).mean() / 3).backward()
        optimizer.step()
        optimizer.zero_grad()


def tied(rank: int, world_size: int, directory: str) -> None:
    """An embedding tied to the head across slices: averaged once per backward, accumulated under
    no_sync, and stepped once by its owner in the sharded update."""
    from .stream_scenarios import tied_mlp

    model = OffloadModel(tied_mlp().eval(), device="cpu", num_slices=3, process_group=dist.group.WORLD)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    tied_steps(model, optimizer, lambda i: share(tied_data(i, world_size), rank, world_size))
    save(directory, "tied", rank, [p.detach().clone() for p in model.parameters()])


def layouts_network(seed: int) -> nn.Sequential:
    """A channels_last convolution and a linear weight transposed in memory (dense, not row-major)."""
    torch.manual_seed(seed)
    layers = nn.Sequential(nn.Conv2d(2, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))
    layers = layers.to(memory_format=torch.channels_last)
    layers[3].weight = nn.Parameter(layers[3].weight.detach().t().contiguous().t())
    return layers


def layouts_data(step: int, world_size: int, rows: int = 2) -> torch.Tensor:
    x = torch.randn(world_size * rows, 2, 4, 4, generator=torch.Generator().manual_seed(2000 + step))
    return x.to(memory_format=torch.channels_last)


def layouts(rank: int, world_size: int, directory: str) -> None:
    """Ranks start from different seeds: rank 0's parameters reach every rank, gradients are
    averaged and the sharded update shares its parameters, whatever their memory layout."""
    model = OffloadModel(layouts_network(seed=rank), device="cpu", num_slices=3, process_group=dist.group.WORLD)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    for step in range(3):
        model(share(layouts_data(step, world_size), rank, world_size)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    save(directory, "layouts", rank, [(p.detach().clone(), p.stride()) for p in model.parameters()])


def sharded_disk(rank: int, world_size: int, directory: str) -> None:
    """The sharded update with each rank's state in a disk tier under one shared path, against the
    sharded update with the state in RAM."""
    results: dict[str, Any] = {}
    for tier in (None, os.path.join(directory, "tier")):
        model = OffloadModel(network(seed=0), device="cpu", num_slices=3, process_group=dist.group.WORLD)
        optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, disk_tier=tier)
        for step in range(3):
            model(share(data(step, world_size), rank, world_size)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        optimizer.synchronize()
        run_ = {"params": [p.detach().clone() for p in model.parameters()],
                "state": optimizer.consolidated_state_dict(to=0),
                "owned_elements": sum(p.numel() for p in optimizer.state)}
        if tier is not None:
            run_["directory"] = str(optimizer._tier.directory)
            run_["files"] = sorted(os.listdir(optimizer._tier.directory))
            run_["disk_bytes"] = model.memory_footprint().disk
            optimizer.close()
        results[str(tier is not None)] = run_
    save(directory, "sharded_disk", rank, results)


def one_parameter_per_slice(seed: int) -> nn.Sequential:
    """Three slices of one parameter each: in each, one rank updates and the other only receives."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16, bias=False), nn.Tanh(), nn.Linear(16, 16, bias=False), nn.Tanh(),
                         nn.Linear(16, 3, bias=False))


def sharded_masters(rank: int, world_size: int, directory: str) -> None:
    """The sharded update under bfloat16 compute with each rank's masters on disk (one shared
    directory), against the same with the masters in RAM, and on the whole batch on every rank
    (the average of equal gradients is exact: one process's update); what stays resident."""
    from offload import DiskTier

    def resident(model: OffloadModel) -> int:
        return sum(s.storage.masters_file.resident_bytes() for s in model._engine.slices
                   if s.storage.masters_file is not None)

    def whole(batch: torch.Tensor, *_: Any) -> torch.Tensor:
        return batch

    masters = DiskTier(os.path.join(directory, "masters"))
    results: dict[str, Any] = {}
    for name, layers, place, rows in (("ram", network, None, share), ("disk", network, masters, share),
                                      ("disk-whole-batch", network, masters.path, whole),
                                      ("ram-one-owner", one_parameter_per_slice, None, share),
                                      ("disk-one-owner", one_parameter_per_slice, masters, share)):
        # Ranks start from different seeds: building takes rank 0's parameters into the files.
        model = OffloadModel(layers(seed=rank), device="cpu", num_slices=3, compute_dtype=torch.bfloat16,
                             process_group=dist.group.WORLD, masters=place)
        run_: dict[str, Any] = {}
        if place is not None:
            run_["resident_built"] = resident(model)
        optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
        assert optimizer._collectives is not None
        for step in range(3):
            model(rows(data(step, world_size), rank, world_size)).float().pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
        optimizer.synchronize()
        if place is not None:
            run_["resident_synchronized"] = resident(model)
        run_["outputs"] = model(data(9, 1)).detach().float()
        if place is not None:
            run_["resident_forward"] = resident(model)
        run_["owned"] = len(optimizer.state)
        run_["slices_only_received"] = sum(step.whole is None for step in optimizer._steps)
        run_["params"] = [p.detach().clone() for p in model.parameters()]
        results[name] = run_
    save(directory, "sharded_masters", rank, results)


JOBS = {f.__name__: f for f in (train, no_sync, sharded, different_models, one_rank_fails, hangs, nccl_one_gpu, tied,
                                 layouts, sharded_disk, sharded_masters)}
