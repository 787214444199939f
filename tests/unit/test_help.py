"""`--help` of every command is short and useful: exit 0, under 50 lines, no
composed-config dump; the commands that take overrides name every config group on disk and say where
`--gpus` goes; each points at docs/ pages that have the sections it names. Hydra's own `--hydra-help`
and `--cfg job` stay available.
"""

import os
import re
import subprocess
import sys

from conftest import REPO

PY = sys.executable
# (command, takes Hydra overrides)
COMMANDS = {
    "python train.py": ([PY, "train.py"], True),
    "qlora train": ([PY, "-m", "qlora_recipes", "train"], True),
    "qlora plan": ([PY, "-m", "qlora_recipes", "plan"], True),
    "scripts/plan.py": ([PY, "scripts/plan.py"], True),
    "qlora launch": ([PY, "-m", "qlora_recipes", "launch"], True),
    "qlora merge": ([PY, "-m", "qlora_recipes", "merge"], False),
    "qlora generate": ([PY, "-m", "qlora_recipes", "generate"], False),
    "qlora eval": ([PY, "-m", "qlora_recipes", "eval"], False),
    "qlora export": ([PY, "-m", "qlora_recipes", "export"], False),
    "qlora summarize": ([PY, "-m", "qlora_recipes", "summarize"], False),
    "scripts/summarize_sweep.py": ([PY, "scripts/summarize_sweep.py"], False),
    "qlora bench": ([PY, "-m", "qlora_recipes", "bench"], False),
}
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


def _start(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _recipe_listing(lines: list[str]) -> list[str]:
    """The lines of a help's `recipes:` section, one per recipe on disk."""
    if "recipes:" not in lines:
        return []
    start = lines.index("recipes:") + 1
    names = {p.stem for p in (REPO / "recipes").glob("*.yaml")}
    return [ln for ln in lines[start : start + len(names)] if ln.split() and ln.split()[0] in names]


def _groups_on_disk() -> list[str]:
    """conf/'s groups (Hydra's own aside) and the recipes, read here independently of helptext.py."""
    groups = [p.name for p in (REPO / "conf").iterdir() if p.is_dir() and p.name not in ("hydra", "sweep")]
    return sorted(groups)


def _headings(page: str) -> set[str]:
    """The headings of a docs page (its title too), or nothing when there is no such page."""
    path = REPO / page
    if not path.is_file() or path.parent != REPO / "docs":
        return set()
    return {m.group(1).strip() for m in re.finditer(r"^#{1,4} (.+)$", path.read_text(), re.M)}


def test_every_command_help_is_short_names_the_groups_and_points_at_the_docs():
    procs = {name: _start([*argv, "--help"]) for name, (argv, _) in COMMANDS.items()}
    results = {name: (*proc.communicate(timeout=300), proc.returncode) for name, proc in procs.items()}
    for name, (stdout, stderr, code) in results.items():
        assert code == 0, (name, stderr[-2000:])
        assert "Traceback" not in stderr, (name, stderr[-2000:])
        lines = stdout.rstrip("\n").splitlines()
        # the recipes' one-line listing grows with the catalogue; the rest of the help stays short
        catalogue = _recipe_listing(lines)
        assert 5 < len(lines) - len(catalogue) < 50, (name, len(lines), stdout)
        assert "== Config ==" not in stdout and "_target_" not in stdout, (name, "config dump")
        pointer = next((ln for ln in lines if ln.startswith("more: ")), "")
        places = re.findall(r"(docs/[\w.-]+\.md) \('([^']+)'\)", pointer)
        assert places and len(places) == pointer.count("docs/"), (name, stdout[-500:])
        missing = [(page, section) for page, section in places if section not in _headings(page)]
        assert not missing, (name, "no such page or section", missing)
        if COMMANDS[name][1]:
            named = {ln.split()[0] for ln in lines if ln.startswith("  ") and ln.split()}
            missing = [g for g in _groups_on_disk() if g not in named]
            assert not missing, (name, missing, stdout)
            assert "--gpus" in stdout, (name, "no --gpus")
    for name in ("python train.py", "qlora plan"):
        assert "common overrides:" in results[name][0] and "data.path=FILE" in results[name][0]


def test_hydras_own_help_and_config_print_stay_available():
    own = _start([*COMMANDS["qlora train"][0], "--hydra-help"])
    job = _start([*COMMANDS["qlora train"][0], "--cfg", "job"])
    stdout, stderr = own.communicate(timeout=300)
    assert own.returncode == 0 and "Hydra" in stdout, stderr[-2000:]
    stdout, stderr = job.communicate(timeout=300)
    assert job.returncode == 0, stderr[-2000:]
    assert "model:" in stdout and "trainer:" in stdout and len(stdout.splitlines()) > 50


def test_train_given_gpus_says_where_gpus_go_in_one_line():
    proc = _start([*COMMANDS["python train.py"][0], "--gpus", "24GB", "trainer=smoke"])
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2 and stderr.count("\n") == 1, stderr
    assert stderr.startswith("error: ") and "qlora plan --gpus" in stderr and "usage:" not in stdout + stderr


PIPED = {f"{name} --help": [*argv, "--help"] for name, (argv, _) in COMMANDS.items()}
PIPED["qlora --help"] = [PY, "-m", "qlora_recipes", "--help"]
PIPED["qlora plan recipe=llama2-70b-a100"] = [*COMMANDS["qlora plan"][0], "recipe=llama2-70b-a100"]
PIPED["python train.py --cfg job"] = [*COMMANDS["python train.py"][0], "--cfg", "job"]


def _start_with_the_reader_gone(argv: list[str]) -> subprocess.Popen:
    """stdout is a pipe whose reading end is closed before the command starts: its first write
    fails, as `cmd | head -3` makes a later one fail once head has its lines (no timing involved)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.Popen(argv, cwd=REPO, env=ENV, stdout=write_end, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write_end)


def _noisy_when_the_reader_goes(names) -> dict:
    procs = {name: _start_with_the_reader_gone(PIPED[name]) for name in names}
    results = {name: (proc.communicate(timeout=300)[1], proc.returncode) for name, proc in procs.items()}
    return {name: result for name, result in results.items() if result[0] or result[1] not in (0, 141)}


def test_output_piped_into_head_ends_quietly():
    """`qlora plan --help | head -3` once printed a BrokenPipeError traceback. Every command's --help,
    and what a Hydra task prints (`qlora plan`), end with nothing on stderr and exit 0 (the output
    went to a buffer, then nowhere) or 141 (as a tool that SIGPIPE ended)."""
    assert _noisy_when_the_reader_goes(list(PIPED)) == {}


def test_plan_help_into_head_prints_its_first_lines_only():
    proc = subprocess.run(
        ["bash", "-c", f"{PY} -m qlora_recipes plan --help | head -3"], cwd=REPO, env=ENV, capture_output=True, text=True
    )  # fmt: skip
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.splitlines()[0].startswith("usage: qlora plan")
    assert len(proc.stdout.splitlines()) == 3
