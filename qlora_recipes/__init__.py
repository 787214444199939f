"""QLoRA recipe library: one room (sub-package) per concern; docs/ARCHITECTURE.md is the map."""

import logging

# bitsandbytes tries to fetch an optional AVX512 CPU inference kernel from the hub at import and
# warns when it cannot; we never use that path (model/loading._keep_4bit_layout_trainable), so hush it.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

# datasets' progress bars: data.load_splits turns them off (TRL's passes over 2000 rows drowned the
# training bar) and shows one while a large split is tokenized (data/tokens.py). An environment
# that sets HF_DATASETS_DISABLE_PROGRESS_BARS decides instead.
