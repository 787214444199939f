"""The plain way: QLoRA fine-tuning as the Hugging Face docs show it, with no recipe layer.

    python -m bench.baseline --model assets/tiny-llama --data assets/data/order/train.jsonl \
        --steps 30 --batch 16 --seq-len 64

from_pretrained with a BitsAndBytesConfig, prepare_model_for_kbit_training, get_peft_model, TRL's
SFTTrainer with paged_adamw_8bit, then the adapter saved. It imports nothing from this repository:
the harness (`python -m bench`) runs it beside `train.py` on the same model, data, steps and device
and reports ours/baseline ratios. The last line printed is one JSON object of metrics, with the
definitions train.py uses: tokens_per_s = TRL's num_tokens / train_s (trainer construction +
train()), peak_mem_gib = torch.cuda.max_memory_allocated on a GPU, the peak RSS of this process on a
CPU; step_end_s = seconds since the trainer was built at the end of each optimizer step.
"""

import argparse
import json
import resource
import time

_STARTED = time.time()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="local model dir (HF layout, safetensors)")
    p.add_argument("--data", required=True, help="jsonl with prompt/completion or text rows")
    p.add_argument("--out", default="baseline-out", help="output dir (checkpoints, adapter)")
    p.add_argument("--metrics-json", default=None, help="also write the metrics to this file")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=1, help="per-device micro-batch")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--quant", choices=["nf4", "fp4", "int8", "none"], default="nf4")
    p.add_argument("--no-double-quant", action="store_true")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--optim", default="paged_adamw_8bit", help="a transformers `optim` string")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--scheduler", default="cosine")
    p.add_argument("--warmup-ratio", type=float, default=0.03)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=0.3)
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--alpha", type=int, default=32)
    p.add_argument("--dropout", type=float, default=0.05)
    p.add_argument("--target-modules", default="all-linear", help="all-linear or a comma-separated list")
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--reentrant", action="store_true", help="reentrant gradient checkpointing")
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--packing", action="store_true")
    p.add_argument("--no-completion-only-loss", action="store_true")
    p.add_argument("--logging-steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def quantization(args, dtype):
    """The BitsAndBytesConfig for --quant (None: no quantization)."""
    from transformers import BitsAndBytesConfig

    if args.quant in ("nf4", "fp4"):
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=args.quant,
            bnb_4bit_use_double_quant=not args.no_double_quant,
            bnb_4bit_compute_dtype=dtype,
        )
    if args.quant == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def load(args, gpu: bool):
    """(model with LoRA adapters, tokenizer): from_pretrained, prepare_model_for_kbit_training, get_peft_model."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, args.dtype)
    bnb = quantization(args, dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        args.model,
        quantization_config=bnb,
        dtype=dtype,
        device_map={"": 0} if gpu else {"": "cpu"},
        attn_implementation=args.attn,
    )
    model.config.use_cache = False
    if bnb is not None:
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=not args.no_gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": args.reentrant},
        )
    targets = args.target_modules if args.target_modules == "all-linear" else args.target_modules.split(",")
    lora = LoraConfig(
        r=args.r, lora_alpha=args.alpha, lora_dropout=args.dropout, target_modules=targets, task_type="CAUSAL_LM"
    )
    return get_peft_model(model, lora), tokenizer


def sft_config(args, gpu: bool):
    from trl import SFTConfig

    return SFTConfig(
        output_dir=f"{args.out}/checkpoints",
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        lr_scheduler_type=args.scheduler,
        warmup_steps=args.warmup_ratio,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        optim=args.optim,
        bf16=args.dtype == "bfloat16",
        fp16=args.dtype == "float16",
        use_cpu=not gpu,
        gradient_checkpointing=not args.no_gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": args.reentrant},
        max_length=args.seq_len,
        packing=args.packing,
        completion_only_loss=False if args.no_completion_only_loss else None,
        logging_steps=args.logging_steps,
        logging_first_step=True,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=args.seed,
        data_seed=args.seed,
    )


def step_clock():
    """A callback that records the seconds since it was made at the end of each optimizer step."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.t0, self.ends = time.time(), []

        def on_step_end(self, *a, **k):
            self.ends.append(round(time.time() - self.t0, 4))

    return StepClock()


def peak_memory(gpu: bool) -> tuple[float, float | None]:
    """(peak GiB, peak reserved GiB): max_memory_allocated/reserved on a GPU, this process's peak RSS on a CPU."""
    import torch

    if gpu:
        return torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, None


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch
    from datasets import load_dataset
    from transformers import set_seed
    from trl import SFTTrainer

    set_seed(args.seed)
    gpu = torch.cuda.is_available()
    model, tokenizer = load(args, gpu)
    dataset = load_dataset("json", data_files=args.data, split="train")
    sft_args = sft_config(args, gpu)
    clock = step_clock()
    train_started = time.time()
    trainer = SFTTrainer(
        model=model, args=sft_args, train_dataset=dataset, processing_class=tokenizer, callbacks=[clock]
    )
    result = trainer.train()
    train_s = time.time() - train_started
    trainer.save_model(f"{args.out}/adapter")

    log = trainer.state.log_history
    losses = [e["loss"] for e in log if "loss" in e] or [None]
    tokens = max((float(e.get("num_tokens", 0)) for e in log), default=0.0)
    peak, reserved = peak_memory(gpu)
    metrics = {
        "status": "ok",
        "train_loss_first": losses[0],
        "train_loss_last": losses[-1],
        "train_loss_mean": result.training_loss,
        "tokens": tokens,
        "tokens_per_s": tokens / train_s if train_s > 0 else None,
        "peak_mem_gib": peak,
        "peak_reserved_gib": reserved,
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "steps": trainer.state.global_step,
        "train_s": train_s,
        "wall_s": time.time() - _STARTED,
        "step_end_s": clock.ends,
        # TRL's cumulative num_tokens by step (logged every step in the suites), as ours' TensorBoard has it
        "step_tokens": {int(e["step"]): float(e["num_tokens"]) for e in log if "num_tokens" in e and "step" in e},
    }
    if args.metrics_json:
        with open(args.metrics_json, "w") as f:
            json.dump(metrics, f, indent=2)
    print(json.dumps(metrics), flush=True)
    return metrics


if __name__ == "__main__":
    main()
