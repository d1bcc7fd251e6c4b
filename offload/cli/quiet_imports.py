"""transformers imported for the commands without the notes other libraries log while it imports them.

transformers imports torchao (``transformers.modeling_utils``, through its quantizers) and
bitsandbytes (``transformers.optimization``) whenever they are installed, as they are after the
README's full install; importing, they log notes that concern none of the commands' paths:
torchao's C extensions built for another torch, torch's deprecation of the way torchao registers
its enums, bitsandbytes' optional CPU kernels. :func:`import_transformers` drops exactly those
records, by logger and message, and only while it imports; every other line, and any later record
from those loggers, is printed as before. It is for the commands: the library imports transformers
plainly and leaves its users' logs alone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

__all__ = ["IMPORT_NOTES", "import_transformers", "without_import_notes"]

#: Logger name -> the fragments of the messages dropped while transformers imports.
IMPORT_NOTES = {
    # torchao/__init__.py: its C extensions (mxfp8, cutlass) built for another torch, or skipped.
    "torchao": ("Failed to load ", "Skipping import of cpp extensions"),
    # torch's note that torchao's enums need not be registered as pytree constants any more.
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported by torch.compile",),
    # bitsandbytes' optional CPU 4-bit kernel, from the `kernels` package.
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",),
}


class _DropNotes(logging.Filter):
    """Drops a logger's records whose message holds one of ``fragments``."""

    def __init__(self, fragments: tuple[str, ...]) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)  # the format string: a filter runs before the record is formatted
        return not any(fragment in message for fragment in self.fragments)


@contextmanager
def without_import_notes() -> Iterator[None]:
    """Drop the records of :data:`IMPORT_NOTES` inside the block, and nothing else."""
    filters = [(logging.getLogger(name), _DropNotes(fragments)) for name, fragments in IMPORT_NOTES.items()]
    for logger, drop in filters:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger, drop in filters:
            logger.removeFilter(drop)


def import_transformers() -> ModuleType:
    """``transformers``, with the modules that import torchao and bitsandbytes imported quietly.

    Raises:
        ImportError: transformers is not installed.
    """
    with without_import_notes():
        import transformers
        import transformers.modeling_utils  # noqa: F401  (imports torchao when installed)
        import transformers.optimization  # noqa: F401  (imports bitsandbytes when installed)
    return transformers
