"""``offload.integrations.transformers.load_causal_lm`` against ``from_pretrained`` followed by
``causal_lm_sequential`` and ``OffloadModel``: every parameter and buffer, logits, losses and
gradients bit for bit, for every supported family, from sharded checkpoints written here with
``save_pretrained``; and the peak memory of loading, measured in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from offload import OffloadModel

from .helpers import DEVICES, assert_same_grads
from .test_transformers import EXACT, FAMILIES, LATER_FAMILIES, TIED_BY_DEFAULT, batch, both_backward, build

transformers = pytest.importorskip("transformers")
from offload.integrations.transformers import causal_lm_sequential, load_causal_lm  # noqa: E402

#: Shards of a few kilobytes: the small models below are cut into several files.
SHARD = "20KB"


def from_pretrained(path: Path, dtype: torch.dtype | str = torch.float32) -> torch.nn.Module:
    transformers.logging.set_verbosity_error()  # the tiny shards and configs draw warnings
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def tensors_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def assert_same_tensors(got: torch.nn.Module, want: torch.nn.Module) -> None:
    mine, theirs = tensors_of(got), tensors_of(want)
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert mine[name].dtype == tensor.dtype, name
        torch.testing.assert_close(mine[name], tensor, **EXACT, msg=name)


CASES = [pytest.param(kind, False, id=kind) for kind in FAMILIES + LATER_FAMILIES] + [
    pytest.param(kind, True, id=f"{kind}-tied") for kind in TIED_BY_DEFAULT]


@pytest.mark.parametrize("kind,tied", CASES)
def test_every_tensor_and_the_training_step_equal_from_pretrained(kind, tied, tmp_path):
    build(kind, tied=tied).save_pretrained(tmp_path, max_shard_size=SHARD)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    reference = from_pretrained(tmp_path)
    model, hf = load_causal_lm(tmp_path, "cpu", num_slices=3)
    # Rotary tables and embedding scales (not stored) included, and the same modes.
    assert_same_tensors(hf, reference)
    assert hf.training == reference.training
    tied_here = hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    assert tied_here == tied == (reference.get_output_embeddings().weight is reference.get_input_embeddings().weight)
    wrapped = OffloadModel(causal_lm_sequential(reference), "cpu", num_slices=3)
    assert model.partition == wrapped.partition
    assert model.memory_footprint() == wrapped.memory_footprint()
    assert_same_training_step(model, hf, reference)


def save_with_head(kind: str, path: Path, head: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   embedding_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Save a tied model whose checkpoint stores ``lm_head.weight`` beside the embedding: its copy,
    or ``head(embedding)``; the embedding cast to ``embedding_dtype`` and back first. Returns what is stored."""
    model = build(kind, tied=True)
    model.save_pretrained(path)  # config.json: tie_word_embeddings=True
    from safetensors.torch import save_file
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    embedding = next(name for name, p in model.named_parameters() if p is model.get_input_embeddings().weight)
    if embedding_dtype is not None:
        state[embedding] = state[embedding].to(embedding_dtype).float()
    state["lm_head.weight"] = state[embedding].clone() if head is None else head(state[embedding])
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return state


def assert_same_training_step(model, hf, reference) -> None:
    hf.train()
    reference.train()
    inputs = batch()
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    got_logits, want_logits = both_backward(hf, reference, model, inputs, labels)
    torch.testing.assert_close(got_logits, want_logits, **EXACT)
    assert_same_grads(hf, reference, **EXACT)


def tied(hf: torch.nn.Module) -> bool:
    return hf.get_output_embeddings().weight is hf.get_input_embeddings().weight


@pytest.mark.parametrize("kind", ["gpt2", "gemma"])
def test_a_tied_model_whose_checkpoint_also_stores_the_head(kind, tmp_path):
    # Many hub checkpoints of tied models store lm_head.weight beside the embedding, equal to it.
    save_with_head(kind, tmp_path)
    reference = from_pretrained(tmp_path)
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        model, hf = load_causal_lm(tmp_path, "cpu", num_slices=3)
    assert not [w for w in told if "not tied" in str(w.message)]  # nothing to untie, nothing to say
    assert tied(hf) and tied(reference)
    assert_same_tensors(hf, reference)
    # Read once, held once: as the wrapped reference, whose head borrows the embedding.
    wrapped = OffloadModel(causal_lm_sequential(reference), "cpu", num_slices=3)
    assert model.memory_footprint() == wrapped.memory_footprint()


