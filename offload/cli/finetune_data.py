"""``offload-finetune``'s data: the files checked before the model is built, and the batches of each step.

Batches are a function of the data options and the step alone (Note: [Never lose a run], rule 3, in
``offload/cli/finetune.py``): a resumed run replays the block stream to where the stopped one was.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
from collections.abc import Iterator
from pathlib import Path

import torch

from .finetune_args import fail

__all__ = ["Batches", "check_data_readable"]


def check_data_readable(args: argparse.Namespace) -> None:
    """Before the model is built, ``--data`` and ``--eval-file`` read as a pass will read them: plain
    text, JSON lines and CSV decode as UTF-8 (read through once), a parquet or CSV file's first row
    reads (``check_readable``), and each one's first document comes through the reader. The reading
    is lazy, so a bad byte deep in a large file, or a file its reader refuses, would otherwise stop
    the run when training reaches it; and what the first document shows (a wrong ``--text-field``,
    an empty file, chat records for a tokenizer without a chat template, a directory that is not a
    ``datasets`` save) would be refused only once the model is loaded, minutes in for a large one.

    Raises:
        DataFormatError: what the reader refuses, in its words.
        SystemExit: a file without a document, or ``--model`` without a tokenizer.
    """
    from ..integrations.data import TEXT_SUFFIXES, check_readable

    tokenizer = None
    for flag, path in (("--data", args.data), ("--eval-file", args.eval_file)):
        if path is None:
            continue
        check_readable(path)
        if tokenizer is None and (path.is_dir() or path.suffix.lower() not in TEXT_SUFFIXES):
            tokenizer = _run_tokenizer(args)  # records may be chats, which its template renders
        _check_first_document(flag, path, tokenizer, args.text_field)


def _run_tokenizer(args: argparse.Namespace):
    """The tokenizer the run will train with: ``--model``'s, or the random model's byte tokenizer."""
    from .models import byte_tokenizer, pretrained_tokenizer

    return byte_tokenizer() if args.model is None else pretrained_tokenizer(args.model)


def _check_first_document(flag: str, path: Path, tokenizer, text_field: str | None) -> None:
    """Read ``path``'s first document as training will (its record's field, a chat rendered by the
    tokenizer's template), and nothing more: a cost of one record whatever the file's size."""
    from ..integrations.data import read_documents

    purpose = "train" if flag == "--data" else "eval"  # --eval-file reads a DatasetDict's evaluation split
    with contextlib.closing(read_documents(path, tokenizer, text_field=text_field, purpose=purpose)) as documents:
        if next(documents, None) is None:
            use = "train on" if flag == "--data" else "evaluate on"
            raise fail(f"{flag} {path} holds no text (an empty file, or one without a record); give the text to {use}")


class Batches:
    """The run's batches: ``--batch-size`` blocks of the training stream at a time, and the fixed
    evaluation batches (Note: [Never lose a run], rule 3)."""

    def __init__(self, args: argparse.Namespace, tokenizer) -> None:
        self.args = args
        self.tokenizer = tokenizer

    def _blocks(self, path: Path, split: str | None) -> Iterator[torch.Tensor]:
        """``path``'s blocks, or its ``split`` share under ``--eval-fraction``; ``--eval-file``'s
        (``split`` None) are a ``DatasetDict``'s evaluation split, never its train split."""
        from ..integrations.data import eval_blocks, split_blocks, token_blocks

        if split is None:
            return eval_blocks(path, self.tokenizer, self.args.seq_len, text_field=self.args.text_field)
        blocks = token_blocks(path, self.tokenizer, self.args.seq_len, text_field=self.args.text_field)
        return split_blocks(blocks, self.args.eval_fraction, split)

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
