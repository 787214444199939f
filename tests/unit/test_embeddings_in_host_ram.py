"""offload.embeddings: the input embeddings stay in host RAM and are looked up there; only the
rows a batch uses go to the device the layers run on. Refused, in one line, where it cannot work.
On the fake CUDA device: tests/unit/test_memory_tracer.py (slow); the 8 GB recipe's trace:
bench/results/planner-traced.md."""

import pytest
import torch
from conftest import compose_cfg

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