@pytest.mark.parametrize("kind", ["gpt2", "gemma", "llama"])
def test_a_tied_model_whose_stored_head_differs_is_untied_as_from_pretrained_unties_it(kind, tmp_path):
    # config.json ties the head to the embedding, but the checkpoint stores a head of other values:
    # from_pretrained warns and unties them, each parameter holding its stored values.
    state = save_with_head(kind, tmp_path, head=lambda embedding: embedding + 1)
    reference = from_pretrained(tmp_path)
    with pytest.warns(UserWarning, match=r"^the checkpoint stores 'lm_head\.weight' \(model\.safetensors\) and "
                                         r"'[^']+' \(model\.safetensors\), which the model ties .* with different "
                                         r"values, so they are not tied: each holds its stored values, as "
                                         r"from_pretrained does\. Save the config with tie_word_embeddings=False"):
        model, hf = load_causal_lm(tmp_path, "cpu", num_slices=3)
    assert not tied(reference) and not tied(hf)
    assert hf.config.tie_word_embeddings is reference.config.tie_word_embeddings is True  # left as it is, by both
    assert hf.all_tied_weights_keys == reference.all_tied_weights_keys == {}  # tie_weights() would not tie them again
    torch.testing.assert_close(hf.get_output_embeddings().weight, state["lm_head.weight"], **EXACT)
    assert_same_tensors(hf, reference)
    wrapped = OffloadModel(causal_lm_sequential(reference), "cpu", num_slices=3)
    assert model.partition == wrapped.partition
    assert model.memory_footprint() == wrapped.memory_footprint()
    assert_same_training_step(model, hf, reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_stored_head_and_embedding_are_compared_in_the_models_dtype(dtype, tmp_path):
    # A head apart from the embedding by less than bfloat16's precision: from_pretrained compares the
    # two once loaded in the model's dtype, so unties them in float32 and ties them in bfloat16.
    save_with_head("llama", tmp_path, head=lambda embedding: embedding * (1 + 2**-12), embedding_dtype=torch.bfloat16)
    reference = from_pretrained(tmp_path, dtype)
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        model, hf = load_causal_lm(tmp_path, "cpu", num_slices=3, dtype=dtype)
    assert tied(reference) == (dtype == torch.bfloat16) == tied(hf)
    assert hf.all_tied_weights_keys == reference.all_tied_weights_keys
    assert any("not tied" in str(w.message) for w in told) == (dtype == torch.float32)
    assert_same_tensors(hf, reference)
    assert_same_training_step(model, hf, reference)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["llama", "gemma3_text", "mixtral"])
