"""The checks a typed config passes on its own: no devices, no files, no packages (run/validate.py adds
those). `check_stack(cfg)` is what `qlora train` and `qlora plan` both run; each failure is one
UserError line.

The tables come from the schema's field metadata (config/fields.py): CHOICES, POSITIVE, RANGES.
"""

from __future__ import annotations

import re

from ..errors import UserError
from ..families import FAMILIES, traits
from ..units import PRECISION_DTYPE, dtype_name
from .adapters import BF16_ADAPTER_OPTIMS
from .fields import keys, range_ok, values
from .objectives import BUILTIN_REWARDS, OBJECTIVES
from .schema import ATTENTION, COMPUTE_DTYPES, TrainConfig, TrainerConfig

CHOICES = {key: f.metadata["choices"] for key, f in keys(TrainConfig) if "choices" in f.metadata}
POSITIVE = tuple(key for key, f in keys(TrainConfig) if f.metadata.get("positive"))
# Every other numeric key: its range and, for the message, what it means (the field's help).
RANGES = {key: (f.metadata["range"], f.metadata["help"]) for key, f in keys(TrainConfig) if "range" in f.metadata}

# The three in SCHEDULER_KWARGS need lr_scheduler_kwargs this repository does not pass, the two in
# SCHEDULER_EVAL an eval strategy (TrainingArguments checks).
SCHEDULER_KWARGS = {
    "cosine_with_min_lr": "min_lr",
    "cosine_warmup_with_min_lr": "min_lr",
    "warmup_stable_decay": "num_decay_steps",
}
SCHEDULER_EVAL = ("reduce_lr_on_plateau", "greedy")


def check_stack(cfg: TrainConfig) -> None:
    """Every check that needs only the typed config, in the order `qlora train` has always run them."""
    for key, f, value in values(cfg):
        allowed = f.metadata.get("choices")
        if allowed is not None and value not in allowed:
            names = ", ".join(str(a) for a in allowed)
            hint = f" {f.metadata['choices_hint']}" if "choices_hint" in f.metadata else ""
            raise UserError(f"{key}={value} is not an option; choose one of: {names}{hint}")
    _check_seq_len(cfg.trainer)
    _check_images_per_row(cfg.data.images_per_row)
    _check_batch_and_checkpointing(cfg.trainer)
    for key, f, value in values(cfg):
        if f.metadata.get("positive") and (value is None or value <= 0):
            raise UserError(f"{key}={value} must be positive")
    t = cfg.trainer
    if t.max_steps <= 0 and t.epochs <= 0:
        raise UserError("trainer.max_steps and trainer.epochs are both <= 0: set one of them")
    if not 0 <= cfg.peft.dropout < 1:
        raise UserError(f"peft.dropout={cfg.peft.dropout} must be in [0, 1)")
    if not 0 <= cfg.data.eval_fraction < 1:
        raise UserError(f"data.eval_fraction={cfg.data.eval_fraction} must be in [0, 1)")
    if cfg.data.metric not in (None, "exact_match"):
        raise UserError(f"data.metric={cfg.data.metric} is not a metric; use exact_match, or null for eval loss only")
    check_ranges(cfg)
    check_objective(cfg)
    _check_values(cfg)
    _check_combinations(cfg)
    check_precision(cfg)
    _check_placement(cfg)
    check_hardware(cfg)


SHARDED_STRATEGIES = ("fsdp", "zero3")  # the strategies that shard the base weights themselves


