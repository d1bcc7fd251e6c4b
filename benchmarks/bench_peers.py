"""One training step of a Llama-shaped model, offloaded by this library and by its peers.

The same Hugging Face ``LlamaForCausalLM`` (random weights, bf16 compute, AdamW) and the same batch
run one way after another, each in this one process, the device memory freed between them:

- ``resident``: the whole model on the device with its parameters in bfloat16, the model's own
  gradient checkpointing and fused AdamW there: the compute time offloading cannot beat.
- ``offload``: ``OffloadModel(causal_lm_sequential(model), compute_dtype=torch.bfloat16)`` stepped
  by ``OffloadOptimizer`` (fused AdamW on the host, overlapped with the next forward).
- ``offload-resident``, ``offload-in-backward-resident``: the same with the first
  ``--resident-slices`` slices kept on the device (``OffloadModel(..., resident_slices=k)``; default
  a quarter of the slices), updated there by ``step()``, the host updating the others; the update
  at the next forward and during backward. Their efficiency's host term is the host update alone
  of the streamed slices' parameters (``host_update_streamed_alone_s``, measured as the whole
  model's); their parameters are not expected to match the other variants' bit for bit (the
  resident slices' AdamW runs on the device, the others' on the host).
- ``fsdp2``: PyTorch's ``fully_shard`` at world size 1 with ``CPUOffloadPolicy`` and bf16
  ``MixedPrecisionPolicy`` (parameters, gradients and the AdamW step on the host).
- ``torchao``: torchao's ``CPUOffloadOptimizer`` (parameters on the device, AdamW state and step on
  the host) under ``torch.autocast(bfloat16)``; only where torchao imports (not a dependency).
- ``fairscale``: fairscale's ``OffloadModel`` on the model as a Sequential of one-tensor stages
  (:func:`tensor_sequential`), bf16 through autocast (it has no compute dtype); only where
  fairscale imports (not a dependency).

Per run: the median step time, its forward and backward, what of the update the step still waited
for (``offload``), peak device memory, tokens/s, host RSS per step. Beside them, measured in the same
process: pinned copy bandwidth each way, and the host update alone (fused AdamW over float32
tensors of the model's sizes, the median of 7), and the host's memory bandwidth (a copy of 2 GiB).
``offload``'s efficiency is ``max(resident step, its link bytes ÷ link bandwidth, host update
alone) / its step``; its ``bound`` (``host_bound.py``) puts the host bytes a step touches, counted
by the library with the copy engine's bytes, over that bandwidth in place of the update alone, with
both efficiencies (``efficiency``, ``old_efficiency``). Its gradients after the first backward are compared
with the resident model's, bit for bit (the resident model's second backward of the same batch
gives the spread its own kernels allow).

``--predict`` sets the planner's prediction for the same machine beside each offloaded run
(``benchmarks/step_prediction.py``). ``--trace DIR`` profiles one more step of the ``--trace-runs``
(default ``resident,offload-in-backward``) into ``DIR/trace-<run>.json.gz`` with each CUDA stream's
busy and idle time over forward and backward (``benchmarks/stream_idle.py``). Every offloaded run
records each slice's parameter digest and where its update ran (``slice_parameters_sha256_16``);
``parameters_per_slice`` says whether the variants that placed every slice's update alike agree.

``--cap-gib N --only offload --disk-tier DIR`` trains the offloaded model with device memory capped
(``torch.cuda.set_per_process_memory_fraction``) and AdamW's state in files.

Usage::

    python benchmarks/bench_peers.py --json peers.json                      # a GPU, the default sizes
    python benchmarks/bench_peers.py --cpu-dry-run --json /tmp/peers.json   # every code path, toy sizes, CPU
    python benchmarks/bench_peers.py --only resident,offload,offload-resident,offload-in-backward-resident --resident-slices 4
    python benchmarks/bench_peers.py --only offload --cap-gib 4 --disk-tier /tmp/tier --json capped.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import hashlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import psutil
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark import device_name, measure_bandwidth, synchronize  # noqa: E402
from host_bound import bound, fused_adamw_alone, host_bandwidth  # noqa: E402

from offload.cli.calibrate import host_norm_rate  # noqa: E402
from offload.clipping import clip_grad_norm_, total_grad_norm  # noqa: E402
from offload.kernels import host_kernel  # noqa: E402
from offload.planning.host_bytes import host_bytes_per_step  # noqa: E402

from offload import DiskTier, OffloadModel, OffloadOptimizer  # noqa: E402
from offload.model import engine_of  # noqa: E402
from json_output import check_json_path  # benchmarks/json_output.py, next to this file

PEERS = ("resident", "offload", "fsdp2", "torchao", "fairscale")
#: Ways of running OffloadModel that take a step apart (``--only offload,offload-sync,...``):
#: ``sync`` waits for the update after each step (nothing overlaps it), ``threads8`` gives the
#: update 8 threads, ``no-step`` runs forward and backward alone, ``profile`` prints torch.profiler's
#: table of the host's operations over the timed steps, ``cprofile`` the Python calls of the training
#: thread (where it waits), written beside ``--json`` as ``<name>.prof`` too; ``in-backward`` starts
#: each slice's update in backward (``OffloadOptimizer(..., update_in_backward=True)``), ``-cut`` only
#: while the update worker keeps up (``max_backlog = 1``), the rest at step(), in slice order;
#: ``-resident`` keeps the first ``--resident-slices`` slices on the device (Note: [Resident slices]).
#: ``clip`` clips the gradients' total norm to 1 with ``offload.clip_grad_norm_`` before ``step()`` (the update behind the next forward, as
#: Hugging Face's Trainer runs it), the host gradients' norms computed in backward (``norms_in_backward``) and
#: their scaling run in each slice's update (``scale_in_update``). A ``-resident`` name may end in a count: ``offload-in-backward-resident6``
#: keeps 6 slices resident whatever ``--resident-slices`` says (:func:`split_variant`).
OFFLOAD_VARIANTS = ("offload-in-backward", "offload-in-backward-cut", "offload-sync", "offload-threads8", "offload-no-step", "offload-profile",
                    "offload-cprofile", "offload-resident", "offload-in-backward-resident", "offload-clip",
                    "offload-clip-resident")
GPU_SIZES = {"hidden": 2048, "layers": 16, "intermediate": 5632, "heads": 16, "kv_heads": 8, "vocab": 32000,
             "seq": 1024, "batch": 8}
DRY_SIZES = {"hidden": 64, "layers": 2, "intermediate": 128, "heads": 4, "kv_heads": 2, "vocab": 256,
             "seq": 16, "batch": 2}


def split_variant(name: str) -> tuple[str, int | None]:
    """``offload-in-backward-resident6`` -> ``("offload-in-backward-resident", 6)``; other names -> ``(name, None)``."""
    match = re.fullmatch(r"(offload.*-resident)(\d+)", name)
    return (match[1], int(match[2])) if match else (name, None)


def build_llama(sizes: dict[str, int], seed: int = 0) -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=sizes["vocab"], hidden_size=sizes["hidden"], intermediate_size=sizes["intermediate"],
        num_hidden_layers=sizes["layers"], num_attention_heads=sizes["heads"],
        num_key_value_heads=sizes["kv_heads"], max_position_embeddings=sizes["seq"], use_cache=False,
        tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).train()


def enable_checkpointing(model: nn.Module) -> None:
    # transformers 5.24 renamed the method and warns on the old name, which older releases alone know.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def rss() -> int:
    return psutil.Process().memory_info().rss


class Run:
    """One way of training: ``step()`` runs forward, backward and the optimizer, and returns the
    seconds of its forward and backward alone (what it waited for the optimizer left out)."""

    def __init__(self, step: Callable[[], float], free: Callable[[], None] = lambda: None) -> None:
        self.step, self.free = step, free
        self.times: list[float] = []
        self.model_times: list[float] = []
        self.exposed: list[float] = []
        self.rss: list[int] = []
        self.parts: dict[str, list[float]] = {}  # named parts of the steps, seconds each

    def timed(self, device: torch.device) -> None:
        synchronize(device)
        start = time.perf_counter()
        self.model_times.append(self.step())
        synchronize(device)
        self.times.append(time.perf_counter() - start)
        self.rss.append(rss())
        print(f"  step {len(self.times)}: {self.times[-1] * 1e3:.1f} ms", flush=True)


def timed_forward_backward(device: torch.device, forward_backward: Callable[[], None]) -> float:
    start = time.perf_counter()
    # The range a trace's per-stream table reads (benchmarks/stream_idle.py); nothing while no profiler records.
    with torch.profiler.record_function("forward+backward"):
        forward_backward()
        synchronize(device)
    return time.perf_counter() - start


def resident_run(base: nn.Module, batch: torch.Tensor, device: torch.device, grads: dict) -> Run:
    # Parameters in bfloat16 as compute_dtype makes them; buffers (the rotary inverse frequencies)
    # stay float32, as they do in OffloadModel.
    model = copy.deepcopy(base).to(device)
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    enable_checkpointing(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")

    def forward_backward() -> None:
        loss_of(model(batch).logits, batch).backward()

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        seconds = timed_forward_backward(device, forward_backward)
        if "resident" not in grads:
            grads["resident"] = {n: p.grad.float().cpu() for n, p in model.named_parameters()}
            optimizer.zero_grad(set_to_none=True)
            forward_backward()  # the same batch again: the spread of the device's own kernels
            grads["resident_again"] = {n: p.grad.float().cpu() for n, p in model.named_parameters()}
        optimizer.step()
        return seconds

    return Run(step)


def offload_run(base: nn.Module, batch: torch.Tensor, device: torch.device, grads: dict, args,
                variant: str = "offload") -> Run:
    from offload.integrations.transformers import causal_lm_sequential

    hf = copy.deepcopy(base)
    tier = DiskTier(args.disk_tier) if args.disk_tier else None
    kind, count = split_variant(variant)
    resident = (args.resident_slices if count is None else count) if kind.endswith("-resident") else 0
    model = OffloadModel(causal_lm_sequential(hf), device=device, num_slices=args.num_slices,
                         compute_dtype=torch.bfloat16, masters=tier if args.masters_on_disk else None,
                         resident_slices=resident)
    threads = 8 if kind == "offload-threads8" else args.update_threads
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-5, fused=True, disk_tier=tier, num_threads=threads,
                                 update_in_backward=kind.startswith("offload-in-backward"),
                                 norms_in_backward=kind.startswith("offload-clip"),
                                 scale_in_update=kind.startswith("offload-clip"))
    if kind == "offload-in-backward-cut":
        optimizer._in_backward.max_backlog = 1
    updates = engine_of(model).updates
    wait, blocked = updates.wait, [0.0]

    def timed_wait(index: int) -> None:
        start = time.perf_counter()
        wait(index)
        blocked[0] += time.perf_counter() - start

    updates.wait = timed_wait  # type: ignore[method-assign]
    run: Run

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        seconds = timed_forward_backward(device, lambda: loss_of(model(batch), batch).backward()) - blocked[0]
        if "offload" not in grads or (args.deterministic and variant not in grads.get("variants", {})):
            # On the host, as the resident model's: a resident slice's gradients are on the device.
            # Every variant's under --deterministic (small models): each is compared with the resident's.
            first = {n: p.grad.to("cpu", copy=True) for n, p in hf.named_parameters()}
            grads.setdefault("offload", first)
            if args.deterministic:
                grads.setdefault("variants", {})[variant] = first
        if kind.startswith("offload-clip"):
            # offload.clip_grad_norm_ as a training loop calls it: the norm takes the host gradients'
            # norms backward computed (norms_in_backward; the first call computes them all again, on
            # several threads, to compare), and the streamed slices' scaling is handed to the update
            # worker (scale_in_update): what the next forward waits for of it is in the exposed update.
            grads_now = [p.grad for p in hf.parameters() if p.grad is not None]
            if "clip_norm_torch_s" not in run.parts:
                # Once, in the first warm-up step: PyTorch's own norm (one thread a tensor), its
                # time and whether offload's is the same bits.
                start = time.perf_counter()
                theirs = torch.nn.utils.get_total_norm(grads_now, 2.0)
                run.parts["clip_norm_torch_s"] = [time.perf_counter() - start]
                run.parts["clip_norm_equal"] = [bool(torch.equal(theirs, total_grad_norm(grads_now, 2.0)))]
            start = time.perf_counter()
            clip_grad_norm_(list(hf.parameters()), 1.0)
            run.parts.setdefault("clip_s", []).append(time.perf_counter() - start)
            run.parts["clip_threads"] = [torch.get_num_threads()]
        # What this step's forward waited for the last update; synchronize() below waits through the
        # same function, which must not count twice.
        forward_blocked = blocked[0]
        start = time.perf_counter()
        if kind != "offload-no-step":
            optimizer.step()
        if kind == "offload-sync":
            # The update alone, apart from the step() call that submits it.
            submitted = time.perf_counter()
            optimizer.synchronize()
            run.parts.setdefault("step_call_s", []).append(submitted - start)
            run.parts.setdefault("synchronize_s", []).append(time.perf_counter() - submitted)
        run.exposed.append(forward_blocked + time.perf_counter() - start)
        blocked[0] = 0.0
        return seconds

    def free() -> None:
        optimizer.close()

    def fingerprint() -> str:
        """A digest of every parameter's bits after the run: the offloaded variants train the same
        model on the same batch for the same steps, so their digests agree where the update is exact
        and the device's kernels repeat themselves."""
        optimizer.synchronize()
        digest = hashlib.sha256()
        for _, p in sorted(hf.named_parameters()):
            digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()[:16]

    def slice_digests() -> list[list[str]]:
        """Per slice, where its update ran (``device``: a resident slice's; ``host``) and the digest
        of its parameters' bits: slices updated on the same side must agree across variants."""
        optimizer.synchronize()
        out = []
        for s in engine_of(model).slices:
            digest = hashlib.sha256()
            for e in s.storage.held:
                if e.is_parameter:
                    digest.update(e.tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            out.append(["device" if s.storage.resident else "host", digest.hexdigest()[:16]])
        return out

    run = Run(step, free)
    # The host's bytes a step: the streamed slices' parameters, as the host update steps them.
    streamed_counts: dict[str, int] = {}
    for s in engine_of(model).slices:
        for e in s.storage.held:
            if e.is_parameter and e.tensor.requires_grad and not s.storage.resident:
                key = str(e.tensor.dtype).removeprefix("torch.")
                streamed_counts[key] = streamed_counts.get(key, 0) + e.tensor.numel()
    run.streamed_parameters = streamed_counts  # type: ignore[attr-defined]
    if resident and not args.disk_tier:
        # The host's share of the update: the slices that stream (float32 host copies, as the
        # whole model's host_update_alone_s), timed before the steps.
        streamed = [e.tensor.shape for s in engine_of(model).slices if not s.storage.resident
                    for e in s.storage.held if e.is_parameter]
        run.host_update_streamed_alone_s = host_update_alone(streamed)  # type: ignore[attr-defined]
    run.fingerprint = fingerprint  # type: ignore[attr-defined]
    run.slice_digests = slice_digests  # type: ignore[attr-defined]
    run.traffic = engine_of(model).traffic  # type: ignore[attr-defined]
    run.copies = engine_of(model).copies  # type: ignore[attr-defined]
    return run


def fsdp2_run(base: nn.Module, batch: torch.Tensor, device: torch.device) -> Run:
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        store = tempfile.mktemp(prefix="offload-bench-peers-")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}",
                                rank=0, world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = copy.deepcopy(base)
    enable_checkpointing(model)
    mesh = dist.device_mesh.init_device_mesh(device.type, (1,))
    policy = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    if device.type == "cuda":
        policy["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    for layer in model.model.layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    # Fused: PyTorch's fastest AdamW for the host's DTensors (its default for CPU tensors is the
    # per-tensor loop).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        seconds = timed_forward_backward(device, lambda: loss_of(model(batch).logits, batch).backward())
        optimizer.step()
        return seconds

    return Run(step, lambda: dist.destroy_process_group())


def torchao_run(base: nn.Module, batch: torch.Tensor, device: torch.device) -> Run:
    from torchao.optim import CPUOffloadOptimizer

    model = copy.deepcopy(base).to(device)
    enable_checkpointing(model)
    optimizer = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-5, fused=True)

    def forward_backward() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(batch).logits
        loss_of(logits, batch).backward()

    def step() -> float:
        optimizer.zero_grad()
        seconds = timed_forward_backward(device, forward_backward)
        optimizer.step()
        return seconds

    return Run(step)


