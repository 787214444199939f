"""QLoRA recipe library: one module per concern (see README.md, "Layout")."""

import logging

# bitsandbytes tries to fetch an optional AVX512 CPU inference kernel from the hub at import and
# warns when it cannot; we never use that path (modeling._keep_4bit_layout_trainable), so hush it.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

# Dataset preprocessing bars (tokenizing 2000 rows) drown the training progress bar.
import os  # noqa: E402

os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
