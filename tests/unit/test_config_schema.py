"""The typed config: each key's facts live on its schema field and drive the checks; the one loader
gives a TrainConfig of plain values; overrides apply to a typed config; a saved config.yaml reads
back equal; `qlora plan` refuses a bad value with the line `qlora train` prints."""

import copy
import dataclasses

import pytest
from conftest import compose_cfg

from qlora_recipes.config import checks
from qlora_recipes.config.adapters import settled
from qlora_recipes.config.fields import keys, option, range_ok, resume_safe_prefixes
from qlora_recipes.config.loader import load, read_saved, to_yaml, with_overrides
from qlora_recipes.config.schema import OPTIMIZERS, QUANT_METHODS, TrainConfig
from qlora_recipes.errors import UserError
from qlora_recipes.run.resume import RESUME_SAFE_PREFIXES, stack_changes

SMOKE = ["trainer=smoke", "data.metric=null"]


def test_every_field_has_help_text():
    missing = [key for key, f in keys(TrainConfig) if not str(f.metadata.get("help", "")).strip()]
    assert not missing, missing


def test_value_sets_live_once_on_their_fields():
    fields = dict(keys(TrainConfig))
    assert fields["quant.method"].metadata["choices"] == QUANT_METHODS
    assert fields["optim.name"].metadata["choices"] == OPTIMIZERS
    assert checks.CHOICES["quant.method"] is QUANT_METHODS


@dataclasses.dataclass
class _Group:
    mode: str = option("a", "how it runs", choices=("a", "b"))
    count: int = option(2, "things counted", positive=True)
    share: float = option(0.5, "a share of it", range="[0, 1)")
    cap: int | None = option(None, "null: no cap", range=">= 1|null")
    noisy: bool = option(False, "says more", resume_safe=True)


@dataclasses.dataclass
class _Root:
    group: _Group = option(_Group, "the group")
    side: _Group = option(_Group, "a group whose keys may all change on resume", resume_safe=True)


def test_resume_safety_comes_from_the_fields_a_whole_group_by_its_parent():
    assert resume_safe_prefixes(_Root) == ("group.noisy", "side.")
    assert "logger." in RESUME_SAFE_PREFIXES and "trainer.max_steps" in RESUME_SAFE_PREFIXES
    assert not any(p.startswith("peft") for p in RESUME_SAFE_PREFIXES)


def test_range_rules_read_as_written():
    assert range_ok(None, ">= 1|null") and not range_ok(None, ">= 1")
    assert range_ok(0.0, "[0, 1)") and not range_ok(1.0, "[0, 1)")
    assert range_ok(-1, ">= -1") and not range_ok(0, "> 0") and not range_ok(float("inf"), "> 0")
    assert not range_ok(True, ">= 0")  # a bool is not a count


@pytest.mark.parametrize(
    "overrides,line",
    [
        (["quant.method=nf5"], "quant.method=nf5 is not an option; choose one of: nf4, fp4, int8, none"),
        (["optim.name=lion"], "optim.name=lion is not an option; choose one of: paged_adamw_8bit"),
        (["trainer.grad_accum=0"], "trainer.grad_accum=0 must be positive"),
        (["peft.r=0"], "peft.r=0 must be positive"),
        (["optim.beta2=1.0"], "optim.beta2=1.0 must be in [0, 1) (Adam's second-moment decay)"),
        (["model.head_dim=0"], "model.head_dim=0 must be >= 1 or null (null: hidden_size / num_heads)"),
        (["model.num_layers=0"], "model.num_layers=0 must be >= 1 or null (an architecture figure)"),
    ],
)
def test_field_metadata_drives_the_config_checks(overrides, line):
    with pytest.raises(UserError) as err:
        checks.check_stack(compose_cfg(*overrides))
    assert str(err.value).startswith(line)


@pytest.fixture(scope="module")
def default_cfg() -> TrainConfig:
    return compose_cfg()


@pytest.mark.parametrize("key", sorted(checks.RANGES))
def test_a_range_message_names_the_rule_and_quotes_the_fields_help(key, default_cfg):
    cfg = copy.deepcopy(default_cfg)
    group, _, name = key.rpartition(".")
    node = getattr(cfg, group) if group else cfg
    setattr(node, name, -(2**40))  # below every range
    rule, meaning = checks.RANGES[key]
    with pytest.raises(UserError) as err:
        checks.check_ranges(cfg)
    bound = rule.partition("|")[0]
    assert str(err.value).startswith(f"{key}={-(2**40)} must be ") and f"{bound} " in str(err.value) + " "
    assert f"({meaning})" in str(err.value)


