"""``offload-finetune`` (offload/cli/) and the data it reads (offload/integrations/data.py).

The data: every format packs into the blocks that tokenising the whole text would give, lazily;
records without the field are refused by name. The run: exact against the plain model with a
schedule, accumulation and clipping; outputs checked before the first step; Ctrl-C ends with the
checkpoint and the command that resumes it; the export with masters on disk peaks no higher than
the steps; a LoRA adapter records where its base is.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from offload import OffloadModel, save_checkpoint  # noqa: E402
from offload.checkpoint import saver  # noqa: E402
from offload.cli import finetune as cli  # noqa: E402
from offload.cli.finetune_args import ARCHITECTURES, build_parser, parse_args  # noqa: E402
from offload.cli.invocation import python_command  # noqa: E402
from offload.cli.models import byte_tokenizer, random_model  # noqa: E402
from offload.cli.outputs import OutputError, Write, check_no_earlier_run, check_room, resume_command  # noqa: E402
from offload.integrations import data  # noqa: E402
from offload.integrations.data import DataFormatError, shuffled, split_blocks, token_blocks  # noqa: E402
from offload.integrations.transformers import causal_lm_sequential  # noqa: E402
from .helpers import cli_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "offload" / "cli" / "sample.txt"
EXACT = {"rtol": 0, "atol": 0}
DOCS = ["The clock struck thirteen.", "Winston Smith slipped quickly through the glass doors.", "héllo wörld " * 7]


def ids_of(blocks) -> list[int]:
    return [i for block in blocks for i in block.tolist()]


def packed(texts: list[str], tokenizer, block: int, eos: bool = True) -> list[int]:
    """What packing promises (Note: [Packing]): each document's ids, an EOS after each (unless they
    end with one), cut into blocks."""
    stream = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        stream += ids + ([tokenizer.eos_token_id] if eos and ids[-1] != tokenizer.eos_token_id else [])
    return stream[:len(stream) - len(stream) % block]


@pytest.fixture(scope="module")
def tokenizer():
    tok = byte_tokenizer()
    tok.eos_token = tok.convert_ids_to_tokens(10)  # the byte of "\n": an end of document in the byte vocabulary
    assert tok.eos_token_id == 10
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    return tok


# -- data -------------------------------------------------------------------------------------------------


def test_plain_text_packs_to_the_whole_texts_ids_across_reads(tokenizer, tmp_path, monkeypatch):
    text = SAMPLE.read_text(encoding="utf-8") * 3
    (tmp_path / "book.txt").write_text(text, encoding="utf-8")
    monkeypatch.setattr(data, "TEXT_CHUNK_BYTES", 100)  # many reads, each ending after a line
    blocks = list(token_blocks(tmp_path / "book.txt", tokenizer, 64))
    assert all(b.shape == (64,) and b.dtype == torch.long for b in blocks)
    assert ids_of(blocks) == packed([text], tokenizer, 64, eos=False)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv", "datasets"])
def test_record_formats_pack_each_document_with_an_eos(fmt, tokenizer, tmp_path):
    records = [{"id": i, "body": text} for i, text in enumerate(DOCS)]
    path = tmp_path / f"corpus.{fmt}"
    if fmt in ("jsonl", "json"):
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    else:
        dataset = datasets.Dataset.from_list(records)
        {"parquet": dataset.to_parquet, "csv": dataset.to_csv, "datasets": dataset.save_to_disk}[fmt](str(path))
    got = ids_of(token_blocks(path, tokenizer, 16, text_field="body"))
    assert got == packed(DOCS, tokenizer, 16)


def test_chat_messages_go_through_the_chat_template(tokenizer, tmp_path):
    chats = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}],
             [{"role": "user", "content": "and you?"}]]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats), encoding="utf-8")
    rendered = [tokenizer.apply_chat_template(m, tokenize=False) for m in chats]
    assert rendered[0] == "<user>hi\n<assistant>hello there\n"
    assert ids_of(token_blocks(path, tokenizer, 8)) == packed(rendered, tokenizer, 8)
    no_template = byte_tokenizer()
    with pytest.raises(DataFormatError, match="the tokenizer has no chat template"):
        next(token_blocks(path, no_template, 8))


def test_a_record_without_the_field_is_refused_naming_the_field_and_the_keys(tokenizer, tmp_path):
    path = tmp_path / "notes.jsonl"
    path.write_text(json.dumps({"title": "a", "body": "b"}) + "\n", encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"record 1: has no 'text' field nor chat 'messages'; its keys are "
                                              r"\['body', 'title'\]\. Name the field .* --text-field"):
        next(token_blocks(path, tokenizer, 4))
    with pytest.raises(DataFormatError, match=r"has no field 'content'; its keys are \['body', 'title'\]"):
        next(token_blocks(path, tokenizer, 4, text_field="content"))
    (tmp_path / "corpus.xml").write_text("<a/>")
    with pytest.raises(DataFormatError, match=r"unknown data format '.xml'; give plain text"):
        next(token_blocks(tmp_path / "corpus.xml", tokenizer, 4))


def test_reading_is_lazy_memory_flat_in_the_corpus(tokenizer, tmp_path, monkeypatch):
    line = "All work and no play makes Jack a dull boy. " * 3 + "\n"
    path = tmp_path / "big.txt"
    with path.open("w") as file:
        file.write(line * (8 * 2**20 // len(line)))  # 8 MiB
    monkeypatch.setattr(data, "TEXT_CHUNK_BYTES", 64 * 1024)
    tracemalloc.start()
    try:
        blocks = token_blocks(path, tokenizer, 128)
        first = [next(blocks) for _ in range(4)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ids_of(first) == tokenizer(line * 4)["input_ids"][:512]
    # A read and its ids (about 20 bytes a byte, as Python lists), not the 8 MiB nor its ids.
    assert peak < 2 * 2**20


def test_eval_split_and_shuffle():
    blocks = [torch.tensor([i]) for i in range(100)]
    train = ids_of(split_blocks(blocks, 0.1, "train"))
    held = ids_of(split_blocks(blocks, 0.1, "eval"))
    assert len(held) == 10 and sorted(train + held) == list(range(100)) and held == list(range(9, 100, 10))
    order = [ids_of(shuffled(blocks, 16, torch.Generator().manual_seed(3))) for _ in range(2)]
    assert order[0] == order[1] != list(range(100)) and sorted(order[0]) == list(range(100))


# -- the command line ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_architecture_builds_a_tiny_random_model_that_trains_offloaded(arch):
    hf, _ = random_model(arch, "tiny", 256, 16)
    assert sum(p.numel() for p in hf.parameters()) < 2_000_000  # tiny whatever the family's default expert count
    model = OffloadModel(causal_lm_sequential(hf), device="cpu", num_slices=2)
    model(torch.randint(0, 256, (2, 16))).float().pow(2).mean().backward()


def test_help_states_each_default_once_and_shows_examples():
    text = build_parser().format_help()
    assert "(default: None)" not in text and "(default: False)" not in text
    assert text.count("(default: all)") == 1 and "(default: all) (default" not in text
    assert "examples:" in text and "offload-finetune --model ./llama-1b --data chats.jsonl" in text


def test_console_entry_point_is_declared():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    module, function = project["scripts"]["offload-finetune"].split(":")
    assert module == "offload.cli.finetune" and function == "main" and callable(cli.main)


def run_cli(*args: str, tmp_path: Path, capsys) -> tuple[int, str, str]:
    return cli_result(cli.main, ["--device", "cpu", "--no-progress", *args], capsys)


def test_an_unwritable_out_is_refused_before_the_model_is_built(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("")
    built = []
    monkeypatch.setattr(cli, "random_model", lambda *a: built.append(a))
    code, out, err = run_cli("--out", str(tmp_path / "file" / "out"), tmp_path=tmp_path, capsys=capsys)
    assert code != 0 and "--out" in err and "cannot write there" in err and "before anything trains" in err
    assert built == [] and "step 1" not in out
    code, _, err = run_cli("--out", str(tmp_path / "ok"), "--disk-tier", str(tmp_path / "file" / "tier"),
                           tmp_path=tmp_path, capsys=capsys)
    assert code != 0 and "--disk-tier" in err and built == []


def test_room_is_checked_per_disk_against_the_writes_added_up(tmp_path, monkeypatch):
    """The free bytes are pinned: a real disk's change between the test's reading and the check's
    (another process freeing a few megabytes) would move the edge it checks."""
    import shutil

    usage = shutil.disk_usage(tmp_path)
    free = 10 * 2**30
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=free))
    check_room([Write(tmp_path / "a", free // 3, "x"), Write(tmp_path / "b", free // 3, "y")])
    with pytest.raises(OutputError, match=r"not enough room .* free, the run writes .* \(the model in .*; checkpoints in"):
        check_room([Write(tmp_path / "a", free // 2 + 1, "the model"), Write(tmp_path / "b", free // 2 + 1, "checkpoints")])


def test_room_errors_give_small_sizes_in_a_unit_that_shows_them(tmp_path, monkeypatch):
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=3 * 2**20))
    with pytest.raises(OutputError) as refused:
        check_room([Write(tmp_path / "a", 5 * 2**20, "the model"), Write(tmp_path / "b", 512, "checkpoints")])
    assert f"{tmp_path}: 3.0 MiB free, the run writes 5.0 MiB there (the model in {tmp_path / 'a'}: 5.0 MiB; " \
           f"checkpoints in {tmp_path / 'b'}: 512 bytes)" in str(refused.value)


def test_a_run_with_too_little_room_stops_before_the_first_step(tmp_path, capsys, monkeypatch):
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1000))
    code, out, err = run_cli("--out", str(tmp_path / "out"), "--steps", "2", tmp_path=tmp_path, capsys=capsys)
    assert code != 0 and "not enough room" in err and "the trained model in" in err and "step 1" not in out


def test_resume_command_replaces_resume():
    argv = ["--out", "o b", "--resume", "old", "--steps", "4"]
    assert resume_command(argv, Path("o b/checkpoints/step-2"), program="offload-finetune") == \
        "offload-finetune --out 'o b' --steps 4 --resume 'o b/checkpoints/step-2'"


TINY_RUN = ["--batch-size", "2", "--seq-len", "16", "--num-slices", "3"]


@pytest.mark.parametrize("flag", ["--out", "--disk-tier", "--data", "--model"])
def test_an_empty_path_is_refused_by_the_parser(flag, tmp_path, capsys, monkeypatch):
    """An unset variable (``--out "$OUT"``) would be the current directory: exports there remove
    the model files an earlier export left."""
    monkeypatch.chdir(tmp_path)  # where a run that took it would export
    code, _, err = run_cli(*([] if flag == "--out" else ["--out", str(tmp_path / "out")]), flag, "",
                           tmp_path=tmp_path, capsys=capsys)
    assert code == 2 and re.search(rf"argument {flag}(/--\w+)?: an empty path \(an unset variable\?\)", err), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("target", ["qproj", "norm"])
def test_lora_targets_it_cannot_adapt_are_one_line_naming_the_linear_layers(target, tmp_path, capsys):
    code, out, err = run_cli("--out", str(tmp_path / "out"), "--steps", "1", "--lora-r", "2", "--lora-targets", target,
                             *TINY_RUN, tmp_path=tmp_path, capsys=capsys)
    lines = err.strip().splitlines()
    assert code != 0 and "Traceback" not in err and "step 1/" not in out, err
    assert lines[-1].startswith(f"offload-finetune: error: --lora-targets {target}: ")
    assert lines[-1].endswith("Its linear layers: down_proj gate_proj k_proj lm_head o_proj q_proj up_proj v_proj")


def files_of(directory: Path) -> dict[str, bytes]:
    """The bytes of the files directly in ``directory``, by name."""
    return {f.name: f.read_bytes() for f in sorted(directory.iterdir()) if f.is_file()}


def test_a_resume_with_no_steps_left_is_refused_and_the_trained_model_kept(tmp_path, capsys):
    """A resume from a checkpoint past --steps, or at it into an --out holding a finished model,
    would train nothing and export the checkpoint's weights over that model: refused, by the
    checkpoint's name before the model is built, and by the step saved in it whatever its name
    (Note: [Never lose a run], rule 4)."""
    out = tmp_path / "out"
    code, _, err = run_cli("--out", str(out), "--steps", "3", "--save-every", "1", *TINY_RUN, tmp_path=tmp_path,
                           capsys=capsys)
    assert code == 0, err
    finished = files_of(out)
    assert any(name.endswith(".safetensors") for name in finished)
    renamed = tmp_path / "kept"
    (out / "checkpoints" / "step-2").rename(renamed)

    def refusal(step: int, steps: int) -> str:
        if step > steps:
            return (f"offload-finetune: error: --resume: the checkpoint is at step {step} and --steps is {steps}, so "
                    f"nothing would train: pass --steps N > {step}, or --out a new directory without --resume to "
                    "start over")
        return (f"offload-finetune: error: --resume: the checkpoint is at step {step} and --steps is {steps}, so "
                f"nothing would train, and --out {out} holds a finished model that exporting the checkpoint would "
                f"overwrite: pass --steps N > {step} to train on, or --out a new directory to export the checkpoint "
                "there")

    # By its name: a parser error, before the model is built.
    first = out / "checkpoints" / "step-1"
    code, out_text, err = run_cli("--out", str(out), "--steps", "1", "--resume", str(first), *TINY_RUN,
                                  tmp_path=tmp_path, capsys=capsys)
    assert code == 2 and err.strip().splitlines()[-1] == refusal(1, 1) and out_text == "", err
    code, out_text, err = run_cli("--out", str(out), "--steps", "1", "--resume", str(out / "checkpoints" / "step-3"),
                                  *TINY_RUN, tmp_path=tmp_path, capsys=capsys)
    assert code == 2 and err.strip().splitlines()[-1] == refusal(3, 1) and out_text == "", err
    assert files_of(out) == finished
    # By the step saved in it: once it is loaded, before anything trains. (--overwrite: without it, a
    # checkpoint from outside --out's is refused before that, as check_resume_keeps_finished_model says.)
    for steps in (2, 1):
        code, out_text, err = run_cli("--out", str(out), "--steps", str(steps), "--resume", str(renamed), "--overwrite",
                                      *TINY_RUN, tmp_path=tmp_path, capsys=capsys)
        assert code == 1 and err.strip() == refusal(2, steps) and "step 3/" not in out_text, err
    assert files_of(out) == finished
    # A model written before the export record existed (or by something else) counts as finished.
    (out / "offload_finetune.json").unlink()
    code, _, err = run_cli("--out", str(out), "--steps", "1", "--resume", str(first), *TINY_RUN, tmp_path=tmp_path,
                           capsys=capsys)
    assert code == 2 and err.strip().splitlines()[-1] == refusal(1, 1), err


def test_a_run_without_resume_is_refused_where_an_earlier_run_saved_checkpoints(tmp_path, capsys):
    """Its saves would replace the earlier run's of the same steps and --keep-checkpoints remove the
    others, the furthest among them (Note: [Never lose a run], rule 5): refused before the model is
    built, the checkpoints untouched; with --resume, or without saves, it runs."""
    out = tmp_path / "out"
    args = ["--out", str(out), "--steps", "2", "--save-every", "1", *TINY_RUN]
    code, _, err = run_cli(*args, tmp_path=tmp_path, capsys=capsys)
    assert code == 0, err
    checkpoints = out / "checkpoints"
    saved = {path.relative_to(checkpoints): path.read_bytes() for path in checkpoints.rglob("*") if path.is_file()}
    code, out_text, err = run_cli(*args, "--keep-checkpoints", "1", tmp_path=tmp_path, capsys=capsys)
    assert code == 1 and "step 1/" not in out_text, err
    assert err.strip() == (f"offload-finetune: error: --out {out}: an earlier run saved checkpoints in {checkpoints} "
                           "(the last: step-2), which this run's saves would replace or remove. Continue that run "
                           "with --resume latest, or choose another --out, or remove that directory first.")
    assert {path.relative_to(checkpoints): path.read_bytes() for path in checkpoints.rglob("*") if path.is_file()} == saved
    code, _, err = run_cli("--out", str(out), "--steps", "3", "--save-every", "1", "--resume", "latest", *TINY_RUN,
                           tmp_path=tmp_path, capsys=capsys)
    assert code == 0, err


def test_an_earlier_runs_checkpoints_under_a_damaged_latest_are_still_refused(tmp_path):
    """A ``latest`` emptied (a disk that filled as it was rewritten) names no checkpoint, yet the
    checkpoints beside it are an earlier run's, which a new run's saves would replace."""
    checkpoints = tmp_path / "out" / "checkpoints"
    save_checkpoint(checkpoints / "step-2", torch.nn.Linear(2, 2))
    (checkpoints / "latest").write_text("")
    with pytest.raises(OutputError, match=r"an earlier run saved checkpoints in .*latest is damaged.*step-2.*"
                                          r"Continue that run with --resume"):
        check_no_earlier_run(checkpoints)
    (checkpoints / "latest").unlink()
    check_no_earlier_run(checkpoints)  # no latest: nothing saved there yet


def test_a_resume_replays_the_schedule_without_warnings(tmp_path, capsys, recwarn):
    out = tmp_path / "out"
    args = ["--out", str(out), "--steps", "3", "--save-every", "2", "--lr-schedule", "cosine", *TINY_RUN]
    code, _, err = run_cli(*args, tmp_path=tmp_path, capsys=capsys)
    assert code == 0, err
    recwarn.clear()
    code, out_text, err = run_cli(*args, "--resume", "latest", tmp_path=tmp_path, capsys=capsys)
    assert code == 0 and "after step 2" in out_text and "step 3/3" in out_text, err
    messages = [str(w.message) for w in recwarn]
    assert not any("lr_scheduler.step()" in m for m in messages), messages


def test_a_checkpoint_that_does_not_load_is_one_line_in_the_commands_flags(tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run_cli("--out", str(out), "--steps", "2", "--save-every", "1", *TINY_RUN, tmp_path=tmp_path,
                           capsys=capsys)
    assert code == 0, err
    checkpoint = out / "checkpoints" / "step-1"
    code, _, err = run_cli("--out", str(out), "--steps", "3", "--resume", str(checkpoint), "--batch-size", "2",
                           "--seq-len", "16", "--num-slices", "2", tmp_path=tmp_path, capsys=capsys)
    (line,) = err.strip().splitlines()
    assert code == 1 and line.startswith(f"offload-finetune: error: --resume: checkpoint {checkpoint} was saved from "
                                         "a model cut into 3 slices, this one has 2; slice 0 differs"), line
    assert line.endswith("; pass --num-slices 3, as the run that saved it did") and "OffloadModel" not in line
    (checkpoint / "offload.json").write_text("{not json")
    code, _, err = run_cli("--out", str(out), "--steps", "3", "--resume", str(checkpoint), *TINY_RUN,
                           tmp_path=tmp_path, capsys=capsys)
    (line,) = err.strip().splitlines()
    assert code == 1 and line.startswith(f"offload-finetune: error: --resume: checkpoint {checkpoint} is damaged: "
                                         "offload.json is not valid JSON"), line
    # The first run finished: a new one would replace its model, as check_no_finished_model says.
    assert line.endswith(f"; pass --resume an earlier checkpoint (under {out / 'checkpoints'}), or start over: "
                         "leave out --resume and pass --overwrite")
    # With --save-every, a run without --resume is refused beside the earlier run's checkpoints.
    code, _, err = run_cli("--out", str(out), "--steps", "3", "--save-every", "1", "--resume", str(checkpoint),
                           *TINY_RUN, tmp_path=tmp_path, capsys=capsys)
    (line,) = err.strip().splitlines()
    assert code == 1 and line.endswith(f"; pass --resume an earlier checkpoint (under {out / 'checkpoints'}), or "
                                       f"start over: choose another --out, or remove {out / 'checkpoints'}, and "
                                       "leave out --resume and pass --overwrite"), line


@pytest.mark.parametrize(("device", "capability", "flags", "expected"), [
    ("cpu", None, [], "none"),  # every CPU: auto does not measure whether it has bfloat16 instructions
    ("cuda", (9, 0), [], "bf16"),
    ("cuda", (8, 0), [], "bf16"),
    ("cuda", (7, 0), [], "none"),  # no bfloat16 tensor cores
    ("cpu", None, ["--disk-tier", "tier", "--masters-on-disk"], "bf16"),  # loads read the bf16 shadow
    ("cpu", None, ["--compute-dtype", "bf16"], "bf16"),
    ("cuda", (9, 0), ["--compute-dtype", "none"], "none"),
])
def test_the_default_compute_dtype_is_the_planners_choice_for_the_device(device, capability, flags, expected,
                                                                         monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: device == "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: int(device == "cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    args = parse_args(["--out", "o", "--device", device, *flags])
    assert args.compute_dtype == expected


def test_a_model_folder_without_weights_says_how_to_write_them_from_its_config(tmp_path, capsys):
    folder = tmp_path / "config-only"
    transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256).save_pretrained(folder)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--out", str(tmp_path / "out"), "--device", "cpu", "--model", str(folder)])
    assert exit_info.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"offload-finetune: error: --model {folder}: a config.json but no weights")
    assert "it needs the model's tokenizer too" in line and "chat_template.jinja" in line, line
    # The command the line gives writes weights that the run then loads.
    code = re.search(r'python -c "(.*?)"', line)[1]
    exec(code, {})
    byte_tokenizer().save_pretrained(folder)
    assert parse_args(["--out", str(tmp_path / "out"), "--device", "cpu", "--model", str(folder)]).model == folder
    (folder / "model.safetensors").unlink()
    (folder / "config.json").unlink()
    with pytest.raises(SystemExit):
        parse_args(["--out", str(tmp_path / "out"), "--device", "cpu", "--model", str(folder)])
    assert "neither weights nor config.json there" in capsys.readouterr().err


#: What importing torchao and bitsandbytes logs (transformers imports them when they are installed).
IMPORT_NOISE = ("torchao", "_pytree.py", "kernels-community")


@pytest.mark.parametrize("command", [
    ["finetune", "--help"],
    ["plan", "--hf-config", json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}),
     "--gpu", "a100"],
    ["calibrate", "--help"],
])
def test_the_commands_print_no_import_notes_of_other_libraries(command):
    done = subprocess.run([sys.executable, "-m", "offload", *command], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not [line for line in done.stderr.splitlines() if any(noise in line for noise in IMPORT_NOISE)], done.stderr


def test_import_notes_are_dropped_by_logger_and_message_and_only_while_importing():
    from offload.cli.quiet_imports import without_import_notes

    class Kept(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    kept = Kept()
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree", "transformers")]
    torchao_log, pytree_log, other_log = loggers
    for logger in loggers:
        logger.addHandler(kept)
    try:
        with without_import_notes():
            torchao_log.warning("Failed to load /x/_C_mxfp8.so: Could not load this library")
            pytree_log.warning("%s is an Enum subclass and is now natively supported by torch.compile as an opaque "
                               "value type.", "<enum 'KernelPreference'>")
            torchao_log.warning("quantize_ is deprecated")  # another message: kept
            other_log.warning("Failed to load a thing")  # another logger: kept
        torchao_log.warning("Failed to load /x/_C_mxfp8.so later")  # after the import: kept
    finally:
        for logger in loggers:
            logger.removeHandler(kept)
    assert kept.messages == ["quantize_ is deprecated", "Failed to load a thing", "Failed to load /x/_C_mxfp8.so later"]


def test_schedule_accumulation_and_clipping_are_exact_with_the_plain_model(tmp_path, capsys):
    args = ["--out", str(tmp_path / "out"), "--steps", "4", "--batch-size", "2", "--seq-len", "16",
            "--compute-dtype", "none", "--num-slices", "2", "--loss-chunk-tokens", "0", "--lr", "3e-3",
            "--lr-schedule", "cosine", "--warmup-steps", "2", "--grad-accum", "2", "--max-grad-norm", "0.05"]
    code, out, err = run_cli(*args, tmp_path=tmp_path, capsys=capsys)
    assert code == 0, err
    # The plain model, trained the same way with PyTorch and transformers alone.
    namespace = parse_args([*args, "--device", "cpu"])
    torch.manual_seed(0)
    reference, tokenizer = random_model("llama", "tiny", 256, 16)
    reference.config.use_cache = False
    optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.0, fused=True)
    scheduler = transformers.get_scheduler("cosine", optimizer, num_warmup_steps=2, num_training_steps=4)
    batches = cli.Batches(namespace, tokenizer).train()
    clipped = []
    for _ in range(4):
        micro = [next(batches) for _ in range(2)]
        tokens = sum(ids[:, 1:].numel() for ids in micro)
        for ids in micro:
            logits = reference(input_ids=ids).logits
            reference.loss_function(logits=logits, labels=ids, vocab_size=256, num_items_in_batch=tokens).backward()
        clipped.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)) > 0.05)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    assert all(clipped)  # the clipping acted at every step
    tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    torch.testing.assert_close(tuned.state_dict(), reference.state_dict(), **EXACT)


def test_update_in_backward_trains_the_same_weights_with_accumulation_and_a_schedule(tmp_path, capsys, monkeypatch):
    """``--update-in-backward`` against the same run without it: the same weights, bit for bit,
    with the updates of steps 2 to 4 started in the backward that ends each accumulation."""
    built = []

    class Recorded(cli.OffloadOptimizer):
        def __init__(self, *args, **kwargs):
            self.started_in_backward = []  # per step(): the slices whose update backward started
            super().__init__(*args, **kwargs)
            built.append(self)

        def step(self, *args, **kwargs):
            result = super().step(*args, **kwargs)
            if self._in_backward is not None:
                self.started_in_backward.append(sorted(self._in_backward.last_started))
            return result

    monkeypatch.setattr(cli, "OffloadOptimizer", Recorded)
    args = ["--steps", "4", "--batch-size", "2", "--seq-len", "16", "--compute-dtype", "none", "--num-slices", "3",
            "--loss-chunk-tokens", "0", "--lr", "3e-3", "--lr-schedule", "cosine", "--warmup-steps", "2",
            "--grad-accum", "2"]
    for name, flags in (("default", []), ("in-backward", ["--update-in-backward"])):
        code, out, err = run_cli("--out", str(tmp_path / name), *args, *flags, tmp_path=tmp_path, capsys=capsys)
        assert code == 0, err
    default, in_backward = built
    assert default._in_backward is None and in_backward._in_backward.accumulation_steps == 2
    # The first step only checks; each later one started some slice's update in backward.
    started = in_backward.started_in_backward
    assert started[0] == [] and all(started[1:]), started
    weights = [transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name).state_dict()
               for name in ("default", "in-backward")]
    torch.testing.assert_close(weights[1], weights[0], **EXACT)


@pytest.mark.parametrize("source", ["random", "pretrained"])
def test_resident_slices_train_the_same_weights(source, tmp_path, capsys):
    """``--resident-slices 1`` against the same run without it: the same weights, bit for bit (on
    the CPU the resident slice's update on the "device" is the same fused AdamW kernel). From a
    folder the model is loaded slice by slice (``load_causal_lm``), which takes the option too."""
    args = ["--steps", "3", "--batch-size", "2", "--seq-len", "16", "--compute-dtype", "none", "--num-slices", "3",
            "--loss-chunk-tokens", "0", "--lr", "3e-3", "--grad-accum", "2", "--max-grad-norm", "0.5"]
    if source == "pretrained":
        torch.manual_seed(0)
        hf, tokenizer = random_model("llama", "tiny", 256, 16)
        hf.save_pretrained(tmp_path / "base")
        tokenizer.save_pretrained(tmp_path / "base")
        args += ["--model", str(tmp_path / "base")]
    outputs = {}
    for name, flags in (("streamed", []), ("resident", ["--resident-slices", "1"])):
        code, out, err = run_cli("--out", str(tmp_path / name), *args, *flags, tmp_path=tmp_path, capsys=capsys)
        assert code == 0, err
        outputs[name] = out
    assert "3 slices (1 resident) on cpu" in outputs["resident"] and "3 slices on cpu" in outputs["streamed"]
    if source == "pretrained":
        assert "slice by slice" in outputs["resident"]
    weights = [transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name).state_dict()
               for name in ("streamed", "resident")]
    torch.testing.assert_close(weights[1], weights[0], **EXACT)
    assert any(not torch.equal(w, v) for w, v in zip(weights[0].values(),
                                                  random_model("llama", "tiny", 256, 16)[0].state_dict().values()))


@pytest.mark.parametrize("count", ["-1", "4"])
def test_resident_slices_beyond_the_slices_are_a_parser_error(count, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--out", "o", "--device", "cpu", "--num-slices", "3", "--resident-slices", count])
    assert exit_info.value.code == 2
    assert f"--resident-slices must be between 0 and --num-slices (3), got {count}" in capsys.readouterr().err


@pytest.mark.parametrize("source", ["random", "pretrained"])
def test_resident_slices_beyond_the_models_stages_are_one_line(source, tmp_path, capsys):
    """``--num-slices 50`` on the tiny Llama's 6 stages makes 6 slices: ``--resident-slices 10``,
    which the parser let through against the 50 typed, is refused as the parser refuses a flag,
    before the model is built (loaded slice by slice from a folder, or built from a config)."""
    args = ["--steps", "1", "--num-slices", "50", "--resident-slices", "10", "--out", str(tmp_path / "out")]
    if source == "pretrained":
        hf, tokenizer = random_model("llama", "tiny", 256, 16)
        hf.save_pretrained(tmp_path / "base")
        tokenizer.save_pretrained(tmp_path / "base")
        args += ["--model", str(tmp_path / "base")]
    code, out, err = run_cli(*args, tmp_path=tmp_path, capsys=capsys)
    assert code == 2 and "slice by slice" not in out and "Traceback" not in err, err
    assert err.strip() == ("offload-finetune: error: --resident-slices 10 is more than the model's 6 stages (a slice "
                           "holds at least one: --num-slices 50 makes 6 slices); pass --resident-slices 6 or fewer")


def test_update_in_backward_with_clipping_is_a_parser_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--out", "o", "--device", "cpu", "--update-in-backward", "--max-grad-norm", "1.0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--update-in-backward cannot clip" in err and "before the gradients' total norm is known" in err
    assert "Leave out --max-grad-norm, or --update-in-backward" in err


def test_eval_split_is_evaluated_every_n_steps_and_at_the_end(tmp_path, capsys):
    code, out, err = run_cli("--out", str(tmp_path / "out"), "--steps", "3", "--eval-fraction", "0.2",
                             "--eval-every", "2", "--eval-batches", "2", tmp_path=tmp_path, capsys=capsys)
    assert code == 0, err
    evals = [line for line in out.splitlines() if line.startswith("eval step")]
    assert [line.split()[2] for line in evals] == ["2/3", "3/3"] and "perplexity" in evals[0]
    (tmp_path / "eval.jsonl").write_text(json.dumps({"text": SAMPLE.read_text()[:300]}) + "\n")
    code, out, err = run_cli("--out", str(tmp_path / "out2"), "--steps", "1", "--eval-file",
                             str(tmp_path / "eval.jsonl"), tmp_path=tmp_path, capsys=capsys)
    assert code == 0 and "eval step 1/1" in out, err
    code, out, err = run_cli("--out", str(tmp_path / "out3"), "--data", str(tmp_path / "eval.jsonl"),
                             "--text-field", "body", tmp_path=tmp_path, capsys=capsys)
    assert code != 0 and "has no field 'body'; its keys are ['text']" in err and "step 1" not in out


def test_data_too_short_for_one_block_is_refused_before_the_first_step(tmp_path, capsys):
    (tmp_path / "short.txt").write_text("too short")
    code, out, err = run_cli("--out", str(tmp_path / "out"), "--data", str(tmp_path / "short.txt"),
                             tmp_path=tmp_path, capsys=capsys)
    assert code != 0 and "step 1" not in out
    assert f"--data {tmp_path / 'short.txt'} holds fewer than --seq-len 64 tokens" in err


def test_an_error_after_training_started_says_what_was_saved(tmp_path, capsys, monkeypatch):
    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli, "save_output", full_disk)
    with pytest.raises(OSError, match="No space left"):
        cli.main(["--device", "cpu", "--no-progress", "--out", str(tmp_path), "--steps", "2", "--save-every", "1"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"saving to {tmp_path} failed (OSError) after step 2; "
                           f"last checkpoint: {tmp_path / 'checkpoints' / 'step-2'}; resume with: ")


def test_an_error_during_the_steps_names_the_last_checkpoint(tmp_path, capsys, monkeypatch):
    save = cli.save_checkpoint

    def second_save_fails(path, *args, **kwargs):
        if path.name == "step-2":
            raise OSError(5, "Input/output error")
        save(path, *args, **kwargs)

    monkeypatch.setattr(cli, "save_checkpoint", second_save_fails)
    with pytest.raises(OSError, match="Input/output error"):
        cli.main(["--device", "cpu", "--no-progress", "--out", str(tmp_path), "--steps", "3", "--save-every", "1"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"stopped by OSError after step 2; last checkpoint: {tmp_path / 'checkpoints' / 'step-1'}; "
                           "resume with: ")


def test_a_checkpoint_save_that_fails_mid_run_is_two_lines_without_a_traceback(tmp_path, capsys, monkeypatch):
    """A save the library refused (here: a full disk at step 2) ends the run with the stop line and
    the library's message, whose advice is the command's (resume), not a traceback."""
    from offload.checkpoint.checkpoint_files import CheckpointError

    save = cli.save_checkpoint

    def second_save_fails(path, *args, **kwargs):
        if path.name == "step-2":
            raise CheckpointError(f"could not save checkpoint {path}: the disk filled up while writing it. "
                                  "Nothing of it was kept. Free space (or save elsewhere) and save again.")
        save(path, *args, **kwargs)

    monkeypatch.setattr(cli, "save_checkpoint", second_save_fails)
    with pytest.raises(SystemExit) as stop:
        cli.main(["--device", "cpu", "--no-progress", "--out", str(tmp_path), "--steps", "3", "--save-every", "1"])
    message = str(stop.value.code)
    assert message.startswith("offload-finetune: error: could not save checkpoint ")
    assert message.endswith("Free space (or save elsewhere) and resume with the command above.")
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("stopped: a checkpoint could not be saved after step 2; "
                           f"last checkpoint: {tmp_path / 'checkpoints' / 'step-1'}; resume with: ")


def test_ctrl_c_before_the_first_step_says_nothing_was_trained(tmp_path, capsys, monkeypatch):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "random_model", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--device", "cpu", "--no-progress", "--out", str(tmp_path)])
    assert exit_info.value.code == 130
    assert capsys.readouterr().err.strip() == "interrupted before the first step; nothing was trained"


def test_ctrl_c_while_a_resume_loads_names_the_checkpoint_it_resumes_and_the_command(tmp_path, capsys, monkeypatch):
    # Before the fix the line said "nothing was trained" and gave neither the checkpoint nor the
    # command, for a run resumed from a checkpoint of the steps an earlier run trained.
    run = ["--device", "cpu", "--no-progress", "--out", str(tmp_path), "--save-every", "1", *TINY_RUN]
    cli.main([*run, "--steps", "2"])
    capsys.readouterr()

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "resume", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*run, "--steps", "4", "--resume", "latest"])
    assert exit_info.value.code == 130
    checkpoint = tmp_path / "checkpoints" / "step-2"
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (f"interrupted before the first step of this run; nothing was trained, and the checkpoint it "
                    f"resumes, {checkpoint}, is as it was; resume with: "
                    f"{resume_command([*run, '--steps', '4', '--resume', 'latest'], checkpoint, 'offload-finetune')}")
    monkeypatch.undo()
    command = last.split("resume with: ", 1)[1].split()
    cli.main(command[1:])  # the command it gives resumes: steps 3 and 4
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step-4"


@pytest.mark.parametrize("stopped_at", [1, 2])
def test_ctrl_c_in_a_saves_clean_up_names_the_checkpoint_it_committed(stopped_at, tmp_path, capsys, monkeypatch):
    """Once a save committed, an interrupt in its clean-up (the replaced checkpoint's removal,
    keep_last's) leaves it saved and named by latest: the stop line resumes from it."""
    real = saver.tidy

    def interrupted(path, keep_last):
        if path.name == f"step-{stopped_at}":
            raise KeyboardInterrupt
        return real(path, keep_last)

    monkeypatch.setattr(saver, "tidy", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--device", "cpu", "--no-progress", "--out", str(tmp_path), "--steps", "3", "--save-every", "1",
                  "--keep-checkpoints", "1", *TINY_RUN])
    assert exit_info.value.code == 130
    checkpoint = tmp_path / "checkpoints" / f"step-{stopped_at}"
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"interrupted after step {stopped_at}; last checkpoint: {checkpoint}; resume with: "), last
    assert (tmp_path / "checkpoints" / "latest").read_text() == checkpoint.name and checkpoint.is_dir()


