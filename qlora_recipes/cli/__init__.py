"""The `qlora` command: one subcommand per job, each a thin layer over the library.

    qlora train [overrides]        fine-tune a stack (Hydra: groups, keys, -m sweeps)
    qlora plan [--gpus ...] [overrides]   memory plan of a stack, nothing loaded
    qlora launch RECIPE [overrides]       a recipe on the hardware it is sized for
    qlora merge RUN | qlora generate RUN PROMPT | qlora summarize SWEEP_DIR | qlora bench SUITE
    qlora eval RUN --tasks T | qlora export RUN --to gguf|vllm

`python train.py`, `python scripts/<name>.py` and `python -m qlora_recipes <name>` reach the same
functions. Every subcommand takes `--help`.
"""

from __future__ import annotations

import importlib
import sys

from .helptext import quiet_when_the_reader_goes

# name -> (module under qlora_recipes.cli, one-line summary)
SUBCOMMANDS = {
    "train": ("train", "fine-tune a stack: NF4 + LoRA + TRL, memory planned first (Hydra overrides, -m sweeps)"),
    "plan": ("plan", "memory plan of a stack for the GPUs you name, without loading anything"),
    "launch": ("launch", "run a recipe on the hardware it is sized for (torchrun/accelerate for several GPUs)"),
    "merge": ("merge", "merge a run's adapter into its base, with a merge-quality check"),
    "push": ("push", "push a run's adapter or a merged model, with its model card, to the Hugging Face Hub"),
    "generate": ("generate", "generate from a run (4-bit base + adapter) or a merged model"),
    "eval": ("eval", "a run against its base on lm-eval tasks (base vs tuned vs merged) into eval.json"),
    "export": ("export", "a run for other runtimes: GGUF + Ollama Modelfile (llama.cpp's converter), vLLM"),
    "summarize": ("summarize", "summary.csv/.md/.png of a sweep dir, Pareto front marked"),
    "bench": ("bench", "the benchmark harness of a source checkout (bench/): cpu, gpu, smoke, report"),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = ["usage: qlora COMMAND [args]   (qlora COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in SUBCOMMANDS.items()]
    return "\n".join(lines)


@quiet_when_the_reader_goes()  # `qlora --help | head`: no BrokenPipeError traceback
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        sys.exit(0 if argv else 2)
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"error: qlora {name}: no such command; choose one of: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        sys.exit(2)
    try:  # Ctrl-C while the subcommand's imports run: one line, as in train.py (its own handling is not in place yet)
        from .. import interrupts

        interrupts.install(lambda signame: f"qlora {name}: {interrupts.starting_line(signame)}")
        module = importlib.import_module(f"{__name__}.{SUBCOMMANDS[name][0]}")
        own = {"own_process": True} if name == "train" else {}  # the one command this process runs
        module.run(rest, prog=f"qlora {name}", **own)
    except KeyboardInterrupt as err:
        import signal

        from .. import interrupts

        signame = interrupts.signal_name(err)
        for sig in interrupts.STOP_SIGNALS:  # the exit itself is not interrupted again
            signal.signal(sig, signal.SIG_IGN)
        print(f"qlora {name}: stopped by {interrupts.described(signame)}", file=sys.stderr, flush=True)
        sys.exit(interrupts.exit_code(signame))
