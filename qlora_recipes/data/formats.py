"""The data formats (`data.format`; `auto` reads the first row's keys), and what each means for TRL:

- `alpaca`: `instruction`, optional `input`, `output` -> `prompt`/`completion` with the Alpaca template
- `messages`: `messages`, a list of `{role, content}` -> rendered by the chat template
- `sharegpt`: `conversations`, a list of `{from, value}` (human/gpt/system and the usual variants) ->
  converted to `messages` (and trained as such)
- `prompt_completion`: `prompt`, `completion` (strings, or lists of messages for chat prompts)
- `text`: `text`, plain language modelling
- `preference` (objective=dpo): `prompt`, `chosen`, `rejected` as text, or as lists of messages; or
  `chosen`/`rejected` whole conversations whose shared leading turns are the prompt (TRL's implicit
  prompt, and the UltraFeedback-binarized layout, whose `prompt` string and `messages` are left aside)
- `unpaired` (objective=kto): `prompt`, `completion` (text, or lists of messages) and `label`, true for a
  desirable completion and false for an undesirable one. objective=kto also reads preference pairs:
  `unpair` splits each into a desirable and an undesirable row (TRL's unpair_preference_dataset)

Every row is checked here before training starts; a bad row stops the run with one line naming the
row (as `readers.Rows` names it) and the field. `format_kwargs` and `generation_pairs` give the SFTConfig
fields and the exact-match (prompt, reference) pairs each format needs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..config.schema import DataConfig
from ..errors import UserError
from .readers import Rows

if TYPE_CHECKING:
    from datasets import Dataset

# Sources up to this size convert into an in-memory dataset (as all did before streaming); larger ones
# into a memory-mapped Arrow file, so their rows never sit in memory as Python objects.
IN_MEMORY_BYTES = 32 << 20
# Each format and the fields a row of it holds (for the error messages).
FORMAT_FIELDS = {
    "alpaca": "instruction, [input], output",
    "messages": "messages",
    "sharegpt": "conversations (a list of {from, value})",
    "prompt_completion": "prompt, completion",
    "text": "text",
    "preference": "prompt, chosen, rejected (text or messages)",
    "unpaired": "prompt, completion, label (true or false; text or messages)",
    "prompt": "prompt (text or messages), plus the columns the rewards read",
}
# The rows each objective's data kind (config/objectives.py) trains on.
KIND_FORMATS = {
    "preference": ("preference",),
    "unpaired": ("unpaired", "preference"),
    "prompt": ("prompt",),  # grpo: prompts alone, completions sampled in training
    "sft": tuple(f for f in FORMAT_FIELDS if f not in ("preference", "unpaired", "prompt")),
}
# The objective that trains each kind of row that is not plain SFT data, for the hints that name it.
TRAINED_BY = {
    "preference": "objective=dpo (or objective=kto, which reads each pair as two labelled rows)",
    "unpaired": "objective=kto",
}
FORMATS = tuple(FORMAT_FIELDS)
ROLES = ("system", "user", "assistant", "tool")
# ShareGPT speakers (`from`, case-insensitive) and the role each is trained as.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "bot": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "function_call": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}


def trains_as(fmt: str) -> str:
    """The format TRL sees: ShareGPT rows are converted to messages."""
    return "messages" if fmt == "sharegpt" else fmt


# The standard Stanford Alpaca prompts (github.com/tatsu-lab/stanford_alpaca, train.py).
ALPACA_PROMPT_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


def alpaca_prompt(instruction: str, input: str | None = None) -> str:
    """The Alpaca prompt for one row (the variant with an `### Input:` block when `input` is set)."""
    if input:
        return ALPACA_PROMPT_INPUT.format(instruction=instruction, input=input)
    return ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_format_name(fmt: Any, allow_auto: bool = True) -> str:
    """`fmt` if it names a format (or `auto`, where detection can still run); a UserError otherwise."""
    names = (("auto",) if allow_auto else ()) + FORMATS
    if not isinstance(fmt, str) or fmt not in names:
        from .chat import BUILTIN_TEMPLATES

        hint = f" (a chat template? set data.chat_template={fmt})" if fmt in BUILTIN_TEMPLATES else ""
        raise UserError(f"data.format: unknown format {fmt!r}; use one of {', '.join(names)}{hint}")
    return fmt


def detect(rows: Rows) -> str:
    """The format the first row's keys name (`data.format: auto`)."""
    key, first = rows.first()
    if not isinstance(first, dict):
        raise UserError(f"{rows.where(key)}: expected an object with named fields, got {type(first).__name__}")
    keys = set(first)
    if {"chosen", "rejected"} <= keys:  # before messages: UltraFeedback-binarized rows hold both
        return "preference"
    if {"prompt", "completion", "label"} <= keys:  # before prompt_completion: KTO's rows hold both
        return "unpaired"
    if "conversations" in keys:
        return "sharegpt"
    if "messages" in keys:
        turns = first["messages"]
        if isinstance(turns, list) and turns and isinstance(turns[0], dict) and "from" in turns[0]:
            return "sharegpt"  # ShareGPT turns under a `messages` key
        return "messages"
    if {"prompt", "completion"} <= keys:
        return "prompt_completion"
    if {"instruction", "output"} <= keys:
        return "alpaca"
    if "text" in keys:
        return "text"
    if "prompt" in keys:  # a prompt with no answer to train on: grpo samples the completions
        return "prompt"
    known = "; ".join(f"{name} ({fields})" for name, fields in FORMAT_FIELDS.items())
    raise UserError(
        f"{rows.where(key)}: cannot detect the data format from the first row's keys {sorted(keys)}; "
        f"known formats: {known}; rename the fields or set data.format"
    )


