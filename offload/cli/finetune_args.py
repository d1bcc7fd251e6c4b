"""The command line of ``offload-finetune``: its options, their checks, and ``--help``.

Only parsing and checking what can be checked without a model lives here; the run itself is in
``offload/cli/finetune.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import torch

from ..checkpoint import CheckpointError, latest_checkpoint
from ..checkpoint.commit import committed
from ..integrations.data import TEXT_SUFFIXES
from .device_argument import device_argument
from .models import SIZES
from .outputs import holds_finished_model
from .plan_models import LEARNED_POSITIONS
from .quantize import QUANT_TYPES, import_bitsandbytes

DEFAULT_TEXT = Path(__file__).resolve().parent / "sample.txt"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}
#: ``--compute-dtype``'s default, resolved per device by :func:`default_compute_dtype`.
AUTO = "auto"
#: ``--lr-schedule`` -> the name of transformers' schedule with warm-up (``get_scheduler``).
SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}
#: The seeds ``torch.manual_seed`` takes (a negative one counts back from 2**64); past them it raises.
SEEDS = range(-2**63, 2**64)
#: ``--eval-batches``' default, given once the parser knows it was not set (:func:`check_eval_batches`).
EVAL_BATCHES = 8
# From the families' table, which imports nothing of transformers: its models import torchao and
# its notes (offload/cli/quiet_imports.py), which --help has no use for.
from ..integrations.transformers_families import SUPPORTED_MODEL_TYPES as ARCHITECTURES

PROG = "offload-finetune"


def fail(message: str) -> SystemExit:
    """The exit for bad input once the options are parsed: one line, as the parser's errors read
    (``main`` puts the program's name as it was started in place of :data:`PROG`)."""
    return SystemExit(f"{PROG}: error: {message}")


DESCRIPTION = """\
Fine-tune a Hugging Face causal LM larger than accelerator memory with OffloadModel and
OffloadOptimizer, end to end: a small random-initialised model (bytes as tokens, nothing
downloaded) or a local save_pretrained directory (--model), trained on plain text, JSON lines,
parquet, CSV or a datasets directory (--data, read and tokenised lazily), saved with its tokenizer
into --out. Before the model is built, plain text, JSON lines and CSV are read through once for a
byte that is not UTF-8, a parquet or CSV file's first row is read, and the first document of --data
and --eval-file goes through the reader (its field, a chat template); every output directory is
checked for writing and room before the first step; a run that stops (an error, Ctrl-C) says where
its last checkpoint is and how to resume."""

EPILOG = """\
examples:
  offload-finetune --out /tmp/tuned                          # tiny random Llama, seconds, CPU or GPU
  offload-finetune --model ./llama-1b --data book.txt --out ./tuned-book --steps 500 \\
      --batch-size 8 --seq-len 1024 --num-slices 16 --lr-schedule cosine --warmup-steps 50
  offload-finetune --model ./llama-1b --data chats.jsonl --out ./tuned-chats --eval-fraction 0.01 --eval-every 100
  offload-finetune --model ./llama-1b --data notes.jsonl --text-field body --grad-accum 4 --max-grad-norm 1.0 --out ./tuned-notes
  offload-finetune --model ./llama-1b --out ./tuned-accum --grad-accum 4 --update-in-backward   # no clipping then
  offload-finetune --out /tmp/tuned-40 --steps 40 --save-every 10                  # stopped at step 27...
  offload-finetune --out /tmp/tuned-40 --steps 40 --save-every 10 --resume latest  # ...continues from step 20
  offload-finetune --model ./llama-1b --out ./adapter --lora-r 16 --lora-targets q_proj v_proj
  offload-finetune --model ./llama-70b --out ./adapter-70b --lora-r 16 --load-in-4bit --compute-dtype bf16   # QLoRA
  offload-finetune --model ./llama-1b --out ./tuned-disk --disk-tier /nvme/offload --masters-on-disk

Each example writes an --out of its own: a run without --resume into an --out that holds a finished
model, or a run into one holding model or tokenizer files this command did not write (a config.json),
is refused unless --overwrite replaces them. The project's docs/huggingface.md describes the
command in full; from a clone, python scripts/finetune_causal_lm.py takes the same options."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown where there is one to show: not for required options, options without a
    default, flags, or help that states its default itself."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if action.required or action.default is None or action.default is False or "(default" in help_text:
            return help_text
        return super()._get_help_string(action)


def user_path(text: str) -> Path:
    """A path option's value, ``~`` expanded: a shell leaves ``--out=~/tuned`` as it is, and the
    run would make a directory named ``~`` here and report it as the home directory. An empty one
    (an unset ``$OUT``) is refused: it would be the current directory."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path (an unset variable?): give a directory or file by name")
    return Path(text).expanduser()


