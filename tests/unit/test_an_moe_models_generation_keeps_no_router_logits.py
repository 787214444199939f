"""TRL turns an MoE model's output_router_logits on for the load-balancing loss, and generate's forwards
read it from the config: each would keep every layer's router logits of all its tokens (the prefill's:
eval batch x prompt x experts a layer) and score them against the whole attention mask, which fails on the
decode steps of a batch of prompts. The exact-match metric's generation (outputs/generation.generate)
turns them off, so the planner's generation phase (planner/loss.generation_bytes) holds none."""

import pytest
import torch
from helpers_families import build_family

from qlora_recipes.outputs.generation import generate
from qlora_recipes.outputs.prompts import data_prompt


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "mixtral"])
def test_generating_a_batch_with_the_load_balancing_configs_router_logits_keeps_none(tmp_path, model_type):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = build_family(model_type, tmp_path / model_type)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    model.config.output_router_logits = True  # as SFTTrainer sets it where it adds the loss
    kept = []
    model.register_forward_hook(lambda m, args, kwargs, out: kept.append(out.router_logits), with_kwargs=True)
    prompts = [data_prompt("abcdefgh"), data_prompt("abc")]  # two prompts, left-padded into one batch
    answers = generate(model, AutoTokenizer.from_pretrained(str(folder)), prompts, "plain", 3, batch_size=2)
    assert len(answers) == 2
    assert len(kept) >= 2 and kept == [None] * len(kept)  # the prefill and each decode step: none kept
