"""QLoRA fine-tuning: one entry point for every stack (the same as `qlora train`).

    python train.py                                   # the embedded default (tiny model, CPU ok)
    python train.py quant=nf4 optim=paged8bit peft.r=64
    python train.py recipe=tiny-cpu                   # a full stack from recipes/
    python train.py -m peft.r=4,8 optim=paged8bit,adamw8bit   # Hydra multirun sweep
    python train.py --help                            # groups, options and flags

Hydra composes conf/train.yaml with the overrides (qlora_recipes/cli/train.py);
qlora_recipes/run/training.py's `train(cfg, run_dir)` does the work.
"""

if __name__ == "__main__":
    try:  # first: Ctrl-C while the imports below run is one line too (even `import sys` can be hit)
        import sys

        from qlora_recipes import interrupts

        interrupts.install(interrupts.starting_line)  # from here a Ctrl-C never lands inside an import
        from qlora_recipes.cli import train

        train.run(sys.argv[1:], prog="train.py", own_process=True)
    except KeyboardInterrupt as err:  # Ctrl-C (or SIGTERM) before the command's own handling is in place
        import signal
        import sys

        signame = getattr(err, "signame", "SIGINT")  # interrupts.Interrupted names its signal
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # the exit itself is not interrupted again
        shown = "SIGINT (Ctrl-C)" if signame == "SIGINT" else signame
        print(f"stopped by {shown} while starting; nothing was written", file=sys.stderr, flush=True)
        sys.exit(143 if signame == "SIGTERM" else 130)
