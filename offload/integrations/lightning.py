"""PyTorch Lightning around an :class:`~offload.OffloadModel`: what Lightning's own checkpoints leave out.

A ``LightningModule`` that holds an OffloadModel and returns an :class:`~offload.OffloadOptimizer`
(or any ``torch.optim`` optimizer over its parameters) from ``configure_optimizers`` trains with
Lightning as it is; ``docs/lightning.md`` says what Lightning does to the model and the optimizer.
This module holds the one piece Lightning lacks for a resume to equal the run that never stopped:
its checkpoints do not keep the random number generators, which dropout draws from.

``lightning`` is imported with this module only: ``import offload`` never needs it.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from ..checkpoint import _rng_state, _set_rng_state

__all__ = ["RandomState"]


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
