"""Typed schemas for every config group, registered in Hydra's ConfigStore.

`conf/train.yaml` puts `train_schema` first in its defaults list, so every option file, recipe and
command-line override is merged onto these dataclasses in struct mode: a misspelled key fails with
a message that names it, and a value of the wrong type fails with the key and the expected type.
"""

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from .devices import auto_precision_value
from .resources import shipped_path
from .units import cfg_get


@dataclass
class ModelConfig:
    # Where the weights are: a hub id or a local dir in the HF layout. Figures below describe the
    # architecture so the planner can reason offline; a local config.json overrides them.
    name_or_path: str = MISSING
    hub_id: str | None = None
    architecture: str = "llama"
    hidden_size: int = MISSING
    num_layers: int = MISSING
    num_heads: int = MISSING
    num_kv_heads: int = MISSING
    intermediate_size: int = MISSING
    vocab_size: int = MISSING
    tie_embeddings: bool = False
    head_dim: int | None = None
    max_position_embeddings: int = 4096
    trust_remote_code: bool = False
    revision: str | None = None
    attn_implementation: str = "sdpa"
    lora_lr: float = 2e-4  # learning rate this model size wants (QLoRA paper, Table 9)


@dataclass
class DataConfig:
    path: str = MISSING  # .jsonl/.json/.csv/.parquet file, a dataset dir, or a hub dataset name
    format: str = "auto"  # auto | alpaca | messages | prompt_completion | text
    split: str = "train"  # for hub datasets and dataset dirs
    eval_path: str | None = None  # a separate eval file; otherwise eval_fraction of path
    eval_fraction: float = 0.1
    packing: bool = False
    packing_strategy: str = "bfd"  # TRL's, with packing: bfd | bfd_split | wrapped (see padding_free_on)
    padding_free: bool = False  # each micro-batch one flat row of real tokens, no pads (TRL padding_free)
    completion_only_loss: bool = True  # loss on completions / assistant turns only
    metric: str | None = None  # null: eval loss (and perplexity) only; exact_match: greedy generations vs references
    metric_examples: int = 64  # eval rows used for the generation metric
    max_new_tokens: int = 32
    # Chat data (messages, ShareGPT, chat prompt/completion): null or "tokenizer" = the tokenizer's own
    # template; a built-in name (data.chat.BUILTIN_TEMPLATES: chatml, llama3, gemma, mistral); or a .jinja file.
    chat_template: str | None = None
    too_long: str = "truncate"  # rows longer than trainer.seq_len: truncate (keep the first seq_len tokens) | drop


# The options of keys with a fixed set of values; validate.py and the planner both check against these.
QUANT_METHODS = ("nf4", "fp4", "int8", "none")
PEFT_METHODS = ("lora", "dora", "rslora")
PACKING_STRATEGIES = ("bfd", "bfd_split", "wrapped")  # TRL 1.16 SFTConfig.packing_strategy


def padding_free_on(data: Any) -> bool:
    """Whether TRL trains padding-free: `padding_free`, or packing with a best-fit strategy, which
    TRL 1.16 makes padding-free regardless (SFTTrainer.__init__: `args.padding_free or (args.packing
    and args.packing_strategy in {"bfd", "bfd_split"})`)."""
    packing = bool(cfg_get(data, "packing", False))
    best_fit = cfg_get(data, "packing_strategy", "bfd") in ("bfd", "bfd_split")
    return bool(cfg_get(data, "padding_free", False)) or (packing and best_fit)


@dataclass
class QuantConfig:
    method: str = "nf4"  # nf4 | fp4 | int8 | none
    double_quant: bool = True
    compute_dtype: str = "${precision.dtype}"
    storage_dtype: str = "uint8"  # bnb_4bit_quant_storage; set to the FSDP dtype under FSDP
    int8_threshold: float = 6.0
    skip_modules: list[str] = field(default_factory=list)


@dataclass
class PeftConfig:
    method: str = "lora"  # lora | dora | rslora
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: Any = "all-linear"  # "all-linear" or a list of module names
    modules_to_save: list[str] | None = None


@dataclass
class OptimConfig:
    name: str = "paged_adamw_8bit"  # the transformers `optim` string
    lr: float = "${model.lora_lr}"  # type: ignore[assignment]  # per model size unless set
    scheduler: str = "cosine"
    warmup_ratio: float = 0.03  # a fraction of the total steps, in [0, 1)
    warmup_steps: int = 0  # a number of warmup steps; when > 0 it is used instead of warmup_ratio
    weight_decay: float = 0.0
    max_grad_norm: float = 0.3
    beta1: float = 0.9
    beta2: float = 0.999


