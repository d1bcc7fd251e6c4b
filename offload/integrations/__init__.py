"""Adapters from third-party model libraries to the ``nn.Sequential`` that :class:`~offload.OffloadModel` wraps.

Each submodule imports its library lazily and only when imported itself, so ``import offload``
never needs them: ``offload.integrations.transformers`` needs ``pip install "offload[transformers]"``.
"""


def install_hint(extra: str) -> str:
    """The command that installs the optional dependencies ``extra`` names (``[project.optional-dependencies]``
    in ``pyproject.toml``), for an error to end with. It names the package, so it works wherever
    offload was installed from, not only in a clone (where an editable install of ``.`` would).

    Example::

        raise ImportError(f"... needs PyTorch Lightning: {install_hint('lightning')}") from error
    """
    return f'pip install "offload[{extra}]"'