def test_a_bfloat16_checkpoint_into_float32_masters_and_a_compute_dtype(kind, device, tmp_path):
    build(kind, dropout=0.0).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size=SHARD)
    reference = from_pretrained(tmp_path, torch.float32)
    model, hf = load_causal_lm(tmp_path, device, num_slices=2, compute_dtype=torch.bfloat16)
    assert_same_tensors(hf, reference)
    wrapped = OffloadModel(causal_lm_sequential(reference), device, num_slices=2, compute_dtype=torch.bfloat16)
    inputs = batch(device)
    torch.testing.assert_close(model(inputs), wrapped(inputs), **EXACT)
    # "auto": the dtype config.json names, as from_pretrained(dtype="auto").
    _, kept = load_causal_lm(tmp_path, "cpu", dtype="auto")
    assert_same_tensors(kept, from_pretrained(tmp_path, "auto"))
    assert kept.get_input_embeddings().weight.dtype == torch.bfloat16
    # Without a dtype in config.json: the stored tensors'.
    config = json.loads((tmp_path / "config.json").read_text())
    del config["dtype"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    _, kept = load_causal_lm(tmp_path, "cpu", dtype="auto")
    assert_same_tensors(kept, from_pretrained(tmp_path, "auto"))
    assert kept.get_input_embeddings().weight.dtype == torch.bfloat16


def test_from_pretrained_keywords_for_the_attention_and_the_dtype_and_one_line_for_any_other(tmp_path):
    build("llama", dropout=0.0).save_pretrained(tmp_path)
    # attn_implementation as from_pretrained takes it: on the config, and eager's logits and gradients.
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                                  attn_implementation="eager")
    model, hf = load_causal_lm(tmp_path, "cpu", num_slices=2, attn_implementation="eager")
    assert hf.config._attn_implementation == reference.config._attn_implementation == "eager"
    assert_same_training_step(model, hf, reference)
    # torch_dtype, dtype's old name, as from_pretrained takes it: where dtype is not given; warned of.
    for keywords in ({"torch_dtype": torch.bfloat16}, {"dtype": torch.float32, "torch_dtype": torch.bfloat16}):
        with pytest.warns(FutureWarning, match="^torch_dtype is deprecated, as in transformers: use dtype instead$"):
            _, hf = load_causal_lm(tmp_path, "cpu", **keywords)
        reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, **keywords)
        assert hf.dtype == reference.dtype == keywords.get("dtype", torch.bfloat16)
        assert_same_tensors(hf, reference)
    # Any other keyword (from_pretrained's device_map, revision, ...): one line naming what is taken,
    # before anything is read (OffloadModel would have named itself, which the caller never called).
    with pytest.raises(TypeError) as refused:
        load_causal_lm(tmp_path / "missing", "cpu", num_slices=2, revision="main", device_map="cpu")
    assert "\n" not in str(refused.value)
    assert str(refused.value).startswith(
        "load_causal_lm (and OffloadedCausalLM.from_pretrained) got unexpected keyword arguments: 'device_map', "
        "'revision'; it takes dtype, loss_chunk_tokens, quantization_config, attn_implementation, router_logits, "
        "torch_dtype, untie_differing_copies and OffloadModel's offload_device, num_slices, ")
    # build_from_checkpoint's own keyword passes, as before the refusal.
    load_causal_lm(tmp_path, "cpu", num_slices=2, untie_differing_copies=False)


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])
def test_masters_on_disk_load_and_train_as_in_ram(kind, tmp_path):
    from offload import DiskTier, OffloadOptimizer

    build(kind, dropout=0.0, tied=True).save_pretrained(tmp_path / "model", max_shard_size=SHARD)
    runs = []
    for masters in (None, DiskTier(tmp_path / "masters")):
        model, hf = load_causal_lm(tmp_path / "model", "cpu", num_slices=3, compute_dtype=torch.bfloat16,
                                   masters=masters)
        hf.train()
        runs.append((model, hf, OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, fused=True)))
    on_disk = runs[1][0]
    assert all(s.storage.masters_file is not None for s in on_disk._engine.slices)
    assert sum(s.storage.masters_file.resident_bytes() for s in on_disk._engine.slices) == 0
    assert_same_tensors(runs[1][1], runs[0][1])
    inputs = batch()
    for _ in range(3):
        logits = [model(inputs).float() for model, _, _ in runs]
        torch.testing.assert_close(logits[1], logits[0], **EXACT)
        for (_, _, optimizer), out in zip(runs, logits):
            out.pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    for _, _, optimizer in runs:
        optimizer.synchronize()  # the tensors are read through the Hugging Face models
    assert_same_tensors(runs[1][1], runs[0][1])


@pytest.mark.parametrize("kind", ["gpt2", "gemma"])
def test_a_base_models_checkpoint_without_the_prefix(kind, tmp_path):
    # A tied model's decoder alone holds all its weights: stored names lack "model." / "transformer.".
    build(kind, tied=True).base_model.save_pretrained(tmp_path)
    model, hf = load_causal_lm(tmp_path, "cpu", num_slices=2)
    assert_same_tensors(hf, from_pretrained(tmp_path))