def _check_sharded_quant(cfg: TrainConfig) -> None:
    """What FSDP / ZeRO-3 can shard: never an int8 base; a 4-bit one only stored in the compute dtype.
    Config-only, so `qlora plan` refuses what train and launch refuse."""
    s, q, dtype = cfg.dist.strategy, cfg.quant, cfg.precision.dtype
    if s not in SHARDED_STRATEGIES:
        return
    if q.method == "int8":
        # FSDP: "Must flatten tensors with uniform dtype but got torch.float16 and torch.int8"
        # (bitsandbytes issue 1709); ZeRO-3 cannot partition Int8Params (bigcode starcoder issue 96).
        raise UserError(
            f"dist={s} cannot shard an int8 (LLM.int8) base; use quant=nf4 with quant.storage_dtype={dtype}"
        )
    if q.method in ("nf4", "fp4") and q.storage_dtype != dtype:
        # FSDP shards only floating tensors of one dtype per unit: uint8 storage fails ("Cannot
        # flatten integer dtype tensors", peft issue 1432; bitsandbytes PR 970) or, under FSDP2,
        # is silently left unsharded on every rank (accelerate issue 3983); a float storage of
        # another dtype fails to flatten with the rest (transformers PR 29587 sets the mixed
        # precision policy from bnb_4bit_quant_storage). ZeRO-3 + QLoRA needs the same
        # (peft docs, "Use PEFT QLoRA and DeepSpeed with ZeRO3").
        raise UserError(
            f"dist={s} with a 4-bit base needs quant.storage_dtype={dtype} (the compute dtype), "
            f"not {q.storage_dtype}: set quant.storage_dtype={dtype}"
        )


def _check_seq_len(t: TrainerConfig) -> None:
    """trainer.seq_len: a positive number of tokens, or auto (planner/seqlen.py resolves it from the data);
    trainer.eval_batch_size: a positive number of rows, or auto (planner/evalbatch.py)."""
    value = t.seq_len
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise UserError(f"trainer.seq_len={value} must be a positive number of tokens, or auto (from the data)")
    rows = t.eval_batch_size
    if rows != "auto" and (isinstance(rows, bool) or not isinstance(rows, int) or rows <= 0):
        raise UserError(f"trainer.eval_batch_size={rows} must be a positive number of rows, or auto (from the plan)")
    if not 0 < t.seq_len_percentile <= 100:
        raise UserError(f"trainer.seq_len_percentile={t.seq_len_percentile} must be in (0, 100]; 100: the longest row")


def _check_images_per_row(value) -> None:
    """data.images_per_row: a whole number of images, 1 or more, or auto (planner/vision.py reads the data)."""
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise UserError(
            f"data.images_per_row={value} must be a whole number of images a row, 1 or more, or auto (the most "
            "any row of the data holds)"
        )


def _check_batch_and_checkpointing(t: TrainerConfig) -> None:
    """trainer.micro_batch_size: a positive number of rows, or auto; trainer.gradient_checkpointing: true,
    false, a number of decoder layers >= 0, or auto (planner/fastest.py resolves both from the plan)."""
    mb = t.micro_batch_size
    if mb != "auto" and (isinstance(mb, bool) or not isinstance(mb, int) or mb <= 0):
        raise UserError(f"trainer.micro_batch_size={mb} must be a positive number of rows, or auto (from the plan)")
    gc = t.gradient_checkpointing
    if not isinstance(gc, bool) and gc != "auto" and (not isinstance(gc, int) or gc < 0):
        raise UserError(
            f"trainer.gradient_checkpointing={gc} must be true, false, a number of decoder layers (0 or more) "
            "or auto (the fewest that fit)"
        )


def check_ranges(cfg: TrainConfig) -> None:
    """Each numeric key with a `range` in its metadata, within it."""
    for key, f, value in values(cfg):
        rule = f.metadata.get("range")
        if rule is None or range_ok(value, rule):
            continue
        bound, _, nullable = rule.partition("|")
        want = f"in {bound}" if bound.startswith("[") else bound
        hint = ""
        if key == "optim.warmup_ratio" and isinstance(value, (int, float)) and value >= 1:
            hint = f"; for {int(value)} warmup steps set optim.warmup_steps={int(value)} instead"
        elif key == "optim.max_grad_norm":
            hint = "; a large value such as 1e9 turns clipping off"
        meaning = f.metadata["help"]
        raise UserError(f"{key}={value} must be {want}{' or null' if nullable else ''} ({meaning}){hint}")


