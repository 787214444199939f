"""Shared test helpers: compose the real config, the smoke stack and a smoke run, find every config
file on disk, a GPU skip. Both tests/unit and tests/e2e see this file: `from conftest import ...`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch thread per process, children included: the tiny models gain nothing from a second thread
# (the default run takes the same wall time, with 40 % less CPU, and trains the same bits), and two
# test processes then share the 2 cores instead of spinning on each other's.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from qlora_recipes.config.loader import register_schemas, to_typed  # noqa: E402

register_schemas()
# Every folder of conf/ is a group in train.yaml's defaults, except the presets chosen with `+`
# (sweep), Hydra's own (hydra/...) and the link to recipes/.
GROUPS = tuple(
    sorted(p.name for p in (REPO / "conf").iterdir() if p.is_dir() and p.name not in ("recipe", "sweep", "hydra"))
)


def compose_cfg(*overrides: str):
    """The typed config (TrainConfig) train.py would run for these command-line overrides; Hydra's
    composition errors propagate as Hydra raises them, the typing's (unknown `+key`) as UserError."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return to_typed(compose(config_name="train", overrides=list(overrides)))


def compose_hydra_cfg(*overrides: str):
    """The raw DictConfig with Hydra's own node (`cfg.hydra.sweeper`, `.launcher`): for tests of what
    Hydra does with a preset, which the typed config does not carry."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides), return_hydra_config=True)


# The stack a training test starts from: 3 steps of the tiny model, no generation metric (the
# exact-match pass would double a 3-step run's time and no test of training needs it).
SMOKE = ("trainer=smoke", "data.metric=null")


def run_job(cmd, *, timeout: float, merge_output: bool = False, **popen) -> subprocess.CompletedProcess:
    """subprocess.run for a command that starts processes of its own. torchrun starts each rank in a
    session of its own, so subprocess.run's timeout (which kills torchrun alone) would then wait for
    ever on the pipes a hanging rank still holds; here every process under the command is killed and
    the test fails naming the timeout, with the output so far."""
    import psutil

    errors = subprocess.STDOUT if merge_output else subprocess.PIPE
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, text=True, **popen)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for p in tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        out, err = proc.communicate(timeout=60)
        pytest.fail(
            f"{cmd if isinstance(cmd, str) else ' '.join(map(str, cmd))} ran past {timeout} s; every "
            f"process under it was killed. Its output:\n{(out or '')[-3000:]}\n{(err or '')[-3000:]}"
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def train_smoke(run_dir: Path, *overrides: str) -> tuple[dict, Path]:
    """Train SMOKE plus these overrides in this process: (metrics, run_dir). For module-scoped runs
    that several tests share; a single test takes the `smoke_run` fixture."""
    from qlora_recipes.run.training import train

    return train(compose_cfg(*SMOKE, *overrides), run_dir), run_dir


def generate_alike(folders, prompt: str = "dcba") -> list[dict]:
    """`qlora generate FOLDER PROMPT --jsonl` from each folder at once (run dirs, merged dirs): each
    answer's JSON line, after checking it exited 0 with no traceback."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "qlora_recipes", "generate", str(folder), prompt, "--jsonl"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for folder in folders
    ]
    answers = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
        answers.append(json.loads(stdout.strip().splitlines()[-1]))
    return answers


@pytest.fixture
def smoke_run(tmp_path: Path):
    """`smoke_run(*overrides)`: train SMOKE plus overrides in this process into tmp_path/run."""
    return lambda *overrides: train_smoke(tmp_path / "run", *overrides)


def options(group: str) -> list[str]:
    folder = REPO / ("recipes" if group == "recipe" else f"conf/{group}")
    return sorted(p.stem for p in folder.rglob("*.yaml"))


def requires_gpu(reason: str = "needs a CUDA GPU"):
    return pytest.mark.skipif(not torch.cuda.is_available(), reason=reason)


@pytest.fixture
def small_data(tmp_path: Path) -> list[str]:
    """Overrides for 64 training rows and 8 eval rows of the shipped sample: loading and the final
    eval stay short where a test trains and resumes several times."""
    return sample_subset(tmp_path, "", 64, 8)


def sample_subset(tmp_path: Path, sample: str, train: int, eval: int) -> list[str]:
    """Overrides for the first `train` and `eval` rows of a shipped order sample (`sample`: "" for SFT,
    or preference/, kto/, grpo/): short resumes of each objective."""
    for name, keep in (("train", train), ("eval", eval)):
        rows = (REPO / f"assets/data/order/{sample}{name}.jsonl").read_text().splitlines()[:keep]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(rows) + "\n")
    return [f"data.path={tmp_path / 'train.jsonl'}", f"data.eval_path={tmp_path / 'eval.jsonl'}"]


def resumed_as_if_never_stopped(stack: list[str], tmp_path: Path, monkeypatch) -> tuple[dict, dict]:
    """Train `stack` whole, then again stopped by SIGTERM at step 2 and resumed (save_steps=2, 4 steps):
    (whole, resumed) metrics, after checking the resume started from checkpoint-2, ran to step 4 and
    ended with the very adapter the whole run did."""
    from qlora_recipes.run.lifecycle import Preempted
    from qlora_recipes.run.training import train

    stack = [*stack, "trainer.max_steps=4", "trainer.save_steps=2"]
    whole = train(compose_cfg(*stack), tmp_path / "whole")
    monkeypatch.setenv("QLORA_RECIPES_FAULTS", "sigterm_at_step=2")
    with pytest.raises(Preempted):
        train(compose_cfg(*stack), tmp_path / "stopped")
    monkeypatch.delenv("QLORA_RECIPES_FAULTS")
    resumed = train(compose_cfg(*stack, "resume=auto"), tmp_path / "stopped")
    assert resumed["resumed_from"].endswith("checkpoint-2") and resumed["steps"] == 4
    assert resumed["adapter_sha256"] == whole["adapter_sha256"]
    return whole, resumed


def train_py(run_dir: Path, *overrides: str, timeout: int = 1800) -> tuple[dict, Path, str]:
    """`python train.py OVERRIDES` as a user runs it, in its own process (its measured peak is a first
    run's, not that of a test process that trained before): (metrics, run dir, stdout)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *overrides, f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((run_dir / "metrics.json").read_text()), run_dir, proc.stdout


def merge_and_generate(run_dir: Path, prompt: str = "order: dcba") -> str:
    """scripts/merge.py then scripts/generate.py on a finished run, each in its own process: the merged
    dir exists and generate's stdout (the prompt, then an answer) is returned."""
    for script, *args in (("merge.py",), ("generate.py", prompt)):
        proc = subprocess.run(
            [sys.executable, str(REPO / "scripts" / script), str(run_dir), *args],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "merged" / "config.json").is_file()
    assert prompt in proc.stdout and proc.stdout.strip().splitlines()[-1]  # an answer after the prompt
    return proc.stdout


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def tok():
    """The tiny model's tokenizer (assets/tiny-llama)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(REPO / "assets" / "tiny-llama")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture
def hub_out_of_reach(monkeypatch):
    """A token in the environment, the hub switched on, and its endpoint a closed local port."""
    import huggingface_hub
    from helpers_hub import SECRET, closed_port

    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", closed_port())
