"""data.padding_free and data.packing_strategy: composed, validated, passed to SFTConfig, planned."""

import pytest
from conftest import compose_cfg

from qlora_recipes import planner
from qlora_recipes.data.formats import format_kwargs
from qlora_recipes.errors import UserError
from qlora_recipes.run.validate import validate

GiB = 2**30


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("data.packing=true",),
        ("data.packing=true", "data.packing_strategy=bfd_split"),
        ("data.packing=true", "data.packing_strategy=wrapped"),
        ("data.packing=true", "data.padding_free=true"),
        ("data.packing=true", "data.padding_free=true", "model.attn_implementation=eager"),
    ],
)
def test_runnable_combinations_validate(overrides):
    validate(compose_cfg(*overrides), gpu_available=False, world_size=1)


@pytest.mark.parametrize(
    "overrides, gpu, line",
    [
        (
            ("data.packing=true", "data.packing_strategy=ffd"),
            False,
            "data.packing_strategy=ffd is not an option; choose one of: bfd, bfd_split, wrapped",
        ),
        (
            ("data.padding_free=true",),
            False,
            "data.padding_free=true without data.packing: TRL cannot cut rows to trainer.seq_len then; "
            "add data.packing=true (data.packing_strategy=bfd is padding-free by itself)",
        ),
        (
            ("data.packing=true", "model.attn_implementation=flash_attention_2"),
            False,
            "data.packing_strategy=bfd: model.attn_implementation=flash_attention_2 needs a CUDA GPU; use "
            "model.attn_implementation=auto here (sdpa_varlen: each packed sequence apart, no dense mask)",
        ),
        (
            ("data.packing=true", "data.padding_free=true", "model.attn_implementation=paged|sdpa"),
            True,
            "data.padding_free: model.attn_implementation=paged|sdpa does not keep packed sequences apart (they "
            "would attend to each other); use model.attn_implementation=auto (sdpa_varlen, or flash_attention_2 "
            "where installed)",
        ),
        (
            ("data.packing=true", "model.attn_implementation=flex_attention"),
            False,
            "model.attn_implementation=flex_attention needs a CUDA GPU to train (torch has no flex attention "
            "backward on a CPU); use model.attn_implementation=auto here",
        ),
        (
            ("model=gpt-oss-20b", "data.packing=true", "model.attn_implementation=sdpa_varlen"),
            True,
            "model.attn_implementation=sdpa_varlen: gpt_oss has attention sinks, which sdpa_varlen does not "
            "apply; use model.attn_implementation=auto",
        ),
    ],
)
def test_impossible_combinations_get_one_line(overrides, gpu, line):
    with pytest.raises(UserError) as err:
        validate(compose_cfg(*overrides), gpu_available=gpu, world_size=1)
    assert str(err.value) == line


def test_flash_padding_free_validates_with_a_gpu():
    cfg = compose_cfg("data.packing=true", "model.attn_implementation=flash_attention_2")
    validate(cfg, gpu_available=True, world_size=1)


def test_format_kwargs_reach_sft_config(tmp_path):
    from trl import SFTConfig

    cfg = compose_cfg("data.packing=true", "data.packing_strategy=wrapped", "data.padding_free=true")
    kwargs = format_kwargs(cfg.data, "prompt_completion")
    assert (kwargs["packing"], kwargs["packing_strategy"], kwargs["padding_free"]) == (True, "wrapped", True)
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, **kwargs)
    assert (args.packing, args.packing_strategy, args.padding_free) == (True, "wrapped", True)
    default = format_kwargs(compose_cfg().data, "text")
    assert (default["packing_strategy"], default["padding_free"]) == (SFTConfig.packing_strategy, False)


def _plan(*overrides):
    return planner.plan(compose_cfg(*overrides), gpus=None, host_ram=64 * GiB, world_size=1, ladder=False)


def test_plan_notes_the_upper_bound_and_keeps_the_token_count():
    plain, packed = _plan(), _plan("data.packing=true", "data.packing_strategy=wrapped")
    note = [n for n in packed["notes"] if n.startswith("data:")]
    assert len(note) == 1 and "upper bound" in note[0] and "no planned saving" in note[0]
    assert not [n for n in plain["notes"] if n.startswith("data:")]
    # wrapped packing is not padding-free: the same micro-batch shape, the same bytes
    assert [d["peak"] for d in packed["devices"]] == [d["peak"] for d in plain["devices"]]


def test_padding_free_on_eager_plans_the_flat_rows_mask():
    """Eager attention over one row of b*s tokens: b times the scores of b rows of s."""
    from qlora_recipes.planner.components import attention_rows, shared_per_device_bytes
    from qlora_recipes.planner.spec import spec_from_cfg

    eager = ("model.attn_implementation=eager", "trainer.seq_len=64")  # spec_from_cfg takes a number, not auto
    padded = spec_from_cfg(compose_cfg(*eager), 1)
    flat = spec_from_cfg(compose_cfg(*eager, "data.packing=true"), 1)
    b, s = padded.micro_batch, padded.seq_len
    assert attention_rows(padded, b) == (b, s) and attention_rows(flat, b) == (1, b * s)
    assert shared_per_device_bytes(flat, b, True) > shared_per_device_bytes(padded, b, True)
    assert "one flat row" in [n for n in _plan("data.packing=true")["notes"] if n.startswith("data:")][0]


@pytest.mark.parametrize(
    "overrides, picked",
    [
        ((), "sdpa"),
        (("data.packing=true", "data.packing_strategy=wrapped"), "sdpa"),  # not padding-free: rows, no position_ids
        (("data.packing=true",), "sdpa_varlen"),  # bfd: TRL trains it padding-free
        (("data.packing=true", "data.padding_free=true", "data.packing_strategy=wrapped"), "sdpa_varlen"),
        (("data.packing=true", "model.attn_implementation=sdpa"), "sdpa"),  # the user's choice stands
        (("data.packing=true", "model.attn_implementation=eager"), "eager"),
        (("model=gpt-oss-20b", "data.packing=true", "model.attn_implementation=auto"), "sdpa"),  # sinks: eager
    ],
)
def test_auto_attention_picks_the_unmasked_path_for_padding_free_batches(overrides, picked):
    assert compose_cfg(*overrides).model.attn_implementation == picked


def test_padding_free_plans_no_mask_on_the_varlen_path():
    """sdpa_varlen: no [n, n] mask, and K/V not repeated to every head (SDPA's native GQA)."""
    from qlora_recipes.planner.components import sdpa_masked, shared_per_device_bytes
    from qlora_recipes.planner.spec import spec_from_cfg

    flat = ("data.packing=true", "trainer.seq_len=64")
    varlen = spec_from_cfg(compose_cfg(*flat), 1)
    dense = spec_from_cfg(compose_cfg(*flat, "model.attn_implementation=sdpa"), 1)
    b = varlen.micro_batch
    assert (varlen.attn, dense.attn) == ("sdpa_varlen", "sdpa")
    assert sdpa_masked(dense, b) and not sdpa_masked(varlen, b)
    n = b * varlen.seq_len
    assert shared_per_device_bytes(dense, b, True) - shared_per_device_bytes(varlen, b, True) == n * n
    note = [n for n in _plan(*flat)["notes"] if n.startswith("data:")][0]
    assert "no mask (sdpa_varlen reads cu_seq_lens)" in note
