"""The rates a step's time is predicted from: how fast this machine computes, copies and writes.

:class:`MachineRates` holds them; ``python -m offload calibrate`` measures them on the machine at
hand and stores them as a small JSON file (:func:`default_rates_path`); :data:`GPU_DEFAULTS` are
figures for common GPUs, each with its source, for planning a machine one does not have.

A GPU default says nothing about the host it sits in, so its host rates (copy bandwidth, the
fused AdamW update, disk) are those of :data:`HOST_DEFAULT`, which the user's calibration
replaces (``offload plan --rates FILE --gpu h100-sxm`` takes the host's from the file and the
device's from the default).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Bytes AdamW moves per float32 parameter: reads the parameter, gradient and two moments, writes
#: the parameter and both moments. Host update rates are given in these bytes per second.
ADAMW_BYTES_PER_PARAMETER = 28
#: The same for SGD with momentum (read p, g, m; write p, m) and plain SGD (read p, g; write p).
UPDATE_BYTES_PER_PARAMETER = {"adamw": 28, "adam": 28, "sgd-momentum": 20, "sgd": 12, None: 0}

GB = 1e9
TB = 1e12
TFLOP = 1e12
#: A host gradient's 2-norm where none was measured: ``clip_grad_norm_``'s norm over 3.54 GB of
#: float32 gradients took 345 and 446 ms on an H200's 16-core host (10.3 and 7.9 GB/s, one thread:
#: ``benchmarks/results/h200-2026-11-28``, ``clip_norm_s``); the lower figure.
HOST_NORM_DEFAULT = 7.9 * GB


@dataclass(frozen=True)
class MachineRates:
    """Rates of one machine, in bytes or operations per second.

    Attributes:
        name: what was measured (``"calibrated on <host>"``, ``"h100-sxm"``).
        device_flops: dense matrix-multiply operations per second by compute dtype name
            (``"float32"``, ``"bfloat16"``, ``"float16"``).
        host_to_device, device_to_host: pinned copies over the link; 0 on a CPU "device" (no
            link: its loads are copies in RAM, timed with :attr:`host_copy`), which marks the
            rates as a CPU's: ``offload plan`` refuses them for a GPU.
        host_copy: bytes per second copied by a large copy in RAM (each byte read and written once).
        host_update: the fused AdamW update on the host, in :data:`ADAMW_BYTES_PER_PARAMETER`
            bytes per parameter per second.
        host_memory_bandwidth: bytes per second the host's memory reads plus writes, as a copy
            of a few GB between two buffers achieves it (STREAM's copy, counted as STREAM counts
            it): what the host's passes over memory other than the optimizer's are timed with
            (``None``: not measured; the planner then takes twice :attr:`host_copy`).
        host_norm: bytes per second a float32 gradient's 2-norm reads on the host: PyTorch
            computes a CPU tensor's norm on one thread, so ``torch.nn.utils.clip_grad_norm_``
            over host gradients reads them at about one core's rate, and
            :func:`offload.clip_grad_norm_`, which spreads the tensors over threads, reads its
            largest tensor at that rate (``None``: not measured; the planner then takes
            :data:`HOST_NORM_DEFAULT`).
        disk_read, disk_write: sequential file bandwidth where the disk tier would live
            (``None``: not measured).
        slice_overhead_s: fixed host time per slice run (a slice's forward, recompute or
            backward on one microbatch): Python, events, launches.
        device_memory: bytes of device memory (``None``: unknown).
        device_memory_bandwidth: bytes per second the device's memory reads plus writes, as an
            elementwise kernel achieves it: the resident slices' update on the device (``None``:
            unknown; the planner then takes :data:`DEVICE_MEMORY_BANDWIDTH_DEFAULT`).
        sources: where each figure came from, by attribute name.
    """

    name: str
    device_flops: dict[str, float]
    host_to_device: float
    device_to_host: float
    host_copy: float
    host_update: float
    disk_read: float | None = None
    disk_write: float | None = None
    slice_overhead_s: float = 0.0
    device_memory: int | None = None
    device_memory_bandwidth: float | None = None
    host_memory_bandwidth: float | None = None
    host_norm: float | None = None
    sources: dict[str, str] = field(default_factory=dict)

    def flops_for(self, dtype_name: str) -> float:
        """The device's rate for ``dtype_name``; float32 where that dtype was not measured."""
        rate = self.device_flops.get(dtype_name) or self.device_flops.get("float32")
        if not rate:
            asked = "float32" if dtype_name == "float32" else f"{dtype_name} or float32"
            raise ValueError(f"{self.name}: no device rate for {asked}; run `python -m offload calibrate` on a "
                             f"machine with the device, or pass --gpu")
        return rate

    def with_host(self, host: MachineRates) -> MachineRates:
        """These device and link rates with ``host``'s host rates (copy, update, disk, overhead)."""
        names = ("host_copy", "host_update", "host_memory_bandwidth", "host_norm", "disk_read", "disk_write",
                 "slice_overhead_s")
        sources = dict(self.sources) | {n: host.sources.get(n, host.name) for n in names}
        return dataclasses.replace(self, name=f"{self.name} + host {host.name}", sources=sources,
                                   **{n: getattr(host, n) for n in names})

    @property
    def host_memory(self) -> float:
        """The host's memory bandwidth, read plus written: measured, or twice the copy rate (a
        copied byte is read once and written once)."""
        return self.host_memory_bandwidth or 2 * self.host_copy

    @property
    def host_norm_rate(self) -> float:
        """Bytes per second the host reads a gradient for its norm: measured, or :data:`HOST_NORM_DEFAULT`."""
        return self.host_norm or HOST_NORM_DEFAULT

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MachineRates:
        if not isinstance(data, dict):
            raise ValueError(f"rates file must hold a JSON object of rates, got {type(data).__name__}; run `python -m "
                             f"offload calibrate` again")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"rates file has unknown fields {unknown}; it was written by another version: "
                             f"run `python -m offload calibrate` again")
        _check_values(data)
        return cls(**data)


