"""Command-line programs installed with the package: ``offload-finetune`` (:mod:`offload.cli.finetune`).

Nothing here is imported by ``import offload``; each program imports its optional libraries
(transformers, peft, datasets) when it runs and says what to install when one is missing.
"""
