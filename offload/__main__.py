"""``python -m offload plan|calibrate|finetune ...``: the ``offload`` command (``offload/cli/main.py``)."""

from .cli.main import main

main()