class _TensorStage(nn.Module):
    """A stage of :func:`tensor_sequential`: one tensor in, one out."""

    def __init__(self, kind: str, module: nn.Module, rotary: nn.Module | None = None) -> None:
        super().__init__()
        self.kind, self.module = kind, module
        # Not a submodule: fairscale moves each slice's modules, and every layer shares the table.
        self.__dict__["rotary"] = rotary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind != "layer":
            return self.module(x)
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        self.rotary.to(x.device)
        # No mask: the attention is causal by itself (sdpa's is_causal), as in the model without padding.
        out = self.module(x, attention_mask=None, position_ids=positions,
                          position_embeddings=self.rotary(x, position_ids=positions))
        return out[0] if isinstance(out, tuple) else out


def tensor_sequential(hf: nn.Module) -> nn.Sequential:
    """The Llama model as an ``nn.Sequential`` passing one tensor between stages, for fairscale,
    whose ``OffloadModel`` passes nothing else: embedding, each decoder layer with the rotary
    tables computed in it, final norm and head. Same parameters and logits as the model without
    padding."""
    body = hf.model
    stages = [_TensorStage("embed", body.embed_tokens)]
    stages += [_TensorStage("layer", layer, body.rotary_emb) for layer in body.layers]
    stages += [_TensorStage("norm", body.norm), _TensorStage("head", hf.lm_head)]
    return nn.Sequential(*stages)


