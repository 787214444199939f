"""Real-shape models with random weights, and synthetic data, so the GPU suite needs no model hub.

A model is written from a `conf/model` option's figures tensor by tensor, one safetensors shard per
decoder layer (no model is ever whole in memory), in bf16 (loaded through the real 4-bit path by
`from_pretrained`) or pre-quantized NF4 (a 70B that never exists in memory at once), with a word-level
tokenizer of the model's vocabulary. Data is text over that vocabulary: rows of one length (`full`) or
log-uniform lengths (`mixed`). `Assets` keeps both in the run's cache and builds what is missing.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.runner import log_tail, run_child
from bench.suite import Settings, compose
from qlora_recipes.config.schema import ModelConfig
from qlora_recipes.units import GiB

FIGURE_KEYS = (
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "intermediate_size",
    "vocab_size",
    "tie_embeddings",
    "max_position_embeddings",
)
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
MODEL_MAX_POSITIONS = 131072  # built models allow long sequences (default RoPE; the seq search needs it)
MARKER = "bench-model.json"  # written last: a model dir with it is complete


def figures_of(model_cfg: ModelConfig, **changes: Any) -> dict:
    """The architecture figures of a model option, with `changes` applied."""
    fig = {k: getattr(model_cfg, k) for k in FIGURE_KEYS}
    fig["head_dim"] = model_cfg.head_dim
    arch = model_cfg.architecture
    if arch != "llama":
        raise ValueError(f"random-weight models are built for the llama architecture only, not {arch}")
    fig.update({k: v for k, v in changes.items() if v is not None})
    if not fig.get("head_dim"):
        fig["head_dim"] = fig["hidden_size"] // fig["num_heads"]
    return fig


def figure_overrides(fig: Mapping[str, Any]) -> list[str]:
    """train.py overrides that describe `fig` (so the composed config and the model dir agree)."""
    keys = (*FIGURE_KEYS, "head_dim")
    return [f"model.{k}={str(fig[k]).lower() if isinstance(fig[k], bool) else fig[k]}" for k in keys if k in fig]


def llama_tensor_shapes(fig: Mapping[str, Any]) -> tuple[list[tuple[str, tuple]], list[list[tuple[str, tuple]]]]:
    """(non-layer tensors, per-layer tensors) of a Llama in the HF checkpoint layout: (name, shape)."""
    h, f, v = fig["hidden_size"], fig["intermediate_size"], fig["vocab_size"]
    hd = fig.get("head_dim") or h // fig["num_heads"]
    q, kv = fig["num_heads"] * hd, fig["num_kv_heads"] * hd
    top = [("model.embed_tokens.weight", (v, h)), ("model.norm.weight", (h,))]
    if not fig.get("tie_embeddings"):
        top.append(("lm_head.weight", (v, h)))
    layers = []
    for i in range(fig["num_layers"]):
        p = f"model.layers.{i}."
        layers.append(
            [
                (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (q, h)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, q)),
                (p + "mlp.gate_proj.weight", (f, h)),
                (p + "mlp.up_proj.weight", (f, h)),
                (p + "mlp.down_proj.weight", (h, f)),
            ]
        )
    return top, layers


def _quantized(name: str, shape: tuple, quantize: str | None) -> bool:
    """Only the decoder layers' linears are stored in 4 bits (as bitsandbytes leaves them)."""
    return bool(quantize) and len(shape) == 2 and ".layers." in name


def model_disk_bytes(fig: Mapping[str, Any], quantize: str | None) -> int:
    """About what `build_random_model` writes: bf16, or for the layers' linears NF4 (0.5 B/param, a uint8
    absmax per 64, ~2 KiB of maps and state per tensor)."""
    top, layers = llama_tensor_shapes(fig)
    total = 0
    for name, shape in top + [t for layer in layers for t in layer]:
        n = math.prod(shape)
        if _quantized(name, shape, quantize):
            total += int(n * (0.5 + 1 / 64)) + 2048  # + the quant maps, nested absmax and packed state
        else:
            total += 2 * n
    return total


