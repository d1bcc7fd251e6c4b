"""offload: train ``nn.Sequential`` models larger than accelerator memory.

Wrap the model in :class:`OffloadModel` and train as usual; parameters live in host memory and
stream to the device slice by slice.

Note: [Glossary]
    The words below mean exactly this everywhere in the package.

    host copy
        A parameter or buffer as the user sees it: it lives on ``offload_device`` (pinned when the
        compute device is CUDA) and is the master the optimizer updates.
    device copy
        A slice's parameters and buffers in a device slot, used for compute and then overwritten.
    slice
        A contiguous run of layers that is loaded and run as a unit.
    slot
        A persistent device buffer that holds one slice's device copy; there are two, so one
        slice can load while the other computes.
    boundary activation
        The input of a slice for one microbatch: what a recompute starts from.
    microbatch
        A chunk of the batch along dim 0; every slice runs on each in turn.
    load / offload
        A copy host→device / device→host.
    ready event
        The event a copy records when it completes; compute waits on it. ``None`` on the CPU,
        where copies are synchronous.

Where each part lives (one concept a folder; ``docs/architecture.md`` has the layers and a concept
table):

- ``streams/``: host copies, device slots, every copy between host and device and its ordering;
- ``tiers/``: a slice's host update, and optimizer state and float32 masters kept in files;
- ``walk/``: slices, the engine that serves them, and one walk of the slices through the slots;
- ``autograd/``: what runs on each slice when autograd differentiates a walk;
- ``planning/``: memory by category and its prediction; the benchmarks' models;
- ``model.py``, ``optimizer.py``, ``data_parallel.py``, ``grad_scaler.py``: what users build;
- ``checkpoint/``: checkpoints written and read; ``loading/``: models loaded from safetensors;
- ``integrations/``, ``profiling/``, ``cli/``: other libraries, memory profiles, the commands;
- ``streamcheck/``: the stream-ordering checker that runs the CUDA paths on the CPU.
"""

# The one place the version is written: pyproject.toml reads it from here.
__version__ = "0.1.0"

from typing import TYPE_CHECKING

from .autograd.recompute_state import is_recomputing, will_recompute
from .clipping import clip_grad_norm_
from .tiers.disk_tier import DiskTier, DiskTierError
from .planning.footprint import MemoryFootprint
from .grad_scaler import GradScaler
from .loading.sequential import load_sequential
from .model import OffloadModel
from .walk.activation_policy import OffloadActivations
from .optimizer import OffloadOptimizer
from .planning.planner import estimate_memory
from .tiers.slice_update import HostUpdateError
from .streams.collectives import CollectiveError

__all__ = ["CheckpointError", "CollectiveError", "DiskTier", "DiskTierError", "GradScaler", "HostUpdateError", "MemoryFootprint",
           "OffloadActivations", "OffloadModel", "OffloadOptimizer", "clip_grad_norm_", "estimate_memory", "is_recomputing", "latest_checkpoint",
           "load_checkpoint", "load_sequential", "save_checkpoint", "will_recompute"]

# offload.checkpoint imports torch.distributed.checkpoint, which brings some two hundred
# torch.distributed modules and sympy: about a second, most of what `import offload` would add to
# `import torch`. Its names load on first use instead (PEP 562), so a script that never checkpoints
# does not pay for it.
_CHECKPOINT_NAMES = ("CheckpointError", "latest_checkpoint", "load_checkpoint", "save_checkpoint")

if TYPE_CHECKING:  # what type checkers and editors see: the names as if imported above
    from .checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint


def __getattr__(name: str) -> object:
    if name not in _CHECKPOINT_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import checkpoint

    value = getattr(checkpoint, name)
    globals()[name] = value  # later lookups find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_CHECKPOINT_NAMES})
