"""The router's load-balancing loss, which TRL turns on for MoE configs, keeps each routed layer's router
logits from the forward through the loss, and their gradients from the loss until each layer's backward:
the planner counts tokens x experts x layers in the compute dtype beside the activations, measured here
on tiny qwen3_moe and gpt_oss models as the router logits' gradients alive when the last layer's
backward starts."""

import pytest
import torch
from conftest import compose_cfg
from helpers_families import build_family

from qlora_recipes.planner import moe
from qlora_recipes.planner.spec import spec_from_cfg

TOKENS = 512


def _spec(folder):
    overrides = ("precision=bf16", "trainer.micro_batch_size=1", f"trainer.seq_len={TOKENS}")
    return spec_from_cfg(compose_cfg(f"model.name_or_path={folder}", *overrides), world_size=1)


def _model(folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _softmax_nodes(fn) -> list:
    """The SoftmaxBackward nodes under the aux loss's grad_fn (one per routed layer)."""
    found, seen, stack = [], set(), [fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "Softmax" in node.name():
            found.append(node)
        else:
            stack += [nxt for nxt, _ in node.next_functions]
    return found


def _held_at_last_layer_backward(model, aux: bool) -> int:
    """Bytes of the router logits' gradients the loss's softmax backwards produced before the first
    decoder layer's backward (the last layer's) consumes its logits' one: each waits in autograd's buffers
    until its layer's backward."""
    produced, held = [], []
    ids = torch.randint(3, 100, (1, TOKENS))
    out = model(input_ids=ids, labels=ids, output_router_logits=aux)
    for node in _softmax_nodes(out.aux_loss.grad_fn) if aux else ():
        node.register_hook(lambda grads, _: produced.append(sum(g.numel() * g.element_size() for g in grads)))
    for logits in out.router_logits or ():
        logits.register_hook(lambda g: held.append(sum(produced)) if not held else None)
    out.loss.backward()
    return held[0] if held else 0


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_the_load_balancing_loss_keeps_what_the_planner_counts(tmp_path, model_type):
    folder = build_family(model_type, tmp_path / model_type)
    st = _spec(folder)
    measured = _held_at_last_layer_backward(_model(folder), aux=True)
    planned = moe.router_logits_bytes(st, TOKENS, st.fig.num_layers, st.act_bytes)
    assert moe.load_balancing_loss(st)
    assert measured > 0 and abs(planned - measured) <= 0.03 * measured
    assert _held_at_last_layer_backward(_model(folder), aux=False) == 0


def test_llama4_whose_loader_zeroes_the_coefficient_plans_no_load_balancing_loss(tmp_path):
    folder = build_family("llama4_text", tmp_path / "llama4_text")
    st = _spec(folder)
    assert st.fig.num_experts and not moe.load_balancing_loss(st)
    assert moe.router_logits_bytes(st, TOKENS, st.fig.num_layers, st.act_bytes) == 0


def _with_config(folder, **keys):
    import json

    path = folder / "config.json"
    cj = {k: v for k, v in json.loads(path.read_text()).items() if k not in keys}
    path.write_text(json.dumps({**cj, **{k: v for k, v in keys.items() if v is not None}}))
    return folder


def _trl_adds_the_loss(folder, tmp_path) -> bool:
    """Whether TRL's SFTTrainer, built on the model, adds the load-balancing loss to each step."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    model = AutoModelForCausalLM.from_pretrained(str(folder))
    args = SFTConfig(output_dir=str(tmp_path / "out"), report_to=[], max_steps=1, use_cpu=True, max_length=32)
    rows = Dataset.from_list([{"text": "abc"}, {"text": "def"}])
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=rows, processing_class=AutoTokenizer.from_pretrained(folder)
    )
    assert model.config.output_router_logits is trainer.aux_loss_enabled  # TRL sets it, whatever config.json said
    return trainer.aux_loss_enabled


@pytest.mark.parametrize(
    "coef,logits,on",
    [(0.0, True, False), (0.0, None, False), (None, False, True), (0.02, False, True)],
)
def test_the_plan_keeps_router_logits_only_where_trl_adds_the_loss(tmp_path, coef, logits, on):
    """config.json's router_aux_loss_coef decides (left out: the config class's 0.001); its
    output_router_logits does not, TRL overriding it from the coefficient."""
    folder = _with_config(
        build_family("qwen3_moe", tmp_path / "m"), router_aux_loss_coef=coef, output_router_logits=logits
    )
    st = _spec(folder)
    assert _trl_adds_the_loss(folder, tmp_path) is on
    assert moe.load_balancing_loss(st) is on
    assert (moe.router_logits_bytes(st, TOKENS, st.fig.num_layers, st.act_bytes) > 0) is on


def test_a_router_aux_loss_coef_that_is_no_number_is_one_line(tmp_path):
    from qlora_recipes.errors import UserError

    folder = _with_config(build_family("qwen3_moe", tmp_path / "m"), router_aux_loss_coef="high")
    with pytest.raises(UserError, match=r"router_aux_loss_coef='high' must be a number"):
        moe.load_balancing_loss(_spec(folder))


EVAL_TOKENS = 256  # the tiny models' positions


def _eval_plan(folder):
    from qlora_recipes import planner

    overrides = ("precision=bf16", "trainer.micro_batch_size=1", f"trainer.seq_len={EVAL_TOKENS}")
    cfg = compose_cfg(f"model.name_or_path={folder}", *overrides, "trainer.eval_batch_size=2", "data.metric=null")
    plan = planner.plan(cfg, gpus=[], host_ram=32 * 2**30, world_size=1, ladder=False)
    return spec_from_cfg(cfg, world_size=1), plan["components"]["eval_transient"]["cpu"]


def test_evaluation_keeps_every_layers_router_logits_where_the_loss_is_on(tmp_path):
    """TRL asks for the router logits in evaluation too (compute_loss, under no_grad): the backbone returns
    each layer's, held through the head and the loss; the eval phase plans them beside its forwards."""
    on = build_family("qwen3_moe", tmp_path / "on")
    off = _with_config(build_family("qwen3_moe", tmp_path / "off"), router_aux_loss_coef=0.0)
    (st, with_logits), (_, without) = _eval_plan(on), _eval_plan(off)
    planned = moe.router_logits_bytes(st, st.eval_rows * EVAL_TOKENS, st.fig.num_layers, st.act_bytes)
    assert planned > 0 and with_logits - without == planned
    model = _model(on).eval()
    with torch.no_grad():
        out = model.model(input_ids=torch.randint(3, 100, (st.eval_rows, EVAL_TOKENS)), output_router_logits=True)
    assert sum(t.numel() * t.element_size() for t in out.router_logits) == planned
