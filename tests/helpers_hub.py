"""What the model-card and hub tests share: a token that must be written nowhere, a hub out of reach
(a closed local port), and the check that a text names no local path."""

import re
import socket

from conftest import REPO

SECRET = "hf_qlora_recipes_test_token_never_written_0123456789"
# The smoke stack with a small exact-match pass: the card states the task metric
SMOKE_WITH_EXACT_MATCH = ["trainer=smoke", "data.metric=exact_match", "data.metric_examples=4", "data.max_new_tokens=4"]
ABSOLUTE_PATH = re.compile(r"(?:^|[\s`'\"(=:])(/(?:[\w.-]+/)+[\w.-]*)", re.MULTILINE)


def closed_port() -> str:
    """An endpoint nothing listens on: a port the kernel just handed out and that is closed again."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def no_absolute_path(text: str) -> None:
    found = [m for m in ABSOLUTE_PATH.findall(text) if not m.startswith("//")]
    assert not found, found
    assert str(REPO) not in text
