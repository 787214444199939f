"""The loss path the planner counts is the one TRL 1.16 takes: the fused LM head of
add_fused_lm_head (tiles, no (b, s, V) logits), checked against what TRL's own head takes on CPU
(the quantity a CPU plan predicts: the process's peak RSS, the kernel's high-water mark, with the
malloc thresholds a CPU run pins); evaluation and the exact-match metric's generation (torch's
allocation tracking: the profiler's memory events); the allocated peak next to the device peak."""

import gc
import inspect
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch
from conftest import REPO, compose_cfg
from helpers_forkserver import ForkServer
from torch.profiler import ProfilerActivity, profile

from qlora_recipes import planner
from qlora_recipes.config import devices, schema
from qlora_recipes.planner import components, constants, loss
from qlora_recipes.planner.figures import Figures
from qlora_recipes.planner.spec import StackSpec, spec_from_cfg
from qlora_recipes.run import memory, metrics, trainer_args

GiB = 2**30


def allocated_peak(fn) -> int:
    """The most bytes the CPU allocator held at once while fn ran, above what was held before."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    held = peak = 0
    for e in events:
        held += e.nbytes()
        peak = max(peak, held)
    return peak


def rss_peak(fn) -> int:
    """The most RSS the process held while fn ran, above what it held before: the high-water mark,
    with the malloc thresholds a CPU training run pins (memory.pin_malloc_thresholds)."""
    if not (memory.pin_malloc_thresholds() and memory.reset_rss_high_water_mark()):
        pytest.skip("needs glibc and /proc/self/clear_refs (Linux)")
    fn()  # once for the one-time allocations (kernels, thread pools)
    gc.collect()
    before = memory.rss_bytes()
    memory.reset_rss_high_water_mark()
    fn()
    return memory.rss_high_water_mark() - before


def head_imports() -> None:
    """What fused_head_peak_here imports: its fork server's, once, before it forks."""
    from transformers import LlamaForCausalLM  # noqa: F401
    from trl.trainer.utils import add_fused_lm_head  # noqa: F401


@pytest.fixture(scope="module")
def fused_head_peak():
    """fused_head_peak(b, s, h, vocab, bf16, train, softcap=False): fused_head_peak_here, each call in
    a process of its own: a high-water mark of RSS depends on what the process did before (the other
    tests a pytest-xdist worker ran there), the plan's figure on the head alone. Each runs in a child
    forked from one server that imported torch, transformers and TRL once (tests/helpers_forkserver.py):
    a fresh Python spent most of a call's time on those imports."""
    here = Path(__file__).stem
    with ForkServer(f"{here}:fused_head_peak_here", f"{here}:head_imports") as peaks:
        yield lambda b, s, h, vocab, bf16, train, softcap=False: peaks(b, s, h, vocab, bf16, train, softcap)


def fused_head_peak_here(b: int, s: int, h: int, vocab: int, bf16: bool, train: bool, softcap: bool = False) -> int:
    """TRL's fused head as SFTTrainer runs it (add_fused_lm_head, the outputs it asks for) behind a
    model with no decoder layer: final norm + head + loss, forward (+ backward), frozen weights,
    fp32 hidden states (a quantized model's residual stream), CPU autocast when bf16; its peak RSS."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    cfg = LlamaConfig(hidden_size=h, intermediate_size=2 * h, num_hidden_layers=0, num_attention_heads=1,
                      num_key_value_heads=1, vocab_size=vocab, max_position_embeddings=s,
                      final_logit_softcapping=30.0 if softcap else None)  # fmt: skip
    model = LlamaForCausalLM(cfg).float().requires_grad_(False)
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    hidden = torch.randn(b, s, h, requires_grad=train)
    labels = torch.randint(0, vocab, (b, s))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), torch.set_grad_enabled(train):
            out = model(inputs_embeds=hidden, labels=labels, fused_lm_head=True, use_cache=False)
        if train:
            out.loss.backward()

    return rss_peak(step)


def spec(b: int, s: int, h: int, vocab: int, bf16: bool, softcap: bool = False) -> StackSpec:
    fig = Figures("llama", h, 1, 1, 1, h, 2 * h, vocab, False, final_logit_softcapping=softcap)
    return StackSpec(fig=fig, name_or_path="test", dtype="bfloat16" if bf16 else "float32", micro_batch=b, seq_len=s)


# b, s, h, V, bf16 autocast: fp32 with one narrow vocabulary tile; bf16 over fp32 hidden states with
# two tiles (one full, one strided); a Qwen2.5-0.5B-like head (152k vocabulary, five tiles), and the
# same head over 63 positions, where the backward's fp32 copy of a weight chunk outgrows the fold
@pytest.mark.parametrize(
    "shape",
    [(1, 1024, 64, 8000, False), (2, 300, 64, 40000, True), (2, 128, 896, 151936, True), (1, 64, 896, 151936, True)],
)
def test_planned_training_loss_matches_trls_fused_head_on_cpu(shape, fused_head_peak):
    b, s, h, vocab, bf16 = shape
    measured = fused_head_peak(b, s, h, vocab, bf16, train=True)
    planned = loss.train_loss_bytes(spec(*shape), b, on_cpu=True)
    assert abs(planned - measured) <= 0.1 * measured, (planned, measured)


def test_planned_softcap_bytes_are_the_tanh_tile_trls_soft_capped_head_keeps(fused_head_peak):
    """final_logit_softcapping set: TRL's CPU backward keeps tanh of the tile beside the fold (4 bytes
    an element); its forward's transform fits under the fold it already had."""
    shape = (1, 1024, 64, 8000, False)
    capped, plain = (fused_head_peak(*shape, train=True, softcap=cap) for cap in (True, False))
    planned = loss.train_loss_bytes(spec(*shape, softcap=True), 1, on_cpu=True)
    extra = planned - loss.train_loss_bytes(spec(*shape), 1, on_cpu=True)
    assert extra == loss.FOLD_BYTES["softcap"] * 1023 * 8000
    assert abs(extra - (capped - plain)) <= 0.1 * extra, (extra, capped - plain)
    assert abs(planned - capped) <= 0.1 * capped, (planned, capped)
    evaluated = fused_head_peak(*shape, train=False, softcap=True)
    assert abs(loss.eval_loss_bytes(spec(*shape, softcap=True), 1, on_cpu=True) - evaluated) <= 0.1 * evaluated


