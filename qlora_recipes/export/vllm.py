"""`qlora export RUN --to vllm`: the run's adapter checked for what vLLM's LoRA loader takes, and the
`vllm serve` command that serves it over its base.

    vllm_command(run_dir) -> str

vLLM serves LoRA A/B factors (`--enable-lora`); an adapter that also carries full copies of modules
(peft's modules_to_save, e.g. lm_head or the embeddings) or DoRA magnitudes is refused in one line,
with the way around it (planner.report.vllm_note says the same when such a run is planned).
`--max-lora-rank` is the adapter's largest rank, rounded up to a value vLLM accepts.
"""

from __future__ import annotations

import shlex

from ..errors import UserError
from ..outputs.rundir import adapter_config, load_run_config, resolve_dir
from ..planner.report import vllm_note

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices


def _rank(cfg: dict) -> int:
    ranks = [int(cfg.get("r") or 0), *(int(v) for v in (cfg.get("rank_pattern") or {}).values())]
    return max(ranks)


def vllm_command(path) -> str:
    """The `vllm serve` line for a run's adapter; a UserError where vLLM could not load it."""
    from ..integrations.modelcard import base_model

    _, run_dir = resolve_dir(path, allow_merged=False)
    adapter = run_dir / "adapter"
    cfg = adapter_config(adapter)
    note = vllm_note(cfg.get("modules_to_save"))
    if note:
        raise UserError(f"{adapter}: {note}")
    if cfg.get("use_dora"):
        raise UserError(
            f"{adapter}: a DoRA adapter, which vLLM's LoRA loader does not serve; merge it (qlora merge {run_dir}) "
            f"and serve the merged model: vllm serve {run_dir}/merged"
        )
    rank = _rank(cfg)
    fitting = [r for r in VLLM_RANKS if r >= rank]
    if not fitting:
        raise UserError(f"{adapter}: rank {rank} is above vLLM's largest --max-lora-rank {VLLM_RANKS[-1]}")
    run_cfg = load_run_config(run_dir)
    base = base_model(run_cfg.model)[0] or str(run_cfg.model.name_or_path)
    module = f"{run_dir.name}={adapter}"
    return " ".join(
        ["vllm serve", shlex.quote(base), "--enable-lora", "--lora-modules", shlex.quote(module)]
        + ["--max-lora-rank", str(fitting[0])]
    )
