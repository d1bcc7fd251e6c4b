"""What each rank runs in ``test_distributed.py`` (spawned processes import it from here).

Every job takes ``(rank, world_size, directory)``, joins a gloo group through a file store in
``directory`` with a short timeout, and saves what it wants compared to ``directory/<job>.<rank>.pt``.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import threading
import time
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


def sharded_state_dict(rank: int, world_size: int, directory: str) -> None:
    """Two steps, sharded and not: the sharded optimizer's state_dict() refuses (Note: [A sharded
    state_dict()]), on every rank, and what it advises gathers the whole state on rank 0; the
    unsharded one's state_dict() holds every parameter's state on every rank."""
    results: dict[str, Any] = {}
    for shard in (True, False):
        model = OffloadModel(network(seed=0), device="cpu", num_slices=3, process_group=dist.group.WORLD)
        optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, shard=shard)
        for step in range(2):
            model(share(data(step, world_size), rank, world_size)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        try:
            results[f"state_dict {shard}"] = optimizer.state_dict()
        except RuntimeError as error:
            results[f"state_dict {shard}"] = str(error)
        results[f"consolidated {shard}"] = optimizer.consolidated_state_dict(to=0)
        results[f"model {shard}"] = model.state_dict()
    save(directory, "sharded_state_dict", rank, results)


def different_models(rank: int, world_size: int, directory: str) -> None:
    layers = network(seed=0) if rank == 0 else nn.Sequential(nn.Linear(6, 17), nn.Tanh(), nn.Linear(17, 3))
    try:
        OffloadModel(layers, device="cpu", num_slices=2, process_group=dist.group.WORLD)
    except ValueError as error:
        save(directory, "different_models", rank, str(error))


def unfreezing_layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(64, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 32), nn.Tanh()), nn.Linear(32, 2)]


def unfreezing_data(step: int) -> torch.Tensor:
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(500 + step))


def unfreeze_at_step_2(model: nn.Module, optimizer: torch.optim.Optimizer, rows: Any) -> None:
    """AdamW over the last two layers, and at step 2 a group of the first one (unfrozen after a
    warm-up), which moves the second layer's weight to the other rank in a fresh plan of owners."""
    params = list(model.parameters())
    for step in range(4):
        if step == 2:
            optimizer.add_param_group({"params": params[:2], "lr": 5e-3})
        model(rows(step)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def sharded_add_param_group(rank: int, world_size: int, directory: str) -> None:
    model = OffloadModel(unfreezing_layers(), device="cpu", process_group=dist.group.WORLD)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, [{"params": list(model.parameters())[2:]}], lr=1e-2,
                                 fused=True)
    unfreeze_at_step_2(model, optimizer, lambda step: unfreezing_data(step).chunk(world_size)[rank])
    full = optimizer.consolidated_state_dict(to=0)
    save(directory, "sharded_add_param_group", rank,
         {"params": [p.detach().clone() for p in model.parameters()], "state": full})


def load_missing_on_one_rank(rank: int, world_size: int, directory: str) -> None:
    """Rank 1 is given a path that holds no checkpoint: every rank refuses the load, none waits."""
    from offload import CheckpointError, load_checkpoint, save_checkpoint

    model = OffloadModel(network(seed=0), device="cpu", num_slices=3, process_group=dist.group.WORLD)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    path = os.path.join(directory, "checkpoint")
    save_checkpoint(path, model, optimizer)
    try:
        load_checkpoint(path if rank == 0 else path + "-typo", model, optimizer)
    except CheckpointError as error:
        save(directory, "load_missing_on_one_rank", rank, str(error))


