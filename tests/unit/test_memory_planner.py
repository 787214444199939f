"""The memory planner (qlora_recipes/planner/, scripts/plan.py).

Static parts are checked exactly against real objects built here on CPU: bitsandbytes-quantized
models (NF4+DQ, FP4, int8) of three tiny architectures saved with save_pretrained and loaded with
BitsAndBytesConfig, peft adapters, optimizers after one step, and the device map from_pretrained
builds. The model-level figures are reconciled with published numbers (Llama-2-70B, Llama-3.1-8B,
QLoRA paper appendix). No mocks, no network, no GPU.
"""

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from conftest import REPO, compose_cfg

from qlora_recipes import planner
from qlora_recipes.config.devices import parse_gpus
from qlora_recipes.errors import UserError
from qlora_recipes.planner import components, constants, figures, placement
from qlora_recipes.planner.ladder import LADDER_ORDER
from qlora_recipes.planner.spec import spec_from_cfg
from qlora_recipes.units import parse_size

GiB = 2**30
GB = 10**9
HOST = 64 * GiB  # a declared host for plans that must not depend on this machine's RAM


def plan_for(*overrides: str, gpus=None, host_ram=HOST, ladder=True):
    # in bf16 with fp32 adapters, what the figures below are sized for and peft's get_peft_model makes
    # (precision=auto picks fp32 on a CPU without native bf16; adapter_dtype=auto would pick bf16 adapters)
    stack = ("precision=bf16", "peft.adapter_dtype=float32", *overrides)
    return planner.plan(compose_cfg(*stack), gpus=gpus, host_ram=host_ram, world_size=1, ladder=ladder)


def total(plan: dict, component: str) -> int:
    return sum(plan["components"].get(component, {}).values())


def peak_bytes(plan: dict) -> int:
    return max(d["peak"] for d in plan["devices"] if d["device"].startswith("cuda"))


# QLoRA stack of the paper's App. G check: bs 1, seq 512, r 64 all-linear, NF4+DQ, checkpointing;
# training only (the sample data's exact-match metric would add a generation the paper never ran).
PAPER = (
    "trainer=standard",
    "data.metric=null",
    "trainer.seq_len=512",
    "trainer.micro_batch_size=1",
    "peft.r=64",
    "quant=nf4",
    "optim=paged8bit",
    "trainer.gradient_checkpointing=true",
)
LLAMA2_70B = (
    "model=llama2-70b",
    "trainer=standard",
    "trainer.seq_len=2048",
    "trainer.micro_batch_size=1",
    "peft.r=16",
    "quant=nf4",
    "optim=paged8bit",
    "trainer.gradient_checkpointing=true",
)


# ----------------------------------------------------------------------------------------------
# Published figures
# ----------------------------------------------------------------------------------------------
def test_llama2_70b_published_parameter_counts_and_nf4_size():
    started = time.perf_counter()
    plan = plan_for(*LLAMA2_70B, gpus=[80 * GiB])
    print(f"70B plan computed in {time.perf_counter() - started:.3f} s")
    c = plan["counts"]
    assert c["params_total"] == 68_976_648_192
    assert c["params_quantized"] == 68_451_041_280  # every linear but lm_head
    assert c["lora_params"] == 207_093_760
    nf4 = total(plan, "quantized_weights")
    assert round(nf4 / GB, 2) == 35.31
    assert c["quantized_bytes_per_param"] == pytest.approx(0.5 + 1 / 64 + 4 / 16384, abs=1e-5)  # 0.5159
    # prepare_model_for_kbit_training: embeddings, lm_head and norms in fp32
    assert total(plan, "other_params") == 4 * (68_976_648_192 - 68_451_041_280)


def test_llama31_8b_published_parameter_counts():
    plan = plan_for("model=llama3.1-8b", "peft.r=16", gpus=[80 * GiB])
    assert plan["counts"]["params_total"] == 8_030_261_248
    assert plan["counts"]["lora_params"] == 41_943_040