def fairscale_run(base: nn.Module, batch: torch.Tensor, device: torch.device, args) -> Run:
    from fairscale.experimental.nn.offload import OffloadModel as FairscaleOffloadModel

    model = FairscaleOffloadModel(model=tensor_sequential(copy.deepcopy(base)), device=device,
                                  offload_device=torch.device("cpu"), num_slices=args.num_slices,
                                  checkpoint_activation=True, num_microbatches=1)
    # Its parameters stay float32 on the host; bf16 compute through autocast, as torchao's run.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def forward_backward() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(batch)
        loss_of(logits, batch).backward()

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        seconds = timed_forward_backward(device, forward_backward)
        optimizer.step()
        return seconds

    return Run(step)


def host_update_alone(shapes: list[torch.Size]) -> float:
    """Seconds of one fused AdamW step over float32 host tensors of the sizes ``shapes``: the
    median of 7 (``host_bound.fused_adamw_alone``)."""
    return fused_adamw_alone(shapes)["median_s"]


def traced_step(run: Run, name: str, device: torch.device, directory: str) -> dict:
    """One more step under ``torch.profiler``, its Chrome trace written gzipped to
    ``directory/trace-<name>.json.gz``; returns the per-stream table of its forward and backward
    (:func:`stream_idle.lanes`)."""
    import gzip
    import shutil

    from stream_idle import lanes, load
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run.timed(device)
    raw = os.path.join(directory, f".trace-{name}.json")
    prof.export_chrome_trace(raw)
    path = os.path.join(directory, f"trace-{name}.json.gz")
    with open(raw, "rb") as src, gzip.open(path, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)
    return {"trace": os.path.basename(path)} | lanes(load(path))


