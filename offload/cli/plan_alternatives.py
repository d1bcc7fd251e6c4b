"""What would fit when nothing does: ``offload plan`` plans again with one option changed at a
time and says what each change needs, and whether the machine then has it.

The options: the disk tier (``--disk-dir``, when there is none), LoRA adapters (``--lora-r``, for
``--hf-config`` without them), a 4-bit base under them (``--quantize nf4``, without one), another
count of microbatches dividing the batch (``--microbatches``: one the planner does not try, or
another than the one fixed), a smaller batch (``--batch-size``) or sequence (``--seq-len``), the planner's own choice instead of a fixed
one (``--resident-slices auto``, no ``--num-slices`` ...), and the memory itself (``--host-memory``, ``--device-memory``, ``--disk``: the least under
which something fits, planned again to check). Every figure is a plan's
(:func:`~offload.planning.choose.least_needs`), with the planner's margins; nothing here
estimates. The planning itself is ``offload/cli/plan.py``'s.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Protocol

from ..planning.choose import MICROBATCH_LIMIT, Limits, Needs, Plan, gib, least_needs, microbatch_counts
from ..planning.rates import MachineRates

GIB = 2**30
#: The adapters' rank tried for ``--lora-r`` (a common one; the base's bytes dominate, not theirs).
LORA_RANK = 16
#: The shortest sequence tried for ``--seq-len``.
MIN_SEQ_LEN = 64
#: Fixed choices, by flag: the value that leaves the choice to the planner.
FREED = {"--resident-slices": ("resident_slices", "auto"), "--num-slices": ("num_slices", None),
         "--microbatches": ("microbatches", None), "--compute-dtype": ("compute_dtype", "auto"),
         "--schedule": ("schedule", "auto")}


class Planner(Protocol):
    """What plans for the arguments: ``offload/cli/plan.py``'s ``Planner``."""

    rates: MachineRates

    def plan(self, args: argparse.Namespace, limits: Limits) -> Plan: ...


@dataclass(frozen=True)
class Alternative:
    """One option changed (``flags``, as typed), the plan with it, and what that plan needs."""

    flags: str
    plan: Plan
    needs: Needs
    limits: Limits
    #: The figure it changes: ``"device"`` memory, or ``"host"`` memory (and disk).
    figure: str = "host"

    @property
    def fits(self) -> bool:
        return self.plan.chosen is not None

    def describe(self) -> str:
        """``needs 77.0 GiB of host memory and 89.7 GiB of disk: fits``, or what is still short."""
        needs, parts = self.needs, []
        # As the plan's own answer (choose.missing): where every other limit is met by some
        # candidate, the pinned memory is what is short, however much host memory there is.
        pinned = [c.memory.pinned_bytes for c in self.plan.candidates if set(c.over) == {"pinned"}]
        if pinned and not self.fits:
            return (f"needs {gib(min(pinned))} of pinned host memory (the platform pins "
                    f"{gib(self.limits.pinned_memory or 0, up=False)}): does not fit")
        host = (needs.host_memory, needs.tiered_host_memory) != (None, None)
        if self.figure == "device" or not host:
            parts.append(f"{gib(needs.device_memory)} of device memory")
        # With the device memory given, the host's may still be short: said, or the line reads as
        # the plan's own "needs ... of device memory" and is left out as no change.
        if host and (self.figure != "device" or not self.fits):
            if needs.host_memory is not None and (needs.tiered_host_memory is None
                                                  or needs.host_memory <= needs.tiered_host_memory):
                parts.append(f"{gib(needs.host_memory)} of host memory")
            else:
                parts.append(f"{gib(needs.tiered_host_memory)} of host memory and {gib(needs.tiered_disk)} of disk")
        return "needs " + " and ".join(parts) + (": fits" if self.fits else ": does not fit")

    def to_json(self) -> dict[str, object]:
        return {"flags": self.flags, "fits": self.fits, "device_memory": self.needs.device_memory,
                "host_memory": self.needs.host_memory, "tiered_host_memory": self.needs.tiered_host_memory,
                "tiered_disk": self.needs.tiered_disk}


def alternatives(args: argparse.Namespace, plan: Plan, limits: Limits, planner: Planner) -> list[Alternative]:
    """Each option that changes ``plan``'s answer, "nothing fits", with the plan it gives: those
    that fit first, then those that need less (in the order tried)."""
    needs = least_needs(plan.candidates, limits)
    now = Alternative(flags="", plan=plan, needs=needs, limits=limits,
                      figure="host" if (needs.host_memory, needs.tiered_host_memory) != (None, None) else "device")
    # A change whose figure prints as today's does not change the answer.
    found = [a for a in _tried(args, plan, limits, planner) if a is not None and (a.fits or a.describe() != now.describe())]
    return [a for a in found if a.fits] + [a for a in found if not a.fits]


