"""Own-data rows of every format, for the tests that write a user's file."""

import json
from pathlib import Path

LETTERS = "abcdefghij"


def words(n: int) -> list[str]:
    import random

    rng = random.Random(0)
    return ["".join(rng.sample(LETTERS, 4)) for _ in range(n)]


def own_rows(fmt: str, n: int = 20) -> list[dict]:
    rows = []
    for w in words(n):
        s = "".join(sorted(w))
        rows.append(
            {
                "alpaca": {"instruction": "Sort.", "input": w, "output": s},
                "prompt_completion": {"prompt": f"sort: {w}\n", "completion": s},
                "messages": {
                    "messages": [{"role": "user", "content": f"sort: {w}"}, {"role": "assistant", "content": s}]
                },
                "sharegpt": {"conversations": [{"from": "human", "value": f"sort: {w}"}, {"from": "gpt", "value": s}]},
                "text": {"text": f"sort: {w}\n{s}"},
            }[fmt]
        )
    return rows


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class GenerateRecorder:
    """Wraps GenerationMixin.generate: records (prompt positions, max_new_tokens, output positions)."""

    def __init__(self, monkeypatch):
        from transformers.generation.utils import GenerationMixin

        self.calls = []
        original = GenerationMixin.generate

        def recording(model, *args, **kwargs):
            out = original(model, *args, **kwargs)
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.calls.append((tuple(ids.shape), kwargs.get("max_new_tokens"), tuple(out.shape)))
            return out

        monkeypatch.setattr(GenerationMixin, "generate", recording)