class _RankState(nn.Module):
    """A layer with extra state whose ``set_extra_state`` raises on rank 1."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.count = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def get_extra_state(self) -> Any:
        return {"count": self.count}

    def set_extra_state(self, state: Any) -> None:
        if dist.get_rank() == 1:
            raise ValueError("set_extra_state refuses on rank 1")
        self.count = state["count"]


def load_hook_fails_on_one_rank(rank: int, world_size: int, directory: str) -> None:
    """Rank 1 raises as the load ends (a module's set_extra_state), after the read: every rank
    raises, none waits; the optimizer's hooked keys the checkpoint holds are rank 0's."""
    from offload import CheckpointError, load_checkpoint, save_checkpoint

    model = OffloadModel(nn.Sequential(_RankState(), nn.Linear(4, 4)), device="cpu", num_slices=2,
                         process_group=dist.group.WORLD)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    optimizer.register_state_dict_post_hook(lambda opt, state: {**state, "from_rank": rank})
    seen: list[Any] = []
    optimizer.register_load_state_dict_pre_hook(lambda opt, state: seen.append(state.pop("from_rank")) or state)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()  # state on both ranks: DCP then keeps a key every rank offers from rank 1
    path = os.path.join(directory, "checkpoint")
    save_checkpoint(path, model, optimizer)
    try:
        load_checkpoint(path, model, optimizer)
        error = None
    except (CheckpointError, ValueError) as raised:
        error = f"{type(raised).__name__}: {raised}"
    save(directory, "load_hook_fails_on_one_rank", rank, {"error": error, "seen": seen})


def different_slices(rank: int, world_size: int, directory: str) -> None:
    try:
        OffloadModel(network(seed=0), device="cpu", num_slices=3 if rank == 0 else 2, process_group=dist.group.WORLD)
    except ValueError as error:
        save(directory, "different_slices", rank, str(error))


def one_rank_fails(rank: int, world_size: int, directory: str) -> None:
    model = OffloadModel(network(seed=0), device="cpu", num_slices=3, process_group=dist.group.WORLD)
    if rank == 1:
        save(directory, "one_rank_fails", rank, "failed before backward")
        return  # leaves the step: the others wait in vain
    try:
        model(share(data(0, world_size), rank, world_size)).sum().backward()
    except CollectiveError as error:
        save(directory, "one_rank_fails", rank, str(error))


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a bad batch")


class FailsInBackward(nn.Module):
    """The identity, whose backward raises while ``fail`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FailsInBackward.apply(x) if self.fail else x


def backward_fails_on_one_rank(rank: int, world_size: int, directory: str) -> None:
    """Rank 1's backward raises in the middle slice, after the last slice's averaging began; it
    catches the error and tries the next step, as a loop skipping a bad batch would."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), FailsInBackward(), nn.Linear(16, 16), nn.Tanh(),
                           nn.Linear(16, 3))
    model = OffloadModel(layers, device="cpu", num_slices=3, process_group=dist.group.WORLD)
    model.get_submodule("2").fail = rank == 1
    try:
        model(share(data(0, world_size), rank, world_size)).sum().backward()
    except RuntimeError as error:
        if rank == 0:
            save(directory, "backward_fails_on_one_rank", rank, f"{type(error).__name__}: {error}")
            return
    model.zero_grad()
    model.get_submodule("2").fail = False
    try:
        model(share(data(1, world_size), rank, world_size))
    except CollectiveError as error:
        save(directory, "backward_fails_on_one_rank", rank, str(error))


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


class Branch(nn.Module):
    """Branch ``a`` for rows whose first feature is positive, else ``b``; ``c`` is never taken."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if x[0, 0] > 0 else self.b(x)


def branch_network(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(Branch(), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


def branch_data(step: int, rank: int, first: float) -> torch.Tensor:
    """Rank ``rank``'s rows of a step, their first feature ``first`` (which picks the branch)."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(3000 + 10 * step + rank))
    x[:, 0] = first
    return x


def uneven_branch(rank: int, world_size: int, directory: str) -> None:
    """Rank 0 takes branch a, the others b, and none c: gradients of one backward, then three steps
    of a plain SGD and of a sharded OffloadOptimizer, with 2 and 3 slices."""
    first = 1.0 if rank == 0 else -1.0
    results: dict[str, Any] = {}
    for slices in (2, 3):
        for sharded_ in (False, True):
            model = OffloadModel(branch_network(seed=0), device="cpu", num_slices=slices,
                                 process_group=dist.group.WORLD)
            optimizer = (OffloadOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, fused=True) if sharded_
                         else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
            grads = None
            for step in range(3):
                model(branch_data(step, rank, first)).pow(2).mean().backward()
                if grads is None:
                    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
                optimizer.step()
                optimizer.zero_grad()
            results[f"{slices}-{sharded_}"] = {"grads": grads, "params": [p.detach().clone() for p in model.parameters()]}
    save(directory, "uneven_branch", rank, results)


def branch_in_no_sync(rank: int, world_size: int, directory: str) -> None:
    """Branch a only in the micro-step under no_sync, b only in the synced one."""
    results = {}
    for slices in (3, 4):
        model = OffloadModel(branch_network(seed=0), device="cpu", num_slices=slices, process_group=dist.group.WORLD)
        with model.no_sync():
            (model(branch_data(0, rank, 1.0)).pow(2).mean() / 2).backward()
        (model(branch_data(1, rank, -1.0)).pow(2).mean() / 2).backward()
        results[slices] = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    save(directory, "branch_in_no_sync", rank, results)


def frozen_on_one_rank(rank: int, world_size: int, directory: str) -> None:
    layers = network(seed=0)
    if rank == 1:
        layers[2].requires_grad_(False)
    try:
        OffloadModel(layers, device="cpu", num_slices=2, process_group=dist.group.WORLD)
    except ValueError as error:
        save(directory, "frozen_on_one_rank", rank, str(error))


def own_collectives(rank: int, world_size: int, directory: str) -> None:
    """The caller's own collectives on the model's group right after each step (a logged mean loss, a
    barrier), beside a second model on the same group, while the sharded updates' broadcasts run."""
    models = [OffloadModel(network(seed=k), device="cpu", num_slices=3, process_group=dist.group.WORLD)
              for k in range(2)]
    optimizers = [OffloadOptimizer(m, torch.optim.AdamW, lr=1e-2, fused=True) for m in models]
    logged = []
    for step in range(4):
        for model, optimizer in zip(models, optimizers):
            loss = model(share(data(step, world_size), rank, world_size)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            logged.append((total / world_size).item())
        dist.barrier()
    for optimizer in optimizers:
        optimizer.synchronize()
    params = [[p.detach().clone() for p in m.parameters()] for m in models]
    del models, optimizers, model, optimizer, loss  # (the last loss's graph holds its model too)
    gc.collect()
    save(directory, "own_collectives", rank, {"logged": logged, "params": params,
                                              "collectives threads left": collectives_threads_left()})


def collectives_threads_left(deadline_s: float = 10.0) -> int:
    """How many threads that run a model's collectives are alive once they had ``deadline_s`` to end."""
    deadline = time.monotonic() + deadline_s
    while True:
        left = sum(thread.name.endswith("collectives") for thread in threading.enumerate())
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def overlapping_groups(rank: int, world_size: int, directory: str) -> None:
    """Three ranks make groups [0, 1] and [1, 2] (each rank has then joined another number of
    groups); ranks 0 and 1 train a sharded model on the first."""
    first, _ = dist.new_group([0, 1]), dist.new_group([1, 2])
    if rank == 2:
        save(directory, "overlapping_groups", rank, None)
        dist.barrier()  # gone early, it could close the second group's connections while rank 1 makes them
        return
    model = OffloadModel(network(seed=0), device="cpu", num_slices=3, process_group=first)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    for step in range(2):
        model(share(data(step, 2), rank, 2)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    save(directory, "overlapping_groups", rank, [p.detach().clone() for p in model.parameters()])
    dist.barrier()


def batchnorm_network(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8), nn.BatchNorm1d(8),
                         nn.Linear(8, 2))


def batchnorm_data(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(4000 + 10 * step + rank)) * (1 + 3 * rank)


def batchnorm_checkpoint(rank: int, world_size: int, directory: str) -> None:
    """Per-rank BatchNorm statistics at a save, and what each rank loads from it."""
    from offload import load_checkpoint, save_checkpoint

    path = os.path.join(directory, "checkpoint")
    model = OffloadModel(batchnorm_network(seed=0), device="cpu", num_slices=3, process_group=dist.group.WORLD)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=0.1, fused=True)
    for step in range(2):
        model(batchnorm_data(step, rank)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    saved = {name: b.clone() for name, b in model.named_buffers()}
    save_checkpoint(path, model, optimizer)
    model = OffloadModel(batchnorm_network(seed=1), device="cpu", num_slices=3, process_group=dist.group.WORLD)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=0.1, fused=True)
    load_checkpoint(path, model, optimizer)
    save(directory, "batchnorm_checkpoint", rank, {"saved": saved,
                                                   "loaded": {name: b.clone() for name, b in model.named_buffers()}})


def _per_layer_groups(model: OffloadModel) -> list[dict[str, Any]]:
    """One parameter group per linear layer of :func:`network`."""
    return [{"params": list(model.get_submodule(str(k)).parameters())} for k in (0, 2, 4, 6)]


def _update_fails_on_rank_1(rank: int, world_size: int, directory: str, job: str, shard: bool) -> None:
    """Step 2's update of the second layer raises on rank 1 (a learning rate it cannot use); every rank
    then waits, trains two more steps, saves (refused), loads step 1's checkpoint and trains on."""
    from offload import CheckpointError, HostUpdateError, latest_checkpoint, load_checkpoint, save_checkpoint

    checkpoints = os.path.join(directory, "checkpoints")
    model = OffloadModel(network(seed=0), device="cpu", num_slices=3, process_group=dist.group.WORLD)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, _per_layer_groups(model), lr=1e-2, fused=True,
                                 shard=shard)

    def train_step(step: int) -> list[bool]:
        before = [p.detach().clone() for p in model.parameters()]
        model(share(data(step, world_size), rank, world_size)).pow(2).mean().backward()
        optimizer.step()
        optimizer.synchronize()
        optimizer.zero_grad()
        return [not torch.equal(a, b) for a, b in zip(before, model.parameters())]

    train_step(0)
    save_checkpoint(os.path.join(checkpoints, "step-1"), model, optimizer)
    saved = [p.detach().clone() for p in model.parameters()]
    model(share(data(1, world_size), rank, world_size)).pow(2).mean().backward()
    if rank == 1:
        optimizer.param_groups[1]["lr"] = "not a number"
    optimizer.step()
    optimizer.param_groups[1]["lr"] = 1e-2
    optimizer.zero_grad()
    result: dict[str, Any] = {}
    try:
        optimizer.synchronize()
    except HostUpdateError as error:
        result["raised"] = "\n".join([str(error), *getattr(error, "__notes__", [])])
    result["moved"] = [train_step(step) for step in (2, 3)]
    result["params"] = [p.detach().clone() for p in model.parameters()]
    try:
        save_checkpoint(os.path.join(checkpoints, "step-4"), model, optimizer)
    except (RuntimeError, CheckpointError) as error:
        result["save"] = f"{type(error).__name__}: {error}"
    result["latest"] = os.path.basename(latest_checkpoint(checkpoints))
    load_checkpoint(latest_checkpoint(checkpoints), model, optimizer)
    result["loaded"] = all(torch.equal(a, b) for a, b in zip(saved, model.parameters()))
    result["moved after load"] = train_step(1)
    result["params after load"] = [p.detach().clone() for p in model.parameters()]
    save_checkpoint(os.path.join(checkpoints, "step-2"), model, optimizer)
    save(directory, job, rank, result)


def sharded_update_fails_on_one_rank(rank: int, world_size: int, directory: str) -> None:
    _update_fails_on_rank_1(rank, world_size, directory, "sharded_update_fails_on_one_rank", shard=True)


def update_fails_on_one_rank(rank: int, world_size: int, directory: str) -> None:
    _update_fails_on_rank_1(rank, world_size, directory, "update_fails_on_one_rank", shard=False)


JOBS = {f.__name__: f for f in (train, no_sync, sharded, different_models, one_rank_fails, load_hook_fails_on_one_rank, backward_fails_on_one_rank,
                                 hangs, nccl_one_gpu, tied,
                                 layouts, sharded_disk, sharded_masters, uneven_branch, branch_in_no_sync,
                                 frozen_on_one_rank, own_collectives, batchnorm_checkpoint, overlapping_groups,
                                 sharded_update_fails_on_one_rank, update_fails_on_one_rank, different_slices,
                                 sharded_add_param_group, load_missing_on_one_rank, sharded_state_dict)}