#: The rates a file must give, each a number above 0: a step's time divides by them.
_REQUIRED_RATES = ("host_copy", "host_update")
#: The link's rates: a file must give them, each a number above 0, or 0 where there is no link (a
#: CPU "device", whose loads are copies in RAM: ``offload plan`` refuses them for a GPU).
_LINK_RATES = ("host_to_device", "device_to_host")
#: The rates a file may leave out or give as ``null`` (not measured); given, each is above 0.
_OPTIONAL_RATES = ("disk_read", "disk_write", "device_memory", "device_memory_bandwidth", "host_memory_bandwidth",
                   "host_norm")


def _check_values(data: dict[str, Any]) -> None:
    """Refuse a rate that is missing, not a number, 0 (where there must be one), negative or not
    finite: the step's time divides by each, and a wrong one plans nonsense (negative seconds) or
    fails (a division by 0)."""
    missing = sorted(n for n in ("name", "device_flops", *_REQUIRED_RATES, *_LINK_RATES) if n not in data)
    if missing:
        raise ValueError(f"rates file lacks {missing}; run `python -m offload calibrate` again")
    if not isinstance(data["name"], str):
        raise ValueError(f"rates file: name must be text, got {json.dumps(data['name'])}; run `python -m offload "
                         f"calibrate` again, or correct it")
    sources = data.get("sources", {})
    if not isinstance(sources, dict) or not all(isinstance(v, str) for v in sources.values()):
        # --gpu merges the file's sources into the GPU's by name.
        raise ValueError(f"rates file: sources must map rate names to where each came from, got "
                         f"{json.dumps(sources)}; run `python -m offload calibrate` again, or correct it")
    flops = data["device_flops"]
    if not isinstance(flops, dict):
        raise ValueError(f"rates file: device_flops must map dtype names to operations per second, got {flops!r}")
    # (name, value, whether 0 is a value it may take)
    named = [*((n, data[n], False) for n in _REQUIRED_RATES),
             *((n, data[n], True) for n in _LINK_RATES),
             *((n, data[n], False) for n in _OPTIONAL_RATES if data.get(n) is not None),
             *((f"device_flops[{k!r}]", v, False) for k, v in flops.items()),
             ("slice_overhead_s", data.get("slice_overhead_s", 0.0), True)]
    for name, value, zero in named:
        if not _number(value) or value < 0 or (value == 0 and not zero):
            least = "of at least 0" if zero else "above 0"
            raise ValueError(f"rates file: {name} must be a number {least}, got {json.dumps(value)}; run `python -m "
                             f"offload calibrate` again, or correct it")


def _number(value: object) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past a float's range (10**400): not a rate either
        return False


