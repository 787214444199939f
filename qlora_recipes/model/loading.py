"""Load the tokenizer and the (quantized) base, then make it trainable: k-bit prep and adapters."""

import logging
import os
import warnings
from pathlib import Path

import torch

from ..config.adapters import adapter_dtype
from ..config.attention import AUTO, VARLEN, why_picked
from ..config.schema import DistConfig, ModelConfig, OffloadConfig, TrainConfig, mlp_tile, padding_free_on
from ..errors import UserError
from ..families import traits
from ..units import torch_dtype
from .checkpoint import bitsandbytes_saved
from .checkpointing import enable_checkpointing
from .hf_configs import bnb_config
from .lean_rmsnorm import lean_rmsnorms
from .moe_experts import quantize_experts, quantized_while_loading
from .tiled_mlp import tile_mlps
from .tiled_moe import tile_moe_blocks
from .vision import (
    is_vision_language,
    keep_vision_in,
    lora_on_language_model,
    skipped_from_quantization,
    vision_prefixes,
)
from .vision_tower import unhook_frozen_tower

log = logging.getLogger(__name__)


def on_gpu() -> bool:
    return torch.cuda.is_available()


def device_name() -> str:
    return torch.cuda.get_device_name() if on_gpu() else "cpu"


def source(model: ModelConfig) -> dict:
    """from_pretrained's source arguments: a local dir if one exists, else a hub id."""
    path = model.name_or_path
    local = Path(path).expanduser()
    if not local.is_dir() and (path.startswith((".", "/", "~")) or path.count("/") > 1):
        raise UserError(
            f"model.name_or_path={path}: no such directory; give a local model dir in the HF layout or a hub id"
        )
    return {
        "pretrained_model_name_or_path": str(local) if local.is_dir() else path,
        "trust_remote_code": model.trust_remote_code,
        "revision": model.revision,
    }


def _load_failed(model: ModelConfig, what: str, err: Exception) -> UserError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return UserError(
        f"could not load the {what} of model.name_or_path={model.name_or_path} ({first}); "
        "offline, point model.name_or_path at a local dir in the HF layout"
    )


def load_tokenizer(model: ModelConfig):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(**source(model))
    except (OSError, ValueError) as err:
        raise _load_failed(model, "tokenizer", err) from None
    if tokenizer.pad_token is None:  # Llama-style tokenizers ship without one
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def device_map(dist: DistConfig, offload: OffloadConfig):
    if dist.strategy in ("fsdp", "zero3"):
        # Sharded strategies place the weights themselves (accelerate's cpu_ram_efficient_loading:
        # rank 0 reads, the others start on meta); a device map would pin a full copy per rank.
        return None
    if offload.device_map is None:
        # One device: this rank's GPU under torchrun, else GPU 0, else the CPU.
        return {"": int(os.environ.get("LOCAL_RANK", 0))} if on_gpu() else {"": "cpu"}
    return offload.device_map


def _planned_placement(cfg: TrainConfig, run_plan: dict | None) -> tuple[dict | None, dict | None]:
    """(device map, max_memory) for from_pretrained: the budgets of `run_plan` (the run's plan, as
    plan.json records it), and when layers may be offloaded its map, passed as an explicit dict;
    without a run's plan (a run dir read back) one process's, planned here. Two reasons not to pass
    "auto": transformers 5 quantizes before it infers an "auto" map, so `llm_int8_enable_fp32_cpu_offload`
    cannot keep the offloaded layers unquantized and their 4-bit weights cannot be onloaded
    (bitsandbytes' quant state stays on meta); and the planner pins the LM head to the execution
    device (placement.pin_output_head), which an "auto" map would not."""
    if cfg.offload.device_map is None and run_plan is None:
        return None, None
    from ..planner import loader_max_memory, plan

    if cfg.offload.device_map is None:
        return None, loader_max_memory(run_plan)
    # one process's device map: no rank sharding applies to it (offloading runs one process: run/validate.py)
    planned = run_plan if run_plan is not None else plan(cfg, world_size=1, ladder=False)
    return dict(planned["device_map"]), loader_max_memory(planned)


