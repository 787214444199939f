"""Tiny models built here for tests that need a shape the shipped one lacks (a tied table, a large
vocabulary, MoE experts): the shipped model's tokenizer (its 100 ids are the first rows of the table)
and, where it can, its layers."""

import shutil
from pathlib import Path

from helpers_families import COMMON

TINY = Path(__file__).resolve().parents[1] / "assets" / "tiny-llama"


def build_llama(out: Path, tied: bool, vocab: int = 1000) -> Path:
    """A 2-layer Llama of the shipped model's shape with `vocab` rows, tied embeddings or not."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=tied,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(str(out))
    for f in [*TINY.glob("tokenizer*"), TINY / "chat_template.jinja"]:
        shutil.copy(f, out)
    return out


def build_moe(family: str, out: Path) -> Path:
    """A 2-layer `family` model (qwen3_moe or gpt_oss) with hidden 64, random weights, and the shipped
    tokenizer: its fused experts are what quant.experts=4bit stores in 4 bits."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    common = {k: v for k, v in COMMON.items() if k != "intermediate_size"}  # MoE widths are the family's
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **common, intermediate_size=128, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2
        )
    else:
        config = transformers.GptOssConfig(**common, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(out))
    return _with_tokenizer(out)


def build_mixtral_from_tiny(out: Path, experts: int = 4) -> Path:
    """A 2-layer Mixtral that answers like the shipped model: its attention, embeddings, norms and head
    are the tiny Llama's, and each of its experts is that Llama's MLP with 5 % noise on every weight
    (random routers; Mixtral's top-2 weights sum to 1). A random MoE greedily answers EOS and nothing
    else; this one writes text, so generation has something to show. Saved by transformers in
    Mixtral's own checkpoint layout (per-expert w1/w2/w3 under block_sparse_moe)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    llama = AutoModelForCausalLM.from_pretrained(str(TINY), dtype=torch.float32)
    c = llama.config
    config = transformers.MixtralConfig(
        **{k: getattr(c, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")},
        **{k: getattr(c, k) for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps")},
        max_position_embeddings=c.max_position_embeddings,
        rope_parameters=dict(c.rope_parameters),
        num_local_experts=experts,
        num_experts_per_tok=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    same = llama.state_dict()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name in same:
                tensor.copy_(same[name])
        for layer, dense in zip(model.model.layers, llama.model.layers, strict=True):
            gate_up = torch.cat([dense.mlp.gate_proj.weight, dense.mlp.up_proj.weight])
            down = dense.mlp.down_proj.weight
            for e in range(experts):
                layer.mlp.experts.gate_up_proj[e] = gate_up * (1 + 0.05 * torch.randn_like(gate_up))
                layer.mlp.experts.down_proj[e] = down * (1 + 0.05 * torch.randn_like(down))
    model.save_pretrained(str(out))
    return _with_tokenizer(out)


def _with_tokenizer(out: Path) -> Path:
    for f in [*TINY.glob("tokenizer*"), TINY / "chat_template.jinja"]:
        shutil.copy(f, out)
    return out