def test_load_returns_a_train_config_of_plain_values():
    cfg = load([*SMOKE, "peft.target_modules=[q_proj,v_proj]", "offload=cpu"])
    assert type(cfg) is TrainConfig
    assert type(cfg.peft.target_modules) is list and cfg.peft.target_modules == ["q_proj", "v_proj"]
    assert type(cfg.offload.max_memory) is dict and type(cfg.quant.skip_modules) is list
    assert cfg.quant.compute_dtype == cfg.precision.dtype and isinstance(cfg.optim.lr, float)  # resolved


@pytest.mark.parametrize(
    "overrides,needle",
    [(["+trainer.extra_knob=3"], "unknown key trainer.extra_knob"), (["peft.r=0"], "peft.r=0 must be positive")],
)
def test_load_refuses_in_one_line(overrides, needle):
    with pytest.raises(UserError) as err:
        load(overrides)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_overrides_apply_to_a_typed_config_as_a_new_one():
    cfg = compose_cfg(*SMOKE)
    changed = with_overrides(cfg, ["trainer.micro_batch_size=2", "trainer.gradient_checkpointing=false"])
    assert type(changed) is TrainConfig
    assert (changed.trainer.micro_batch_size, changed.trainer.gradient_checkpointing) == (2, False)
    assert cfg.trainer.micro_batch_size != 2 or cfg.trainer.gradient_checkpointing  # the original is untouched
    assert changed.peft == cfg.peft
    with pytest.raises(UserError, match="micro_batch_sise"):
        with_overrides(cfg, ["trainer.micro_batch_sise=2"])


def test_the_oom_ladder_rung_is_the_typed_config_with_its_overrides():
    from qlora_recipes.run.lifecycle import next_in_process_rung

    cfg = compose_cfg(*SMOKE, "trainer.micro_batch_size=4", "trainer.grad_accum=2")
    rung, applied = next_in_process_rung(cfg)
    assert applied == "trainer.micro_batch_size=2 trainer.grad_accum=4"
    assert (rung.trainer.micro_batch_size, rung.trainer.grad_accum) == (2, 4) and cfg.trainer.micro_batch_size == 4


def test_a_saved_config_yaml_reads_back_equal(tmp_path):
    # as a run saves it: peft.adapter_dtype=auto settled for this CPU's precision (a saved auto is a config
    # from before the key, which trained float32)
    cfg = settled(compose_cfg(*SMOKE, "peft.r=8", "offload=cpu", "logger=[tensorboard,wandb]"))
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    again = read_saved(path)
    assert again == cfg and stack_changes(again, cfg) == []


def test_config_yaml_is_what_the_composed_config_resolves_to():
    from omegaconf import OmegaConf

    from qlora_recipes.config.loader import compose

    overrides = [*SMOKE, "model=llama2-70b", "offload=cpu", "peft.target_modules=[q_proj]"]
    assert to_yaml(compose_cfg(*overrides)) == OmegaConf.to_yaml(compose(overrides), resolve=True)


def test_a_saved_key_the_schema_no_longer_reads_counts_as_changed(tmp_path):
    cfg = settled(compose_cfg(*SMOKE))  # as a run saves it: peft.adapter_dtype=auto settled
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg).replace("peft:\n", "peft:\n  old_knob: 1\n", 1))
    with pytest.raises(Exception, match="old_knob"):
        read_saved(path)
    dropped: list[str] = []
    saved = read_saved(path, dropped)
    assert dropped == ["peft.old_knob"] and stack_changes(saved, cfg, dropped) == ["peft.old_knob"]


# ---------------------------------------------------------------- plan and train refuse alike
def _stderr_line(run, argv, capsys) -> tuple[int, str]:
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with pytest.raises(SystemExit) as stop:
        run(argv)
    GlobalHydra.instance().clear()
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    return stop.value.code, lines[-1] if lines else ""


@pytest.mark.parametrize("bad", ["quant.method=nf5", "peft.r=0", "optim.beta1=1.5", "data.too_long=cut"])
def test_plan_and_train_refuse_a_bad_value_with_the_same_line(bad, tmp_path, capsys, monkeypatch):
    import logging
    import sys

    from qlora_recipes.cli import plan as plan_command
    from qlora_recipes.cli import train as train_command

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(plan_command, "_HARDWARE", {})
    monkeypatch.chdir(tmp_path)
    trained = _stderr_line(train_command.run, [*SMOKE, bad, f"hydra.run.dir={tmp_path / 'train'}"], capsys)
    planned = _stderr_line(plan_command.run, [*SMOKE, bad, f"hydra.run.dir={tmp_path / 'plan'}"], capsys)
    assert trained[0] == planned[0] == 2
    assert trained[1] == planned[1] and trained[1].startswith(f"error: {bad.split('=')[0]}="), (trained, planned)
    assert not (tmp_path / "train").exists()
