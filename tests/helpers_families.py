"""Tiny models of every family the family table knows, built offline from transformers' own config
classes (2 layers, hidden 64, random weights) and saved as a user's model dir with the shipped
character tokenizer: what the unit checks of the table and the e2e training runs both load."""

import shutil
from pathlib import Path

TINY = Path(__file__).resolve().parents[1] / "assets" / "tiny-llama"

COMMON = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
_LINEAR_ATTENTION = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)

# model_type -> (config class, what differs from COMMON): one local layer beside a global one, a few experts
FAMILY_CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "gemma2": ("Gemma2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "qwen3_moe": ("Qwen3MoeConfig", _MOE),
    "qwen3_5_text": ("Qwen3_5TextConfig", _LINEAR_ATTENTION),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", {**_LINEAR_ATTENTION, **_MOE, "shared_expert_intermediate_size": 64}),
    "gemma3_text": ("Gemma3TextConfig", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}),
    "gemma4_text": (
        "Gemma4TextConfig",
        {
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 8,
            "hidden_size_per_layer_input": 16,
            "vocab_size_per_layer_input": 100,
            "global_head_dim": 16,
        },
    ),
    "gpt_oss": ("GptOssConfig", {"intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "mixtral": ("MixtralConfig", {"intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "llama4_text": (
        "Llama4TextConfig",
        {"intermediate_size": 64, "intermediate_size_mlp": 128, "num_local_experts": 4, "attention_chunk_size": 8},
    ),
    "smollm3": ("SmolLM3Config", {}),
}


def tiny_config(model_type: str):
    """The transformers config of the tiny `model_type` model."""
    import transformers

    name, extra = FAMILY_CONFIGS[model_type]
    return getattr(transformers, name)(**{**COMMON, **extra})


def build_family(model_type: str, out: Path) -> Path:
    """A tiny random `model_type` model saved in `out` (safetensors, config.json, the shipped tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(model_type)).save_pretrained(str(out))
    for f in [*TINY.glob("tokenizer*"), TINY / "chat_template.jinja"]:
        shutil.copy(f, out)
    return out