def _string(rows: Rows, i: Any, row: dict, field: str, required: bool = True) -> str:
    if field not in row or row[field] is None:
        if not required:
            return ""
        raise UserError(f"{rows.where(i)}: missing field '{field}'; every row needs it (or set data.format)")
    value = row[field]
    if not isinstance(value, str):
        raise UserError(
            f"{rows.where(i)}: field '{field}' must be a string, got {type(value).__name__} {_short(value)}; "
            "write it as text (in quotes)"
        )
    if required and not value.strip():
        raise UserError(f"{rows.where(i)}: field '{field}' is an empty string; give it text or remove the row")
    return value


def _json_cell(rows: Rows, i: Any, field: str, text: str) -> Any:
    """A CSV cell's message list: CSV cells are all strings, so lists come written as JSON text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise UserError(
            f"{rows.where(i)}: field '{field}' is a string that is not valid JSON ({err.msg}); "
            "it must be a list of {role, content} objects"
        ) from None


# A chat turn's text as each format's error lines name it: (the field, one turn is a, the text is).
_TURN_TEXT = {"messages": ("content", "message", "the message text"), "sharegpt": ("value", "turn", "the turn's text")}


def _turn_text(content: Any, where: str, role: str, speaker: Any, fmt: str) -> str:
    """One turn's text checked (messages `content`, ShareGPT `value`): present, a string, and not blank
    in a reply; `where` names the turn, `speaker` is how the row names a blank reply's author."""
    field, unit, text = _TURN_TEXT[fmt]
    if content is None:
        raise UserError(f"{where}.{field}' is missing; give each {unit} its text in '{field}'")
    if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image" for p in content):
        raise UserError(
            f"{where}.{field}' holds an image part: image rows train a vision-language model, and this model is "
            "a text model; point model.name_or_path at one (`make shapes` builds a tiny one), or set model.vision=true"
        )
    if not isinstance(content, str):
        raise UserError(
            f"{where}.{field}' must be a string, got {type(content).__name__} {_short(content)}; "
            f"write {text} as one string"
        )
    if role == "assistant" and not content.strip():
        raise UserError(f"{where}.{field}' is an empty {speaker} turn; give it the reply text or remove it")
    return content


