"""The dense families people fine-tune now (Qwen3, Qwen3.5's Gated DeltaNet, Gemma 3 and 4, SmolLM3) go
through what follows training as Llama does: a smoke run of each tiny model (tests/helpers_families.py,
built from its transformers config class) merges with `qlora merge RUN` semantics, the merge's quality
check passing (the merged logits against the 4-bit base + adapter), and `qlora generate` answers alike
from the run dir and the merged dir. The MoE families have their own file
(test_moe_runs_resume_merge_and_generate.py, and expert LoRA's)."""

import pytest
from conftest import generate_alike, train_smoke
from helpers_families import build_family

# ~40 s each on 2 cores: the Gated DeltaNet family in the default run, the others with the slow ones
FAMILIES = [
    "qwen3_5_text",
    *(pytest.param(f, marks=pytest.mark.slow) for f in ("qwen3", "gemma3_text", "gemma4_text", "smollm3")),
]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_new_family_merges_with_its_quality_check_and_generates_alike_merged(tmp_path, model_type):
    from qlora_recipes.merge.pipeline import merge

    base = build_family(model_type, tmp_path / "base")
    out, run_dir = train_smoke(tmp_path / "run", f"model.name_or_path={base}", "quant=nf4", "optim=paged8bit")
    assert out["status"] == "ok"
    report = merge(run_dir)
    check = report["compare"]
    assert check["vs_base_plus_adapter"]["argmax_agreement"] == 1.0, check
    assert check["vs_base_plus_adapter"]["max_abs_diff"] < 1e-3, check
    # the adapter moved the logits far more than the merge's rounding did: a lost update would show
    assert check["adapter_effect"]["max_abs_diff"] > 10 * check["vs_base_plus_adapter"]["max_abs_diff"], check
    from_run, from_merged = generate_alike([run_dir, run_dir / "merged"])
    assert from_run == from_merged and from_run["prompt"] == "dcba", (from_run, from_merged)
