"""Training text read and tokenised lazily, packed into fixed-length blocks of token ids.

:func:`token_blocks` turns a file or a ``datasets`` directory into an iterator of ``block_size``
token ids, reading and tokenising a document (or, for plain text, a run of lines) at a time, so
memory stays flat in the corpus size: a 100 MB corpus costs what a 10 MB one does
(``benchmarks/bench_data.py``). :func:`split_blocks` holds out a fraction of the blocks for evaluation
and :func:`shuffled` mixes a stream through a bounded buffer. ``offload-finetune`` trains on them;
a ``transformers.Trainer`` or a plain loop can too (``torch.stack`` a few blocks into a batch, the
labels are the ids).

It does not pad, truncate or batch, and it does not read anything twice: a new pass over the data
calls :func:`token_blocks` again. A CSV file's cells are text as written, whatever they look like
(``NA``, ``12``, ``True``: no type is guessed). A ``DatasetDict`` is read by its ``train`` split,
and by its ``validation`` (else ``test``) split for evaluation (:func:`eval_blocks`). Plain text, JSON
lines and CSV are UTF-8 (a byte-order mark that opens the file is dropped, not read as text):
:func:`check_encoding` reads such a file through once, without tokenising, to find a byte that
does not decode before a pass over the data reaches it; :func:`check_readable` adds the first row
of a parquet or CSV file, read as a pass would read it, so a file its reader refuses is found
before a model is built.

Note: [Packing]
    Documents (a JSON lines record, a parquet row, a dataset row) are tokenised one by one, each
    followed by the tokenizer's end-of-sequence token when it has one (once: not after ids that
    already end with it), and joined into one stream that is cut into blocks of ``block_size`` ids:
    a block may hold the end of one document and the start of the next, and no token is padding.
    The last, shorter remainder is dropped. An empty document (no text, or text that gives no ids)
    adds nothing: no lone end-of-sequence token to train on.

    Plain text is one document, read and tokenised about ``TEXT_CHUNK_BYTES`` at a time (a line
    longer than that is read in parts, so memory stays flat whatever the line lengths), with no
    end-of-sequence token added. A tokenizer that wraps every text it is given in special tokens (its
    post-processor's: a BOS before, an EOS after, as Llama's ``add_eos_token``) has them as the whole
    text has them: the opening ones once at the start, the closing ones once after the last piece,
    none at a cut (:func:`_split_closing` tells the two apart; ``tests/test_data_readers.py``).

    A piece is cut before the last space that stands between two characters that are not
    whitespace; that space and what follows it start the next piece. Pre-tokenizers start a new word at such a space
    and never join it to the character before it: byte-level BPE (GPT-2's regex and the later ones
    built like it, as Llama 3's and Qwen's) and Metaspace (SentencePiece-style, which prepends its
    mark only to a text that does not already start with one), so the pieces' ids are the whole text's
    (``tests/test_data_edges.py``). Two cases still differ near a cut, by a few tokens per
    ``TEXT_CHUNK_BYTES``: a piece with no such space (text written without spaces between words,
    a single word longer than a piece) is cut where its read ends, and a tokenizer that adds a mark
    before every text it is given (a normalizer that prepends one, as the legacy Llama 2
    ``tokenizer.json`` has) adds it at each cut too.
"""

from __future__ import annotations

import codecs
import json
import logging
import os
import shlex
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["DataFormatError", "TEXT_SUFFIXES", "check_encoding", "check_readable", "eval_blocks", "read_documents",
           "shuffled", "split_blocks", "token_blocks"]

#: Suffixes read as plain text; ``.jsonl``/``.json``, ``.parquet``, ``.csv`` and directories are
#: the other formats. Anything else is refused rather than guessed.
TEXT_SUFFIXES = (".txt", ".text", ".md")
#: The formats ``datasets`` streams, by suffix: the builder and the name in messages.
STREAMED = {".parquet": ("parquet", "parquet"), ".csv": ("csv", "CSV")}
#: What a reader raises for a file it cannot read (pyarrow's ArrowInvalid and pandas' ParserError
#: are ValueErrors, as UnicodeDecodeError is; pyarrow's ArrowNotImplementedError a NotImplementedError),
#: or the system for a read it refuses (an OSError with an errno: :func:`_unreadable` words the two apart).
READER_ERRORS = (ValueError, OSError, NotImplementedError)
#: The splits of a ``DatasetDict`` that each purpose reads, the first one it holds; one that holds a
#: single split is read whatever its name.
_SPLITS = {"train": ("train",), "eval": ("validation", "test")}
#: What ``next`` gives for a stream that has ended: a row is never this.
_END = object()
#: How much plain text is read and tokenised at once (Note: [Packing]), in characters: bytes for ASCII.
#: A read costs about 20 times its size while its ids are Python lists: 5 MB here.
TEXT_CHUNK_BYTES = 1 << 18