def exactness(report: dict) -> dict:
    """Per slice, the digests of the variants that placed every slice's update alike (the host's
    AdamW, or the device's for a resident slice): under deterministic kernels they must all be
    equal. Variants that place them differently are not compared: the device's AdamW and the
    host's round differently, so from the second step on every slice sees other inputs (the first
    backward's gradients are compared across all variants, ``compare_gradients``). A clipped run
    trains differently, and a traced run one step longer: both are left out."""
    groups: dict[str, dict[str, str]] = {}
    for name, run in report["runs"].items():
        if "streams" in run or split_variant(name)[0].startswith("offload-clip"):
            continue
        digests = run.get("slice_parameters_sha256_16", [])
        on_device = [index for index, (where, _) in enumerate(digests) if where == "device"]
        placement = f"slices {on_device} updated on the device" if on_device else "every update on the host"
        for index, (where, digest) in enumerate(digests):
            groups.setdefault(f"slice {index} on the {where} ({placement})", {})[name] = digest
    compared = {key: runs for key, runs in groups.items() if len(runs) > 1}
    differing = {key: runs for key, runs in compared.items() if len(set(runs.values())) > 1}
    return {"groups_compared": len(compared), "groups_differing": len(differing), "all_equal": not differing,
            "differing": differing}


def compare_gradients(grads: dict) -> dict:
    def worst(a: dict, b: dict) -> tuple[float, int]:
        diff, differing = 0.0, 0
        for name, ref in a.items():
            delta = (b[name].float() - ref).abs().max().item()
            scale = ref.abs().max().item() or 1.0
            diff = max(diff, delta / scale)
            differing += int(not torch.equal(b[name].float(), ref))
        return diff, differing

    out: dict[str, Any] = {"tensors": len(grads.get("resident", {}))}
    if "resident" in grads and "offload" in grads:
        out["offload_vs_resident_max_relative"], out["offload_vs_resident_tensors_differing"] = worst(
            grads["resident"], grads["offload"])
        out["bit_identical"] = out["offload_vs_resident_tensors_differing"] == 0
    if "resident_again" in grads:
        out["resident_vs_itself_max_relative"], out["resident_vs_itself_tensors_differing"] = worst(
            grads["resident"], grads["resident_again"])
    if "resident" in grads and grads.get("variants"):
        out["per_variant"] = {}
        for name, ours in grads["variants"].items():
            relative, differing = worst(grads["resident"], ours)
            out["per_variant"][name] = {"max_relative": relative, "tensors_differing": differing,
                                        "bit_identical": differing == 0}
    return out