# Attention per family. `model.attn_implementation` defaults to sdpa; a family without an sdpa path gets
# eager instead: families.py says so for the families it knows (Gemma 2, whose attention-logit
# soft-capping sdpa cannot apply; the planner asks the same traits), transformers' `_supports_sdpa =
# False` for the others. Other values are taken as given; when transformers refuses one, the error
# names model.attn_implementation.
_ATTENTION_WORDS = (
    "attn_implementation",
    "attention implementation",
    "scaled_dot_product_attention",
    "flashattention",
    "flash_attn",
    "flash attention",
    "flex_attention",
    "sdpa",
    "`kernels`",  # a hub kernel (model.attn_implementation=org/name) needs the kernels package
)


def _model_class(model: ModelConfig):
    """The transformers causal-LM class model.name_or_path loads as, or None when its config cannot be
    read here (a hub id offline: loading reports that itself)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        config = AutoConfig.from_pretrained(**source(model))
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except Exception:  # unreachable hub, unknown model type, remote code: from_pretrained says what is wrong
        return None


def rope_scaled_config(model: ModelConfig):
    """The model's AutoConfig with model.rope_scaling over its rope_parameters (transformers 5 keeps
    rope_theta there too, so the option's keys are merged in, not swapped for the whole dict)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(**source(model))
    scaling = {str(k): v for k, v in dict(model.rope_scaling).items()}
    own = dict(config.rope_parameters or {})
    if own.get("rope_type") != scaling.get("rope_type"):  # another type's keys (llama3's low_freq_factor) go
        own = {key: own[key] for key in ("rope_theta", "partial_rotary_factor") if key in own}
    config.rope_parameters = {**own, **scaling}
    try:
        config.standardize_rope_params()  # yarn and llama3 read original_max_position_embeddings from here
        config.validate_rope()
    except (KeyError, ValueError, TypeError) as err:  # transformers' own word on keys the option's checks do not know
        raise UserError(f"model.rope_scaling={model.rope_scaling}: {str(err).strip(chr(34))}") from None
    return config


def attention_for(model: ModelConfig) -> str:
    """The attention implementation to load with: model.attn_implementation, except that the sdpa
    default becomes eager for a family that has no sdpa path (logged)."""
    requested = str(model.attn_implementation)
    requested = "sdpa" if requested == AUTO else requested  # a config not typed by config/loader.to_typed
    if requested != "sdpa":
        return requested
    cls = _model_class(model)
    if cls is None:
        return requested
    family = getattr(getattr(cls, "config_class", None), "model_type", "")  # the dir's own, not model.architecture
    if traits(family).attention == "eager" or not getattr(cls, "_supports_sdpa", True):
        log.info(
            "attention: eager for %s (transformers has no sdpa path for it; set model.attn_implementation to "
            "choose another)",
            cls.__name__,
        )
        return "eager"
    return requested


def _packed_attention(cfg: TrainConfig, attn: str) -> None:
    """Register sdpa_varlen with transformers when it runs, and say in one line how a padding-free
    run keeps its packed sequences apart."""
    if attn == VARLEN:
        from .packed_attention import register

        register()
    if padding_free_on(cfg.data):
        log.info("attention: %s for padding-free micro-batches (%s)", attn, why_picked(attn))


def _attention_error(err: Exception) -> bool:
    text = str(err).lower()
    return any(word in text for word in _ATTENTION_WORDS)


def _attention_failed(model: ModelConfig, attn: str, err: Exception) -> UserError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    first = first if len(first) <= 240 else first[:237] + "..."
    return UserError(
        f"model.attn_implementation={attn}: {model.name_or_path} cannot load with this attention ({first}); "
        "set model.attn_implementation=eager (any model, any device) or sdpa where the model supports it"
    )


