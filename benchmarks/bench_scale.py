"""Train a model whose float32 AdamW state does not fit in this machine's RAM: the reach of the disk
tier and of loading slice by slice.

Writes a safetensors checkpoint of an ``nn.Sequential`` of Linear+GELU blocks one shard at a time
(never the whole model in memory), loads it slice by slice with :func:`offload.load_sequential`,
and trains a few steps with ``OffloadOptimizer(torch.optim.AdamW, fused=True, disk_tier=...)``:
masters and gradients in RAM, AdamW's moments on disk; with ``--compute-dtype bfloat16
--masters-on-disk``, the float32 masters and the gradients on disk too (``OffloadModel(...,
masters=DiskTier(...))``), the bfloat16 shadow in RAM. Records the parameters, the bytes the
float32 AdamW state would take in RAM, peak RSS (sampled, by phase, with its anonymous, file and
shared parts at the peak; and the kernel's high-water mark), bytes
on disk, seconds per step and where they go (forward and backward; the update's wait), and the
disk traffic per step against the raw bandwidth measured by ``benchmarks/bench_storage.py``.

Exactness at this size has no reference to compare with (the plain model does not fit: that is the
point); the disk tier and the loader are bit-identical to the RAM-resident run and to
``from_pretrained`` in the tests (``tests/test_disk_tier.py``, ``tests/test_loading.py``), and
``benchmarks/bench_storage.py`` checks a few steps bit for bit.

Usage::

    python benchmarks/bench_scale.py --dir /nvme/scratch --json benchmarks/results/scale_cpu_DATE.json
        [--width 8192] [--layers 30] [--slices 15] [--steps 3] [--batch 8]
        [--compute-dtype bfloat16 --masters-on-disk] [--resume-check | --drop-checkpoint]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import resource
import shutil
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch
from torch import nn

import offload
from offload import DiskTier, OffloadOptimizer
from offload.model import engine_of
from json_output import check_dir, check_json_path  # benchmarks/json_output.py, next to this file

GIB = 2**30


def build(width: int, layers: int) -> nn.Sequential:
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*blocks)


def build_meta(width: int, layers: int) -> nn.Sequential:
    """The model's layers on the meta device: what ``estimate_memory`` counts, allocating nothing."""
    with torch.device("meta"):
        return build(width, layers)


