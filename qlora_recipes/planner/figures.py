"""Model figures and the parameter inventory: the architecture numbers of `cfg.model` (a local dir's
`config.json`, a hub id's from the HF cache or the hub, or the conf/model entry that names that hub id
when its config.json is out of reach), the blocks the loader places (decoder layers,
embeddings, norms, lm_head) with their linears, and, for device maps and unknown families, the
model on the meta device as from_pretrained builds it (torch + transformers + accelerate, ~5 s to
import; the known families are inventoried analytically without importing torch).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from ..errors import UserError
from ..families import KNOWN_ARCHITECTURES, FamilyTraits, traits
from ..model.checkpoint import hub_config_json, local_dir, read_config
from ..units import torch_dtype
from .blocks import Block, Linear
from .family_layers import config_keys, with_config_defaults
from .layers import analytic_inventory, family_figures
from .vlm_layout import layout

if TYPE_CHECKING:
    from ..config.schema import ModelConfig


@dataclass(frozen=True)
class Figures:
    """The architecture numbers the planner sizes everything from."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 4096
    positions: int = 0  # what the config's own RoPE scaling reaches (0: max_position_embeddings)
    source: str = "conf/model"
    config_dir: str | None = None  # a local dir with config.json (used for the meta model)
    trust_remote_code: bool = False
    # a family's own layers (layers.family_figures): MoE experts, top-k, widths; local layers and their window
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    rotary_fraction: float = 1.0  # the part of head_dim that rotates (Qwen3.5's partial_rotary_factor)
    # Qwen3.5's Gated DeltaNet layers: key and value heads, their widths, the causal conv's kernel
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    linear_conv_kernel: int = 0
    # Gemma 4: per-layer input embeddings (width per layer, vocab), its global layers' head_dim and kv
    # heads, the last layers that reuse earlier ones' k/v, keys as values, double-wide MLPs where shared
    per_layer_input: int = 0
    per_layer_vocab: int = 0
    global_head_dim: int = 0
    global_kv_heads: int = 0
    kv_shared_layers: int = 0
    k_eq_v: bool = False
    double_wide_mlp: bool = False
    # Llama 4: which layers are MoE (the others a dense MLP of dense_intermediate)
    moe_layers: tuple[int, ...] = ()
    dense_intermediate: int = 0
    # Llama 4: the layers whose q and k pass through its weightless L2 norm (use_qk_norm: the RoPE layers)
    l2_norm_layers: tuple[int, ...] = ()
    # config.json's final_logit_softcapping set (True) or null (False); None where it is left out: the
    # family's config class default (FamilyTraits.final_logit_softcap), as transformers would build it
    final_logit_softcapping: bool | None = None
    # mllama: the language model's layers that cross-attend to the image features instead of self-attending
    cross_attention_layers: tuple[int, ...] = ()
    # a conf/model entry's vision_config, as JSON (the figures are frozen and hashed): a vision-language
    # model whose vision tower is planned from it (planner/vision.py) and built with it (hf_config)
    vision_config_json: str | None = None

    @property
    def traits(self) -> FamilyTraits:
        return traits(self.architecture)

    @property
    def softcapped_logits(self) -> bool:
        """Whether the LM head's logits are soft-capped (TRL's fused head reads the config key)."""
        if self.final_logit_softcapping is None:
            return self.traits.final_logit_softcap
        return self.final_logit_softcapping

    @property
    def active_intermediate(self) -> int:
        """The MLP width one token runs through: an MoE layer's top-k experts (and its shared expert),
        else the dense intermediate size; what the activation terms count per token."""
        if self.num_experts:
            return self.routed_rows * self.expert_intermediate + self.shared_expert_intermediate
        return self.intermediate_size

    @property
    def routed_rows(self) -> int:
        """The expert rows a token makes: its top-k; Llama 4's experts run every token through every expert
        (a batched matmul over E copies of the tokens, the scores outside the top-k zero)."""
        return self.num_experts if self.traits.router == "sigmoid" else self.experts_per_token


_FIGURE_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size")


def _arch_biases(arch: str, cfg_json: Mapping[str, Any] | None = None) -> tuple[bool, bool, bool]:
    cj, family = cfg_json or {}, traits(arch)
    if family.qkv_bias:
        return True, False, False
    if family.config_biases:
        ab = bool(cj.get("attention_bias", False))
        return ab, ab, bool(cj.get("mlp_bias", False))
    return False, False, False


