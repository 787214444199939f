"""offload.embeddings: the input embeddings stay in host RAM and are looked up there; only the
rows a batch uses go to the device the layers run on. Refused, in one line, where it cannot work.
On the fake CUDA device: tests/unit/test_memory_tracer.py (slow); the 8 GB recipe's trace:
bench/results/planner-traced.md."""

import pytest
import torch
import torch.distributed as tdist
from accelerate import Accelerator
from conftest import compose_cfg
from torch.nn.parallel import DistributedDataParallel

from qlora_recipes import planner
from qlora_recipes.errors import UserError
from qlora_recipes.model import loading
from qlora_recipes.model.host_embeddings import keep_on_host
from qlora_recipes.run.validate import validate
from qlora_recipes.units import GiB


def test_the_lookup_runs_on_the_host_and_gives_the_same_rows(run_dir):
    cfg = compose_cfg("quant=none", "precision=fp32")
    model = loading.load_model(cfg, run_dir)
    ids = torch.tensor([[5, 6, 7, 8]])
    before = model(input_ids=ids).logits
    moved = keep_on_host(model, "cpu")
    table = model.get_input_embeddings()
    assert moved == table.weight.numel() * 4 and table.weight.device.type == "cpu"
    assert table._forward_pre_hooks and table._forward_hooks
    assert torch.equal(model(input_ids=ids).logits, before)


# eager attention: sdpa's mask code reads the mask's values, which the meta device (the stand-in
# for the GPU the model is moved to) has not
TINY_FP32 = ("quant=none", "precision=fp32", "model.attn_implementation=eager")


def _meta_forward(model, ids):
    on_meta = ids.to("meta")
    return model(input_ids=ids, attention_mask=torch.ones_like(on_meta), labels=on_meta)


def test_a_move_of_the_whole_model_leaves_the_table_in_host_ram_and_the_rows_follow_the_layers(run_dir):
    model = loading.load_model(compose_cfg(*TINY_FP32), run_dir)
    keep_on_host(model, "cpu")
    table = model.get_input_embeddings()
    model.to("meta", torch.bfloat16)  # as model.to("cuda") moves every other tensor; the cast applies
    assert table.weight.device.type == "cpu" and table.weight.dtype == torch.bfloat16
    assert {p.device.type for n, p in model.named_parameters() if "embed_tokens" not in n} == {"meta"}
    ids = torch.tensor([[5, 6, 7, 8]])
    out = _meta_forward(model, ids)
    assert out.logits.shape == (1, 4, 100) and out.loss.device.type == "meta"
    table.cpu()  # a move to the host itself: the rows stay there too
    assert table.weight.device.type == "cpu" and table(ids).device.type == "cpu"


def test_masks_and_positions_given_on_the_tables_device_reach_the_layers_device(run_dir):
    """generate() moves its inputs to model.device, the first parameter's: the host table's. The
    decoder takes the mask and positions to its layers (meta, as a GPU's stand-in), not the host."""
    model = loading.load_model(compose_cfg(*TINY_FP32), run_dir)
    keep_on_host(model, "cpu")
    model.to("meta")
    assert model.device.type == "cpu"  # why generate() hands everything over on the host
    ids = torch.tensor([[5, 6, 7, 8]])
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(4)[None])
    assert out.logits.device.type == "meta" and out.logits.shape == (1, 4, 100)


def test_the_trainers_device_move_after_loading_keeps_the_table_in_host_ram(run_dir, monkeypatch):
    """The training path to the first forward: loaded, table to the host, adapters, then accelerate's
    prepare_model, which calls model.to(its device) on a model loaded on one device (a 4-bit one too:
    transformers 5 sets it no hf_device_map); its device here is meta, as a GPU's stand-in."""
    cfg = compose_cfg(*TINY_FP32)
    model = loading.load_model(cfg, run_dir)
    keep_on_host(model, "cpu")
    model = loading.make_trainable(cfg, model)
    monkeypatch.setattr(Accelerator, "device", property(lambda self: torch.device("meta")))
    prepared = Accelerator().prepare_model(model)
    assert model.get_input_embeddings().weight.device.type == "cpu"
    assert {p.device.type for p in model.parameters() if p.requires_grad} == {"meta"}
    out = _meta_forward(prepared, torch.tensor([[5, 6, 7, 8]]))
    assert out.loss.device.type == "meta"


def test_ddp_leaves_the_host_table_alone_on_the_model_it_wraps(run_dir, tmp_path):
    """DDP refuses a model on two device types (the table on the host, the rest on each rank's GPU)
    and would broadcast the table over NCCL: the trainable model names it for DDP to leave alone."""
    cfg = compose_cfg(*TINY_FP32, "offload.embeddings=true")
    model = loading.load_model(cfg, run_dir)
    keep_on_host(model, "cpu")
    model = loading.make_trainable(cfg, model)
    tdist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(model)
        ids = torch.tensor([[5, 6, 7, 8]])
        ddp(input_ids=ids, labels=ids).loss.backward()
    finally:
        tdist.destroy_process_group()
    assert ddp.parameters_to_ignore == {"base_model.model.model.embed_tokens.weight"}
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_the_plan_moves_the_table_to_host_ram_and_counts_it_while_loading():
    eight_b = ("recipe=llama3.1-8b-8gb",)
    on_gpu = planner.plan(compose_cfg(*eight_b, "offload.embeddings=false"), gpus=[int(7.6 * GiB)], host_ram=32 * GiB)
    on_host = planner.plan(compose_cfg(*eight_b), gpus=[int(7.6 * GiB)], host_ram=32 * GiB)
    table = 128256 * 4096 * 2  # bf16 (precision.upcast_frozen=false)
    gpu_rows, host_rows = on_gpu["components"]["other_params"], on_host["components"]["other_params"]
    assert gpu_rows["cuda:0"] - host_rows["cuda:0"] == table == host_rows["cpu"]
    assert on_host["components"]["load_transient"]["cuda:0"] == table
    assert on_host["peak_allocated_gib"] <= 5.6 < on_gpu["peak_allocated_gib"]


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["offload=cpu"], "offload.embeddings=true with offload=cpu|disk"),
        (["dist=fsdp"], "cannot run under dist=fsdp"),
        (["peft.modules_to_save=[embed_tokens]"], "peft.modules_to_save trains embed_tokens"),
        (["peft.target_modules=[embed_tokens,q_proj]"], "trains an adapter on"),
    ],
)
def test_combinations_that_cannot_work_are_one_line(overrides, words):
    with pytest.raises(UserError, match=words.replace("|", r"\|").replace("[", r"\[")):
        validate(compose_cfg("offload.embeddings=true", *overrides), gpu_available=True, world_size=1)


def test_no_gpu_or_a_tied_table_is_one_line():
    with pytest.raises(UserError, match="needs a CUDA GPU"):
        validate(compose_cfg("offload.embeddings=true"), gpu_available=False, world_size=1)
    with pytest.raises(UserError, match="ties its input embeddings to the LM head"):
        validate(compose_cfg("model=gemma2-9b", "offload.embeddings=true"), gpu_available=True, world_size=1)
