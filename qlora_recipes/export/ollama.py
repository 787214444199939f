"""An Ollama Modelfile beside a GGUF: the prompt as the run was trained, and its stop tokens.

    modelfile(merged_dir, gguf_name) -> str

Ollama does not run a GGUF's Jinja chat template (`tokenizer.chat_template`, which the converter
embeds and llama.cpp's server uses with --jinja): it maps the templates it knows to Go templates of
its own and takes the Modelfile's TEMPLATE otherwise. So TEMPLATE here is the run's own prompt
format written as a Go template: a prompt rendered the way generate renders it (the chat template
with its generation prompt for chat data, the Alpaca template, or the prefix and suffix the
prompt/completion rows shared), with the prompt itself as `{{ .Prompt }}`. The BOS the tokenizer
adds is left to llama.cpp (the GGUF's add_bos_token). Stop tokens: the tokenizer's EOS, every
eos_token_id of config.json and generation_config.json, and the chat template's end of turn.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from ..errors import UserError

PROMPT_MARK = "\x00PROMPT\x00"  # stands for the user's prompt while the template is rendered


def _go_literal(text: str) -> str:
    """Text a Go template prints as it is: its own `{{` written as a string action."""
    return text.replace("{{", '{{ "{{" }}')


def _prompt_format(merged_dir: Path):
    from ..outputs.prompts import load_prompt_format
    from ..outputs.runfiles import read_json

    path = merged_dir / "merge_report.json"
    report = read_json(path, "merge the run again") if path.is_file() else {}
    style = report.get("prompt_style", "plain")
    return load_prompt_format(None, style, report.get("prompt_format"))


def template(tokenizer, merged_dir: Path) -> str:
    from ..outputs.prompts import Prompt, render

    fmt = _prompt_format(merged_dir)
    text, _ = render(tokenizer, Prompt("text", PROMPT_MARK), fmt)
    if tokenizer.bos_token and text.startswith(tokenizer.bos_token):
        text = text[len(tokenizer.bos_token) :]  # llama.cpp adds it (add_bos_token)
    if PROMPT_MARK not in text:
        raise UserError(f"{merged_dir}: the run's prompt format drops the prompt; no Modelfile TEMPLATE can be written")
    before, after = text.split(PROMPT_MARK, 1)
    go = _go_literal(before) + "{{ .Prompt }}" + _go_literal(after)
    if '"""' in go:
        raise UserError(f'{merged_dir}: the run\'s prompt template holds """, which a Modelfile TEMPLATE cannot')
    return go


def _eos_ids(merged_dir: Path, name: str) -> object:
    path = merged_dir / name
    return json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None


def stop_tokens(tokenizer, merged_dir: Path) -> list[str]:
    from ..outputs.generation import stop_strings, stop_token_ids

    holder = SimpleNamespace(
        generation_config=SimpleNamespace(eos_token_id=_eos_ids(merged_dir, "generation_config.json")),
        config=SimpleNamespace(eos_token_id=_eos_ids(merged_dir, "config.json")),
    )
    ids = stop_token_ids(holder, tokenizer)
    texts = [tokenizer.convert_ids_to_tokens(i) for i in ids]
    texts += stop_strings(tokenizer, _prompt_format(merged_dir))
    return list(dict.fromkeys(t for t in texts if t))


def modelfile(merged_dir: Path, gguf_name: str) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(merged_dir))
    lines = [
        "# Ollama: ollama create NAME -f Modelfile   (written by qlora export; the prompt as the run was trained)",
        f"FROM ./{gguf_name}",
        f'TEMPLATE """{template(tokenizer, merged_dir)}"""',
    ]
    lines += [f"PARAMETER stop {json.dumps(t)}" for t in stop_tokens(tokenizer, merged_dir)]
    return "\n".join(lines) + "\n"