def default_rates_path() -> Path:
    """Where ``calibrate`` writes and ``plan`` reads the rates: ``$XDG_CACHE_HOME/offload/rates.json``
    (``~/.cache/offload/rates.json`` without it)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "offload" / "rates.json"


def save_rates(rates: MachineRates, path: str | os.PathLike[str]) -> Path:
    """Write ``rates`` to ``path`` whole or not at all: a full disk or an error part way leaves the
    file that was there as it was (a temp file beside it, made durable, then renamed over it). A
    symbolic link is written through, as a plain write would: its target is replaced, the link kept."""
    path = Path(path)
    target = Path(os.path.realpath(path))  # renaming over the link itself would turn it into a file
    target.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(rates.to_json(), indent=2) + "\n"
    handle, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        # mkstemp's 0600 would hide the rates from other users where a plain write would not: the
        # file keeps its mode, or a new one gets what the umask allows a plain write.
        os.chmod(temp, _mode_of(target))
        os.replace(temp, target)
    except BaseException:  # Ctrl-C too: no temp file left behind
        Path(temp).unlink(missing_ok=True)
        raise
    return path


def _mode_of(path: Path) -> int:
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0o022)  # the only way to read it; set back at once
        os.umask(umask)
        return 0o666 & ~umask


def load_rates(path: str | os.PathLike[str]) -> MachineRates:
    """The rates in ``path``, as a plan times with them.

    Raises:
        FileNotFoundError: no such file, with what to run to make it.
        ValueError: not rates of this version, a rate missing or not a number above 0
            (:meth:`MachineRates.from_json`), or no float32 device rate.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no rates at {path}: run `python -m offload calibrate` (a minute) or pass --gpu NAME")
    rates = MachineRates.from_json(json.loads(path.read_text()))
    if not rates.device_flops.get("float32"):
        # A plan times a float32 step with it, and a dtype the file has no rate for (flops_for).
        # (A record of a run's device seconds, read by from_json, may have none: benchmarks' cases.)
        raise ValueError(f"rates file: device_flops has no float32 rate, got {json.dumps(rates.device_flops)}; run "
                         f"`python -m offload calibrate` again, or correct it")
    return rates


_H100_README = "benchmarks/results/h100-2026-11-22/README.md"
_CPU_RESULTS = "benchmarks/results/optimizer_cpu_2026-11-22d.json"
_DISK_RESULTS = "benchmarks/results/storage_cpu_2026-11-24_quiet.json: disk_mixed_read_gbps, disk_mixed_write_gbps"

#: Host rates when nothing was calibrated: this repository's 2-core CPU runner (fused AdamW 22.5
#: GB/s; a copy 34.8 GB/s read plus written, 17.4 GB/s copied: ``optimizer_cpu_2026-11-22d.json``);
#: its disk read and written at once, as the tier does (1.29 and 1.33 GB/s:
#: ``storage_cpu_2026-11-24_quiet.json``). Slow beside a server: calibrate.
HOST_DEFAULT = MachineRates(
    name="default host",
    device_flops={},
    host_to_device=17.4 * GB,
    device_to_host=17.4 * GB,
    host_copy=17.4 * GB,
    host_update=22.5 * GB,
    disk_read=1.29 * GB,
    disk_write=1.33 * GB,
    slice_overhead_s=2e-4,
    sources={"host_copy": _CPU_RESULTS, "host_update": _CPU_RESULTS, "disk_read": _DISK_RESULTS,
             "disk_write": _DISK_RESULTS,
             "slice_overhead_s": "an assumed 0.2 ms per slice run: calibrate to measure it"},
)


def _gpu(name: str, flops: dict[str, float], link: float, memory_gib: int, bandwidth: float,
         sources: dict[str, str]) -> MachineRates:
    return dataclasses.replace(HOST_DEFAULT, name=name, device_flops=flops, host_to_device=link, device_to_host=link,
                               device_memory=memory_gib * 2**30, device_memory_bandwidth=bandwidth,
                               sources=HOST_DEFAULT.sources | sources)