def check_objective(cfg: TrainConfig) -> None:
    """An objective.* key another objective reads, set under this one: one line naming both."""
    o = cfg.objective
    own = OBJECTIVES[o.name].keys
    for name, row in OBJECTIVES.items():
        for key in row.keys:
            if key not in own and getattr(o, key) is not None:
                raise UserError(
                    f"objective.{key}={getattr(o, key)} only applies to objective={name}, not objective={o.name}; "
                    f"drop it or train with objective={name}"
                )
    if o.name != "sft" and (cfg.data.packing or cfg.data.padding_free):
        key = "data.packing" if cfg.data.packing else "data.padding_free"
        raise UserError(
            f"{key}=true does not apply to objective={o.name}: TRL pads each pair's sequences (its padding-free "
            f"path is off since its refactor); drop {key}"
        )
    mb = cfg.trainer.micro_batch_size
    if OBJECTIVES[o.name].kl_batch and isinstance(mb, int) and mb < 2:
        raise UserError(
            f"trainer.micro_batch_size={mb} is too small for objective={o.name}: its KL estimate pairs each prompt "
            "with another row's completion of the same micro-batch; set trainer.micro_batch_size=2 or more"
        )
    for key in own:
        if getattr(o, key) is None:
            raise UserError(f"objective={o.name} needs objective.{key}; pick the group (objective={o.name}) or set it")
    if o.ref_adapter and not cfg.init_from:
        raise UserError(
            "objective.ref_adapter=true needs init_from=<a finished run dir>: the reference is that earlier stage's "
            "adapter; without one the adapter starts as the base, which is the default reference (drop ref_adapter)"
        )
    if o.name in ("dpo", "kto") and o.beta == 0:
        raise UserError(
            f"objective.beta=0 leaves {o.name.upper()} no reference to move from; set objective.beta > 0 (e.g. 0.1)"
        )
    if o.name == "grpo":
        check_grpo(cfg)


def check_grpo(cfg: TrainConfig) -> None:
    """GRPO's generation batch holds whole groups (TRL 1.16 GRPOConfig: micro_batch_size x grad_accum
    completions, num_generations per prompt), and its rewards are built-ins or module:function names."""
    o, t = cfg.objective, cfg.trainer
    if t.micro_batch_size == "auto":  # its generation batch must stay whole groups: the user sizes it
        raise UserError(
            "trainer.micro_batch_size=auto does not apply to objective=grpo (its generation batch holds whole "
            "groups of num_generations); set a number"
        )
    batch = t.micro_batch_size * t.grad_accum
    if batch % o.num_generations:
        raise UserError(
            f"objective.num_generations={o.num_generations} does not divide the generation batch of {batch} "
            f"completions (trainer.micro_batch_size={t.micro_batch_size} x trainer.grad_accum={t.grad_accum}); "
            f"make the batch a multiple of it or pick num_generations among its divisors"
        )
    if t.activation_offloading:
        raise UserError(
            "trainer.activation_offloading=true does not apply to objective=grpo (TRL's GRPOTrainer has no such path); drop it"
        )
    if not o.rewards:
        raise UserError(
            f"objective.rewards is empty; name at least one, e.g. [{BUILTIN_REWARDS[0]}] (docs/objectives.md)"
        )
    for name in o.rewards:
        if name not in BUILTIN_REWARDS and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", str(name)):
            raise UserError(
                f"objective.rewards: {name!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) nor "
                "module:function (a function of your own module, e.g. my_rewards:length_penalty)"
            )


def check_precision(cfg: TrainConfig) -> None:
    p = cfg.precision
    if PRECISION_DTYPE[p.name] != p.dtype:
        raise UserError(
            f"precision.dtype={p.dtype} contradicts precision={p.name}; pick precision=bf16|fp16|fp32 instead"
        )


