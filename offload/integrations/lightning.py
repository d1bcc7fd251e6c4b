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
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning.pytorch.plugins.precision import Precision

from ..checkpoint import load_checkpoint, save_checkpoint
from ..clipping import clip_grad_norm_
from ..checkpoint.contents import _rng_state, _set_rng_state
from ..optimizer import OffloadOptimizer

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
       directory beside the file (``epoch=3-step=400.ckpt.offload``, plus the ``latest`` file
       ``save_checkpoint`` writes), and ``fit(ckpt_path=...)`` loads it back with
       :func:`offload.load_checkpoint`, which also restores the generators as saved (what
       :class:`RandomState` does). The cost: that directory holds the model's parameters too
       (``save_checkpoint`` names the state by them), a second copy beside the file's. Copy or
       move the two together; ``ModelCheckpoint(save_last="link")`` links the file only.
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
            return {self.marker: True}  # saved beside the file by save_checkpoint
        return super().optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | os.PathLike[str],
                        storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)
        # Only the states Lightning asked for (optimizer_state() left the marker): a weights-only
        # checkpoint (save_weights_only=True, weights_only=True) holds no "optimizer_states".
        states = checkpoint.get("optimizer_states") or []
        streamed = [o for o, state in zip(map(_unwrapped, self.optimizers), states)
                    if isinstance(state, Mapping) and self.marker in state and _streamed(o)]
        if not streamed and _beside(filepath).is_dir():
            shutil.rmtree(_beside(filepath))  # an earlier save's under this name: the file no longer names it
        for optimizer in streamed:
            save_checkpoint(_beside(filepath), optimizer.model, optimizer)

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
            ValueError: a streamed state without the directory beside its file, or for an
                optimizer that is not an OffloadOptimizer (the run is built differently).
        """
        for optimizer, state in zip(map(_unwrapped, self.optimizers), checkpoint["optimizer_states"]):
            if self.marker not in state:
                optimizer.load_state_dict(state)
                continue
            if not isinstance(optimizer, OffloadOptimizer):
                raise ValueError(f"the checkpoint streamed this optimizer's state beside its file, but the optimizer "
                                 f"is a {type(optimizer).__name__}; build the OffloadOptimizer the run saved")
            if self._loading_from is None or not _beside(self._loading_from).is_dir():
                where = "no file" if self._loading_from is None else f"no directory {_beside(self._loading_from)}"
                raise ValueError(f"this checkpoint keeps the optimizer's state in a directory beside its file, and "
                                 f"there is {where}; copy or move the file together with its .offload directory, "
                                 f"and resume with trainer.fit(..., ckpt_path=...)")
            load_checkpoint(_beside(self._loading_from), optimizer.model, optimizer)


def _unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _streamed(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` keeps state in a disk tier, which ``state_dict()`` would gather."""
    optimizer = _unwrapped(optimizer)
    return isinstance(optimizer, OffloadOptimizer) and optimizer._tier is not None


def _beside(filepath: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(filepath)}.offload")
