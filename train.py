"""QLoRA fine-tuning: one entry point for every stack.

    python train.py                                   # the embedded default (tiny model, CPU ok)
    python train.py quant=nf4 optim=paged8bit peft.r=64
    python train.py recipe=tiny-cpu                   # a full stack from recipes/
    python train.py -m peft.r=4,8 optim=paged8bit,adamw8bit   # Hydra multirun sweep

`main()` composes the config with Hydra; `train(cfg, run_dir)` does the work, so tests call it
in-process. Order: validate -> plan -> tokenizer -> data -> model (quantized, device map) ->
k-bit prep + adapters -> TRL SFTTrainer (guarded: atomic checkpoints, NaN stop, OOM ladder,
preemption) -> eval -> save adapter + metrics.json.
"""

import logging
import os
import shutil
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from qlora_recipes import cli
from qlora_recipes.console import print_stack
from qlora_recipes.errors import UserError
from qlora_recipes.schema import register_schemas

register_schemas()
log = logging.getLogger("train")


def train(cfg: DictConfig, run_dir: Path, choices: dict | None = None) -> dict:
    """Run one stack end to end; returns the metrics also written to run_dir/metrics.json."""
    import torch
    from torch.utils.tensorboard import SummaryWriter
    from transformers import set_seed
    from transformers.integrations import TensorBoardCallback

    from qlora_recipes import data, dist, lifecycle, memory, metrics, modeling, stack
    from qlora_recipes.callbacks import MemoryLogger
    from qlora_recipes.validate import validate

    started = time.time()
    run_dir.mkdir(parents=True, exist_ok=True)
    gpu = modeling.on_gpu()
    validate(cfg, gpu_available=gpu)
    resume_from = lifecycle.resume_checkpoint(cfg, run_dir)  # checks the saved config first
    main_rank = int(os.environ.get("RANK", 0)) == 0  # under torchrun only rank 0 writes the run dir
    plan = dist.plan_stack(cfg)  # one rank's share under FSDP/ZeRO-3, the whole stack otherwise
    if main_rank:
        print_stack(cfg, choices)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        memory.write_plan(plan, run_dir)
    memory.refuse_unless_fits(plan, force=cfg.force)

    set_seed(cfg.seed)
    tokenizer = modeling.load_tokenizer(cfg)
    train_ds, eval_ds, data_stats = data.load_splits(cfg.data, tokenizer, cfg.trainer.seq_len, cfg.seed)
    model = modeling.make_trainable(cfg, modeling.load_model(cfg, run_dir, memory.loader_max_memory(plan)))
    trainable, total = model.get_nb_trainable_parameters()
    log.info("trainable params: %d of %d (%.3f%%)", trainable, total, 100 * trainable / total)

    want_em = cfg.data.metric == "exact_match" and eval_ds is not None
    pairs = data.generation_pairs(eval_ds, data_stats["format"], cfg.data.metric_examples) if want_em else []
    em_before = metrics.exact_match(model, tokenizer, pairs, cfg.data.max_new_tokens)

    tb = SummaryWriter(log_dir=str(run_dir / "tb")) if main_rank else None
    preemption = lifecycle.PreemptionCallback()
    data_kwargs = {**data.sft_kwargs(cfg.data, data_stats["format"]), **dist.sft_kwargs(cfg)}

    def make_trainer(c: DictConfig):
        tb_callback = TensorBoardCallback(tb_writer=tb)
        tb_callback.logging_dir = str(run_dir / "tb")  # where it reopens after train() closes it
        return lifecycle.GuardedTrainer(
            model=model,
            args=stack.sft_config(c, run_dir, data_kwargs, gpu, eval_ds is not None),
            train_dataset=train_ds,
            eval_dataset=eval_ds,
            processing_class=tokenizer,
            callbacks=[MemoryLogger(run_dir, c.trainer.memory_log_steps, tb), tb_callback, preemption],
        )

    train_started = time.time()
    preemption.install()
    try:
        trainer, result, fit_cfg = lifecycle.train_with_oom_ladder(
            cfg, model, make_trainer, run_dir, resume_from, [rung["overrides"] for rung in plan.get("ladder", [])]
        )
    finally:
        preemption.uninstall()
    train_s = time.time() - train_started
    if preemption.received:
        checkpoint = lifecycle.find_checkpoint(run_dir / "checkpoints")
        metrics.write_metrics(
            run_dir,
            {
                "status": "preempted",
                "signal": preemption.received,
                "steps": trainer.state.global_step,
                "checkpoint": checkpoint,
            },
        )
        raise lifecycle.Preempted(preemption.received, trainer.state.global_step, checkpoint)

    eval_loss = trainer.evaluate()["eval_loss"] if eval_ds is not None else None
    em_after = metrics.exact_match(model, tokenizer, pairs, cfg.data.max_new_tokens)
    lm_eval = (
        metrics.lm_eval_scores(
            model, tokenizer, cfg.trainer.lm_eval_tasks, cfg.trainer.lm_eval_limit, cfg.trainer.eval_batch_size
        )
        if cfg.trainer.lm_eval_tasks
        else None
    )
    staging = run_dir / "adapter.partial"  # the adapter dir appears complete or not at all
    trainer.save_model(str(staging))  # gathers a full state dict under FSDP; rank 0 writes
    if main_rank:
        tokenizer.save_pretrained(staging)
        shutil.rmtree(run_dir / "adapter", ignore_errors=True)
        staging.rename(run_dir / "adapter")

    loss_curve = metrics.losses(trainer.state.log_history)
    tokens = max((float(e.get("num_tokens", 0)) for e in trainer.state.log_history), default=0.0)
    out = {
        "status": "ok",
        "train_loss_first": loss_curve[0] if loss_curve else None,
        "train_loss_last": loss_curve[-1] if loss_curve else None,
        "train_loss_mean": result.training_loss,
        "eval_loss": eval_loss,
        "eval_perplexity": metrics.perplexity(eval_loss),
        "eval_exact_match_before": em_before,
        "eval_exact_match": em_after,
        "lm_eval": lm_eval,
        "tokens_per_s": tokens / train_s if train_s > 0 else None,
        "peak_mem_gib": metrics.peak_memory_gib(),
        "planned_peak_gib": plan["peak_gib"],
        "device": modeling.device_name(),
        "steps": trainer.state.global_step,
        "micro_batch_size": fit_cfg.trainer.micro_batch_size,
        "grad_accum": fit_cfg.trainer.grad_accum,
        "resumed_from": resume_from,
        "train_s": train_s,
        "wall_s": time.time() - started,
        "data": data_stats,
        "torch": torch.__version__,
    }
    out["adapter_sha256"] = metrics.trainable_digest(model)  # equal on every DDP rank
    rank = int(os.environ.get("RANK", 0))
    metrics.write_metrics(run_dir, out, name="metrics.json" if main_rank else f"metrics.rank{rank}.json")
    if tb is not None:
        tb.close()
    log.info("metrics: %s", {k: v for k, v in out.items() if k != "data"})
    return out


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    from qlora_recipes.lifecycle import Preempted
    from qlora_recipes.memory import DoesNotFit
    from qlora_recipes.metrics import write_metrics

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        result = train(cfg, run_dir, dict(hydra_cfg.runtime.choices))
    except UserError as err:
        if hydra_cfg.mode != RunMode.MULTIRUN:
            raise
        # One bad job must not end a sweep; a stack the planner rejects is skipped before loading.
        status = "skipped" if isinstance(err, DoesNotFit) else "error"
        write_metrics(run_dir, {"status": status, "error": str(err)})
        log.error("%s: %s", status, err)
        return None
    except Preempted as stop:
        keep = [o for o in hydra_cfg.overrides.task if not o.startswith(("resume", "hydra.run.dir"))]
        print(
            f"stopped by {stop.signame} at step {stop.step}; checkpoint {stop.checkpoint}; resume with: "
            f"{' '.join(['python train.py', *keep])} resume=auto hydra.run.dir={run_dir}",
            file=sys.stderr,
        )
        sys.exit(143 if stop.signame == "SIGTERM" else 130)
    return result.get("eval_loss")  # the objective an Optuna sweep minimises


if __name__ == "__main__":
    cli.run(main)