def _tried(args: argparse.Namespace, plan: Plan, limits: Limits, planner: Planner) -> Iterator[Alternative | None]:
    needs = least_needs(plan.candidates, limits)
    yield from _more_memory(args, needs, limits, planner)
    if limits.disk_dir is None and planner.rates.disk_read is not None and planner.rates.disk_write is not None:
        # A disk with no limit: the plan then says how much of it the tier takes. Rates without
        # the disk's (a calibration without --dir) cannot time the tier: it is not tried.
        yield _replan(planner, args, replace(limits, disk_dir="DIR", disk=None), "--disk-dir DIR")
    if args.hf_config and not args.lora_r and _installed("peft"):
        yield _replan(planner, _with(args, lora_r=LORA_RANK), limits, f"--lora-r {LORA_RANK}")
    if args.hf_config and not args.quantize and _installed("peft") and _installed("bitsandbytes"):
        flags = "--quantize nf4" if args.lora_r else f"--lora-r {LORA_RANK} --quantize nf4"
        yield _replan(planner, _with(args, lora_r=args.lora_r or LORA_RANK, quantize="nf4"), limits, flags)
    yield _other_microbatches(planner, args, limits)
    # --microbatches splits the rows: a batch it does not divide is refused; a sequence is not split.
    yield _smaller(planner, args, limits, "batch_size", lowest=args.microbatches or 1, multiple=args.microbatches or 1)
    if args.hf_config:
        yield _smaller(planner, args, limits, "seq_len", lowest=MIN_SEQ_LEN)
    for flag, (name, free) in FREED.items():
        if getattr(args, name) != free:
            yield _replan(planner, _with(args, **{name: free}), limits, flag + (f" {free}" if free else " (left out)"))


def _more_memory(args: argparse.Namespace, needs: Needs, limits: Limits, planner: Planner) -> Iterator[Alternative]:
    """The least memory under which something fits, planned again with it."""
    if needs.host_memory is None and needs.tiered_host_memory is None:
        device, text = _round_up(needs.device_memory)
        yield replace(_replan(planner, args, replace(limits, device_memory=device), f"--device-memory {text}"),
                      figure="device")
        return
    host = min(n for n in (needs.host_memory, needs.tiered_host_memory) if n is not None)
    if limits.host_memory is not None and host > limits.host_memory:
        host, text = _round_up(host)
        yield _replan(planner, args, replace(limits, host_memory=host), f"--host-memory {text}")
    if needs.tiered_disk is not None and limits.disk is not None and needs.tiered_disk > limits.disk:
        disk, text = _round_up(needs.tiered_disk)
        yield _replan(planner, args, replace(limits, disk=disk), f"--disk {text}")


def _smaller(planner: Planner, args: argparse.Namespace, limits: Limits, name: str, lowest: int,
             multiple: int = 1) -> Alternative | None:
    """The largest of ``name``'s halvings (down to ``lowest``, each a multiple of ``multiple``) that
    fits; or, when none does, the smallest's plan. The smallest is planned first: if it does not
    fit, nothing larger does."""
    value = getattr(args, name)
    sizes = [value >> k for k in range(1, value.bit_length()) if (value >> k) >= lowest and (value >> k) % multiple == 0]
    if not sizes:
        return None
    flag = "--" + name.replace("_", "-")
    smallest = _replan(planner, _with(args, **{name: sizes[-1]}), limits, f"{flag} {sizes[-1]}")
    if not smallest.fits:
        return smallest
    for size in sizes[:-1]:
        alternative = _replan(planner, _with(args, **{name: size}), limits, f"{flag} {size}")
        if alternative.fits:
            return alternative
    return smallest


def _other_microbatches(planner: Planner, args: argparse.Namespace, limits: Limits) -> Alternative | None:
    """The fewest microbatches that fit, of the counts dividing the batch that the plan did not
    try: past :data:`~offload.planning.choose.MICROBATCH_LIMIT` (the batch over a small count), or
    any other than a fixed ``--microbatches``. ``None`` when none fits."""
    batch = args.batch_size
    small = [d for d in range(1, min(batch, MICROBATCH_LIMIT) + 1) if batch % d == 0]
    counts = sorted({*small, *(batch // d for d in small)} - set([args.microbatches] if args.microbatches
                                                                  else microbatch_counts(batch)))
    for count in counts:
        alternative = _replan(planner, _with(args, microbatches=count), limits, f"--microbatches {count}")
        if alternative.fits:
            return alternative
    return None


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _replan(planner: Planner, args: argparse.Namespace, limits: Limits, flags: str) -> Alternative:
    plan = planner.plan(args, limits)
    return Alternative(flags=flags, plan=plan, needs=least_needs(plan.candidates, limits), limits=limits)


def _with(args: argparse.Namespace, **changes: object) -> argparse.Namespace:
    return argparse.Namespace(**(vars(args) | changes))


def _round_up(nbytes: int) -> tuple[int, str]:
    """``nbytes`` up to the GiB figure :func:`~offload.planning.choose.gib` prints, and that figure."""
    text = gib(nbytes).removesuffix(" GiB")
    return max(nbytes, math.ceil(float(text) * GIB)), text