def save_legacy(kind: str, path: Path) -> tuple[list[str], list[str]]:
    """Save a checkpoint as older transformers wrote them, which from_pretrained still loads: GPT-2
    as on the hub (no "transformer." prefix, no head beside the tied embedding) with each layer's
    causal-mask buffers ``attn.bias`` and ``attn.masked_bias``; a Llama with each layer's rotary
    ``inv_freq``. Returns the stored names that name nothing in the model: those from_pretrained
    reports unexpected, and those it drops without a word."""
    from safetensors.torch import load_file, save_file

    model = build(kind, dropout=0.0, tied=kind == "gpt2")
    model.save_pretrained(path)
    state = load_file(path / "model.safetensors")
    reported, silent = [], []
    for i in range(model.config.num_hidden_layers):
        if kind == "gpt2":
            state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64)
            state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
            reported.append(f"h.{i}.attn.masked_bias")
            silent.append(f"h.{i}.attn.bias")  # GPT-2's _keys_to_ignore_on_load_unexpected
        else:
            state[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = 1 / 10000 ** (torch.arange(0, 8, 2) / 8)
            silent.append(f"model.layers.{i}.self_attn.rotary_emb.inv_freq")
    if kind == "gpt2":
        state = {k.removeprefix("transformer."): v for k, v in state.items() if k != "lm_head.weight"}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return reported, silent


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_stored_tensors_that_name_nothing_are_skipped_unread_as_from_pretrained_skips_them(kind, tmp_path,
                                                                                           monkeypatch):
    from offload.loading import safetensors_files

    reported, silent = save_legacy(kind, tmp_path)
    reference = from_pretrained(tmp_path)
    read: list[str] = []

    def spied(reader):
        def spy(stored, name, *rest):
            read.append(name)
            return reader(stored, name, *rest)
        return spy

    for reader in ("_read_bytes", "_read_span"):  # every read of a stored tensor's bytes goes through one
        monkeypatch.setattr(safetensors_files, reader, spied(getattr(safetensors_files, reader)))
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        model, hf = load_causal_lm(tmp_path, "cpu", num_slices=3)
    assert read and not set(read) & {*reported, *silent}  # not a byte of them read
    # One warning naming each tensor from_pretrained reports unexpected, none for those it drops silently.
    unused = [str(w.message) for w in told if "name nothing in the model" in str(w.message)]
    assert len(unused) == (1 if reported else 0)
    for message in unused:
        assert message.startswith(f"the checkpoint at {tmp_path} stores tensors that name nothing in the model, "
                                  "which were not read, as from_pretrained leaves them unused: "
                                  + ", ".join(f"'{name}' (model.safetensors)" for name in reported))
        assert not any(name in message for name in silent)
    assert_same_tensors(hf, reference)
    assert_same_training_step(model, hf, reference)


def test_offload_finetune_trains_from_a_checkpoint_with_tensors_that_name_nothing(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from offload.cli import finetune as cli
    from offload.cli.models import random_model

    from .helpers import cli_result

    hf, tokenizer = random_model("gpt2", "tiny", 256, 16)
    hf.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    state = load_file(tmp_path / "base" / "model.safetensors")
    masks = {f"transformer.h.{i}.attn.masked_bias": torch.tensor(-1e4) for i in range(hf.config.n_layer)}
    save_file({**state, **masks}, str(tmp_path / "base" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"name nothing in the model.*'transformer\.h\.0\.attn\.masked_bias'"):
        code, out, err = cli_result(cli.main, ["--device", "cpu", "--no-progress", "--model", str(tmp_path / "base"),
                                               "--out", str(tmp_path / "out"), "--steps", "1", "--seq-len", "16"],
                                    capsys)
    assert code == 0, err[-3000:]
    assert "slice by slice" in out


ADVICE = (r"\. load_causal_lm reads every parameter and persistent buffer from the checkpoint: check that config\.json "
          r"is the one saved with these weights and that the folder holds every shard\. To train tensors the "
          r"checkpoint lacks from a fresh initialisation, or of other shapes \(ignore_mismatched_sizes=True\), load "
          r"with from_pretrained, which initialises them, and wrap the model with causal_lm_sequential and "
          r"OffloadModel$")


def test_checkpoints_that_do_not_match_name_the_key_and_the_file_and_say_what_to_do(tmp_path):
    from safetensors.torch import load_file, save_file

    build("llama").save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in stored.items() if k != "model.layers.1.mlp.up_proj.weight"},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing from the checkpoint: '2\.layer\.mlp\.up_proj\.weight'" + ADVICE):
        load_causal_lm(tmp_path, "cpu")
    # A tensor that names nothing is told with the missing one it may have been meant for.
    save_file({**{k: v for k, v in stored.items() if k != "model.layers.1.mlp.up_proj.weight"},
               "model.layers.1.mlp.up.weight": stored["model.layers.1.mlp.up_proj.weight"]},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match=r"missing from the checkpoint: '2\.layer\.mlp\.up_proj\.weight'; stored "
                                             r"but naming nothing in the model: 'model\.layers\.1\.mlp\.up\.weight' "
                                             r"\(model\.safetensors\)" + ADVICE):
            load_causal_lm(tmp_path, "cpu")
    assert not [w for w in told if "name nothing" in str(w.message)]  # told once, in the error
    # Alone, such a tensor is skipped with a warning, as from_pretrained skips it.
    save_file({**stored, "model.layers.9.mlp.up_proj.weight": torch.zeros(1)}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"name nothing in the model, which were not read, as from_pretrained leaves "
                                         r"them unused: 'model\.layers\.9\.mlp\.up_proj\.weight' "
                                         r"\(model\.safetensors\)\. "):
        _, hf = load_causal_lm(tmp_path, "cpu")
    assert_same_tensors(hf, from_pretrained(tmp_path))
    save_file({k: v for k, v in stored.items() if k != "model.layers.0.mlp.up_proj.weight"},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing from the checkpoint: '1\.layer\.mlp\.up_proj\.weight'"):
        load_causal_lm(tmp_path, "cpu")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' in model\.safetensors has shape "
                                         r"\(64, 32\), the model's '1\.layer\.mlp\.up_proj\.weight' is \(48, 32\)"
                                         r".*" + ADVICE):
        load_causal_lm(tmp_path, "cpu")


def test_an_expert_missing_from_the_checkpoint(tmp_path):
    from safetensors.torch import load_file, save_file

    build("mixtral").save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in stored.items() if k != "model.layers.1.block_sparse_moe.experts.2.w3.weight"},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"filled in part: '2\.layer\.mlp\.experts\.gate_up_proj' gets 14336 of its "
                                         r"16384 values, from 7 stored tensors \('model\.layers\.1\.block_sparse_moe"):
        load_causal_lm(tmp_path, "cpu")
    save_file({**stored, "model.layers.1.block_sparse_moe.experts.4.w3.weight": torch.zeros(64, 32)},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.block_sparse_moe\.experts\.4\.w3\.weight' in "
                                         r"model\.safetensors has shape \(64, 32\), the model's "
                                         r"'2\.layer\.mlp\.experts\.gate_up_proj' \(its part\) is outside it"):
        load_causal_lm(tmp_path, "cpu")


