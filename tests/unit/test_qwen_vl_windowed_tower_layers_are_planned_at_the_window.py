"""Qwen2.5-VL's tower: every layer but fullatt_block_indexes attends within windows of window_size
pixels. The plan sizes those layers' attention at the window, the rest at the whole image: held to the
scores a tiny Qwen2.5-VL tower's eager attention makes (a real forward)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qlora_recipes.planner.vision_forward import (
    TowerLora,
    forward_bytes,
    image_tokens,
    lora_kept_bytes,
    scores,
    vision_shape,
)

VISION = {
    "depth": 4,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
    "window_size": 112,  # 4 merge units (8 patches) a side
    "fullatt_block_indexes": [1, 3],
}
SIDE = 16  # patches a side: 2 x 2 windows of 8 x 8 patches


class _Softmaxes(TorchDispatchMode):
    """The elements of every softmax output: the attention scores eager attention makes."""

    def __init__(self):
        super().__init__()
        self.elements = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten._softmax, torch.ops.aten.softmax):
            self.elements.append(out.numel())
        return out


def _config():
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(vision_config=VISION)


def _without_windows():
    """The same tower had every layer attended the whole image (no window_size)."""
    vc = _config().to_dict()["vision_config"]
    return vision_shape({"vision_config": {k: v for k, v in vc.items() if k != "window_size"}}, 64)


def test_the_windowed_layers_and_the_window_come_from_the_vision_config():
    shape = vision_shape(_config().to_dict(), 64)
    assert (shape.window, shape.full_layers, shape.windowed) == (64, (1, 3), 2)
    no_windows = _without_windows()
    assert no_windows.window == 0 and no_windows.windowed == 0


def test_windowed_layers_are_planned_at_the_scores_the_tower_makes():
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = _config()
    config.vision_config._attn_implementation = "eager"
    tower = Qwen2_5_VisionTransformerPretrainedModel(config.vision_config).eval()
    vc = config.vision_config
    pixels = torch.randn(SIDE * SIDE, 3 * vc.temporal_patch_size * vc.patch_size**2)
    counter = _Softmaxes()
    with torch.no_grad(), counter:
        tower(pixels, grid_thw=torch.tensor([[1, SIDE, SIDE]]))
    shape = vision_shape(config.to_dict(), 64)
    img = image_tokens(shape, {"max_pixels": (SIDE * vc.patch_size) ** 2}, seq_len=4096)
    assert img.patches == SIDE * SIDE
    windowed, full = scores(shape, img, 1, windowed=True), scores(shape, img, 1, windowed=False)
    planned = [full if i in shape.full_layers else windowed for i in range(shape.layers)]
    # eager attention splits a layer at the window bounds: one softmax a window, summed per layer
    measured = sum(counter.elements)
    assert measured == sum(planned) and windowed == full // 4  # 4 windows: a quarter of the full scores
    # the forward's peak is a full layer's while one remains; the saved tensors sum every layer's own
    lora = TowerLora(r=8, dropout=False, checkpointed=False, sigmoid_act=True)
    all_full = _without_windows()
    assert lora_kept_bytes(shape, img, 1, 2, True, lora) < lora_kept_bytes(all_full, img, 1, 2, True, lora)
    assert forward_bytes(shape, img, 1, 2, True) == forward_bytes(all_full, img, 1, 2, True)
