"""The lean options in training: `precision.upcast_frozen=false` (frozen embeddings, lm_head and norms in the
compute dtype instead of k-bit prep's fp32) trains in the dtype asked for; `trainer.activation_offloading`
(TRL: saved activations to pinned host RAM) is refused in one line on CPU and trains on a GPU."""

import math

import pytest
import torch
from conftest import requires_gpu

from qlora_recipes.errors import UserError
from qlora_recipes.model import loading


def _spy_on_training_dtypes(monkeypatch) -> dict:
    """Wrap loading.make_trainable: at each training forward, the dtypes the final norm sees."""
    seen: dict = {}
    real = loading.make_trainable

    def spy(cfg, model):
        model = real(cfg, model)
        base = model.get_base_model()

        def record(module, args):
            if not (module.training and torch.is_grad_enabled()):
                return
            seen["lm_head"] = base.lm_head.weight.dtype
            seen["embed_tokens"] = base.model.embed_tokens.weight.dtype
            seen["norms"] = {m.weight.dtype for n, m in base.named_modules() if n.endswith("norm")}
            seen["frozen"] = {p.dtype for p in base.parameters() if not p.requires_grad and p.is_floating_point()}
            seen["lora"] = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
            seen["trainable"] = {p.dtype for p in model.parameters() if p.requires_grad}
            seen["residual"] = args[0].dtype

        base.model.norm.register_forward_pre_hook(record)
        return model

    monkeypatch.setattr(loading, "make_trainable", spy)
    return seen


# ----------------------------------------------------------------------------------------------
# precision.upcast_frozen
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "quant,upcast",
    [("nf4", False), ("fp4", False), ("int8", False), ("none", False), ("nf4", True)],
)
def test_frozen_parts_train_in_the_dtype_asked_for(quant, upcast, monkeypatch, smoke_run):
    seen = _spy_on_training_dtypes(monkeypatch)
    upcast_frozen = f"precision.upcast_frozen={str(upcast).lower()}"
    m, _ = smoke_run(f"quant={quant}", "precision=bf16", upcast_frozen, "peft.adapter_dtype=float32")
    assert m["steps"] == 3 and all(math.isfinite(x) for x in m["train_losses"]), m["train_losses"]
    frozen = torch.float32 if upcast and quant != "none" else torch.bfloat16
    assert seen["lm_head"] == seen["embed_tokens"] == frozen
    assert seen["norms"] == seen["frozen"] == {frozen}
    assert seen["residual"] == frozen  # the residual stream follows the embeddings
    assert seen["lora"] == seen["trainable"] == {torch.float32}  # peft autocast_adapter_dtype


def test_modules_to_save_copies_train_in_fp32_without_the_upcast(monkeypatch, smoke_run):
    """peft upcasts the adapters, not the modules_to_save copies: make_trainable does (as planned)."""
    seen = _spy_on_training_dtypes(monkeypatch)
    m, _ = smoke_run(
        "precision=bf16",
        "precision.upcast_frozen=false",
        "peft.modules_to_save=[lm_head]",
        "peft.adapter_dtype=float32",
    )
    assert all(math.isfinite(x) for x in m["train_losses"]), m["train_losses"]
    assert seen["trainable"] == {torch.float32} and seen["frozen"] == {torch.bfloat16}


# ----------------------------------------------------------------------------------------------
# trainer.activation_offloading
# ----------------------------------------------------------------------------------------------
OFFLOAD_LINE = "trainer.activation_offloading=true needs a CUDA GPU"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_activation_offloading_is_refused_in_one_line_on_cpu(run_dir, smoke_run):
    with pytest.raises(UserError) as err:
        smoke_run("trainer.activation_offloading=true")
    assert str(err.value).startswith(OFFLOAD_LINE) and "\n" not in str(err.value)
    assert not (run_dir / "config.yaml").exists()  # refused before anything is written
    # why: TRL's offloader asks torch for the accelerator, and there is none (an AttributeError
    # from SFTTrainer's __init__ otherwise); when TRL runs here, this refusal can go
    from trl.models import get_act_offloading_ctx_manager

    with pytest.raises(AttributeError):
        get_act_offloading_ctx_manager(torch.nn.Linear(2, 2))


@pytest.mark.gpu
@requires_gpu("TRL's activation offloading needs a CUDA GPU")
def test_activation_offloading_trains_on_a_gpu(smoke_run):
    m, _ = smoke_run("trainer.activation_offloading=true")
    assert m["steps"] == 3 and all(math.isfinite(x) for x in m["train_losses"])


