"""Whether the LM head's logits are soft-capped comes from the model's own config key,
`final_logit_softcapping`, which TRL's fused head reads (add_fused_lm_head): Gemma 4's config class
leaves it unset but its checkpoints set it, Gemma 3's set it null, Gemma 2's class sets it. Left out
of config.json (or of a conf/model entry's figures), the family's config class default applies."""

import json
from dataclasses import replace

import pytest
from conftest import compose_cfg

from qlora_recipes.config.schema import ModelConfig
from qlora_recipes.errors import UserError
from qlora_recipes.planner import loss
from qlora_recipes.planner.figures import model_figures
from qlora_recipes.planner.spec import spec_from_cfg

FIGURES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=32000)


def _figures(tmp_path, arch: str, **keys):
    folder = tmp_path / f"{arch}-{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": arch, **FIGURES, **keys}))
    return model_figures(ModelConfig(name_or_path=str(folder), architecture=arch))


@pytest.mark.parametrize(
    "arch, keys, capped",
    [
        ("gemma4_text", {"final_logit_softcapping": 30.0}, True),  # what Gemma 4 checkpoints ship
        ("gemma4_text", {}, False),  # Gemma4TextConfig's default: None
        ("gemma2", {}, True),  # Gemma2Config's default: 30.0
        ("gemma2", {"final_logit_softcapping": None}, False),
        ("llama", {"final_logit_softcapping": 30.0}, True),  # any family whose config sets it
    ],
)
def test_the_config_key_decides_whether_the_loss_is_soft_capped(tmp_path, arch, keys, capped):
    assert _figures(tmp_path, arch, **keys).softcapped_logits is capped


def test_a_soft_capped_config_plans_the_tanh_tile_of_the_cpu_loss(tmp_path):
    """The same model with and without the key: the CPU backward's fold keeps tanh of every tile element
    beside the others (FOLD_BYTES['softcap'] per element: 4 bytes, b*(s-1) x the vocabulary)."""
    st = spec_from_cfg(compose_cfg("trainer.seq_len=512", "trainer.micro_batch_size=1"), 1)
    capped, plain = (
        replace(st, fig=_figures(tmp_path, "gemma4_text", **keys)) for keys in ({"final_logit_softcapping": 30.0}, {})
    )
    extra = loss.train_loss_bytes(capped, 1, on_cpu=True) - loss.train_loss_bytes(plain, 1, on_cpu=True)
    assert extra == loss.FOLD_BYTES["softcap"] * 511 * 32000
    # Triton's fold keeps nothing of a tile: on a GPU the cap costs no memory
    assert loss.train_loss_bytes(capped, 1) == loss.train_loss_bytes(plain, 1)


@pytest.mark.parametrize("value", ["30", 0, -1.0, True])
def test_a_final_logit_softcapping_that_is_not_a_positive_number_is_refused(tmp_path, value):
    with pytest.raises(UserError, match="final_logit_softcapping=.* must be a positive number or null"):
        _figures(tmp_path, "gemma4_text", final_logit_softcapping=value)


def test_the_gemma4_entry_plans_the_cap_its_checkpoint_ships():
    assert model_figures(compose_cfg("model=gemma4-31b").model).softcapped_logits