class DataFormatError(ValueError):
    """A data source that cannot be read as training text; the message says what to change."""


def token_blocks(source: str | os.PathLike[str], tokenizer: Any, block_size: int, *,
                 text_field: str | None = None) -> Iterator[torch.Tensor]:
    """Yield ``block_size`` token ids at a time (int64, 1-D) from ``source``, packed (Note: [Packing]).

    Args:
        source: a plain-text file (``.txt``, ``.text``, ``.md``), a JSON lines file (``.jsonl``, or
            ``.json`` holding one object a line), a ``.parquet`` or ``.csv`` file, or a directory
            written by ``datasets``' ``save_to_disk`` (its ``train`` split when it holds several;
            :func:`eval_blocks` reads the one to evaluate on).
        tokenizer: a Hugging Face tokenizer (``__call__`` returning ``input_ids``); with chat
            records, one with a chat template.
        block_size: ids per block (the sequence length).
        text_field: the field holding each record's text; by default ``text``, else a chat
            ``messages`` list rendered with ``tokenizer.apply_chat_template``.

    Raises:
        DataFormatError: an unknown format, a record without the field (naming the keys found),
            text that is not UTF-8 (naming the byte), a JSON array given as JSON lines, a
            ``DatasetDict`` of several splits without ``train``, or a file its reader refuses (with the
            reader's reason) or the system cannot read (with the system's), when the reading reaches it.
        FileNotFoundError: ``source`` does not exist.

    Example::

        >>> blocks = token_blocks("corpus.jsonl", tokenizer, 1024)
        >>> batch = torch.stack([next(blocks) for _ in range(8)])   # 8 x 1024, labels = batch
    """
    return _packed(read_documents(source, tokenizer, text_field=text_field), tokenizer, block_size)


def eval_blocks(source: str | os.PathLike[str], tokenizer: Any, block_size: int, *,
                text_field: str | None = None) -> Iterator[torch.Tensor]:
    """:func:`token_blocks` of data to evaluate on: of a ``DatasetDict``, its ``validation`` split,
    else its ``test`` split, or its only split; never the ``train`` split beside them, which would
    report training-set figures as held-out ones. Any other source gives :func:`token_blocks`' blocks.

    Raises:
        DataFormatError: what :func:`token_blocks` raises, and for a ``DatasetDict`` of several splits
            with neither ``validation`` nor ``test``, naming its splits.
    """
    return _packed(read_documents(source, tokenizer, text_field=text_field, purpose="eval"), tokenizer, block_size)


