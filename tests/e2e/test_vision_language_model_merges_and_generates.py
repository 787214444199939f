"""A tiny LLaVA trained once through train.py (NF4 + LoRA, exact match on held-out squares), then merged in
bf16 and asked with `qlora generate --image`, as a user would: the metric is measured on image rows, the
vision tower and projector are written bit for bit as the base stored them, the merged dir loads with
AutoModelForImageTextToText and its processor, its logits on the image prompts stay within the merge's
tolerance, and the run dir and the merged dir answer alike."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO
from helpers_vision import build_llava, write_colour_rows

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
STEPS = 60


def _run(*argv: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=1200, env=ENV)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vlm")
    llava = build_llava(folder / "model")
    rows = write_colour_rows(folder / "data", repeats=12)
    run_dir = folder / "run"
    _run(
        str(REPO / "train.py"),
        f"model.name_or_path={llava}",
        f"data.path={rows}",
        "quant=nf4",
        "optim=paged8bit",
        "trainer=smoke",
        f"trainer.max_steps={STEPS}",
        "data.metric=exact_match",
        "data.eval_fraction=0.25",
        "data.max_new_tokens=4",
        f"hydra.run.dir={run_dir}",
    )
    return llava, rows.parent / "images", run_dir


@pytest.mark.slow
def test_a_trained_llava_scores_its_image_rows_merges_and_answers_with_images(trained):
    llava, images, run_dir = trained
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["data"]["metric"] == "eval loss + exact match"
    before, after = metrics["eval_exact_match_before"], metrics["eval_exact_match"]
    assert before == 0.0 and after > before, (before, after)  # held-out exact match rises

    merged = run_dir / "merged"
    _run("-m", "qlora_recipes", "merge", str(run_dir), "--dtype", "bfloat16")
    report = json.loads((merged / "merge_report.json").read_text())
    compare = report["compare"]
    assert compare["prompts_source"].startswith("eval data of the run") and compare["prompts"] == 8
    main = compare["vs_base_plus_adapter"]
    assert main["max_abs_diff"] < 2e-2 * main["ref_logit_absmax"] and main["argmax_agreement"] >= 0.95, main
    assert compare["adapter_effect"]["max_abs_diff"] > 10 * main["max_abs_diff"], compare  # a lost update shows

    _vision_tensors_are_the_bases(llava, merged)
    for name in ("processor_config.json", "chat_template.jinja", "tokenizer.json"):
        assert (merged / name).is_file(), name
    card = (merged / "README.md").read_text()
    assert "pipeline_tag: image-text-to-text" in card and "--image red.png" in card

    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(str(merged))
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    assert type(AutoProcessor.from_pretrained(str(merged))).__name__ == "LlavaProcessor"

    asked = [images / "red.png", images / "blue.png"]
    procs = {
        (folder.name, image.stem): subprocess.Popen(
            [
                sys.executable,
                "-m",
                "qlora_recipes",
                "generate",
                str(folder),
                "colour?",
                "--jsonl",
                "--image",
                str(image),
            ],
            cwd=REPO,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for folder in (run_dir, merged)
        for image in asked
    }
    answers = {}
    for key, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
        answers[key] = json.loads(out.strip())
    for image in asked:
        assert answers["run", image.stem] == answers["merged", image.stem], answers
        assert answers["run", image.stem]["images"] == [str(image)]


def _vision_tensors_are_the_bases(llava, merged) -> None:
    from safetensors.torch import load_file

    base = load_file(str(llava / "model.safetensors"))
    out = load_file(str(merged / "model.safetensors"))
    vision = [k for k in base if "vision_tower" in k or "multi_modal_projector" in k]
    assert vision and set(base) == set(out)
    for key in vision:
        assert out[key].dtype == base[key].dtype == torch.float32 and torch.equal(out[key], base[key]), key
    language = [k for k in base if k not in vision and base[k].is_floating_point()]
    assert {out[k].dtype for k in language} == {torch.bfloat16}