def _messages(rows: Rows, i: Any, row: dict, field: str, need_assistant: bool) -> list[dict]:
    at = rows.where(i)
    if field not in row or row[field] is None:
        raise UserError(f"{at}: missing field '{field}'; every row needs it (or set data.format)")
    value = row[field]
    if isinstance(value, str) and rows.text_cells:
        value = _json_cell(rows, i, field, value)
    if not isinstance(value, list):
        raise UserError(
            f"{at}: field '{field}' must be a list of {{role, content}} objects, got "
            f"{type(value).__name__} {_short(value)}"
        )
    if not value:
        raise UserError(f"{at}: field '{field}' is an empty list; give it at least one turn")
    out = []
    for j, message in enumerate(value):
        where = f"{at}: field '{field}[{j}]"
        if not isinstance(message, dict):
            raise UserError(f"{where}' must be a {{role, content}} object, got {type(message).__name__}")
        role = message.get("role")
        if role is None:
            raise UserError(f"{where}.role' is missing; give each message a role ({', '.join(ROLES)})")
        if role not in ROLES:
            raise UserError(f"{where}.role' is an unknown role {_short(role)}; use one of {', '.join(ROLES)}")
        content = _turn_text(message.get("content"), where, role, role, "messages")
        out.append({"role": role, "content": content})
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise UserError(
            f"{at}: field '{field}' has no assistant turn, so there is nothing to train on; add the assistant's reply"
        )
    return out


def _sharegpt_field(row: dict) -> str:
    return "conversations" if "conversations" in row or "messages" not in row else "messages"


def _sharegpt(rows: Rows, i: Any, row: dict) -> list[dict]:
    """A ShareGPT conversation as {role, content} messages (then checked like any messages row)."""
    field = _sharegpt_field(row)
    if field not in row or row[field] is None:
        raise UserError(f"{rows.where(i)}: missing field '{field}'; every row needs it (or set data.format)")
    value = row[field]
    if isinstance(value, str) and rows.text_cells:
        value = _json_cell(rows, i, field, value)
    if not isinstance(value, list):
        raise UserError(
            f"{rows.where(i)}: field '{field}' must be a list of {{from, value}} objects, got "
            f"{type(value).__name__} {_short(value)}"
        )
    turns = []
    for j, turn in enumerate(value):
        where = f"{rows.where(i)}: field '{field}[{j}]"
        if not isinstance(turn, dict):
            raise UserError(f"{where}' must be a {{from, value}} object, got {type(turn).__name__}")
        speaker = turn.get("from", turn.get("role"))
        if speaker is None:
            raise UserError(f"{where}.from' is missing; give each turn a speaker (human, gpt, system, ...)")
        role = SHAREGPT_ROLES.get(str(speaker).strip().lower()) if isinstance(speaker, str) else None
        if role is None:
            known = ", ".join(SHAREGPT_ROLES)
            raise UserError(f"{where}.from' is an unknown speaker {_short(speaker)}; use one of {known}")
        content = _turn_text(turn.get("value", turn.get("content")), where, role, speaker, "sharegpt")
        turns.append({"role": role, "content": content})
    if not turns:
        raise UserError(f"{rows.where(i)}: field '{field}' is an empty list; give it at least one turn")
    if not any(t["role"] == "assistant" for t in turns):
        raise UserError(
            f"{rows.where(i)}: field '{field}' has no gpt/assistant turn, so there is nothing to train on; "
            "add the reply"
        )
    return turns


def convert(rows: Rows, fmt: str) -> tuple[Dataset, bool]:
    """Validate every row for `fmt` and build the dataset of the columns TRL expects (ShareGPT:
    `messages`). Returns (dataset, conversational). A streamed source larger than IN_MEMORY_BYTES is
    converted batch by batch into datasets' Arrow cache (memory-mapped, keyed on the file's path, size
    and mtime as `load_dataset` keys local files); smaller ones, and rows already held in memory (.json,
    .csv), become an in-memory dataset as before (datasets' own `IN_MEMORY_MAX_SIZE` idea)."""
    from datasets import Dataset

    first = rows.first()
    conversational = _conversational(first[1], fmt, rows.text_cells)
    extra = reward_columns(first[1]) if fmt == "prompt" else ()
    if rows.in_memory or rows.nbytes <= IN_MEMORY_BYTES:
        columns: dict[str, list] = {}
        for key, row in rows.items():
            for name, value in convert_row(rows, key, row, fmt, conversational, extra).items():
                columns.setdefault(name, []).append(value)
        return Dataset.from_dict(columns), conversational
    from datasets.exceptions import DatasetGenerationError

    try:
        ds = Dataset.from_generator(
            _converted, gen_kwargs={"rows": rows, "fmt": fmt, "conversational": conversational, "extra": extra}
        )
    except DatasetGenerationError as err:  # a bad row stops the generator: its UserError is the cause
        if isinstance(err.__cause__, UserError):
            raise err.__cause__ from None
        raise
    return ds, conversational


