"""A stream-ordering checker: the asynchronous copy path, run and checked on the CPU.

On a GPU, copies run on side streams while compute runs on its own, and a missing wait is a race
that shows up only now and then, as a wrong number. Machines without a GPU never run that code
path at all. :class:`StreamChecker` installs a simulated stream backend so that it does run there,
and makes mistakes show:

- **Deferred copies.** A copy queued on a side stream runs only when something forces it (or at
  issue, or at random points: three schedules); until then its destination holds poison (NaN;
  ``0xFF`` bytes, NaN through any floating-point view, for ``uint8``; ``True`` for ``bool``; the
  most negative value for other integers), and its source is read when it runs. Reading a
  destination too early, or writing a source too early, gives wrong values.
- **Happens-before race checking.** Vector clocks for the host, the compute stream and each side
  stream, advanced by events, stream waits and host synchronisation, and every byte range touched
  by compute, by copies and by host-side code (an optimizer, the caller's code between steps) is
  checked against earlier conflicting accesses of other agents. The caching allocator is
  modelled: freshly allocated device memory may still be in use by compute queued before, and
  device memory freed while a side stream may use it must have been marked as used by it.
  Asynchronous copies from memory that is not pinned are reported.
- **Dependencies.** Every wait, synchronisation and mark the copy engine asks for is recorded
  (:class:`Dependency`) and can be left out, so a test can prove each one is needed.

What it cannot model: real kernel timing and bandwidth (it finds missing orderings, not slow
ones), several devices or processes, the CUDA caching allocator's exact reuse policy (it assumes
the worst case), and memory accessed outside PyTorch operators (``numpy()`` views, C extensions;
the package's one-pass host update kernel shows what it touches as an operator, Note: [One-pass
update] in ``offload/kernels/one_pass.py``).
"""

from .checker import StreamChecker, StreamOrderingError
from .memory import Race
from .simulator import SCHEDULES, Dependency, SimulatedBackend

__all__ = ["SCHEDULES", "Dependency", "Race", "SimulatedBackend", "StreamChecker", "StreamOrderingError"]
