"""A plan counts what the run will really hold: every tensor peft trains (a `peft.modules_to_save` copy of
a tied lm_head is the whole V x h table, trained apart from the embeddings), and an evaluation no wider
than the eval split's rows."""

import pytest
from conftest import compose_cfg, sample_subset
from helpers_models import build_llama

from qlora_recipes import data, planner
from qlora_recipes.model import loading


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    root = tmp_path_factory.mktemp("llamas")
    return {tied: build_llama(root / f"tied-{tied}", tied) for tied in (True, False)}


@pytest.mark.parametrize("saved", [["lm_head"], ["embed_tokens"], ["embed_tokens", "lm_head"]])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_modules_to_save_are_planned_as_the_tensors_peft_trains(llamas, tmp_path, tied, saved):
    cfg = compose_cfg(f"model.name_or_path={llamas[tied]}", f"peft.modules_to_save=[{','.join(saved)}]")
    plan = planner.plan(cfg, gpus=[], ladder=False)
    model = loading.make_trainable(cfg, loading.load_model(cfg, tmp_path))
    trained = {id(p): p for p in model.parameters() if p.requires_grad}.values()
    assert plan["counts"]["trainable_params"] == sum(p.numel() for p in trained)
    copies = [p for n, p in model.named_parameters() if p.requires_grad and "modules_to_save" in n]
    assert len(copies) == len(saved) and all(p.shape == (1000, 128) for p in copies)


def _settled_for(tmp_path, eval_rows: int) -> tuple[dict, dict]:
    """(the plan before the data, the plan settled for it) of the shipped sample's rows with `eval_rows`
    eval rows, at trainer.eval_batch_size=16."""
    cfg = compose_cfg(*sample_subset(tmp_path, "", 40, eval_rows), "trainer.seq_len=64", "trainer.eval_batch_size=16")
    first = planner.plan(cfg, gpus=[], ladder=False)
    _, _, stats = data.load_splits(cfg.data, loading.load_tokenizer(cfg.model), 64, cfg.seed, cfg.objective)
    assert stats["rows"]["eval"] == eval_rows
    return first, planner.settle_for_data(cfg, first, stats, gpus=[])[1]


def _eval_peak(plan: dict) -> int:
    (cpu,) = [d for d in plan["devices"] if d["device"] == "cpu"]
    return cpu["peak_by_phase"]["eval"]


def test_an_eval_split_smaller_than_the_eval_batch_is_planned_at_its_rows(tmp_path):
    first, settled = _settled_for(tmp_path, 12)
    assert first["stack"]["eval_batch_size"] == 16 and settled["stack"]["eval_batch_size"] == 12
    assert settled["data_eval_rows"] == 12
    assert any("eval split's 12 rows" in note for note in settled["notes"])
    assert _eval_peak(settled) < _eval_peak(first)


def test_an_eval_split_of_a_full_batch_or_more_keeps_the_eval_batch(tmp_path):
    _, settled = _settled_for(tmp_path, 16)
    assert settled["stack"]["eval_batch_size"] == 16 and "data_eval_rows" not in settled