def test_a_save_interrupted_before_its_commit_names_the_checkpoint_this_run_resumed(tmp_path, capsys, monkeypatch):
    """Resumed from step-1 while latest still names an earlier run's step-2: a save of step-2 that
    never committed leaves the stop line on step-1, not on the earlier run's copy."""
    flags = ["--device", "cpu", "--no-progress", "--out", str(tmp_path), "--save-every", "1", *TINY_RUN]
    code, _, err = run_cli(*flags[3:], "--steps", "2", tmp_path=tmp_path, capsys=capsys)
    assert code == 0, err
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "latest").read_text() == "step-2"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "save_checkpoint", interrupted)
    with pytest.raises(SystemExit):
        cli.main([*flags, "--steps", "3", "--resume", str(checkpoints / "step-1")])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"interrupted after step 2; last checkpoint: {checkpoints / 'step-1'}; resume with: "), last


@pytest.mark.parametrize("before", [signal.SIG_DFL, signal.SIG_IGN, lambda signum, frame: None])
def test_sigterm_is_handled_during_the_run_only_and_a_callers_handler_is_left_alone(tmp_path, monkeypatch, before):
    during = []

    def interrupted(*args):
        during.append(signal.getsignal(signal.SIGTERM))
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "random_model", interrupted)
    previous = signal.signal(signal.SIGTERM, before)
    try:
        with pytest.raises(SystemExit):
            cli.main(["--device", "cpu", "--no-progress", "--out", str(tmp_path)])
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert (during[0] is before) == (before is not signal.SIG_DFL)


