"""A tiny MoE run with its experts in 4 bits (quant.experts=4bit, the default) keeps what a run promises
after training: stopped by SIGTERM it resumes to the very adapter of a run never stopped; merged, its
experts are the dequantized 4-bit weights training computed with plus their LoRA update (peft.experts=lora,
the default), rounded once to the run's dtype, its linears hold theirs, the files have the base
checkpoint's layout (names and shapes, in the run's dtype) and plain transformers loads them; the merged logits match the 4-bit base + adapter; generate answers alike from the run dir and the
merged dir. Models (helpers_models.py): random Qwen3-MoE and gpt-oss (biased, transposed experts, no
layout conversion), and a Mixtral built from the shipped tiny Llama (a layout transformers converts while
loading; it writes text where a random MoE greedily answers EOS).

Measured here (CPU, 8 eval prompts / 113 tokens): the merged model against the 4-bit base + adapter,
max |dlogit| 9e-6 (Mixtral, logit absmax 13.8) and 2e-7 (gpt-oss) in fp32; saved in bf16 (precision=auto
on a CPU with native bf16) 3.5e-2 (absmax 13.8) and 1.2e-3 (absmax 0.64), the weights' bf16 rounding
(helpers_merge.py); argmax 100 %; the adapter's own effect on the logits max ~0.4 to ~2.9."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import SMOKE, generate_alike, resumed_as_if_never_stopped, train_smoke
from helpers_merge import merged_logit_bound
from helpers_models import build_mixtral_from_tiny, build_moe
from safetensors import safe_open

from qlora_recipes.model import loading, moe_experts
from qlora_recipes.units import PRECISION_DTYPE

MERGED = ("mixtral", "gpt_oss")


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    models = {family: build_moe(family, root / family) for family in ("qwen3_moe", "gpt_oss")}
    return {**models, "mixtral": build_mixtral_from_tiny(root / "mixtral")}


@pytest.fixture
def expert_counts(monkeypatch) -> list[dict]:
    """quantize_experts' counts at every model load of the test."""
    seen = []
    real = loading.quantize_experts
    monkeypatch.setattr(loading, "quantize_experts", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    return seen


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_stopped_moe_run_resumes_to_the_adapter_of_a_run_never_stopped(
    family, bases, tmp_path, monkeypatch, expert_counts
):
    whole, resumed = resumed_as_if_never_stopped([*SMOKE, f"model.name_or_path={bases[family]}"], tmp_path, monkeypatch)
    assert resumed["train_losses"] == whole["train_losses"]
    assert len(expert_counts) == 3  # the whole run, the stopped one, the resumed one
    assert all(c["layers"] == 2 and c["weights"] == 4 and c["kept_16bit"] == 0 for c in expert_counts)


@pytest.fixture(scope="module")
def merged_runs(bases, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """{family: (run dir, merge report)}: a smoke run of each merged family, merged as `qlora merge RUN`
    merges (into RUN/merged, the run's dtype)."""
    from qlora_recipes.merge.pipeline import merge

    runs = {}
    for family in MERGED:
        _, run_dir = train_smoke(tmp_path_factory.mktemp(family) / "run", f"model.name_or_path={bases[family]}")
        runs[family] = (run_dir, merge(run_dir))
    return runs


def _layout(folder: Path) -> dict[str, tuple[list[int], str]]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {key: (f.get_slice(key).get_shape(), f.get_slice(key).get_dtype()) for key in f.keys()}  # noqa: SIM118


def _run_dtype(run_dir: Path) -> torch.dtype:
    """The dtype the run computed in (precision=auto: bf16 on a CPU with native bf16, else fp32)."""
    precision = yaml.safe_load((run_dir / "config.yaml").read_text())["precision"]["name"]
    return getattr(torch, PRECISION_DTYPE[precision])


def test_a_merged_moe_has_its_bases_checkpoint_layout_and_loads_in_plain_transformers(bases, merged_runs):
    from transformers import AutoModelForCausalLM

    for family, (run_dir, report) in merged_runs.items():
        out, dtype = run_dir / "merged", _run_dtype(run_dir)
        merged, base = _layout(out), _layout(bases[family])  # the tiny bases are fp32
        assert {k: shape for k, (shape, _) in merged.items()} == {k: shape for k, (shape, _) in base.items()}, family
        saved = {"float32": "F32", "bfloat16": "BF16"}[str(dtype).removeprefix("torch.")]
        assert {kind for _, kind in merged.values()} == {saved}, family  # saved in the run's dtype
        config = json.loads((out / "config.json").read_text())
        assert "quantization_config" not in config and config["dtype"] == str(dtype).removeprefix("torch.")
        assert report["merged_into"] == "dequantized 4-bit nf4 base"
        model, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
        assert not any(info.values()), (family, info)  # no key missing, unexpected or mismatched
        assert all(p.is_floating_point() for p in model.parameters())


def _expert_updates(stack) -> dict[str, torch.Tensor]:
    """{expert weight name: its LoRA update}, by peft's own get_delta_weight, of a loaded run stack."""
    from peft.tuners.lora.layer import ParamWrapper

    updates = {}
    for name, module in stack.get_base_model().named_modules():
        if isinstance(module, ParamWrapper):
            key = f"{name.replace('.base_layer', '')}.{module.parameter_name}"
            updates[key] = module.get_delta_weight("default").float()
    return updates


def test_merged_experts_are_the_dequantized_4bit_experts_training_computed_with_their_update(merged_runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from qlora_recipes.outputs.rundir import load_run_config, load_stack

    for family, (run_dir, _) in merged_runs.items():
        rounding = torch.finfo(_run_dtype(run_dir)).eps / 2  # the fp32 sum, rounded once: within half an ulp
        stack = load_stack(load_run_config(run_dir), run_dir)  # the 4-bit base as the run loaded it + adapter
        updates = _expert_updates(stack)
        merged = AutoModelForCausalLM.from_pretrained(str(run_dir / "merged"), dtype=torch.float32)
        params = {
            n.replace(".base_layer", ""): p
            for n, p in stack.get_base_model().named_parameters()
            if moe_experts.is_4bit(p) and len(p.quant_state.shape) == 3
        }
        assert len(params) == 4 and sorted(updates) == sorted(params), family
        for name, packed in params.items():
            assert updates[name].abs().max() > 0, name  # trained: B moved from its zero init
            expected = moe_experts.dequantized(packed, torch.float32) + updates[name]
            torch.testing.assert_close(merged.get_parameter(name), expected, rtol=rounding, atol=1e-6, msg=name)
        trained = stack.get_base_model()
        biases = [n for n, _ in trained.named_parameters() if "experts" in n and n.endswith("_bias")]
        assert len(biases) == (4 if family == "gpt_oss" else 0)
        for name in biases:
            assert torch.equal(
                merged.get_parameter(name.replace(".base_layer", "")), trained.get_parameter(name).float()
            )


def test_a_merged_moe_matches_its_4bit_base_plus_adapter(merged_runs):
    for family, (_, report) in merged_runs.items():
        c = report["compare"]
        main = c["vs_base_plus_adapter"]
        print(family, main, c["adapter_effect"])
        assert c["dtype"] == "float32" and c["prompts"] == 8
        assert main["max_abs_diff"] < merged_logit_bound(report), family
        assert main["argmax_agreement"] == 1.0, family
        assert c["adapter_effect"]["max_abs_diff"] > 20 * main["max_abs_diff"], family  # a lost update shows


def test_qlora_generate_answers_alike_from_the_moe_run_and_its_merged_dir(merged_runs):
    run_dir, _ = merged_runs["mixtral"]
    answers = generate_alike([run_dir, run_dir / "merged"])
    assert answers[0] == answers[1] and answers[0]["prompt"] == "dcba"
    assert answers[0]["generation"].strip(), answers  # text: the model built from the tiny Llama writes some