def summarise(run: Run, tokens: int, device: torch.device, steps: int) -> dict:
    median = statistics.median(run.times[-steps:])
    out = {"median_step_s": median, "median_forward_backward_s": statistics.median(run.model_times[-steps:]),
           "tokens_per_s": tokens / median, "step_s": run.times, "host_rss_bytes_per_step": run.rss,
           "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    if run.exposed:
        out["median_exposed_update_s"] = statistics.median(run.exposed[-steps:])
    for name, values in run.parts.items():
        out[f"median_{name}"] = statistics.median(values[-steps:])
    return out


def measure(name: str, make: Callable[[], Run], args, device: torch.device, tokens: int, report: dict) -> None:
    print(f"[{name}] ...", flush=True)
    run = None
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        run = make()
        for _ in range(args.warmup):
            run.timed(device)
        traffic_before = run.traffic() if hasattr(run, "traffic") else None
        offload_copies_before = run.copies.offload_copies if hasattr(run, "copies") else 0
        with profiled(name, device, args.json):
            for _ in range(args.steps):
                run.timed(device)
        result = summarise(run, tokens, device, args.steps)
        if traffic_before is not None:
            after = run.traffic()
            result["loaded_bytes_per_step"] = (after[0] - traffic_before[0]) / args.steps
            result["offloaded_bytes_per_step"] = (after[1] - traffic_before[1]) / args.steps
            # Gradients and boundary activations: one copy per slice's gradients where they are gathered.
            result["offload_copies_per_step"] = (run.copies.offload_copies - offload_copies_before) / args.steps
        if hasattr(run, "streamed_parameters"):
            result["streamed_parameters"] = run.streamed_parameters
        if hasattr(run, "host_update_streamed_alone_s"):
            result["host_update_streamed_alone_s"] = run.host_update_streamed_alone_s
            result["resident_slices"] = split_variant(name)[1] or args.resident_slices
        if name in args.trace_runs:
            result["streams"] = traced_step(run, name, device, args.trace)
        if hasattr(run, "fingerprint") and name != "offload-no-step":
            result["parameters_sha256_16"] = run.fingerprint()
            result["slice_parameters_sha256_16"] = run.slice_digests()
        report["runs"][name] = result
        print(f"[{name}] step {result['median_step_s'] * 1e3:.1f} ms, fwd+bwd "
              f"{result['median_forward_backward_s'] * 1e3:.1f} ms", flush=True)
    except Exception as error:  # noqa: BLE001 - a failing peer must not hide the others
        report["failed"][name] = f"{type(error).__name__}: {error}"[:2000]
        print(f"[{name}] failed: {report['failed'][name][:300]}", flush=True)
        traceback.print_exc()
    finally:
        if run is not None:
            with contextlib.suppress(Exception):
                run.free()
        del run
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        write(report, args.json)


@contextlib.contextmanager
def profiled(name: str, device: torch.device, json_path: str | None):
    if name == "offload-cprofile":
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        try:
            yield
        finally:
            profiler.disable()
        if json_path:
            profiler.dump_stats(os.path.join(os.path.dirname(os.path.abspath(json_path)), f"{name}.prof"))
        stats = pstats.Stats(profiler).sort_stats("tottime")
        stats.print_stats(30)
        stats.sort_stats("cumulative").print_stats(40)
        return
    if name != "offload-profile":
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        yield
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50))
    if device.type == "cuda":
        print(table.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=50))


