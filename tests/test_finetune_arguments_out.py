"""``offload-finetune``'s ``--out`` when it holds files the command did not write, and two options
checked by the parser: ``--text-field`` with plain text alone, ``--seed`` past ``torch.manual_seed``.

An ``--out`` without the export record that holds a model's or a tokenizer's files (a
``config.json``, an ``adapter_config.json``, a ``tokenizer.json``) is refused before anything is
built, naming them, unless ``--overwrite``: the export would remove or write over them (Note:
[Never lose a run], rule 6, in ``offload/cli/finetune.py``). An empty ``--out``, one holding other
files, and a resume into its own ``--out`` (its checkpoints, an export it had begun) run as before.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from offload.cli import finetune as cli  # noqa: E402
from offload.cli.finetune_args import parse_args  # noqa: E402
from offload.cli.outputs import EXPORT_RECORD, OutputError, check_no_foreign_files  # noqa: E402
from .helpers import cli_result  # noqa: E402

TINY = ["--device", "cpu", "--no-progress", "--batch-size", "2", "--seq-len", "16", "--num-slices", "2",
        "--steps", "1"]
SAMPLE = Path(cli.__file__).resolve().parent / "sample.txt"


def run_cli(*args: str, capsys) -> tuple[int, str, str]:
    return cli_result(cli.main, [*TINY, *args], capsys)


def files_of(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()}


def parser_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--device", "cpu", *argv])
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


# -- --out holding files the command did not write ---------------------------------------------------------------


def test_an_out_with_a_users_config_and_tokenizer_files_is_refused_before_anything_is_built(tmp_path, capsys,
                                                                                          monkeypatch):
    out = tmp_path / "proj"
    out.mkdir()
    (out / "config.json").write_text('{"experiment": "my settings"}')
    (out / "adapter_config.json").write_text('{"r": 8}')
    (out / "tokenizer.json").write_text("{}")
    (out / "notes.md").write_text("mine")
    before = files_of(out)
    built = []
    monkeypatch.setattr(cli, "random_model", lambda *args: built.append(args))
    code, printed, err = run_cli("--out", str(out), capsys=capsys)
    assert code == 1 and built == [] and printed == "", err
    assert err.strip() == (f"offload-finetune: error: --out {out} holds adapter_config.json, config.json, "
                           "tokenizer.json, which this run's export would remove or replace, and no model this "
                           "command wrote: choose another --out, or move those files elsewhere, or pass --overwrite "
                           "to replace them")
    assert files_of(out) == before


@pytest.mark.parametrize("name", ["generation_config.json", "tokenizer_config.json", "model.safetensors.index.json",
                                  "chat_template.jinja"])
def test_each_file_an_export_removes_or_writes_over_is_named(name, tmp_path):
    (tmp_path / name).write_text("{}")
    (tmp_path / "notes.md").write_text("mine")
    with pytest.raises(OutputError, match=rf"--out {tmp_path} holds {name}, which"):
        check_no_foreign_files(tmp_path, overwrite=False)
    check_no_foreign_files(tmp_path, overwrite=True)


def test_overwrite_replaces_them_and_keeps_other_files(tmp_path, capsys):
    out = tmp_path / "proj"
    out.mkdir()
    (out / "config.json").write_text('{"experiment": "my settings"}')
    (out / "adapter_config.json").write_text('{"r": 8}')
    (out / "notes.md").write_text("mine")
    code, _, err = run_cli("--out", str(out), "--overwrite", capsys=capsys)
    assert code == 0, err[-3000:]
    assert not (out / "adapter_config.json").exists() and (out / "notes.md").read_text() == "mine"
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"


def test_an_empty_out_or_one_with_other_files_runs(tmp_path, capsys):
    out = tmp_path / "proj"
    out.mkdir()
    (out / "notes.md").write_text("mine")
    (out / "data.txt").write_text("mine too")
    code, _, err = run_cli("--out", str(out), capsys=capsys)
    assert code == 0, err[-3000:]
    assert (out / "notes.md").read_text() == "mine" and (out / "model.safetensors.index.json").is_file()
    check_no_foreign_files(tmp_path / "empty", overwrite=False)  # nothing there yet


def test_a_resume_into_its_own_out_runs_from_its_checkpoints_and_from_an_export_it_had_begun(tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run_cli("--out", str(out), "--save-every", "1", capsys=capsys)
    assert code == 0, err[-3000:]
    # Stopped as its export began: the record says unfinished, the model's files are half written.
    (out / EXPORT_RECORD).write_text(json.dumps({"step": 1, "finished": False}))
    for shard in out.glob("*.safetensors"):
        shard.unlink()
    code, printed, err = run_cli("--out", str(out), "--save-every", "1", "--resume", "latest", capsys=capsys)
    assert code == 0 and "nothing left to train after step 1" in printed, err[-3000:]
    # Stopped before its export: only its checkpoints are there.
    for path in out.iterdir():
        if path.is_file():
            path.unlink()
    code, printed, err = run_cli("--out", str(out), "--save-every", "1", "--steps", "2", "--resume", "latest",
                                 capsys=capsys)
    assert code == 0 and "final loss" in printed, err[-3000:]
    assert json.loads((out / EXPORT_RECORD).read_text()) == {"step": 2, "finished": True}


def test_a_resume_into_an_out_with_a_users_config_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run_cli("--out", str(out), "--save-every", "1", capsys=capsys)
    assert code == 0, err[-3000:]
    for path in out.iterdir():
        if path.is_file():
            path.unlink()
    (out / "config.json").write_text('{"experiment": "my settings"}')
    code, _, err = run_cli("--out", str(out), "--save-every", "1", "--steps", "2", "--resume", "latest",
                           capsys=capsys)
    assert code == 1 and f"--out {out} holds config.json, which this run's export would remove" in err, err
    assert (out / "config.json").read_text() == '{"experiment": "my settings"}'


# -- --text-field with plain text alone ----------------------------------------------------------------------------


def test_text_field_with_plain_text_alone_is_a_parser_error(tmp_path, capsys):
    notes = tmp_path / "notes.md"
    notes.write_text("some notes")
    assert parser_error(["--out", str(tmp_path / "o"), "--text-field", "body"], capsys).endswith(
        f"error: --text-field body names the records' field holding the text, and --data {SAMPLE} (the short text "
        "shipped with the package) is plain text, which has no fields: leave out --text-field, or give records "
        "(JSON lines, parquet, CSV or a datasets directory)")
    assert parser_error(["--out", str(tmp_path / "o"), "--text-field", "body", "--data", str(notes), "--eval-file",
                         str(SAMPLE)], capsys).endswith(
        f"and --data {notes} and --eval-file {SAMPLE} are plain text, which has no fields: leave out --text-field, "
        "or give records (JSON lines, parquet, CSV or a datasets directory)")
    upper = tmp_path / "NOTES.TXT"
    upper.write_text("some notes")
    assert "is plain text" in parser_error(["--out", str(tmp_path / "o"), "--text-field", "body", "--data",
                                            str(upper)], capsys)


def test_text_field_with_records_in_data_or_eval_file_parses(tmp_path):
    records = tmp_path / "notes.jsonl"
    records.write_text('{"body": "hello"}\n')
    saved = tmp_path / "corpus.txt"  # a datasets directory, whatever its name
    saved.mkdir()
    for data, eval_file in ((records, None), (SAMPLE, records), (records, SAMPLE), (saved, None)):
        argv = ["--out", str(tmp_path / "o"), "--device", "cpu", "--text-field", "body", "--data", str(data)]
        args = parse_args(argv + ([] if eval_file is None else ["--eval-file", str(eval_file)]))
        assert args.text_field == "body"


# -- --seed ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [str(2**64), str(-2**63 - 1), "99999999999999999999"])
def test_a_seed_torch_does_not_take_is_a_parser_error(seed, tmp_path, capsys):
    assert parser_error(["--out", str(tmp_path), "--seed", seed], capsys).endswith(
        "error: --seed must be from -2**63 to 2**64 - 1 (-9223372036854775808 to 18446744073709551615), the seeds "
        f"torch.manual_seed takes; got {seed}")


@pytest.mark.parametrize("seed", [2**64 - 1, -2**63, 0, -1])
def test_the_seeds_torch_takes_parse(seed, tmp_path):
    assert parse_args(["--out", str(tmp_path), "--device", "cpu", "--seed", str(seed)]).seed == seed
    torch.Generator().manual_seed(seed)  # the range is torch's: its ends are taken
