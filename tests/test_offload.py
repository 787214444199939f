"""Training with layers offloaded (offload=cpu / offload=disk): the adapters of an offloaded layer
are real tensors that train, and the adapter saves and reloads.

On a GPU the loader's device map puts the layers that do not fit on "cpu" or "disk"; accelerate
keeps their weights on `meta` and an AlignDevicesHook onloads them to the GPU for each forward.
This machine has no GPU, so the CPU is the execution device, and what differs from a GPU run is:
  - "cpu" is the main device here, so accelerate does not hook modules the map puts on "cpu"; a
    layer is offloaded only on "disk" (read from the offload folder each forward). The host-RAM
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
from conftest import compose_cfg

from qlora_recipes import modeling, planner
from qlora_recipes.errors import UserError
from qlora_recipes.training import train

# A CPU budget the tiny model (2 layers) does not fit: layer 1, the final norm and lm_head go to
# disk; the planner keeps lm_head on the execution device (TRL's fused head reads its weight).
DISK = ("offload=disk", "offload.max_memory.cpu=200KB")
LAYER = "model.layers.1"


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


def _assert_trains_and_reloads(model, tmp_path, offloaded_layer: int = 1, reload: bool = True):
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
    if not reload:
        return
    # reloaded onto a base that is not offloaded, it is the adapter that was trained
    base = modeling.load_model(compose_cfg(), tmp_path / "reload")
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    for name, param in _adapter(reloaded, offloaded_layer).items():
        assert torch.equal(param.detach().float(), after[name].detach().float()), name


def test_disk_offloaded_layer_trains_and_its_adapter_saves(tmp_path):
    """The loader's real path (planned device map, offload folder, make_trainable): the layer on
    disk keeps its weights on meta, its adapters are real tensors that learn."""
    cfg = compose_cfg(*DISK, f"offload.folder={tmp_path / 'offload'}")
    plan = planner.plan(cfg, world_size=1, ladder=False)
    assert plan["device_map"][LAYER] == "disk" and plan["device_map"]["lm_head"] == "cpu"
    model = modeling.make_trainable(cfg, modeling.load_model(cfg, tmp_path))
    base = model.get_base_model()
    assert base.hf_device_map == plan["device_map"]  # the planned map is the one loaded
    q_proj = base.model.layers[1].self_attn.q_proj
    assert q_proj.base_layer.weight.device.type == "meta"  # still offloaded
    assert type(q_proj.base_layer) is torch.nn.Linear  # unquantized (llm_int8_enable_fp32_cpu_offload)
    assert model.hf_device_map[LAYER] == "cpu"  # the trainer's view (accelerate refuses "disk" for 4-bit)
    _assert_trains_and_reloads(model, tmp_path)


def test_host_ram_offloaded_layer_trains(tmp_path, monkeypatch):
    """A layer offloaded to host RAM as beside a GPU: accelerate's cpu_offload hooks it with its
    state dict in RAM and its weights on meta (quant=none: the layer is unquantized either way)."""
    from accelerate import cpu_offload

    cfg = compose_cfg("quant=none")
    base = modeling.load_model(cfg, tmp_path)
    cpu_offload(base.model.layers[1], execution_device=torch.device("cpu"))
    assert base.model.layers[1].self_attn.q_proj.weight.device.type == "meta"
    model = modeling.make_trainable(cfg, base)
    _assert_trains_and_reloads(model, tmp_path, reload=False)  # the disk test reloads


def test_dora_on_an_offloaded_layer_is_refused_in_one_line(tmp_path):
    """DoRA reads its base weight outside the forward that onloads it: refused, not a meta error."""
    cfg = compose_cfg(*DISK, "peft=dora", f"offload.folder={tmp_path / 'offload'}")
    with pytest.raises(UserError, match="peft=dora cannot train .*layers.1.* offloaded"):
        modeling.make_trainable(cfg, modeling.load_model(cfg, tmp_path))


@pytest.mark.slow
def test_train_py_with_a_layer_on_disk(tmp_path, monkeypatch):
    """The entry point end to end: plan, load, SFTTrainer (accelerate's prepare), save."""
    from safetensors.torch import load_file

    seen = {}
    real = modeling.make_trainable

    def spy(cfg, model):
        model = real(cfg, model)
        seen["model"] = model
        seen["before"] = {n: p.detach().clone() for n, p in _adapter(model).items()}
        return model

    monkeypatch.setattr(modeling, "make_trainable", spy)
    run_dir = tmp_path / "run"
    m = train(compose_cfg("trainer=smoke", "data.metric=null", "trainer.max_steps=4", *DISK), run_dir)
    assert m["steps"] == 4 and all(math.isfinite(x) for x in m["train_losses"]), m["train_losses"]
    after = _adapter(seen["model"])
    assert all(not torch.equal(seen["before"][n], p) for n, p in after.items() if "lora_B" in n)
    saved = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    assert any("layers.1." in k for k in saved)
    for name, param in after.items():
        assert torch.equal(saved[name.replace(".default", "")], param.detach().cpu())
