"""model.rope_scaling: transformers' RoPE scaling as a model option. The planner's positions become the
model's max_position_embeddings times its factor, and the loaded model's config carries the scaling."""

from __future__ import annotations

import pytest
from conftest import SMOKE, compose_cfg

from qlora_recipes.errors import UserError
from qlora_recipes.planner.seqlen import auto_cap, positions, refuse_past_positions

LINEAR_2 = "model.rope_scaling={rope_type:linear,factor:2.0}"  # the tiny model's 256 positions -> 512


def test_seq_len_past_native_positions_is_accepted_with_scaling():
    cfg = compose_cfg(*SMOKE, LINEAR_2, "trainer.seq_len=512")
    assert positions(cfg.model) == 512
    refuse_past_positions(cfg)  # no error


def test_seq_len_past_native_positions_without_scaling_names_the_option():
    with pytest.raises(UserError, match=r"256 positions.*model\.rope_scaling=\{rope_type:linear,factor:F\}"):
        refuse_past_positions(compose_cfg(*SMOKE, "trainer.seq_len=512"))


def test_seq_len_past_scaled_positions_is_refused():
    with pytest.raises(UserError, match=r"512 positions \(max_position_embeddings with model\.rope_scaling\)"):
        refuse_past_positions(compose_cfg(*SMOKE, LINEAR_2, "trainer.seq_len=576"))


def test_auto_seq_len_is_capped_at_the_scaled_positions():
    cfg = compose_cfg(*SMOKE, LINEAR_2, "trainer.seq_len=auto")
    cap, why = auto_cap(cfg, lambda trial, **_: {"fits": True}, lambda: None)
    assert cap == 512 and "factor=2.0" in why


def test_the_loaded_model_carries_the_scaling(tmp_path):
    from qlora_recipes.model import loading

    cfg = compose_cfg(*SMOKE, "model.rope_scaling={rope_type:yarn,factor:4}")
    model = loading.load_model(cfg, tmp_path)
    rope = model.config.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4
    assert rope["original_max_position_embeddings"] == 256 and "rope_theta" in rope
    assert model.model.rotary_emb.rope_type == "yarn"


def test_a_scaling_transformers_refuses_is_one_line_at_load():
    from qlora_recipes.model.loading import rope_scaled_config

    cfg = compose_cfg(*SMOKE)
    cfg.model.rope_scaling = {"rope_type": "llama3", "factor": 2.0}  # past the checks: transformers' own KeyError
    with pytest.raises(UserError, match=r"model\.rope_scaling=.*low_freq_factor"):
        rope_scaled_config(cfg.model)
