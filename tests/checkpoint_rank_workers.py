"""What each rank runs in ``test_checkpoint_rank_paths.py`` and ``test_checkpoint_extra_per_rank.py``
(spawned processes import it from here).

Two ranks join a gloo group through a file store in the test's directory, save or load checkpoints
under ``directory/ckpt`` on paths that differ between them (or with an ``extra`` of each rank's
own), and write what each one saw to ``directory/<job>.<rank>.json``. A rank without a shared
filesystem is played by rank 1 writing its partial directory, or reading its checkpoint, somewhere
only it looks (the real case: each machine's own disk mounted at the same path).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from offload import OffloadModel, OffloadOptimizer, load_checkpoint, save_checkpoint

#: The group's timeout: a rank that waited for a refusing one would take this long, the test
#: wants every refusal far sooner.
TIMEOUT_S = 8


def run(rank: int, world_size: int, directory: str, job: str, store: str) -> None:
    """Run ``job`` on this rank and write what it returns to ``directory/<job>.<rank>.json``."""
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(directory, store), world_size), rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        outcome = JOBS[job](rank, Path(directory))
    finally:
        dist.destroy_process_group()
    # default=str: the path a save that was not refused returns
    (Path(directory) / f"{job}.{rank}.json").write_text(json.dumps(outcome, default=str))


def network() -> nn.Sequential:
    """The model every job trains (and the test loads into, as a plain module)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 2))


def build() -> tuple[OffloadModel, OffloadOptimizer]:
    """Data parallel over the default group; SGD with momentum, its state sharded over the ranks."""
    model = OffloadModel(network(), device="cpu", num_slices=3, process_group=dist.group.WORLD)
    return model, OffloadOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, fused=True)


def train_step(model: OffloadModel, optimizer: OffloadOptimizer, rank: int, step: int) -> None:
    rows = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
    model(rows).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def attempt(work: Callable[[], Any]) -> dict[str, Any]:
    """What ``work()`` raised (its class and message, ``None`` when nothing), and how long it took."""
    start = time.monotonic()
    outcome: dict[str, Any] = {"raised": None, "message": None, "result": None}
    try:
        outcome["result"] = work()
    except Exception as error:
        outcome.update(raised=type(error).__name__, message=str(error))
    outcome["seconds"] = time.monotonic() - start
    return outcome


def parameters(model: nn.Module) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in model.parameters()]


def save_on_other_paths(rank: int, directory: Path) -> dict[str, Any]:
    """Save step-1, then step-2 with each rank passing a path of its own (``keep_last=1``)."""
    model, optimizer = build()
    train_step(model, optimizer, rank, 1)
    save_checkpoint(directory / "ckpt" / "step-1", model, optimizer, extra={"step": 1}, keep_last=1)
    train_step(model, optimizer, rank, 2)
    return attempt(lambda: save_checkpoint(directory / "ckpt" / f"step-2-rank{rank}", model, optimizer,
                                           extra={"step": 2}, keep_last=1))


def save_without_a_shared_filesystem(rank: int, directory: Path) -> dict[str, Any]:
    """Save step-1, then step-2 (``keep_last=1``) with rank 1 writing where rank 0 does not look:
    ``directory/rank-1-disk``. Returns, as well, what is left there."""
    from offload.checkpoint import saver

    model, optimizer = build()
    train_step(model, optimizer, rank, 1)
    save_checkpoint(directory / "ckpt" / "step-1", model, optimizer, extra={"step": 1}, keep_last=1)
    train_step(model, optimizer, rank, 2)
    own = directory / "rank-1-disk"
    if rank == 1:
        own.mkdir()
        saver.partial_directory = lambda path: own / f".{path.name}.partial"
    outcome = attempt(lambda: save_checkpoint(directory / "ckpt" / "step-2", model, optimizer, extra={"step": 2},
                                              keep_last=1))
    outcome["left on rank 1's disk"] = sorted(str(p.relative_to(own)) for p in own.rglob("*")) if rank == 1 else None
    return outcome