@dataclass
class OffloadConfig:
    # device_map null: everything on one device (this rank's GPU, or the CPU without one).
    device_map: str | None = None
    # Budgets passed to from_pretrained as max_memory. Key "gpu" means every visible GPU;
    # "0", "1", ... name one GPU; "cpu" the host.
    max_memory: dict[str, str] = field(default_factory=dict)
    disk: bool = False  # let what overflows CPU RAM go to `folder` on disk
    folder: str | None = None  # offload folder for layers placed on disk (relative: in the run dir)


@dataclass
class PrecisionConfig:
    # bf16 | fp16 | fp32; precision=auto (the default) picks one of them for the hardware
    # (devices.auto_precision) before anything reads it, and the run says in one line which and why.
    name: str = "bf16"
    dtype: str = "bfloat16"  # compute dtype and the dtype non-quantized weights load in
    # A quantized base: true keeps prepare_model_for_kbit_training's fp32 copy of the frozen
    # non-quantized params (embeddings, lm_head, norms); false keeps them in `dtype` (torchtune,
    # unsloth). No effect with quant=none or precision=fp32: they are in `dtype` already.
    upcast_frozen: bool = True


@dataclass
class TrainerConfig:
    micro_batch_size: int = 4
    grad_accum: int = 4
    eval_batch_size: int = 16
    seq_len: int = 2048
    max_steps: int = -1  # -1: run `epochs` epochs
    epochs: float = 1.0
    gradient_checkpointing: bool = True
    checkpointing_mode: str = "non_reentrant"  # non_reentrant | reentrant
    activation_offloading: bool = False  # TRL: saved activations to pinned host RAM (CUDA only)
    liger: bool = False  # Liger kernels through TRL/transformers' use_liger_kernel (Triton: CUDA only)
    logging_steps: int = 10
    eval_steps: int = 0  # 0: evaluate at the end only
    save_steps: int = 0  # 0: save the adapter at the end only
    save_total_limit: int = 2  # the newest K checkpoints, plus the best by eval loss
    lm_eval_tasks: list[str] = field(default_factory=list)  # lm-eval-harness tasks run at the end, if installed
    lm_eval_limit: int | None = None  # examples per lm-eval task (None: all)
    memory_log_steps: int = 10  # memory.jsonl / TensorBoard memory scalars every N steps
    progress_bar: bool = True


@dataclass
class ResumeConfig:
    auto: bool = False  # continue from the newest complete checkpoint of this run dir
    checkpoint: str | None = None  # or from this checkpoint dir
    allow_changes: bool = False  # resume even when stack-changing keys differ from the saved run


@dataclass
class HardwareConfig:
    # What a recipe is sized for, machine-readable: scripts/launch.py checks it before starting,
    # `make plan-<recipe>` and tests/test_recipes.py plan for it. gpus=0: any machine (CPU is fine).
    name: str = "any machine"
    gpus: int = 0  # GPUs per node
    gpu_memory_gib: float | None = None  # usable memory of each GPU (torch's total_memory), GiB
    nodes: int = 1
    host_ram_gib: int | None = None  # host RAM the plan assumes (offload, FSDP loading); SLURM mem
    # False for pre-Ampere GPUs (T4, V100): precision must be fp16. precision=auto reads it: planning
    # for GPUs (this node's, or `qlora plan --gpus` with no such node: true) it picks bf16 when true,
    # fp16 when false; on a machine it never picks bf16 when false.
    bf16: bool = True
    timeout_min: int = 1440  # wall time a scheduler grants the job (hydra/launcher=slurm)


@dataclass
class DistConfig:
    # How ranks share the work (conf/dist): none = one process (or plain DDP under torchrun);
    # ddp = a full replica per GPU; fsdp = FSDP + QLoRA (sharded 4-bit storage);
    # zero2 / zero3 = DeepSpeed (needs `pip install deepspeed`, not in requirements.txt).
    strategy: str = "none"
    launcher: str = "accelerate"  # accelerate | torchrun: how scripts/launch.py starts the ranks
    accelerate_config: str | None = None  # launch/accelerate/*.yaml for `accelerate launch`
    deepspeed_config: str | None = None  # launch/deepspeed/*.json (zero2 / zero3)
    offload_params: bool = False  # FSDP: parameter shards live in host RAM (fsdp_offload_params)
    load_on_cpu: bool = False  # each rank loads + quantizes the base in host RAM, then shards to its GPU
    cpu_ram_efficient_loading: bool = True  # fsdp_cpu_ram_efficient_loading
    state_dict_type: str = "SHARDED_STATE_DICT"  # FSDP checkpoints (the adapter is gathered to save)


