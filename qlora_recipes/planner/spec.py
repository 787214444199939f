"""The planner's numeric view of a composed stack: `StackSpec` holds only the choices that change
memory (quantization, adapters, optimizer, batch, sequence, checkpointing, placement, ranks), read
from the config groups and checked, so every other planner room works on plain numbers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config.adapters import adapter_dtype
from ..config.attention import unmasked_packing
from ..config.objectives import OBJECTIVES
from ..config.schema import mlp_tile, padding_free_on
from ..errors import UserError
from ..model.checkpoint import SavedQuant, Stored, quant_contradiction, read_config, saved_quantization, stored_weights
from ..units import DTYPE_BYTES, dtype_bytes
from .constants import DEVICE_MAP_STRATEGIES, TRL_OFFLOAD_FWD_STASH
from .evalbatch import AUTO as AUTO_ROWS
from .evalbatch import MOST as MOST_EVAL_ROWS
from .figures import Figures, given, model_figures

if TYPE_CHECKING:
    from ..config.schema import (
        OffloadConfig,
        OptimConfig,
        PeftConfig,
        PrecisionConfig,
        QuantConfig,
        TrainConfig,
        TrainerConfig,
    )


@dataclass(frozen=True)
class StackSpec:
    """What of a composed stack the planner sizes; the ladder's rungs are changed copies of it."""

    fig: Figures
    name_or_path: str
    quant: str = "nf4"
    prequantized: bool = False  # the checkpoint is stored quantized (its quantization_config): loaded as stored
    double_quant: bool = True
    quant_storage_bytes: int = 1
    experts_4bit: bool = True  # quant.experts=4bit: fused MoE expert weights stored NF4/FP4 (nf4/fp4 only)
    skip_modules: tuple[str, ...] = ()
    peft: str = "lora"
    r: int = 16
    alpha: float = 32
    lora_dropout: float = 0.05
    target_modules: Any = "all-linear"  # "all-linear", a regex string, or a tuple of names
    expert_r: int = 0  # peft.experts=lora: the LoRA rank of each MoE expert (resolved); 0: no LoRA on the experts
    modules_to_save: tuple[str, ...] = ()
    optim: str = "paged_adamw_8bit"
    dtype: str = "bfloat16"
    stored_dtype: str | None = None  # the checkpoint's floating parameters on disk (None: unknown, planned as dtype)
    stored_bytes: int | None = None  # its safetensors tensors' bytes (None: not here; params x stored dtype)
    upcast_frozen: bool = True  # precision.upcast_frozen: k-bit prep's fp32 copy of the frozen non-quantized params
    micro_batch: int = 4
    grad_accum: int = 4
    eval_batch: int = 16
    evaluates: bool = True
    seq_len: int = 2048
    checkpointing: bool = True
    ckpt_layers: int | None = None  # trainer.gradient_checkpointing=N: the first N decoder layers; None: all
    checkpointing_mode: str = "non_reentrant"
    activation_offloading: bool = False  # trainer.activation_offloading (TRL): saved activations in host RAM
    embeddings_on_host: bool = False  # offload.embeddings: the input embeddings in host RAM, looked up there
    offload_stash: int = TRL_OFFLOAD_FWD_STASH  # trainer.activation_offload_stash: offloaded tensors left on the GPU
    offload_pinned: bool = True  # trainer.activation_offload_pinned: host blocks rounded to a power of two
    mlp_tile: int = 0  # trainer.tiled_mlp: tokens per MLP tile (schema.mlp_tile); 0: untiled
    adapter_bytes: int = 4  # peft.adapter_dtype: bytes per element of the trained tensors and their gradients
    lean_norms: bool = False  # trainer.lean_rmsnorm: RMSNorms keep their 16-bit input, not an fp32 copy
    attn: str = "sdpa"
    packing: bool = False  # data.packing: micro-batches filled from the data, no pads
    padding_free: bool = False  # schema.padding_free_on: one flat row of b*s tokens, position_ids apart
    device_map: str | None = None
    max_memory: tuple[tuple[str, str], ...] = ()
    offload_folder: str | None = None
    offload_option: str = "none"  # the conf/offload option this looks like (for ladder overrides)
    world_size: int = 1
    # the objective (config/objectives.py): sequences per example in a forward (dpo: chosen and rejected),
    # and its reference: "adapter_off" (a no_grad forward per step), "init_adapter" (the same forward with the
    # earlier stage's adapter, a frozen copy of the LoRA weights), "precomputed" (before training) or "none"
    sequences: int = 1
    reference: str = "none"
    kl_batch: bool = False  # kto: a no_grad forward of the micro-batch's mismatched pairs before the policy's
    # grpo: the tokens a sampled completion may have (objective.max_completion_length); 0: no sampling in
    # training. seq_len is then a prompt's bound plus these (the sequences TRL trains on).
    completion_len: int = 0
    # model.vision_tower (model/vision_tower.py): frozen, quantized (its linears in quant's format) or lora
    vision_tower: str = "frozen"
    # data.images_per_row: images a row holds, as the vision terms count them; auto before the data is read: 1
    images_per_row: int = 1
    images_auto: bool = False  # data.images_per_row=auto, not yet resolved from the rows (no data read)

    @property
    def sample_rows(self) -> int:
        """grpo: completions one generate call samples (TRL's generation batch: micro-batch x grad_accum)."""
        return self.micro_batch * self.grad_accum if self.completion_len else 0

    @property
    def train_rows(self) -> int:
        """Sequences in one training forward: the micro-batch's examples times the objective's sequences."""
        return self.micro_batch * self.sequences

    @property
    def eval_rows(self) -> int:
        """Sequences in one evaluation forward (dpo: both answers of every pair)."""
        return self.eval_batch * self.sequences

    @property
    def act_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def quantized(self) -> bool:
        return self.quant != "none"

    @property
    def frozen_bytes(self) -> int:
        """Bytes per element of the frozen non-quantized params (embeddings, lm_head, norms) as they
        train: prepare_model_for_kbit_training casts fp16/bf16 ones to fp32 (quantized bases, unless
        precision.upcast_frozen=false); otherwise they keep the precision dtype they loaded in."""
        return 4 if self.quantized and self.upcast_frozen else dtype_bytes(self.dtype)