def test_planned_eval_loss_matches_trls_fused_head_without_grad(fused_head_peak):
    shape = (2, 256, 64, 40000, False)
    measured = fused_head_peak(*shape, train=False)
    planned = loss.eval_loss_bytes(spec(*shape), shape[0], on_cpu=True)
    assert abs(planned - measured) <= 0.1 * measured, (planned, measured)


def test_the_8b_plan_has_no_full_logits_term():
    cfg = compose_cfg("recipe=llama3.1-8b-24gb")
    plan = planner.plan(cfg, gpus=devices.declared_gpus(cfg), host_ram=devices.declared_host_ram(cfg))
    st = spec_from_cfg(cfg, 1)
    b, s, vocab = st.micro_batch, st.seq_len, st.fig.vocab_size
    planned = plan["components"]["lm_head_loss"]["cuda:0"]
    assert planned == loss.train_loss_bytes(st, b)
    assert planned < b * s * vocab * 2  # less than the bf16 logits alone (full logits + CE: ~6 GiB)
    # nothing in it scales with the vocabulary beyond one 32768-wide tile
    wider = replace(st, fig=replace(st.fig, vocab_size=4 * vocab))
    assert loss.train_loss_bytes(wider, b) == planned and loss.eval_loss_bytes(wider, b) == loss.eval_loss_bytes(st, b)


def test_on_a_gpu_the_tiles_are_the_buffer_and_the_weight_chunk_only():
    st = spec(2, 2048, 4096, 128256, bf16=True)
    n = 2 * 2047
    gpu = loss.train_loss_bytes(st, 2, on_cpu=False)
    cpu = loss.train_loss_bytes(st, 2, on_cpu=True)
    # bf16 buffer + bf16 copies of two weight chunks (backward casts the next while the last is held)
    tiles = n * loss.VOCAB_TILE * 2 + 2 * loss.VOCAB_TILE * 4096 * 2
    assert tiles < gpu < tiles + 6 * n * 4096 * 4  # + hidden states, their copies and fp32 gradient
    second_chunk = loss.VOCAB_TILE * 4096 * 2  # planned on the GPU path only (bench/trace)
    fold = loss.FOLD_BYTES["backward"] * n * loss.VOCAB_TILE  # the CPU fold's temporaries
    assert cpu - gpu > fold * 0.99 - second_chunk


def test_no_key_of_ours_takes_trl_off_the_fused_head(tmp_path):
    """TRL builds full logits only for label_smoothing_factor > 0, a compute_loss_func (or Liger's
    fused cross-entropy, which it refuses); no group of ours has a key for any of them and the
    SFTConfig we build keeps the defaults, so the planner has no full-logits path to keep."""
    names = {f.name for group in (schema.TrainerConfig, schema.OptimConfig, schema.DataConfig) for f in fields(group)}
    assert not names & {
        "label_smoothing_factor",
        "label_smoothing",
        "loss_type",
        "use_liger_kernel",
        "compute_loss_func",
    }
    args = trainer_args.sft_config(compose_cfg(), tmp_path, "prompt_completion", on_gpu=False, has_eval=True)
    assert args.label_smoothing_factor == 0 and args.loss_type == "nll" and not args.use_liger_kernel


