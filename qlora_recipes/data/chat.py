"""The chat template chat data is trained with (`data.chat_template`), and its end-of-turn marker.

`data.chat_template` is null or `tokenizer` (the tokenizer's own template), a built-in name
(`BUILTIN_TEMPLATES`: chatml, llama3, gemma, mistral), a path to a Jinja template file, or the Jinja text
itself. The chosen template is set on the tokenizer before training, so TRL tokenizes with it and the run's
saved tokenizer (adapter/) carries it: generation later renders prompts the same way.

Under assistant-only loss TRL needs `{% generation %}` markers in the template to mask the other turns. The
built-ins carry them, with each assistant turn's end-of-turn marker inside, so the model learns to stop;
for a tokenizer template without them TRL has patched versions of common ones. Chat data on a tokenizer
without a template and no `data.chat_template` stops the run with one line naming the option.

Nothing here imports torch, transformers or datasets at import time (validate.py checks the option).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..errors import UserError

log = logging.getLogger(__name__)

TOKENIZER_TEMPLATE = "tokenizer"

# Each role on its own line between <|im_start|> and <|im_end|> (Qwen, OpenHermes, many others).
CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}{{- '\\n' -}}"
    "{%- else -%}{{- message['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Llama 3 / 3.1 instruct: header tokens around the role, <|eot_id|> ends a turn.
LLAMA3 = (
    "{{- bos_token or '' -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] | trim + '<|eot_id|>' -}}{%- endgeneration -%}"
    "{%- else -%}{{- message['content'] | trim + '<|eot_id|>' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)

# Gemma / Gemma 2 instruct: `model` is the assistant's role; Gemma has no system role, so a system message
# goes in front of the next user turn.
GEMMA = (
    "{{- bos_token or '' -}}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.system = ns.system + message['content'] | trim + '\\n\\n' -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<start_of_turn>model\\n' -}}"
    "{%- generation -%}{{- message['content'] | trim + '<end_of_turn>' -}}{%- endgeneration -%}{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<start_of_turn>user\\n' + ns.system + message['content'] | trim + '<end_of_turn>\\n' -}}"
    "{%- set ns.system = '' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)

# Mistral instruct ([INST] ... [/INST] reply</s>); a system message goes in front of the next user turn.
MISTRAL = (
    "{{- bos_token or '' -}}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.system = ns.system + message['content'] | trim + '\\n\\n' -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- ' ' + message['content'] | trim + (eos_token or '') -}}{%- endgeneration -%}"
    "{%- else -%}"
    "{{- '[INST] ' + ns.system + message['content'] | trim + ' [/INST]' -}}"
    "{%- set ns.system = '' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

BUILTIN_TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "gemma": GEMMA, "mistral": MISTRAL}


def _names() -> str:
    return ", ".join(BUILTIN_TEMPLATES)


def _is_inline(value: str) -> bool:
    return "{{" in value or "{%" in value


def check_template_option(value: Any) -> None:
    """data.chat_template must name something that exists (validate.py, before anything loads)."""
    resolve_template(value)


def resolve_template(value: Any) -> tuple[str | None, str]:
    """(the template text, a short description) for `data.chat_template`; (None, "the tokenizer's own")
    when the tokenizer's own template is wanted. A UserError naming the built-ins otherwise."""
    if value is None or (isinstance(value, str) and value.strip() in ("", TOKENIZER_TEMPLATE)):
        return None, "the tokenizer's own"
    if not isinstance(value, str):
        raise UserError(f"data.chat_template={value!r}: give a built-in name ({_names()}), a .jinja file or null")
    name = value.strip()
    if name.lower() in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[name.lower()], f"built-in {name.lower()}"
    if _is_inline(name):
        return value, "given inline"
    path = Path(name).expanduser()
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(f"data.chat_template={name}: cannot be read ({err}); give a UTF-8 Jinja file") from None
        if not text.strip():
            raise UserError(f"data.chat_template={name}: the file is empty; give a Jinja chat template")
        return text, str(path)
    raise UserError(
        f"data.chat_template={name}: not a built-in template ({_names()}, or {TOKENIZER_TEMPLATE} for the "
        "tokenizer's own) and no such file; give one of those or the path of a Jinja template file"
    )