def write_tokenizer(out: Path, vocab_size: int, max_length: int = 1 << 20, byte_alphabet: bool = False) -> None:
    """A word-level tokenizer with exactly `vocab_size` entries: the 4 specials, then w4 ... w{V-1}.
    `byte_alphabet`: ids 4-259 are the byte-level alphabet instead (the w-words follow), for model
    types whose tokenizer class transformers fixes whatever tokenizer_config names (qwen2 ->
    Qwen2Tokenizer, a byte-level BPE built from this vocab): it then reads text a byte a token,
    where the w-words alone would give it nothing (every row one token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    first = len(SPECIAL_TOKENS)
    if byte_alphabet:
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        vocab.update({ch: first + i for i, ch in enumerate(alphabet)})
        first += len(alphabet)
    vocab.update({f"w{i}": i for i in range(first, vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=max_length,
    )
    tok.save_pretrained(out)


def _llama_config(fig: Mapping[str, Any], quantize: str | None):
    """The config.json of the model: these figures, bf16, and the 4-bit quantization it was saved in."""
    import torch
    from transformers import BitsAndBytesConfig, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=fig["vocab_size"],
        hidden_size=fig["hidden_size"],
        intermediate_size=fig["intermediate_size"],
        num_hidden_layers=fig["num_layers"],
        num_attention_heads=fig["num_heads"],
        num_key_value_heads=fig["num_kv_heads"],
        head_dim=fig.get("head_dim") or None,
        max_position_embeddings=fig.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(fig.get("tie_embeddings")),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype="bfloat16",
    )
    if quantize:
        if quantize != "nf4":
            raise ValueError(f"pre-quantized models are built in nf4 only, not {quantize}")
        cfg.quantization_config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        ).to_dict()
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def _random_shard(tensors, quantize: str | None, gen, device: str, std: float) -> dict:
    """One shard's tensors: normal(0, std) matrices and unit norms, the layers' linears packed to NF4 +
    double quant in the layout bitsandbytes/transformers save when `quantize`."""
    import torch

    data: dict[str, Any] = {}
    for key, shape in tensors:
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.bfloat16, device=device)
        else:
            t = torch.randn(shape, generator=gen, dtype=torch.bfloat16, device=device).mul_(std)
        if _quantized(key, shape, quantize):
            import bitsandbytes.functional as bnbf

            packed, state = bnbf.quantize_4bit(
                t, blocksize=64, compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8
            )
            data[key] = packed.cpu().contiguous()
            for sub, value in state.as_dict(packed=True).items():
                data[f"{key}.{sub}"] = value.cpu().contiguous()
            del packed, state
        else:
            data[key] = t.cpu().contiguous()
        del t
    return data


def build_random_model(
    fig: Mapping[str, Any],
    out: Path,
    quantize: str | None = None,
    device: str = "cpu",
    seed: int = 0,
    std: float = 0.02,
) -> Path:
    """Write a Llama of these figures with random weights (normal(0, std) matrices, unit norms) to `out`,
    one safetensors shard per decoder layer, so no more than one layer is ever in memory. quantize=None
    writes bf16 (from_pretrained quantizes it at load: the real 4-bit path); quantize="nf4" writes a
    pre-quantized NF4 + double-quant checkpoint in the layout bitsandbytes/transformers save.
    Reuses `out` when a previous build with the same figures completed."""
    import torch
    from safetensors.torch import save_file

    out = Path(out)
    stamp = {"figures": dict(fig), "quantize": quantize, "seed": seed, "std": std}
    marker = out / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return out
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    _llama_config(fig, quantize).save_pretrained(out)
    write_tokenizer(out, fig["vocab_size"])

    gen = torch.Generator(device=device).manual_seed(seed)
    top, layers = llama_tensor_shapes(fig)
    shards = [top] + layers
    weight_map: dict[str, str] = {}
    total = 0
    for idx, tensors in enumerate(shards):
        name = f"model-{idx + 1:05d}-of-{len(shards):05d}.safetensors"
        data = _random_shard(tensors, quantize, gen, device, std)
        save_file(data, str(out / name), metadata={"format": "pt"})
        for key, value in data.items():
            weight_map[key] = name
            total += value.numel() * value.element_size()
        del data
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    marker.write_text(json.dumps(stamp))
    return out


def build_main(spec: str, out: str, device: str) -> None:
    """Child process (`python -m bench _build SPEC OUT DEVICE`): write one random-weight model, keeping
    CUDA out of the harness process."""
    s = json.loads(spec)
    started = time.time()
    build_random_model(s["figures"], Path(out), quantize=s.get("quantize"), device=device)
    print(f"built {out} in {time.time() - started:.1f} s")


def write_text_data(path: Path, vocab_size: int, rows: int, min_words: int, max_words: int, seed: int = 0) -> Path:
    """`rows` lines of {"text": "w17 w4051 ..."}; lengths log-uniform in [min_words, max_words] (equal
    bounds: every row that long). Word ids avoid the 4 special tokens."""
    import random

    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    lo, hi = math.log(min_words), math.log(max_words)
    with open(path, "w") as f:
        for _ in range(rows):
            n = min_words if min_words == max_words else int(round(math.exp(rng.uniform(lo, hi))))
            words = " ".join(f"w{rng.randrange(len(SPECIAL_TOKENS), vocab_size)}" for _ in range(n))
            f.write(json.dumps({"text": words}) + "\n")
    return path


class Assets:
    """The models and data files of a suite run, kept in its cache dir (`--cache`) across runs."""

    def __init__(self, settings: Settings):
        self.s = settings

    def model_fig(self, spec: dict, num_layers: int | None = None) -> tuple[str, dict]:
        """(option, figures) of a stage's model: the option's figures, shrunk with --shrink."""
        option = spec["option"]
        mcfg = compose([f"model={option}"]).model
        sh = self.s.suite.get("shrink", {}) if self.s.shrink else {}
        fig = figures_of(mcfg, **sh.get("figures", {}))
        if self.s.shrink:
            fig["head_dim"] = fig["hidden_size"] // fig["num_heads"]
            fig["num_layers"] = sh.get("num_layers", 2)
        if num_layers is not None:
            fig["num_layers"] = int(num_layers)
        fig["max_position_embeddings"] = max(int(fig.get("max_position_embeddings") or 0), MODEL_MAX_POSITIONS)
        return option, fig

    def model_dir(self, option: str, fig: Mapping[str, Any], quantize: str | None = None) -> Path:
        return self.s.cache / "models" / f"{option}-L{fig['num_layers']}-h{fig['hidden_size']}-{quantize or 'bf16'}"

    def build_model(self, option: str, fig: dict, quantize: str | None = None) -> Path:
        out = self.model_dir(option, fig, quantize)
        tag, stamp = out.name, out / MARKER
        if stamp.is_file():
            return out
        need = model_disk_bytes(fig, quantize)
        self._make_room(need, keep=out)
        spec = json.dumps({"figures": fig, "quantize": quantize})
        device = "cuda" if self.s.gpu else "cpu"
        print(f"[bench] building {tag} ({need / GiB:.1f} GiB, random weights, on {device})", flush=True)
        started = time.time()
        if self.s.gpu:  # in a child, so that this process never holds a CUDA context
            child = run_child(
                [sys.executable, "-m", "bench", "_build", spec, str(out), device],
                self.s.work / "build" / f"{tag}.log",
                self.s.env,
                self.s.timeout,
            )
            if child["rc"] != 0 or not stamp.is_file():
                raise RuntimeError(f"building {tag} failed: {log_tail(child['log'])}")
        else:
            build_random_model(fig, out, quantize=quantize, device="cpu")
        print(f"[bench] built {tag} in {time.time() - started:.0f} s", flush=True)
        return out

    def _make_room(self, need: int, keep: Path) -> None:
        """Free disk for a model: drop other cached bench models, oldest first, while short."""
        models = self.s.cache / "models"
        models.mkdir(parents=True, exist_ok=True)
        margin = 4 * GiB
        others = sorted((p for p in models.iterdir() if p.is_dir() and p != keep), key=lambda p: p.stat().st_mtime)
        while shutil.disk_usage(models).free < need + margin and others:
            victim = others.pop(0)
            print(f"[bench] removing cached {victim.name} to make room", flush=True)
            shutil.rmtree(victim, ignore_errors=True)

    def data_file(self, kind: dict, vocab: int, seq_len: int, steps: int) -> Path:
        """Synthetic text for `steps` steps at `seq_len`: `full` rows all longer than seq_len, `mixed`
        rows log-uniform from min_words to seq_len (1.5x the tokens needed, on average)."""
        if kind["kind"] == "full":
            rows, lo, hi = steps + 4, seq_len + 8, seq_len + 8
        else:
            lo, hi = int(kind.get("min_words", 64)), seq_len
            mean = (hi - lo) / math.log(hi / lo) if hi > lo else hi
            rows = int(math.ceil(1.5 * steps * seq_len / mean)) + 8
        path = self.s.cache / "data" / f"{kind['kind']}-v{vocab}-w{lo}-{hi}-r{rows}.jsonl"
        if not path.is_file():
            tmp = path.with_suffix(".tmp")
            write_text_data(tmp, vocab, rows, lo, hi, seed=0)
            tmp.replace(path)
        return path

    def stage_data(self, st: dict, vocab: int, seq_len: int, steps: int) -> Path:
        """The data file a stage (or one of its stacks) names: the suite's `data` entry `full` by default."""
        return self.data_file(self.s.suite["data"][st.get("data", "full")], vocab, seq_len, steps)

    def job_seq_len(self) -> int:
        seq = 2048
        for o in self.s.suite.get("job", []):
            if o.startswith("trainer.seq_len="):
                seq = int(o.split("=", 1)[1])
        return seq

    @staticmethod
    def model_overrides(option: str, fig: dict, path: Path) -> list[str]:
        return [f"model={option}", f"model.name_or_path={path}", *figure_overrides(fig), "force=true"]
