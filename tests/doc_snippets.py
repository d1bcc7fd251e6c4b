"""What the documentation's snippets take for granted, built small, and the process that runs them.

A snippet in README.md or docs/*.md is written for a reader: it trains ``layers`` from a
``loader``, loads ``"path/to/llama"``, reads ``train.txt``. A setup named in the Markdown
(``<!-- snippet-setup: NAME -->`` before the fence; ``tests/test_doc_snippets.py`` holds the rules)
provides those names and files, at tiny sizes and on the CPU, in the snippet's own working
directory. Each setup is a function here that writes the files and returns the names.

A setup gives only what the reader supplies (:data:`READER_NAMES`), never ``torch`` or offload's
names: a snippet imports what it uses, or continues a page whose earlier snippet did. Each snippet
runs in the namespace the page's earlier snippets left (as a reader who copies the page in order
has it), with its setup's names over it.

Run as ``python -m tests.doc_snippets JOBS.json OUTCOMES.json``: each job is a snippet's code, its
page, its setup and its working directory; they run one after the other in this process (the
imports are paid once). OUTCOMES.json maps each job to ``None`` or its traceback, and the exit
status is 1 when one failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

#: The tiny Llama every Hugging Face setup saves (what ``offload-finetune`` writes: a random model
#: and its byte-level tokenizer, vocabulary 256), at most this many tokens long.
SEQ_LEN = 64

#: The names a setup may give: what the pages leave to the reader (their layers, data and loss, the
#: model an excerpt continues from, a trainer's arguments). Imports are not among them.
READER_NAMES = frozenset({
    "layers", "loader", "loss_fn", "batches_from", "train_a_few_steps",   # a training loop's
    "model", "optimizer",                                                  # built by an earlier step
    "local_rank", "accumulate",                                            # torchrun's, the loop's
    "hf_model", "ids", "mask", "labels", "data", "args",                   # a Hugging Face script's
})


def reader_names(names: dict[str, Any], setup: str) -> dict[str, Any]:
    """``names``, once each is one :data:`READER_NAMES` lists: a setup that gives ``torch`` or
    ``OffloadModel`` would hide a snippet that forgets to import it."""
    unlisted = sorted(set(names) - READER_NAMES)
    if unlisted:
        raise ValueError(f"setup {setup} gives {unlisted}, which are no reader's (READER_NAMES): "
                         "the snippet imports them")
    return names


def _layers(width: int = 16, depth: int = 16):
    # Sixteen layers: the snippets ask for up to 16 slices.
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)))


def _batches(n: int = 4, width: int = 16) -> list:
    import torch

    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(4, width, generator=generator), torch.randn(4, width, generator=generator)) for _ in range(n)]


def layers() -> dict[str, Any]:
    """``layers`` (an ``nn.Sequential`` of 16), a ``loader`` of ``(x, y)``, ``loss_fn``, and the
    helpers the checkpoint and checker pages leave to the reader."""
    import torch

    batches = _batches()

    def batches_from(step):
        return batches[step:]

    def train_a_few_steps(model):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in batches[:2]:
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()

    return {"layers": _layers(), "loader": batches, "loss_fn": torch.nn.functional.mse_loss,
            "batches_from": batches_from, "train_a_few_steps": train_a_few_steps}


def disk() -> dict[str, Any]:
    """As :func:`layers`, and ``nvme/``: the mounted disk the disk-tier page writes under."""
    Path("nvme").mkdir()
    return layers()


def model() -> dict[str, Any]:
    """As :func:`layers`, and ``model``: those layers in an ``OffloadModel``."""
    from offload import OffloadModel

    names = layers()
    return {**names, "model": OffloadModel(names["layers"], device="cpu", num_slices=4)}


def optimizer() -> dict[str, Any]:
    """As :func:`model`, and ``optimizer``: an ``OffloadOptimizer`` (AdamW) stepping it."""
    import torch

    from offload import OffloadOptimizer

    names = model()
    return {**names, "optimizer": OffloadOptimizer(names["model"], torch.optim.AdamW, lr=1e-3)}


def classifier() -> dict[str, Any]:
    """A ``loader`` of ``(x, y)`` for the README's classifier, made 64 features wide: 10 classes."""
    import torch

    generator = torch.Generator().manual_seed(0)
    return {"loader": [(torch.randn(4, 64, generator=generator), torch.randint(10, (4,), generator=generator))
                       for _ in range(2)]}


def torchrun() -> dict[str, Any]:
    """As :func:`layers`, and what ``torchrun`` gives one process: the environment, ``local_rank``;
    and the loop's ``accumulate``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    return {**layers(), "local_rank": 0, "accumulate": 2}


def weights() -> dict[str, Any]:
    """``weights.safetensors``, the state of the page's ``build()`` at width 64."""
    import safetensors.torch
    from torch import nn

    safetensors.torch.save_file(nn.Sequential(*(nn.Linear(64, 64) for _ in range(48))).state_dict(),
                                "weights.safetensors")
    return {}


def _save_llama(path: str, *, vocab: int = 256, seq_len: int = SEQ_LEN, eos: bool = False):
    """A random tiny Llama and its byte-level tokenizer, saved at ``path`` as ``offload-finetune``
    saves them; with ``eos``, the tokenizer's end-of-sequence token is a token of its own (id 256)
    and it has no padding token, as most pretrained ones."""
    import torch

    from offload.cli.models import random_model

    torch.manual_seed(0)
    hf, tokenizer = random_model("llama", "tiny", vocab + eos, seq_len)
    if eos:
        tokenizer.add_special_tokens({"eos_token": "</s>"})
        tokenizer.pad_token = None
        hf.config.eos_token_id = tokenizer.eos_token_id
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return hf, tokenizer