def load_model(cfg: TrainConfig, run_dir: Path, run_plan: dict | None = None):
    """The base as the run trains it, placed by `run_plan` (its budgets, and an offloading stack's
    device map: what plan.json says is loaded, not planned a second time); without one, offloading
    stacks plan it here."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    vlm = is_vision_language(cfg.model)
    attn = attention_for(cfg.model)
    _packed_attention(cfg, attn)
    planned_map, budgets = _planned_placement(cfg, run_plan)
    quantization = bnb_config(cfg.quant, cfg.offload, cfg.model)
    if quantization is not None and bitsandbytes_saved(cfg.model.name_or_path, cfg.model.revision):
        # stored quantized: transformers loads it as saved (the planner refused a quant group saying
        # otherwise) and would only warn that a config passed beside it is ignored
        quantization = None
    if quantization is not None and vlm:  # the vision tower and projector stay in the compute dtype
        quantization.llm_int8_skip_modules = skipped_from_quantization(cfg.model, quantization.llm_int8_skip_modules)
    if quantization is not None and planned_map is not None:
        # transformers leaves every module the map puts on "cpu" or "disk" unquantized under this flag,
        # the whole model for {"": "cpu"}: only a map that really offloads gets it
        from ..planner.placement import offloads  # the planner sizes offloaded modules unquantized too

        quantization.llm_int8_enable_fp32_cpu_offload = offloads(planned_map)
    kwargs = dict(
        dtype=torch_dtype(cfg.precision.dtype),
        device_map=planned_map if planned_map is not None else device_map(cfg.dist, cfg.offload),
        max_memory=budgets,
        use_safetensors=True,
        attn_implementation=attn,
    )
    if quantization is not None:  # an explicit None would also clear a quantized checkpoint's own config
        kwargs["quantization_config"] = quantization
    if cfg.model.rope_scaling:
        kwargs["config"] = rope_scaled_config(cfg.model)
    if cfg.offload.folder:
        folder = Path(cfg.offload.folder)
        kwargs["offload_folder"] = str(folder if folder.is_absolute() else run_dir / folder)
    experts_4bit = planned_map is None and cfg.dist.strategy not in ("fsdp", "zero3")  # else: as loaded, logged
    try:
        with quantized_while_loading(cfg.quant, experts_4bit):
            auto = AutoModelForImageTextToText if vlm else AutoModelForCausalLM
            model = auto.from_pretrained(**source(cfg.model), **kwargs)
    except (OSError, ValueError, ImportError) as err:
        if _attention_error(err):
            raise _attention_failed(cfg.model, attn, err) from None
        if isinstance(err, ImportError):
            raise
        raise _load_failed(cfg.model, "weights", err) from None
    model.config.use_cache = False  # the KV cache only costs memory while training
    if cfg.offload.embeddings and on_gpu():  # validate refuses it without a GPU
        from .host_embeddings import keep_on_host

        keep_on_host(model, model.get_output_embeddings().weight.device)
        torch.cuda.empty_cache()  # the table's block, back for the activations
    head = model.get_output_embeddings()
    if head is not None and head.weight.device.type == "meta":
        # TRL's fused LM head reads lm_head.weight outside the offload hook (placement.pin_output_head
        # keeps it on the execution device unless the whole model went to disk)
        raise UserError(
            "offload: the LM head would stay offloaded (the whole model is on disk); raise offload.max_memory.cpu "
            "or offload.max_memory.gpu"
        )
    quantize_experts(model, cfg.quant, experts_4bit)
    _keep_4bit_layout_trainable(model)
    _as_trls_fused_head_reads_it(model)
    return model


def _as_trls_fused_head_reads_it(model) -> None:
    """What TRL's fused LM head (the SFT loss) assumes of a causal LM, made true of Llama 4's text model.
    It runs `model.base_model` for the hidden states: Llama4ForCausalLM keeps the prefix it has inside the
    multimodal model ("language_model"), so alone its base_model is itself (logits, no hidden states) while
    its decoder is `.model`. And it adds the load-balancing loss whenever the config has a coefficient,
    reading `num_experts`: Llama 4's config names it num_local_experts, and its own forward adds no such
    loss (it keeps no router_aux_loss_coef, as Qwen3-MoE and gpt-oss do): 0 keeps the loss its own."""
    from transformers import PreTrainedModel

    if model.base_model is model and isinstance(getattr(model, "model", None), PreTrainedModel):
        model.base_model_prefix = "model"
    text = model.config.get_text_config()
    if getattr(text, "router_aux_loss_coef", 0.0) and not hasattr(model, "router_aux_loss_coef"):
        text.router_aux_loss_coef = 0.0


def _keep_4bit_layout_trainable(model) -> None:
    """bitsandbytes 0.50 repacks a CPU Linear4bit's weight for AVX512-BF16 inference the first
    time it runs in eval mode, and that packed path (gemv_4bit) has no backward: training after an
    evaluation (our exact-match before training) would get no gradient through the frozen base.
    Keep the trainable layout; inference on CPU uses the dequantize path instead."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def make_trainable(cfg: TrainConfig, model):
    """prepare_model_for_kbit_training for quantized bases (unless precision.upcast_frozen=false),
    then the adapters from `peft`."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    from . import expert_lora  # imports peft

    t = cfg.trainer
    ckpt_kwargs = {"use_reentrant": t.checkpointing_mode == "reentrant"}
    kbit_prep = cfg.quant.method != "none" and cfg.precision.upcast_frozen
    if kbit_prep:  # checkpointing below, by its transformers 5 name (peft's prep calls the deprecated one)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    vlm = is_vision_language(cfg.model)
    if vlm:
        keep_vision_in(model, torch_dtype(cfg.precision.dtype))
    if t.gradient_checkpointing:
        # Also upcast_frozen=false: k-bit prep is freeze + fp32 upcast + these two calls (peft
        # utils/other.py). Not prep-then-cast-back: that would hold the fp32 copies of embeddings and
        # lm_head at load, the very bytes this option saves. Freezing is get_peft_model's (only the
        # adapters train); the adapters are fp32 either way (peft autocast_adapter_dtype).
        enable_checkpointing(model, t.gradient_checkpointing, ckpt_kwargs)  # every layer, or the first N
        if not kbit_prep or ckpt_kwargs["use_reentrant"]:  # as peft's prep does it
            model.enable_input_require_grads()
    try:
        with warnings.catch_warnings():  # peft 0.21 reads transformers 5's deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            warnings.filterwarnings("ignore", expert_lora.RANK_PATTERN_WARNING, RuntimeWarning)
            tower = cfg.model.vision_tower == "lora"
            peft_cfg = lora_on_language_model(cfg.peft, model, tower) if vlm else cfg.peft
            model = get_peft_model(model, expert_lora.peft_config(peft_cfg, model))
        expert_lora.saved_as_peft_loads_it(model)
    except ValueError as err:  # e.g. target modules not found in the base
        raise UserError(f"peft: {str(err).splitlines()[0]} (check peft.target_modules)") from None
    if vlm:  # a tower that trains nothing needs no gradient: no autograd graph, nothing kept for backward
        base = model.get_base_model()
        unhook_frozen_tower(base, vision_prefixes(base))
    _adapters_off_meta(cfg.offload, model)
    _trainable_in(model, torch_dtype(adapter_dtype(cfg)))  # auto: as the run settled it and the plan counts it
    if cfg.init_from:  # a stage: the adapter starts as the earlier run's (run/stages.py checked the shape)
        load_init_adapter(model, Path(cfg.init_from) / "adapter")
    _disk_layers_as_host_layers(model)
    if cfg.offload.embeddings:
        from .host_embeddings import left_alone_by_ddp

        left_alone_by_ddp(model)  # named on the model DDP wraps: peft's
    if t.tiled_mlp:
        _tile_mlps(cfg, model)
    if t.lean_rmsnorm and not lean_rmsnorms(model):
        raise UserError(
            f"trainer.lean_rmsnorm=true: {cfg.model.architecture} has no Llama-form RMSNorm (Llama, Mistral, Qwen2, "
            "Qwen3, SmolLM3 have); drop trainer.lean_rmsnorm"
        )
    return model


def load_init_adapter(model, adapter_dir: Path) -> None:
    """The earlier stage's adapter weights copied into the adapter peft made (fp32, on its devices): the
    shapes and the scale are this run's peft group's, which must match (run/stages.py); every tensor
    of the file must land, and every trainable tensor must get one."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(str(adapter_dir / "adapter_model.safetensors"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        result = set_peft_model_state_dict(model, weights)
    unexpected = [k for k in getattr(result, "unexpected_keys", ()) if "lora_" in k or "modules_to_save" in k]
    missing = trainable & set(getattr(result, "missing_keys", ()))
    if unexpected or missing:
        raise UserError(
            f"init_from: {adapter_dir} does not fit this run's adapter ({len(unexpected)} tensors without a place, "
            f"{len(missing)} left as initialised, e.g. {(unexpected or sorted(missing))[0]}); train the stages with "
            "the same peft group"
        )
    log.info("init_from: the adapter starts from %s (%d tensors)", adapter_dir, len(weights))


