"""`qlora generate RUN_OR_MERGED_DIR "prompt"`: generate with a finished run or a merged model.

    qlora generate RUN_OR_MERGED_DIR "prompt" [--file prompts.txt | --file -] [--max-new-tokens N]
                   [--greedy | --temperature T] [--chat | --no-chat | --raw] [--jsonl] [--trust-remote-code]
                   [--image PATH ...]

A run dir loads as trained (its 4-bit base + adapter). Plain prompts are wrapped the way the run's data
was (its chat template for chat data, the Alpaca template for alpaca data, the prefix and suffix its
prompt/completion prompts shared); --raw sends them exactly as typed. `\\n` in a prompt is a newline.
--file: one prompt per line, or JSON lines (strings or data rows: the prompt part is used); `--file -`
(or no prompt, with text piped in) reads one prompt per line from stdin. Prints one generation per prompt.
--image (repeatable, a vision-language model only): every prompt is asked about these images, rendered by
the run's processor with its chat template, the images before the prompt's text. Image rows of a JSON
lines prompts file (messages + images, as training reads them) are asked with their own images.
"""

from __future__ import annotations

import json
import logging
import sys

from ..console import quiet_libraries
from ..errors import UserError
from .helptext import docs_pointer, quiet_when_the_reader_goes
from .runner import ArgumentParser, run_plain


def _parser(prog: str) -> ArgumentParser:
    parser = ArgumentParser(prog=prog, description=__doc__.split("\n\n", 1)[1], epilog=docs_pointer("After training"))
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
    chat.add_argument("--raw", action="store_true", help="send prompts exactly as given: no template, no wrapping")
    parser.add_argument("--jsonl", action="store_true", help="print one JSON object per prompt")
    parser.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="an image every prompt is asked about (repeatable; a vision-language model's run or merged dir)",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let a merged model dir run its own code (its config's auto_map); a run dir follows its "
        "model.trust_remote_code",
    )
    return parser


def _check(args) -> None:
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
    if args.temperature is not None and args.temperature <= 0:
        raise UserError(f"--temperature {args.temperature}: must be positive (use --greedy for greedy decoding)")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p {args.top_p}: must be in (0, 1]")


@quiet_when_the_reader_goes()
def run(argv: list[str], prog: str = "qlora generate") -> None:
    parser = _parser(prog)

    def generate_run() -> int:
        args = parser.parse_intermixed_args(argv)  # options before or after the prompt
        quiet_libraries(logging.WARNING)
        from ..outputs.generation import generate, load_for_generation
        from ..outputs.prompts import Prompt, read_prompts, unescape

        prompts = [Prompt("text", unescape(args.prompt))] if args.prompt is not None else []
        if args.file:
            prompts += read_prompts(args.file)
        elif not prompts and not sys.stdin.isatty():
            prompts = read_prompts("-")
        if args.raw:  # typed text goes in as it is; rows of a JSON lines file keep their own form
            prompts = [Prompt("formatted", p.value) if p.kind == "text" else p for p in prompts]
        if not prompts:
            raise UserError(
                "no prompt: give one as the second argument, --file with one prompt per line, or pipe them in"
            )
        _check(args)
        images = _images(args, prompts)  # a bad file or a text model answers before anything loads
        model, tokenizer, info = load_for_generation(
            args.path, chat=args.chat, trust_remote_code=args.trust_remote_code
        )
        import torch

        torch.manual_seed(args.seed)
        max_new = args.max_new_tokens or info["max_new_tokens"]
        sampling = {
            "temperature": args.temperature,
            "top_p": args.top_p,
            "max_prompt_tokens": info["max_prompt_tokens"],
        }
        if images is not None:
            from ..outputs.images import generate_with_images, image_prompt

            asked = [image_prompt(p, info["format"], i) for p, i in zip(prompts, images, strict=True)]
            outputs = generate_with_images(model, info["processor"], asked, max_new, **sampling)
        else:
            outputs = generate(model, tokenizer, prompts, info["format"], max_new, **sampling)
        for prompt, text in zip(prompts, outputs, strict=True):
            if args.jsonl:
                row = {"prompt": prompt.value, "generation": text}
                shown = args.image or prompt.images
                print(json.dumps({**row, "images": shown} if shown else row))
            else:
                print(f"### {prompt.show()}{_shown(args.image or prompt.images)}\n{text}\n")
        return 0

    run_plain(generate_run)


def _images(args, prompts: list) -> list | None:
    """Each prompt's opened images (the --image files, or an image row's own), once the dir is known to
    hold a vision-language model; None when no prompt has any (the text path)."""
    from ..outputs.images import image_parts, open_images

    own = [p.images for p in prompts]
    if args.image and any(own):
        raise UserError(
            "--image with a prompts file whose rows name their own images: drop --image, or the rows' 'images'"
        )
    if not args.image and not any(own):
        for prompt in prompts:
            if prompt.kind == "messages" and image_parts(prompt.value):
                raise UserError(
                    f"prompt {prompt.show()!r} has image parts but no images: pass --image PATH for them, or give "
                    "the row an 'images' list"
                )
        return None
    from ..outputs.generation import is_vision_dir

    if not is_vision_dir(args.path):
        what, drop = ("--image", "drop --image") if args.image else ("the prompts' images", "drop the rows' images")
        raise UserError(
            f"{what}: {args.path} holds a text model, which cannot see images; {drop}, or pass a "
            "vision-language model's run or merged dir"
        )
    if args.image:
        return [open_images(args.image)] * len(prompts)
    return [open_images(paths, "prompt image") for paths in own]


def _shown(paths: list[str]) -> str:
    return f" [images: {', '.join(paths)}]" if paths else ""
