"""What a run of several ranks prints and writes, checked without training: the command that starts
the same job again (torchrun with as many ranks, or the `qlora launch` that started it), a metrics
file written through a temporary name no other writer uses, an earlier run's files of ranks this job
lacks dropped, and the options tested in one process refused under several processes whatever
dist= says. The ranks themselves: tests/e2e/test_ranks_stop_together_and_resume_as_launched.py."""

import json

import pytest
from conftest import compose_cfg

from qlora_recipes import invocation
from qlora_recipes.errors import UserError
from qlora_recipes.run import metrics
from qlora_recipes.run.validate import validate

TORCHRUN_RANK = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "1"}


def test_one_process_resumes_with_the_command_it_was_started_with():
    assert invocation.launcher_command("python train.py", {}) == "python train.py"
    assert invocation.launcher_command("qlora train", {"WORLD_SIZE": "1"}) == "qlora train"


def test_a_torchrun_rank_names_torchrun_with_as_many_ranks_over_the_same_script():
    assert (
        invocation.launcher_command("python train.py", TORCHRUN_RANK)
        == "torchrun --standalone --nproc_per_node 2 train.py"
    )
    assert (
        invocation.launcher_command("qlora train", TORCHRUN_RANK)
        == "torchrun --standalone --nproc_per_node 2 -m qlora_recipes train"
    )
    two_nodes = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    assert (
        invocation.launcher_command("python train.py", two_nodes) == "torchrun --nnodes 2 --nproc_per_node 4 train.py"
    )


def test_the_ranks_of_qlora_launch_resume_with_qlora_launch_and_the_recipe_first(monkeypatch):
    env = {**TORCHRUN_RANK, invocation.LAUNCH_ENV: "qlora launch --cpu"}
    monkeypatch.setattr(invocation, "_COMMAND", ["qlora train"])
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    invocation.set_command("qlora train")
    line = invocation.resume_command(["recipe=llama3.1-70b-2x24gb", "model=tiny", "hydra.run.dir=/r/x"], "/r/x")
    assert line == "qlora launch --cpu llama3.1-70b-2x24gb model=tiny resume=auto hydra.run.dir=/r/x"


def test_the_printed_resume_of_a_torchrun_rank_keeps_the_world_size(monkeypatch):
    monkeypatch.setattr(invocation, "_COMMAND", ["qlora train"])
    invocation.set_command("train.py", TORCHRUN_RANK)
    line = invocation.resume_command(["dist=fsdp", "trainer=smoke", "hydra.run.dir=runs/a"], "runs/a")
    assert (
        line
        == "torchrun --standalone --nproc_per_node 2 train.py dist=fsdp trainer=smoke resume=auto hydra.run.dir=runs/a"
    )


def test_a_metrics_write_leaves_another_writers_temporary_file_alone(tmp_path):
    """Two ranks writing through one temporary name: the second renamed the first's file away and
    the first's rename then failed (FileNotFoundError: metrics.json.tmp -> metrics.json)."""
    theirs = {"metrics.json.tmp": "another writer's, half written", ".metrics.json.1.tmp": "pid 1's"}
    for name, text in theirs.items():
        (tmp_path / name).write_text(text)
    metrics.write_metrics(tmp_path, {"status": "ok"})
    assert json.loads((tmp_path / "metrics.json").read_text()) == {"status": "ok"}
    assert {name: (tmp_path / name).read_text() for name in theirs} == theirs
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*theirs, "metrics.json"])  # none of its own left


def test_rank_zero_drops_the_metrics_of_ranks_this_job_does_not_have(tmp_path):
    for name in ("metrics.json", "metrics.rank1.json", "metrics.rank2.json", "metrics.rankX.json"):
        (tmp_path / name).write_text("{}")
    assert metrics.drop_rank_metrics(tmp_path, 2) == ["metrics.rank2.json"]
    assert metrics.drop_rank_metrics(tmp_path, 1) == ["metrics.rank1.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json", "metrics.rankX.json"]


@pytest.mark.parametrize(
    "overrides,named",
    [
        (("trainer.tiled_mlp=true",), "trainer.tiled_mlp=true"),
        (("trainer.lean_rmsnorm=true",), "trainer.lean_rmsnorm=true"),
        (("peft.adapter_dtype=bfloat16", "optim=adamw8bit"), "peft.adapter_dtype=bfloat16"),
    ],
)
def test_one_process_options_are_refused_under_torchrun_with_dist_none(overrides, named, monkeypatch):
    """dist=none under torchrun runs DDP: the options refused with dist= are refused by WORLD_SIZE too."""
    cfg = compose_cfg(*overrides)
    validate(cfg, gpu_available=False, world_size=1)
    with pytest.raises(UserError, match=rf"^{named} is tested in one process, not under 2 processes"):
        validate(cfg, gpu_available=False, world_size=2)
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets in each rank
    with pytest.raises(UserError, match=r"WORLD_SIZE=2"):
        validate(cfg, gpu_available=False)