def _conversational(first: Any, fmt: str, text_cells: bool) -> bool:
    """Whether the first row's prompt (prompt_completion) or chosen (preference) is a message list."""
    if not isinstance(first, dict):
        return False
    if fmt in ("prompt_completion", "unpaired", "prompt"):
        return isinstance(first.get("prompt"), list)
    chosen = first.get("chosen")
    return fmt == "preference" and (isinstance(chosen, list) or (text_cells and str(chosen).lstrip().startswith("[")))


def _preference(rows: Rows, i: Any, row: dict, conversational: bool) -> dict[str, Any]:
    """A preference pair as TRL's DPOTrainer reads it: prompt, chosen, rejected, all text or all message
    lists (chat: the prompt's turns, then each answer's). Whole conversations without a prompt list (TRL's
    implicit prompt; UltraFeedback-binarized) split where chosen and rejected stop sharing turns."""
    if not conversational:
        if isinstance(row.get("chosen"), list):
            raise UserError(
                f"{rows.where(i)}: field 'chosen' is a list of messages but the first row's is text; give every "
                "row the same kind"
            )
        return {k: _string(rows, i, row, k) for k in ("prompt", "chosen", "rejected")}
    chosen = _messages(rows, i, row, "chosen", need_assistant=True)
    rejected = _messages(rows, i, row, "rejected", need_assistant=True)
    if isinstance(row.get("prompt"), list) or (rows.text_cells and str(row.get("prompt", "")).lstrip().startswith("[")):
        return {
            "prompt": _messages(rows, i, row, "prompt", need_assistant=False),
            "chosen": chosen,
            "rejected": rejected,
        }
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    while shared and chosen[shared - 1]["role"] == "assistant":  # the answers start at an assistant turn
        shared -= 1
    if not shared:
        raise UserError(
            f"{rows.where(i)}: fields 'chosen' and 'rejected' share no leading turn, so there is no prompt; start "
            "both with the same user turn or give a 'prompt' list"
        )
    if chosen[shared:] == rejected[shared:]:
        raise UserError(f"{rows.where(i)}: fields 'chosen' and 'rejected' are the same answer; remove the row")
    return {"prompt": chosen[:shared], "chosen": chosen[shared:], "rejected": rejected[shared:]}


def _converted(rows: Rows, fmt: str, conversational: bool, extra: tuple = ()) -> Iterator[dict]:
    for key, row in rows.items():
        yield convert_row(rows, key, row, fmt, conversational, extra)


def convert_row(rows: Rows, i: Any, row: Any, fmt: str, conversational: bool, extra: tuple = ()) -> dict[str, Any]:
    """One row validated for `fmt` and converted to TRL's columns; `rows.where(i)` names it in an error.
    `extra`: prompt rows' other columns (the first row's), which every row must hold."""
    if not isinstance(row, dict):
        raise UserError(
            f"{rows.where(i)}: expected an object with fields ({FORMAT_FIELDS[fmt]}), got "
            f"{type(row).__name__} {_short(row)}"
        )
    if fmt == "text":
        return {"text": _string(rows, i, row, "text")}
    if fmt == "alpaca":
        instruction = _string(rows, i, row, "instruction")
        extra = _string(rows, i, row, "input", required=False)
        output = _string(rows, i, row, "output")
        return {"prompt": alpaca_prompt(instruction, extra), "completion": output}
    if fmt == "messages":
        return {"messages": _messages(rows, i, row, "messages", need_assistant=True)}
    if fmt == "sharegpt":
        return {"messages": _sharegpt(rows, i, row)}
    if fmt == "preference":
        return _preference(rows, i, row, conversational)
    if fmt == "unpaired":
        return {**convert_row(rows, i, row, "prompt_completion", conversational), "label": _label(rows, i, row)}
    if fmt == "prompt":
        return _prompt_row(rows, i, row, conversational, extra)
    if conversational:
        if not isinstance(row.get("prompt"), list) and row.get("prompt") is not None:
            raise UserError(
                f"{rows.where(i)}: field 'prompt' must be a list of {{role, content}} objects like the first "
                f"row's, got {type(row['prompt']).__name__} {_short(row['prompt'])}"
            )
        prompt = _messages(rows, i, row, "prompt", need_assistant=False)
        completion = _messages(rows, i, row, "completion", need_assistant=True)
        return {"prompt": prompt, "completion": completion}
    return {"prompt": _string(rows, i, row, "prompt"), "completion": _string(rows, i, row, "completion")}


