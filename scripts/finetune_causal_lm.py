"""Fine-tune a Hugging Face causal LM with OffloadModel and OffloadOptimizer: the ``offload-finetune`` command.

The program lives in the package (``offload/cli/finetune.py``) so that ``pip install`` puts it on
the path as ``offload-finetune``; this file runs it from a checkout, with the same options::

    python scripts/finetune_causal_lm.py --out /tmp/tuned          # tiny random Llama, CPU or GPU
    python scripts/finetune_causal_lm.py --help                    # every option, with examples
"""

from offload.cli.finetune import main, parse_args  # noqa: F401  (tests import parse_args from here)
from offload.cli.models import byte_tokenizer, random_model  # noqa: F401

if __name__ == "__main__":
    main()