def _check_host_embeddings(cfg: TrainConfig) -> None:
    """offload.embeddings keeps a frozen table in host RAM on a one-device model."""
    if not cfg.offload.embeddings:
        return
    if cfg.offload.device_map is not None:
        raise UserError(
            "offload.embeddings=true with offload=cpu|disk: accelerate places the embeddings already; use one or the other"
        )
    if cfg.dist.strategy in ("fsdp", "zero3"):
        raise UserError(
            f"offload.embeddings=true cannot run under dist={cfg.dist.strategy} (it shards the table itself); drop it"
        )
    trained = [m for m in (cfg.peft.modules_to_save or []) if "embed" in str(m)]
    if "embed" in str(cfg.peft.target_modules):
        trained.append(f"an adapter on {cfg.peft.target_modules}")
    if trained:
        raise UserError(
            f"offload.embeddings=true keeps the input embeddings frozen in host RAM, but peft.modules_to_save "
            f"trains {trained[0]}: drop one of them"
        )


def _check_placement(cfg: TrainConfig) -> None:
    """Offload settings and method pairs that cannot work whatever the machine."""
    o = cfg.offload
    if o.device_map == "auto" and not o.max_memory:
        raise UserError("offload.device_map=auto without offload.max_memory: use offload=cpu or set budgets")
    if o.disk and not o.folder:
        raise UserError(
            "offload=disk needs an offload folder: set offload.folder=PATH (relative paths land in the run dir)"
        )
    if o.disk and o.device_map != "auto":
        raise UserError("offload=disk needs offload.device_map=auto so accelerate can place layers on disk")
    _check_host_embeddings(cfg)
    if cfg.peft.method == "dora" and cfg.quant.method == "int8":
        # peft's DoRA weight norm needs the dequantized base; with LLM.int8 layers bitsandbytes
        # 0.50 fails in MatMul8bitFp (seen on CPU): a traceback after minutes of loading.
        raise UserError(
            "peft=dora does not work over quant=int8 (bitsandbytes 8-bit matmul fails); use quant=nf4 or peft=lora"
        )
    # dist=fsdp / zero3 set quant.storage_dtype to the compute dtype for a 4-bit base they shard; with no
    # 4-bit weights that setting is moot, not the user's mistake
    set_by_dist = cfg.dist.strategy in SHARDED_STRATEGIES and cfg.quant.storage_dtype == cfg.precision.dtype
    if cfg.quant.method == "none" and cfg.quant.storage_dtype not in ("uint8", None) and not set_by_dist:
        raise UserError("quant.storage_dtype only applies to 4-bit quantization; drop it or use quant=nf4")
    _check_sharded_quant(cfg)


def check_hardware(cfg: TrainConfig) -> None:
    """The `hardware` node a recipe declares, and the precision it allows."""
    hw = cfg.hardware
    if hw.gpus < 0 or hw.nodes < 1 or hw.timeout_min <= 0:
        raise UserError(
            f"hardware: gpus={hw.gpus}, nodes={hw.nodes}, timeout_min={hw.timeout_min}; "
            "need gpus >= 0 (per node), nodes >= 1, timeout_min > 0"
        )
    if hw.gpus > 0 and not (hw.gpu_memory_gib and hw.gpu_memory_gib > 0):
        raise UserError(f"hardware.gpus={hw.gpus} needs hardware.gpu_memory_gib (each GPU's memory in GiB, e.g. 79)")
    if hw.host_ram_gib is not None and hw.host_ram_gib <= 0:
        raise UserError(f"hardware.host_ram_gib={hw.host_ram_gib} must be positive (GiB) or null")
    if not hw.bf16 and cfg.precision.name == "bf16":
        raise UserError(
            f"precision=bf16 but hardware {hw.name!r} has no bfloat16 (pre-Ampere, e.g. T4, V100): use precision=fp16"
        )


