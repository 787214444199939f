"""The GPU suite's `seq_search` stage: the longest `trainer.seq_len` the 70B shape trains at on this
device. A bounded binary search over multiples of the granularity whose probes train the reduced-depth
models (e.g. 2 and 4 layers) at that length and extrapolate the peak to the full depth against the
device's memory; the answer is then run once on the full pre-quantized model if the `full` stage built
it, and the planner's own answer (the same search over its plans) is recorded beside it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import planning as P
from bench.models import MARKER, figure_overrides
from bench.stats import extrapolate_layers, search_longest
from bench.suite import compose
from qlora_recipes.units import GiB


def _capacity_gib(b: Any) -> float:
    """What a probe must fit in: the GPU's memory, or on a CPU (shrink mode) the machine's RAM."""
    if b.settings.gpu:
        return b.settings.device["total_bytes"] / GiB
    import psutil

    return psutil.virtual_memory().total / GiB


class Prober:
    """fits(seq) for `search_longest`: train each reduced-depth model at `seq`, extrapolate the peak to
    `target` layers (plus the CUDA context on a GPU) and compare with the capacity; every probe is kept."""

    def __init__(self, b: Any, key: str, st: dict, option: str, models: dict, data: Path, target: int):
        self.b, self.key, self.st, self.option = b, key, st, option
        self.models, self.data, self.target = models, data, target
        self.steps, self.warmup = b.settings.steps, b.settings.warmup
        self.capacity = _capacity_gib(b)
        self.quantity = "peak_reserved_gib" if b.settings.gpu else "peak_rss_gib"
        self.probes: list[dict] = []
        self.plans: dict[int, dict | None] = {}

    def train(self, name: str, fig: dict, path: Path, seq: int, record: bool) -> dict:
        """Our run of the model at `path` at this sequence length (its stack entry)."""
        return self.b.measure.stack(
            name,
            [
                *self.b.assets.model_overrides(self.option, fig, path),
                f"data.path={self.data}",
                f"trainer.seq_len={seq}",
                *self.st.get("overrides", []),
            ],
            steps=self.steps,
            warmup=self.warmup,
            repeats=1,
            record=record,
        )

    def _measure(self, seq: int) -> tuple[dict[int, float], list[str]]:
        """{layers: measured quantity} of the runs that succeeded; notes on those that did not."""
        pts, notes = {}, []
        for layers, (fig, path) in self.models.items():
            e = self.train(f"{self.key}-probe-L{layers}-s{seq}", fig, path, seq, record=False)
            o = e.get("ours", {})
            if o.get("status") != "ok" or o.get("note"):
                notes.append(f"L{layers}: {o.get('error') or o.get('note')}"[:200])
            else:
                pts[layers] = o.get(self.quantity)
                self.plans[seq] = e.get("plan")
        return pts, notes

    def __call__(self, seq: int) -> bool:
        pts, notes = self._measure(seq)
        if notes or len(pts) < 2:
            self.probes.append({"seq_len": seq, "fits": False, "note": "; ".join(notes) or "too few points"})
            return False
        ex = extrapolate_layers(pts, self.target)
        ctx = (self.plans.get(seq) or {}).get("cuda_context_gib", 0.0) if self.b.settings.gpu else 0.0
        need = ex["at_target"] + ctx
        ok = need <= self.capacity
        self.probes.append(
            {
                "seq_len": seq,
                "fits": ok,
                "peak_gib": need,
                "points": ex["points"],
                "note": f"{self.quantity} extrapolated to {self.target} layers"
                f"{' + CUDA context ' + format(ctx, '.2f') + ' GiB' if ctx else ''}"
                f" vs {self.capacity:.1f} GiB",
            }
        )
        print(f"[bench] seq {seq}: need {need:.2f} GiB of {self.capacity:.1f} -> {'fits' if ok else 'no'}", flush=True)
        return ok


def _planner_longest(b: Any, option: str, target: int, grid: tuple[int, int, int], st: dict) -> int | None:
    """The same search over the planner's plans of the full-depth stack (GPU only: the planner's budget
    is a GPU's memory; on a CPU the search only exercises the path)."""
    if not b.settings.gpu:
        return None
    _, tfig = b.assets.model_fig(st["model"], num_layers=target)
    base = [f"model={option}", *figure_overrides(tfig), *st.get("overrides", [])]

    def fits(seq: int) -> bool:
        cfg = compose(b.measure.child_overrides([*base, f"trainer.seq_len={seq}"], 3))
        return P.fits(cfg, b.settings.gpus_decl)

    return search_longest(*grid, fits, 64)


def _verify_full(b: Any, key: str, st: dict, prober: Prober, longest: int) -> bool | None:
    """One run of the full pre-quantized model at the answer, as a probe; None when `full` did not build it."""
    full_layers = (b.settings.suite.get("stages", {}).get("full", {}) or {}).get("num_layers")
    _, ffig = b.assets.model_fig(st["model"], num_layers=full_layers)
    fpath = b.assets.model_dir(prober.option, ffig, "nf4")
    if not (fpath / MARKER).is_file():
        prober.probes.append({"seq_len": longest, "fits": None, "note": "full model not built (stage full)"})
        return None
    e = prober.train(f"{key}-verify-L{ffig['num_layers']}-s{longest}", ffig, fpath, longest, record=True)
    o = e.get("ours", {})
    ok = o.get("status") == "ok" and not o.get("note")
    prober.probes.append(
        {
            "seq_len": longest,
            "fits": ok,
            "peak_gib": o.get(prober.quantity),
            "note": f"full {ffig['num_layers']}-layer pre-quantized model, measured"
            f"{'' if ok else ': ' + str(o.get('error') or o.get('note'))[:160]}",
        }
    )
    return ok


def stage_seq_search(b: Any, key: str, st: dict) -> None:
    option, full_fig = b.assets.model_fig(st["model"])
    target = int(st.get("target_layers", full_fig["num_layers"]))
    grid = (int(st["lo"]), int(st["hi"]), int(st.get("granularity", 1024)))
    models = {}
    for layers in st["layers"]:
        _, fig = b.assets.model_fig(st["model"], num_layers=layers)
        models[layers] = (fig, b.assets.build_model(option, fig))
    data = b.assets.stage_data(st, full_fig["vocab_size"], grid[1], b.settings.steps)
    prober = Prober(b, key, st, option, models, data, target)
    longest = search_longest(*grid, prober, int(st.get("max_probes", 7)))
    entry = {
        "name": f"{key}-{option}",
        "mode": f"extrapolated from layers {list(st['layers'])} to {target}",
        "capacity_gib": prober.capacity,
        "longest_seq": longest,
        "planner_longest_seq": _planner_longest(b, option, target, grid, st),
        "probes": prober.probes,
        "granularity": grid[2],
    }
    if st.get("verify_full") and longest:
        entry["verified_full"] = _verify_full(b, key, st, prober, longest)
    b.results.put("seq_search", entry)