def efficiency(report: dict) -> None:
    for name in list(report["runs"]):
        if split_variant(name)[0] in ("offload", "offload-in-backward", "offload-in-backward-cut", "offload-resident",
                                      "offload-in-backward-resident", "offload-clip", "offload-clip-resident"):
            efficiency_of(report, name)


def efficiency_of(report: dict, name: str) -> None:
    runs, ours = report["runs"], report["runs"][name]
    if "resident" not in runs:
        return
    bandwidth = report["bandwidth_bytes_per_s"]
    link = max(ours.get("loaded_bytes_per_step", 0) / bandwidth["host_to_device"],
               ours.get("offloaded_bytes_per_step", 0) / bandwidth["device_to_host"])
    terms = {"link_s": link}
    if "host_update_streamed_alone_s" in ours:  # with resident slices the host updates the others only
        terms["host_update_streamed_alone_s"] = ours["host_update_streamed_alone_s"]
    else:
        terms["host_update_alone_s"] = report.get("host_update_alone_s")
    if "resident" in runs:
        terms["resident_step_s"] = runs["resident"]["median_step_s"]
    known = [v for v in terms.values() if v is not None]
    ours["ideal_terms"] = terms
    ours["ideal_s"] = max(known)
    ours["efficiency"] = ours["ideal_s"] / ours["median_step_s"]
    if "streamed_parameters" in ours and "host_bandwidth" in report:
        # The bound with the host's bytes counted (host_bound.py); ``efficiency`` above is the old one.
        counts = {getattr(torch, dtype): n for dtype, n in ours["streamed_parameters"].items()}
        # The shadow in the update's pass where the one-pass kernel ran (Note: [One-pass update]).
        host = host_bytes_per_step(counts, compute_dtype=torch.bfloat16, optimizer="adamw",
                                   shadow_in_update=report["one_pass"]).with_copies(
            ours.get("loaded_bytes_per_step", 0), ours.get("offloaded_bytes_per_step", 0))
        alone = terms.get("host_update_streamed_alone_s", terms.get("host_update_alone_s"))
        ours["bound"] = bound(ours["median_step_s"], terms["resident_step_s"], link, host,
                              report["host_bandwidth"]["bytes_per_s"], alone, sum(counts.values()))
    for other, run in runs.items():
        if other not in (name, "resident"):
            ours[f"speedup_vs_{other}"] = run["median_step_s"] / ours["median_step_s"]