def test_llama2_70b_on_one_80gb_gpu_is_well_under_and_near_the_arithmetic_floor():
    plan = plan_for(*LLAMA2_70B, gpus=[80 * GiB])
    peak = peak_bytes(plan)
    print(f"Llama-2-70B r16 seq 2048 bs 1: planned peak {peak / GB:.2f} GB ({peak / GiB:.2f} GiB)")
    assert plan["fits"] and plan["ladder"] == []
    assert 40 * GB < peak < 0.65 * 80 * GiB  # floor ~43 GB; seeds' loose 75 GB is far above it


def test_qlora_paper_65b_fits_one_48gb_gpu():
    plan = plan_for("model=llama-65b", *PAPER, gpus=[48 * GiB])
    peak = peak_bytes(plan)
    print(f"LLaMA-65B (paper ~45 GB): planned peak {peak / GB:.2f} GB")
    assert peak < 48 * GB
    assert plan["fits"]


def test_qlora_paper_33b_close_to_24_7_gb():
    plan = plan_for("model=llama-33b", *PAPER, gpus=[24 * GiB])
    peak = peak_bytes(plan)
    print(f"LLaMA-33B (paper ~24.7 GB): planned peak {peak / GB:.2f} GB")
    assert abs(peak / GB - 24.7) / 24.7 < 0.08
    # "does not quite fit" a 24 GB card: under 5 % headroom, so the plan carries a ladder
    assert plan["ladder"] and plan["devices"][0]["headroom_pct"] < 5


# ----------------------------------------------------------------------------------------------
# Activations: the formulas as documented
# ----------------------------------------------------------------------------------------------
def test_checkpointed_activations_keep_one_fp32_input_per_layer():
    """QLoRA: prepare_model_for_kbit_training leaves the embeddings fp32, so each checkpoint (the
    layer input) is fp32; without quantization it is in the precision dtype."""
    h, layers, d = 4096, 32, 128  # llama2-7b
    for s, quant, r in ((2048, "nf4", 4), (4096, "nf4", 4), (2048, "none", 2)):
        plan = plan_for(
            "model=llama2-7b", "trainer.micro_batch_size=1", f"trainer.seq_len={s}", f"quant={quant}", gpus=[80 * GiB]
        )
        assert total(plan, "activations") == layers * s * h * r + 2 * s * d * r  # + RoPE cos/sin


def test_activations_without_checkpointing_follow_the_documented_tally():
    s, h, f, a, d, layers, r_lora = 2048, 4096, 11008, 32, 128, 32, 16  # llama2-7b, MHA
    plan = plan_for(
        "model=llama2-7b",
        "trainer.micro_batch_size=1",
        f"trainer.seq_len={s}",
        "trainer.gradient_checkpointing=false",
        "peft.dropout=0.05",
        f"peft.r={r_lora}",
        gpus=[80 * GiB],
    )
    c, r, mask = 2, 4, 1  # bf16 compute, fp32 residual stream (QLoRA), bool dropout mask (CUDA)
    lora_in = 3 * h + a * d + 2 * h + f  # q, k, v, o, gate, up, down inputs
    per_token = 2 * (4 * h + 4) + c * (2 * a * d + 2 * a * d) + 4 * a + 3 * r * f + (c + mask) * lora_in
    lora_per_layer = r_lora * (4 * (h + h) + 2 * (h + f) + (f + h))
    expected = layers * (s * per_token + c * lora_per_layer) + 2 * s * d * r
    assert total(plan, "activations") == expected
    # Korthikanti Eq. 1 for a 16-bit GPT layer is 34*s*b*h; the fp32 residual stream and MLP outputs
    # and the LoRA input copies make a QLoRA layer keep about twice that
    assert 1.5 * layers * 34 * s * h < expected < 3 * layers * 34 * s * h
    plan2 = plan_for(
        "model=llama2-7b",
        "trainer.micro_batch_size=2",
        f"trainer.seq_len={s}",
        "trainer.gradient_checkpointing=false",
        "peft.dropout=0.05",
        gpus=[80 * GiB],
    )
    assert total(plan2, "activations") > 1.95 * total(plan, "activations")