#: Runs the script named next with Ctrl-C raising KeyboardInterrupt, as in a terminal. A child
#: inherits an ignored SIGINT, and Python keeps it ignored: a suite started as a background job of a
#: non-interactive shell would otherwise send a signal its child never sees.
INTERRUPTIBLE = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                 "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.mark.parametrize(("stop", "why", "status"), [(signal.SIGINT, "interrupted", 130),
                                                     (signal.SIGTERM, "terminated", 143)])
def test_ctrl_c_or_sigterm_ends_with_the_last_checkpoint_and_the_command_to_resume(tmp_path, stop, why, status):
    """Ctrl-C, or SIGTERM (a scheduler's stop, ``kill``'s default)."""
    command = [sys.executable, "-c", INTERRUPTIBLE, "scripts/finetune_causal_lm.py", "--device", "cpu",
               "--no-progress", "--out", str(tmp_path), "--steps", "100000", "--save-every", "1",
               "--keep-checkpoints", "2"]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        for line in process.stdout:
            if line.startswith("step 2/"):
                break
        process.send_signal(stop)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == status, err[-3000:]
    assert "Traceback" not in err
    (last,) = err.strip().splitlines()[-1:]
    # Stopped after step 2 or later; the checkpoint is that step's, or the one before when the
    # signal came while it was being written (an unfinished checkpoint is never "latest").
    match = re.fullmatch(rf"{why} after step (\d+); last checkpoint: (\S+); resume with: (.*)", last)
    assert match, last
    step, checkpoint, command = int(match[1]), Path(match[2]), match[3]
    assert step >= 2 and checkpoint.parent == tmp_path / "checkpoints" and checkpoint.is_dir()
    assert checkpoint.name in (f"step-{step}", f"step-{step - 1}")
    # The interpreter as the shell finds it: "python" when that is this one (offload/cli/invocation.py).
    assert command == (f"{python_command()} scripts/finetune_causal_lm.py --device cpu --no-progress "
                       f"--out {tmp_path} --steps 100000 --save-every 1 --keep-checkpoints 2 --resume {checkpoint}")