def _packed(documents: Iterable[tuple[str, bool, bool]], tokenizer: Any, block_size: int) -> Iterator[torch.Tensor]:
    """:func:`read_documents`' texts tokenised and packed into blocks (Note: [Packing])."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    eos = getattr(tokenizer, "eos_token_id", None)
    pending: list[int] = []
    closing: list[int] = []  # the special tokens a tokenizer puts after a text: after plain text's last piece
    for text, is_document, special in documents:
        if is_document:
            ids = tokenizer(text, add_special_tokens=special)["input_ids"]
            if not ids:
                continue  # text that gives no ids adds nothing: no lone end-of-sequence token to train on
            pending.extend(ids)
            if eos is not None and ids[-1] != eos:  # some tokenizers end with it
                pending.append(eos)
        elif special:  # plain text's first piece: the whole text's opening special tokens, if any
            ids, closing = _split_closing(tokenizer, text)
            pending.extend(ids)
        else:
            pending.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        full = len(pending) - len(pending) % block_size
        for start in range(0, full, block_size):
            yield torch.tensor(pending[start:start + block_size], dtype=torch.long)
        del pending[:full]
    pending.extend(closing)
    for start in range(0, len(pending) - block_size + 1, block_size):
        yield torch.tensor(pending[start:start + block_size], dtype=torch.long)


def _split_closing(tokenizer: Any, text: str) -> tuple[list[int], list[int]]:
    """``text``'s ids with the tokenizer's special tokens, less the ones it puts after the text, and
    those: ``(ids, closing)``. A post-processor wraps a text's own ids (``TemplateProcessing``'s
    ``"<s> $A </s>"``, a Llama tokenizer's ``add_eos_token``); where they stand among the marked ids
    tells the opening tokens from the closing ones. Plain text keeps the opening ones at its start and
    the closing ones go after its last piece, as the whole text tokenised at once has them. The cost:
    the first piece tokenised twice, about ``TEXT_CHUNK_BYTES`` once a pass."""
    marked = tokenizer(text, add_special_tokens=True)["input_ids"]
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    for start in range(len(marked) - len(plain) + 1):
        if marked[start:start + len(plain)] == plain:
            return marked[:start + len(plain)], marked[start + len(plain):]
    return marked, []  # special tokens that do not wrap the text (none known): the first piece keeps them all


def read_documents(source: str | os.PathLike[str], tokenizer: Any = None, *, text_field: str | None = None,
                   purpose: str = "train") -> Iterator[tuple[str, bool, bool]]:
    """The texts of ``source`` one at a time, as ``(text, ends_a_document, add_special_tokens)``.

    Plain text comes in pieces of about ``TEXT_CHUNK_BYTES``, cut before a word (one stream: no
    piece ends a document, so no end-of-sequence token goes in it; the first piece alone says to add
    special tokens, which :func:`token_blocks` puts at the stream's ends); a record's text is a whole
    document, and an empty one is left out; a chat record is rendered by the tokenizer's template,
    which writes its own special tokens. ``purpose`` (``"train"`` or ``"eval"``) picks a
    ``DatasetDict``'s split, as :func:`token_blocks` and :func:`eval_blocks` read it.
    """
    if purpose not in _SPLITS:
        raise ValueError(f"purpose must be 'train' or 'eval', got {purpose!r}")
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if path.is_dir():
        yield from _records(_dataset_rows(path, purpose), path, tokenizer, text_field)
        return
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        yield from _text_pieces(path)
    elif suffix in (".jsonl", ".json"):
        yield from _records(_json_lines(path), path, tokenizer, text_field)
    elif suffix in STREAMED:
        yield from _records(_streamed_rows(path, suffix), path, tokenizer, text_field)
    else:
        raise DataFormatError(
            f"{path}: unknown data format {suffix or '(no suffix)'!r}; give plain text ({', '.join(TEXT_SUFFIXES)}), "
            "JSON lines (.jsonl, or .json with one object a line), .parquet, .csv or a datasets directory "
            "(save_to_disk)")


def check_encoding(source: str | os.PathLike[str]) -> None:
    """Read ``source`` through once, if it is plain text, JSON lines or CSV, and check that it is UTF-8.

    The readers decode lazily, so a bad byte deep in a large file would otherwise stop a pass over
    it where it lies; this costs a read of the file without tokenising (about the disk's speed).
    Other formats (parquet, datasets directories) are binary, decoded by ``datasets``, and not read.

    Raises:
        DataFormatError: the first byte that is not UTF-8, by offset and line, with the fix.
    """
    path = Path(source)
    if path.is_file() and path.suffix.lower() in (*TEXT_SUFFIXES, ".jsonl", ".json", ".csv"):
        _check_utf8(path)


def check_readable(source: str | os.PathLike[str]) -> None:
    """Check what can be checked of ``source`` in seconds, before a long pass over it: that it is
    UTF-8 (:func:`check_encoding`), and that a parquet or CSV file's reader opens it and reads its
    first row (a parquet file's footer and first row group; a CSV file's first chunk of rows).
    A file damaged further in is found when the reading reaches it, with the same error.

    Raises:
        DataFormatError: a byte that is not UTF-8, a file its reader refuses, or a read the system
            refuses (an I/O error, a permission), with the reason.
    """
    check_encoding(source)
    path = Path(source)
    if path.is_file() and path.suffix.lower() in STREAMED:
        next(_streamed_rows(path, path.suffix.lower()), None)


def _check_utf8(path: Path) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # of the chunk read next
    lines = 1  # the line the chunk read next starts in
    try:
        with path.open("rb") as file:
            while True:
                chunk = file.read(4 * TEXT_CHUNK_BYTES)
                # A sequence cut by the chunk's start waits in the decoder: its bytes come before the chunk's.
                pending = len(decoder.getstate()[0])
                try:
                    decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as error:
                    bad = offset - pending + error.start
                    line = lines + chunk[:max(bad - offset, 0)].count(b"\n")
                    raise _not_utf8(path, bad, line, error.object[error.start]) from None
                if not chunk:
                    return
                offset += len(chunk)
                lines += chunk.count(b"\n")
    except OSError as error:  # the system's (a permission, an I/O error): the file may be sound
        raise _unreadable(path, _format_name(path), f"from line {lines} on", error) from error


def _not_utf8(path: Path, offset: int, line: int, byte: int) -> DataFormatError:
    return DataFormatError(
        f"{path}: not UTF-8 text: byte 0x{byte:02x} at offset {offset} (line {line}) does not decode; re-encode "
        f"the file as UTF-8 (Latin-1 text, say: iconv -f LATIN1 -t UTF-8 {_converted(path, '-utf8' + path.suffix)})")


def _converted(path: Path, ending: str) -> str:
    """``path`` and the file a command advised to convert it writes, ``path``'s stem with
    ``ending``, shell-quoted: never ``path`` itself, which the shell would empty before the command
    reads it (``> data.jsonl`` for ``data.jsonl``), whatever its suffix or its letters' case."""
    return f"{shlex.quote(str(path))} > {shlex.quote(path.stem + ending)}"


def _utf8_lines(path: Path, limit: int = -1) -> Iterator[str]:
    """``path``'s lines, decoded as UTF-8 (universal newlines, as ``open`` reads text), a line longer
    than ``limit`` characters in parts of ``limit``; a byte that does not decode stops them with
    :func:`check_encoding`'s error, naming where it is.

    A byte-order mark that opens the file (Notepad's, PowerShell 5's ``Out-File``) is dropped: it
    marks the encoding and is no text, and ``json.loads`` refuses a line that starts with it.
    :func:`_check_utf8` accepts it (it decodes as UTF-8), so the two agree on what a file holds. A read
    the system refuses stops them with :func:`_unreadable`'s error, naming the line.
    """
    lines = 1  # the line read next
    try:
        with path.open(encoding="utf-8-sig") as file:
            # The text reader decodes incrementally: a character cut by a read waits for the next.
            while line := file.readline(limit):
                yield line
                lines += line.endswith("\n")
    except UnicodeDecodeError as error:
        # The text reader does not say where in the file the bad byte is: find it in the bytes.
        _check_utf8(path)
        raise DataFormatError(f"{path}: not UTF-8 text ({error}); re-encode the file as UTF-8") from error
    except OSError as error:  # the system's (a permission, an I/O error): the file may be sound
        raise _unreadable(path, _format_name(path), f"from line {lines} on", error) from error


def _format_name(path: Path) -> str:
    """What ``path``'s suffix says it holds, as messages name it."""
    suffix = path.suffix.lower()
    if suffix in STREAMED:
        return STREAMED[suffix][1]
    return "JSON lines" if suffix in (".jsonl", ".json") else "plain-text"


def _text_pieces(path: Path) -> Iterator[tuple[str, bool, bool]]:
    # Only the first piece gets the tokenizer's special tokens: token_blocks keeps the opening ones (a BOS)
    # there and puts the closing ones (an EOS) after the last piece, where the whole text has them.
    first = True
    piece: list[str] = []
    size = 0
    for line in _utf8_lines(path, TEXT_CHUNK_BYTES):
        piece.append(line)
        size += len(line)
        if size >= TEXT_CHUNK_BYTES:
            text = "".join(piece)
            cut = _word_start(text)
            yield text[:cut], False, first
            # The word after the cut starts the next piece (Note: [Packing]).
            piece, size, first = [text[cut:]], len(text) - cut, False
    if piece and size:
        yield "".join(piece), False, first


def _word_start(text: str) -> int:
    """Where to cut ``text`` so that the tokenizer reads both sides as it reads the whole: at the last
    space between two characters that are not whitespace, else at its end (Note: [Packing])."""
    space = len(text) - 1
    while (space := text.rfind(" ", 1, space)) > 0:
        if not text[space - 1].isspace() and not text[space + 1].isspace():
            return space
    return len(text)


def _json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    first = True
    for number, line in enumerate(_utf8_lines(path), 1):
        if not line.strip():
            continue
        if first and line.lstrip().startswith("["):
            # An array of records (Alpaca's format, pretty-printed or not) is JSON, but not JSON lines.
            raise DataFormatError(
                f"{path}, line {number}: a JSON array, not JSON lines (one object a line); convert it to one "
                f"record a line, e.g. jq -c '.[]' {_converted(path, '-lines.jsonl')}, and give that file")
        first = False
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as error:
            raise DataFormatError(
                f"{path}, line {number}: not a JSON object ({error.msg}); JSON lines hold one object a line"
            ) from error


def _streamed_rows(path: Path, suffix: str) -> Iterator[tuple[int, Any]]:
    """``path``'s rows, numbered, as ``datasets`` streams them; a file the reader refuses, at its
    opening or further in, stops them with a :class:`DataFormatError` naming the file and why."""
    datasets = _datasets(path)
    builder, what = STREAMED[suffix]
    reader_log = logging.getLogger(f"datasets.packaged_modules.{builder}.{builder}")
    level = reader_log.level
    # datasets logs the parquet reader's error as it raises it (opening the file, reading its first row
    # group): the error below says it once.
    reader_log.setLevel(logging.CRITICAL)
    try:
        options = _cells_as_written(path, datasets) if builder == "csv" else {}
        rows = iter(datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True, **options))
        row = next(rows, _END)
    except READER_ERRORS as error:
        raise _unreadable(path, what, "at or before row 1", error) from error
    finally:
        reader_log.setLevel(level)
    number = 1
    while row is not _END:
        yield number, row
        number += 1
        try:
            row = next(rows, _END)
        except READER_ERRORS as error:
            raise _unreadable(path, what, f"at or before row {number}", error) from error


def _cells_as_written(path: Path, datasets: Any) -> dict[str, Any]:
    """The CSV reader's options that read each cell as the text it is: a CSV file has no types, and
    pandas' guesses would turn a document that reads ``NA``, ``None``, ``nan`` or ``null`` into a null,
    ``12`` into an int and ``True`` into a bool, and a chunk of 10,000 rows far into the file whose
    cells all look like numbers into ints. An empty cell is an empty document: it adds nothing."""
    import pandas  # datasets' CSV reader is pandas'; it names the columns as that reader will

    columns = pandas.read_csv(path, nrows=0).columns
    return {"features": datasets.Features({name: datasets.Value("string") for name in columns}), "na_filter": False}


def _unreadable(path: Path, what: str, where: str, error: Exception) -> DataFormatError:
    """The error for ``path``, a ``what`` file whose reading stopped ``where`` (``"at or before row 3"``)
    with ``error``: a file that is not what its suffix says, or, for an error with an errno, a read the
    system refused."""
    if isinstance(error, UnicodeDecodeError):
        _check_utf8(path)  # names the byte, by offset and line
    reason = " ".join(str(error).split()) or "no reason given"
    # An OSError with an errno is the system's (an I/O error, a permission): the file may be sound. One
    # without is a reader's: pyarrow raises OSError for corrupt data in a parquet file ("Corrupt snappy
    # compressed data").
    if isinstance(error, OSError) and error.errno is not None:
        return DataFormatError(f"{path}: could not be read, {where} ({type(error).__name__}: "
                               f"{reason}); the system refused the read, not the {what} reader: check the disk "
                               "and the file's permissions, and run again")
    return DataFormatError(f"{path}: not a {what} file its reader can read, {where} "
                           f"({type(error).__name__}: {reason}); fix or re-export the file")


def _dataset_rows(path: Path, purpose: str) -> Iterator[tuple[int, Any]]:
    datasets = _datasets(path)
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as error:
        raise DataFormatError(f"{path}: a directory, but not one written by datasets' save_to_disk ({error})") from error
    if isinstance(loaded, datasets.DatasetDict):
        # An eval split read from the train split would report training-set figures as held-out ones.
        split = next((name for name in _SPLITS[purpose] if name in loaded), None)
        if split is None and len(loaded) != 1:
            wanted = " or ".join(map(repr, _SPLITS[purpose]))
            advice = ("save the split to train on alone" if purpose == "train" else
                      "save the split to evaluate on alone, or as 'validation' beside the others")
            raise DataFormatError(f"{path}: a DatasetDict with splits {sorted(loaded)} and no {wanted}; {advice}")
        loaded = loaded[split] if split is not None else next(iter(loaded.values()))
    # An Arrow table mapped from disk: rows are read as they are reached, not loaded whole.
    yield from enumerate(loaded, 1)


def _datasets(path: Path) -> Any:
    try:
        import datasets
    except ImportError as error:
        raise DataFormatError(f'{path}: reading it needs the datasets package: pip install "offload[data]"') from error
    return datasets


def _records(rows: Iterable[tuple[int, Any]], path: Path, tokenizer: Any,
             text_field: str | None) -> Iterator[tuple[str, bool, bool]]:
    for number, record in rows:
        if not isinstance(record, dict):
            raise DataFormatError(f"{path}, record {number}: a {type(record).__name__}, not an object with a text field")
        field = text_field or ("text" if "text" in record else "messages" if "messages" in record else None)
        if field is None or field not in record:
            wanted = f"field {text_field!r}" if text_field else "'text' field nor chat 'messages'"
            raise DataFormatError(
                f"{path}, record {number}: has no {wanted}; its keys are {sorted(record)}. "
                f"Name the field that holds the text with --text-field (text_field=...)")
        value = record[field]
        if isinstance(value, str) and (text_field is not None or field == "text"):
            if value:  # an empty document adds nothing (Note: [Packing])
                yield value, True, True
        elif isinstance(value, str):
            # Found by its name, "messages" promises a chat: text there is more likely a chat
            # serialised by mistake than the corpus, which --text-field says outright.
            raise DataFormatError(
                f"{path}, record {number}: field 'messages' holds text, not a list of chat messages "
                "({'role': ..., 'content': ...}); if that text is what to train on, say so with --text-field messages "
                "(text_field='messages')")
        elif isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value):
            yield _chat(value, tokenizer, path, number), True, False
        else:
            raise DataFormatError(f"{path}, record {number}: field {field!r} holds a {type(value).__name__}, "
                                  "not text or a list of chat messages ({'role': ..., 'content': ...})")


