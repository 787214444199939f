"""The gpu-check suite's own stages (bench/suites/gpu-check.yaml): `card_cases`, the longest-context
cases trained at their claimed lengths on a GPU capped to the card's size
(torch.cuda.set_per_process_memory_fraction), expandable segments on and off; and `moe_slice`, an
MoE recipe on a layer slice of its model with random weights, measured peak beside its plan.

    python -m bench.gpu_check FRACTION train.py ARGS...   # train.py with the GPU capped to FRACTION
    python -m bench.gpu_check _build SPEC OUT DEVICE      # a random-weight slice of an MoE model
"""

from __future__ import annotations

import json
import runpy
import sys
import time
from pathlib import Path
from typing import Any

from bench.models import write_tokenizer
from bench.runner import log_tail, run_child
from bench.stages import long_context_cases
from bench.suite import compose


def cap_and_run(fraction: float, script: str, args: list[str]) -> None:
    """Cap this process's CUDA allocator at `fraction` of the GPU before anything loads, then run the
    script as `python script args` would: the card's size imposed on the real entry point."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(fraction)
        print(f"[bench] CUDA allocator capped at {fraction:.4f} of the GPU", flush=True)
    else:
        print("[bench] no CUDA here: the card's size is not imposed", flush=True)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def stage_card_cases(b: Any, key: str, st: dict) -> None:
    """The recorded longest-context cases of `st['cards']` (GB) at their claimed lengths (at most
    seq_cap with --shrink), each with the GPU capped to the card and expandable segments on and off."""
    from bench.longest_context import RESULTS

    cases = json.loads(RESULTS.read_text())["cases"]
    picked = [c for c in cases if c["model"] in st["models"] and c.get("card_gb") in st["cards"]]
    total = b.settings.device.get("total_bytes")
    for lc, case in zip(long_context_cases(picked, st["models"], None, st.get("seq_cap")), picked, strict=True):
        option, fig = b.assets.model_fig({"option": lc["model"]})
        path = b.assets.build_model(option, fig)
        data = b.assets.stage_data(st, fig["vocab_size"], lc["seq_len"], b.settings.steps)
        own = [o for o in lc["overrides"] if o not in st.get("drop", ())]  # --shrink: no CUDA-only options
        card = case["card_gb"] * 10**9
        fraction = min(1.0, card / total) if b.settings.gpu and total else 1.0
        for expandable in st.get("expandable", (True, False)):
            name = f"card-{lc['model']}-{case['card_gb']}gb-{'expandable' if expandable else 'fixed'}"
            if not b.settings.selected(name):
                continue
            ov = [*b.assets.model_overrides(option, fig, path), f"data.path={data}", *own]
            extra = {
                "card_gb": case["card_gb"],
                "claimed_seq": case["longest_seq"],
                "seq_len": lc["seq_len"],
                "memory_fraction": round(fraction, 6) if b.settings.gpu else None,
                "card_imposed": bool(b.settings.gpu),
                "expandable_segments": expandable,
                "planned_allocated_gib": lc["planned_allocated_gib"],
            }
            launcher = ("bench.gpu_check", str(fraction))  # on a CPU it runs train.py uncapped, saying so
            ov.append(f"trainer.expandable_segments={str(expandable).lower()}")
            b.measure.stack(name, ov, launcher=launcher, extra=extra)


def build_slice(overrides: list[str], layers: int, out: str, device: str) -> None:
    """A random-weight model of the composed config's figures cut to `layers` decoder layers, saved
    in bf16 with a word-level tokenizer of its vocabulary (the config built as the tracer builds it)."""
    import torch
    from transformers import AutoModelForCausalLM

    from bench.trace.model import hf_config

    cfg = compose(overrides)
    config = hf_config(cfg, layers)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    write_tokenizer(Path(out), config.vocab_size)
    (Path(out) / "bench-model.json").write_text(json.dumps({"layers": layers}))  # last: the dir is complete


def stage_moe_slice(b: Any, key: str, st: dict) -> None:
    """The MoE recipe on `layers` of its model's layers (random weights): peak beside the plan of
    the same slice. The figures' changes (`figures`, --shrink) go to the build and the run alike."""
    base = [f"recipe={st['recipe']}", *st.get("figures", []), f"model.num_layers={st['layers']}"]
    cfg = compose([*b.settings.suite.get("job", []), *base])
    out = b.settings.cache / "models" / f"{st['recipe']}-L{st['layers']}-h{cfg.model.hidden_size}-hf"
    if not (out / "bench-model.json").is_file():
        device = "cuda" if b.settings.gpu else "cpu"
        started = time.time()
        spec = json.dumps([*b.settings.suite.get("job", []), *base])
        argv = [sys.executable, "-m", "bench.gpu_check", "_build", spec, str(out), str(st["layers"]), device]
        child = run_child(argv, b.settings.work / "build" / f"{out.name}.log", b.settings.env, b.settings.timeout)
        if child["rc"] != 0:
            raise RuntimeError(f"building {out.name} failed: {log_tail(child['log'])}")
        print(f"[bench] built {out.name} in {time.time() - started:.0f} s", flush=True)
    data = b.assets.stage_data(st, cfg.model.vocab_size, b.assets.job_seq_len(), b.settings.steps)
    ov = [*base, f"model.name_or_path={out}", f"data.path={data}", "force=true", *st.get("overrides", [])]
    b.measure.stack(f"moe-{st['recipe']}-L{st['layers']}", ov, extra={"recipe": st["recipe"], "layers": st["layers"]})


if __name__ == "__main__":
    if sys.argv[1:2] == ["_build"]:
        build_slice(json.loads(sys.argv[2]), int(sys.argv[4]), sys.argv[3], sys.argv[5])
    else:
        cap_and_run(float(sys.argv[1]), sys.argv[2], sys.argv[3:])
