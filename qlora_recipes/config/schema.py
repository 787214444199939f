"""Typed schemas for every config group, registered in Hydra's ConfigStore.

`conf/train.yaml` puts `train_schema` first in its defaults list, so every option file, recipe and
command-line override is merged onto these dataclasses in struct mode: a misspelled key fails with
a message that names it, and a value of the wrong type fails with the key and the expected type.

Each field carries its facts in metadata (config/fields.py `option`): help, and where they apply
the allowed choices, positivity, a range and resume-safety; config/checks.py and run/resume.py
derive their checks from them. Keys with a fixed set of values stay plain strings with `choices`
in metadata: OmegaConf 2.3 has no Literal, and Enum members would leak into config.yaml, plan.json
and the error messages.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from .attention import DEFAULT as ATTENTION_DEFAULT
from .fields import option
from .objectives import BUILTIN_REWARDS, DPO_LOSS_TYPES, OBJECTIVES

# The value sets of keys with a fixed set of values: the one list each, for the checks and the planner.
QUANT_METHODS = ("nf4", "fp4", "int8", "none")
PEFT_METHODS = ("lora", "dora", "rslora")
PACKING_STRATEGIES = ("bfd", "bfd_split", "wrapped")  # TRL 1.16 SFTConfig.packing_strategy
DATA_FORMATS = (
    "auto",
    "alpaca",
    "messages",
    "sharegpt",
    "prompt_completion",
    "text",
    "preference",
    "unpaired",
    "prompt",
)
STORAGE_DTYPES = ("uint8", "bfloat16", "float16", "float32")
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")  # short aliases (bf16, ...) accepted too
PRECISIONS = ("bf16", "fp16", "fp32")
# transformers `optim` strings the planner knows how to size (planner/constants) and transformers 5.23
# accepts (OptimizerNames); tests/unit/test_bad_input_gets_one_line.py keeps the two in step.
OPTIMIZERS = (
    "paged_adamw_8bit",
    "paged_adamw_32bit",
    "adamw_bnb_8bit",
    "adamw_8bit",
    "adamw_torch",
    "adamw_torch_fused",
    "adafactor",
    "sgd",
)
# transformers 5.23 SchedulerType (config/checks.py refuses the ones that need kwargs or an eval).
SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "reduce_lr_on_plateau",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
    "greedy",
)
# transformers 5.23 attention implementations (ALL_ATTENTION_FUNCTIONS and eager), each also with the
# old `paged|` prefix; `org/name` is a hub kernel, which only loading can check. auto and sdpa_varlen are
# ours (config/attention.py).
ATTENTION = (
    "auto",
    "eager",
    "sdpa",
    "sdpa_varlen",  # ours: model/packed_attention.py
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
    "paged|eager",
)
DIST_STRATEGIES = ("none", "ddp", "fsdp", "zero2", "zero3")
DIST_LAUNCHERS = ("accelerate", "torchrun")
FSDP_STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
FIGURE = "an architecture figure"  # the help of the figures a local config.json replaces
MODEL_FIGURES = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size")


@dataclass
class ModelConfig:
    # Figures describe the architecture so the planner can reason offline; a local config.json overrides them
    # (null or ???: unset, read from that config.json).
    name_or_path: str = option(MISSING, "where the weights are: a hub id or a local dir in the HF layout")
    hub_id: str | None = option(None, "the hub id of a local copy (model cards, the hub check)")
    architecture: str = option("llama", "the model family (llama, mistral, qwen2, gemma2, ...)")
    hidden_size: int | None = option(None, FIGURE, range=">= 1|null")
    num_layers: int | None = option(None, FIGURE, range=">= 1|null")
    num_heads: int | None = option(None, FIGURE, range=">= 1|null")
    num_kv_heads: int | None = option(None, FIGURE, range=">= 1|null")
    intermediate_size: int | None = option(None, FIGURE, range=">= 1|null")
    vocab_size: int | None = option(None, FIGURE, range=">= 1|null")
    tie_embeddings: bool = option(False, "lm_head shares the embedding matrix")
    head_dim: int | None = option(None, "null: hidden_size / num_heads", range=">= 1|null")
    max_position_embeddings: int = option(4096, "the model's context length", range=">= 1")
    trust_remote_code: bool = option(False, "run the model repo's own code (transformers trust_remote_code)")
    vision: bool | None = option(
        None,
        "a vision-language model (image rows, its processor, the vision tower unquantized); null: its config.json says",
    )
    # model/vision.py: what a vision-language model's tower (its largest part beside the language model) does
    vision_tower: str = option(
        "frozen",
        "a vision-language model's vision tower: frozen (unquantized in the compute dtype, untrained), quantized "
        "(its linears in quant's format, frozen) or lora (unquantized, LoRA on its linears too)",
        choices=("frozen", "quantized", "lora"),
    )
    revision: str | None = option(None, "a hub branch, tag or commit; null: main")
    # config/attention.py: the default resolves to sdpa, or sdpa_varlen / flash for padding-free batches
    attn_implementation: str = option(
        ATTENTION_DEFAULT,
        "transformers' attention implementation (or a hub kernel, org/name); auto: sdpa, or for padding-free / "
        "best-fit packed batches flash_attention_2 where flash-attn is installed, else sdpa_varlen (no dense mask)",
    )
    # Any, not a typed dict: OmegaConf cannot merge a command line's {...} into a null or struct dict
    rope_scaling: Any = option(
        None,
        "transformers' RoPE scaling, {rope_type: linear|dynamic|yarn|llama3, factor: > 1, ...}: "
        "positions past max_position_embeddings, up to it x factor; null: the model's own",
    )
    # config.json keys of a family's own layers for planning offline (planner/layers.family_figures)
    figures: Any = option(
        None,
        "config.json keys of the family's own layers: num_experts, num_experts_per_tok, moe_intermediate_size, "
        "shared_expert_intermediate_size, layer_types, sliding_window; a local config.json's win",
    )
    # a vision-language checkpoint's vision tower, planned offline (planner/figures.py carries it as JSON)
    vision_config: Any = option(
        None,
        "the checkpoint's config.json vision_config (a mapping): a vision-language model, its tower planned "
        "without a download; a local config.json's win",
    )
    # the learning rate this model size wants (QLoRA paper, Table 9)
    lora_lr: float = option(2e-4, "the default learning rate of this model", range="> 0")


@dataclass
class DataConfig:
    path: str = option(MISSING, ".jsonl/.json/.csv/.parquet file, a dataset dir, or a hub dataset name")
    format: str = option("auto", "the rows' format; auto detects it", choices=DATA_FORMATS)
    split: str = option("train", "the split of a hub dataset or dataset dir")
    eval_path: str | None = option(None, "a separate eval file; otherwise eval_fraction of path")
    eval_fraction: float = option(0.1, "the share of rows held out for eval", range="[0, 1)")
    eval_max_rows: int | None = option(
        2000, "the most rows eval_fraction holds out (the rest train); null: no cap", range=">= 1|null"
    )
    packing: bool = option(False, "pack several rows into each trainer.seq_len row")
    # TRL's, with packing (see padding_free_on)
    packing_strategy: str = option("bfd", "how rows are packed", choices=PACKING_STRATEGIES)
    padding_free: bool = option(False, "each micro-batch one flat row of real tokens, no pads (TRL padding_free)")
    completion_only_loss: bool = option(True, "loss on completions / assistant turns only")
    metric: str | None = option(
        None, "null: eval loss (and perplexity) only; exact_match: greedy generations vs references"
    )
    metric_examples: int = option(64, "eval rows the generation metric uses", range=">= 1", resume_safe=True)
    max_new_tokens: int = option(32, "tokens generated per eval row for the metric", positive=True, resume_safe=True)
    # null or "tokenizer" = the tokenizer's own template; a built-in name (data.chat.BUILTIN_TEMPLATES:
    # chatml, llama3, gemma, mistral); or a .jinja file.
    chat_template: str | None = option(None, "the chat template of chat data (messages, ShareGPT, chat prompts)")
    too_long: str = option(
        "truncate",
        "rows longer than trainer.seq_len: truncate (keep the first seq_len tokens) | drop",
        choices=("truncate", "drop"),
    )
    # image rows (data/image_bounds.py): each key maps onto one kind of transformers image processor
    image_max_pixels: int | None = option(
        None,
        "image rows: the most pixels the processor resizes an image to (Qwen-VL-style processors, their "
        "size.longest_edge); null: the processor's own",
        range=">= 1|null",
    )
    image_min_pixels: int | None = option(
        None,
        "image rows: the fewest pixels the processor resizes an image to (Qwen-VL-style processors, their "
        "size.shortest_edge); null: the processor's own",
        range=">= 1|null",
    )
    image_longest_edge: int | None = option(
        None,
        "image rows: the longest edge in pixels the processor resizes an image to (Idefics3, SmolVLM, Pixtral: "
        "size.longest_edge); null: the processor's own",
        range=">= 1|null",
    )
    # the plan counts them (planner/vision.py); auto: a run reads them from its rows, a plan without the data 1
    images_per_row: int | str = option("auto", "image rows: most images a row; auto: the rows' most", resume_safe=True)
    image_file_max_pixels: int = option(
        89_478_485,
        "image rows: the largest image (width x height) a row may hold; a larger one is refused (the default is "
        "PIL's own decompression-bomb bound)",
        range=">= 1",
    )


def padding_free_on(data: "DataConfig | Mapping") -> bool:
    """Whether TRL trains padding-free: `padding_free`, or packing with a best-fit strategy, which
    TRL 1.16 makes padding-free regardless (SFTTrainer.__init__: `args.padding_free or (args.packing
    and args.packing_strategy in {"bfd", "bfd_split"})`). A plain dict is read as one too."""
    node = data.get if isinstance(data, Mapping) else lambda key: getattr(data, key)
    best_fit = node("packing_strategy") in ("bfd", "bfd_split")
    return bool(node("padding_free")) or (bool(node("packing")) and best_fit)


@dataclass
class QuantConfig:
    method: str = option("nf4", "how the base is quantized", choices=QUANT_METHODS)
    double_quant: bool = option(True, "quantize the 4-bit absmax constants too (QLoRA's double quantization)")
    compute_dtype: str = option("${precision.dtype}", "the dtype 4-bit matmuls compute in")
    storage_dtype: str | None = option(
        "uint8",
        "bnb_4bit_quant_storage; set to the FSDP dtype under FSDP (null: the default, uint8, or the compute "
        "dtype under dist=fsdp|zero3)",
        choices=STORAGE_DTYPES,
    )
    int8_threshold: float = option(6.0, "LLM.int8's outlier threshold", range=">= 0")
    skip_modules: list[str] = option(list, "modules left unquantized (llm_int8_skip_modules)")
    # model/moe_experts.py: the fused 3-D expert weights, which bitsandbytes (nn.Linear only) would leave in 16 bits
    experts: str = option(
        "4bit",
        "MoE expert weights under quant.method=nf4|fp4: 4bit stores them in that format, dequantized one layer "
        "at a time; 16bit keeps them in the compute dtype (for comparison)",
        choices=("4bit", "16bit"),
    )


@dataclass
class PeftConfig:
    method: str = option("lora", "the adapter kind", choices=PEFT_METHODS)
    r: int = option(16, "the LoRA rank", positive=True, range=">= 1")
    alpha: int = option(32, "the LoRA scaling numerator (scale alpha / r)", positive=True)
    dropout: float = option(0.05, "the LoRA dropout probability", range="[0, 1)")
    target_modules: Any = option("all-linear", '"all-linear", a list of module names or a regular expression')
    modules_to_save: list[str] | None = option(None, "modules trained in full and saved with the adapter")
    # model/expert_lora.py: peft's target_parameters on the fused 3-D expert weights (4-bit ones included)
    experts: str = option(
        "lora",
        "MoE models: lora also adapts the fused expert weights (peft target_parameters, one low-rank update "
        "per expert, no dropout there); none adapts the linears only (attention, shared experts)",
        choices=("lora", "none"),
    )
    expert_r: int | None = option(
        None,
        "the LoRA rank of each expert under peft.experts=lora; null: max(1, r // num_experts), as peft's docs "
        "advise (the experts together then hold about what one rank-r linear does)",
        range=">= 1|null",
    )
    # config/adapters.py resolves auto: the planner for the precision it plans, a run once, before its plan
    adapter_dtype: str = option(
        "auto",
        "the trained tensors' dtype: auto is bfloat16 under bf16 compute with an 8-bit optimizer, LoRA or rsLoRA "
        "in one process (as TRL and the QLoRA paper train them; an 8B step 0.58 s against 0.67 s on an H200), "
        "else float32; float32 keeps master weights (updates below bf16's resolution are not lost), bfloat16 halves the "
        "adapters' weight and gradient memory",
        choices=("auto", "float32", "bfloat16"),
    )


@dataclass
class OptimConfig:
    name: str = option(
        "paged_adamw_8bit",
        "the transformers `optim` string",
        choices=OPTIMIZERS,
        choices_hint="(or pick the group: optim=paged8bit|adamw8bit|paged32bit|adamw|adafactor)",
    )
    # per model size unless set
    lr: float = option("${model.lora_lr}", "the learning rate", positive=True, range="> 0")
    scheduler: str = option("cosine", "the learning-rate schedule (transformers' SchedulerType)", choices=SCHEDULERS)
    warmup_ratio: float = option(0.03, "a fraction of the total steps", range="[0, 1)")
    warmup_steps: int = option(0, "steps of warmup; 0: use optim.warmup_ratio", range=">= 0")
    weight_decay: float = option(0.0, "the AdamW weight decay", range=">= 0")
    max_grad_norm: float = option(0.3, "the gradient-norm clipping threshold", range="> 0")
    beta1: float = option(0.9, "Adam's first-moment decay", range="[0, 1)")
    beta2: float = option(0.999, "Adam's second-moment decay", range="[0, 1)")


@dataclass
class OffloadConfig:
    device_map: str | None = option(
        None,
        "null: everything on one device (this rank's GPU, or the CPU without one); auto: accelerate places layers",
        choices=(None, "auto"),
    )
    # Key "gpu" means every visible GPU; "0", "1", ... name one GPU; "cpu" the host.
    max_memory: dict[str, str] = option(dict, "budgets passed to from_pretrained as max_memory")
    disk: bool = option(False, "let what overflows CPU RAM go to `folder` on disk")
    folder: str | None = option(None, "offload folder for layers placed on disk (relative: in the run dir)")
    # model/host_embeddings.py: the frozen table in host RAM, only the looked-up rows cross to the GPU
    embeddings: bool = option(
        False,
        "the input embeddings in host RAM, looked up there: only the rows a batch uses move to the GPU "
        "(CUDA GPU, one process or DDP, untied embeddings, not trained)",
    )


@dataclass
class PrecisionConfig:
    # conf/precision/auto.yaml (the default) resolves to bf16, fp16 or fp32 for the hardware
    # (config/devices.auto_precision), pinned by the loader before anything reads it.
    name: str = option("bf16", "the training precision", choices=PRECISIONS)
    dtype: str = option("bfloat16", "compute dtype and the dtype non-quantized weights load in")
    auto: bool = option(
        False,
        "precision=auto picked name and dtype for this machine; a plan for other GPUs picks again",
        resume_safe=True,
    )
    # No effect with quant=none or precision=fp32: they are in `dtype` already.
    upcast_frozen: bool = option(
        True,
        "a quantized base: true keeps prepare_model_for_kbit_training's fp32 copy of the frozen non-quantized "
        "params (embeddings, lm_head, norms); false keeps them in `dtype` (torchtune, unsloth)",
    )


def mlp_tile(trainer: "TrainerConfig", hidden_size: int) -> int:
    """Tokens per tile of trainer.tiled_mlp (0: off): trainer.tiled_mlp_tile, or hidden_size tokens
    (Snowflake's ALST: ceil(seqlen / hidden) shards). The loader and the planner both ask it."""
    if not trainer.tiled_mlp:
        return 0
    return int(trainer.tiled_mlp_tile) or max(1, int(hidden_size))


@dataclass
class TrainerConfig:
    # int | str: a number, or "auto" (planner/fastest.py), resolved by the plan before it is read
    micro_batch_size: int | str = option(
        4,
        "rows per forward/backward; auto: the largest that fits, trainer.grad_accum then read as the rows of one "
        "optimizer step per rank and split into micro-batch x accumulation (the effective batch kept)",
    )
    grad_accum: int = option(4, "micro-batches per optimizer step", positive=True)
    # int | str: a number, or "auto" (planner/evalbatch.py), resolved by the plan before it is read
    eval_batch_size: int | str = option(
        "auto",
        "rows per eval forward; auto: the most, up to 16, whose evaluation needs no more memory than training",
        resume_safe=True,
    )
    # int | str: a number, or "auto" (planner/seqlen.py), resolved before anything reads it as tokens
    seq_len: int | str = option(
        2048,
        "tokens per row (longer rows: data.too_long); auto: the train rows' longest, rounded up to a multiple "
        "of 64, capped by the model's positions and by what fits",
    )
    seq_len_percentile: float = option(
        100.0, "trainer.seq_len=auto covers this percentile of the train rows' token lengths", range="> 0"
    )
    # the total: on resume the LR schedule continues by continue_schedule's policy
    max_steps: int = option(-1, "-1 or 0: run trainer.epochs epochs", range=">= -1", resume_safe=True)
    epochs: float = option(
        1.0, "passes over the data; used when trainer.max_steps is -1", range=">= 0", resume_safe=True
    )
    # bool | int | str: all, none, the first N decoder layers, or "auto" (planner/fastest.py)
    gradient_checkpointing: bool | int | str = option(
        True,
        "recompute activations in backward instead of keeping them: true (every decoder layer), false, N (the "
        "first N decoder layers; the rest keep theirs), auto (the fewest layers that fit the card)",
        resume_safe=True,  # where activations wait for backward, not what is trained
    )
    checkpointing_mode: str = option(
        "non_reentrant", "torch's checkpoint variant", choices=("non_reentrant", "reentrant")
    )
    # where activations wait for backward, not what is trained
    activation_offloading: bool = option(
        False, "TRL: saved activations to pinned host RAM (CUDA only)", resume_safe=True
    )
    # how many offloaded layer inputs stay on the GPU while their copies to host RAM run
    activation_offload_stash: int = option(
        5,
        "trainer.activation_offloading: the newest offloaded tensors kept on the GPU while their copies run "
        "(TRL's 5 overlaps the most; 1 keeps only the one in flight: the least GPU memory)",
        range=">= 1",
        resume_safe=True,
    )
    # where offloaded activations wait in host RAM, not what is trained
    activation_offload_pinned: bool = option(
        True,
        "trainer.activation_offloading: host copies in pinned RAM (copies overlap compute; torch rounds each "
        "block up to a power of two). false: pageable RAM at exact size, copies not overlapped: for contexts "
        "whose offloaded activations outgrow host RAM",
        resume_safe=True,
    )
    # where the MLP's intermediates live, not what is trained (the same gradients, model/tiled_mlp.py)
    tiled_mlp: bool = option(
        False,
        "run each decoder layer's MLP over tiles of tokens in forward and backward (its intermediates for one "
        "tile at a time: long sequences); costs one more MLP forward per step",
        resume_safe=True,
    )
    tiled_mlp_tile: int = option(0, "tokens per tiled_mlp tile; 0: hidden_size tokens", range=">= 0", resume_safe=True)
    # what RMSNorm keeps for backward, not what is trained (the same gradients, model/lean_rmsnorm.py)
    lean_rmsnorm: bool = option(
        False,
        "RMSNorms keep their 16-bit input and recompute the fp32 pass in backward instead of keeping an fp32 "
        "copy (Llama, Mistral, Qwen2): less activation memory, a little more compute",
        resume_safe=True,
    )
    # how torch's CUDA allocator maps memory, not what is trained
    expandable_segments: bool = option(
        True,
        "CUDA: torch's caching allocator grows expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) "
        "instead of caching fixed-size blocks, so memory freed by one step's shapes serves the next step's; a "
        "PYTORCH_CUDA_ALLOC_CONF set in the environment is kept as it is",
        resume_safe=True,
    )
    liger: bool = option(False, "Liger kernels through TRL/transformers' use_liger_kernel (Triton: CUDA only)")
    logging_steps: int = option(10, "steps between logged losses", positive=True, resume_safe=True)
    eval_steps: int = option(0, "0: evaluate at the end only", range=">= 0", resume_safe=True)
    save_steps: int = option(0, "0: save the adapter at the end only, no checkpoints", range=">= 0", resume_safe=True)
    # plus the best by eval loss
    save_total_limit: int = option(2, "the newest checkpoints kept", range=">= 0", resume_safe=True)
    lm_eval_tasks: list[str] = option(list, "lm-eval-harness tasks run at the end, if installed")
    lm_eval_limit: int | None = option(None, "examples per lm-eval task; null: all", range=">= 1|null")
    memory_log_steps: int = option(
        10, "steps between memory samples", range=">= 1", resume_safe=True
    )  # memory.jsonl / TensorBoard memory scalars
    progress_bar: bool = option(True, "show the trainer's progress bar", resume_safe=True)


@dataclass
class ObjectiveConfig:
    # The `objective` group (config/objectives.py: the trainer, data kind and planner terms each name picks).
    # Keys one objective reads are null under the others (config/checks.py refuses them there).
    name: str = option("sft", "what the adapter is trained for: sft | dpo | kto | grpo", choices=tuple(OBJECTIVES))
    beta: float | None = option(
        None,
        "dpo, kto, grpo: how far the policy may move from the reference (TRL's beta; higher: closer; grpo: 0 = no "
        "reference forward)",
        range=">= 0|null",
    )
    loss_type: str | None = option(None, "dpo: TRL's loss", choices=(None, *DPO_LOSS_TYPES))
    precompute_ref_log_probs: bool | None = option(
        None, "dpo, kto: the reference's log-probs computed once before training (no reference forward per step)"
    )
    desirable_weight: float | None = option(
        None, "kto: weight of the desirable (label true) rows' losses, to balance unequal counts", range="> 0|null"
    )
    undesirable_weight: float | None = option(
        None, "kto: weight of the undesirable (label false) rows' losses", range="> 0|null"
    )
    sft_weight: float | None = option(
        None,
        "dpo: weight of an SFT term on the chosen answers beside the preference loss (TRL's loss_type sft; RPO); "
        "keeps the answers' likelihood, the EOS included, from falling",
        range=">= 0|null",
    )
    ref_adapter: bool | None = option(
        None, "dpo: the reference is init_from's adapter, frozen (false: the base with the adapter off)"
    )
    num_generations: int | None = option(
        None, "grpo: completions sampled per prompt (the group its advantages compare)", range=">= 2|null"
    )
    max_completion_length: int | None = option(None, "grpo: the most tokens a completion has", range=">= 1|null")
    temperature: float | None = option(None, "grpo: the sampling temperature of the completions", range="> 0|null")
    rewards: list[str] | None = option(
        None, f"grpo: reward functions, summed: built-ins ({', '.join(BUILTIN_REWARDS)}) or your module:function"
    )
    reward_timeout_s: float | None = option(
        None,
        "grpo: seconds one call of a reward may take; past it the run stops in one line naming the reward",
        range="> 0|null",
        resume_safe=True,
    )


@dataclass
class ResumeConfig:
    auto: bool = option(False, "continue from the newest complete checkpoint of this run dir")
    checkpoint: str | None = option(None, "or from this checkpoint dir")
    allow_changes: bool = option(False, "resume even when stack-changing keys differ from the saved run")


@dataclass
class HardwareConfig:
    # What a recipe is sized for, machine-readable: scripts/launch.py checks it before starting,
    # `make plan-<recipe>` and tests/unit/test_recipes_keep_their_promises.py plan for it. gpus=0: any machine (CPU is fine).
    name: str = option("any machine", "what the hardware is called in messages")
    gpus: int = option(0, "GPUs per node", range=">= 0")
    gpu_memory_gib: float | None = option(None, "each GPU's memory in GiB", range="> 0|null")  # torch's total_memory
    nodes: int = option(1, "nodes", range=">= 1")
    # the plan assumes it for offload and FSDP loading; SLURM's mem
    host_ram_gib: float | None = option(
        None, "host RAM in GiB; a run plans with the smaller of it and this machine's", range="> 0|null"
    )
    # precision=auto reads it: planning for GPUs (this node's, or `qlora plan --gpus` with no such node:
    # true) it picks bf16 when true, fp16 when false; on a machine it never picks bf16 when false.
    bf16: bool = option(True, "False for pre-Ampere GPUs (T4, V100): precision must be fp16")
    # wall time (hydra/launcher=slurm)
    timeout_min: int = option(1440, "minutes a scheduler grants the job", range=">= 1")


@dataclass
class DistConfig:
    # How ranks share the work (conf/dist): none = one process (or plain DDP under torchrun);
    # ddp = a full replica per GPU; fsdp = FSDP + QLoRA (sharded 4-bit storage);
    # zero2 / zero3 = DeepSpeed (needs `pip install deepspeed`, not in requirements.txt).
    strategy: str = option("none", "how ranks share the work", choices=DIST_STRATEGIES)
    launcher: str = option("accelerate", "how scripts/launch.py starts the ranks", choices=DIST_LAUNCHERS)
    accelerate_config: str | None = option(None, "launch/accelerate/*.yaml for `accelerate launch`")
    deepspeed_config: str | None = option(None, "launch/deepspeed/*.json (zero2 / zero3)")
    offload_params: bool = option(False, "FSDP: parameter shards live in host RAM (fsdp_offload_params)")
    load_on_cpu: bool = option(False, "each rank loads + quantizes the base in host RAM, then shards to its GPU")
    cpu_ram_efficient_loading: bool = option(True, "fsdp_cpu_ram_efficient_loading")
    state_dict_type: str = option(
        "SHARDED_STATE_DICT", "FSDP checkpoints (the adapter is gathered to save)"
    )  # checked against FSDP_STATE_DICT_TYPES with its own message (run/validate.py)


@dataclass
class TensorBoardLogger:
    enabled: bool = option(False, "scalars (losses, memory) to tb/ in the run dir: `tensorboard --logdir runs`")


@dataclass
class WandbLogger:
    enabled: bool = option(False, "report to Weights & Biases")
    # Offline runs land in RUN/wandb/ (`wandb sync RUN/wandb/offline-run-*` uploads them later).
    mode: str | None = option(
        None, "online | offline | disabled; null: wandb's own choice (WANDB_MODE, `wandb offline`, else online)"
    )
    entity: str | None = option(None, "team or user; null: the login's default")


@dataclass
class MlflowLogger:
    enabled: bool = option(False, "report to MLflow")
    tracking_uri: str | None = option(
        None,
        "null: MLFLOW_TRACKING_URI when set, else a file store in the run dir "
        "(RUN/mlruns: `mlflow ui --backend-store-uri RUN/mlruns`)",
    )


@dataclass
class TrackioLogger:
    enabled: bool = option(False, "local: trackio's own store (TRACKIO_DIR, else HF_HOME/trackio): `trackio show`")


@dataclass
class LoggerConfig:
    # The `logger` group: one or several trackers at once (`logger=[tensorboard,wandb]`), each option
    # file switching its backend on. TensorBoard writes tb/ itself; the others are the trainer's report_to.
    tensorboard: TensorBoardLogger = option(TensorBoardLogger, "TensorBoard scalars")
    wandb: WandbLogger = option(WandbLogger, "Weights & Biases")
    mlflow: MlflowLogger = option(MlflowLogger, "MLflow")
    trackio: TrackioLogger = option(TrackioLogger, "trackio")
    project: str = option("qlora-recipes", "the W&B project, the MLflow experiment and the trackio project")
    run_name: str | None = option(None, 'null: the run dir and its overrides, e.g. "2026-01-31/12-00-00 peft.r=8"')


@dataclass
class HubConfig:
    # The token comes from HF_TOKEN or `hf auth login`, never from the config: nothing secret is written anywhere.
    push: bool = option(False, "push the adapter (with its model card) to the Hugging Face Hub after training")
    repo_id: str | None = option(None, '"user/name" or "org/name"; created when missing')
    private: bool | None = option(None, "null: the hub's default for a new repo (an existing repo keeps its own)")
    revision: str | None = option(None, "a branch to commit to (created from main when missing); null: main")


@dataclass
class TrainConfig:
    model: ModelConfig = option(ModelConfig, "the base model and its architecture figures")
    data: DataConfig = option(DataConfig, "the training (and eval) data")
    quant: QuantConfig = option(QuantConfig, "how the base is quantized")
    peft: PeftConfig = option(PeftConfig, "the adapter")
    optim: OptimConfig = option(OptimConfig, "the optimizer and learning-rate schedule")
    offload: OffloadConfig = option(OffloadConfig, "where layers go when the GPU is too small", resume_safe=True)
    precision: PrecisionConfig = option(PrecisionConfig, "the compute dtype")
    trainer: TrainerConfig = option(TrainerConfig, "batch, length, steps, checkpointing, logging")
    objective: ObjectiveConfig = option(ObjectiveConfig, "what the adapter is trained for (sft, dpo, kto)")
    resume: ResumeConfig = option(ResumeConfig, "continuing a run", resume_safe=True)
    hardware: HardwareConfig = option(HardwareConfig, "what a recipe is sized for")
    dist: DistConfig = option(DistConfig, "how ranks share the work")
    # where metrics are reported, not what is trained
    logger: LoggerConfig = option(LoggerConfig, "the trackers", resume_safe=True)
    # whether the finished adapter is pushed
    hub: HubConfig = option(HubConfig, "pushing the adapter to the Hugging Face Hub", resume_safe=True)
    # a stage: this run's adapter starts as a finished run's (SFT -> DPO), run/stages.py checks it
    init_from: str | None = option(None, "a finished run dir whose adapter this run starts from (SFT -> DPO)")
    seed: int = option(0, "the random seed (numpy takes 0 .. 2**32 - 1)", range="[0, 4294967296)")
    force: bool = option(False, "start even when the memory plan says the stack does not fit", resume_safe=True)
    # a run dir holding a run (adapter/, checkpoints, metrics.json) is never reused silently (run/reuse.py)
    overwrite: bool = option(
        False,
        "replace the run the run dir already holds (its adapter, checkpoints, metrics); resume=auto continues it",
        resume_safe=True,
    )
    cache_dir: str = option(
        "${oc.env:QLORA_RECIPES_CACHE,${oc.env:HOME}/.cache/qlora-recipes}",
        "where tokenized data is cached",
        resume_safe=True,
    )