def _chat(messages: list[dict[str, Any]], tokenizer: Any, path: Path, number: int) -> str:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise DataFormatError(f"{path}, record {number}: chat messages, but the tokenizer has no chat template; "
                              "use a model whose tokenizer has one, or give the text in a field of its own")
    return tokenizer.apply_chat_template(messages, tokenize=False)


def split_blocks(blocks: Iterable[torch.Tensor], fraction: float, split: str) -> Iterator[torch.Tensor]:
    """The ``"train"`` or ``"eval"`` share of ``blocks``: block ``i`` is held out for evaluation
    when ``floor((i + 1) * fraction) > floor(i * fraction)``, so held-out blocks are spread evenly
    through the corpus and the two splits never share a block, without reading ahead."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"fraction must be in [0, 1), got {fraction}")
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    for i, block in enumerate(blocks):
        held_out = int((i + 1) * fraction) > int(i * fraction)
        if held_out == (split == "eval"):
            yield block


def shuffled(blocks: Iterable[torch.Tensor], buffer: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """``blocks`` in a random order drawn through a buffer of ``buffer`` blocks (memory: that many
    blocks): each block out is a random one of the buffer, replaced by the next block in. The
    order depends only on the blocks and the generator's state, so a run replayed from the same
    seed draws the same blocks. ``buffer`` 0 or 1 keeps the order."""
    if buffer <= 1:
        yield from blocks
        return
    held: list[torch.Tensor] = []
    for block in blocks:
        if len(held) < buffer:
            held.append(block)
            continue
        pick = int(torch.randint(buffer, (1,), generator=generator))
        yield held[pick]
        held[pick] = block
    while held:
        yield held.pop(int(torch.randint(len(held), (1,), generator=generator)))