def test_eager_attention_adds_the_score_matrices():
    s, h, a, layers = 2048, 4096, 32, 32
    base = (
        "model=llama2-7b",
        "trainer.micro_batch_size=1",
        f"trainer.seq_len={s}",
        "trainer.gradient_checkpointing=false",
    )
    sdpa = plan_for(*base, gpus=[80 * GiB])
    eager = plan_for(*base, "model.attn_implementation=eager", gpus=[80 * GiB])
    scores = a * s * s * (4 + 2)  # fp32 softmax + its bf16 cast, per layer
    qkv = s * (3 * 2 * h - (2 * 4 * h + 4 * a))  # eager keeps Q, K, V; SDPA Q, K, V, out, log-sum-exp
    mask = s * s * 4  # eager's float mask takes inputs_embeds' dtype: fp32 after k-bit prep's upcast
    assert total(eager, "activations") - total(sdpa, "activations") == layers * (scores + qkv) + mask


# ----------------------------------------------------------------------------------------------
# Exact static bytes against real bitsandbytes / peft / optimizers on CPU
# ----------------------------------------------------------------------------------------------
TINY = dict(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """Llama (GQA, untied), Qwen2 (tied embeddings, q/k/v bias), Gemma2 (tied, head_dim != h/a, 4 norms)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("tiny-models")
    configs = {
        "llama": AutoConfig.for_model("llama", tie_word_embeddings=False, **TINY),
        "qwen2": AutoConfig.for_model("qwen2", tie_word_embeddings=True, **TINY),
        "gemma2": AutoConfig.for_model("gemma2", tie_word_embeddings=True, head_dim=96, **TINY),
    }
    paths = {}
    for kind, config in configs.items():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(root / kind)
        paths[kind] = root / kind
    return paths


def bnb_config(quant: str):
    import torch
    from transformers import BitsAndBytesConfig

    if quant == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant,
        bnb_4bit_use_double_quant=quant == "nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def load_quantized(path: Path, quant: str):
    import torch
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb_config(quant), dtype=torch.bfloat16)


def unique_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is not None:
            seen[(t.untyped_storage().data_ptr(), t.dtype, t.numel())] = t.numel() * t.element_size()
    return sum(seen.values())


def quantized_bytes_held(model) -> int:
    """Bytes of bitsandbytes weights and every tensor of their quantization state."""
    data, state = 0, []
    for p in model.parameters():
        kind = type(p).__name__
        if kind == "Params4bit":
            data += p.numel() * p.element_size()
            qs = p.quant_state
            state += [qs.absmax, qs.code]
            if qs.nested:
                state += [qs.offset, qs.state2.absmax, qs.state2.code]
        elif kind == "Int8Params":
            data += p.numel() * p.element_size()
            state.append(p.SCB)
            if p.CB is not None and p.CB.untyped_storage().data_ptr() != p.untyped_storage().data_ptr():
                state.append(p.CB)
    return data + unique_bytes(state)


@pytest.mark.parametrize(
    "kind,quant",
    [
        ("llama", "nf4"),
        ("gemma2", "nf4"),
        ("qwen2", "fp4"),
        ("gemma2", "int8"),
        pytest.param("qwen2", "nf4", marks=pytest.mark.slow),
        pytest.param("llama", "int8", marks=pytest.mark.slow),
    ],
)
def test_quantized_model_bytes_match_the_loaded_model(tiny_models, kind, quant):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    path = tiny_models[kind]
    plan = plan_for(
        f"model.name_or_path={path}", f"quant={quant}", f"quant.double_quant={quant == 'nf4'}", "peft.r=16", gpus=[]
    )
    assert plan["model"]["figures_from"] == str(path / "config.json")
    assert plan["model"]["architecture"] == kind
    model = load_quantized(path, quant)
    assert plan["counts"]["footprint_at_load"] == model.get_memory_footprint()
    assert total(plan, "quantized_weights") == quantized_bytes_held(model)
    assert total(plan, "buffers") == sum(b.numel() * b.element_size() for b in model.buffers())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    unique = {id(p): p for p in model.parameters()}.values()  # tied embeddings count once
    others = [p for p in unique if type(p).__name__ not in ("Params4bit", "Int8Params")]
    assert {p.dtype for p in others} == {__import__("torch").float32}
    assert total(plan, "other_params") == sum(p.numel() * p.element_size() for p in others)
    peft_model = get_peft_model(
        model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    )
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    assert plan["counts"]["lora_params"] == sum(p.numel() for p in trainable)
    assert total(plan, "lora_weights") == sum(p.numel() * p.element_size() for p in trainable)


def make_optimizer(name: str, params):
    import bitsandbytes as bnb
    import torch
    from transformers.optimization import Adafactor

    return {
        "adamw_torch": lambda: torch.optim.AdamW(params, lr=1e-3),
        "adamw_bnb_8bit": lambda: bnb.optim.AdamW8bit(params, lr=1e-3),
        "paged_adamw_8bit": lambda: bnb.optim.PagedAdamW8bit(params, lr=1e-3),
        "paged_adamw_32bit": lambda: bnb.optim.PagedAdamW32bit(params, lr=1e-3),
        # what transformers' Trainer builds for optim="adafactor"
        "adafactor": lambda: Adafactor(params, lr=1e-3, scale_parameter=False, relative_step=False, warmup_init=False),
    }[name]()


@pytest.fixture(scope="module")
def adapted(tiny_models):
    """NF4 Llama with LoRA / DoRA (r=16, all-linear) after one backward: params with gradients."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    out = {}
    for method in ("lora", "dora"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = prepare_model_for_kbit_training(
                load_quantized(tiny_models["llama"], "nf4"), use_gradient_checkpointing=True
            )
            model = get_peft_model(
                model,
                LoraConfig(
                    r=16, lora_alpha=32, target_modules="all-linear", use_dora=method == "dora", task_type="CAUSAL_LM"
                ),
            )
            ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
            model(input_ids=ids, labels=ids).loss.backward()
        out[method] = (model, [p for p in model.parameters() if p.requires_grad])
    return out


@pytest.mark.parametrize(
    "optim,peft_method",
    [
        ("adamw_torch", "lora"),
        ("adamw_bnb_8bit", "lora"),
        ("paged_adamw_8bit", "lora"),
        ("paged_adamw_32bit", "lora"),
        ("adafactor", "lora"),
        ("paged_adamw_8bit", "dora"),
        ("adafactor", "dora"),
    ],
)
def test_optimizer_state_matches_what_the_optimizer_holds_after_one_step(tiny_models, adapted, optim, peft_method):
    """r=16 on hidden 256: lora_A (16x256 = 4096 elements) gets 8-bit state, the smaller k/v
    lora_B (128x16) keeps 32-bit state (bitsandbytes min_8bit_size=4096); DoRA adds magnitudes."""
    import torch

    plan = plan_for(
        f"model.name_or_path={tiny_models['llama']}",
        "quant=nf4",
        f"peft={peft_method}",
        "peft.r=16",
        f"optim.name={optim}",
        gpus=[],
    )
    _, params = adapted[peft_method]
    assert plan["counts"]["lora_params"] == sum(p.numel() for p in params)
    assert total(plan, "gradients") == sum(p.grad.numel() * p.grad.element_size() for p in params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paged optimizers fall back to unpaged on CPU
        opt = make_optimizer(optim, params)
        opt.step()
    held = unique_bytes(v for state in opt.state.values() for v in state.values() if torch.is_tensor(v))
    assert total(plan, "optimizer_state") == held


@pytest.mark.parametrize(
    "kind,peft_method,b,s",
    [
        ("llama", "lora", 2, 64),  # GQA, SDPA, a padding-free batch of 2
        ("gemma2", "dora", 1, 64),  # eager attention with soft-capping, 4 norms, DoRA
        pytest.param("gemma2", "lora", 1, 64, marks=pytest.mark.slow),
        pytest.param("llama", "dora", 1, 64, marks=pytest.mark.slow),
    ],
)
def test_layer_activation_tally_matches_what_autograd_keeps_on_cpu(tiny_models, kind, peft_method, b, s):
    """The tensors autograd keeps alive for one decoder layer (NF4 base, LoRA/DoRA with dropout,
    bf16 autocast as the Trainer runs it) against layer_saved_bytes with CPU semantics."""
    import weakref

    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    path = tiny_models[kind]
    overrides = (
        f"model.name_or_path={path}",
        "quant=nf4",
        f"peft={peft_method}",
        "peft.r=16",
        "peft.dropout=0.05",
        f"trainer.micro_batch_size={b}",
        f"trainer.seq_len={s}",
    )
    # the bf16 autocast below; fp32 adapters, as peft's LoraConfig below makes them
    st = spec_from_cfg(compose_cfg("precision=bf16", "peft.adapter_dtype=float32", *overrides), world_size=1)
    layer_bytes = next(bb for blk, bb in components.block_bytes(st) if blk.name == "model.layers.1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = prepare_model_for_kbit_training(load_quantized(path, "nf4"), use_gradient_checkpointing=False)
        model = get_peft_model(
            model,
            LoraConfig(
                r=16,
                lora_alpha=32,
                lora_dropout=0.05,
                target_modules="all-linear",
                use_dora=peft_method == "dora",
                task_type="CAUSAL_LM",
            ),
        )
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside, kept = [False], []

    def pack(t):
        if inside[0] and t.untyped_storage().data_ptr() not in params:
            kept.append((weakref.ref(t), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return t

    layer = model.base_model.model.model.layers[1]  # layer 0's input needs no grad: not typical
    layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    ids = torch.randint(4, 1000, (b, s), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids, output_hidden_states=True)
    measured = sum({ptr: n for ref, ptr, n in kept if ref() is not None}.values())
    planned = components.layer_saved_bytes(st, layer_bytes, b, on_cpu=True)
    print(f"{kind} {peft_method} b={b} s={s}: autograd keeps {measured} B, planned {planned} B")
    assert abs(measured - planned) / measured < 0.08
    assert out.hidden_states[1].dtype == torch.float32  # the fp32 residual stream of QLoRA
    del out


@pytest.mark.parametrize("kind,quant", [("gemma2", "nf4"), pytest.param("llama", "none", marks=pytest.mark.slow)])
def test_device_map_is_the_one_from_pretrained_builds(tiny_models, tmp_path, kind, quant):
    """CPU budgets small enough to push modules to disk. quant=none: the planned map equals the one
    from_pretrained's "auto" builds. nf4: "auto" quantizes every module, but our loader passes the
    planned map as a dict, and then bitsandbytes leaves the modules on cpu/disk unquantized
    (llm_int8_enable_fp32_cpu_offload); loaded so, the cpu modules' real bytes fit the budget."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    path = tiny_models[kind]
    # offloaded modules stay unquantized: the budgets are fractions of the unquantized footprint
    size = plan_for(f"model.name_or_path={path}", "quant=none", gpus=[])["counts"]["footprint_at_load"]
    maps = []
    for cpu_budget in (int(f * size) for f in (0.2, 0.4, 0.6, 0.8)):
        plan = plan_for(
            f"model.name_or_path={path}",
            f"quant={quant}",
            "offload=disk",
            f"offload.max_memory.cpu={cpu_budget}",
            f"offload.folder={tmp_path / 'plan'}",
            gpus=[],
        )
        q = None
        if quant == "nf4":
            q = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.bfloat16,
                llm_int8_enable_fp32_cpu_offload=placement.offloads(plan["device_map"]),  # as the loader sets it
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(
                path,
                quantization_config=q,
                dtype=torch.bfloat16,
                device_map="auto" if quant == "none" else plan["device_map"],
                max_memory={"cpu": cpu_budget},
                offload_folder=str(tmp_path / "load"),
            )
        real = dict(getattr(model, "hf_device_map", None) or {"": "cpu"})
        print(kind, quant, cpu_budget, real)
        if quant != "none":
            on_cpu = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cpu")
            assert on_cpu <= cpu_budget, (on_cpu, cpu_budget)
            maps.append(real)
            continue
        if real.get("lm_head") in ("cpu", "disk"):  # the planner keeps it on the execution device (pin_output_head)
            real["lm_head"] = "cpu"
        assert plan["device_map"] == real
        assert planner.loader_max_memory(plan) == {"cpu": cpu_budget}
        maps.append(real)
    if quant == "none":
        assert any(set(m.values()) == {"cpu", "disk"} for m in maps)  # a split map was among them
    else:  # 4-bit on a CPU-only machine: once a module must go to disk, none is quantized (all at bf16)
        assert {"cpu"} in [set(m.values()) for m in maps] and {"disk"} in [set(m.values()) for m in maps]


@pytest.mark.parametrize("kind,quant", [("llama", "nf4"), ("gemma2", "none")])
def test_single_device_shortcut_agrees_with_the_loaders_device_map(tiny_models, kind, quant):
    """infer_device_map skips the meta model when the whole model provably fits one device; on
    both sides of that boundary the loader's own _get_device_map gives the same answer."""
    cfg = compose_cfg(
        f"model.name_or_path={tiny_models[kind]}",
        f"quant={quant}",
        "offload=cpu",
        "precision=bf16",
        "trainer.seq_len=64",
    )
    st = spec_from_cfg(cfg, 1)  # bf16: the models above load in it
    bbs = components.block_bytes(st)
    sizes = [bb.placed_bytes for _, bb in bbs]
    factor = constants.BNB_MAX_MEMORY_FACTOR if st.quantized else 1.0
    threshold = (sum(sizes) + max(sizes)) / factor
    taken = 0
    for device in (0, "cpu"):
        for scale in (0.5, 0.9, 0.99, 1.0, 1.002, 1.01, 1.1, 2.0):
            budget = int(threshold * scale)
            max_memory = {0: budget, "cpu": 10**12} if device == 0 else {"cpu": budget}
            shortcut = placement._whole_model_fits_one_device(st, max_memory, bbs)
            real = dict(placement.infer_device_map(st, max_memory, bbs, shortcut=False))
            if shortcut is not None:
                taken += 1
                assert real == {"": shortcut}, (device, scale, real)
    assert taken >= 6  # the shortcut was exercised on both devices


FAST_MODELS = (
    "llama2-70b",
    "llama3.1-8b",
    "mistral-7b",
    "qwen2.5-7b",
    "gemma2-9b",
    "qwen3-8b",
    "gpt-oss-20b",
)  # one per family


@pytest.mark.parametrize(
    "option",
    [
        m if m in FAST_MODELS else pytest.param(m, marks=pytest.mark.slow)
        for m in sorted(p.stem for p in (REPO / "conf" / "model").glob("*.yaml"))
    ],
)
def test_analytic_inventory_matches_the_transformers_module_tree(option):
    """The figure-based parameter inventory equals the modules transformers builds from the figures."""
    cfg = compose_cfg(f"model={option}")
    fig = planner.model_figures(cfg.model)
    if fig.architecture not in constants.KNOWN_ARCHITECTURES:
        pytest.skip(f"{fig.architecture} is planned from the meta model only")
    analytic, meta = figures._analytic_inventory(fig), figures._meta_inventory(fig)

    def summary(blocks):
        return {
            b.name: (
                sorted((lin.name, lin.in_features, lin.out_features, lin.bias) for lin in b.linears),
                sum(n for name, n in b.params if not name.endswith(".bias")),
                sorted(b.experts),
                b.tied_to,
            )
            for b in blocks
        }

    assert summary(analytic) == summary(meta)


# ----------------------------------------------------------------------------------------------
# Devices, budgets, offload
# ----------------------------------------------------------------------------------------------
def test_without_gpu_the_plan_is_for_the_cpu():
    plan = plan_for("recipe=tiny-cpu", gpus=[], host_ram=24 * GiB)
    (dev,) = plan["devices"]
    assert dev["device"] == "cpu" and dev["budget"] == 24 * GiB
    assert plan["components"]["process_baseline"] == {"cpu": constants.CPU_PROCESS_BASELINE_BYTES}
    assert "cuda_context" not in plan["components"]
    assert plan["fits"] and plan["peak_gib"] < 1.0  # the recipe's header promises under 1 GiB
    assert plan["device_map"] == {"": "cpu"}


def test_declared_gpus_and_auto_budgets_place_layers_on_both():
    plan = plan_for(*LLAMA2_70B, "offload=cpu", gpus=parse_gpus("2x40GiB"), host_ram=256 * GiB)
    names = [d["device"] for d in plan["devices"]]
    assert names == ["cuda:0", "cuda:1", "cpu"]
    assert {d["device"]: d["max_memory"] for d in plan["devices"]} == {
        "cuda:0": int(0.9 * 40 * GiB),
        "cuda:1": int(0.9 * 40 * GiB),
        "cpu": int(0.8 * 256 * GiB),
    }
    placed = set(plan["device_map"].values())
    assert placed == {0, 1}
    layers = {k: v for k, v in plan["device_map"].items() if k.startswith("model.layers.")}
    assert len(layers) == 80 or "model.layers" in plan["device_map"]
    assert set(plan["components"]["quantized_weights"]) == {"cuda:0", "cuda:1"}
    assert plan["components"]["lm_head_loss"].keys() == {"cuda:1"}  # lm_head is last
    assert plan["fits"]


def test_budget_errors_are_one_line_user_errors():
    cases = [
        (("offload=cpu", "offload.max_memory.gpu=100GiB"), [80 * GiB], "more than cuda:0 has"),
        (("offload=cpu", "offload.max_memory.gpu=-5GiB"), [80 * GiB], "negative"),
        (("offload=cpu", "offload.max_memory.gpu=12XB"), [], "not a size"),
        (("offload=cpu", "offload.max_memory.cpu=2TiB"), [80 * GiB], "more than this host's RAM"),
        (("offload=cpu", "++offload.max_memory.3=10GiB"), [80 * GiB, 80 * GiB], "names GPU 3"),
        (("offload=cpu", "++offload.max_memory.cuda0=10GiB"), [80 * GiB], "unknown device key"),
        (("offload.device_map=cuda:2",), [80 * GiB], "names GPU 2"),
        (("offload.device_map=everywhere",), [80 * GiB], "offload.device_map"),
        (("model=llama2-70b", "offload=cpu", "offload.max_memory.cpu=10GiB"), [], "offload.folder is not set"),
        (
            ("model=tiny", "model.name_or_path=org/unknown-model", "model.hidden_size=???"),
            [],
            "is a hub id whose config.json cannot be read",  # offline: neither its figures nor the entry's
        ),
        (
            ("model.architecture=nosuchnet", "model.name_or_path=org/unknown", "model.hub_id=org/unknown"),
            [],
            "model.architecture='nosuchnet'",
        ),
        (("peft.target_modules=[nope]",), [], "matches no module"),
    ]
    for overrides, gpus, needle in cases:
        with pytest.raises(UserError) as err:
            plan_for(*overrides, gpus=gpus, host_ram=64 * GiB)
        message = str(err.value)
        assert needle in message and "\n" not in message, (overrides, message)


def test_parse_size_and_gpus():
    assert parse_size("80GB", "x") == 80 * 10**9 and parse_size("75GiB", "x") == 75 * GiB
    # a marketed card size is that card's usable memory (devices.MARKETED_GPU_GIB), as in the recipes
    assert parse_gpus("2x80GB,40GiB") == [79 * GiB, 79 * GiB, 40 * GiB] and parse_gpus("none") == []
    with pytest.raises(UserError, match="not a size"):
        parse_gpus("80XB")


# ----------------------------------------------------------------------------------------------
# Ladder and refusal
# ----------------------------------------------------------------------------------------------
def test_ladder_rungs_are_exact_overrides_that_replan_to_their_peak():
    base = (
        "model=llama3.1-8b",
        "quant=nf4",
        "trainer.seq_len=4096",
        "trainer.micro_batch_size=16",
        "trainer.grad_accum=1",
        "trainer.gradient_checkpointing=false",
        "optim=adamw",
    )
    plan = plan_for(*base, gpus=[24 * GiB])
    assert not plan["fits"] and plan["ladder"]
    first_fit = next(r for r in plan["ladder"] if r["fits"])
    replanned = plan_for(*base, *first_fit["overrides"].split(), gpus=[24 * GiB], ladder=False)
    assert replanned["fits"] and replanned["peak_gib"] == first_fit["peak_gib"]
    assert replanned["effective_batch"] == plan["effective_batch"] == 16  # micro-batch rung keeps it
    kinds = [r["change"] for r in plan["ladder"] if r["change"] != "eval_batch"]
    assert kinds == [k for k in LADDER_ORDER if k in kinds]  # cheapest first
    peaks = [r["worst_peak_gib"] for r in plan["ladder"]]
    assert all(r["cost"] and r["cost_note"] and r["adds"] for r in plan["ladder"])
    assert peaks[-1] < plan["peak_gib"]


def test_refusal_is_one_line_with_the_first_fitting_rung():
    plan = plan_for("model=llama3.1-8b", "trainer.seq_len=4096", "trainer.micro_batch_size=16", gpus=[24 * GiB])
    with pytest.raises(UserError) as err:
        planner.refuse_unless_fits(plan, force=False)
    message = str(err.value)
    first_fit = next(r for r in plan["ladder"] if r["fits"])
    assert message.startswith("stack does not fit: peak ") and "on cuda:0" in message and "\n" not in message
    assert f"try: {first_fit['overrides']} (see plan.json ladder)" in message and "force=true" in message
    planner.refuse_unless_fits(plan, force=True)  # force starts anyway
    planner.refuse_unless_fits(plan_for(*LLAMA2_70B, gpus=[80 * GiB]), force=False)


def test_ladder_reaches_cpu_offload_for_70b_on_a_24gb_card():
    plan = plan_for(*LLAMA2_70B, gpus=[24 * GiB], host_ram=256 * GiB)
    # (eval_batch_size=auto: after the offload an eval-batch rung may follow; a replan resolves it anew)
    rung = next(r for r in plan["ladder"] if r["change"] == "cpu_offload")
    assert rung["cost"] == "large"
    assert "offload=cpu" in rung["overrides"] and "offload.max_memory.gpu=" in rung["overrides"]
    replanned = plan_for(*LLAMA2_70B, *rung["overrides"].split(), gpus=[24 * GiB], host_ram=256 * GiB, ladder=False)
    assert replanned["fits"] and "cpu" in replanned["device_map"].values()
    # a host too small for the rest of the model: disk offload, with the folder of offload=disk
    small = plan_for(*LLAMA2_70B, gpus=[24 * GiB], host_ram=24 * GiB)
    disk = next(r for r in small["ladder"] if r["change"] == "disk_offload")
    assert "offload=disk" in disk["overrides"]


def test_write_plan_and_table(tmp_path):
    plan = plan_for(*LLAMA2_70B, gpus=[80 * GiB])
    path = planner.write_plan(plan, tmp_path / "run")
    saved = json.loads(path.read_text())
    for key in (
        "components",
        "devices",
        "fits",
        "peak_gib",
        "tokens_per_step",
        "effective_batch",
        "ladder",
        "device_map",
    ):
        assert key in saved
    assert saved["tokens_per_step"] == 1 * 2048 * 16 and saved["effective_batch"] == 16
    assert {"budget", "peak", "headroom", "device"} <= set(saved["devices"][0])
    table = planner.render_table(plan)
    assert "cuda:0" in table and "quantized weights" in table and "FITS" in table


# ----------------------------------------------------------------------------------------------
# scripts/plan.py end to end
# ----------------------------------------------------------------------------------------------
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


def plan_script(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "plan.py"), *args],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_plan_script_prints_the_table_and_writes_plan_json(tmp_path):
    started = time.perf_counter()
    proc = plan_script("--gpus", "80GiB", *LLAMA2_70B, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    print(f"scripts/plan.py wall time: {time.perf_counter() - started:.2f} s")
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["fits"] and plan["counts"]["params_total"] == 68_976_648_192
    assert "quantized weights" in proc.stdout and "FITS" in proc.stdout and "plan.json" in proc.stdout


@pytest.mark.slow
def test_plan_script_without_gpu_plans_the_cpu(tmp_path):
    proc = plan_script(f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    if not plan["stack"]["hardware"]["gpus"]:
        assert [d["device"] for d in plan["devices"]] == ["cpu"]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["offload=cpu", "offload.max_memory.gpu=12XB"], "not a size"),
        (["--gpus", "80XB"], "--gpus"),
        (["--gpus", "24"], "24 has no unit"),
        (["--gpus", "0x24GB"], "0 GPUs of 24GB"),
        pytest.param(
            ["--gpus", "24GiB", "offload=cpu", "offload.max_memory.gpu=100GiB"],
            "more than cuda:0 has",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["model.name_or_path=org/x", "model.hidden_size=???"], "no architecture figures", marks=pytest.mark.slow
        ),
    ],
)
def test_plan_script_bad_input_is_one_line_exit_2(tmp_path, args, needle):
    proc = plan_script(*args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout[-1000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], proc.stderr
    assert proc.stderr.strip().splitlines() == errors
    assert not (tmp_path / "run" / "plan.json").exists()