def spec_from_cfg(cfg: TrainConfig, world_size: int) -> StackSpec:
    """Read the memory-relevant choices from a composed config; UserError on values it cannot plan."""
    model, quant, peft, trainer, data = cfg.model, cfg.quant, cfg.peft, cfg.trainer, cfg.data
    fig = model_figures(model)
    method, pmethod, oname, dtype, storage_bytes = _methods(quant, peft, cfg.optim, cfg.precision)
    stored, saved = _checkpoint(fig, quant, str(given(model, "name_or_path") or ""))
    ints = _sizes(trainer, peft)
    mode = str(trainer.checkpointing_mode)
    if mode not in ("non_reentrant", "reentrant"):
        raise UserError(f"trainer.checkpointing_mode={mode!r} is not one of non_reentrant, reentrant")
    objective = OBJECTIVES[cfg.objective.name]
    reference = "none"
    if objective.reference and (objective.name != "grpo" or cfg.objective.beta > 0):  # grpo: beta 0, none
        reference = "precomputed" if cfg.objective.precompute_ref_log_probs else "adapter_off"
        if reference == "adapter_off" and cfg.objective.ref_adapter:
            reference = "init_adapter"
    completion = int(cfg.objective.max_completion_length or 0) if objective.name == "grpo" else 0
    targets = peft.target_modules
    if targets is None:
        raise UserError("peft.target_modules is null; use all-linear or a list like [q_proj, v_proj]")
    if not isinstance(targets, str):  # a list of module names
        targets = tuple(str(t) for t in targets)
    return StackSpec(
        fig=fig,
        name_or_path=str(given(model, "name_or_path") or ""),
        quant=method,
        prequantized=saved is not None,
        double_quant=bool(quant.double_quant),
        quant_storage_bytes=storage_bytes,
        experts_4bit=str(quant.experts) == "4bit",
        # a quantized checkpoint keeps what it was saved with unquantized, whatever quant.skip_modules says
        skip_modules=saved.skip_modules if saved is not None else tuple(quant.skip_modules or ()),
        peft=pmethod,
        r=ints["r"],
        alpha=float(peft.alpha),
        # DPOConfig.disable_dropout (TRL's default, kept): every dropout's p set to 0, so it saves no mask
        lora_dropout=float(peft.dropout) if objective.name == "sft" else 0.0,
        target_modules=targets,
        expert_r=_expert_rank(peft, fig.num_experts),
        modules_to_save=tuple(peft.modules_to_save or ()),
        optim=oname,
        dtype=dtype,
        stored_dtype=stored.dtype,
        stored_bytes=stored.bytes,
        upcast_frozen=bool(cfg.precision.upcast_frozen),
        micro_batch=ints["micro_batch"],
        grad_accum=ints["grad_accum"],
        eval_batch=ints["eval_batch"],
        evaluates=bool(data.eval_path) or float(data.eval_fraction) > 0,
        seq_len=ints["seq_len"] + completion,
        **_checkpointing(trainer.gradient_checkpointing, fig.num_layers),
        checkpointing_mode=mode,
        activation_offloading=bool(trainer.activation_offloading),
        offload_stash=int(trainer.activation_offload_stash),
        offload_pinned=bool(trainer.activation_offload_pinned),
        embeddings_on_host=bool(cfg.offload.embeddings),
        mlp_tile=mlp_tile(trainer, fig.hidden_size),
        lean_norms=bool(trainer.lean_rmsnorm),
        adapter_bytes=dtype_bytes(adapter_dtype(cfg, world_size)),  # auto: for the precision planned
        attn=str(model.attn_implementation),
        packing=bool(data.packing),
        padding_free=padding_free_on(data),
        **_offload(cfg.offload),
        world_size=max(1, int(world_size)),
        sequences=objective.sequences,
        reference=reference,
        kl_batch=objective.kl_batch,
        completion_len=completion,
        vision_tower=str(getattr(model, "vision_tower", "frozen")),
        images_per_row=1 if data.images_per_row == "auto" else int(data.images_per_row),
        images_auto=data.images_per_row == "auto",
    )


