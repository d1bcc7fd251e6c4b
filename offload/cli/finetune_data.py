"""``offload-finetune``'s data: the files checked before the model is built, and the batches of each step.

Batches are a function of ``--seed`` and the step alone (Note: [Never lose a run], rule 3, in
``offload/cli/finetune.py``): a resumed run replays the block stream to where the stopped one was.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterator
from pathlib import Path

import torch

from .finetune_args import fail

__all__ = ["Batches", "check_data_readable"]


def check_data_readable(args: argparse.Namespace) -> None:
    """Before the model is built, ``--data`` and ``--eval-file`` read as a pass will read them: plain
    text, JSON lines and CSV decode as UTF-8 (read through once), and a parquet or CSV file's first
    row reads. The reading is lazy, so a bad byte deep in a large file, or a file its reader refuses,
    would otherwise stop the run when training reaches it (``check_readable``)."""
    from ..integrations.data import check_readable

    for path in (args.data, args.eval_file):
        if path is not None:
            check_readable(path)


class Batches:
    """The run's batches: ``--batch-size`` blocks of the training stream at a time, and the fixed
    evaluation batches (Note: [Never lose a run], rule 3)."""

    def __init__(self, args: argparse.Namespace, tokenizer) -> None:
        self.args = args
        self.tokenizer = tokenizer

    def _blocks(self, path: Path, split: str | None) -> Iterator[torch.Tensor]:
        """``path``'s blocks, or its ``split`` share under ``--eval-fraction``."""
        from ..integrations.data import split_blocks, token_blocks

        blocks = token_blocks(path, self.tokenizer, self.args.seq_len, text_field=self.args.text_field)
        return blocks if split is None else split_blocks(blocks, self.args.eval_fraction, split)

    def _epochs(self) -> Iterator[torch.Tensor]:
        for epoch in itertools.count():
            count = 0
            for block in self._blocks(self.args.data, "train"):
                count += 1
                yield block
            if count == 0:
                raise fail(f"--data {self.args.data} holds fewer than --seq-len {self.args.seq_len} "
                           "tokens for training; give more text or a shorter --seq-len")

    def train(self, skip: int = 0) -> Iterator[torch.Tensor]:
        """Batches of ``--batch-size`` blocks, epoch after epoch, after the first ``skip`` steps'."""
        from ..integrations.data import shuffled

        generator = torch.Generator().manual_seed(self.args.seed)
        blocks = shuffled(self._epochs(), self.args.shuffle_buffer, generator)
        per_step = self.args.batch_size * self.args.grad_accum
        for _ in itertools.islice(blocks, skip * per_step):
            pass  # replayed to where the stopped run was: the same shuffle, the same batches
        while True:
            yield torch.stack([next(blocks) for _ in range(self.args.batch_size)])

    def evaluation(self) -> list[torch.Tensor]:
        """The eval split's first ``--eval-batches`` batches (fewer when it is shorter), or none."""
        args = self.args
        if args.eval_file is None and not args.eval_fraction:
            return []
        held_out = self._blocks(args.eval_file, None) if args.eval_file else self._blocks(args.data, "eval")
        blocks = list(itertools.islice(held_out, args.eval_batches * args.batch_size))
        if not blocks:
            flag = "--eval-file" if args.eval_file else "--eval-fraction"
            raise fail(f"{flag}: the eval split holds no block of --seq-len {args.seq_len} tokens; "
                       "give more evaluation text or a larger fraction")
        return [torch.stack(blocks[i:i + args.batch_size]) for i in range(0, len(blocks), args.batch_size)]
