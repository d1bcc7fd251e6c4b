"""``offload-finetune``'s export into ``--out`` and the room checked for it, and two options that
would change nothing, silently, refused by the parser.

An export first removes the previous model's files and its tokenizer's (Note: [Never lose a run],
rule 6, in ``offload/cli/finetune.py``): ``save_pretrained`` writes only the files a tokenizer has,
so a chat template of the previous one left in ``--out`` loaded with the new one. The room checked
before the first step (rule 1) is the export's whole, its tokenizer, config and files' headers with
its tensors, and counts the previous model's files the export removes as room it gets back: a run
that passes the check is not stopped at its export by a full disk, and the retry of an export that
failed is not refused for the shards it left.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from offload.cli import finetune as cli  # noqa: E402
from offload.cli import outputs  # noqa: E402
from offload.cli.finetune_args import parse_args  # noqa: E402
from offload.cli.models import random_model  # noqa: E402
from offload.cli.outputs import (CHAT_TEMPLATES_DIR, EXPORT_RECORD, MODEL_FILES, TOKENIZER_FILES,  # noqa: E402
                                 OutputError, Write, check_no_foreign_files, check_room, remove_model_files,
                                 replaced_bytes)
from offload.tiers.disk_tier import size_text  # noqa: E402
from .disk_full import report_free  # noqa: E402
from .helpers import cli_result  # noqa: E402

TINY = ["--device", "cpu", "--no-progress", "--batch-size", "2", "--seq-len", "16", "--num-slices", "2",
        "--steps", "1"]
SAMPLE = Path(cli.__file__).resolve().parent / "sample.txt"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"


def run_cli(*args: str, capsys) -> tuple[int, str, str]:
    return cli_result(cli.main, [*TINY, *args], capsys)


def files_under(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` by its path there, with its bytes."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def parser_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--device", "cpu", *argv])
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


# -- the previous tokenizer's files ----------------------------------------------------------------------------


def chat_model(folder: Path) -> Path:
    """A tiny random Llama saved with the byte tokenizer given chat templates: the default one,
    saved as chat_template.jinja, and a named one, saved under additional_chat_templates/."""
    hf, tokenizer = random_model("llama", "tiny", 256, 16)
    tokenizer.chat_template = {"default": TEMPLATE, "tool_use": "{{ messages[0]['content'] }}"}
    hf.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert (folder / "chat_template.jinja").is_file() and (folder / CHAT_TEMPLATES_DIR / "tool_use.jinja").is_file()
    return folder


def test_an_export_over_a_model_whose_tokenizer_had_chat_templates_leaves_only_the_new_tokenizers_files(tmp_path,
                                                                                                       capsys):
    """The random model's byte tokenizer has no chat template: after its export over a model whose
    tokenizer had two, ``--out``'s tokenizer files are those a fresh save of it writes, byte for
    byte, and it loads without a template. The user's other files stay."""
    out = tmp_path / "out"
    code, _, err = run_cli("--model", str(chat_model(tmp_path / "chat")), "--out", str(out), capsys=capsys)
    assert code == 0, err[-3000:]
    assert (out / "chat_template.jinja").is_file() and (out / CHAT_TEMPLATES_DIR / "tool_use.jinja").is_file()
    (out / "notes.md").write_text("mine")
    code, _, err = run_cli("--out", str(out), "--overwrite", capsys=capsys)
    assert code == 0, err[-3000:]

    random_model("llama", "tiny", 256, 16)[1].save_pretrained(tmp_path / "fresh")
    model_files = {str(path.relative_to(out)) for pattern in MODEL_FILES for path in out.glob(pattern)}
    left = {name: data for name, data in files_under(out).items()
            if name not in model_files | {EXPORT_RECORD, "notes.md"}}
    assert left == files_under(tmp_path / "fresh")
    assert not (out / CHAT_TEMPLATES_DIR).exists() and (out / "notes.md").read_text() == "mine"
    assert transformers.AutoTokenizer.from_pretrained(out).chat_template is None


