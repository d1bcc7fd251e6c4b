"""The data reader at its edges: a line longer than a read, the cuts between the pieces of plain
text (the ids of a real BPE tokenizer are the whole text's), the random model's byte tokenizer
ending each document, and a ``--seq-len`` past a ``--model``'s learned positions.

Reads are made small (``TEXT_CHUNK_BYTES``) so that a few kilobytes of text cross many of them.
"""

from __future__ import annotations

import errno
import json
import os

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from offload.cli import finetune as cli  # noqa: E402
from offload.cli.finetune_args import DEFAULT_TEXT, parse_args  # noqa: E402
from offload.cli.models import byte_tokenizer  # noqa: E402
from offload.integrations import data  # noqa: E402
from offload.integrations.data import DataFormatError, token_blocks  # noqa: E402
from .helpers import cli_result  # noqa: E402

READ = 512  # characters a read, for these tests


@pytest.fixture
def small_reads(monkeypatch):
    monkeypatch.setattr(data, "TEXT_CHUNK_BYTES", READ)


def pieces_of(path) -> list[str]:
    return [text for text, _, _ in data._text_pieces(path)]


@pytest.mark.parametrize("line", [
    "All work and no play makes Jack a dull boy. " * 400,  # words on one line, no newline
    "é" * 3000 + "ok",  # one word of two-byte characters: cut where a read ends, mid-word
], ids=["words", "one-word"])
def test_a_line_longer_than_a_read_comes_in_pieces(line, small_reads, tmp_path):
    path = tmp_path / "one-line.txt"
    path.write_text(line, encoding="utf-8")
    pieces = pieces_of(path)
    # Each piece is about a read (a read and the word carried over from the one before): memory is
    # flat in the line's length, and no character is split or lost at a cut.
    assert len(pieces) > 5 and max(map(len, pieces)) < 3 * READ
    assert "".join(pieces) == line


def test_a_bad_byte_in_a_long_line_is_named_where_it_is(small_reads, tmp_path):
    path = tmp_path / "corpus.txt"
    head = ("short line\n" * 3 + "ü " * 2000).encode("utf-8")  # line 4 spans many reads
    path.write_bytes(head + b"\xe9" + b" tail\n")
    with pytest.raises(DataFormatError, match=rf"byte 0xe9 at offset {len(head)} \(line 4\)"):
        list(token_blocks(path, byte_tokenizer(), 16))


