"""The tracer against a real run, on the CPU: what the tracer counts vs what a real step allocates.

The same child (bench/trace/child.py) runs the same two steps of a mid-size Llama (CPU_CHECK below:
8 layers, h 1024, GQA, 32k vocabulary, 2 x 512 tokens, NF4 + LoRA r16, checkpointing) twice on the
CPU device: once on real tensors (weights initialised, bitsandbytes' CPU kernels, real backward),
where the same MemTracker counts the bytes of every live tensor storage, and once on fake tensors,
the tracer. torch 2.13 has no allocator statistics for the CPU, so the real run's live tensor bytes
come from MemTracker itself; the child's peak RSS is recorded beside them (it adds the process:
Python, the libraries, the allocator's free lists). Equal peaks and components mean the fake
tensors see every tensor the real kernels allocate on this device.

`offload_repro` checks the bug the two recipes with layers offloaded to host RAM or disk used to hit:
on the loader's path (from_pretrained with a device map and an offload folder, then
modeling.make_trainable), peft moved the adapters of an offloaded layer to the device of its base
weight, which accelerate's offload hook keeps on `meta`, and the first backward failed ("expected
device meta but got cpu"). modeling._adapters_off_meta re-creates them on the execution device;
the repro records where they are and that backward runs (tests/e2e/test_offloaded_layers_train_and_save.py trains them).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench import REPO

CPU_CHECK = [
    "model.name_or_path=cpu-check-llama",
    "model.hidden_size=1024",
    "model.num_layers=8",
    "model.num_heads=16",
    "model.num_kv_heads=4",
    "model.intermediate_size=2816",
    "model.vocab_size=32000",
    "model.max_position_embeddings=4096",  # the tiny option file's 256 would refuse seq 512
    "trainer.micro_batch_size=2",
    "trainer.seq_len=512",
    "peft.r=16",
]


def cpu_check(log_dir: Path | None = None) -> dict:
    from bench.trace.children import run_child
    from qlora_recipes.units import GiB

    log_dir = log_dir or REPO / "runs" / "bench" / "trace" / "cpu-check"
    real = run_child({"overrides": CPU_CHECK, "device": "cpu", "fake": False}, log_dir / "real.log")
    fake = run_child({"overrides": CPU_CHECK, "device": "cpu", "fake": True}, log_dir / "fake.log")
    dev = "cpu"
    comps = {}
    rc, fc = real["peak_components"].get(dev, {}), fake["peak_components"].get(dev, {})
    for name in sorted(set(rc) | set(fc)):
        comps[name] = {"real_gib": round(rc.get(name, 0) / GiB, 4), "fake_gib": round(fc.get(name, 0) / GiB, 4)}
    phases = {}
    for key in sorted(set(real["phases"]) | set(fake["phases"])):
        phases[key.split("|", 1)[1]] = {
            "real_gib": round(real["phases"].get(key, {}).get("total", 0) / GiB, 4),
            "fake_gib": round(fake["phases"].get(key, {}).get("total", 0) / GiB, 4),
        }
    rp, fp = real["peak"].get(dev, 0), fake["peak"].get(dev, 0)
    out = {
        "overrides": CPU_CHECK,
        "real_peak_gib": round(rp / GiB, 4),
        "fake_peak_gib": round(fp / GiB, 4),
        "ratio": round(fp / rp, 4) if rp else None,
        "real_peak_phase": real["peak_phase"].get(dev),
        "fake_peak_phase": fake["peak_phase"].get(dev),
        "real_max_rss_gib": real.get("max_rss_gib"),
        "real_step_s": real.get("step_s"),
        "fake_step_s": fake.get("step_s"),
        "components": comps,
        "phases": phases,
    }
    out["summary"] = (
        f"`{' '.join(CPU_CHECK)}` on the CPU device, two steps, the second counted: live tensor bytes of the real run "
        f"(MemTracker on real tensors) peak at {out['real_peak_gib']:.4f} GiB in {out['real_peak_phase']}; the tracer "
        f"(fake tensors) at {out['fake_peak_gib']:.4f} GiB in {out['fake_peak_phase']} (ratio {out['ratio']}). The real "
        f"process's peak RSS was {out['real_max_rss_gib']} GiB (Python, libraries and allocator free lists included)."
    )
    try:
        out["offload_repro"] = offload_repro()
    except Exception as err:  # noqa: BLE001 - recorded, not fatal
        out["offload_repro"] = {"error": f"repro did not run: {err}"}
    return out


_REPRO = r"""
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig
from qlora_recipes.config.loader import load
from qlora_recipes.model import loading
import tempfile
folder = tempfile.mkdtemp()
cfg = load(["offload=disk", f"offload.folder={folder}"])
q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                       bnb_4bit_compute_dtype=torch.bfloat16, llm_int8_enable_fp32_cpu_offload=True)
dm = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
      "model.rotary_emb": "cpu", "lm_head": "cpu"}
m = AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path, quantization_config=q, dtype=torch.bfloat16,
                                         device_map=dm, offload_folder=folder)
m = loading.make_trainable(cfg, m)
lora = m.base_model.model.model.layers[1].self_attn.q_proj.lora_A["default"].weight
print("ADAPTER_DEVICE", lora.device)
x = torch.randint(0, 99, (2, 16))
out = m(input_ids=x, labels=x)
out.loss.backward()
print("BACKWARD_OK")
"""


def offload_repro() -> dict:
    """The tiny model with its second layer offloaded to disk, through the real loader and
    modeling.make_trainable, one forward and backward on the CPU."""
    from bench.trace.children import child_env

    proc = subprocess.run(
        [sys.executable, "-c", _REPRO], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600
    )
    text = proc.stdout + proc.stderr
    device = next((line.split()[1] for line in text.splitlines() if line.startswith("ADAPTER_DEVICE")), None)
    error = next((line for line in reversed(text.splitlines()) if "Error" in line), None)
    return {
        "what": "assets/tiny-llama, layer 1 on disk (device map + offload folder), from_pretrained + make_trainable, one backward on CPU",
        "adapter_device": device,
        "backward_ok": "BACKWARD_OK" in text,
        "error": None if "BACKWARD_OK" in text else error,
    }