def _tile_mlps(cfg: TrainConfig, model) -> None:
    """trainer.tiled_mlp: every decoder layer's MLP, dense (model/tiled_mlp.py) or sparse MoE block
    (model/tiled_moe.py), over tiles of tokens."""
    hidden = model.get_base_model().config.get_text_config().hidden_size
    tile = mlp_tile(cfg.trainer, hidden)
    if not tile_mlps(model, tile) + tile_moe_blocks(model, tile):
        raise UserError(
            f"trainer.tiled_mlp=true: {cfg.model.architecture} has no gate/up/down MLP or MoE block to tile "
            "(Llama, Mistral, Qwen2, Qwen3, Qwen3.5, SmolLM3, Gemma 2-4 and the MoE families have); drop "
            "trainer.tiled_mlp"
        )


def _disk_layers_as_host_layers(model) -> None:
    """accelerate's Accelerator.prepare_model refuses any 4-bit/8-bit model whose hf_device_map
    names "disk" ("can't train ... with CPU or disk offload"), while it lets "cpu" through with
    bitsandbytes' multi-backend (0.50 has it). Here both train the same way: the offloaded modules
    are kept unquantized (llm_int8_enable_fp32_cpu_offload with an explicit map), onloaded by the
    same AlignDevicesHook, and their adapters are real tensors (_adapters_off_meta). The trainer's
    view of the map (an attribute of the PeftModel it prepares) therefore names disk as cpu; the
    base model keeps its true hf_device_map."""
    base = model.get_base_model()
    dmap = getattr(base, "hf_device_map", None)
    if dmap and "disk" in dmap.values():
        model.hf_device_map = {k: ("cpu" if v == "disk" else v) for k, v in dmap.items()}