# -- peak memory --------------------------------------------------------------------------------

MEASURE = textwrap.dedent("""
    import json, sys, threading, time, torch
    from offload.integrations.transformers import load_causal_lm

    def anonymous():
        # Anonymous pages only: what the load allocates. The file-backed pages of torch's and
        # transformers' libraries also count in RSS, and on a machine whose page cache is under
        # pressure (a whole test suite's run) they are read in again during the load.
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anonymous())
            time.sleep(0.001)

    before = anonymous()
    sampler = threading.Thread(target=sample)
    sampler.start()
    model, hf = load_causal_lm(sys.argv[1], "cpu", num_slices=8)
    done.set()
    sampler.join()
    footprint = model.memory_footprint()
    print(json.dumps({"before": before, "peak": max(peak[0], anonymous()), "after": anonymous(),
                      "host_copies": footprint.host_copies + footprint.host_shadows,
                      "largest_slice": max(s.storage.host_nbytes for s in model._engine.slices)}))
""")

def test_peak_memory_is_the_models_host_copies_plus_a_slice_or_two(tmp_path):
    # A 59 M parameter Llama: 236 MB in float32, three shards, written here; measured in a fresh process.
    ROOT = Path(__file__).resolve().parents[1]
    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                                      num_attention_heads=8, num_key_value_heads=8, vocab_size=32000)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path, max_shard_size="100MB")
    # A fixed mmap threshold: freed buffers go back to the system, so the peak is what was live,
    # not what the allocator kept of earlier reads.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"}
    done = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path)], cwd=ROOT, timeout=300,
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.splitlines()[-1])
    growth = measured["peak"] - measured["before"]
    assert measured["host_copies"] > 230e6
    # The host copies and a slice or two more (the device slots, on the CPU here, are allocated but
    # not touched before the first forward): anonymous growth measured 243 MB, the slices being
    # 66 MB. Loading then wrapping needs the model twice (468 MB) at least, a state dict as well
    # three times.
    assert growth < measured["host_copies"] + 2 * measured["largest_slice"], measured


def test_the_loading_benchmark_smoke_test(tmp_path):
    # Writes a small checkpoint, loads it both ways in subprocesses (scripts/load_checkpoint.py).
    ROOT = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_loading.py", "--dir", str(tmp_path / "model"), "--json", str(tmp_path / "r.json"),
         "--layers", "2", "--hidden", "256", "--intermediate", "512", "--vocab", "1000", "--repeats", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["checkpoint"]["parameters"] == sum(run["parameters"] for run in result["runs"]) // 2
    assert {run["method"] for run in result["runs"]} == {"slices", "from_pretrained"}
    assert all(run["seconds"] > 0 and run["peak_rss_growth_bytes"] > 0 for run in result["runs"])
    # Both hold the same host copies afterwards.
    assert len({run["host_copies_bytes"] for run in result["runs"]}) == 1