def test_removing_the_previous_model_takes_every_tokenizer_file_and_leaves_other_files(tmp_path):
    names = ["model.safetensors", "config.json", "model.safetensors.partial-00001", "tokenizer.json",
             "special_tokens_map.json", "vocab.txt", "spiece.model", "chat_template.json",
             f"{CHAT_TEMPLATES_DIR}/tool_use.jinja"]
    for name in names:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("x")
    (tmp_path / "notes.md").write_text("mine")
    (tmp_path / "checkpoints").mkdir()
    assert sorted(str(path.relative_to(tmp_path)) for path in remove_model_files(tmp_path)) == sorted(names)
    assert files_under(tmp_path) == {"notes.md": b"mine"} and not (tmp_path / CHAT_TEMPLATES_DIR).exists()
    # A file of the user's in the templates' directory keeps it, and is kept.
    (tmp_path / CHAT_TEMPLATES_DIR).mkdir()
    (tmp_path / CHAT_TEMPLATES_DIR / "tool_use.jinja").write_text("x")
    (tmp_path / CHAT_TEMPLATES_DIR / "README").write_text("mine")
    remove_model_files(tmp_path)
    assert files_under(tmp_path / CHAT_TEMPLATES_DIR) == {"README": b"mine"}


def test_a_named_chat_template_is_a_file_the_export_replaces(tmp_path):
    (tmp_path / CHAT_TEMPLATES_DIR).mkdir()
    (tmp_path / CHAT_TEMPLATES_DIR / "tool_use.jinja").write_text("{{ x }}")
    with pytest.raises(OutputError, match=rf"--out {tmp_path} holds {CHAT_TEMPLATES_DIR}/tool_use.jinja, which"):
        check_no_foreign_files(tmp_path, overwrite=False)
    assert f"{CHAT_TEMPLATES_DIR}/*.jinja" in TOKENIZER_FILES


def test_the_working_names_of_a_failed_exports_shards_are_model_files():
    from offload.integrations.transformers_saving import PARTIAL_STEM

    assert f"{PARTIAL_STEM}*" in MODEL_FILES


# -- the room for the export -----------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [[], ["--lora-r", "2"], ["--arch", "mixtral"]], ids=["full", "lora", "experts"])
def test_the_room_checked_for_the_export_holds_every_file_it_writes(extra, tmp_path, capsys, monkeypatch):
    """The bytes checked for the trained model are at least those the export writes (its shards
    with their headers, the index, the config and generation config or an adapter's config and
    model card, the tokenizer's files, the export record), and close to them; a mixture's experts,
    stored one by one, each have an entry."""
    checked: list[list[Write]] = []
    monkeypatch.setattr(cli, "check_room", lambda writes: checked.append(list(writes)))
    out = tmp_path / "out"
    code, _, err = run_cli("--out", str(out), *extra, capsys=capsys)
    assert code == 0, err[-3000:]
    [export] = [write for write in checked[0] if write.what == "the trained model"]
    written = [path for path in out.rglob("*") if path.is_file()]
    assert export.files >= len(written)
    written_bytes = sum(path.stat().st_size for path in written)
    assert written_bytes <= export.nbytes <= written_bytes + 4096 * len(written), (written_bytes, export.nbytes)


def test_a_tokenizer_that_does_not_fit_stops_the_run_before_the_first_step(tmp_path, capsys, monkeypatch):
    """Room for the weights' tensors alone, not for the tokenizer's files: refused before anything
    trains, where the run used to train and then fail in its export."""
    code, _, err = run_cli("--out", str(tmp_path / "measured"), capsys=capsys)
    assert code == 0, err[-3000:]
    tensors = sum(path.stat().st_size for path in (tmp_path / "measured").glob("*.safetensors"))
    report_free(monkeypatch, tensors + 1024)
    code, printed, err = run_cli("--out", str(tmp_path / "out"), capsys=capsys)
    assert code == 1 and "step 1" not in printed, err[-3000:]
    assert f"not enough room on the disk holding {tmp_path / 'out'}" in err and "the trained model in" in err


def test_the_retry_of_a_failed_export_counts_its_leftover_shards_as_room(tmp_path, capsys, monkeypatch):
    """A failed export leaves its shards under their working names and its record unfinished; the
    retry removes them before it writes, so the room they hold is the retry's: it runs where the
    disk's free bytes alone would not hold the model, and the leftovers are gone after."""
    out = tmp_path / "out"
    out.mkdir()
    (out / EXPORT_RECORD).write_text(json.dumps({"step": 1, "finished": False}))
    (out / "model.safetensors.partial-00001").write_bytes(os.urandom(2 * 2**20))
    assert replaced_bytes(out) == 2 * 2**20
    report_free(monkeypatch, 64 * 1024)
    code, printed, err = run_cli("--out", str(out), capsys=capsys)
    assert code == 0 and "final loss" in printed, err[-3000:]
    assert not list(out.glob("*.partial-*")) and json.loads((out / EXPORT_RECORD).read_text())["finished"]


