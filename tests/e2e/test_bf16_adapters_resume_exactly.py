"""A run that trains bf16 adapters (precision=bf16, peft.adapter_dtype=auto: what a GPU user runs) and is
stopped, then resumed, ends with the very adapter of a run never stopped. peft's load_adapter, which
transformers' resume calls, upcasts bf16 adapters to fp32: the resumed steps computed in fp32 and the
adapter differed. precision=bf16 is pinned so the check holds on a CPU whose precision=auto is fp32 too."""

import json

from conftest import SMOKE, resumed_as_if_never_stopped
from safetensors import safe_open


def test_a_run_with_bf16_adapters_resumes_to_the_adapter_of_a_run_never_stopped(small_data, tmp_path, monkeypatch):
    resumed_as_if_never_stopped([*SMOKE, *small_data, "precision=bf16"], tmp_path, monkeypatch)
    stopped = tmp_path / "stopped"
    assert json.loads((stopped / "plan.json").read_text())["stack"]["adapter_dtype"] == "bfloat16"
    with safe_open(stopped / "adapter" / "adapter_model.safetensors", "pt") as saved:
        assert {str(saved.get_slice(k).get_dtype()) for k in saved.keys()} == {"BF16"}
