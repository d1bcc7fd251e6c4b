"""The model ``offload plan`` plans for, as the planner sees it (:class:`Workload`): a benchmark
preset, an ``nn.Sequential`` from a factory, or a Hugging Face causal LM's config, each built on the
meta device (no weight read or allocated), with LoRA adapters (``--lora-r``) over a base in its
own dtype or in 4 bits (``--quantize``). ``offload/cli/plan.py`` reads the arguments, plans and prints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..planning.presets import build_preset, preset_from_factory
from ..planning.shapes import ModelProfile, profile_layers
from .quantize import four_bit_counts, import_bitsandbytes, quantize_linears
from .quiet_imports import import_transformers

DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
#: The families whose positions are a learned table, by model type: its size in the config. A
#: longer sequence indexes past the table (rotary families compute any position, so their
#: ``max_position_embeddings`` is no limit to the forward).
LEARNED_POSITIONS = {"gpt2": "n_positions"}
#: The config's sizes a model is built from, checked to be positive integers before it is: a zero
#: divides by zero in the model's ``__init__`` (a head's size, rotary frequencies), a negative fails
#: making a tensor. ``None`` (a size the family derives, as ``head_dim``) and a name the family lacks
#: pass; a list (a size per layer) is checked item by item.
CONFIG_SIZES = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                "num_local_experts", "num_experts", "num_experts_per_tok", "n_routed_experts")
#: Tokens per row when --seq-len is left out.
DEFAULT_SEQ_LEN = 2048
#: --hf-config's loss chunk when --loss-chunk-tokens is left out: offload-finetune's default.
DEFAULT_LOSS_CHUNK_TOKENS = 1024


class PlanInputError(ValueError):
    """A bad input found after parsing (a config, a factory, a rates file, the model's size):
    :func:`main` answers it as the parser answers a bad flag, in one line."""


@dataclass(frozen=True)
class FourBitBase:
    """What ``--quantize`` made of the base: the format, the dtype of everything else in it, and
    the parameters its 4-bit weights stand for with the bytes of their codes and state."""

    quant_type: str
    double_quant: bool
    dtype: torch.dtype
    parameters: int
    nbytes: int

    def code(self) -> str:
        """The lines that load such a base, for the printed calls."""
        dtype = "torch." + str(self.dtype).removeprefix("torch.")
        return (f'four_bit = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="{self.quant_type}", '
                f"bnb_4bit_use_double_quant={self.double_quant}, bnb_4bit_compute_dtype={dtype})\n"
                f"hf_model = AutoModelForCausalLM.from_pretrained(path, quantization_config=four_bit, dtype={dtype}, "
                f'device_map="cpu")\n')

    def describe(self, trainable: int) -> str:
        """One line: what is in 4 bits, in how many bytes, and what trains."""
        double = "with" if self.double_quant else "without"
        return (f"4-bit base: {self.parameters / 1e9:.3f} B parameters in {self.quant_type} {double} double "
                f"quantisation, {self.nbytes / 2**30:.2f} GiB of codes and state ({self.nbytes / self.parameters:.3f} "
                f"B a parameter); the rest in {str(self.dtype).removeprefix('torch.')}; "
                f"{trainable / 1e6:.1f} M trainable (LoRA)")

    def to_json(self) -> dict[str, Any]:
        return {"quant_type": self.quant_type, "double_quant": self.double_quant,
                "dtype": str(self.dtype).removeprefix("torch."), "parameters": self.parameters, "bytes": self.nbytes}


class Workload:
    """The model as the planner sees it: its layers, a profile per compute dtype, the batch, and
    how to build it (for the printed code).

    A 4-bit base (``four_bit``) is profiled on ``profiled``, the same model with ``nn.Linear``
    layers where it has ``Linear4bit`` ones: a fake tensor stands for a weight, not for its
    quantisation state, and the layers' work and activations are those of the linear layers they
    dequantise into."""

    def __init__(self, layers: nn.Sequential, make_input: Callable[[], Any], batch_size: int, build: str,
                 finetune: list[str] | None = None, input_flags: str | None = None,
                 profiled: nn.Sequential | None = None, four_bit: FourBitBase | None = None,
                 users_layers: bool = False) -> None:
        self.layers = layers
        self.profiled = layers if profiled is None else profiled
        self.four_bit = four_bit
        self.make_input = make_input
        self.batch_size = batch_size
        self.build = build
        self.finetune = finetune
        #: The flags that describe a user's input (``--input-shape ...``, ``--hf-config ...
        #: --batch-size ...``): a forward that fails on it is their input's error, not the planner's.
        self.input_flags = input_flags
        #: Whether the layers are the user's own (``--model``): any failure of their forward on the
        #: input is the input's then; a preset's or a config's fails on the user's sizes only where
        #: they overflow what torch can hold, and any other failure is the planner's, a traceback.
        self.users_layers = users_layers
        self._profiles: dict[Any, ModelProfile] = {}

    @property
    def parameters(self) -> int:
        """The model's parameters, a 4-bit weight's counted as those it stands for (not its bytes)."""
        from ..streams.quantized import is_4bit_weight

        return sum(p.quant_state.shape.numel() if is_4bit_weight(p) else p.numel() for p in self.layers.parameters())

    def profile(self, compute_dtype: torch.dtype | None) -> ModelProfile:
        if compute_dtype not in self._profiles:
            try:
                profile = profile_layers(self.profiled, self.make_input, compute_dtype=compute_dtype)
            except (RuntimeError, TypeError, ValueError, OverflowError) as error:
                # What torch raises on the sizes given (a user's layer refusing the input, a tensor
                # past int64's bytes): the flags' error, in one line. Other exceptions propagate.
                if self.input_flags is None or not (self.users_layers or _overflowed(error)):
                    raise
                raise PlanInputError(f"{self.input_flags}: {_one_line(error)}") from error
            self._profiles[compute_dtype] = profile
        return self._profiles[compute_dtype]


def workload(args: argparse.Namespace) -> Workload:
    if args.hf_config:
        return hf_workload(args)
    rows = args.batch_size
    input_flags = " ".join([f"--preset {args.preset}", *(["--set", *args.set] if args.set else []),
                            "--batch-size", str(rows)])
    if args.model:
        input_flags = " ".join(["--batch-size", str(rows), "--input-shape", *map(str, args.input_shape)]
                               + ([] if args.vocab is None else ["--vocab", str(args.vocab)]))
        input_flags += f" for --model {args.model}"
        # A console script's sys.path starts with the script's own directory, not the one the
        # user is in (`python -m offload` starts with that one): put it first for the factory's
        # module, as uvicorn and gunicorn do for their APP argument.
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
    # Built on the meta device: the planner needs shapes and dtypes, not weights.
    with torch.device("meta"):
        try:
            if args.preset:
                overrides = dict(_setting(item) for item in args.set)
                preset = build_preset(args.preset, **overrides)
                build = f"build_preset({args.preset!r}{''.join(f', {k}={v!r}' for k, v in overrides.items())}).model"
            else:
                preset = preset_from_factory(args.model, args.input_shape, args.vocab, batch_size=args.batch_size)
                build = f"{args.model.replace(':', '.')}()"
        except (TypeError, ValueError) as error:
            # The preset's checks and the factory's import, name and return value.
            raise PlanInputError(_one_line(error)) from error
        except RuntimeError as error:  # a preset's weight past int64's bytes (--set width=2**62)
            raise PlanInputError(f"{input_flags}: {_one_line(error)}") from error

    def make_input() -> Any:
        return preset.make_batch(rows, "cpu")[0]

    return Workload(preset.model, make_input, rows, build, input_flags=input_flags, users_layers=bool(args.model))


def _setting(item: str) -> tuple[str, Any]:
    key, sep, value = item.partition("=")
    if not sep:
        raise PlanInputError(f"--set takes KEY=VALUE, got {item!r}")
    if key == "batch_size":  # the plan's batch is --batch-size's: a preset's would be printed, not planned
        raise PlanInputError(f"--set {item}: give the batch as --batch-size {value}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def hf_config(spec: str) -> Any:
    """A transformers config from a ``config.json``, its directory, or the JSON text."""
    import transformers

    path, is_json = Path(spec), spec.lstrip().startswith("{")
    try:
        if not is_json and path.is_dir():  # JSON first: a long text is no path the file system takes
            return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        text = spec if is_json else path.read_text()
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        # A weights or tokenizer file beside the config is the usual mistake: say what to give instead.
        raise PlanInputError(f"--hf-config {spec}: not a JSON config ({_one_line(error)}); give the model's "
                             "config.json, the folder holding it, or its JSON text") from error
    except (OSError, ValueError) as error:  # unreadable, or a config transformers refuses
        raise PlanInputError(f"--hf-config {spec}: {_one_line(error)}") from error
    if not isinstance(data, dict) or data.get("model_type") is None:
        raise PlanInputError(f"--hf-config {spec}: the config has no model_type (a config.json names its family, "
                             f'e.g. "model_type": "llama")')
    model_type = data.pop("model_type")
    _check_family(spec, model_type)  # before transformers lists every family it knows
    try:
        return transformers.AutoConfig.for_model(model_type, **data)
    except Exception as error:  # noqa: BLE001 (a config's checks raise huggingface_hub's own classes too)
        raise PlanInputError(f"--hf-config {spec}: {_one_line(error)}") from error


def _check_family(spec: str, model_type: str) -> None:
    from ..integrations.transformers_families import CUT_MODEL_TYPES

    if model_type not in CUT_MODEL_TYPES:  # as causal_lm_sequential cuts them
        raise PlanInputError(f"--hf-config {spec}: model_type {model_type!r} is not a causal LM that offload cuts "
                             f"into stages; it plans {', '.join(CUT_MODEL_TYPES)}")


def hf_workload(args: argparse.Namespace) -> Workload:
    """The config's causal LM built on the meta device, cut into stages as OffloadModel gets it."""
    try:
        transformers = import_transformers()  # without torchao's import notes (offload/cli/quiet_imports.py)
    except ImportError as error:
        raise PlanInputError(f'{error}. --hf-config needs transformers: pip install "offload[transformers]"') from error
    from ..integrations.transformers import causal_lm_sequential

    config = hf_config(args.hf_config)
    _check_family(args.hf_config, config.model_type)
    _check_sizes(args.hf_config, config)
    _check_positions(args, config)
    chunk = args.loss_chunk_tokens or None
    dtype = four_bit_dtype(args) if args.quantize else torch.float32
    profiled = four_bit = None
    if args.quantize:
        try:
            import_bitsandbytes(f"--quantize {args.quantize}")
        except ImportError as error:
            raise PlanInputError(_one_line(error)) from error
    try:
        with torch.device("meta"):
            # Sizes the model refuses (a negative one fails making its tensor: RuntimeError).
            hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
            if args.quantize:
                twin = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
                profiled = causal_lm_sequential(_with_lora(twin, args.lora_r), loss_chunk_tokens=chunk,
                                                router_logits=None)
                four_bit = _quantized(hf, args, dtype)
            if args.lora_r:
                hf = _with_lora(hf, args.lora_r)
            layers = causal_lm_sequential(hf, loss_chunk_tokens=chunk, router_logits=None)  # as offload-finetune
    except (ValueError, TypeError, AttributeError, RuntimeError, ArithmeticError) as error:
        # ArithmeticError: a size _check_sizes does not know, zero, divided by in the model's __init__.
        raise PlanInputError(f"--hf-config {args.hf_config}: {_one_line(error)}") from error
    rows, tokens = args.batch_size, args.seq_len

    def make_input() -> Any:
        ids = torch.zeros(rows, tokens, dtype=torch.long)
        return {"input_ids": ids, "labels": ids} if chunk else ids

    hf_model = "get_peft_model(hf_model, LoraConfig(...))" if args.lora_r else "hf_model"
    router = ", router_logits=True" if getattr(config.get_text_config(), "output_router_logits", False) else ""
    build = f"causal_lm_sequential({hf_model}{', loss_chunk_tokens=' + str(chunk) if chunk else ''}{router})"
    input_flags = f"--hf-config {args.hf_config} --batch-size {rows} --seq-len {tokens}"
    return Workload(layers, make_input, rows, build, finetune=_finetune_flags(args, layers.hf_model),
                    input_flags=input_flags, profiled=profiled, four_bit=four_bit)


def _finetune_flags(args: argparse.Namespace, hf: nn.Module) -> list[str] | None:
    """``offload-finetune``'s flags for the planned model, or ``None`` where it would refuse every
    checkpoint of it: one storing tensors that loading splits (Sarvam-MoE's fused ``query_key_value``)."""
    from ..integrations.transformers_loading import split_on_loading

    if split_on_loading(hf):
        return None
    flags = ["--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
             "--loss-chunk-tokens", str(args.loss_chunk_tokens)]
    if args.lora_r:
        flags += ["--lora-r", str(args.lora_r)]
    if args.quantize:
        flags += ["--load-in-4bit", "--bnb-4bit-quant-type", args.quantize]
        flags += [] if args.bnb_4bit_use_double_quant else ["--no-bnb-4bit-use-double-quant"]
    return flags


def _check_sizes(spec: str, config: Any) -> None:
    """Refuse a :data:`CONFIG_SIZES` size that is not a positive integer, naming it, before the
    model is built from it.

    Raises:
        PlanInputError: the first such size and its value.
    """
    for name in CONFIG_SIZES:
        value = getattr(config, name, None)
        for size in value if isinstance(value, (list, tuple)) else [value]:
            if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
                raise PlanInputError(f"--hf-config {spec}: {name} must be a positive integer, got {value!r}; give the "
                                     "size of the model to plan")
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
        # Grouped-query attention shares each key and value head among as many query heads: the
        # first attention would fail (found once profiling, a traceback).
        raise PlanInputError(f"--hf-config {spec}: num_key_value_heads {kv_heads} does not divide "
                             f"num_attention_heads {heads} (each key and value head serves an equal group of query "
                             "heads); give a divisor of it")


def _check_positions(args: argparse.Namespace, config: Any) -> None:
    """Refuse a ``--seq-len`` past a learned position table: the planned model would fail at its
    first forward (an index past the table). The default is lowered to the table's size."""
    name = LEARNED_POSITIONS.get(config.model_type)
    positions = getattr(config, name, None) if name else None
    if isinstance(positions, int) and args.seq_len > positions and getattr(args, "seq_len_default", False):
        args.seq_len = positions
    if isinstance(positions, int) and args.seq_len > positions:
        raise PlanInputError(f"--seq-len {args.seq_len} is more than the {positions} positions of --hf-config "
                             f"{args.hf_config} ({config.model_type} learns one embedding per position: {name} in "
                             f"its config); plan --seq-len {positions} or less")


def four_bit_dtype(args: argparse.Namespace) -> torch.dtype:
    """The dtype of a 4-bit base's other parameters, which it computes in: ``--compute-dtype``'s;
    under ``auto``, bfloat16 (QLoRA's), or float32 on a CPU device, as ``offload-finetune
    --load-in-4bit`` chooses there without measuring the CPU (``default_compute_dtype``)."""
    if args.compute_dtype == "auto":
        return torch.float32 if args.device == "cpu" else torch.bfloat16
    return DTYPES[args.compute_dtype] or torch.float32


def _quantized(hf: nn.Module, args: argparse.Namespace, dtype: torch.dtype) -> FourBitBase:
    """Quantise ``hf``'s linear layers on the meta device, as ``--quantize`` asks."""
    quantize_linears(hf, quant_type=args.quantize, double_quant=args.bnb_4bit_use_double_quant, compute_dtype=dtype,
                     device="meta")
    parameters, nbytes = four_bit_counts(hf)
    return FourBitBase(args.quantize, args.bnb_4bit_use_double_quant, dtype, parameters, nbytes)


def _with_lora(hf: nn.Module, rank: int) -> nn.Module:
    try:
        import peft
    except ImportError as error:
        raise PlanInputError(f'{error}. --lora-r needs peft: pip install "offload[peft]"') from error
    with warnings.catch_warnings():
        # peft asks the meta model a deprecated transformers question; the note is theirs, not the user's.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return peft.get_peft_model(hf, peft.LoraConfig(r=rank, target_modules="all-linear", task_type="CAUSAL_LM"))


def _overflowed(error: BaseException) -> bool:
    """Whether ``error`` (or what it wraps: the profile names the layer that failed) is a size past
    what torch can hold: a shape or a storage's bytes past int64."""
    while error is not None:
        if isinstance(error, OverflowError) or "overflow" in str(error).lower():
            return True
        error = error.__cause__  # type: ignore[assignment]
    return False


def _one_line(error: BaseException) -> str:
    """``error``'s message on one line (transformers' and huggingface_hub's span several), less the
    C++ frames torch appends to some (``Exception raised from ...``)."""
    text = str(error).split("\nException raised from ")[0]
    return " ".join(line.strip() for line in text.splitlines() if line.strip()) or type(error).__name__
