"""Training with layers offloaded (offload=cpu / offload=disk): the adapters of an offloaded layer
are real tensors that train, and the adapter saves and reloads.

On a GPU the loader's device map puts the layers that do not fit on "cpu" or "disk"; accelerate
keeps their weights on `meta` and an AlignDevicesHook onloads them to the GPU for each forward.
This machine has no GPU, so the CPU is the execution device, and what differs from a GPU run is:
  - "cpu" is the main device here, so accelerate does not hook modules the map puts on "cpu"; a
    layer is offloaded only on "disk" (read in place from the checkpoint each forward). The host-RAM
    case is the same hook with an in-RAM state dict as its weights map: the second test builds it
    with accelerate's own cpu_offload on a layer (what dispatch_model does to a "cpu" block beside
    a GPU).
  - with "disk" in the map transformers keeps every "cpu" and "disk" module unquantized
    (llm_int8_enable_fp32_cpu_offload), here the CPU-resident layers too; beside a GPU only the
    offloaded ones.
  - the onloaded weights and the adapters sit in host RAM, not GPU memory (the plan's
    offload_staging row on a GPU).
"""

import math

import pytest
import torch
from conftest import REPO, compose_cfg, train_smoke

from qlora_recipes import planner
from qlora_recipes.errors import UserError
from qlora_recipes.model import loading

LAYER = "model.layers.1"