@pytest.mark.gpu
@requires_gpu("offload.embeddings keeps the table off a CUDA GPU")
def test_embeddings_in_host_ram_train_on_a_gpu(smoke_run, monkeypatch):
    placed = {}
    real = loading.make_trainable

    def spy(cfg, model):
        placed["table"], placed["model"] = model.get_input_embeddings().weight.device.type, model
        return real(cfg, model)

    monkeypatch.setattr(loading, "make_trainable", spy)
    # the exact-match pass too: generation puts the ids on the LM head's device, not the table's
    m, _ = smoke_run("offload.embeddings=true", "trainer.activation_offloading=true", "data.metric=exact_match")
    assert placed["table"] == "cpu" and m["steps"] == 3 and all(math.isfinite(x) for x in m["train_losses"])
    # still there after the trainer moved the model to its device (accelerate's prepare_model)
    assert placed["model"].get_input_embeddings().weight.device.type == "cpu"


@pytest.mark.gpu
@requires_gpu("the CUDA caching allocator")
def test_a_gpu_run_allocates_from_expandable_segments(smoke_run):
    """trainer.expandable_segments (the default): every segment the run's allocator mapped grows."""
    m, _ = smoke_run()
    assert m["steps"] == 3
    segments = torch.cuda.memory._snapshot()["segments"]
    assert segments and all(s.get("is_expandable") for s in segments)


# ----------------------------------------------------------------------------------------------
# trainer.tiled_mlp
# ----------------------------------------------------------------------------------------------
def test_tiled_mlp_trains_through_its_tiles_in_forward_and_backward(monkeypatch, smoke_run):
    """The smoke run with every decoder MLP over 16-token tiles: the tiled Function runs in each
    checkpointed layer's forward and backward, and the run trains and saves its adapter."""
    from qlora_recipes.model.tiled_mlp import TiledMLPFunction

    calls = {"forward": 0, "backward": 0}
    forward, backward = TiledMLPFunction.forward, TiledMLPFunction.backward

    def counted(name, fn):
        def wrapper(*args):
            calls[name] += 1
            return fn(*args)

        return staticmethod(wrapper)

    monkeypatch.setattr(TiledMLPFunction, "forward", counted("forward", forward))
    monkeypatch.setattr(TiledMLPFunction, "backward", counted("backward", backward))
    m, run = smoke_run("trainer.tiled_mlp=true", "trainer.tiled_mlp_tile=16")
    assert m["steps"] == 3 and all(math.isfinite(x) for x in m["train_losses"]), m["train_losses"]
    layers = 2  # the tiny model's; checkpointing recomputes each forward once in backward
    assert calls["backward"] == 3 * layers and calls["forward"] == 2 * calls["backward"]
    assert (run / "adapter" / "adapter_model.safetensors").is_file()


# ----------------------------------------------------------------------------------------------
# trainer.lean_rmsnorm
# ----------------------------------------------------------------------------------------------
def test_lean_rmsnorms_train_through_their_own_backward(monkeypatch, smoke_run):
    """The smoke run with every RMSNorm lean: each checkpointed layer's two norms and the final one run
    the lean Function's backward, and the run trains and saves its adapter."""
    from qlora_recipes.model.lean_rmsnorm import LeanRMSNormFunction

    calls = {"backward": 0}
    backward = LeanRMSNormFunction.backward

    def counted(*args):
        calls["backward"] += 1
        return backward(*args)

    monkeypatch.setattr(LeanRMSNormFunction, "backward", staticmethod(counted))
    m, run = smoke_run("trainer.lean_rmsnorm=true")
    assert m["steps"] == 3 and all(math.isfinite(x) for x in m["train_losses"]), m["train_losses"]
    assert calls["backward"] == 3 * (2 * 2 + 1)  # 3 steps x (2 layers x 2 norms + the final norm)
    assert (run / "adapter" / "adapter_model.safetensors").is_file()


# ----------------------------------------------------------------------------------------------
# peft.adapter_dtype
# ----------------------------------------------------------------------------------------------
def test_bf16_adapters_train_and_are_saved_in_bf16(monkeypatch, smoke_run):
    """peft.adapter_dtype=bfloat16: every trained tensor is bf16 at each training forward (the lifecycle
    keeps what TRL's cast made, where it restores fp32 by default) and the saved adapter is bf16."""
    from safetensors import safe_open

    seen = _spy_on_training_dtypes(monkeypatch)
    m, run = smoke_run("precision=bf16", "peft.adapter_dtype=bfloat16")
    assert m["steps"] == 3 and all(math.isfinite(x) for x in m["train_losses"]), m["train_losses"]
    assert seen["lora"] == seen["trainable"] == {torch.bfloat16}
    with safe_open(run / "adapter" / "adapter_model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    plan = (run / "plan.json").read_text()
    assert '"adapter_dtype": "bfloat16"' in plan
