"""PyTorch Lightning around an :class:`~offload.OffloadModel`: what Lightning's own checkpoints leave out.

A ``LightningModule`` that holds an OffloadModel and returns an :class:`~offload.OffloadOptimizer`
(or any ``torch.optim`` optimizer over its parameters) from ``configure_optimizers`` trains with
Lightning as it is; ``docs/lightning.md`` says what Lightning does to the model and the optimizer.
This module holds what Lightning lacks:

- :class:`RandomState`, a callback: Lightning's checkpoints do not keep the random number
  generators, which dropout draws from, so without it a resumed run draws other masks.
- :class:`OffloadStrategy`, Lightning's single-device strategy with three changes: an
  OffloadOptimizer with a disk tier is checkpointed slice by slice through
  :func:`offload.save_checkpoint` instead of through ``state_dict()``, which would gather the
  tier's whole state in host memory; a loaded optimizer state stays beside its parameters (on
  the host) instead of moving to the accelerator; and ``gradient_clip_val`` clips by norm with
  :func:`offload.clip_grad_norm_` (the same result, the host gradients' norms on several threads).

``lightning`` is imported with this module only: ``import offload`` never needs it.

Note: [The file commits the pair]
    A checkpoint with a disk tier is two things: Lightning's file and the optimizers' states
    streamed beside it. ModelCheckpoint rewrites ``last.ckpt`` under the same name every epoch,
    and a process can die between any two writes, so the pair is made to change in one step, the
    file's write:

    1. Each save streams into a directory of its own, ``<file>.offload/<save id>/<index>`` (one
       :func:`offload.save_checkpoint` checkpoint per streamed optimizer, ``index`` its place in
       ``trainer.optimizers``: two disk tiers never share a directory). Nothing an earlier file
       names is touched.
    2. Then Lightning's file is written, its marker for each streamed optimizer naming
       ``<save id>/<index>``. Lightning writes it to a temporary file and moves it into place:
       until then the old file, naming the old directories, is the checkpoint.
    3. Then what no file names any more goes: the earlier saves' directories under this name,
       and what a killed save left.

    Killed (or failing) before the file's rename, the old pair is whole; a failure raises and
    first removes this save's directories. Killed after it, the new pair is whole, with leftovers
    the next save of that name removes. A load reads the directory the file names, beside the
    file or, for a link (``ModelCheckpoint(save_last="link")``), beside its target; a directory
    from another save is never read: its name differs. A file saved by an earlier version (its
    marker ``True``) loads from ``<file>.offload`` itself, as it was saved.

    What it leaves: a ``CheckpointIO`` that writes in the background (Lightning's
    ``AsyncCheckpointIO``) returns before the file is written, and step 3 runs while the old file
    still names what it removes; a kill then leaves a file whose directory is gone, which a load
    refuses (never a mixed pair). And the file's move is one rename only when the temporary
    directory (``TMPDIR``) is on the checkpoint's filesystem; across two, it is a copy, which a
    kill can leave torn (a file that does not load).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from . import install_hint
from ..checkpoint import load_checkpoint, save_checkpoint
from ..clipping import clip_grad_norm_
from ..checkpoint.contents import _rng_state, _set_rng_state
from ..optimizer import OffloadOptimizer

try:
    import lightning.pytorch as pl
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import SingleDeviceStrategy
except ImportError as error:
    raise ImportError(f"offload.integrations.lightning needs PyTorch Lightning: {install_hint('lightning')}") from error

__all__ = ["OffloadStrategy", "RandomState"]


class RandomState(pl.Callback):
    """Keep the random number generators in Lightning's checkpoints and restore them on resume.

    It saves the CPU generator, every CUDA device's (when CUDA is in use) and Python's ``random``,
    the generators :func:`offload.save_checkpoint` keeps, under ``checkpoint["offload_random_state"]``;
    ``trainer.fit(..., ckpt_path=...)`` puts them back before the first resumed step. With it, a
    model with dropout resumed from a checkpoint saved at the end of an epoch draws the masks the
    uninterrupted run drew (the data order must be restored too: ``docs/lightning.md``).

    The cost: a few kilobytes per checkpoint. A checkpoint saved without it resumes with the
    generators as the new process left them, as Lightning does by default.

    Example::

        >>> trainer = L.Trainer(callbacks=[ModelCheckpoint(every_n_epochs=1), RandomState()])
        >>> trainer.fit(task, loader, ckpt_path="last")
    """

    key = "offload_random_state"

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        checkpoint[self.key] = _rng_state()

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        if self.key in checkpoint:
            _set_rng_state(checkpoint[self.key])


class OffloadStrategy(SingleDeviceStrategy):
    """Lightning's single-device strategy for a model whose parameters and optimizer state live
    on the host.

    1. **A disk tier's state is streamed.** For an :class:`~offload.OffloadOptimizer` with a disk
       tier, Lightning's checkpoint file holds a marker in place of the optimizer's
       ``state_dict()``; the state goes, a slice at a time, into an :func:`offload.save_checkpoint`
       checkpoint in the directory beside the file (``epoch=3-step=400.ckpt.offload/<save
       id>/<index>``, one per such optimizer), and ``fit(ckpt_path=...)`` loads it back with
       :func:`offload.load_checkpoint`, which also restores the generators as saved (what
       :class:`RandomState` does). The file is written after the directory and names it, so
       that a save killed part way leaves the previous pair whole (Note: [The file commits the
       pair]). The cost: that directory holds the model's parameters too (``save_checkpoint``
       names the state by them), a second copy beside the file's. Copy or move the two together;
       a link to the file (``ModelCheckpoint(save_last="link")``) loads the directory beside its
       target.
    2. **A loaded state stays beside its parameters.** ``torch.optim``'s ``load_state_dict()``
       puts each state tensor on its parameter's device; Lightning then moves all of it to the
       accelerator, where an optimizer over host copies cannot step with it (and where it may not
       fit). This strategy leaves it there.
    3. **Clipping by norm is PyTorch's, on several threads.** Lightning clips with
       ``torch.nn.utils.clip_grad_norm_``, which computes each host gradient's norm on one thread;
       under this strategy a precision plugin that does not clip in its own way calls
       :func:`offload.clip_grad_norm_` instead, with the same result bit for bit (Note: [Norms on
       several threads] in ``offload/clipping.py``).

    Other optimizers, and an OffloadOptimizer without a disk tier, are saved in Lightning's file
    as usual. A weights-only checkpoint (``ModelCheckpoint(save_weights_only=True)``,
    ``trainer.save_checkpoint(path, weights_only=True)``) streams nothing: no directory beside the
    file (one an earlier save left under the same name is removed), and it loads as Lightning
    loads any weights-only checkpoint.

    Example::

        >>> trainer = L.Trainer(strategy=OffloadStrategy("cpu"), callbacks=[ModelCheckpoint(every_n_epochs=1)])
    """

    #: What Lightning's checkpoint holds in place of a streamed optimizer's ``state_dict()``.
    marker = "offload_streamed_state"

    def __init__(self, device: Any = "cpu", **kwargs: Any) -> None:
        super().__init__(device, **kwargs)
        self._loading_from: Path | None = None

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        precision = self.precision_plugin
        if type(precision).clip_grad_by_norm is Precision.clip_grad_by_norm:  # a plugin's own way stays

            def clip_grad_by_norm(optimizer: torch.optim.Optimizer, clip_val: int | float) -> None:
                clip_grad_norm_(precision.main_params(optimizer), clip_val)

            precision.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if _streamed(optimizer):
            return {self.marker: True}  # save_checkpoint() streams it and puts its directory's name here
        return super().optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | os.PathLike[str],
                        storage_options: Any = None) -> None:
        """Stream each disk tier's state into a directory of this save beside ``filepath``, then
        write Lightning's file naming it, then remove the earlier saves' directories under that
        name (Note: [The file commits the pair]).

        Raises:
            CheckpointError: a state's save failed (a full disk says so). It, and any error of
                Lightning's write, leaves the previous file and its directories intact: this
                save's directories are removed first.

        Warns:
            UserWarning: the checkpoint is saved, but an earlier save's directory under its name
                could not be removed (the next save of that name tries again).
        """
        # Only the states Lightning asked for (optimizer_state() left the marker): a weights-only
        # checkpoint (save_weights_only=True, weights_only=True) holds no "optimizer_states".
        states = checkpoint.get("optimizer_states") or []
        optimizers = list(map(_unwrapped, self.optimizers))
        streamed = [index for index, (optimizer, state) in enumerate(zip(optimizers, states))
                    if isinstance(state, Mapping) and self.marker in state and _streamed(optimizer)]
        save = uuid.uuid4().hex  # a name no earlier file under this name holds
        beside = _beside(filepath)
        if streamed:  # a copy: the dict is Lightning's, and callbacks have seen it as it was
            named = [{self.marker: f"{save}/{index}"} if index in streamed else state
                     for index, state in enumerate(states)]
            checkpoint = {**checkpoint, "optimizer_states": named}
        try:
            for index in streamed:
                save_checkpoint(beside / save / str(index), optimizers[index].model, optimizers[index])
            super().save_checkpoint(checkpoint, filepath, storage_options)
        except BaseException:
            # The old file still names the old directories: only this save's go (and the
            # directory beside the file, if this save made it).
            shutil.rmtree(beside / save, ignore_errors=True)
            with contextlib.suppress(OSError):
                beside.rmdir()  # only when empty
            raise
        _remove_unnamed(beside, save if streamed else None, filepath)

    def remove_checkpoint(self, filepath: str | os.PathLike[str]) -> None:
        super().remove_checkpoint(filepath)
        if _beside(filepath).is_dir():
            shutil.rmtree(_beside(filepath))

    def load_checkpoint(self, checkpoint_path: str | os.PathLike[str], weights_only: bool | None = None) -> dict[str, Any]:
        self._loading_from = Path(checkpoint_path)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load each optimizer's state, from the directory beside the file where it was streamed;
        leave it where ``load_state_dict()`` put it, beside its parameters.

        Raises:
            ValueError: a streamed state whose directory is not beside its file (nor beside the
                file a link points to), or for an optimizer that is not an OffloadOptimizer (the
                run is built differently). Checked for every optimizer before any state loads.
        """
        pairs = list(zip(map(_unwrapped, self.optimizers), checkpoint["optimizer_states"]))
        # Every directory found first: a refusal leaves every optimizer as it was.
        directories = [_streamed_into(self._loading_from, optimizer, state[self.marker])
                       if self.marker in state else None for optimizer, state in pairs]
        for (optimizer, state), directory in zip(pairs, directories):
            if directory is None:
                optimizer.load_state_dict(state)
            else:
                load_checkpoint(directory, optimizer.model, optimizer)