@pytest.fixture(scope="module")
def tiny8(tmp_path_factory) -> str:
    """The shipped tiny Llama with 8 decoder layers: its own 2, then 6 whose output projections are
    zero (identity blocks: the same function, so it trains as the shipped one does). An offloaded
    layer is unquantized (bf16, 4x its NF4 bytes), so a budget that splits the model must hold one
    bf16 layer beside the room the loader keeps for the largest: with 2 layers any budget that does
    not fit the 4-bit model whole sends everything to disk."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    src, out = REPO / "assets" / "tiny-llama", tmp_path_factory.mktemp("tiny8")
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    config = AutoConfig.from_pretrained(src)
    config.num_hidden_layers = 8
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).state_dict(), strict=False)
    with torch.no_grad():
        for layer in model.model.layers[2:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(out)
    return str(out)


def tiny8_model(path: str) -> tuple[str, ...]:
    return (f"model.name_or_path={path}", "model.num_layers=8")


def disk_overrides(path: str) -> tuple[str, ...]:
    """A CPU budget that holds embed_tokens and layer 0 in bf16 (plus the loader's room for one more
    layer): layers 1-7 and the final norm go to disk; the planner keeps lm_head on the execution
    device (TRL's fused head reads its weight). In bf16, which the budget is sized for (precision=auto
    would pick fp32 on a CPU without native bf16)."""
    return (*tiny8_model(path), "precision=bf16", "offload=disk", "offload.max_memory.cpu=700KB")


def _adapter(model, layer: int = 1) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if f"layers.{layer}." in n and "lora_" in n and p.requires_grad}


def _batch(n: int = 2, s: int = 16) -> torch.Tensor:
    return torch.randint(4, 99, (n, s), generator=torch.Generator().manual_seed(0))


def _train_steps(model, steps: int = 4) -> list[float]:
    """A few AdamW steps on one fixed batch (the loss must fall) over what the trainer would train."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    ids, losses = _batch(), []
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _assert_trains_and_reloads(model, tmp_path, offloaded_layer: int = 1, reload: tuple[str, ...] | None = None):
    from peft import PeftModel
    from safetensors.torch import load_file

    before = {n: p.detach().clone() for n, p in _adapter(model, offloaded_layer).items()}
    assert before and all(p.device.type == "cpu" for p in _adapter(model, offloaded_layer).values())
    losses = _train_steps(model)
    assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.9 * losses[0], losses
    after = _adapter(model, offloaded_layer)
    assert all(not torch.equal(before[n], after[n]) for n in before if "lora_B" in n)  # B starts at zero
    model.save_pretrained(tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    for name, param in after.items():
        key = name.replace(".default", "")
        assert torch.equal(saved[key], param.detach().cpu()), key
    if reload is None:
        return
    # reloaded onto a base that is not offloaded, it is the adapter that was trained
    base = loading.load_model(compose_cfg(*reload), tmp_path / "reload")
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    for name, param in _adapter(reloaded, offloaded_layer).items():
        assert torch.equal(param.detach().float(), after[name].detach().float()), name


def test_disk_offloaded_layer_trains_and_its_adapter_saves(tmp_path, tiny8):
    """The loader's real path (planned device map, offload folder, make_trainable): the layer on
    disk keeps its weights on meta, its adapters are real tensors that learn."""
    cfg = compose_cfg(*disk_overrides(tiny8), f"offload.folder={tmp_path / 'offload'}")
    plan = planner.plan(cfg, world_size=1, ladder=False)
    assert plan["device_map"][LAYER] == "disk" and plan["device_map"]["lm_head"] == "cpu"
    model = loading.make_trainable(cfg, loading.load_model(cfg, tmp_path))
    base = model.get_base_model()
    assert base.hf_device_map == plan["device_map"]  # the planned map is the one loaded
    q_proj = base.model.layers[1].self_attn.q_proj
    assert q_proj.base_layer.weight.device.type == "meta"  # still offloaded
    assert type(q_proj.base_layer) is torch.nn.Linear  # unquantized (llm_int8_enable_fp32_cpu_offload)
    assert model.hf_device_map[LAYER] == "cpu"  # the trainer's view (accelerate refuses "disk" for 4-bit)
    _assert_trains_and_reloads(model, tmp_path, reload=tiny8_model(tiny8))


def test_the_loader_places_layers_by_the_runs_plan_without_planning_them_again(tmp_path, tiny8, monkeypatch):
    """A run hands its plan (what plan.json records) to the loader: the map loaded is that plan's, and
    the loader makes no second plan of its own."""
    cfg = compose_cfg(*disk_overrides(tiny8), f"offload.folder={tmp_path / 'offload'}")
    run_plan = planner.plan(cfg, world_size=1, ladder=False)

    def planned_again(*args, **kwargs):
        raise AssertionError("the loader planned the run a second time")

    monkeypatch.setattr(planner, "plan", planned_again)
    base = loading.load_model(cfg, tmp_path, run_plan)
    assert run_plan["device_map"][LAYER] == "disk" and base.hf_device_map == run_plan["device_map"]


def test_host_ram_offloaded_layer_trains(tmp_path, monkeypatch):
    """A layer offloaded to host RAM as beside a GPU: accelerate's cpu_offload hooks it with its
    state dict in RAM and its weights on meta (quant=none: the layer is unquantized either way)."""
    from accelerate import cpu_offload

    cfg = compose_cfg("quant=none")
    base = loading.load_model(cfg, tmp_path)
    cpu_offload(base.model.layers[1], execution_device=torch.device("cpu"))
    assert base.model.layers[1].self_attn.q_proj.weight.device.type == "meta"
    model = loading.make_trainable(cfg, base)
    _assert_trains_and_reloads(model, tmp_path)  # the disk test reloads


def test_dora_on_an_offloaded_layer_is_refused_in_one_line(tmp_path, tiny8):
    """DoRA reads its base weight outside the forward that onloads it: refused, not a meta error."""
    cfg = compose_cfg(*disk_overrides(tiny8), "peft=dora", f"offload.folder={tmp_path / 'offload'}")
    with pytest.raises(UserError, match="peft=dora cannot train .*layers.1.* offloaded"):
        loading.make_trainable(cfg, loading.load_model(cfg, tmp_path))


@pytest.mark.slow
def test_train_py_with_a_layer_on_disk(tmp_path, monkeypatch, tiny8):
    """The entry point end to end: plan, load, SFTTrainer (accelerate's prepare), save."""
    from safetensors.torch import load_file

    seen = {}
    real = loading.make_trainable

    def spy(cfg, model):
        model = real(cfg, model)
        seen["model"] = model
        seen["before"] = {n: p.detach().clone() for n, p in _adapter(model).items()}
        return model

    monkeypatch.setattr(loading, "make_trainable", spy)
    m, run_dir = train_smoke(tmp_path / "run", "trainer.max_steps=4", *disk_overrides(tiny8))
    assert m["steps"] == 4 and all(math.isfinite(x) for x in m["train_losses"]), m["train_losses"]
    after = _adapter(seen["model"])
    assert all(not torch.equal(seen["before"][n], p) for n, p in after.items() if "lora_B" in n)
    saved = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    assert any("layers.1." in k for k in saved)
    for name, param in after.items():
        assert torch.equal(saved[name.replace(".default", "")], param.detach().cpu())


# --- what an offloaded layer weighs: unquantized, in the load dtype --------------------------------


def _block_numel(model, prefix: str) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith(prefix + ".") and "lora_" not in n)


