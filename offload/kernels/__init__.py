"""Host kernels compiled for this machine on first use: the one-pass Adam/AdamW update that writes
a slice's compute-dtype shadow as it updates the masters (Note: [One-pass update] in
``one_pass.py``). ``build.py`` compiles and checks them; without a compiler, or where a check
fails, the host update runs PyTorch's own kernels as before, with the same results."""

from .build import HostKernelUnavailable, host_kernel
from .one_pass import OnePassUpdate

__all__ = ["HostKernelUnavailable", "OnePassUpdate", "host_kernel"]
