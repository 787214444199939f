"""A routed MoE layer's backward under gradient checkpointing (planner/moe.py): when its recompute reaches
the down projection of its 4-bit experts (model/moe_experts.routed_forward), the tiny gpt-oss layer built
from transformers' GptOssConfig holds what the plan counts there: all the layer keeps for backward
(components.layer_saved_bytes) and the routed-row and hidden-width tensors beside them
(moe.routed_recompute_bytes): the layer output's gradient, the attention block's residual sum and the
MLP's normed input among them. Measured as the bytes of every tensor the backward has made and still
holds (a dispatch mode that sees each op's output storage until it is freed), on CPU in fp32."""

import weakref

import pytest
import torch
from conftest import compose_cfg
from helpers_families import build_family
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from qlora_recipes.model import loading, moe_experts
from qlora_recipes.planner import components, moe
from qlora_recipes.planner.spec import spec_from_cfg

# eager attention (sinks run nowhere else on a CPU) over short rows, so its seq^2 terms stay small; bf16
# frozen parts, so that the hidden states are 16-bit and the norms make fp32 copies, as on a GPU
ROWS, SEQ = 16, 8
STACK = ("trainer=smoke", f"trainer.seq_len={SEQ}", f"trainer.micro_batch_size={ROWS}", "quant=nf4", "peft.r=8")
STACK += ("precision=bf16", "precision.upcast_frozen=false", "peft.dropout=0", "trainer.gradient_checkpointing=true")


class _LiveBytes(TorchDispatchMode):
    """The bytes of the storages the ops run inside it allocated and that are still alive; while
    `watching`, the most of them after any op."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self._refs: list = []
        self.watching, self.peak = False, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(ret.alias_info is not None for ret in func._schema.returns):
            return out  # a view (of a parameter, of the checkpoint's input) allocates nothing
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.live:
                storage = t.untyped_storage()
                key = storage.data_ptr()
                self.live[key] = storage.nbytes()
                self._refs.append(weakref.ref(storage, lambda _, k=key: self.live.pop(k, None)))
        if self.watching:
            self.peak = max(self.peak, sum(self.live.values()))
        return out


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return build_family("gpt_oss", tmp_path_factory.mktemp("routed-recompute") / "gpt_oss")


def _held_in_the_recompute(model, ids, projection: str) -> int:
    """The most the backward holds while the last layer's recompute runs its expert `projection`."""
    mode, seen = _LiveBytes(), []
    original = moe_experts._project

    def project(module, name, x, offsets, ids_=None):
        first = name == projection and torch._C._current_graph_task_id() != -1 and not seen
        mode.watching = first
        out = original(module, name, x, offsets, ids_)
        if first:
            mode.watching = False
            seen.append(mode.peak)
        return out

    out = model(input_ids=ids, labels=ids)
    moe_experts._project = project
    try:
        with mode:
            out.loss.backward()
    finally:
        moe_experts._project = original
    assert seen, "no routed recompute ran"
    return seen[0]


@pytest.mark.parametrize("projection", ["gate_up_proj", "down_proj"])
def test_the_recomputed_expert_projections_hold_what_the_plan_counts(gpt_oss, tmp_path, projection):
    """gate_up: the layer's attention and norms kept, the routed rows and what the projection makes, with
    its dequantized weight or after it (first_projection_bytes + the dequant scratch the phase adds);
    down: all the layer keeps and the routed rows and hidden-width tensors beside (routed_recompute_bytes)."""
    cfg = compose_cfg(*STACK, f"model.name_or_path={gpt_oss}")
    st = spec_from_cfg(cfg, world_size=1)
    layer = next(bb for blk, bb in components.block_bytes(st) if blk.is_layer)
    tokens, (c, r, _) = ROWS * SEQ, components.act_dtypes(st, on_cpu=True)
    saved = components.layer_saved_bytes(st, layer, ROWS, on_cpu=True)
    if projection == "down_proj":
        planned = saved + moe.routed_recompute_bytes(st, tokens, c, r)
    else:
        mlp = components.mlp_saved_per_token(st, layer, on_cpu=True)
        dequant = layer.max_dequant * c
        planned = saved + moe.first_projection_bytes(st, tokens, c, r, mlp, dequant) + dequant
    torch.manual_seed(0)
    model = loading.make_trainable(cfg, loading.load_model(cfg, tmp_path))
    model.train()
    ids = torch.randint(4, 100, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    measured = _held_in_the_recompute(model, ids, projection)
    # the hidden-width tensors beside them (moe.beside_recompute_per_token) are 7 % of it here
    assert planned == pytest.approx(measured, rel=0.03)