def trained_tokenizer(text: str, pre_tokenizer):
    """A BPE tokenizer trained on ``text`` here (nothing downloaded), with ``pre_tokenizer``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    inner = Tokenizer(models.BPE(unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizer
    inner.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="</s>")


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_pieces_of_plain_text_tokenise_as_the_whole_text(kind, small_reads, tmp_path):
    from tokenizers import pre_tokenizers

    # Blank lines, indented lines and a long line of words: each a place where a cut after a line
    # changed a byte-level BPE's merges or added a Metaspace mark.
    text = DEFAULT_TEXT.read_text().replace("\n", "\n\n  ") * 2 + "words on one line " * 200 + "end\n"
    pre = (pre_tokenizers.ByteLevel(add_prefix_space=False) if kind == "byte-level"
           else pre_tokenizers.Metaspace(prepend_scheme="first"))
    tokenizer = trained_tokenizer(text, pre)
    path = tmp_path / "book.txt"
    path.write_text(text)
    assert len(pieces_of(path)) > 10
    whole = tokenizer(text)["input_ids"]
    pieced = [int(i) for block in token_blocks(path, tokenizer, 1) for i in block]
    assert pieced == whole


def test_the_byte_tokenizer_ends_each_document(tmp_path):
    path = tmp_path / "two.jsonl"
    path.write_text(json.dumps({"text": "one."}) + "\n" + json.dumps({"text": "two"}) + "\n")
    ids = [int(i) for block in token_blocks(path, byte_tokenizer(), 1) for i in block]
    assert ids == [*b"one.", 0, *b"two", 0]  # 0: the random model's eos_token_id


def test_the_saved_byte_tokenizer_keeps_its_special_tokens(tmp_path, capsys):
    out = tmp_path / "out"
    code, printed, err = cli_result(cli.main, ["--device", "cpu", "--no-progress", "--out", str(out), "--steps", "1",
                                               "--batch-size", "1", "--seq-len", "16", "--num-slices", "2"], capsys)
    assert code == 0, err
    saved = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    config = json.loads((out / "config.json").read_text())
    assert (saved.eos_token_id, saved.bos_token_id, saved.pad_token_id) == (config["eos_token_id"], 0, 0) == (0, 0, 0)
    # The character standing for byte 0 in the vocabulary is text like any other: its own two bytes.
    assert saved("aĀ")["input_ids"] == [*"aĀ".encode("utf-8")]


def gpt2_folder(tmp_path, positions: int):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=256, n_positions=positions)
    config.save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"")  # the check reads the config alone, before a load
    return folder


def test_a_seq_len_past_a_models_learned_positions_is_refused_before_the_model_is_built(tmp_path, capsys):
    folder = gpt2_folder(tmp_path, 32)
    flags = ["--device", "cpu", "--out", str(tmp_path / "out"), "--model", str(folder)]
    with pytest.raises(SystemExit):
        parse_args([*flags, "--seq-len", "33"])
    assert (f"--seq-len 33 is more than the 32 positions of --model {folder} (gpt2 learns one embedding per "
            "position: n_positions in its config.json); give --seq-len 32 or less") in capsys.readouterr().err
    assert parse_args([*flags, "--seq-len", "32"]).seq_len == 32


def test_messages_that_hold_text_are_refused_unless_named_as_the_text_field(tmp_path):
    """A 'messages' field found by its name promises a chat: text there (a chat serialised to a
    string by mistake) is refused, saying how to train on it anyway; named with --text-field, it
    is the text."""
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": "lorem ipsum dolor"}) + "\n", encoding="utf-8")
    tokenizer = byte_tokenizer()
    with pytest.raises(DataFormatError, match=r"record 1: field 'messages' holds text, not a list of chat messages "
                                              r".*--text-field messages"):
        next(token_blocks(path, tokenizer, 4))
    named = [b for b in token_blocks(path, tokenizer, 4, text_field="messages")]
    assert named and all(b.shape == (4,) for b in named)


# -- parquet and CSV files their reader refuses ---------------------------------------------------------------


def test_a_csv_file_damaged_past_its_first_chunk_is_refused_where_the_reading_reaches_it(tmp_path):
    """The check before the run reads the first chunk of rows (10,000): the damage further in is
    found by the pass, as a DataFormatError naming the file and the reader's reason, not pandas'
    traceback."""
    pytest.importorskip("datasets")
    path = tmp_path / "rows.csv"
    path.write_text("text\n" + "a row of text\n" * 12_000 + '"an open quote,1\n', encoding="utf-8")
    data.check_readable(path)  # the first row reads
    blocks = token_blocks(path, byte_tokenizer(), 16)
    assert next(blocks).shape == (16,)
    with pytest.raises(DataFormatError, match=rf"^{path}: not a CSV file its reader can read, at or before row "
                                              r"\d+ \(ParserError: Error tokenizing data\. .*\); fix or re-export"):
        list(blocks)


def test_a_csv_file_that_is_not_utf8_is_named_by_byte_before_a_pass(tmp_path):
    path = tmp_path / "latin1.csv"
    path.write_bytes("text\nok\n".encode() + "caf\xe9\n".encode("latin-1"))
    with pytest.raises(DataFormatError, match=r"not UTF-8 text: byte 0xe9 at offset 11 \(line 3\)"):
        data.check_readable(path)


@pytest.mark.parametrize(("error", "words"), [
    (OSError(errno.EIO, os.strerror(errno.EIO)),
     r"could not be read, at or before row {row} \(OSError: \[Errno 5\] Input/output error\); the system refused the "
     r"read, not the CSV reader: check the disk and the file's permissions, and run again$"),
    # pyarrow's OSError for corrupt data in a parquet file has no errno: the file's fault, not the system's.
    (OSError("Corrupt snappy compressed data."),
     r"not a CSV file its reader can read, at or before row {row} \(OSError: Corrupt snappy compressed data\.\); "
     r"fix or re-export the file$"),
], ids=["system", "reader"])
@pytest.mark.parametrize("row", [1, 3])
def test_a_read_the_system_refuses_is_told_apart_from_a_file_its_reader_refuses(error, words, row, tmp_path,
                                                                                 monkeypatch):
    """A transient I/O error says the system refused the read (the file may be sound: run again), not
    that the file needs re-exporting; an OSError without an errno, as pyarrow raises for corrupt data,
    is still the file's. Before a pass (the first row) and in one (a later row) alike."""
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "rows.csv"
    path.write_text("text\none\ntwo\nthree\n", encoding="utf-8")

    def rows():
        yield from ({"text": "a row"} for _ in range(row - 1))
        raise error

    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: rows())
    with pytest.raises(DataFormatError, match=rf"^{path}: " + words.format(row=row)):
        list(data.read_documents(path))


def test_a_parquet_file_corrupt_past_its_first_row_group_is_refused_where_the_reading_reaches_it(tmp_path):
    """Damaged compressed pages, real ones: the check before the run reads the first row group, and
    the pass names the file and the reader's reason where it reaches the damage."""
    pytest.importorskip("datasets")
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"text": [f"row {i} " * 50 for i in range(20_000)]}), path, row_group_size=2_000,
                   compression="snappy")
    damaged = bytearray(path.read_bytes())
    middle = len(damaged) // 2
    damaged[middle:middle + 200] = b"A" * 200
    path.write_bytes(bytes(damaged))
    data.check_readable(path)  # the first row group reads
    with pytest.raises(DataFormatError, match=rf"^{path}: not a parquet file its reader can read, at or before row "
                                              r"\d+ \(\w+: .*\); fix or re-export the file$"):
        list(data.read_documents(path))


def test_the_readme_names_what_the_data_extra_reads():
    """Plain text and JSON lines are read without datasets: the [data] extra is for parquet, CSV and
    datasets directories, as the reader's error says."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    extra = " ".join(readme[readme.index('`".[data]"`'):].split("), `")[0].split()) + ")"
    assert extra == '`".[data]"` (parquet, CSV and `datasets` folders for the fine-tune command; plain text and JSON ' \
                    "lines need nothing)", extra