@dataclass
class TensorBoardLogger:
    enabled: bool = False  # scalars (losses, memory) to tb/ in the run dir: `tensorboard --logdir runs`


@dataclass
class WandbLogger:
    enabled: bool = False
    # online | offline | disabled; null: wandb's own choice (WANDB_MODE, `wandb offline`, else online).
    # Offline runs land in RUN/wandb/ (`wandb sync RUN/wandb/offline-run-*` uploads them later).
    mode: str | None = None
    entity: str | None = None  # team or user; null: the login's default


@dataclass
class MlflowLogger:
    enabled: bool = False
    # null: MLFLOW_TRACKING_URI when set, else a file store in the run dir (RUN/mlruns:
    # `mlflow ui --backend-store-uri RUN/mlruns`)
    tracking_uri: str | None = None


@dataclass
class TrackioLogger:
    enabled: bool = False  # local: trackio's own store (TRACKIO_DIR, else HF_HOME/trackio): `trackio show`


@dataclass
class LoggerConfig:
    # The `logger` group: one or several trackers at once (`logger=[tensorboard,wandb]`), each option
    # file switching its backend on. TensorBoard writes tb/ itself; the others are the trainer's report_to.
    tensorboard: TensorBoardLogger = field(default_factory=TensorBoardLogger)
    wandb: WandbLogger = field(default_factory=WandbLogger)
    mlflow: MlflowLogger = field(default_factory=MlflowLogger)
    trackio: TrackioLogger = field(default_factory=TrackioLogger)
    project: str = "qlora-recipes"  # the W&B project, the MLflow experiment and the trackio project
    run_name: str | None = None  # null: the run dir and its overrides, e.g. "2026-01-31/12-00-00 peft.r=8"


@dataclass
class HubConfig:
    # Push the adapter (with its model card) to the Hugging Face Hub after training. The token comes
    # from HF_TOKEN or `hf auth login`, never from the config: nothing secret is written anywhere.
    push: bool = False
    repo_id: str | None = None  # "user/name" or "org/name"; created when missing
    private: bool | None = None  # null: the hub's default for a new repo (an existing repo keeps its own)
    revision: str | None = None  # a branch to commit to (created from main when missing); null: main


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    hub: HubConfig = field(default_factory=HubConfig)
    seed: int = 0
    force: bool = False  # start even when the memory plan says the stack does not fit
    cache_dir: str = "${oc.env:QLORA_RECIPES_CACHE,${oc.env:HOME}/.cache/qlora-recipes}"


def register_schemas() -> None:
    """Register the schema and the resolvers: `${shipped:rel/path}` (shipped files, from any cwd),
    `${if_data_path:...}` and `${auto_precision:...}` (precision=auto on this machine)."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    if not OmegaConf.has_resolver("shipped"):
        OmegaConf.register_new_resolver("shipped", shipped_path)
    if not OmegaConf.has_resolver("if_data_path"):
        OmegaConf.register_new_resolver("if_data_path", if_data_path)
    if not OmegaConf.has_resolver("auto_precision"):  # conf/precision/auto.yaml
        OmegaConf.register_new_resolver("auto_precision", auto_precision_value)


def if_data_path(path: str, value: Any, otherwise: Any = None, *, _parent_: Any) -> Any:
    """`${if_data_path:PATH,VALUE[,OTHERWISE]}` in a data option file: VALUE while the data node's `path` is
    PATH, OTHERWISE (default null) once `data.path=...` points elsewhere. conf/data/order.yaml ties the
    shipped sample's eval file, metric and generation length to the sample this way, so a user's own
    `data.path` starts from the generic defaults instead of inheriting them."""
    from pathlib import Path

    current = cfg_get(_parent_, "path")
    if current is None:
        return otherwise
    if str(current) == str(path):
        return value
    a, b = Path(str(current)).expanduser(), Path(str(path)).expanduser()
    same = a.exists() and b.exists() and a.resolve() == b.resolve()
    return value if same else otherwise


def compose(overrides: list[str]):
    """The config `qlora train` would compose for these overrides, outside a Hydra run (launch,
    bench, tests). Hydra's composition errors become one UserError line."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from .cli import one_line
    from .errors import UserError
    from .resources import CONF_DIR

    register_schemas()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return hydra_compose(config_name="train", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        raise UserError(one_line(err)) from None
