"""The bound an offloaded step is measured against, with the host counted: what every benchmark
that reports an efficiency computes, in the same process as the steps it measures.

``bound = max(resident step, link bytes / measured link bandwidth, host bytes / measured host
bandwidth)``: a step cannot beat the device's own work, the link's traffic, nor the host memory
traffic the step needs. The host bytes are the library's count
(:func:`offload.planning.host_bytes.host_bytes_per_step`: the optimizer's pass, the shadow's
pass, the gradients written and the loads read, the copies' bytes as the copy engine counted them
where a benchmark has them); the host's bandwidth is the larger of two rates measured in the same
process: a copy of a few GB between two buffers (:func:`offload.cli.calibrate.host_memory_bandwidth`,
read plus written, the median of 7), and the fused AdamW alone's 28 bytes a parameter over its
seconds. A copy alone undercounts what the memory moves: each destination line is read before it
is written, a third of the traffic that STREAM's count leaves out, and an H200 host's 16 threads
copied at 65 GB/s while its fused AdamW reached 105-111 GB/s. A bound at the copy's rate was
beaten by the step it bounded (efficiency 1.20, ``benchmarks/results/h200-2026-11-28``).

The earlier bound, ``max(resident step, link, fused AdamW alone)``, is kept beside it (``old``):
the fused AdamW alone over the same float32 tensors is now the median of 7 repeats, not 3, since
one 3-repeat sample moved the same step's efficiency from 0.55 to 0.45 between two calls.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from offload.cli.calibrate import host_memory_bandwidth
from offload.planning.host_bytes import HostBytes
from offload.planning.rates import ADAMW_BYTES_PER_PARAMETER

#: Repeats of the fused AdamW alone and of the host bandwidth copy; their median is reported.
REPEATS = 7


def fused_adamw_alone(shapes: list[torch.Size], repeats: int = REPEATS) -> dict[str, Any]:
    """One fused AdamW step over float32 host tensors of the sizes ``shapes``: the median seconds
    of ``repeats`` (after one that allocates the state) and every sample."""
    params = [torch.full(shape, 0.5, dtype=torch.float32).requires_grad_() for shape in shapes]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=True)
    optimizer.step()  # the state's first touch
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        optimizer.step()
        samples.append(time.perf_counter() - start)
    return {"median_s": statistics.median(samples), "samples_s": samples}


def host_bandwidth(nbytes: int = 1 << 30, num_threads: int | None = None) -> dict[str, Any]:
    """The host's memory bandwidth (bytes per second, read plus written) by a copy of ``nbytes``
    between two buffers, with the update worker's ``num_threads``."""
    rate = host_memory_bandwidth(nbytes, repeats=REPEATS, num_threads=num_threads)
    return {"bytes_per_s": rate, "copy_bytes": nbytes, "repeats": REPEATS, "num_threads": num_threads}


def bound(step_s: float, resident_step_s: float, link_s: float, host: HostBytes, host_bytes_per_s: float,
          update_alone_s: float | None, update_parameters: int | None = None) -> dict[str, Any]:
    """The new bound and the old one over ``step_s``, with their terms.

    Args:
        resident_step_s: the device's own work (the resident step, or the step without an optimizer).
        link_s: the link's bytes over its measured bandwidth (0 on a CPU "device").
        host: the host bytes of one step; ``host_bytes_per_s``: the copy's measured host bandwidth.
        update_alone_s: the fused AdamW alone (the old bound's host term; ``None``: not measured),
            over ``update_parameters`` parameters: where both are given, the host's rate is the
            larger of the copy's and the update's.
    """
    rates = {"copy": host_bytes_per_s}
    if update_alone_s and update_parameters:
        rates["fused_adamw"] = ADAMW_BYTES_PER_PARAMETER * update_parameters / update_alone_s
    rate = max(rates.values())
    terms = {"resident_step_s": resident_step_s, "link_s": link_s, "host_bytes_s": host.total / rate}
    old_terms = {"resident_step_s": resident_step_s, "link_s": link_s, "update_alone_s": update_alone_s}
    new = max(terms.values())
    old = max(v for v in old_terms.values() if v is not None)
    return {"bound_s": new, "bound_terms": terms, "host_bytes": host.to_json(), "efficiency": new / step_s,
            "host_bytes_per_s": rates, "host_rate_from": max(rates, key=rates.__getitem__),
            "old_bound_s": old, "old_bound_terms": old_terms, "old_efficiency": old / step_s,
            "limited_by": max(terms, key=terms.__getitem__)}