def _check_values(cfg: TrainConfig) -> None:
    """String keys whose valid values are not a plain list: the libraries' own sets where they decide."""
    o, attn = cfg.optim, str(cfg.model.attn_implementation)
    if o.scheduler in SCHEDULER_KWARGS:
        raise UserError(
            f"optim.scheduler={o.scheduler} needs lr_scheduler_kwargs ({SCHEDULER_KWARGS[o.scheduler]}), which this "
            "repository does not pass; use optim.scheduler=cosine (or linear, constant_with_warmup, ...)"
        )
    compute = cfg.quant.compute_dtype
    if dtype_name(compute) not in COMPUTE_DTYPES:
        raise UserError(f"quant.compute_dtype={compute} is not an option; choose one of: {', '.join(COMPUTE_DTYPES)}")
    if attn.removeprefix("paged|") not in ATTENTION and "/" not in attn:  # transformers strips paged|
        raise UserError(
            f"model.attn_implementation={attn} is not an option; choose one of: {', '.join(ATTENTION)} "
            "(or a hub kernel, org/name)"
        )
    check_target_modules(cfg.peft.target_modules, cfg.peft.modules_to_save)
    check_rope_scaling(cfg.model.rope_scaling)


ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3")  # the ones that scale by `factor` (modeling_rope_utils)
ROPE_NEEDS = {"llama3": ("low_freq_factor", "high_freq_factor")}  # transformers' required keys past factor


def check_rope_scaling(scaling) -> None:
    """model.rope_scaling: a rope_type that scales by a factor, and a factor past 1 (1 scales nothing)."""
    if scaling is None:
        return
    fix = "e.g. model.rope_scaling={rope_type:linear,factor:2.0}"
    if not hasattr(scaling, "get"):
        raise UserError(f"model.rope_scaling={scaling} is not a mapping; {fix}")
    kind, factor = scaling.get("rope_type", scaling.get("type")), scaling.get("factor")
    if kind not in ROPE_TYPES:
        raise UserError(f"model.rope_scaling.rope_type={kind} is not an option; choose one of: {', '.join(ROPE_TYPES)}")
    if factor is None:
        raise UserError(f"model.rope_scaling needs a factor (the positions' multiple); {fix}")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
        raise UserError(f"model.rope_scaling.factor={factor} must be a number > 1 (the positions' multiple); {fix}")
    missing = [key for key in ROPE_NEEDS.get(kind, ()) if key not in scaling]
    if missing:
        raise UserError(f"model.rope_scaling with rope_type={kind} needs {' and '.join(missing)} too")
    for key in scaling:  # every other rope parameter transformers reads is a number (yarn's truncate a boolean)
        value, want = scaling[key], ROPE_VALUE_KINDS.get(str(key), "a number")
        if str(key) in ("rope_type", "type", "factor") or _is_kind(value, want):
            continue
        raise UserError(f"model.rope_scaling.{key}={value} must be {want}; {fix}")


ROPE_VALUE_KINDS = {"original_max_position_embeddings": "a whole number > 0", "truncate": "true or false"}


def _is_kind(value, want: str) -> bool:
    if want == "true or false":
        return isinstance(value, bool)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:  # NaN is no number
        return False
    return want == "a number" or (isinstance(value, int) and value > 0)


def check_target_modules(targets, to_save) -> None:
    """peft.target_modules: all-linear, a regular expression or a list of names; modules_to_save: names."""
    example = "'peft.target_modules=[q_proj,v_proj]'"
    if isinstance(targets, str):
        if targets == "all-linear":
            return
        if not targets.strip():
            raise UserError(f"peft.target_modules is empty; use peft.target_modules=all-linear or a list, {example}")
        try:
            re.compile(targets)
        except re.error as err:
            raise UserError(
                f"peft.target_modules={targets!r} is not a valid regular expression ({err}); "
                f"use all-linear or a list, {example}"
            ) from None
        return
    if not (isinstance(targets, list) and targets and all(isinstance(t, str) and t.strip() for t in targets)):
        raise UserError(
            f"peft.target_modules={'null' if targets is None else repr(targets)} is not a module list; "
            "use peft.target_modules=all-linear, a list of "
            f"module names ({example}) or a regular expression over full module names"
        )
    if to_save is not None and not all(isinstance(t, str) and t.strip() for t in to_save):
        raise UserError(f"peft.modules_to_save={to_save!r}: give module names, e.g. 'peft.modules_to_save=[lm_head]'")


