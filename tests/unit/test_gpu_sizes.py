"""qlora_recipes/config/devices.py: one rule for a GPU's size, whether a recipe's hardware node or `--gpus` names it
(once `--gpus 24GB` planned 22.4 GiB while the 24 GB recipes plan 23.5 GiB)."""

import re

import pytest
from conftest import compose_cfg, options

from qlora_recipes.config import devices
from qlora_recipes.errors import UserError
from qlora_recipes.units import GiB


def test_a_marketed_size_is_the_card_the_recipes_plan():
    assert devices.parse_gpus("24GB") == [int(23.5 * GiB)]
    assert devices.parse_gpus("24GB") == devices.declared_gpus(compose_cfg("recipe=llama3.1-8b-24gb"))
    assert devices.parse_gpus("2x24gb") == devices.declared_gpus(compose_cfg("recipe=llama3.1-70b-2x24gb"))
    assert devices.parse_gpus("80GB") == devices.declared_gpus(compose_cfg("recipe=llama2-70b-a100"))


def test_other_sizes_follow_accelerate():
    assert devices.parse_gpus("2x80GiB,20GB") == [80 * GiB, 80 * GiB, 20 * 10**9]
    assert devices.parse_gpus("none") == []
    with pytest.raises(UserError, match="--gpus"):
        devices.parse_gpus("24XB")


@pytest.mark.parametrize("name", [n for n in options("recipe") if re.search(r"\d+GB", n, re.I) or "a100" in n])
def test_every_recipe_sized_for_a_card_uses_that_cards_figure(name):
    """A recipe whose hardware names a marketed size ("RTX 3090 / 4090 24GB", "A100 80GB") budgets
    each GPU at MARKETED_GPU_GIB of that size: the figure `--gpus 24GB` plans with."""
    hw = compose_cfg(f"recipe={name}").hardware
    sold = re.search(r"(\d+)\s*GB", hw.name)
    assert sold, f"{name}: hardware.name {hw.name!r} names no card size"
    assert hw.gpu_memory_gib == devices.MARKETED_GPU_GIB[int(sold.group(1))], (name, hw.gpu_memory_gib)


@pytest.mark.parametrize(
    "text,needle",
    [
        ("24", "24 has no unit; write e.g. 24GB"),  # once 24 bytes
        ("2x24", "24 has no unit"),
        ("0x24GB", "0 GPUs of 24GB; give 1 to"),  # once a plan for the CPU
        ("1000000x80GB", "1000000 GPUs of 80GB"),  # once accepted
        ("512MB", "is outside 1.0 GiB to 1024.0 GiB"),
        ("80TB", "is outside 1.0 GiB to 1024.0 GiB"),
    ],
)
def test_a_gpu_size_needs_a_unit_and_sane_bounds(text, needle):
    with pytest.raises(UserError, match=re.escape(needle)) as err:
        devices.parse_gpus(text)
    assert str(err.value).startswith(f"--gpus {text!r}") and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "text,needle", [("256", "256: a size needs a unit; write e.g. 256GB"), ("1MB", "is outside 1.0 GiB")]
)
def test_host_ram_needs_a_unit_and_sane_bounds(text, needle):
    from qlora_recipes.cli.plan import parse_hardware_flags

    with pytest.raises(UserError, match=re.escape(needle)):
        parse_hardware_flags(["--host-ram", text])
