"""Benchmarks that prove the stacks: memory and speed against the plan and against the plain way.

    python -m bench cpu                    # the CPU suite (make bench-cpu), ~15 min on 2 cores
    python -m bench gpu                    # the GPU suite (make bench-gpu), every stage
    python -m bench gpu --stages 8b,slope  # some stages: 8b, slope, full, seq
    python -m bench gpu --shrink           # the GPU suite's code path on a CPU, small shapes
    python -m bench gpu-check --part 1     # one GPU check for everything pending, one 10-minute call per part
    python -m bench smoke                  # 3 steps of the harness itself (the tests run it)
    python -m bench report bench/results/X.json   # re-render X.md and bench/README.md
    python -m bench trace recipe=NAME      # traced memory of a stack on fake tensors (no GPU needed)
    python -m bench trace --suite          # traced vs planned for every single-GPU recipe and lean option
    python -m bench longest-context        # longest context per card vs unsloth -> results/longest-context.*
    python -m bench planner-cpu            # planned vs measured peak RSS, 36 CPU runs (make bench-planner-cpu)
    python -m bench planner-sharded        # per-rank plan vs each rank's peak RSS, 2-rank DDP/FSDP/ZeRO-2/3 on CPU
    python -m bench syncs                  # device->host syncs and kernels per step, ours vs the baseline

Run from the repository root. A suite is a file in bench/suites/ (or a path). Each measured run is a
fresh process (peak RSS and max_memory_allocated are per process): ours is `python train.py <job>
<stack overrides>`, the baseline `python -m bench.baseline` with the same model, data, steps and
hyperparameters, run alternately (ABAB). Results go to bench/results/<device>-<date>.json (merged with
an earlier file of the same device, date and suite: a stack measured again replaces its entry, every
run is listed) and a markdown table beside it; bench/README.md keeps the latest table per device and
suite. Options: --repeats N, --steps N, --only GLOB (stack names), --results-dir, --work-dir, --cache
DIR (random-weight models and synthetic data; default $QLORA_RECIPES_CACHE/bench), --no-readme,
--timeout S (per child process), --resume (keep the stacks and timings today's results file already
has, e.g. after an interrupted run or a device command's time limit).
"""

from __future__ import annotations

import argparse
import signal
import sys


def _stop(signum, frame) -> None:
    raise SystemExit(f"stopped by signal {signum}")  # run_child then kills the child it is waiting on


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0], usage=f"{prog} SUITE [options]")
    p.add_argument("suite", help="cpu, gpu, smoke, a suite .yaml, or `report FILE.json ...`")
    p.add_argument("files", nargs="*", help="for report: results JSON files")
    p.add_argument("--stages", help="GPU suite: comma-separated stages (default: all, in order)")
    p.add_argument("--part", type=int, help="gpu-check: the stages of one device call (1, 2, ...; default all)")
    p.add_argument("--shrink", action="store_true", help="small shapes on the CPU (the GPU suite's code path)")
    p.add_argument("--repeats", type=int, help="ours/baseline pairs per stack")
    p.add_argument("--steps", type=int, help="optimizer steps per training run")
    p.add_argument("--only", help="comma-separated globs of stack/timing names to run")
    p.add_argument("--results-dir", help="where results go (default bench/results)")
    p.add_argument("--work-dir", help="run dirs and logs (default runs/bench/<suite>-<time>)")
    p.add_argument("--cache", help="random-weight models and synthetic data")
    p.add_argument("--timeout", type=float, help="seconds per child process")
    p.add_argument("--no-readme", action="store_true", help="do not update bench/README.md")
    p.add_argument("--resume", action="store_true", help="keep what today's results file already has; measure the rest")
    return p


def main(argv: list[str] | None = None, prog: str = "python -m bench") -> None:
    signal.signal(signal.SIGTERM, _stop)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_build"]:  # the harness's own child: one random-weight model
        from bench.models import build_main

        build_main(*argv[1:4])
        return
    if argv[:1] == ["trace"]:  # traced memory (bench/trace/): its own options
        from bench.trace.cli import main as trace_main

        trace_main(argv[1:], prog=f"{prog} trace")
        return
    if argv[:1] == ["longest-context"]:  # the longest context per card vs unsloth (bench/longest_context.py)
        from bench.longest_context import main as longest_context

        longest_context(argv[1:], f"{prog} longest-context")
        return
    if argv[:1] == ["planner-cpu"]:  # the planner against measured CPU peaks (bench/planner_cpu.py)
        from bench.planner_cpu import main as planner_cpu

        planner_cpu(argv[1:], f"{prog} planner-cpu")
        return
    if argv[:1] == ["planner-sharded"]:  # the planner per rank against 2 CPU ranks (bench/planner_sharded.py)
        from bench.planner_sharded import main as planner_sharded

        planner_sharded(argv[1:], f"{prog} planner-sharded")
        return
    if argv[:1] == ["syncs"]:  # per-step syncs and kernels, ours vs the baseline (bench/trace/syncs.py)
        from bench.trace.syncs import main as syncs

        syncs(argv[1:], f"{prog} syncs")
        return
    args = parser(prog).parse_args(argv)
    if args.suite == "report":
        from bench.results import rerender

        rerender(args.files, args.no_readme)
        return
    from bench.harness import Bench
    from bench.suite import load_suite

    Bench(load_suite(args.suite, args.shrink), args, command=" ".join([prog, *argv])).run()


if __name__ == "__main__":
    main()
