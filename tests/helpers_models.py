"""Tiny models built here for tests that need a shape the shipped one lacks (a tied table, a large
vocabulary): the shipped model's layers and tokenizer (its 100 ids are the first rows of the table)."""

import shutil
from pathlib import Path

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
