"""The models ``offload-finetune`` trains: a random-initialised one built from a config (with a
byte-level tokenizer, so nothing is downloaded), a local ``save_pretrained`` directory, either
with its linear layers in 4 bits (``--load-in-4bit``), and LoRA adapters on any of them. It does
not wrap them in ``OffloadModel``: ``offload/cli/finetune.py`` does.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch

#: Random-initialised configs by size: (hidden, layers, heads, key/value heads, intermediate).
SIZES = {"tiny": (64, 4, 4, 2, 128), "small": (512, 8, 8, 4, 1408), "1b": (2048, 16, 32, 8, 5632)}


def with_lora(hf, args: argparse.Namespace):
    """``hf`` with LoRA adapters (a ``PeftModel``; its base is frozen), or ``None`` without ``--lora-r``.

    The adapter's ``base_model_name_or_path`` is ``--model`` made absolute: PEFT would record the
    path as typed, which names another directory (or none) once the adapter is read from elsewhere.
    """
    if args.lora_r == 0:
        return None
    try:
        import peft
    except ImportError as error:
        raise SystemExit(f'{error}. --lora-r needs peft: pip install "offload[peft]"') from error
    targets = args.lora_targets[0] if args.lora_targets == ["all-linear"] else args.lora_targets
    config = peft.LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha or 2 * args.lora_r,
                             lora_dropout=args.lora_dropout, target_modules=targets, task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        # peft asks the model a deprecated transformers question; the note is theirs, not the user's.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        try:
            peft_model = peft.get_peft_model(hf, config)
        except ValueError as error:  # a name no module has, or a module LoRA cannot adapt
            raise SystemExit(f"{args.prog}: error: --lora-targets {' '.join(args.lora_targets)}: "
                             f"{str(error).splitlines()[0]} Its linear layers: {_linear_names(hf)}") from None
    if args.model is not None:
        peft_model.peft_config["default"].base_model_name_or_path = str(Path(args.model).resolve())
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    print(f"LoRA rank {args.lora_r} on {', '.join(sorted(config.target_modules))}: "
          f"{trainable / 1e6:.2f} M trainable parameters")
    return peft_model


def _linear_names(hf) -> str:
    """The names ``--lora-targets`` takes for ``hf``'s linear layers (each layer's last name)."""
    from torch import nn

    return " ".join(sorted({name.rsplit(".", 1)[-1] for name, module in hf.named_modules()
                            if isinstance(module, nn.Linear)}))


def random_model(arch: str, size: str, vocab: int, seq_len: int):
    import transformers

    hidden, layers, heads, kv_heads, intermediate = SIZES[size]
    if arch == "gpt2":
        config = transformers.GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=vocab,
                                         n_positions=max(seq_len, 64), tie_word_embeddings=False,
                                         bos_token_id=0, eos_token_id=0)
    else:
        # Token ids 0 for padding and both ends (some families' defaults lie outside a byte
        # vocabulary), and head_dim set where a family would otherwise take a fixed default.
        shared = {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
                  "num_key_value_heads": kv_heads, "intermediate_size": intermediate, "vocab_size": vocab,
                  "max_position_embeddings": max(seq_len, 64), "tie_word_embeddings": False,
                  "head_dim": hidden // heads, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}
        options = {**shared, **_family_sizes(arch, hidden, heads, intermediate)}
        config = transformers.AutoConfig.for_model(arch, **options)
    return transformers.AutoModelForCausalLM.from_config(config), byte_tokenizer()


#: Model types whose configs take their sizes by the names of the family whose forward theirs repeats
#: (``offload/integrations/transformers_families.py``): latent attention as DeepSeek-V3's, experts as
#: that family's.
_SIZED_AS = {"youtu": "deepseek_v3", "glm4_moe_lite": "deepseek_v3", "aria_text": "deepseek_v3",
             "axk1": "deepseek_v3", "solar_open": "glm4_moe", "flex_olmo": "olmoe", "flint": "qwen2_moe"}


def _family_sizes(arch: str, hidden: int, heads: int, intermediate: int) -> dict:
    """Sizes a family's config takes from elsewhere than the shared ones, where its defaults would not
    build (DeepSeek's latent attention, dots.llm1's unset experts) or build a model far larger than
    the size asked for (hundreds of experts)."""
    arch = _SIZED_AS.get(arch, arch)
    experts = {"n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
               "moe_intermediate_size": intermediate // 2, "n_group": 1, "topk_group": 1}
    if arch in ("deepseek_v2", "deepseek_v3"):
        # Latent attention: one key and value per head, the rotary part of each head as wide as
        # head_dim (the rotary tables are built for head_dim).
        head_dim = hidden // heads
        return {**experts, "num_key_value_heads": heads, "q_lora_rank": hidden // 2, "kv_lora_rank": hidden // 2,
                "qk_rope_head_dim": head_dim, "qk_nope_head_dim": head_dim, "v_head_dim": head_dim}
    if arch in ("dots1", "glm4_moe"):
        return experts
    return {
        "gpt_oss": {"num_local_experts": 8},
        "olmoe": {"num_experts": 8},
        "ernie4_5_moe": {"moe_num_experts": 8, "moe_k": 2, "moe_intermediate_size": intermediate // 2},
        "exaone_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": intermediate // 2},
        "qwen3_moe": {"num_experts": 8, "moe_intermediate_size": intermediate // 2},
        "qwen2_moe": {"num_experts": 8, "moe_intermediate_size": intermediate // 2,
                      "shared_expert_intermediate_size": intermediate},
        "qwen3_next": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": intermediate // 2,
                       "shared_expert_intermediate_size": intermediate, "linear_num_key_heads": heads // 2,
                       "linear_num_value_heads": heads, "linear_key_head_dim": hidden // heads,
                       "linear_value_head_dim": hidden // heads},
    }.get(arch, {})


def byte_tokenizer():
    """A tokenizer whose ids are the text's UTF-8 bytes (0-255), saved with the random model.

    With it, ``AutoTokenizer.from_pretrained(out)`` and ``--model out`` work on the output as on
    any ``save_pretrained`` directory, and ``decode`` turns generated ids back into text. Id 0 (the
    NUL byte) is its end-of-sequence, beginning and padding token, as the random model's config says:
    packed documents are kept apart by it (Note: [Packing] in ``offload/integrations/data.py``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Byte-level pre-tokenizers stand for each byte with a printable character: bytes that are
    # printable themselves keep theirs, the rest take code points from 256 up, in byte order.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = (b for b in range(256) if b not in printable)
    char = {b: chr(b) for b in printable} | {b: chr(256 + k) for k, b in enumerate(others)}
    tokenizer = Tokenizer(models.BPE(vocab={char[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    # split_special_tokens: the text "Ā" (the character standing for byte 0) is its own two bytes,
    # not the special token; only the reader's end-of-sequence puts id 0 between documents.
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=char[0], bos_token=char[0],
                                   pad_token=char[0], split_special_tokens=True)


def four_bit_settings(args: argparse.Namespace, compute_dtype: torch.dtype | None) -> dict | None:
    """``--load-in-4bit``'s quantisation (:func:`~offload.cli.quantize.quantize_linears`' keywords
    but the device), or ``None`` without it. The base's other parameters are in ``compute_dtype``
    (``--compute-dtype``'s), float32 for ``None``."""
    if not args.load_in_4bit:
        return None
    return {"quant_type": args.bnb_4bit_quant_type, "double_quant": args.bnb_4bit_use_double_quant,
            "compute_dtype": compute_dtype or torch.float32}


def pretrained_model(path: Path, four_bit: dict | None = None):
    """``from_pretrained``: for ``--untie-embeddings``, which changes the model before it is wrapped
    (the other runs load it slice by slice with ``load_causal_lm``); with ``four_bit``
    (:func:`four_bit_settings`), each linear layer but the head quantised on the CPU as it loads."""
    import transformers

    if four_bit is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    else:
        from .quantize import bnb_config

        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=four_bit["compute_dtype"], quantization_config=bnb_config(**four_bit),
            device_map="cpu")  # the host copies: OffloadModel moves slices to the device
    return model, pretrained_tokenizer(path)


def quantized_random_model(hf, four_bit: dict):
    """The random-initialised ``hf`` in ``four_bit``'s dtype, its linear layers but the head
    quantised on the CPU (as :func:`pretrained_model` loads a checkpoint)."""
    from .quantize import quantize_linears

    return quantize_linears(hf.to(four_bit["compute_dtype"]), device="cpu", **four_bit)


def pretrained_tokenizer(path: Path):
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise SystemExit(f"--model {path}: no tokenizer found there ({error}); save one with the weights") from error
