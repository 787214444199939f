"""A CPU run that computes bf16 natively makes its kernels' workspace with its first bf16 op, after the
model is loaded: the plan counts it in every phase but loading, so a load-time peak (an fp32 checkpoint's
pages) is not planned with kernels that do not exist yet."""

from conftest import SMOKE, compose_cfg

from qlora_recipes import planner
from qlora_recipes.planner import process
from qlora_recipes.planner.constants import CPU_NATIVE_BF16_KERNELS_BYTES

GiB = 2**30


def _cpu(plan: dict) -> dict:
    (cpu,) = [d for d in plan["devices"] if d["device"] == "cpu"]
    return cpu


def _plan(monkeypatch, flags: frozenset, precision: str) -> dict:
    monkeypatch.setattr(process, "cpu_flags", lambda: flags)
    with planner.measured_start(GiB // 2):
        return planner.plan(compose_cfg(*SMOKE, f"precision={precision}"))


def test_native_bf16_kernels_count_in_every_phase_but_loading(monkeypatch):
    native = _plan(monkeypatch, frozenset({"amx_bf16"}), "bf16")
    plain = _plan(monkeypatch, frozenset(), "bf16")
    assert native["components"]["cpu_kernels"] == {"cpu": CPU_NATIVE_BF16_KERNELS_BYTES}
    assert plain["components"].get("cpu_kernels", {}).get("cpu", 0) == 0
    assert native["components"]["process_baseline"] == plain["components"]["process_baseline"]
    with_kernels, without = _cpu(native)["peak_by_phase"], _cpu(plain)["peak_by_phase"]
    assert with_kernels["load"] == without["load"]
    assert all(with_kernels[k] - without[k] == CPU_NATIVE_BF16_KERNELS_BYTES for k in without if k != "load")


def test_fp32_runs_plan_no_bf16_kernels(monkeypatch):
    plan = _plan(monkeypatch, frozenset({"amx_bf16"}), "fp32")
    assert plan["components"].get("cpu_kernels", {}).get("cpu", 0) == 0