def given(model: ModelConfig, key: str) -> Any:
    """model.<key>, None where it is unset (???): a composed DictConfig raises on reading one."""
    try:
        value = getattr(model, key)
    except MissingMandatoryValue:
        return None
    return None if value == MISSING else value  # a dataclass built without it holds the "???" marker


def model_figures(model: ModelConfig) -> Figures:
    """Figures of cfg.model: a local dir's config.json; a hub id's config.json (HF cache, else the hub),
    which the conf/model entry naming it (model.hub_id) must agree with; that entry's figures offline."""
    name = given(model, "name_or_path")
    trust = bool(model.trust_remote_code)
    folder = local_dir(name)
    if folder is not None:
        return _figures_from_config_json(folder, trust)
    missing = [k for k in _FIGURE_FIELDS if given(model, k) is None]
    if name and _hub_shaped(str(name)):
        names_it = given(model, "hub_id") == name and not missing  # the entry's figures are this model's
        path, where = hub_config_json(str(name), given(model, "revision"))
        if path is not None:
            fig = _figures_from_config_json(path.parent, trust, source=f"{name}'s config.json from {where}")
            if names_it:
                _refuse_contradiction(_yaml_figures(model, str(name), trust), fig, str(name))
            return fig
        if not names_it:
            raise UserError(
                f"model.name_or_path={name} is a hub id whose config.json cannot be read ({where}), and the "
                f"figures of conf/model are another model's; {_entry_hint(str(name))}"
            )
    if missing:
        raise UserError(
            f"model {name or '<unnamed>'!s}: no architecture figures ({', '.join('model.' + k for k in missing)} "
            "unset) and no local config.json; pick a conf/model option, add one with the figures, "
            "or point model.name_or_path at a local model dir"
        )
    return _yaml_figures(model, name, trust)


def _hub_shaped(name: str) -> bool:
    """A name the hub could hold (check_model_dir refuses a missing local path of any other shape)."""
    return not name.startswith((".", "/", "~")) and name.count("/") <= 1


def _entry_hint(repo: str) -> str:
    """What to run instead: the shipped conf/model entry whose hub_id is `repo`, or a local dir."""
    from ..resources import CONF_DIR

    local = f"or point model.name_or_path at a local model dir (where there is a network: hf download {repo} --local-dir DIR)"
    for entry in sorted((CONF_DIR / "model").glob("*.yaml")):
        if any(
            line.split(":", 1)[1].strip() == repo
            for line in entry.read_text().splitlines()
            if line.startswith("hub_id:")
        ):
            return f"use model={entry.stem} (its figures, offline) {local}"
    return f"use a conf/model entry with its figures and hub_id: {repo}, {local}"


_COMPARED = _FIGURE_FIELDS + ("architecture", "tie_embeddings", "max_position_embeddings", "num_experts")
_COMPARED += ("experts_per_token", "expert_intermediate", "shared_expert_intermediate", "sliding_window")
_COMPARED += ("linear_v_heads", "linear_k_heads", "per_layer_input", "global_head_dim", "dense_intermediate")
_COMPARED += ("softcapped_logits",)


def _refuse_contradiction(entry: Figures, real: Figures, repo: str) -> None:
    """The conf/model entry naming `repo` must describe the model its config.json describes. A multimodal
    checkpoint's entry names its own model_type (gemma3, mllama), the figures its text_config's."""
    own = read_config(Path(real.config_dir) / "config.json").get("model_type") if real.config_dir else None
    wrong = [
        f"{k} {getattr(entry, k)} (config.json: {getattr(real, k)})"
        for k in _COMPARED
        if getattr(entry, k) != getattr(real, k) and not (k == "architecture" and entry.architecture == own)
    ]
    if wrong:
        raise UserError(
            f"the conf/model entry for {repo} contradicts its config.json ({real.source}): {', '.join(wrong)}; "
            "fix the entry's figures"
        )