def load_other_checkpoints(rank: int, directory: Path) -> dict[str, Any]:
    """Save step-1 and step-2 (and a copy of step-2 elsewhere), then load into a fresh model and
    optimizer: step-1 on rank 0 and step-2 on rank 1; step-2 by one path on both ranks, which on
    rank 1 reads step-1 (each rank's own filesystem); step-2 on rank 0 and its copy on rank 1."""
    from offload.checkpoint import loader

    model, optimizer = build()
    for step in (1, 2):
        train_step(model, optimizer, rank, step)
        save_checkpoint(directory / "ckpt" / f"step-{step}", model, optimizer, extra={"step": step})
    if rank == 0:
        shutil.copytree(directory / "ckpt" / "step-2", directory / "copy" / "step-2")
    dist.barrier()
    step_1, step_2 = directory / "ckpt" / "step-1", directory / "ckpt" / "step-2"
    fresh, fresh_optimizer = build()
    before = parameters(fresh)
    outcomes = {"other paths": attempt(lambda: load_checkpoint(step_1 if rank == 0 else step_2, fresh,
                                                               fresh_optimizer))}
    if rank == 1:
        committed = loader.committed
        loader.committed = lambda path: committed(step_1 if path == step_2 else path)
    outcomes["one path"] = attempt(lambda: load_checkpoint(step_2, fresh, fresh_optimizer))
    if rank == 1:
        loader.committed = committed
    unchanged = parameters(fresh) == before and not fresh_optimizer.state
    outcomes["a copy"] = attempt(lambda: load_checkpoint(step_2 if rank == 0 else directory / "copy" / "step-2",
                                                          fresh, fresh_optimizer))
    everyone: list[Any] = [None, None]
    dist.all_gather_object(everyone, parameters(fresh))
    return {**outcomes, "unchanged by the refusals": unchanged, "loaded alike": everyone[0] == everyone[1],
            "loaded the saved model": parameters(fresh) == parameters(model)}


def plain(value: Any) -> Any:
    """``value`` as JSON holds it: tensors as lists."""
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    return value.tolist() if isinstance(value, torch.Tensor) else value


def save_extra_per_rank(rank: int, directory: Path) -> dict[str, Any]:
    """Save, with every rank's extra its own, the same on every rank (a tensor in it too: compared
    by its pickled bytes), and, as releases before per-rank extras wrote it, every rank's under the
    one key ``extra`` (DCP keeps one); load each on both ranks. Returns, by checkpoint, what each
    load returned and warned, the bytes of extra the room check counted, this rank's extra's
    pickled size, and (rank 0) the checkpoint's extra keys."""
    from offload.checkpoint import saver
    from offload.checkpoint.checkpoint_files import pickled_size

    counted: list[int] = []
    check_room = saver._check_room
    saver._check_room = lambda group, rank, path, state, extra_nbytes, optimizer: (
        counted.append(extra_nbytes) or check_room(group, rank, path, state, extra_nbytes, optimizer))
    model, optimizer = build()
    train_step(model, optimizer, rank, 1)
    extras = {"own": {"rank": rank, "position": torch.tensor([10 * rank, rank])},
              "same": {"step": 1, "seen": torch.arange(3)}, "old": {"rank": rank}}
    outcome: dict[str, Any] = {}
    for name, extra in extras.items():
        if name == "old":
            saver._extra_keys = lambda digests: ["extra"] * len(digests)
        save_checkpoint(directory / "ckpt" / name, model, optimizer, extra=extra)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = load_checkpoint(directory / "ckpt" / name, model, optimizer)
        keys = FileSystemReader(directory / "ckpt" / name).read_metadata().state_dict_metadata
        outcome[name] = {"loaded": plain(loaded), "warned": [str(w.message) for w in caught],
                         "counted": counted[-1], "pickled": pickled_size(extra),
                         "keys": sorted(key for key in keys if key.startswith("extra"))}
    return outcome


JOBS = {f.__name__: f for f in (save_on_other_paths, save_without_a_shared_filesystem, load_other_checkpoints,
                                save_extra_per_rank)}