def _token_batches(n: int = 2):
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(256, (2, 16), generator=generator) for _ in range(n)]
    return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i.clone()} for i in ids]


def hf() -> dict[str, Any]:
    """``path/to/llama``; ``hf_model`` read from it; a ``loader`` of token batches (and one batch as
    ``ids``, ``mask``, ``labels``); and a Trainer's ``args`` and ``data``."""
    import transformers

    _save_llama("path/to/llama")
    loader = _token_batches()
    data = [{"input_ids": row.tolist(), "labels": row.tolist()} for row in loader[0]["input_ids"]]
    return {"hf_model": transformers.AutoModelForCausalLM.from_pretrained("path/to/llama"),
            "loader": loader, "ids": loader[0]["input_ids"], "mask": loader[0]["attention_mask"],
            "labels": loader[0]["labels"], "data": data,
            "args": transformers.TrainingArguments(output_dir="out", report_to=[], max_steps=1)}


def _text_file() -> None:
    # Lines far apart: a text dataset has an empty row for each blank line, and a batch of empty
    # rows only (likely here) is a batch of no tokens.
    Path("train.txt").write_text("".join(f"{line}\n" + "\n" * 8 for line in
                                         ("The clock struck one.", "The mouse ran down.", "Hickory, dickory, dock.")))


def trainer_byte_tokenizer() -> dict[str, Any]:
    """``path/to/llama`` with the tokenizer ``offload-finetune`` writes (id 0 its end-of-sequence and
    padding token), and a ``train.txt`` with blank lines."""
    _save_llama("path/to/llama")
    _text_file()
    return {}


def trainer_eos_tokenizer() -> dict[str, Any]:
    """As :func:`trainer_byte_tokenizer`, with a tokenizer that has an end-of-sequence token and
    no padding token, as a pretrained Llama's has."""
    _save_llama("path/to/llama", eos=True)
    _text_file()
    return {}


CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def sft() -> dict[str, Any]:
    """``path/to/llama-instruct`` (a tokenizer with a chat template and an end-of-sequence token),
    ``chats.jsonl``; and the reader's ``hf_model``, which the LoRA excerpt adapts (its
    ``tokenizer``, ``data`` and ``config`` are the page's first snippet's)."""
    hf_model, tokenizer = _save_llama("path/to/llama-instruct", eos=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained("path/to/llama-instruct")
    chats = [{"messages": [{"role": "user", "content": f"Count to {n}."},
                           {"role": "assistant", "content": " ".join(map(str, range(1, n + 1)))}]}
             for n in range(1, 9)]
    Path("chats.jsonl").write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    return {"hf_model": hf_model}


def tuned() -> dict[str, Any]:
    """``tuned``: what the page's first command (``offload-finetune --out ...``) writes, in two steps."""
    from offload.cli.finetune import main

    with contextlib.redirect_stdout(sys.stderr):
        main(["--out", "tuned", "--steps", "2"])
    return {}


def sequential_lm() -> dict[str, Any]:
    """``model``: a tiny Llama as ``causal_lm_sequential`` layers, 1024 positions long."""
    from offload.cli.models import random_model
    from offload.integrations.transformers import causal_lm_sequential

    hf_model, _ = random_model("llama", "tiny", 256, 1024)
    return {"model": causal_lm_sequential(hf_model)}


def _leave_as_found(environment: dict[str, str]) -> None:
    # The next snippet starts from a fresh process's state: no process group, and none of the
    # variables torchrun's setup sets (under them a trainer built later starts one of its own).
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environment)


def run(jobs: list[dict[str, Any]], outcomes_path: Path) -> int:
    """Run each job; write ``{job id: None, or the traceback}`` to ``outcomes_path`` after each one
    (what a crash or a timeout leaves tells how far it got). A job starts from what the jobs of its
    page before it left: their imports, the functions and values they defined."""
    outcomes, page, carried, environment = {}, None, {}, dict(os.environ)
    for job in jobs:
        os.chdir(job["directory"])
        if job["page"] != page:
            page, carried = job["page"], {}
        supplied, namespace = {}, {**carried, "__name__": "__main__"}
        try:
            if job["setup"]:
                supplied = reader_names(globals()[job["setup"]](), job["setup"])
                namespace.update(supplied)
            exec(compile(job["code"], job["name"], "exec"), namespace)
            outcomes[job["id"]] = None
        except BaseException:  # SystemExit too: a command's refusal is a failure of the snippet
            outcomes[job["id"]] = traceback.format_exc()
        finally:
            _leave_as_found(environment)
        # What the snippet bound, not what its setup gave: the next snippet's setup gives its own.
        carried = {name: value for name, value in namespace.items()
                   if not name.startswith("__") and supplied.get(name, _NOTHING) is not value}
        print(f"{'FAILED' if outcomes[job['id']] else 'ran'} {job['id']}", flush=True)
        outcomes_path.write_text(json.dumps(outcomes))
    return 1 if any(outcomes.values()) else 0


_NOTHING = object()


if __name__ == "__main__":
    sys.exit(run(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])))