def test_the_room_a_write_frees_offsets_its_own_bytes_alone(tmp_path, monkeypatch):
    """The export frees the previous model just before it writes, after the run's other writes,
    which that room cannot hold; each file may take a block more than its bytes."""
    block = os.statvfs(tmp_path).f_frsize
    report_free(monkeypatch, 100 * block)
    check_room([Write(tmp_path / "out", 150 * block, "the trained model", frees=60 * block)])
    with pytest.raises(OutputError) as refused:
        check_room([Write(tmp_path / "out", 150 * block, "the trained model", frees=40 * block)])
    assert (f"the run writes {size_text(110 * block)} there (the trained model in {tmp_path / 'out'}: "
            f"{size_text(150 * block)}, less {size_text(40 * block)} of files there it replaces)") in str(refused.value)
    with pytest.raises(OutputError, match="the run writes"):  # the export's room freed is not the checkpoints'
        check_room([Write(tmp_path / "out", block, "the trained model", frees=500 * block),
                    Write(tmp_path / "out" / "checkpoints", 101 * block, "checkpoints")])
    check_room([Write(tmp_path / "out", 98 * block, "the trained model", files=2)])
    with pytest.raises(OutputError, match="the run writes"):
        check_room([Write(tmp_path / "out", 98 * block, "the trained model", files=3)])


def test_a_file_linked_elsewhere_frees_nothing(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10_000)
    (tmp_path / "config.json").write_bytes(b"{}")
    assert replaced_bytes(tmp_path) == 10_002
    os.link(tmp_path / "model.safetensors", tmp_path / "kept.bin")
    assert replaced_bytes(tmp_path) == 2


def test_a_temporary_directory_that_cannot_be_written_stops_the_run_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(outputs.tempfile, "tempdir", str(tmp_path / "missing"))
    code, printed, err = run_cli("--out", str(tmp_path / "out"), capsys=capsys)
    assert code == 1 and "step 1" not in printed and "Traceback" not in err, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("offload-finetune: error: cannot measure the files the export writes beside the weights "
                           "(its tokenizer's, its config) by saving them into a temporary directory: ")
    assert str(tmp_path / "missing") in line and line.endswith(
        "Free some space there or set TMPDIR to a directory with room, before anything trains")


# -- options that would change nothing -------------------------------------------------------------------------


def test_eval_batches_without_an_eval_split_is_a_parser_error(tmp_path, capsys):
    assert parser_error(["--out", str(tmp_path), "--eval-batches", "3"], capsys).endswith(
        "error: --eval-batches 3 sets how many batches an evaluation reads, and without an eval split nothing is "
        "evaluated: add --eval-file PATH or --eval-fraction F, or leave out --eval-batches")


def test_eval_batches_takes_its_value_with_an_eval_split_and_its_default_without_one(tmp_path):
    base = ["--out", str(tmp_path), "--device", "cpu"]
    assert parse_args(base).eval_batches == 8
    assert parse_args([*base, "--eval-fraction", "0.1"]).eval_batches == 8
    assert parse_args([*base, "--eval-fraction", "0.1", "--eval-batches", "3"]).eval_batches == 3
    assert parse_args([*base, "--eval-file", str(SAMPLE), "--eval-batches", "2"]).eval_batches == 2


def test_save_every_past_the_last_step_is_a_parser_error(tmp_path, capsys):
    assert parser_error(["--out", str(tmp_path), "--steps", "2", "--save-every", "5"], capsys).endswith(
        "error: --save-every 5 saves a checkpoint every 5 steps, and --steps 2 ends the run before the first: give "
        "--save-every 2 or less (a checkpoint at the last step), or leave out --save-every")
    args = parse_args(["--out", str(tmp_path), "--device", "cpu", "--steps", "2", "--save-every", "2"])
    assert (args.save_every, args.steps) == (2, 2)
