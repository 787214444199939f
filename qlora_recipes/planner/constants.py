"""The planner's documented constants and the choices it knows: measured or sourced byte figures
(CUDA context, process baseline, allocator slack, bitsandbytes block sizes) and the names of the
device-map strategies, compute dtypes and optimizers it can plan (the model families are
families.py's, on the package floor).
"""

from __future__ import annotations

from ..families import KNOWN_ARCHITECTURES  # noqa: F401  (the families inventoried from figures)
from ..units import GiB

# CUDA context of a process that imports torch, bitsandbytes and runs cuBLAS/flash kernels: the
# driver context with lazy module loading (CUDA >= 11.7) is 0.3-0.6 GiB on A100/H100, cuBLAS and
# cuBLASLt workspaces up to 32 MiB per handle on Hopper, plus the kernel images of bitsandbytes and
# the attention kernels that get loaded. Not visible to torch.cuda.memory_allocated(); nvidia-smi
# shows it. 1 GiB is the round, slightly conservative figure.
CUDA_CONTEXT_BYTES = 1 * GiB
# RSS of the training process apart from the model and its tensors: the interpreter with torch,
# transformers, peft, trl, bitsandbytes, datasets and hydra imported (0.51 GiB: the RSS at
# train()'s start), the tokenizer and the tokenized data (+0.02-0.04), what the trainer imports when
# it starts (+0.04: accelerate's optional backends), thread pools and kernel workspaces. Measured
# on a 2-core CPU box, torch 2.13: the 1 M-parameter cases of bench/results/planner-cpu.json peak at
# 0.74-0.76 GiB, of which the plan's model, adapters and step are 0.12-0.13 GiB. `qlora plan` uses it,
# having no run to measure; a run plans with its own start RSS instead (planner/process.py), which now
# holds the objective's trainer and accelerate's backends: 0.58 GiB on a 2-core AMX Xeon (2026-11-29),
# 0.52-0.61 across fresh venvs (the shared libraries' file pages come and go with the page cache).
CPU_PROCESS_BASELINE_BYTES = int(0.62 * GiB)
# What a run adds after train()'s start, when it plans with its own start RSS (planner/process.py).
# That start now holds the objective's TRL trainer and what it imports (accelerate's backends
# included), so what follows is the tokenized data (+0.015), the model's files paged in (+0.01), the
# trainer's set-up (+0.01) and the steps' kernels' code, thread pools and workspaces (+0.02), the
# sizes on the tiny default (RSS at each phase, sampled). Measured 2026-11-29 on
# an Intel Xeon with AMX (2 cores, torch 2.13) as peak RSS - start RSS - the plan's modelled bytes
# of `python train.py trainer=smoke data.metric=null objective=O precision=fp32`: sft 0.054, dpo
# 0.056, grpo 0.055, kto 0.071 GiB (its KL rows, built as the trainer starts). The AMD EPYC box
# (no native bf16) measured as little: its checkpointing=auto bench of 2026-11-28 (bench/results/,
# fp32, the trainers already imported at the start) peaked 0.047 GiB under a plan made with 0.11.
CPU_PROCESS_AFTER_START_BYTES = int(0.06 * GiB)
# ... and on a CPU that computes bf16 natively (AVX512-BF16 / AMX), a bf16 run's oneDNN kernels and
# their scratch space (anonymous memory, mostly, from the first bf16 step): the same runs in bf16
# measured 0.054-0.072 GiB over their fp32 twins on the same start (sft 0.057, dpo 0.055, grpo 0.054,
# kto 0.072; plans 0.001 GiB apart), as the tiny default's smoke run did on 2026-11-26 (0.058). An
# upper figure: about half is oneDNN's primitive cache (the smoke run's growth in training fell from
# 0.048 to 0.026 GiB with ONEDNN_PRIMITIVE_CACHE_CAPACITY=0), which depends on the GEMMs' shapes:
# 64 rows a micro-batch (trainer.micro_batch_size=64) measured 0.022 over fp32, not 0.057.
CPU_NATIVE_BF16_KERNELS_BYTES = int(0.06 * GiB)
# torch's CUDA caching allocator: long-lived tensors waste little (512-byte rounding, 2 MiB / 20 MiB
# segments); the per-step tensors of varying size fragment segments. Rules of thumb: 1 % of static
# bytes, 15 % of the dynamic (per-step) bytes. GPUs only: a CPU run caches nothing (peaks.py). Planned
# alike with trainer.expandable_segments (the default) and without: its segments fragment less, by
# an amount no GPU has measured for us yet; the GPU suite records max_memory_reserved beside
# max_memory_allocated for every run, the figures that will set a fraction of its own.
ALLOCATOR_STATIC_FRACTION = 0.01
ALLOCATOR_DYNAMIC_FRACTION = 0.15
# The ladder aims for at least this much headroom on every device; a plan with less gets one.
HEADROOM_TARGET = 0.05
# bitsandbytes constants (bitsandbytes/functional.py, optim/optimizer.py, 0.50).
BNB_4BIT_BLOCKSIZE = 64
BNB_DQ_BLOCKSIZE = 256
BNB_4BIT_CODE_ELEMENTS = 16
BNB_DYNAMIC_CODE_ELEMENTS = 256
BNB_MIN_8BIT_SIZE = 4096
BNB_OPTIM_BLOCKSIZE = 256
BNB_PAGED_MIN_ELEMENTS = 100_000
# TRL activation offloading (trl/models/activation_offloading.py, get_act_offloading_ctx_manager
# defaults): offloaded tensors the forward stash keeps alive on the GPU, and the smallest offloaded.
TRL_OFFLOAD_FWD_STASH = 5
TRL_OFFLOAD_MIN_BYTES = 1024
# transformers' bnb quantizers shrink max_memory by 10 % before placing layers (adjust_max_memory).
BNB_MAX_MEMORY_FACTOR = 0.90

DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")

# optim.name -> how the optimizer keeps state: the byte figures of components.py and single.py are
# keyed by the kind. The names are config/schema.py's OPTIMIZERS, the one list of accepted names
# (tests/unit/test_optimizer_figures.py keeps the two equal).
# bitsandbytes' optimizer step on a CPU (its torch fallback, one tensor at a time) makes fp32 copies and
# temporaries of the tensor it updates; its CUDA kernels update in place. Bytes per element of the tensor
# stepped, by (optimizer kind, bytes per trained element): measured as the RSS rise over opt.step() of a
# 12.8M-element tensor beside a small one (torch 2.13, bitsandbytes 0.50.2, 2-core AMX Xeon, 2026-11-29:
# 19.97-20.00 / 23.99 for 8-bit AdamW and paged AdamW, fp32 / bf16; 11.98 / 16.00 for paged AdamW 32-bit).
# A LoRA tensor makes it a few MiB; a trainable lm_head copy (peft.modules_to_save) hundreds.
BNB_CPU_STEP_BYTES = {
    ("adam8_bnb", 4): 20,
    ("adam8_bnb", 2): 24,
    ("adam8_bnb_paged", 4): 20,
    ("adam8_bnb_paged", 2): 24,
    ("adam32_bnb_paged", 4): 12,
    ("adam32_bnb_paged", 2): 16,
}
OPTIMIZERS = {
    "adamw_torch": "adam32_torch",
    "adamw_torch_fused": "adam32_torch_fused",
    "adamw_bnb_8bit": "adam8_bnb",
    "adamw_8bit": "adam8_bnb",
    "paged_adamw_8bit": "adam8_bnb_paged",
    "paged_adamw_32bit": "adam32_bnb_paged",
    "adafactor": "adafactor",
    "sgd": "sgd",
}
