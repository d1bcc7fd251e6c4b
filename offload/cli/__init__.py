"""Command-line programs installed with the package: ``offload-finetune`` (:mod:`offload.cli.finetune`),
and ``offload`` (:mod:`offload.cli.main`: ``offload plan``, :mod:`offload.cli.plan`; ``offload
calibrate``, :mod:`offload.cli.calibrate`; ``offload finetune``).

Nothing here is imported by ``import offload``; each program imports its optional libraries
(transformers, peft, datasets) when it runs and says what to install when one is missing.
"""
