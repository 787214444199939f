"""The chat template messages are trained with, and the check that chat-format data has one.

Under assistant-only loss TRL needs `{% generation %}` markers in the template to mask the other turns;
it carries patched templates for common tokenizers that lack them. Without a usable template the run
stops before training with one line saying what to change.
"""

from __future__ import annotations

from typing import Any

from ..errors import UserError


def _training_chat_template(tokenizer: Any, where: str) -> str | None:
    """The chat template TRL trains messages with under assistant_only_loss (None: the tokenizer's own),
    or a UserError when the tokenizer cannot mask assistant turns."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise UserError(
            f"{where}: the messages format needs a tokenizer with a chat template, and this one has none; "
            "use a chat/instruct tokenizer or convert the data to prompt/completion"
        )
    if has_generation_markers(template):
        return None
    try:
        return get_training_chat_template(tokenizer)
    except ValueError:
        raise UserError(
            f"{where}: the tokenizer's chat template has no {{% generation %}} markers and TRL has no patched "
            "version of it, so assistant-only loss cannot mask the other turns; set "
            "data.completion_only_loss=false (loss on every token) or use a template with generation markers"
        ) from None


def chat_template_for(tokenizer: Any, fmt: str, conversational: bool, completion_only: bool, where: str) -> str | None:
    """The `chat_template` to tokenize `fmt` data with (None: the tokenizer's own, or no chat at all);
    a UserError when chat-format data meets a tokenizer without a chat template."""
    if fmt == "messages" and completion_only:
        return _training_chat_template(tokenizer, where)
    if (fmt == "messages" or conversational) and not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"{where}: chat-format data needs a tokenizer with a chat template, and this one has none; "
            "use a chat/instruct tokenizer or plain-text prompt/completion data"
        )
    return None