def _yaml_figures(model: ModelConfig, name: Any, trust: bool) -> Figures:
    arch = str(model.architecture).lower()
    heads, hidden, head_dim = int(model.num_heads), int(model.hidden_size), model.head_dim
    qkv_bias, o_bias, mlp_bias = _arch_biases(arch, _entry_keys(model))
    fig = Figures(
        architecture=arch,
        hidden_size=hidden,
        num_layers=int(model.num_layers),
        num_heads=heads,
        num_kv_heads=int(model.num_kv_heads),
        head_dim=int(head_dim) if head_dim else (hidden // heads if heads else 0),
        intermediate_size=int(model.intermediate_size),
        vocab_size=int(model.vocab_size),
        tie_embeddings=bool(model.tie_embeddings),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        max_position_embeddings=int(model.max_position_embeddings),
        source="conf/model",
        trust_remote_code=trust,
        vision_config_json=_vision_json(model, name),
        **family_figures(arch, _entry_keys(model), f"model {name} (model.figures)"),
    )
    _check_figures(fig, f"model {name}")
    return fig


def _entry_keys(model: ModelConfig) -> dict[str, Any]:
    """A conf/model entry's config.json keys for the family's own layers: model.figures, over its
    intermediate_size (gpt-oss's config names the experts' width so) and its layers (the default layer
    patterns count them)."""
    own = {"intermediate_size": int(model.intermediate_size), "num_hidden_layers": int(model.num_layers)}
    return {**own, **dict(given(model, "figures") or {})}


def _vision_json(model: ModelConfig, name: Any) -> str | None:
    """model.vision_config as sorted JSON, None when unset; anything but a non-empty mapping is refused."""
    vc = given(model, "vision_config")
    if vc is None:
        return None
    vc = OmegaConf.to_container(vc, resolve=True) if OmegaConf.is_config(vc) else vc
    if not isinstance(vc, Mapping) or not vc:
        raise UserError(
            f"model {name}: model.vision_config={vc!r} must be a mapping of the checkpoint's config.json "
            "vision_config keys (hidden_size, num_hidden_layers, ...); fix it or set it to null"
        )
    return json.dumps(vc, sort_keys=True)


def _figures_from_config_json(path: Path, trust: bool, source: str | None = None) -> Figures:
    cj = read_config(path / "config.json")
    if "text_config" in cj and "hidden_size" not in cj:
        cj = {**cj["text_config"], "model_type": cj["text_config"].get("model_type", cj.get("model_type"))}
    arch = str(cj.get("model_type", "")).lower()
    cj = with_config_defaults(arch, cj)
    hidden = cj.get("hidden_size", cj.get("n_embd"))
    layers = cj.get("num_hidden_layers", cj.get("n_layer"))
    heads = cj.get("num_attention_heads", cj.get("n_head"))
    # Qwen3.5-MoE's config has no dense intermediate_size: its experts' width stands in (no layer uses it)
    inter = cj.get("intermediate_size", cj.get("n_inner")) or cj.get("moe_intermediate_size")
    vocab = cj.get("vocab_size")
    missing = [
        k
        for k, v in [
            ("hidden_size", hidden),
            ("num_hidden_layers", layers),
            ("num_attention_heads", heads),
            ("intermediate_size", inter),
            ("vocab_size", vocab),
        ]
        if v is None
    ]
    if missing or not arch:
        raise UserError(
            f"{path / 'config.json'}: lacks {', '.join(missing) or 'model_type'}; the planner needs them "
            "(or a conf/model option with the figures)"
        )
    kv = cj.get("num_key_value_heads") or heads
    head_dim = cj.get("head_dim") or hidden // heads
    tie_default = traits(arch).tie_embeddings  # the config class's default when config.json leaves it out
    qkv_bias, o_bias, mlp_bias = _arch_biases(arch, cj)
    fig = Figures(
        architecture=arch,
        hidden_size=int(hidden),
        num_layers=int(layers),
        num_heads=int(heads),
        num_kv_heads=int(kv),
        head_dim=int(head_dim),
        intermediate_size=int(inter),
        vocab_size=int(vocab),
        tie_embeddings=bool(cj.get("tie_word_embeddings", tie_default)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        max_position_embeddings=int(cj.get("max_position_embeddings", 4096) or 4096),
        positions=own_positions(cj),
        source=source or str(path / "config.json"),
        config_dir=str(path),
        trust_remote_code=trust,
        **family_figures(arch, cj, str(path / "config.json")),
    )
    _check_figures(fig, str(path / "config.json"))
    return fig


def own_positions(cj: Mapping[str, Any]) -> int:
    """The positions a config's own RoPE scaling reaches: its original_max_position_embeddings (else
    max_position_embeddings) times the factor, never fewer than max_position_embeddings (Llama 3.1's
    llama3 scaling already counts them there). Per layer type (Gemma 3): the most of any."""
    native = int(cj.get("max_position_embeddings", 4096) or 4096)
    rope = cj.get("rope_parameters") or cj.get("rope_scaling")
    if not isinstance(rope, Mapping):
        return native
    kinds = [r for r in rope.values() if isinstance(r, Mapping)] or [rope]
    most = native
    for r in kinds:
        factor = r.get("factor")
        if r.get("rope_type", r.get("type", "default")) == "default" or not isinstance(factor, (int, float)):
            continue
        original = r.get("original_max_position_embeddings") or cj.get("original_max_position_embeddings") or native
        most = max(most, int(int(original) * float(factor)))
    return most


def _check_figures(fig: Figures, where: str) -> None:
    for k in _FIGURE_FIELDS + ("head_dim",):
        v = getattr(fig, k)
        if not isinstance(v, int) or v <= 0:
            raise UserError(f"{where}: {k}={v!r} must be a positive integer")
    if fig.num_heads % fig.num_kv_heads:
        raise UserError(f"{where}: num_heads={fig.num_heads} is not a multiple of num_kv_heads={fig.num_kv_heads}")


def inventory(fig: Figures) -> tuple[Block, ...]:
    """The blocks of the model: analytic for the known families and vision-language layouts, from a meta
    model otherwise."""
    known = layout(fig)
    if known is not None:  # a vision-language model laid out from its figures (vlm_layout.py)
        return known.inventory(vision_language(fig))
    if fig.traits.known:
        return _analytic_inventory(fig)
    return _meta_inventory(fig)


def text_prefix(fig: Figures) -> str:
    """Where the language model's modules sit, as the loader names them: "model" in a causal LM, a laid-out
    VLM's as its layout names it (model.language_model; model.text_model in Idefics3 / SmolVLM),
    else the meta model's decoder (get_decoder, as model/vision.py finds it)."""
    known = layout(fig)
    if known is not None:
        return known.text_prefix
    if fig.traits.known:
        return "model"
    from ..model.vision import language_model

    try:
        return language_model(meta_model(fig, "bfloat16"))[0]
    except UserError:  # a checkpoint's own code without get_decoder: the causal LM's name
        return "model"


def final_norm(fig: Figures) -> str:
    """The language model's final norm, which FSDP gathers with the output head."""
    return f"{text_prefix(fig)}.norm"


@functools.lru_cache(maxsize=32)
def _analytic_inventory(fig: Figures) -> tuple[Block, ...]:
    return analytic_inventory(fig)


def hf_config(fig: Figures):
    """The transformers config of these figures: the local config.json, else built from the figures."""
    from transformers import AutoConfig

    try:
        if fig.config_dir:
            return AutoConfig.from_pretrained(fig.config_dir, trust_remote_code=fig.trust_remote_code)
        kwargs = dict(
            hidden_size=fig.hidden_size,
            num_hidden_layers=fig.num_layers,
            num_attention_heads=fig.num_heads,
            num_key_value_heads=fig.num_kv_heads,
            intermediate_size=fig.intermediate_size,
            vocab_size=fig.vocab_size,
            tie_word_embeddings=fig.tie_embeddings,
            max_position_embeddings=fig.max_position_embeddings,
            head_dim=fig.head_dim,
            attention_bias=fig.qkv_bias,
        )
        if fig.num_experts:  # both families' names: a config class keeps the one it reads
            kwargs.update(num_experts=fig.num_experts, num_local_experts=fig.num_experts)
            kwargs.update(num_experts_per_tok=fig.experts_per_token, moe_intermediate_size=fig.expert_intermediate)
        kwargs.update(config_keys(fig))
        subs = getattr(AutoConfig.for_model(fig.architecture), "sub_configs", None) or {}
        if "text_config" in subs:  # multimodal: the figures are its text model's, an entry's vision_config its tower
            vision = json.loads(fig.vision_config_json) if fig.vision_config_json and "vision_config" in subs else None
            return AutoConfig.for_model(
                fig.architecture, text_config=kwargs, **({"vision_config": vision} if vision else {})
            )
        return AutoConfig.for_model(fig.architecture, **kwargs)
    except (ValueError, KeyError, OSError, TypeError) as e:
        raise UserError(
            f"model.architecture={fig.architecture!r}: transformers cannot build it ({str(e).splitlines()[0]}); "
            f"use one of {', '.join(KNOWN_ARCHITECTURES)} or a local dir with config.json"
        ) from None


def vision_language(fig: Figures) -> bool:
    """The figures are a vision-language model's language model: an entry's vision_config, or a local
    config.json with one (that model loads as image-text-to-text, model/vision.py)."""
    if fig.vision_config_json:
        return True
    if not fig.config_dir or not (Path(fig.config_dir) / "config.json").is_file():
        return False
    return isinstance(read_config(Path(fig.config_dir) / "config.json").get("vision_config"), Mapping)


@functools.lru_cache(maxsize=4)
def meta_model(fig: Figures, dtype: str):
    """The model on the meta device, as from_pretrained builds it before loading (no weights): a
    vision-language model's as AutoModelForImageTextToText builds it, vision tower included."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - older transformers
        from transformers.modeling_utils import no_init_weights
    config = hf_config(fig)
    auto = AutoModelForImageTextToText if vision_language(fig) else AutoModelForCausalLM
    with init_empty_weights(), no_init_weights():
        return auto.from_config(config, dtype=torch_dtype(dtype), trust_remote_code=fig.trust_remote_code)


@functools.lru_cache(maxsize=8)
def _meta_inventory(fig: Figures) -> tuple[Block, ...]:
    import torch

    model = meta_model(fig, "bfloat16")
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    tied = dict(getattr(model, "all_tied_weights_keys", {}) or {})
    blocks: list[Block] = []
    vision = set(_vision_prefixes(model)) if vision_language(fig) else set()  # planner/vision.py's row

    def visit(name: str, module) -> None:
        if name in vision:
            return
        children, layer = list(module.named_children()), module.__class__.__name__ in no_split
        own = list(module.named_parameters(recurse=False))
        if own and not layer and any(m.__class__.__name__ in no_split for m in module.modules()):
            # a parameter beside the layers (LLaVA-NeXT's image_newline): a block of its own, as accelerate
            # places it, not the whole model in one block
            blocks.extend(Block(f"{name}.{n}", params=((f"{name}.{n}", p.numel()),)) for n, p in own)
            own = []
        if layer or not children or own:
            blocks.append(_block_from_module(name, module, tied, layer, torch))
            return
        for child, sub in children:
            visit(f"{name}.{child}" if name else child, sub)

    visit("", model)
    return tuple(blocks)


def _vision_prefixes(model) -> list[str]:
    from ..model.vision import vision_prefixes

    return vision_prefixes(model)


def _block_from_module(name: str, module, tied: dict, is_layer: bool, torch) -> Block:
    prefix = f"{name}." if name else ""
    linears, params, buffers, embeddings = [], [], [], []
    linear_params = set()
    for sub_name, sub in module.named_modules():
        full = prefix + sub_name if sub_name else name
        if type(sub) is torch.nn.Linear:  # what bitsandbytes replaces (Llama 4's router subclass stays)
            linears.append(Linear(full, sub.in_features, sub.out_features, sub.bias is not None))
            linear_params.add(f"{full}.weight")
            if sub.bias is not None:
                params.append((f"{full}.bias", sub.bias.numel()))
                linear_params.add(f"{full}.bias")
        elif isinstance(sub, torch.nn.Embedding):
            embeddings.append((full, sub.num_embeddings, sub.embedding_dim))
    experts = []
    for pname, p in module.named_parameters():
        full = prefix + pname
        if full in linear_params:
            continue
        if p.dim() == 3 and pname.rsplit(".", 1)[-1] in ("gate_up_proj", "up_proj", "down_proj"):
            experts.append((full, p.numel()))  # fused MoE experts: 4-bit under quant.experts=4bit
        else:
            params.append((full, p.numel()))
    for bname, b in module.named_buffers():
        size = 0 if b.is_floating_point() and b.dtype != torch.float32 else b.element_size()
        buffers.append((prefix + bname, b.numel(), size))
    tied_to = None
    if f"{name}.weight" in tied:
        tied_to = tied[f"{name}.weight"].rsplit(".", 1)[0]
        linears = []
        params = [p for p in params if p[0] != f"{name}.weight"]
    return Block(
        name, tuple(linears), tuple(params), tuple(buffers), tuple(embeddings), is_layer, tied_to, tuple(experts)
    )