def test_generation_metric_is_planned_from_its_lengths():
    assert inspect.signature(metrics.exact_match).parameters["batch_size"].default == loss.GEN_METRIC_BATCH
    base = ("model=llama3.1-8b", "trainer=standard", "data=order", "quant=nf4", "trainer.eval_batch_size=1")
    st = loss.with_metric(spec_from_cfg(compose_cfg(*base), 1), compose_cfg(*base).data)
    assert isinstance(st, loss.MetricStack) and st.gen_batch == min(32, 64) and st.gen_new_tokens == 8
    assert replace(st, seq_len=1024).gen_batch == 32  # the ladder's copies keep the metric
    fig = st.fig
    positions = st.eval_batch * st.seq_len  # what one generation batch may hold (max_batch_tokens)
    kv_cache = fig.num_layers * 2 * fig.num_kv_heads * fig.head_dim * 4 * positions  # fp32: no autocast
    gen = loss.generation_bytes(st, fig.num_layers, True)
    assert kv_cache < gen < kv_cache + 2 * components.eval_layer_bytes(st, st.eval_batch, autocast=False)
    plan = planner.plan(compose_cfg(*base), gpus=[80 * GiB], host_ram=64 * GiB, world_size=1, ladder=False)
    assert plan["components"]["eval_transient"]["cuda:0"] >= gen
    without = planner.plan(compose_cfg(*base, "data.metric=null"), gpus=[80 * GiB], host_ram=64 * GiB, ladder=False)
    assert without["components"]["eval_transient"]["cuda:0"] < gen


def test_generation_plan_bounds_what_the_metric_allocates_on_cpu():
    """The metric's generate (left-padded batches of at most eval_batch x seq_len positions, KV
    cache, last-position logits) on a 2-layer fp32 model with the shipped character tokenizer,
    prompts of 30 to 230 characters: the plan is an upper bound, and not a loose one."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from qlora_recipes.outputs.generation import generate
    from qlora_recipes.outputs.prompts import Prompt

    tokenizer = AutoTokenizer.from_pretrained(str(REPO / "assets" / "tiny-llama"))
    eval_batch, seq_len, new, h = 8, 256, 16, 256
    cfg = LlamaConfig(hidden_size=h, intermediate_size=2 * h, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=1024)  # fmt: skip
    model = LlamaForCausalLM(cfg).float().eval()
    prompts = [Prompt("formatted", "order: " + "abcdefghij"[i % 10] * (30 + 20 * (i % 11))) for i in range(40)]
    with torch.no_grad():
        measured = allocated_peak(
            lambda: generate(
                model, tokenizer, prompts, "plain", new, batch_size=32, max_batch_tokens=eval_batch * seq_len
            )
        )
    fig = Figures("llama", h, 2, 4, 2, h // 4, 2 * h, len(tokenizer), False)
    st = loss.MetricStack(fig=fig, name_or_path="test", quant="none", dtype="float32", seq_len=seq_len,
                          eval_batch=eval_batch, gen_batch=32, gen_new_tokens=new)  # fmt: skip
    planned = loss.generation_bytes(st, 2, True, on_cpu=True)
    print(f"generation: measured {measured:,} B, planned {planned:,} B")
    assert measured <= planned <= 1.5 * measured, (planned, measured)


def test_plan_reports_the_allocated_peak_next_to_the_device_peak():
    cfg = compose_cfg("recipe=llama3.1-8b-24gb")
    plan = planner.plan(cfg, gpus=devices.declared_gpus(cfg), host_ram=devices.declared_host_ram(cfg))
    (gpu,) = plan["devices"]
    overhead = plan["components"]["allocator_overhead"]["cuda:0"]
    assert abs(gpu["peak_allocated"] - (gpu["peak"] - constants.CUDA_CONTEXT_BYTES - overhead)) <= 2
    assert plan["peak_allocated_gib"] == round(gpu["peak_allocated"] / GiB, 3) < plan["peak_gib"]
    table = planner.render_table(plan)
    assert "peak allocated" in table and f"allocated {plan['peak_allocated_gib']:.2f} GiB: what torch.cuda" in table
    fsdp = compose_cfg("recipe=llama3.1-70b-2x24gb")
    sharded = planner.plan(fsdp, gpus=devices.declared_gpus(fsdp), host_ram=devices.declared_host_ram(fsdp))
    assert 0 < sharded["peak_allocated_gib"] < sharded["peak_gib"]