def _checkpointing(value: Any, num_layers: int) -> dict[str, Any]:
    """trainer.gradient_checkpointing as the spec's two fields; auto unresolved (plan() resolves it) is
    planned as every layer, the most it resolves to."""
    if value == "auto" or isinstance(value, bool):
        return {"checkpointing": value == "auto" or value is True, "ckpt_layers": None}
    n = int(value)
    return {"checkpointing": n > 0, "ckpt_layers": n if 0 < n < num_layers else None}


def _expert_rank(peft: PeftConfig, num_experts: int | None) -> int:
    """The rank model/expert_lora.py gives each expert: peft.expert_r, else max(1, r // num_experts); 0
    where no expert gets LoRA (peft.experts=none, a dense model)."""
    if str(peft.experts) != "lora" or not num_experts:
        return 0
    return int(peft.expert_r) if peft.expert_r else max(1, int(peft.r) // num_experts)


def _checkpoint(fig: Figures, quant: QuantConfig, name: str) -> tuple[Stored, SavedQuant | None]:
    """How the checkpoint stores its weights, and the bitsandbytes quantization it was saved with (None:
    16/32-bit): transformers loads such a checkpoint as stored, so a quant group saying otherwise is refused."""
    if fig.config_dir is None:  # figures from conf/model: nothing on disk to read
        return Stored(), None
    folder = Path(fig.config_dir)
    cj = read_config(folder / "config.json")
    saved = saved_quantization(cj)
    if saved is not None:
        wrong = quant_contradiction(saved, str(quant.method), bool(quant.double_quant), str(quant.storage_dtype))
        if wrong:
            raise UserError(f"model.name_or_path={name} is stored quantized ({saved.describe()}); {wrong}")
        if not saved.bitsandbytes:
            saved = None  # another library's format: planned as the quant group says
    return stored_weights(folder, cj), saved


def data_note(st: StackSpec) -> str | None:
    """What the planner can know of packed / padding-free micro-batches (it never sees the data)."""
    if not (st.packing or st.padding_free):
        return None
    fill = "packing fills them from the data" if st.packing else "padding-free without packing holds fewer"
    mask = ""
    if st.padding_free:
        flat = f"no mask ({st.attn} reads cu_seq_lens)" if unmasked_packing(st.attn) else "a mask over that one row"
        mask = f"; padding-free: one flat row of micro_batch_size x seq_len tokens, {flat}"
    return (
        f"data: planned at micro_batch_size x seq_len = {st.micro_batch * st.seq_len:,} tokens per micro-batch, "
        f"an upper bound ({fill}); the same count a padded micro-batch is planned at, so no planned saving{mask}"
    )


def _methods(
    quant: QuantConfig, peft: PeftConfig, optim: OptimConfig, precision: PrecisionConfig
) -> tuple[str, str, str, str, int]:
    """(quant method, peft method, optimizer, compute dtype, bytes per quantized storage element).
    The names are checked before any plan is made (config/checks.py: train, plan, launch and bench
    all load through it); the byte tables here are keyed by them."""
    method, pmethod, oname = str(quant.method).lower(), str(peft.method).lower(), str(optim.name)
    dtype = str(precision.dtype)
    storage_bytes = DTYPE_BYTES[str(quant.storage_dtype)]
    return method, pmethod, oname, dtype, storage_bytes


def _sizes(trainer: TrainerConfig, peft: PeftConfig) -> dict[str, int]:
    ints = {}
    for key, node, name, lo in [
        ("micro_batch", trainer, "micro_batch_size", 1),
        ("grad_accum", trainer, "grad_accum", 1),
        ("eval_batch", trainer, "eval_batch_size", 1),
        ("seq_len", trainer, "seq_len", 1),
        ("r", peft, "r", 1),
    ]:
        group = "peft" if node is peft else "trainer"
        value = getattr(node, name)
        if name == "eval_batch_size" and value == AUTO_ROWS:  # unresolved (plan() resolves it): its most
            value = MOST_EVAL_ROWS
        if name == "micro_batch_size" and value == "auto":  # unresolved (plan() resolves it): its least
            value = 1
        if value is None or int(value) < lo:
            raise UserError(f"{group}.{name}={value!r} must be an integer >= {lo}")
        ints[key] = int(value)
    return ints


def _offload(offload: OffloadConfig) -> dict[str, Any]:
    """The placement fields of the spec from the offload group."""
    device_map = offload.device_map
    if device_map is not None:
        device_map = str(device_map)
        if not (device_map in DEVICE_MAP_STRATEGIES or device_map == "cpu" or re.fullmatch(r"(cuda:)?\d+", device_map)):
            raise UserError(
                f"offload.device_map={device_map!r} is not one of null, {', '.join(DEVICE_MAP_STRATEGIES)}, cpu, cuda:N"
            )
    max_memory = offload.max_memory or {}
    folder = offload.folder
    return {
        "device_map": device_map,
        "max_memory": tuple((str(k), str(v)) for k, v in dict(max_memory).items()),
        "offload_folder": str(folder) if folder else None,
        "offload_option": "none" if device_map is None else ("disk" if folder else "cpu"),
    }
