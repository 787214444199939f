"""Generate with a finished run (its 4-bit base + adapter) or a merged model.

    python scripts/generate.py RUN_OR_MERGED_DIR "prompt" [--file prompts.txt] [--max-new-tokens N]
                               [--greedy | --temperature T] [--chat | --no-chat] [--jsonl]

Prompts are rendered as the run's data was (its chat template for chat data, the Alpaca template for
alpaca data, as typed otherwise); `\\n` in a prompt is a newline. --file: one prompt per line, or
JSON lines (strings or data rows: the prompt part is used). Prints one generation per prompt.
"""

import argparse
import json
import logging
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qlora_recipes.console import fail  # noqa: E402
from qlora_recipes.errors import UserError  # noqa: E402


def quiet_libraries() -> None:
    """transformers' info lines, progress bars and deprecation warnings are noise here."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="a run dir (config.yaml + adapter/) or a merged model dir")
    parser.add_argument("prompt", nargs="?", help="the prompt (\\n for a newline)")
    parser.add_argument("--file", help="more prompts: one per line, or JSON lines")
    parser.add_argument("--max-new-tokens", type=int, help="default: the run's data.max_new_tokens")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--greedy", action="store_true", help="greedy decoding (the default)")
    mode.add_argument("--temperature", type=float, help="sample at this temperature instead of greedy decoding")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling with --temperature (default 1.0)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    chat = parser.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None, help="apply the chat template")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="never apply the chat template")
    parser.add_argument("--jsonl", action="store_true", help="print one JSON object per prompt")
    args = parser.parse_args(argv)
    quiet_libraries()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        from qlora_recipes.generation import Prompt, generate, load_for_generation, read_prompts, unescape

        prompts = [Prompt("text", unescape(args.prompt))] if args.prompt is not None else []
        if args.file:
            prompts += read_prompts(args.file)
        if not prompts:
            raise UserError("no prompt: give one as the second argument, or --file with one prompt per line")
        if args.max_new_tokens is not None and args.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
        if args.temperature is not None and args.temperature <= 0:
            raise UserError(f"--temperature {args.temperature}: must be positive (use --greedy for greedy decoding)")
        if not 0 < args.top_p <= 1:
            raise UserError(f"--top-p {args.top_p}: must be in (0, 1]")
        model, tokenizer, info = load_for_generation(args.path, chat=args.chat)
        import torch

        torch.manual_seed(args.seed)
        outputs = generate(
            model,
            tokenizer,
            prompts,
            info["style"],
            args.max_new_tokens or info["max_new_tokens"],
            temperature=args.temperature,
            top_p=args.top_p,
        )
    except UserError as err:
        fail(str(err))
    for prompt, text in zip(prompts, outputs, strict=True):
        if args.jsonl:
            print(json.dumps({"prompt": prompt.value, "generation": text}))
        else:
            print(f"### {prompt.show()}\n{text}\n")


if __name__ == "__main__":
    main()
