"""`qlora eval` puts a trained run beside its base (and its merge) on a local lm-eval task, and
`qlora export --to vllm` prints the serve command for it; a run trained with modules_to_save is told
at plan time that vLLM will not load it, and refused by `--to vllm` in one line."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, SMOKE, train_smoke

from qlora_recipes.cli import main as qlora


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        qlora(list(argv))
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


def write_task(folder: Path, rows: int = 12) -> Path:
    """A loglikelihood task over the shipped sample's first eval rows (a jsonl and a YAML with its
    absolute path): lm-eval offline; its perplexity moves with any change of the weights."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = (REPO / "assets/data/order/eval.jsonl").read_text().splitlines()[:rows]
    (folder / "rows.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "order_local.yaml").write_text(
        "task: order_local\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'rows.jsonl'}\n"
        "test_split: test\noutput_type: loglikelihood\n"
        'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{completion}}"\ntarget_delimiter: ""\n'
        "metric_list:\n  - metric: perplexity\n    aggregation: perplexity\n    higher_is_better: false\n"
    )
    return folder


def _log_ppl_bound(run_dir: Path, tasks: Path) -> float:
    """How far ln(perplexity) of the merged model may be from the tuned stack's. fp32: 0.05 (measured
    well inside). bf16 (precision=auto on a CPU with native bf16): both evaluate in bf16, where a logit
    is known to half an ulp, 2^-8 of the largest (the merge report's logit absmax), and so is each
    completion token's log-probability; ln(perplexity) sums those over a row's completion tokens
    (measured: 0.0625 with 4.7 tokens and logits up to 15, a bound of 0.28; the adapter moves it 2.6)."""
    from transformers import AutoTokenizer

    precision = yaml.safe_load((run_dir / "config.yaml").read_text())["precision"]["name"]
    if precision == "fp32":
        return 0.05
    tokenizer = AutoTokenizer.from_pretrained(str(run_dir / "adapter"))
    rows = [json.loads(line) for line in (tasks / "rows.jsonl").read_text().splitlines()]
    tokens = sum(len(tokenizer(r["completion"], add_special_tokens=False).input_ids) for r in rows) / len(rows)
    report = json.loads((run_dir / "merged" / "merge_report.json").read_text())
    absmax = report["compare"]["vs_base_plus_adapter"]["ref_logit_absmax"]
    return tokens * 2.0**-8 * absmax


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A smoke run of the default, merged (so eval has three columns)."""
    from qlora_recipes.merge.pipeline import merge

    _, run_dir = train_smoke(tmp_path_factory.mktemp("eval") / "run")
    merge(run_dir)
    return run_dir


def test_eval_prints_base_tuned_and_merged_and_writes_eval_json_and_the_card(trained, tmp_path, capsys, monkeypatch):
    import lm_eval.api.metrics

    def forked(*args, **kwargs):  # perplexity's stderr is bootstrapped in a forked pool: seen hanging in CI
        raise AssertionError("lm-eval bootstrapped a stderr the report drops")

    monkeypatch.setattr(lm_eval.api.metrics, "bootstrap_stderr", forked)
    tasks = write_task(tmp_path / "tasks")
    code, out, err = _cli(capsys, "eval", str(trained), "--tasks", "order_local", "--include-path", str(tasks))
    assert code == 0, err
    assert re.search(r"(?m)^task\s+metric\s+base\s+tuned\s+merged$", out), out
    assert "eval: tuned (base + adapter)" in err and "eval: base (adapter off)" in err  # the progress lines
    report = json.loads((trained / "eval.json").read_text())
    ppl = report["tasks"]["order_local"]["perplexity"]
    assert set(ppl) == {"base", "tuned", "merged"}
    assert ppl["base"] != ppl["tuned"]  # the adapter was really off for the base column
    # the merge keeps what the adapter learned, within the rounding of the dtype the run used
    assert abs(math.log(ppl["merged"] / ppl["tuned"])) <= _log_ppl_bound(trained, tasks), ppl
    row = re.search(r"(?m)^order_local\s+perplexity\s+(\S+)\s+(\S+)\s+(\S+)$", out)
    assert row and float(row.group(2)) == pytest.approx(ppl["tuned"], rel=1e-3), out
    metrics = json.loads((trained / "metrics.json").read_text())
    assert report["run_metric"]["eval loss"]["tuned"] == metrics["eval_loss"]
    card = (trained / "adapter" / "README.md").read_text()
    assert "## lm-eval: base vs fine-tuned" in card and "| order_local | perplexity |" in card
    assert not (trained / "eval.json.partial").exists()


def test_eval_refuses_a_task_it_does_not_know_in_one_line(trained, tmp_path, capsys):
    tasks = write_task(tmp_path / "tasks")
    code, _, err = _cli(
        capsys, "eval", str(trained), "--tasks", "order_local,no_such_task", "--include-path", str(tasks)
    )
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: --tasks: no_such_task"), err


def test_export_to_vllm_prints_the_serve_command_for_the_adapter(trained, capsys):
    code, out, err = _cli(capsys, "export", str(trained), "--to", "vllm")
    assert code == 0, err
    adapter_cfg = json.loads((trained / "adapter" / "adapter_config.json").read_text())
    line = out.strip()
    assert line.startswith("vllm serve ") and "--enable-lora" in line
    assert f"--lora-modules {trained.name}={trained / 'adapter'}" in line
    rank = int(re.search(r"--max-lora-rank (\d+)$", line).group(1))
    assert rank >= adapter_cfg["r"]


def test_modules_to_save_is_a_warning_in_train_and_a_one_line_refusal_for_vllm(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *SMOKE, "peft.modules_to_save=[lm_head]", f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert re.search(r"(?m)^peft\.modules_to_save=\['lm_head'\] .*vLLM's --enable-lora cannot load", said), said[-3000:]
    served = subprocess.run(
        [sys.executable, "-m", "qlora_recipes", "export", str(run_dir), "--to", "vllm"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = served.stderr.strip().splitlines()
    assert served.returncode == 2 and len(lines) == 1, served.stderr
    assert "modules_to_save" in lines[0] and "qlora merge" in lines[0] and not served.stdout