def no_template_error(where: str) -> UserError:
    return UserError(
        f"{where}: chat data needs a chat template and this tokenizer has none; set data.chat_template "
        f"(a built-in: {_names()}; or a .jinja file)"
    )


def use_chat_template(tokenizer: Any, option: Any, where: str) -> str:
    """Set `data.chat_template` on the tokenizer (chat data only; the tokenizer's own stays when the option
    is unset) and return what the template is, for the log; a UserError when there is none at all."""
    template, what = resolve_template(option)
    if template is not None:
        tokenizer.chat_template = template
        _check_renders(tokenizer, what)  # a template of the user's: fail here, in one line, not inside TRL
    elif not getattr(tokenizer, "chat_template", None):
        raise no_template_error(where)
    _warn_split_end_of_turn(tokenizer, what)
    return what


def _check_renders(tokenizer: Any, what: str) -> None:
    try:
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], tokenize=False
        )
    except Exception as err:  # jinja2 TemplateError and friends: the template is the user's
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(
            f"data.chat_template ({what}): the template does not render a user/assistant exchange ({first}); "
            "fix the template or pick a built-in"
        ) from None


def _warn_split_end_of_turn(tokenizer: Any, what: str) -> None:
    marker = end_of_turn(tokenizer)
    if marker and marker not in tokenizer.get_vocab():
        pieces = len(tokenizer(marker, add_special_tokens=False)["input_ids"])
        log.warning(
            "chat template (%s): its end-of-turn marker %r is not one token of this tokenizer but %d pieces; "
            "the model learns the pieces and generation stops on the text",
            what,
            marker,
            pieces,
        )


_PROBE = "Q7xZ-reply-9kW"


def end_of_turn(tokenizer: Any, template: str | None = None) -> str | None:
    """The text a chat template writes right after an assistant reply (`<|im_end|>`, `<|eot_id|>`,
    `<end_of_turn>`, the EOS, ...), what generation must stop on; None without a template or marker."""
    if not (template or getattr(tokenizer, "chat_template", None)):
        return None
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}],
            tokenize=False,
            chat_template=template,
        )
    except Exception:
        return None
    if not isinstance(text, str) or _PROBE not in text:
        return None
    after = text.split(_PROBE, 1)[1].lstrip(" ")
    added = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)
    for token in added:
        if token and after.startswith(token):
            return token
    line = after.split("\n", 1)[0].strip()
    return line or None


def _training_chat_template(tokenizer: Any, where: str) -> str | None:
    """The chat template TRL trains messages with under assistant_only_loss (None: the tokenizer's own),
    or a UserError when the tokenizer cannot mask assistant turns."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise no_template_error(where)
    if has_generation_markers(template):
        return None
    try:
        return get_training_chat_template(tokenizer)
    except ValueError:
        raise UserError(
            f"{where}: the chat template has no {{% generation %}} markers and TRL has no patched version of it, "
            "so assistant-only loss cannot mask the other turns; set data.chat_template to a built-in "
            f"({_names()}: they carry the markers), or data.completion_only_loss=false (loss on every token)"
        ) from None


def chat_template_for(tokenizer: Any, fmt: str, conversational: bool, completion_only: bool, where: str) -> str | None:
    """The `chat_template` to tokenize `fmt` data with (None: the tokenizer's own, or no chat at all);
    a UserError when chat-format data meets a tokenizer without a chat template."""
    if fmt == "messages" and completion_only:
        return _training_chat_template(tokenizer, where)
    if (fmt == "messages" or conversational) and not getattr(tokenizer, "chat_template", None):
        raise no_template_error(where)
    return None
