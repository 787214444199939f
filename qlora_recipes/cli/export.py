"""`qlora export RUN_DIR --to gguf|vllm`: a finished run for llama.cpp / Ollama or for vLLM.

    qlora export --fetch-converter
    qlora export RUN_OR_MERGED_DIR --to gguf [--quant f16|bf16|q8_0] [--out DIR]
    qlora export RUN_DIR --to vllm

--to gguf: the merged model (RUN_DIR/merged, merged first when missing, or a merged dir) converted by
llama.cpp's own convert_hf_to_gguf.py into DIR/model-QUANT.gguf (default DIR: RUN_DIR/gguf), read
back and compared with the merged weights, with an Ollama Modelfile (the prompt as trained, the stop
tokens). The converter comes from the pinned llama-cpp-python source release: fetch it once with
--fetch-converter (pip downloads it; its sha256 is checked; nothing is compiled).
--to vllm: checks the adapter is one vLLM's --enable-lora loads and prints the `vllm serve` command.
"""

from __future__ import annotations

import logging
import sys

from ..console import quiet_libraries
from ..errors import UserError
from .runner import ArgumentParser, run_plain


def _parser(prog: str) -> ArgumentParser:
    parser = ArgumentParser(
        prog=prog, description=__doc__.split("\n\n", 1)[1], epilog="more: docs/after-training.md ('Export')"
    )
    parser.add_argument("path", nargs="?", help="a run dir (config.yaml + adapter/), or a merged dir for --to gguf")
    parser.add_argument("--to", choices=["gguf", "vllm"], help="the runtime to export for")
    parser.add_argument("--quant", default="f16", help="GGUF tensor type: f16 (default), bf16 or q8_0")
    parser.add_argument("--out", help="GGUF output dir (default: RUN_DIR/gguf)")
    parser.add_argument(
        "--fetch-converter", action="store_true", help="download llama.cpp's converter (pinned, sha256 checked)"
    )
    return parser


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _gguf(args) -> None:
    from ..export.gguf import export_gguf

    report = export_gguf(args.path, quant=args.quant, out=args.out, progress=_progress)
    check, out = report["check"], report["out_dir"]
    types = ", ".join(f"{n} {t}" for t, n in sorted(check["types"].items()))
    worst = check["worst"]
    print(f"gguf: {out}/{report['gguf']} ({report['bytes'] / 2**20:.1f} MiB, {report['quant']})")
    print(
        f"checked: all {check['tensors']} merged tensors are in it ({types}); largest difference "
        f"{worst['abs_error']:.3g} ({worst['tensor']}, {worst['type']}), within its rounding"
    )
    print(f"ollama: cd {out} && ollama create NAME -f Modelfile")


def run(argv: list[str], prog: str = "qlora export") -> None:
    parser = _parser(prog)

    def export_run() -> int:
        args = parser.parse_args(argv)
        quiet_libraries(logging.WARNING)
        if args.fetch_converter:
            if args.path or args.to:
                raise UserError("--fetch-converter runs alone: fetch first, then qlora export RUN_DIR --to gguf")
            from ..export.converter import fetch_converter

            fetch_converter(progress=_progress)
            return 0
        if not args.path or not args.to:
            raise UserError(f"{prog}: give a run dir and --to gguf or --to vllm (or --fetch-converter alone)")
        if args.to == "vllm":
            if args.out or args.quant != "f16":
                raise UserError("--out and --quant are for --to gguf; --to vllm serves the adapter where it is")
            from ..export.vllm import vllm_command

            print(vllm_command(args.path))
            return 0
        _gguf(args)
        return 0

    run_plain(export_run)