def _unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _streamed(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` keeps state in a disk tier, which ``state_dict()`` would gather."""
    optimizer = _unwrapped(optimizer)
    return isinstance(optimizer, OffloadOptimizer) and optimizer._tier is not None


def _beside(filepath: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(filepath)}.offload")


def _streamed_into(file: Path | None, optimizer: torch.optim.Optimizer, saved: str | bool) -> Path:
    """The directory that holds the state a checkpoint's marker ``saved`` names for ``optimizer``:
    ``<save id>/<index>`` inside the ``.offload`` beside ``file``, or beside the file a link
    points to; ``True`` (an earlier version's save) for that ``.offload`` itself.

    Raises:
        ValueError: ``optimizer`` is not an OffloadOptimizer, or the directory is not there.
    """
    if not isinstance(optimizer, OffloadOptimizer):
        raise ValueError(f"the checkpoint streamed this optimizer's state beside its file, but the optimizer "
                         f"is a {type(optimizer).__name__}; build the OffloadOptimizer the run saved")
    if file is None:
        raise ValueError("this checkpoint keeps the optimizer's state in a directory beside its file, and there is "
                         "no file; resume with trainer.fit(..., ckpt_path=...)")
    name = "" if saved is True else str(saved)
    target = Path(os.path.realpath(file))
    linked = target != Path(os.path.abspath(file))
    # A link's own name first (a link made beside a copied directory), then its target's, which
    # ModelCheckpoint(save_last="link") leaves as the only one.
    places = [_beside(file), _beside(target)] if linked else [_beside(file)]
    found = next((beside / name for beside in places if (beside / name).is_dir()), None)
    if found is not None:
        return found
    link = f" ({file} is a link to {target})" if linked else ""
    if not any(beside.is_dir() for beside in places):
        raise ValueError(f"this checkpoint keeps the optimizer's state in a directory beside its file, and there is "
                         f"no directory {' nor '.join(map(str, places))}{link}; copy or move the file together with "
                         f"its .offload directory, and resume with trainer.fit(..., ckpt_path=...)")
    held = "; ".join(f"{beside} holds {sorted(p.name for p in beside.iterdir()) if beside.is_dir() else 'nothing'}"
                     for beside in places)
    raise ValueError(f"this checkpoint's optimizer state was streamed into {name} in the .offload directory beside "
                     f"{file}{link}, which is not there ({held}): that directory is another save's under this name "
                     f"(the file was copied or moved without its own, or written by a CheckpointIO in the "
                     f"background and the process died). Copy or move the file together with the .offload "
                     f"directory saved with it, or resume from another checkpoint")


def _remove_unnamed(beside: Path, save: str | None, filepath: str | os.PathLike[str]) -> None:
    """Remove what ``beside`` holds other than the directory of ``save`` (all of it when ``None``):
    the earlier saves' under this file's name, which the file no longer names, and what killed
    saves left (Note: [The file commits the pair], step 3). The checkpoint is saved by then: a
    failure warns."""
    if not beside.is_dir():
        return
    leftovers = [beside] if save is None else [entry for entry in beside.iterdir() if entry.name != save]
    for leftover in leftovers:
        try:
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover)
            else:
                leftover.unlink()
        except OSError as error:
            warnings.warn(f"the checkpoint {os.fspath(filepath)} is saved, but {leftover}, which it does not name, "
                          f"could not be removed ({error}); the next save under this name tries again", stacklevel=3)