def build_parser(prog: str = "offload-finetune") -> argparse.ArgumentParser:
    """The options; ``prog``: the command that started the program, which usage and errors name."""
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--model", type=user_path, help="local directory with weights (and tokenizer) to fine-tune")
    parser.add_argument("--arch", default="llama", choices=ARCHITECTURES,
                        help="architecture of the random-initialised model when no --model is given")
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES), help="size of the random-initialised model")
    parser.add_argument("--out", type=user_path, required=True,
                        help="directory for the trained model (or adapter) and its tokenizer")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per forward")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (the block size of packing)")
    parser.add_argument("--num-slices", type=int, default=3, help="num_slices of OffloadModel")
    parser.add_argument("--microbatches", type=int, default=1, help="num_microbatches of OffloadModel")
    parser.add_argument("--resident-slices", type=int, default=0, metavar="N",
                        help="resident_slices of OffloadModel: the first N slices stay on the device with their "
                             "gradients and optimizer state, updated there (no link traffic, no host update for them)")
    parser.add_argument("--compute-dtype", default=AUTO, choices=[AUTO, *sorted(DTYPES)],
                        help="compute_dtype of OffloadModel (none: float32). auto: bf16 on a CUDA device with "
                             "bfloat16 tensor cores (compute capability 8.0 and up, as offload plan picks there) or "
                             "with --masters-on-disk, none otherwise, every CPU included (offload plan --device cpu "
                             "may pick bf16 on a CPU with bfloat16 instructions: it weighs the calibrated rates)")
    # 1024 tokens: one chunk's logits are 1024 x vocab (0.5 GB in float32 for a 128k vocabulary), and each
    # projection is still a product of 1024 rows by the whole vocabulary.
    parser.add_argument("--loss-chunk-tokens", type=int, default=1024,
                        help="compute the loss in the head over chunks of this many tokens (0: return logits)")
    parser.add_argument("--untie-embeddings", action="store_true",
                        help="give a tied lm_head a weight of its own (by default tied embeddings stay tied)")
    parser.add_argument("--device", type=device_argument, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the layers compute (cuda when present)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the model's initialisation and the data order (-2**63 to 2**64 - 1)")
    parser.add_argument("--no-progress", action="store_true",
                        help="print one line per step instead of a bar, and no loading bars")
    parser.add_argument("--disk-tier", type=user_path, metavar="DIR",
                        help="keep AdamW's moments in files in DIR, a local disk (OffloadOptimizer(disk_tier=...))")
    parser.add_argument("--masters-on-disk", action="store_true",
                        help="keep the float32 masters in files in --disk-tier's DIR too (OffloadModel(masters=...))")
    parser.add_argument("--shadows-on-disk", action="store_true",
                        help="with --masters-on-disk, keep no half-precision shadow in RAM: each load casts its "
                             "slice's masters read from the disk (OffloadModel(shadows=\"disk\"))")
    add_data_arguments(parser)
    add_optimization_arguments(parser)
    add_checkpoint_arguments(parser)
    add_lora_arguments(parser)
    add_four_bit_arguments(parser)
    return parser


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    data = parser.add_argument_group(
        "data", "read and tokenised lazily, packed into --seq-len blocks (offload.integrations.data);\n"
        'parquet, .csv and datasets directories need pip install "offload[data]"')
    data.add_argument("--data", "--text", dest="data", type=user_path, default=DEFAULT_TEXT, metavar="PATH",
                      help="training data: plain text (.txt, .md), JSON lines (.jsonl), .parquet, .csv, or a "
                           "datasets directory (save_to_disk) (default: a short text shipped with the package)")
    data.add_argument("--text-field", metavar="NAME",
                      help="the records' field holding the text (default: 'text', else chat 'messages' "
                           "rendered with the tokenizer's chat template); not with plain-text data alone")
    data.add_argument("--shuffle-buffer", type=int, default=256, metavar="BLOCKS",
                      help="draw blocks at random from a buffer of this many (1: in file order)")
    data.add_argument("--eval-file", type=user_path, metavar="PATH", help="evaluation data, in any --data format")
    data.add_argument("--eval-fraction", type=float, default=0.0, metavar="F",
                      help="hold out this fraction of --data's blocks for evaluation instead")
    data.add_argument("--eval-every", type=int, default=0, metavar="N",
                      help="evaluate every N steps (0: once, after the last step, when there is an eval split)")
    data.add_argument("--eval-batches", type=int, metavar="N",
                      help="batches in the evaluation: the first of the eval split, the same each time (default: "
                           f"{EVAL_BATCHES})")


def add_optimization_arguments(parser: argparse.ArgumentParser) -> None:
    opt = parser.add_argument_group("optimization", "AdamW (fused) on the host copies, without weight decay")
    opt.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    opt.add_argument("--lr-schedule", default="constant", choices=sorted(SCHEDULES),
                     help="learning rate after warm-up: constant, or decaying to 0 at --steps (transformers' schedules)")
    opt.add_argument("--warmup-steps", type=int, default=0, metavar="N",
                     help="raise the learning rate linearly from 0 over the first N steps")
    opt.add_argument("--grad-accum", type=int, default=1, metavar="K",
                     help="accumulate gradients over K batches per step (the loss is the mean over all their tokens)")
    opt.add_argument("--max-grad-norm", type=float, metavar="NORM",
                     help="clip the gradients' total norm to NORM before each step (default: no clipping)")
    opt.add_argument("--router-aux-loss-coef", type=float, metavar="COEF",
                     help="a mixture of experts (Mixtral, Qwen3-MoE, OLMoE, ...): add its load-balancing loss times "
                          "COEF, the mean over a step's batches (0: leave it out; default: as its config says, "
                          "output_router_logits and router_aux_loss_coef, as transformers does)")
    opt.add_argument("--update-in-backward", action="store_true",
                     help="start each slice's update in the backward that ends a step, as soon as its gradients "
                          "are on the host (OffloadOptimizer(update_in_backward=True, accumulation_steps=--grad-accum)): "
                          "for a host update longer than the next forward; exact; not with --max-grad-norm")


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    ckpt = parser.add_argument_group("checkpoints")
    ckpt.add_argument("--save-every", type=int, default=0, metavar="N",
                      help="save a checkpoint every N steps under OUT/checkpoints/step-N (0: never)")
    ckpt.add_argument("--keep-checkpoints", type=int, default=None, metavar="K",
                      help="keep only the K newest checkpoints (default: all)")
    ckpt.add_argument("--resume", metavar="PATH|latest",
                      help="continue from a checkpoint: its directory, or 'latest' for OUT/checkpoints' newest")
    ckpt.add_argument("--overwrite", action="store_true",
                      help="replace a finished model in --out (without it, a new run refuses one, and so does a "
                           "--resume of another --out's checkpoint or one that would end before the model's step), "
                           "or model and tokenizer files there that this command did not write (config.json, "
                           "adapter_config.json, tokenizer.json, ...), which the export removes or writes over")


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    lora = parser.add_argument_group("LoRA", 'train low-rank adapters (peft) on the frozen model: '
                                     'pip install "offload[peft]"')
    lora.add_argument("--lora-r", type=int, default=0, help="adapter rank (0, the default: train every weight)")
    lora.add_argument("--lora-alpha", type=float, help="adapter scale numerator (default: twice the rank)")
    lora.add_argument("--lora-dropout", type=float, help="dropout on the adapters' input (default: 0)")
    lora.add_argument("--lora-targets", nargs="+", metavar="MODULE",
                      help="module names to adapt, or all-linear (the default: every linear layer but the output head)")


def add_four_bit_arguments(parser: argparse.ArgumentParser) -> None:
    four_bit = parser.add_argument_group("4-bit base (QLoRA)", "the frozen base's linear layers in 4 bits (bitsandbytes), "
                                         'under --lora-r\'s adapters: pip install "offload[bnb]"')
    four_bit.add_argument("--load-in-4bit", action="store_true",
                          help="quantise every linear layer but the head to 4 bits, on the CPU as the model loads "
                               "(as from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True)) "
                               "does, but slice by slice); "
                               "the rest of the base in --compute-dtype's dtype (none: float32), which the layers "
                               "compute in, with no OffloadModel compute_dtype (a shadow would copy the codes); "
                               "needs --lora-r")
    four_bit.add_argument("--bnb-4bit-quant-type", choices=QUANT_TYPES, help="the 4-bit format (default: nf4)")
    four_bit.add_argument("--bnb-4bit-use-double-quant", action=argparse.BooleanOptionalAction,
                          help="quantise the blocks' scales again (QLoRA's double quantisation; the default)")


#: Options that only shape what another option turns on, each with that option and its default: set
#: without it they would change nothing, silently, so they are refused (a float32 base trained in full
#: where an fp4 one was meant).
_DEPENDENT_OPTIONS = {
    "lora_alpha": ("lora_r", None), "lora_dropout": ("lora_r", 0.0), "lora_targets": ("lora_r", ["all-linear"]),
    "bnb_4bit_quant_type": ("load_in_4bit", "nf4"), "bnb_4bit_use_double_quant": ("load_in_4bit", True),
}


def check_dependent_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse an option set without the one it shapes (:data:`_DEPENDENT_OPTIONS`), then give the unset
    ones their defaults."""
    for name, (needs, default) in _DEPENDENT_OPTIONS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
        elif not getattr(args, needs):
            flag, needed = f"--{name.replace('_', '-')}", f"--{needs.replace('_', '-')}"
            shown = f"--no-{flag[2:]}" if getattr(args, name) is False else flag
            parser.error(f"{shown} shapes {needed}'s " + ("adapters" if needs == "lora_r" else "4-bit base") +
                         f", which is off: add {needed}" + (" R" if needs == "lora_r" else "") + f", or leave out {shown}")


def check_four_bit_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--load-in-4bit``: adapters to train, no shadow to need, and bitsandbytes to quantise with."""
    if not args.load_in_4bit:
        return
    if args.lora_r == 0:
        parser.error("--load-in-4bit freezes the base in 4 bits, which has no gradient: train LoRA adapters over it "
                     "with --lora-r R (16 is common)")
    if args.masters_on_disk:
        parser.error("--masters-on-disk needs a half-precision shadow to load from, and a 4-bit base has none (it "
                     "computes in its own dtype): leave out --masters-on-disk, or --load-in-4bit")
    try:
        import_bitsandbytes("--load-in-4bit")
    except ImportError as error:
        parser.error(str(error))


def check_float_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The float options are finite and in range: ``float`` takes ``nan`` and ``inf``, which the
    optimizer would refuse only once the model is built (``nan``, a rate below 0) or train into a NaN
    model without a word (``inf``)."""
    if not (math.isfinite(args.lr) and args.lr > 0):
        parser.error(f"--lr must be a finite number above 0 (1e-5 to 1e-3 is usual), got {args.lr}")
    if args.max_grad_norm is not None and not (math.isfinite(args.max_grad_norm) and args.max_grad_norm > 0):
        parser.error(f"--max-grad-norm must be a finite number above 0 (leave it out for no clipping), "
                     f"got {args.max_grad_norm}")
    if args.router_aux_loss_coef is not None and not (math.isfinite(args.router_aux_loss_coef)
                                                      and args.router_aux_loss_coef >= 0):
        parser.error(f"--router-aux-loss-coef must be a finite number, 0 or more (0.001 to 0.02 is usual; 0 "
                     f"leaves the loss out), got {args.router_aux_loss_coef}")
    if not 0.0 <= args.eval_fraction < 1.0:  # false for nan
        parser.error(f"--eval-fraction must be in [0, 1), got {args.eval_fraction}")
    if args.lora_alpha is not None and not (math.isfinite(args.lora_alpha) and args.lora_alpha > 0):
        parser.error(f"--lora-alpha must be a finite number above 0 (leave it out for twice the rank), "
                     f"got {args.lora_alpha}")
    if not 0.0 <= args.lora_dropout < 1.0:
        parser.error(f"--lora-dropout must be in [0, 1), got {args.lora_dropout}")


def check_disk_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--masters-on-disk`` and ``--shadows-on-disk``: what each needs."""
    if args.masters_on_disk and args.disk_tier is None:
        parser.error("--masters-on-disk needs --disk-tier DIR: the directory for their files")
    if args.shadows_on_disk and not args.masters_on_disk:
        parser.error("--shadows-on-disk casts each load from the masters on disk: it needs --masters-on-disk")
    if args.masters_on_disk and args.compute_dtype == "none":
        parser.error("--masters-on-disk needs --compute-dtype bf16 or fp16: loads read the half-precision shadow")


def parse_args(argv: list[str] | None = None, prog: str = "offload-finetune") -> argparse.Namespace:
    """The options, checked (``prog``: as :func:`build_parser`); ``args.prog`` is ``prog``.

    Raises:
        SystemExit: a bad option, as the parser answers one (its usage and the error, status 2).
    """
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    args.prog = prog
    check_disk_args(parser, args)
    if not 0 <= args.resident_slices <= args.num_slices:
        parser.error(f"--resident-slices must be between 0 and --num-slices ({args.num_slices}), "
                     f"got {args.resident_slices}")
    if args.lora_r < 0:
        parser.error("--lora-r must be 0 (off) or a positive rank")
    check_dependent_args(parser, args)
    check_float_args(parser, args)
    check_four_bit_args(parser, args)
    check_eval_batches(parser, args)
    check_int_args(parser, args)
    if args.update_in_backward and args.max_grad_norm is not None:
        # Note: [Update in backward]: a slice's update starts before the last gradient, and so the total
        # norm, exists.
        parser.error("--update-in-backward cannot clip: each slice's update starts in backward, before the "
                     "gradients' total norm is known. Leave out --max-grad-norm, or --update-in-backward (the "
                     "update then runs behind the next forward, after the clipping)")
    if args.eval_file is not None and args.eval_fraction:
        parser.error("--eval-file and --eval-fraction both name an eval split; give one")
    if args.eval_every and args.eval_file is None and not args.eval_fraction:
        parser.error("--eval-every needs an eval split: --eval-file PATH or --eval-fraction F")
    if args.compute_dtype == AUTO:
        args.compute_dtype = default_compute_dtype(args.device, args.masters_on_disk)
    if args.loss_chunk_tokens < 0:
        parser.error("--loss-chunk-tokens must be 0 (off) or a number of tokens")
    if args.save_every < 0:
        parser.error("--save-every must be 0 (never) or a number of steps")
    if args.save_every > args.steps:
        # The first save would come after the last step: the run would save none, silently.
        parser.error(f"--save-every {args.save_every} saves a checkpoint every {args.save_every} steps, and --steps "
                     f"{args.steps} ends the run before the first: give --save-every {args.steps} or less (a "
                     "checkpoint at the last step), or leave out --save-every")
    if args.keep_checkpoints is not None and args.keep_checkpoints < 1:
        parser.error("--keep-checkpoints must be at least 1")
    if args.keep_checkpoints is not None and not args.save_every:
        parser.error("--keep-checkpoints keeps the newest of the checkpoints --save-every N saves, and none is saved "
                     "without it: add --save-every N, or leave out --keep-checkpoints")
    check_paths(parser, args)
    check_text_field(parser, args)
    return args


def check_eval_batches(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse ``--eval-batches`` without an eval split, where nothing is evaluated and it would
    change nothing, silently (as ``--eval-every`` is refused, and :data:`_DEPENDENT_OPTIONS`); else
    give it its default (:data:`EVAL_BATCHES`) when unset."""
    if args.eval_batches is None:
        args.eval_batches = EVAL_BATCHES
    elif args.eval_file is None and not args.eval_fraction:
        parser.error(f"--eval-batches {args.eval_batches} sets how many batches an evaluation reads, and without an "
                     "eval split nothing is evaluated: add --eval-file PATH or --eval-fraction F, or leave out "
                     "--eval-batches")


def check_int_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The counts are in range, and ``--seed`` is one ``torch.manual_seed`` takes: past :data:`SEEDS`
    it raises once the run has started, a traceback instead of a parser error."""
    for name in ("steps", "batch_size", "seq_len", "num_slices", "microbatches", "grad_accum", "eval_batches",
                 "shuffle_buffer"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.seq_len < 2:  # one token scores nothing: every loss would be 0 / 0
        parser.error("--seq-len must be at least 2: a block's loss scores each token against the next")
    for name in ("warmup_steps", "eval_every"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be 0 or more")
    if args.seed not in SEEDS:
        parser.error(f"--seed must be from -2**63 to 2**64 - 1 ({SEEDS.start} to {SEEDS.stop - 1}), the seeds "
                     f"torch.manual_seed takes; got {args.seed}")


def check_text_field(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse ``--text-field`` where all the data is plain text: it names a field of records (JSON
    lines, parquet, CSV, a datasets directory), and plain text, read as one stream, has none, so the
    option would change nothing, silently (as :data:`_DEPENDENT_OPTIONS` are refused). With records
    in ``--data`` or ``--eval-file``, it is theirs."""
    if args.text_field is None:
        return
    sources = {"--data": args.data} if args.eval_file is None else {"--data": args.data, "--eval-file": args.eval_file}
    # A directory is a datasets save, whatever its name (read_documents looks at it first).
    if any(path.is_dir() or path.suffix.lower() not in TEXT_SUFFIXES for path in sources.values()):
        return
    default = " (the short text shipped with the package)" if args.data == DEFAULT_TEXT else ""
    given = " and ".join(f"{flag} {path}" + (default if flag == "--data" else "") for flag, path in sources.items())
    parser.error(f"--text-field {args.text_field} names the records' field holding the text, and {given} "
                 f"{'is' if len(sources) == 1 else 'are'} plain text, which has no fields: leave out --text-field, "
                 "or give records (JSON lines, parquet, CSV or a datasets directory)")


def check_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The input paths exist and are what they should be; ``--resume latest`` becomes a path."""
    for flag, path in (("--data", args.data), ("--eval-file", args.eval_file)):
        if path is not None and not path.exists():
            parser.error(f"{flag} {path}: no such file or directory")
    if args.model is not None and not args.model.is_dir():
        parser.error(f"--model {args.model}: not a directory (a save_pretrained output is expected)")
    if args.model is not None and not _weight_files(args.model):
        parser.error(_without_weights(args.model))
    # --untie-embeddings loads with from_pretrained, which reads such a checkpoint; the others
    # load slice by slice (load_causal_lm), which cannot.
    if args.model is not None and not args.untie_embeddings and (method := _saved_quantization(args.model)):
        parser.error(f"--model {args.model} holds a checkpoint saved quantized ({method}: its config.json has a "
                     "quantization_config), which offload-finetune cannot train from: give --model the unquantized "
                     "checkpoint it was made from, with --load-in-4bit to quantise its linear layers as they load")
    if args.model is not None and (positions := _learned_positions(args.model)) and args.seq_len > positions[1]:
        # A longer block indexes past the position table at the first forward, a traceback at step 1.
        name, count, model_type = positions
        parser.error(f"--seq-len {args.seq_len} is more than the {count} positions of --model {args.model} "
                     f"({model_type} learns one embedding per position: {name} in its config.json); give --seq-len "
                     f"{count} or less")
    if args.resume == "latest":
        try:
            args.resume = latest_checkpoint(args.out / "checkpoints")
        except CheckpointError as error:  # a file where the directory would be, a "latest" directory
            parser.error(f"--resume latest: {error}")
        if args.resume is None:
            parser.error(f"--resume latest: no checkpoint under {args.out / 'checkpoints'} yet")
    elif args.resume is not None:
        args.resume = user_path(args.resume)
        # A save replacing it, killed half way, leaves the checkpoint beside its name until the
        # next save puts it back; the load reads it there (Note: [Atomic save]).
        try:
            found = committed(args.resume).is_dir()
        except CheckpointError:  # the directory checkpoints were saved into, not one of them
            parser.error(resume_directory_advice(args.resume))
        if not found:
            parser.error(f"--resume {args.resume}: no such checkpoint directory")
    # Note: [Never lose a run], rule 4, from the name the run gave the checkpoint, before a model is
    # built for nothing; resume() checks the step saved in it, whatever its name.
    named = None if args.resume is None else re.fullmatch(r"step-(\d+)", args.resume.name)
    refusal = None if named is None else no_steps_left(int(named[1]), args.steps, args.out)
    if refusal is not None:
        parser.error(refusal)


def resume_directory_advice(directory: Path) -> str:
    """The line for ``--resume`` given the directory checkpoints were saved into: the checkpoint
    its ``latest`` names, in the command's terms."""
    try:
        named = latest_checkpoint(directory)
    except CheckpointError as error:
        return f"--resume {directory}: {error}"
    advice = f"pass --resume {named}"
    if directory.name == "checkpoints":
        advice += f", or --resume latest with --out {directory.parent}"
    return (f"--resume {directory} is the directory checkpoints were saved into, not a checkpoint: its latest names "
            f"{named}; {advice}")


def no_steps_left(step: int, steps: int, out: Path) -> str | None:
    """The refusal of a resume from ``step`` that would train nothing and export the checkpoint's
    weights over a finished model in ``out`` (Note: [Never lose a run], rule 4), or ``None``.

    A checkpoint at ``--steps`` into an ``--out`` without a finished model is no such resume: its
    run stopped after the last checkpoint and before its export was done, and resuming runs what
    it had left (the final evaluation, the export).
    """
    if step < steps or (step == steps and not holds_finished_model(out, step)):
        return None
    if step > steps:
        return (f"--resume: the checkpoint is at step {step} and --steps is {steps}, so nothing would train: pass "
                f"--steps N > {step}, or --out a new directory without --resume to start over")
    return (f"--resume: the checkpoint is at step {step} and --steps is {steps}, so nothing would train, and --out "
            f"{out} holds a finished model that exporting the checkpoint would overwrite: pass --steps N > {step} to "
            "train on, or --out a new directory to export the checkpoint there")


def default_compute_dtype(device: torch.device, masters_on_disk: bool) -> str:
    """``--compute-dtype auto``: a dtype by the kind of ``device``, without measuring.

    bf16 on bfloat16 tensor cores (CUDA compute capability 8.0 and up, where
    ``torch.cuda.is_bf16_supported`` is true without emulation), where ``offload plan``, weighing
    float32 against bfloat16 by the device's rates, picks it too. Float32 (``"none"``) on any
    other device, every CPU included: there the plan's choice depends on the CPU, which this does
    not measure. ``offload calibrate`` measures a CPU without bfloat16 instructions computing
    bfloat16 far below float32, and ``offload plan --device cpu`` then takes float32; one with
    them (AVX-512 BF16, AMX) may compute bfloat16 faster, and the plan may then pick it
    (``--compute-dtype bf16`` follows the plan). Masters on disk need a half-precision shadow
    (loads read it), so they take bf16 everywhere.
    """
    if masters_on_disk:
        return "bf16"
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8:
        return "bf16"
    return "none"


def _weight_files(folder: Path) -> list[Path]:
    """The weights in a model folder: safetensors (files or a sharded index), or PyTorch's pickles."""
    return [*folder.glob("*.safetensors"), *folder.glob("*.safetensors.index.json"), *folder.glob("pytorch_model*.bin")]


def _saved_quantization(folder: Path) -> str | None:
    """The quantisation a ``--model`` folder's weights were saved in (``save_pretrained`` of a
    4-bit model writes codes and their state), or ``None``: an unreadable config.json is left to
    the load, which says what is wrong with it."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    saved = config.get("quantization_config") if isinstance(config, dict) else None
    if not saved:
        return None
    return str(saved.get("quant_method", "a quantisation")) if isinstance(saved, dict) else "a quantisation"


def _learned_positions(folder: Path) -> tuple[str, int, str] | None:
    """A ``--model`` folder's learned position table as (its config key, its size, the model type),
    or ``None`` for a family whose positions are computed (rotary) or an unreadable config.json,
    which the load reports."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    name = LEARNED_POSITIONS.get(model_type) if isinstance(model_type, str) else None
    count = config.get(name) if name else None
    return (name, count, model_type) if isinstance(count, int) else None


def _without_weights(folder: Path) -> str:
    """What to do with a ``--model`` folder that holds no weights (a config alone, say)."""
    if not (folder / "config.json").is_file():
        return f"--model {folder}: neither weights nor config.json there: give a save_pretrained output"
    tokenizer = any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json",
                                                           "tokenizer.model"))
    fetch = "" if tokenizer else (
        "; it needs the model's tokenizer too (tokenizer.json, tokenizer_config.json, and its chat template, "
        "chat_template.jinja, for chat 'messages' data): nothing is downloaded, so copy them from a local copy of "
        "the model, e.g. the Hugging Face cache's snapshots/ folder")
    write = (f"python -c \"import transformers as t; t.AutoModelForCausalLM.from_config("
             f"t.AutoConfig.from_pretrained({str(folder)!r})).save_pretrained({str(folder)!r})\"")
    return (f"--model {folder}: a config.json but no weights (model.safetensors); to fine-tune random weights of "
            f"this config, write them there first: {write}{fetch}. Without --model, --arch and --size train a small "
            "random model with a byte tokenizer")