def write_checkpoint(path: Path, width: int, layers: int, blocks_per_shard: int) -> dict:
    """A sharded safetensors checkpoint (``model.safetensors.index.json`` and shards), one shard in
    memory at a time."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    shards = [range(start, min(start + blocks_per_shard, layers)) for start in range(0, layers, blocks_per_shard)]
    total = 0
    for number, blocks in enumerate(shards):
        file = f"model-{number + 1:05d}-of-{len(shards):05d}.safetensors"
        shard = {}
        for block in blocks:
            # The layers' index in the Sequential: Linear at even positions, GELU between.
            name = str(2 * block)
            shard[f"{name}.weight"] = torch.randn(width, width, generator=generator) * width**-0.5
            shard[f"{name}.bias"] = torch.zeros(width)
            weight_map.update({f"{name}.weight": file, f"{name}.bias": file})
        total += sum(t.numel() * 4 for t in shard.values())
        save_file(shard, str(path / file), metadata={"format": "pt"})
        del shard
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return {"bytes": total, "shards": len(shards)}


def resident_parts() -> dict[str, int]:
    """This process's resident set by kind (Linux): anonymous memory (heaps, tensors), pages of
    mapped files (libraries, the masters' and gradients' mappings) and shared memory (the disk
    tier's window); empty elsewhere."""
    try:
        with open("/proc/self/status") as status:
            lines = [line.split() for line in status if line.startswith(("RssAnon", "RssFile", "RssShmem"))]
    except OSError:
        return {}
    return {fields[0].rstrip(":"): int(fields[1]) * 1024 for fields in lines}


class PeakRSS:
    """Samples this process's resident set size on a thread; with ``phase`` set by the caller, the
    peak in each phase and the resident set's parts at the peak."""

    def __init__(self, interval: float = 0.05) -> None:
        self.peak = 0
        self.phase = ""
        self.phases: dict[str, int] = {}
        self.parts_at_peak: dict[str, int] = {}
        self.phase_at_peak = ""
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, phase = self._process.memory_info().rss, self.phase
            if rss > self.peak:
                self.peak, self.phase_at_peak, self.parts_at_peak = rss, phase, resident_parts()
            if phase:
                self.phases[phase] = max(self.phases.get(phase, 0), rss)
            time.sleep(0.05)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def io_counts(counters) -> tuple[int, float, int, float]:  # type: ignore[no-untyped-def]
    """Bytes and seconds read and written so far (zeros without counters)."""
    if not counters:
        return (0, 0.0, 0, 0.0)
    return (counters.read_bytes, counters.read_seconds, counters.write_bytes, counters.write_seconds)


def checksum(model: offload.OffloadModel) -> list[int]:
    """Each parameter's bits summed as integers: equal lists mean equal parameters, bit for bit
    (up to collisions no training run produces). A slice at a time: masters on disk are read in
    for it and dropped again, as an update would, instead of all staying in RAM."""
    sums = []
    with torch.no_grad():
        for piece in engine_of(model).slices:
            sums += [int(e.tensor.detach().view(torch.int32).sum(dtype=torch.int64)) for e in piece.storage.params]
            piece.storage.release_masters()
    return sums


def save_for_resume(path: Path, model: nn.Module, optimizer: OffloadOptimizer) -> dict:
    """``save_checkpoint`` between two steps, timed, with the peak RSS while it runs."""
    with PeakRSS() as saving:
        started = time.perf_counter()
        offload.save_checkpoint(path, model, optimizer)
        save_s = time.perf_counter() - started
    return {"save_s": save_s, "save_peak_rss_bytes": saving.peak, "checkpoint_bytes": disk_bytes(path)}


def check_resume(path: Path, load, x: torch.Tensor, target: torch.Tensor) -> dict:  # type: ignore[no-untyped-def]
    """Build the model again, ``load_checkpoint`` the saved step, and run the last step again."""
    model, optimizer = load()
    with PeakRSS() as loading:
        started = time.perf_counter()
        offload.load_checkpoint(path, model, optimizer)
        load_s = time.perf_counter() - started
    loss = nn.functional.mse_loss(model(x).float(), target)
    loss.backward()
    optimizer.step()
    optimizer.synchronize()
    result = {"load_s": load_s, "load_peak_rss_bytes": loading.peak, "resumed_loss": repr(loss.item()),
              "resumed_checksum": checksum(model)}
    optimizer.close()
    return result


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="a directory on the disk to use (checkpoint and optimizer state)")
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=30, help="Linear+GELU blocks")
    parser.add_argument("--slices", type=int, default=15)
    parser.add_argument("--blocks-per-shard", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="rows per step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="dtype of the device copies (bfloat16: a shadow in RAM that loads read)")
    parser.add_argument("--masters-on-disk", action="store_true",
                        help="keep the float32 masters in files too (needs --compute-dtype bfloat16)")
    parser.add_argument("--shadows-on-disk", action="store_true",
                        help="keep no bfloat16 shadow in RAM: each load casts the masters on disk into a staging "
                             "buffer (needs --masters-on-disk)")
    parser.add_argument("--resume-check", action="store_true",
                        help="save a checkpoint before the last step, then build the model again, load it, run the "
                             "last step again and compare its loss and the parameters after it, bit for bit")
    parser.add_argument("--drop-checkpoint", action="store_true",
                        help="delete the safetensors checkpoint once it is loaded, so that a model whose checkpoint "
                             "and training files together do not fit the disk still trains")
    parser.add_argument("--device", default="cpu", help="the compute device (cuda: the device slots in GPU memory)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    check_json_path(parser, args.json)
    check_dir(parser, args.dir)
    if args.resume_check and args.steps < 2:
        parser.error("--resume-check needs --steps 2 or more: it saves before the last step")
    if args.resume_check and args.drop_checkpoint:
        parser.error("--resume-check builds the model again from the checkpoint: it cannot go with --drop-checkpoint")
    if args.masters_on_disk and args.compute_dtype == "float32":
        parser.error("--masters-on-disk needs --compute-dtype bfloat16")
    if args.shadows_on_disk and not args.masters_on_disk:
        parser.error("--shadows-on-disk needs --masters-on-disk")
    compute_dtype = torch.bfloat16 if args.compute_dtype == "bfloat16" else None
    torch.manual_seed(0)

    work = Path(tempfile.mkdtemp(prefix="offload-scale-", dir=args.dir))
    result: dict = {"script": "benchmarks/bench_scale.py", "date": datetime.date.today().isoformat(),
                    "machine": {"cpus": os.cpu_count(), "ram_bytes": psutil.virtual_memory().total,
                                "platform": platform.platform(), "torch": torch.__version__},
                    "args": vars(args)}
    try:
        with PeakRSS() as writing:
            started = time.perf_counter()
            result["checkpoint"] = write_checkpoint(work / "checkpoint", args.width, args.layers, args.blocks_per_shard)
            result["checkpoint"]["write_s"] = time.perf_counter() - started
        result["checkpoint"]["peak_rss_bytes"] = writing.peak

        def load(drop: bool = False) -> tuple[offload.OffloadModel, OffloadOptimizer]:
            model = offload.load_sequential(lambda: build(args.width, args.layers), work / "checkpoint",
                                            device=args.device, num_slices=args.slices, compute_dtype=compute_dtype,
                                            masters=DiskTier(work / "masters") if args.masters_on_disk else None,
                                            shadows="disk" if args.shadows_on_disk else "ram")
            if drop:  # before the optimizer's tier checks its room
                shutil.rmtree(work / "checkpoint")
            return model, OffloadOptimizer(model, torch.optim.AdamW, lr=1e-4, fused=True,
                                           disk_tier=DiskTier(work / "state"))

        with PeakRSS() as training:
            started = time.perf_counter()
            model, optimizer = load(drop=args.drop_checkpoint)
            load_s = time.perf_counter() - started
            rss_after_load = psutil.Process().memory_info().rss
            training.phases["load"] = training.peak
            params = sum(p.numel() for p in model.parameters())
            steps = []
            resume: dict = {}
            x = torch.randn(args.batch, args.width, device=args.device)
            target = torch.randn(args.batch, args.width, device=args.device)
            counters = optimizer._tier.counters  # the tier's own read and write calls
            files = model._engine.master_files  # the masters' reads and writes, around each update
            # A training loop as users write it: each forward waits for the previous step's update
            # slice by slice (overlapped with it), and only the last step is waited for at its end.
            # Counted from one step's end to the next: reads and writes run beside the loop.
            io_before, masters_before = io_counts(counters), io_counts(files and files.counters)
            for number in range(args.steps):
                started = time.perf_counter()
                # The last step's updates run beside this forward and backward.
                training.phase = f"step {number + 1} forward and backward"
                loss = nn.functional.mse_loss(model(x).float(), target)
                loss.backward()
                compute_s = time.perf_counter() - started
                training.phase = f"step {number + 1} update"
                optimizer.step()
                optimizer.zero_grad()
                waited = time.perf_counter()
                if number == args.steps - 1:
                    optimizer.synchronize()  # the last update, which no forward hides
                io_now, masters_now = io_counts(counters), io_counts(files and files.counters)
                read_bytes, read_s, write_bytes, write_s = (now - then for now, then in zip(io_now, io_before))
                m_read, m_read_s, m_write, m_write_s = (now - then for now, then in zip(masters_now, masters_before))
                io_before, masters_before = io_now, masters_now
                steps.append({"loss": repr(loss.item()), "forward_backward_s": compute_s,
                              "update_wait_s": time.perf_counter() - waited,
                              "step_s": time.perf_counter() - started,
                              "tier_read_bytes": read_bytes, "tier_read_busy_s": read_s,
                              "tier_write_bytes": write_bytes, "tier_write_busy_s": write_s,
                              "masters_read_bytes": m_read, "masters_read_busy_s": m_read_s,
                              "masters_write_bytes": m_write, "masters_write_busy_s": m_write_s})
                print(f"step {len(steps)}: {steps[-1]['step_s']:.1f} s (forward and backward, waiting for the last "
                      f"update, {compute_s:.1f} s; after them {steps[-1]['update_wait_s']:.1f} s); tier read {read_bytes / 1e9:.1f} GB "
                      f"in {read_s:.1f} s, wrote {write_bytes / 1e9:.1f} GB in {write_s:.1f} s; masters read "
                      f"{m_read / 1e9:.1f} GB in {m_read_s:.1f} s, wrote {m_write / 1e9:.1f} GB in {m_write_s:.1f} s",
                      flush=True)
                if args.resume_check and number == args.steps - 2:
                    # Not counted in any step: the next step's counters start after it.
                    resume = save_for_resume(work / "resume", model, optimizer)
                    io_before, masters_before = io_counts(counters), io_counts(files and files.counters)
            footprint = model.memory_footprint()
            state_on_disk = disk_bytes(work / "state")
            # The masters' and gradients' files are unlinked once mapped: the footprint counts them.
            homes = [piece.storage.gradient_home for piece in model._engine.slices
                     if piece.storage.gradient_home is not None]
            gradients_on_disk = sum(home.file.nbytes for home in homes)
            masters_on_disk = footprint.disk - optimizer._tier.disk_nbytes - gradients_on_disk
            estimate = offload.estimate_memory(build_meta(args.width, args.layers), num_slices=args.slices,
                                               compute_dtype=compute_dtype, optimizer="adamw",
                                               optimizer_state="disk",
                                               masters="disk" if args.masters_on_disk else "ram",
                                               shadows="disk" if args.shadows_on_disk else "ram", device=args.device)
            if args.resume_check:
                resume.update(loss=steps[-1]["loss"], checksum=checksum(model))
                # The last loss holds its graph, which holds the model (as in PyTorch: leaves stay
                # alive through their accumulation nodes): the first run goes before the second comes.
                del model, optimizer, files, counters, loss
                gc.collect()
                resume.update(check_resume(work / "resume", load, x, target))
                resume["loss_equal"] = resume["resumed_loss"] == resume["loss"]
                resume["parameters_equal"] = resume.pop("resumed_checksum") == resume.pop("checksum")
                print(f"resumed from the checkpoint of step {args.steps - 1}: step {args.steps}'s loss "
                      f"{'equal' if resume['loss_equal'] else 'DIFFERENT'}, parameters after it "
                      f"{'equal' if resume['parameters_equal'] else 'DIFFERENT'} bit for bit; save {resume['save_s']:.1f} s "
                      f"(peak RSS {resume['save_peak_rss_bytes'] / GIB:.2f} GiB), load {resume['load_s']:.1f} s "
                      f"(peak RSS {resume['load_peak_rss_bytes'] / GIB:.2f} GiB)", flush=True)
            else:
                optimizer.close()
        result.update({
            "parameters": params,
            "adamw_fp32_state_ram_bytes": 16 * params,  # masters, gradients, two moments
            "machine_ram_bytes": psutil.virtual_memory().total,
            "load_s": load_s,
            "rss_after_load_bytes": rss_after_load,
            "peak_rss_bytes_sampled": training.peak,
            "peak_rss_bytes_kernel": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "peak_rss_phase": training.phase_at_peak,
            "peak_rss_parts_bytes": training.parts_at_peak,
            "peak_rss_bytes_by_phase": training.phases,
            "disk_state_bytes": state_on_disk,
            "disk_masters_bytes": masters_on_disk,
            "disk_gradients_bytes": gradients_on_disk,
            "footprint_host_bytes_per_parameter": footprint.host_total / params,
            "footprint_per_parameter": footprint.per_parameter(),
            "estimate_host_and_device_bytes": estimate.host_total + estimate.device_total,
            "estimate_disk_bytes": estimate.disk,
            "checkpoint_bytes": result["checkpoint"]["bytes"],
            "steps": steps,
            "memory_footprint": str(footprint),
            "resume": resume,
        })
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