def _label(rows: Rows, i: Any, row: dict) -> bool:
    """An unpaired row's `label`: true (desirable) or false (undesirable); CSV cells say it as text."""
    value = row.get("label")
    if value is None:
        raise UserError(f"{rows.where(i)}: missing field 'label'; every row needs it, true or false")
    if rows.text_cells and isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if not isinstance(value, bool):
        raise UserError(
            f"{rows.where(i)}: field 'label' must be true (a desirable completion) or false (an undesirable one), "
            f"got {type(value).__name__} {_short(value)}"
        )
    return value


def unpair(ds: Dataset, seed: int) -> Dataset:
    """Preference pairs as objective=kto's unpaired rows: each pair a desirable row (its chosen answer)
    and an undesirable one (its rejected answer), TRL's unpair_preference_dataset, then shuffled (seeded):
    TRL unpairs batch by batch and KTO samples in order, so unshuffled a micro-batch would hold one label."""
    from trl.data_utils import unpair_preference_dataset

    return unpair_preference_dataset(ds).shuffle(seed=seed).flatten_indices()


def reward_columns(first: Any) -> tuple[str, ...]:
    """A prompt row's columns beside `prompt` (what the rewards may read: `answer` for the built-ins)."""
    return tuple(k for k in first if k != "prompt") if isinstance(first, dict) else ()


def _prompt_row(rows: Rows, i: Any, row: dict, conversational: bool, extra: tuple) -> dict[str, Any]:
    """A grpo prompt as TRL's GRPOTrainer reads it (text, or chat turns ending before the answer), with
    the columns the first row has, each a text or a number."""
    if conversational:
        if not isinstance(row.get("prompt"), list):
            raise UserError(
                f"{rows.where(i)}: field 'prompt' must be a list of {{role, content}} objects like the first "
                f"row's, got {type(row.get('prompt')).__name__} {_short(row.get('prompt'))}"
            )
        out: dict[str, Any] = {"prompt": _messages(rows, i, row, "prompt", need_assistant=False)}
    else:
        out = {"prompt": _string(rows, i, row, "prompt")}
    for key in extra:
        value = row.get(key)
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            got = "missing" if value is None else f"{type(value).__name__} {_short(value)}"
            raise UserError(
                f"{rows.where(i)}: field {key!r} must be a text or a number like the first row's, got {got}"
            )
        out[key] = value
    return out


def check_objective_data(fmt: str, kind: str, objective: str, source: str) -> None:
    """Rows of the kind the objective trains on (config/objectives.py `data`), or one line naming both."""
    if fmt in KIND_FORMATS[kind]:
        return
    if kind == "unpaired":
        raise UserError(
            f"objective={objective} trains on unpaired rows ({FORMAT_FIELDS['unpaired']}) or preference pairs but "
            f"{source} holds {fmt} rows; give it such rows (docs/objectives.md) or train with objective=sft"
        )
    if kind == "prompt":
        raise UserError(
            f"objective={objective} trains on prompt rows ({FORMAT_FIELDS['prompt']}) but {source} holds {fmt} rows; "
            f"train those with {TRAINED_BY.get(fmt, 'objective=sft')}, or give it prompt rows (docs/objectives.md)"
        )
    if fmt == "prompt":
        raise UserError(
            f"{source} holds prompt rows without an answer (no 'completion' field), which objective={objective} "
            "does not train on; train prompt rows with objective=grpo, or give each row its answer (docs/objectives.md)"
        )
    if fmt == "unpaired":
        raise UserError(
            f"{source} holds unpaired rows (prompt, completion, label), which objective={objective} does not train "
            "on; train them with objective=kto"
        )
    if kind == "preference":
        raise UserError(
            f"objective={objective} trains on preference pairs ({FORMAT_FIELDS['preference']}) but {source} holds "
            f"{fmt} rows; give it preference rows (docs/objectives.md) or train with objective=sft"
        )
    raise UserError(
        f"{source} holds preference pairs (prompt, chosen, rejected), which objective={objective} does not train on; "
        "train them with objective=dpo, or give SFT rows (prompt/completion, messages, ...)"
    )