_NVIDIA_H100 = "NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): dense, without sparsity"
_NVIDIA_A100 = "NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100): dense, without sparsity"
_ADA = "NVIDIA Ada GPU architecture whitepaper v2.1, RTX 4090: tensor FP16/BF16 with FP32 accumulate, dense"
_PCIE4 = "PCIe 4.0 x16: 32 GB/s raw; 25 GB/s assumed for pinned copies (about 80 %, as the H100 reached of PCIe 5.0)"
#: Datasheet peaks are not reached by real matmuls; the H100 SXM's measured 790 of 989 TFLOP/s
#: (0.8) scales the other datasheet figures, marked so in their sources.
_ACHIEVED = 0.8
#: Share of a datasheet's memory bandwidth an elementwise kernel (a fused optimizer step)
#: achieves: an assumption, not measured here (STREAM-like kernels reach 80-90 % on these GPUs).
_BANDWIDTH_ACHIEVED = 0.8

#: The device's memory bandwidth where the rates do not give one (a calibration on a machine
#: without a GPU, a rates file from before the field): the H100 SXM's 3.35 TB/s (its datasheet)
#: x :data:`_BANDWIDTH_ACHIEVED`. The resident slices' update on the device is timed with it.
DEVICE_MEMORY_BANDWIDTH_DEFAULT = 3.35 * _BANDWIDTH_ACHIEVED * TB

#: Device and link rates of common GPUs, by the names ``offload plan --gpu`` takes.
GPU_DEFAULTS: dict[str, MachineRates] = {
    "h100-sxm": _gpu("h100-sxm", {"bfloat16": 790 * TFLOP, "float16": 790 * TFLOP, "float32": 67 * _ACHIEVED * TFLOP},
                     54.5 * GB, 80, 3.35 * _BANDWIDTH_ACHIEVED * TB, {
                         "device_memory_bandwidth": f"3.35 TB/s HBM3 ({_NVIDIA_H100}) x {_BANDWIDTH_ACHIEVED}",
                         "device_flops": "bfloat16: ~790 TFLOP/s dense matmul measured on an H100 SXM; float32: "
                                         f"67 TFLOP/s ({_NVIDIA_H100}) x {_ACHIEVED}",
                         "host_to_device": f"{_H100_README}: pinned copies 54-55 GB/s each way",
                         "device_to_host": f"{_H100_README}: pinned copies 54-55 GB/s each way"}),
    "h100-pcie": _gpu("h100-pcie", {"bfloat16": 756 * _ACHIEVED * TFLOP, "float16": 756 * _ACHIEVED * TFLOP,
                                    "float32": 51 * _ACHIEVED * TFLOP}, 54.5 * GB, 80,
                      2.0 * _BANDWIDTH_ACHIEVED * TB, {
                          "device_memory_bandwidth": f"2.0 TB/s HBM2e ({_NVIDIA_H100}) x {_BANDWIDTH_ACHIEVED}",
                          "device_flops": f"756 (bf16) and 51 (fp32) TFLOP/s, {_NVIDIA_H100}, x {_ACHIEVED}",
                          "host_to_device": f"PCIe 5.0 x16 as the SXM's host link: {_H100_README}",
                          "device_to_host": f"PCIe 5.0 x16 as the SXM's host link: {_H100_README}"}),
    "a100": _gpu("a100", {"bfloat16": 312 * _ACHIEVED * TFLOP, "float16": 312 * _ACHIEVED * TFLOP,
                          "float32": 19.5 * _ACHIEVED * TFLOP}, 25 * GB, 80, 1.935 * _BANDWIDTH_ACHIEVED * TB, {
                     "device_memory_bandwidth": f"1,935 GB/s, A100 80GB PCIe ({_NVIDIA_A100}) x {_BANDWIDTH_ACHIEVED}",
                     "device_flops": f"312 (bf16) and 19.5 (fp32) TFLOP/s, {_NVIDIA_A100}, x {_ACHIEVED}",
                     "host_to_device": _PCIE4, "device_to_host": _PCIE4}),
    "rtx-4090": _gpu("rtx-4090", {"bfloat16": 165.2 * _ACHIEVED * TFLOP, "float16": 165.2 * _ACHIEVED * TFLOP,
                                  "float32": 82.6 * _ACHIEVED * TFLOP}, 25 * GB, 24, 1.008 * _BANDWIDTH_ACHIEVED * TB, {
                         "device_memory_bandwidth": f"1,008 GB/s GDDR6X ({_ADA}) x {_BANDWIDTH_ACHIEVED}",
                         "device_flops": f"165.2 (bf16) and 82.6 (fp32 non-tensor) TFLOP/s, {_ADA}, x {_ACHIEVED}",
                         "host_to_device": _PCIE4, "device_to_host": _PCIE4}),
}