def _execution_device(module):
    """Where accelerate runs `module`: its offload hook's execution device (a SequentialHook holds
    the AlignDevicesHook among its hooks), or None when no hook manages it."""
    hook = getattr(module, "_hf_hook", None)
    for h in [hook, *getattr(hook, "hooks", ())]:
        device = getattr(h, "execution_device", None)
        if device is not None:
            return torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    return None


def _adapters_off_meta(offload: OffloadConfig, model) -> None:
    """Trainable adapters of offloaded layers as real tensors on the layer's execution device.

    A layer offloaded to host RAM or disk keeps its weights on `meta`; accelerate's per-module hook
    (AlignDevicesHook(offload=True) on each base linear, never on the adapter modules peft adds)
    onloads them for each forward and drops them after. peft moves a new adapter to its base
    weight's device, so those adapters would land on meta, and the first backward fails ("expected
    device meta but got cpu"). Re-created on the execution device and initialised as peft would
    (kaiming A, zero B), they stay put: no hook touches them, the optimizer (built later by the
    trainer) sees them, and their gradients and optimizer state live beside them."""
    from peft.tuners.lora import LoraLayer

    if not any(_execution_device(m) is not None for m in model.modules()):
        return  # nothing offloaded (or a meta skeleton not yet materialised, as bench/trace builds)
    meta = torch.device("meta")
    for name, layer in model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        for adapter in list(layer.lora_A.keys()):
            parts = [layer.lora_A[adapter], layer.lora_B[adapter]]
            if not any(p.device == meta for part in parts for p in part.parameters()):
                continue
            device = _execution_device(layer.get_base_layer())
            if device is None:
                continue  # not offloaded: caught below if it stays on meta
            if layer.use_dora.get(adapter):
                # DoRA reads the base weight itself (its norm, every step), outside the hook's onload
                raise UserError(
                    f"peft=dora cannot train {name}: the layer is offloaded (offload={'disk' if offload.folder else 'cpu'}) "
                    "and DoRA reads its base weight outside the forward that onloads it; use peft=lora or offload=none"
                )
            for part in parts:
                part.to_empty(device=device)
            init = model.peft_config[adapter].init_lora_weights
            layer.reset_lora_parameters(adapter, init if init in (True, "gaussian") else True)
    stuck = [n for n, p in model.named_parameters() if p.requires_grad and p.device == meta]
    if stuck:
        raise UserError(
            f"{len(stuck)} trainable tensor(s) on an offloaded module stay on meta (first: {stuck[0]}); "
            "peft.modules_to_save cannot name a module offloaded to cpu or disk: raise offload.max_memory.gpu or drop it"
        )


def _trainable_in(model, dtype: torch.dtype) -> None:
    """Every trainable tensor in peft.adapter_dtype (auto resolved), as the planner counts it. peft upcasts the
    adapters to fp32, not the `peft.modules_to_save` copies: without k-bit prep's upcast (quant=none,
    precision.upcast_frozen=false) those would train in bf16/fp16. bfloat16 is what TRL's trainers
    make of a quantized model's adapters themselves (the lifecycle keeps the dtype set here)."""
    for param in model.parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
