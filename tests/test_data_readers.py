"""The fine-tune command's data readers on what users' files hold: CSV cells that look like other
types, a file the system will not read, a tokenizer that wraps every text in special tokens, a
saved ``DatasetDict`` given for evaluation, empty documents and an Alpaca-style JSON array.

Each test states the ids (or the one-line error) the reader must give; the byte tokenizer of the
random model makes the ids the text's UTF-8 bytes, with 0 ending each document.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from offload.cli.models import byte_tokenizer  # noqa: E402
from offload.integrations import data  # noqa: E402
from offload.integrations.data import (  # noqa: E402
    DataFormatError, check_readable, eval_blocks, read_documents, token_blocks)

EOS = 0  # the byte tokenizer's end-of-sequence id


def ids_of(blocks) -> list[int]:
    return [int(i) for block in blocks for i in block]


def documents(*texts: str) -> list[int]:
    """The packed ids of ``texts`` as documents under the byte tokenizer."""
    return [i for text in texts for i in (*text.encode("utf-8"), EOS)]


# -- CSV cells are text ---------------------------------------------------------------------------------------

#: Cells pandas would guess to be a null, a number or a bool: each is a document of those characters.
LOOKALIKES = ["NA", "N/A", "None", "nan", "NaN", "null", "NULL", "12", "0012", "1.5", "1e5", "True", "FALSE", " 7 "]


def test_csv_cells_are_read_as_written(tmp_path):
    pytest.importorskip("datasets")
    path = tmp_path / "words.csv"
    path.write_text("text,label\n" + "".join(f'"{word}",{n}\n' for n, word in enumerate(LOOKALIKES)),
                    encoding="utf-8")
    check_readable(path)
    assert ids_of(token_blocks(path, byte_tokenizer(), 1)) == documents(*LOOKALIKES)


def test_a_csv_chunk_of_number_like_cells_past_the_first_is_text(tmp_path):
    """pandas reads 10,000 rows a chunk and types each chunk alone: one whose cells all look like
    numbers, past the chunk the check before the run reads, would stop training where it lies."""
    pytest.importorskip("datasets")
    path = tmp_path / "mixed.csv"
    path.write_text("text\n" + "words\n" * 10_000 + "12\n" * 3, encoding="utf-8")
    check_readable(path)
    assert ids_of(token_blocks(path, byte_tokenizer(), 1))[-9:] == documents("12", "12", "12")


def test_an_empty_csv_cell_is_an_empty_document(tmp_path):
    pytest.importorskip("datasets")
    path = tmp_path / "gaps.csv"
    path.write_text('text,n\nab,1\n,2\n"",3\ncd,4\n', encoding="utf-8")
    assert ids_of(token_blocks(path, byte_tokenizer(), 1)) == documents("ab", "cd")


# -- a file the system will not read --------------------------------------------------------------------------


def refuse_opening(monkeypatch, path: pathlib.Path) -> None:
    """From now on, ``Path.open`` of ``path`` raises what the system says to a user without the
    permission (root reads anything, so the test cannot rely on a chmod)."""
    real_open = pathlib.Path.open

    def open_(self, *args, **kwargs):
        if self == path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", open_)


def system_refused(path, what: str, line: int, reason: str) -> str:
    return (f"{path}: could not be read, from line {line} on ({reason}); the system refused the read, "
            f"not the {what} reader: check the disk and the file's permissions, and run again")


@pytest.mark.parametrize(("suffix", "what"), [(".txt", "plain-text"), (".jsonl", "JSON lines"), (".csv", "CSV")])
def test_a_file_the_system_will_not_read_is_refused_in_one_line(suffix, what, monkeypatch, tmp_path):
    path = tmp_path / f"secret{suffix}"
    path.write_text("text\nhello\n" if suffix == ".csv" else '{"text": "hello"}\n', encoding="utf-8")
    refuse_opening(monkeypatch, path)
    words = system_refused(path, what, 1, f"PermissionError: [Errno 13] Permission denied: '{path}'")
    with pytest.raises(DataFormatError) as caught:
        check_readable(path)
    assert str(caught.value) == words
    if suffix != ".csv":  # a CSV file is opened by pandas, whose refusal is worded as parquet's (test_data_edges)
        with pytest.raises(DataFormatError) as caught:
            list(read_documents(path))
        assert str(caught.value) == words


def test_a_read_the_system_refuses_partway_names_the_line(monkeypatch, tmp_path):
    """An I/O error further in says from which line on the file could not be read."""
    path = tmp_path / "corpus.jsonl"
    body = "".join(json.dumps({"text": f"line {n}"}) + "\n" for n in range(1, 6))
    path.write_text(body, encoding="utf-8")

    class FailsAtLine3(io.StringIO):
        lines_read = 0

        def readline(self, limit=-1):
            if self.lines_read == 2:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            self.lines_read += 1
            return super().readline(limit)

    monkeypatch.setattr(pathlib.Path, "open", lambda self, *args, **kwargs: FailsAtLine3(body))
    with pytest.raises(DataFormatError) as caught:
        list(read_documents(path))
    assert str(caught.value) == system_refused(path, "JSON lines", 3, "OSError: [Errno 5] Input/output error")


# -- special tokens of a tokenizer that wraps every text, in plain text ----------------------------------------

TEXT = " ".join(f"word{n % 97}" for n in range(3_000)) + "\n"  # about 25 KB: many 512-character reads


def wrapping_tokenizer(template: str):
    """A byte-level BPE tokenizer trained here whose post-processor adds ``template``'s special tokens
    to every text (``"<s> $A </s>"`` is a Llama tokenizer with ``add_eos_token``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    inner = Tokenizer(models.BPE(unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.train_from_iterator([TEXT[:5_000]], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    inner.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("<s>", 1), ("</s>", 2)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("template", ["<s> $A </s>", "$A </s>", "<s> $A", "<s> <s> $A </s> </s>"])
@pytest.mark.parametrize("read", [512, 1 << 18], ids=["pieces", "one-piece"])
def test_plain_text_has_the_special_tokens_of_the_whole_text(template, read, monkeypatch, tmp_path):
    """The opening special tokens once at the start, the closing ones once at the end, none at a cut."""
    monkeypatch.setattr(data, "TEXT_CHUNK_BYTES", read)
    tokenizer = wrapping_tokenizer(template)
    path = tmp_path / "book.txt"
    path.write_text(TEXT, encoding="utf-8")
    assert (len(list(data._text_pieces(path))) > 10) == (read == 512)
    whole = tokenizer(TEXT)["input_ids"]
    assert ids_of(token_blocks(path, tokenizer, 1)) == whole
    # Blocks cut at the end: the closing tokens come with the last one, the remainder is dropped.
    assert ids_of(token_blocks(path, tokenizer, 64)) == whole[:len(whole) - len(whole) % 64]


# -- a DatasetDict given for evaluation -----------------------------------------------------------------------


def dataset_dict(tmp_path, *splits: str):
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "dd"
    datasets.DatasetDict({name: datasets.Dataset.from_dict({"text": [name]}) for name in splits}).save_to_disk(path)
    return path


@pytest.mark.parametrize(("splits", "train", "evaluate"), [
    (("train", "validation", "test"), "train", "validation"),
    (("train", "test"), "train", "test"),
    (("test", "validation"), None, "validation"),
    (("train",), "train", "train"),  # a single split: whatever its name, it is the data given
    (("holdout",), "holdout", "holdout"),
])
def test_each_purpose_reads_its_split_of_a_dataset_dict(splits, train, evaluate, tmp_path):
    path = dataset_dict(tmp_path, *splits)
    assert ids_of(eval_blocks(path, byte_tokenizer(), 1)) == documents(evaluate)
    if train is None:
        refusal = (f"{path}: a DatasetDict with splits ['test', 'validation'] and no 'train'; "
                   "save the split to train on alone")
        with pytest.raises(DataFormatError, match=f"^{re.escape(refusal)}$"):
            next(token_blocks(path, byte_tokenizer(), 1))
    else:
        assert ids_of(token_blocks(path, byte_tokenizer(), 1)) == documents(train)


def test_a_dataset_dict_without_a_split_to_evaluate_on_is_refused(tmp_path):
    """Evaluating on its train split would report training-set figures as held-out ones."""
    path = dataset_dict(tmp_path, "train", "extra")
    with pytest.raises(DataFormatError) as caught:
        next(eval_blocks(path, byte_tokenizer(), 1))
    assert str(caught.value) == (f"{path}: a DatasetDict with splits ['extra', 'train'] and no 'validation' or 'test'; "
                                 "save the split to evaluate on alone, or as 'validation' beside the others")
    with pytest.raises(ValueError, match="purpose must be 'train' or 'eval', got 'validation'"):
        next(read_documents(path, purpose="validation"))


# -- empty documents ------------------------------------------------------------------------------------------


def test_an_empty_document_adds_nothing(tmp_path):
    path = tmp_path / "gaps.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["ab", "", "", "", "cd"]), encoding="utf-8")
    assert ids_of(token_blocks(path, byte_tokenizer(), 1)) == documents("ab", "cd")


def test_a_document_that_tokenises_to_no_ids_adds_nothing(tmp_path):
    """A pre-tokenizer that drops whitespace gives a text of spaces no ids: no lone end-of-sequence."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    inner = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "ab": 2, "cd": 3}, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="</s>")
    assert tokenizer("   ")["input_ids"] == []
    path = tmp_path / "spaces.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["ab", "   ", "\n", "cd"]), encoding="utf-8")
    assert ids_of(token_blocks(path, tokenizer, 1)) == [2, 1, 3, 1]


def test_the_reader_leaves_empty_documents_out(tmp_path):
    """So a file of empty records holds no document, as the check before the run reads it."""
    path = tmp_path / "blank.jsonl"
    path.write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": "ab"}) + "\n", encoding="utf-8")
    assert [text for text, _, _ in read_documents(path)] == ["ab"]


# -- an Alpaca-style JSON array -------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "line"), [
    ('[\n  {"text": "ab"},\n  {"text": "cd"}\n]\n', 1),
    ('\n[{"text": "ab"}, {"text": "cd"}]\n', 2),  # a blank line first: the array's line is named
], ids=["pretty", "one-line"])
def test_a_json_array_is_refused_with_how_to_make_json_lines(body, line, tmp_path):
    path = tmp_path / "alpaca.json"
    path.write_text(body, encoding="utf-8")
    with pytest.raises(DataFormatError) as caught:
        next(token_blocks(path, byte_tokenizer(), 1))
    assert str(caught.value) == (f"{path}, line {line}: a JSON array, not JSON lines (one object a line); convert it "
                                 f"to one record a line, e.g. jq -c '.[]' {path} > alpaca-lines.jsonl, and give that file")


@pytest.mark.parametrize("name", ["data.json", "data.jsonl", "DATA.JSONL"])
def test_the_json_array_advice_never_writes_into_the_file_it_reads(name, tmp_path, monkeypatch):
    """Run as printed from the file's directory, the advised command must not name its input as its
    output: the shell empties that file before jq reads it (``> data.jsonl`` for ``data.jsonl``); on
    a filesystem that ignores case, ``data.jsonl`` is ``DATA.JSONL`` too."""
    monkeypatch.chdir(tmp_path)
    path = pathlib.Path(name)
    body = '[{"text": "ab"}, {"text": "cd"}]\n'
    path.write_text(body, encoding="utf-8")
    with pytest.raises(DataFormatError) as caught:
        next(read_documents(path))
    command = re.search(r"e\.g\. (jq .*), and give that file$", str(caught.value))[1]
    *_, read, redirect, written = shlex.split(command)
    assert (read, redirect) == (name, ">") and written.lower() != name.lower(), command
    if shutil.which("jq") is not None:  # the command itself, run as the user would
        subprocess.run(["bash", "-c", command], check=True)
        assert path.read_text(encoding="utf-8") == body
        assert [text for text, _, _ in read_documents(pathlib.Path(written))] == ["ab", "cd"]
