"""Adapters from third-party model libraries to the ``nn.Sequential`` that :class:`~offload.OffloadModel` wraps.

Each submodule imports its library lazily and only when imported itself, so ``import offload``
never needs them: ``offload.integrations.transformers`` needs ``pip install -e ".[transformers]"``.
"""