def write(report: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


def table(report: dict) -> str:
    lines = ["| run | step ms | fwd+bwd ms | exposed update ms | tokens/s | peak device MiB | RSS growth over timed steps MiB "
             "| planner step ms, from resident / from ops (exposed) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, run in report["runs"].items():
        peak = run.get("peak_device_bytes")
        exposed = run.get("median_exposed_update_s")
        timed = run["host_rss_bytes_per_step"][-len(run["step_s"]) + report["warmup"]:] or run["host_rss_bytes_per_step"]
        growth = (timed[-1] - timed[0]) / 2**20
        planner = run.get("planner", {})
        predicted = " / ".join(f"{planner[w]['step'] * 1e3:.1f} ({planner[w]['exposed'] * 1e3:.1f})"
                               for w in ("from_resident", "from_ops") if w in planner)
        lines.append(f"| {name} | {run['median_step_s'] * 1e3:.1f} | {run['median_forward_backward_s'] * 1e3:.1f} "
                     f"| {'' if exposed is None else f'{exposed * 1e3:.1f}'} | {run['tokens_per_s']:.0f} "
                     f"| {'' if peak is None else f'{peak / 2**20:.0f}'} | {growth:.0f} | {predicted} |")
    for name, why in report["failed"].items():
        lines.append(f"| {name} | failed: {why[:120]} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-dry-run", action="store_true", help="toy sizes on the CPU: every code path, no timing")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    for key, value in GPU_SIZES.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=f"GPU default {value}")
    parser.add_argument("--num-slices", type=int, default=None, help="default: one per decoder layer plus two")
    parser.add_argument("--resident-slices", type=int, default=None,
                        help="the -resident variants' resident slices (default: a quarter of the slices, at least 1)")
    parser.add_argument("--update-threads", type=int, default=None,
                        help="OffloadOptimizer(num_threads=...) of every offloaded run (default: PyTorch's)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--only", default=",".join(PEERS), help=f"comma-separated subset of {','.join(PEERS)}")
    parser.add_argument("--cap-gib", type=float, default=None, help="cap device memory (CUDA) for the runs")
    parser.add_argument("--disk-tier", default=None, help="offload: AdamW's state in files in this directory")
    parser.add_argument("--masters-on-disk", action="store_true", help="offload: float32 masters in the disk tier too")
    parser.add_argument("--json", default=None, help="write the report here (after every run)")
    parser.add_argument("--predict", action="store_true",
                        help="the planner's prediction beside each offloaded run (benchmarks/step_prediction.py)")
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help="one more step of each --trace-runs run under torch.profiler: DIR/trace-<run>.json.gz "
                             "and a per-stream table (benchmarks/stream_idle.py)")
    parser.add_argument("--trace-runs", default="resident,offload-in-backward", help="the runs --trace profiles")
    parser.add_argument("--deterministic", action="store_true",
                        help="deterministic kernels only (math attention, torch.use_deterministic_algorithms): the "
                             "offloaded variants' parameters must then agree bit for bit (parameters_sha256_16)")
    args = parser.parse_args(argv)
    check_json_path(parser, args.json)
    if args.deterministic:
        # Before the first cuBLAS call; attention's fused backward kernels add in no fixed order.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        for backend in ("flash", "mem_efficient", "cudnn"):
            getattr(torch.backends.cuda, f"enable_{backend}_sdp", lambda _: None)(False)
    defaults = DRY_SIZES if args.cpu_dry_run else GPU_SIZES
    args.sizes = {key: getattr(args, key) or value for key, value in defaults.items()}
    args.num_slices = args.num_slices or args.sizes["layers"] + 2
    if args.resident_slices is None:
        args.resident_slices = max(1, args.num_slices // 4)
    if not 0 <= args.resident_slices <= args.num_slices:
        parser.error(f"--resident-slices must be between 0 and the number of slices ({args.num_slices}), "
                     f"got {args.resident_slices}")
    args.peers = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = {split_variant(p)[0] for p in args.peers} - set(PEERS) - set(OFFLOAD_VARIANTS)
    if unknown:
        parser.error(f"--only: unknown {', '.join(sorted(unknown - set(OFFLOAD_VARIANTS)))}; choose from "
                     f"{', '.join(PEERS + OFFLOAD_VARIANTS)}")
    if args.cpu_dry_run:
        args.device, args.steps, args.warmup = "cpu", 1, 1
        # Toy sizes: each run's gc.collect() would spend most of its time walking the objects the
        # imports made (torch's), which it never frees; set aside, it walks the runs' own.
        gc.freeze()
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.device.type == "cuda" and args.device.index is None:
        args.device = torch.device("cuda", torch.cuda.current_device())
    if args.masters_on_disk and not args.disk_tier:
        parser.error("--masters-on-disk needs --disk-tier DIR")
    args.trace_runs = [r.strip() for r in args.trace_runs.split(",")] if args.trace else []
    for name in args.peers:
        count = split_variant(name)[1]
        if count is not None and count > args.num_slices:
            parser.error(f"--only {name}: {count} resident slices of {args.num_slices}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device, sizes = args.device, args.sizes
    base = build_llama(sizes)
    tokens = sizes["batch"] * sizes["seq"]
    torch.manual_seed(1)
    batch = torch.randint(0, sizes["vocab"], (sizes["batch"], sizes["seq"]), device=device)
    report: dict[str, Any] = {
        "command": "python " + " ".join(sys.argv), "device_name": device_name(device), "torch": torch.__version__,
        "sizes": sizes, "num_slices": args.num_slices, "parameters": sum(p.numel() for p in base.parameters()),
        "tokens_per_step": tokens, "steps": args.steps, "warmup": args.warmup,
        "bandwidth_bytes_per_s": measure_bandwidth(device), "runs": {}, "failed": {},
        "cap_gib": args.cap_gib, "disk_tier": bool(args.disk_tier), "masters_on_disk": args.masters_on_disk,
        "resident_slices": args.resident_slices,
        "deterministic": args.deterministic}
    print(f"{device_name(device)}; Llama-shaped, {report['parameters'] / 1e9:.3f} B parameters, "
          f"{tokens} tokens/step, {args.num_slices} slices", flush=True)
    # Every offloaded run with the one-pass update, or none: the kernel builds (or loads) first.
    report["one_pass"] = host_kernel(wait=True) is not None
    # The host's memory bandwidth, with the update worker's threads (PyTorch's setting).
    report["host_bandwidth"] = host_bandwidth(64 << 20 if args.cpu_dry_run else 2 << 30)
    report["host_norm_bytes_per_s"] = host_norm_rate(16 << 20 if args.cpu_dry_run else 256 << 20)
    if "resident" in args.peers and not args.disk_tier:
        report["host_update_alone_s"] = host_update_alone([p.shape for p in base.parameters()])
    if args.cap_gib and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total), device)
    grads: dict[str, dict] = {}
    makers = {
        "resident": lambda: resident_run(base, batch, device, grads),
        "offload": lambda: offload_run(base, batch, device, grads, args),
        "fsdp2": lambda: fsdp2_run(base, batch, device),
        "torchao": lambda: torchao_run(base, batch, device),
        "fairscale": lambda: fairscale_run(base, batch, device, args),
    }
    for variant in OFFLOAD_VARIANTS:
        makers[variant] = lambda variant=variant: offload_run(base, batch, device, grads, args, variant)
    for name in args.peers:
        make = makers.get(name) or (lambda name=name: offload_run(base, batch, device, grads, args, name))
        measure(name, make, args, device, tokens, report)
    report["gradients_after_first_backward"] = compare_gradients(grads)
    report["parameters_per_slice"] = exactness(report)
    efficiency(report)
    if args.predict:
        from step_prediction import predict

        predict(report)
    write(report, args.json)
    print(table(report))
    print(json.dumps({k: report["runs"].get("offload", {}).get(k) for k in ("efficiency", "ideal_terms")}
                     | {"gradients": report["gradients_after_first_backward"]}, default=str))
    return report


if __name__ == "__main__":
    # torchao and fairscale are optional and CUDA-only; the others must run wherever this does.
    sys.exit(1 if {"resident", "offload", "fsdp2"} & set(main()["failed"]) else 0)