def _check_combinations(cfg: TrainConfig) -> None:
    t, d, scheduler = cfg.trainer, cfg.data, cfg.optim.scheduler
    if t.save_steps > 0 and t.save_total_limit == 0:
        raise UserError(
            f"trainer.save_total_limit=0 with trainer.save_steps={t.save_steps}: transformers reads 0 as keep every "
            "checkpoint; keep the newest N with trainer.save_total_limit=N (N >= 1), or trainer.save_steps=0"
        )
    if cfg.overwrite and (cfg.resume.auto or cfg.resume.checkpoint):
        which = "resume=auto" if cfg.resume.auto else f"resume.checkpoint={cfg.resume.checkpoint}"
        raise UserError(f"overwrite=true replaces the run in the run dir and {which} continues it: drop one of the two")
    has_eval = d.eval_path not in (None, "") or d.eval_fraction > 0
    if scheduler in SCHEDULER_EVAL and (t.eval_steps <= 0 or not has_eval):
        raise UserError(
            f"optim.scheduler={scheduler} steps on the eval loss: set trainer.eval_steps=N (N >= 1) and keep an "
            "eval split (data.eval_fraction > 0 or data.eval_path)"
        )
    _check_lean_modules(cfg)
    _check_adapter_dtype(cfg)
    if t.eval_steps > 0 and not has_eval:
        # the trainer would skip every evaluation without a word (hf_configs.sft_config turns it off)
        raise UserError(
            f"trainer.eval_steps={t.eval_steps} but the run has no eval split (data.eval_path is null and "
            "data.eval_fraction=0): hold out rows with data.eval_fraction=0.1 or set data.eval_path=FILE, or set "
            "trainer.eval_steps=0 to train without evaluation"
        )


def _check_adapter_dtype(cfg: TrainConfig) -> None:
    """peft.adapter_dtype=bfloat16: with the 8-bit bitsandbytes optimizers (whose state does not follow the
    parameters' dtype), LoRA or rsLoRA (DoRA's magnitude needs fp32: TRL keeps it so), in one process."""
    if cfg.peft.adapter_dtype != "bfloat16":
        return
    fix = "or keep peft.adapter_dtype=float32"
    if cfg.optim.name not in BF16_ADAPTER_OPTIMS:
        raise UserError(
            f"peft.adapter_dtype=bfloat16 with optim.name={cfg.optim.name}: planned and tested with the 8-bit "
            f"optimizers only; use optim=paged8bit or optim=adamw8bit, {fix}"
        )
    if cfg.peft.method == "dora":
        raise UserError(
            f"peft.adapter_dtype=bfloat16 with peft.method=dora: LoRA and rsLoRA only (DoRA's magnitude trains in "
            f"fp32); {fix}"
        )
    if cfg.dist.strategy != "none":
        raise UserError(
            f"peft.adapter_dtype=bfloat16 is tested in one process, not with dist={cfg.dist.strategy}: train with "
            f"dist=none, {fix}"
        )


def _check_lean_modules(cfg: TrainConfig) -> None:
    """trainer.tiled_mlp and trainer.lean_rmsnorm are tested in one process, without Liger's own kernels
    (which replace the MLP and the norms); lean_rmsnorm knows Llama's norm form only."""
    t = cfg.trainer
    for name, on, what in (("tiled_mlp", t.tiled_mlp, "the MLP"), ("lean_rmsnorm", t.lean_rmsnorm, "the RMSNorms")):
        if not on:
            continue
        if cfg.dist.strategy != "none":
            raise UserError(
                f"trainer.{name}=true is tested in one process, not with dist={cfg.dist.strategy}: drop "
                f"trainer.{name} or train with dist=none"
            )
        if t.liger:
            raise UserError(
                f"trainer.{name}=true with trainer.liger=true: Liger replaces {what} with its own kernel, untested "
                f"with trainer.{name}; drop one of the two"
            )
    if t.lean_rmsnorm and not traits(cfg.model.architecture).llama_rmsnorm:
        have = ", ".join(name for name, f in FAMILIES.items() if f.llama_rmsnorm)
        raise UserError(
            f"trainer.lean_rmsnorm=true: {cfg.model.architecture}'s RMSNorm is not Llama's form ({have} have it); "
            "drop trainer.lean_rmsnorm"
        )
