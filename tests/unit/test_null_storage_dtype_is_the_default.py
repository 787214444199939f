"""`quant.storage_dtype=null` is accepted and means the default: uint8, or the compute dtype where
dist=fsdp|zero3 shard a 4-bit base (what conf/dist sets there), the same config as not naming it."""

import pytest
from conftest import REPO

from qlora_recipes.config.loader import load


@pytest.mark.parametrize(
    "stack,expected",
    [((), "uint8"), (("quant=fp4",), "uint8"), (("dist=fsdp", "precision=bf16"), "bfloat16")],
)
def test_null_storage_dtype_is_the_default_of_the_stack(stack, expected):
    given = load([*stack, "quant.storage_dtype=null"])
    assert given.quant.storage_dtype == expected
    assert given.quant == load(list(stack)).quant


def test_null_storage_dtype_passes_the_command_line(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "plan.py"), "quant.storage_dtype=null"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