def test_disk_layer_is_read_in_place_in_the_load_dtype(tmp_path, tiny8):
    """transformers 5 keeps a "disk" module unquantized (llm_int8_enable_fp32_cpu_offload), indexes
    the checkpoint's own safetensors tensors for it (nothing written to offload.folder) and reads
    them cast to the load dtype: params x 2 bytes in bf16, which the plan counts as read from disk."""
    folder = tmp_path / "offload"
    cfg = compose_cfg(*disk_overrides(tiny8), f"offload.folder={folder}")
    plan = planner.plan(cfg, world_size=1, ladder=False)
    model = loading.load_model(cfg, tmp_path)
    assert not any(folder.rglob("*"))  # read in place: the folder stays empty
    assert "disk" not in plan["components"].get("other_params", {})  # so the plan writes nothing there
    hook = model.model.layers[1].self_attn.q_proj._hf_hook
    assert hook.weights_map["weight"].dtype == torch.bfloat16
    on_disk = [k for k, v in plan["device_map"].items() if v == "disk"]
    read = sum(_block_numel(model, k) for k in on_disk) * 2  # bf16
    assert read > 0 and plan["counts"]["disk_read_bytes"] == read
    # on a CPU-only machine the "cpu" layer computes here, unquantized too, upcast to fp32 by k-bit prep
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16


def test_host_ram_layers_beside_a_gpu_count_params_times_load_dtype_bytes(tiny8):
    """Beside a GPU a "cpu" layer stays unquantized in bf16 (transformers' bnb quantizer adds every
    cpu/disk key of a dict map to modules_to_not_convert) and accelerate keeps it as loaded in its
    weights map (dispatch_model: the model's state dict before k-bit prep): host RAM holds exactly
    params x 2 bytes, not the 0.52 bytes of NF4+DQ."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

    cfg = compose_cfg(*tiny8_model(tiny8), "offload=cpu", "offload.max_memory.gpu=540KB")
    plan = planner.plan(cfg, gpus=[24 * 2**30], host_ram=64 * 2**30, world_size=1, ladder=False)
    on_cpu = [k for k, v in plan["device_map"].items() if v == "cpu"]
    assert any(k.startswith("model.layers.") for k in on_cpu) and 0 in plan["device_map"].values()
    # the loader's quantizer on this very map (meta model, no GPU needed)
    config = AutoConfig.from_pretrained(cfg.model.name_or_path)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    q = Bnb4BitHfQuantizer(
        BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", llm_int8_enable_fp32_cpu_offload=True)
    )
    q.preprocess_model(model=model, dtype=torch.bfloat16, device_map=dict(plan["device_map"]))
    for key in on_cpu:
        linears = [m for n, m in model.named_modules() if n.startswith(key + ".") and isinstance(m, torch.nn.Linear)]
        assert all(type(m) is torch.nn.Linear and m.weight.dtype == torch.bfloat16 for m in linears), key
    gpu_layer = next(k for k, v in plan["device_map"].items() if k.startswith("model.layers.") and v == 0)
    assert type(model.get_submodule(gpu_layer).self_attn.q_proj).__name__ == "Linear4bit"
    host = sum(_block_numel(model, k) for k in on_cpu) * 2
    assert plan["components"]["other_params"]["cpu"] == host
    assert "cpu" not in plan["components"].get("quantized_weights", {})


def test_the_placement_budgets_offloaded_layers_at_their_real_size():
    """The 70B disk recipe: what the map puts in host RAM fits offload.max_memory.cpu (less the
    quantizer's 10 %) at bf16; counted at 4 bits it would have held about 4x that."""
    from qlora_recipes.config import devices
    from qlora_recipes.planner.constants import BNB_MAX_MEMORY_FACTOR

    cfg = compose_cfg("recipe=llama2-70b-24gb-disk")
    plan = planner.plan(cfg, gpus=devices.declared_gpus(cfg), host_ram=devices.declared_host_ram(cfg), ladder=False)
    host_weights = plan["components"]["other_params"]["cpu"]
    assert host_weights <= BNB_MAX_MEMORY_FACTOR * plan["max_memory"]["cpu"]
    layers = [k for k, v in plan["device_map"].items() if k.startswith("model.layers.") and v == "cpu"]
    per_layer = 8192 * (2 * 8192 + 2 * 1024) + 3 * 8192 * 28672 + 2 * 8192  # Llama-2-70B, bf16 below
    assert host_weights == len(layers) * per_layer * 2
    assert plan["counts"]["disk_read_bytes"] >= 30 * per_layer * 2 and plan["fits"]