def test_a_kill_mid_step_with_everything_on_disk_resumes_bit_for_bit(tmp_path, capsys):
    """SIGKILL in the middle of training with the optimizer state, the masters, their gradients and
    the shadows off RAM: the last checkpoint is whole, and resuming from it ends with the weights of
    the run that was never killed, bit for bit."""
    flags = [*TINY_RUN, "--steps", "4", "--save-every", "1", "--compute-dtype", "bf16", "--masters-on-disk",
             "--shadows-on-disk"]
    code, _, err = run_cli("--out", str(tmp_path / "whole"), "--disk-tier", str(tmp_path / "tier-whole"), *flags,
                           tmp_path=tmp_path, capsys=capsys)
    assert code == 0, err[-3000:]
    killed = ["--out", str(tmp_path / "killed"), "--disk-tier", str(tmp_path / "tier-killed"), *flags]
    process = subprocess.Popen([sys.executable, "scripts/finetune_causal_lm.py", "--device", "cpu", "--no-progress",
                                *killed], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        for line in process.stdout:
            if line.startswith("step 2/"):  # step 3 is under way: its update, the next loads
                break
        process.send_signal(signal.SIGKILL)
        process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == -signal.SIGKILL
    assert not (tmp_path / "killed" / "model.safetensors.index.json").exists()  # it never finished
    code, out, err = run_cli(*killed, "--resume", "latest", tmp_path=tmp_path, capsys=capsys)
    assert code == 0 and "step 4/4" in out, err[-3000:]
    from safetensors.torch import load_file

    whole, resumed = ({name: tensor for shard in sorted((tmp_path / run).glob("model-*.safetensors"))
                       for name, tensor in load_file(shard).items()} for run in ("whole", "killed"))
    assert whole.keys() == resumed.keys() and len(whole) > 3
    for name, tensor in whole.items():
        assert torch.equal(tensor, resumed[name]), name


def test_lora_adapter_records_the_base_as_an_absolute_path(tmp_path, capsys, monkeypatch):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base, tokenizer = random_model("llama", "tiny", 256, 16)
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    monkeypatch.chdir(ROOT)  # the base named relative to the working directory
    relative = os.path.relpath(tmp_path / "base", ROOT)
    code, _, err = run_cli("--model", relative, "--out", str(tmp_path / "adapter"), "--steps", "1",
                           "--seq-len", "16", "--lora-r", "2", tmp_path=tmp_path, capsys=capsys)
    assert code == 0, err[-3000:]
    config = peft.PeftConfig.from_pretrained(tmp_path / "adapter")
    assert config.base_model_name_or_path == str((tmp_path / "base").resolve())


MEASURE = """
import json, re, sys
import offload.cli.finetune as cli

def high_water():
    return int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024

def measured(name, function):
    def run(*args, **kwargs):
        open("/proc/self/clear_refs", "w").write("5")  # the peak from here on
        result = function(*args, **kwargs)
        peaks[name] = high_water()
        return result
    return run

peaks = {}
cli.train = measured("steps", cli.train)
cli.save_output = measured("export", cli.save_output)
cli.main(sys.argv[1:])
print("PEAKS " + json.dumps(peaks))
"""


def test_export_with_masters_on_disk_peaks_no_higher_than_the_steps(tmp_path):
    # 8 slices of a 6.4 M-parameter Llama: 26 MB of float32 masters, 3 MB a slice.
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")
    byte_tokenizer().save_pretrained(tmp_path / "base")
    done = subprocess.run([sys.executable, "-c", MEASURE, "--device", "cpu", "--no-progress", "--model",
                           str(tmp_path / "base"), "--out", str(tmp_path / "out"), "--steps", "2", "--seq-len", "32",
                           "--batch-size", "2", "--num-slices", "8", "--disk-tier", str(tmp_path / "tier"),
                           "--masters-on-disk"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    peaks = json.loads(done.stdout.split("PEAKS ")[1])
    masters = 4 * sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    # Reading every master into RAM (and cloning it) would add the masters' 26 MB, or twice that.
    # Measured: steps 556 MB, export 536 MB; with hf.save_pretrained, which clones every master
    # (views of one buffer share its storage) after reading it in, the export peaked at 580 MB.
    assert peaks["export"] <= peaks["steps"], (peaks, masters)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert sum(p.numel() for p in loaded.parameters()) * 4 == masters


@pytest.mark.parametrize("kind", ["llama", "gpt2", "mixtral"])
def test_save_causal_lm_writes_what_save_pretrained_writes_a_slice_at_a_time(kind, tmp_path):
    from offload import OffloadModel
    from offload.integrations.transformers import causal_lm_sequential
    from offload.integrations.transformers_loading import load_causal_lm
    from offload.integrations.transformers_saving import save_causal_lm

    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 96}
    config = (transformers.GPT2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=96, tie_word_embeddings=True)
              if kind == "gpt2" else transformers.AutoConfig.for_model(kind, **small, num_local_experts=3)
              if kind == "mixtral" else transformers.AutoConfig.for_model(kind, **small))
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    hf.save_pretrained(tmp_path / "reference")
    model = OffloadModel(causal_lm_sequential(hf), device="cpu", num_slices=3)
    files = save_causal_lm(model, hf, tmp_path / "sliced")
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "reference")
    sliced = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sliced")
    torch.testing.assert_close(sliced.state_dict(), reference.state_dict(), **EXACT)
    assert sliced.config.tie_word_embeddings == (kind == "gpt2")
    _, loaded = load_causal_lm(tmp_path / "sliced", "cpu", num_slices=2)
    torch.testing.assert_close(loaded.state_dict(), reference.state_dict(), **EXACT)