def format_kwargs(data: DataConfig, fmt: str) -> dict:
    """The SFTConfig fields (TRL 1.16 names) this data needs. The caller sets max_length=trainer.seq_len.

    prompt/completion and alpaca: `completion_only_loss` (loss on the completion only, the prompt's
    labels -100). messages: `assistant_only_loss` (loss on the `{% generation %}` spans of the chat
    template, i.e. assistant turns). text: loss on every token. `packing`, `packing_strategy` and
    `padding_free` as configured (TRL trains padding-free with bfd/bfd_split packing whatever
    `padding_free` says; validate.py refuses the combinations TRL or the attention cannot run).
    """
    fmt = trains_as(check_format_name(fmt, allow_auto=False))
    only = bool(data.completion_only_loss)
    kwargs: dict[str, Any] = {
        "packing": bool(data.packing),
        "packing_strategy": str(data.packing_strategy),
        "padding_free": bool(data.padding_free),
        "dataset_text_field": "text",
        "completion_only_loss": None,
        "assistant_only_loss": False,
    }
    if fmt in ("prompt_completion", "alpaca", "preference", "unpaired"):
        kwargs["completion_only_loss"] = only
    elif fmt == "messages":
        kwargs["assistant_only_loss"] = only
    else:  # text: there is no prompt to mask
        kwargs["completion_only_loss"] = False
    return kwargs


def generation_pairs(eval_ds: Dataset | None, fmt: str, limit: int | None) -> list[tuple[Any, str]]:
    """(prompt, reference) pairs for the exact-match metric, from the first `limit` eval rows.

    prompt_completion / alpaca: the prompt string (or, for chat prompt/completion, the prompt's
    message list) and the completion text. messages: the turns before the last assistant turn
    (a message list; render with `add_generation_prompt=True`) and that turn's content. text: [].
    """
    fmt = trains_as(check_format_name(fmt, allow_auto=False))
    if eval_ds is None or fmt == "text" or (limit is not None and limit <= 0):
        return []
    n = len(eval_ds) if limit is None else min(int(limit), len(eval_ds))
    if fmt == "unpaired":  # the desirable completions are the references
        eval_ds = eval_ds.filter(lambda row: row["label"])
        n = min(n, len(eval_ds))
    rows = eval_ds.select(range(n))
    pairs: list[tuple[Any, str]] = []
    if fmt == "messages":
        for messages in rows["messages"]:
            last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
            if last is None:
                continue
            prompt = [{"role": m["role"], "content": m["content"]} for m in messages[:last]]
            pairs.append((prompt, messages[last]["content"]))
        return pairs
    if fmt == "prompt":  # grpo: the reference answer its built-in rewards read, where the rows have one
        if "answer" not in rows.column_names:
            return []
        return [(p, str(a)) for p, a in zip(rows["prompt"], rows["answer"], strict=True)]
    answers = rows["chosen"] if fmt == "preference" else rows["completion"]  # preference: the chosen answer
    for prompt, completion in zip(rows["prompt"], answers, strict=True):
        if isinstance(completion, list):  # chat prompt/completion
            prompt = [{"role": m["role"], "content": m["content"]} for m in prompt]
            completion = "".join(m["content"] for m in completion if m["role"] == "assistant")
        pairs.append((prompt, completion))
    return pairs
