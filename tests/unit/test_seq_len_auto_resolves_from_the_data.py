"""trainer.seq_len=auto: the train rows' longest tokenized length (or a percentile of them), rounded up to
a multiple of 64, capped by the model's positions and by the longest sequence that fits, with the reason
in one line; before the data is read it plans at that cap and says so. A number past the model's
positions is refused (test_bad_input_gets_one_line.py has the line)."""

import pytest
from conftest import compose_cfg

from qlora_recipes import planner
from qlora_recipes.config.adapters import settled
from qlora_recipes.config.loader import to_yaml
from qlora_recipes.errors import UserError
from qlora_recipes.planner.seqlen import resolve_auto
from qlora_recipes.run.resume import stack_changes
from qlora_recipes.units import GiB

POSITIONS = "the model's positions (max_position_embeddings=256)"


def test_the_longest_row_rounded_up_to_a_multiple_of_64():
    value, line = resolve_auto([12, 93, 40], 100, 256, POSITIONS, "my.jsonl")
    assert value == 128
    assert line == (
        "trainer.seq_len=auto -> 128 (the longest tokenized train row of my.jsonl, 93 tokens, "
        "rounded up to a multiple of 64)"
    )
    assert resolve_auto([22, 5], 100, 256, POSITIONS, "s")[0] == 64  # the shipped sample: 64, as it was
    assert resolve_auto([64], 100, 256, POSITIONS, "s")[0] == 64


def test_a_percentile_covers_that_share_of_the_rows():
    lengths = list(range(1, 201))  # 1..200 tokens
    value, line = resolve_auto(lengths, 90, 256, POSITIONS, "my.jsonl")
    assert value == 192  # 180 tokens: 90 % of the rows fit whole
    assert "trainer.seq_len_percentile=90 of the tokenized train rows of my.jsonl, 180 tokens (longest 200)" in line


def test_capped_by_the_model_positions_with_the_reason():
    value, line = resolve_auto([100, 400], 100, 256, POSITIONS, "my.jsonl")
    assert value == 256
    assert line == (
        "trainer.seq_len=auto -> 256 (the longest tokenized train row of my.jsonl, 400 tokens; "
        f"capped at 256: {POSITIONS})"
    )


def test_without_data_auto_plans_at_the_model_positions_and_says_so():
    plan = planner.plan(compose_cfg("trainer=smoke"))
    assert plan["stack"]["seq_len"] == 256 and plan["fits"]
    assert (
        "trainer.seq_len=auto planned at 256, the model's positions (max_position_embeddings=256): the most it "
        "resolves to once the data's rows are read"
    ) in plan["notes"]


def test_capped_by_the_longest_sequence_that_fits():
    """0.8 GiB of host RAM: 64 tokens x 64 rows fit (0.68 GiB), 256 do not (0.86): the cap is between."""
    cfg = compose_cfg("trainer=smoke", "trainer.micro_batch_size=64")
    plan = planner.plan(cfg, host_ram=int(0.8 * GiB))
    cap = plan["seq_len_auto"]["cap"]
    assert 64 <= cap < 256 and cap % 64 == 0 and plan["fits"]
    assert plan["seq_len_auto"]["why"] == "the longest sequence that fits cpu's 0.8 GiB"
    assert cap == planner.longest_seq_len(cfg, host_ram=int(0.8 * GiB))
    assert resolve_auto([250], 100, cap, plan["seq_len_auto"]["why"], "f")[1].endswith(
        f"capped at {cap}: the longest sequence that fits cpu's 0.8 GiB)"
    )


def test_a_run_plans_and_saves_what_auto_resolved_to():
    cfg = compose_cfg("trainer=smoke")
    first = planner.plan(cfg)
    resolve = planner.seq_len_for_data(cfg, first)
    value = resolve([30, 70], "my.jsonl")
    settled, plan = planner.settle_for_data(cfg, first, {"seq_len": value, "max_tokens": {"train": 128}})
    assert value == 128 and settled.trainer.seq_len == 128 and plan["stack"]["seq_len"] == 128
    assert "seq_len: 128" in to_yaml(settled) and cfg.trainer.seq_len == "auto"
    fixed = compose_cfg("trainer=smoke", "trainer.seq_len=64")  # an explicit number: as it is
    assert (
        planner.seq_len_for_data(fixed, first) == 64
        and planner.settle_for_data(fixed, first, {"seq_len": 64})[0] is fixed
    )


def test_resuming_with_auto_is_not_a_stack_change():
    saved = settled(compose_cfg("trainer=smoke", "trainer.seq_len=128"))  # as config.yaml records it
    assert stack_changes(saved, compose_cfg("trainer=smoke")) == []
    assert stack_changes(saved, compose_cfg("trainer=smoke", "trainer.seq_len=64")) == ["trainer.seq_len"]


def test_the_shipped_defaults_use_auto_and_recipes_keep_their_number():
    assert compose_cfg().trainer.seq_len == "auto" and compose_cfg("trainer=smoke").trainer.seq_len == "auto"
    assert compose_cfg("trainer=standard").trainer.seq_len == 2048


def test_a_number_past_the_model_positions_is_refused_by_the_plan():
    with pytest.raises(UserError, match=r"trainer.seq_len=257 is past .*'s 256 positions \(max_position_embeddings\)"):
        planner.plan(compose_cfg("trainer=smoke", "trainer.seq_len=257"))
    assert planner.plan(compose_cfg("trainer=smoke", "trainer.seq_len=256"))["stack"]["seq_len"] == 256


def test_the_plan_settled_on_the_data_keeps_the_first_plans_host_ram():
    """A recipe's hardware.host_ram_gib below this machine's RAM bounds the run's plan; the plan made
    again for the rows' real length (or seq_len=auto's) is made within the same budget."""
    budget = int(0.8 * GiB)
    cfg = compose_cfg("trainer=smoke", "trainer.seq_len=256")
    first = planner.plan(cfg, host_ram=budget)
    _, plan = planner.settle_for_data(cfg, first, {"seq_len": 256, "max_tokens": {"train": 100}}, host_ram=budget)
    assert plan["data_longest_row"] < 256  # made again for the rows
    assert plan["devices"][0]["budget"] == first["devices"][0]["budget"] == budget  # a CPU run: the RAM is its device
