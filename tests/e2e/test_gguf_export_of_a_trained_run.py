"""`qlora export --to gguf` on a trained run writes a GGUF, by llama.cpp's own converter, whose every
tensor equals the merged weights within its type's rounding, and an Ollama Modelfile with the run's
prompt format and stop tokens.

The shipped tiny model's character-level WordLevel tokenizer is none the converter reads (the README
test holds its one-line refusal), so the run here is of a tiny Llama built with a Llama-style
byte-fallback BPE tokenizer, which it converts. The converter comes from the pinned source release
(`qlora export --fetch-converter`: pip, once, into the user's cache), fetched here when missing."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import train_smoke
from helpers_families import COMMON

from qlora_recipes.cli import main as qlora

CHAT = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_bpe_llama(out: Path) -> Path:
    """A 2-layer Llama whose tokenizer is a byte-fallback BPE (one token per printable character, every
    byte as <0xNN>), the Llama-2 layout llama.cpp's converter reads without a tokenizer.model."""
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>"]
    pieces = special + [f"<0x{i:02X}>" for i in range(256)] + ["\u2581"] + [chr(i) for i in range(33, 127)]
    vocab = {t: i for i, t in enumerate(pieces)}
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(special)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<unk>"
    )
    tokenizer.chat_template = CHAT
    torch.manual_seed(0)
    config = LlamaConfig(**{**COMMON, "vocab_size": len(vocab), "tie_word_embeddings": False})
    LlamaForCausalLM(config).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The run trained on the BPE Llama, exported as f16 (merged first), then as q8_0 and bf16 (the merge reused)."""
    from qlora_recipes.export.converter import fetch_converter

    fetch_converter(progress=lambda _: None)
    root = tmp_path_factory.mktemp("gguf")
    base = build_bpe_llama(root / "bpe-llama")
    _, run_dir = train_smoke(root / "run", f"model.name_or_path={base}")
    outputs = {}
    for quant, out in (("f16", None), ("q8_0", root / "q8"), ("bf16", root / "bf16")):
        argv = ["export", str(run_dir), "--to", "gguf", "--quant", quant, *(["--out", str(out)] if out else [])]
        with pytest.raises(SystemExit) as exit_:
            qlora(argv)
        assert exit_.value.code == 0, quant
        outputs[quant] = out or run_dir / "gguf"
    return run_dir, outputs


def _merged(run_dir: Path) -> dict:
    """The merged tensors as fp32 arrays, read with safetensors' torch API: numpy has no bfloat16, the
    dtype a merge of a bf16 run (a GPU's, or a CPU with native bf16) is saved in."""
    from safetensors import safe_open

    found = {}
    for shard in (run_dir / "merged").glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            found.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return found


def test_the_merge_is_saved_in_the_runs_precision(exported):
    """Whatever precision=auto picked here (bf16 where the CPU has it natively, else fp32), the merged
    tensors are saved in it: the GGUF tests below then read a bf16 or an fp32 source."""
    import yaml

    from qlora_recipes.units import PRECISION_DTYPE

    run_dir, _ = exported
    precision = yaml.safe_load((run_dir / "config.yaml").read_text())["precision"]["name"]
    dtypes = {str(t.dtype).removeprefix("torch.") for t in _merged(run_dir).values()}
    assert dtypes == {PRECISION_DTYPE[precision]}, (precision, dtypes)


# one rounding step of each GGUF type, relative to a tensor's largest value (q8_0: its block scale)
@pytest.mark.parametrize("quant, step", [("f16", 2.0**-10), ("q8_0", 1 / 127), ("bf16", 2.0**-7)])
def test_every_merged_tensor_is_in_the_gguf_within_its_rounding(exported, quant, step):
    """Read back here with gguf's reader, independently of the export's own check: each merged tensor
    has a GGUF tensor of its size whose values, sorted (the converter reorders q/k rows), are the
    merged values within one rounding step of the tensor's largest value. A bf16 merge (numpy has no
    bfloat16: read with torch) loses nothing to bf16 and only f16's subnormals to f16."""
    import gguf
    from gguf.quants import dequantize

    run_dir, outputs = exported
    reader = gguf.GGUFReader(str(outputs[quant] / f"model-{quant}.gguf"))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    tensors = {t.name: t for t in reader.tensors}
    merged = {k: v.float().numpy() for k, v in _merged(run_dir).items()}
    assert len(tensors) == len(merged)
    for hf_name, ref in merged.items():
        t = tensors[names.get_name(hf_name, try_suffixes=(".weight",))]
        values = dequantize(t.data, t.tensor_type).reshape(-1)
        assert values.size == ref.size, hf_name
        bound = step * float(np.abs(ref).max()) + 1e-7
        assert float(np.abs(np.sort(values) - np.sort(ref.reshape(-1))).max()) <= bound, hf_name
    report = json.loads((outputs[quant] / "export_report.json").read_text())
    assert report["check"]["tensors"] == len(merged) and report["quant"] == quant
    if quant == "q8_0":
        assert report["check"]["types"].get("Q8_0", 0) > 0  # the 2-D weights really are Q8_0
    embedded = reader.get_field("tokenizer.chat_template").contents()
    assert embedded == CHAT  # the converter embeds the trained chat template


def test_the_modelfile_carries_the_prompt_format_and_stop_tokens(exported):
    run_dir, outputs = exported
    text = (outputs["f16"] / "Modelfile").read_text()
    assert "FROM ./model-f16.gguf" in text
    fmt = json.loads((run_dir / "metrics.json").read_text())["data"]["prompt_format"]
    template = re.search(r'TEMPLATE """(.*?)"""', text, re.S).group(1)
    assert template == fmt["prefix"] + "{{ .Prompt }}" + fmt["suffix"]  # the sample's `order: ` ... newline
    assert 'PARAMETER stop "</s>"' in text


def test_a_merged_dir_exports_beside_itself_and_a_second_export_replaces_the_first(exported, capsys):
    run_dir, outputs = exported
    with pytest.raises(SystemExit) as exit_:
        qlora(["export", str(run_dir / "merged"), "--to", "gguf", "--quant", "q8_0", "--out", str(outputs["q8_0"])])
    out, err = capsys.readouterr()
    assert exit_.value.code == 0, err
    assert re.search(r"(?m)^checked: all \d+ merged tensors are in it", out), out
    assert sorted(p.name for p in outputs["q8_0"].iterdir()) == ["Modelfile", "export_report.json", "model-q8_0.gguf"]
    assert not outputs["q8_0"].with_name("q8.partial").exists()


@pytest.mark.slow
def test_llama_cpp_continues_held_out_prompts_with_the_merged_models_greedy_tokens(exported):
    """llama.cpp itself (llama-cpp-python, optional: `pip install llama-cpp-python==0.3.36`, which
    compiles it) loads the f16 GGUF and, on held-out prompts, puts its highest logit on each token the
    merged HF model picks greedily; the merged weights are rounded to f16 first, so only the two
    kernels differ, and a position whose top two HF logits are within 1e-3 (a tie either may break) is
    not held to it."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, outputs = exported
    merged = run_dir / "merged"
    tokenizer = AutoTokenizer.from_pretrained(merged)
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    llm = llama_cpp.Llama(
        str(outputs["f16"] / "model-f16.gguf"), n_ctx=128, logits_all=True, n_threads=1, verbose=False
    )
    rows = [json.loads(line) for line in (Path(__file__).parents[2] / "assets/data/order/eval.jsonl").open()][:8]
    held, compared = 0, 0
    for row in rows:
        ids = tokenizer(row["prompt"], return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True
            )
        sequence = out.sequences[0].tolist()
        llm.reset()
        llm.eval(sequence[:-1])
        for step, scores in enumerate(out.scores):
            position = ids.shape[1] - 1 + step
            top2 = torch.topk(scores[0], 2).values
            if float(top2[0] - top2[1]) < 1e-3:
                continue
            compared += 1
            held += int(np.argmax(llm.scores[position]) == sequence[position + 1])
    assert compared >= 40  # most positions are no tie
    assert held == compared, f"llama.cpp's greedy token differs at {compared - held} of {compared} positions"
