"""`qlora merge RUN_DIR`: merge a run's adapter into its base and save a standalone model.

    qlora merge RUN_DIR [--out DIR] [--from-original] [--shard-size 2GB] [--prompts FILE]
                        [--dtype bfloat16|float16|float32] [--push-to-hub REPO [--private] [--revision BRANCH]]

Default: into the dequantized 4-bit base the adapter was trained against, saved in the run's
precision dtype under RUN_DIR/merged as safetensors shards + index, config.json and the tokenizer
(no peft, no bitsandbytes needed to load it). --from-original merges into the original 16-bit
weights of model.name_or_path instead. Then the merged model's logits are compared with the base +
adapter's on a few prompts (the run's eval data, or --prompts FILE): one merge-quality line here,
the figures in OUT/merge_report.json. Progress (decoder layers merged, shards written) goes to
stderr: a bar on a terminal, a line every 30 s in a log.
"""

from __future__ import annotations

import logging

from ..console import quiet_libraries
from ..errors import UserError
from .helptext import docs_pointer
from .runner import ArgumentParser, run_plain


def _parser(prog: str) -> ArgumentParser:
    parser = ArgumentParser(prog=prog, description=__doc__.split("\n\n", 1)[1], epilog=docs_pointer("After training"))
    parser.add_argument("run_dir", help="a run dir written by train (config.yaml + adapter/)")
    parser.add_argument("--out", help="where to write the merged model (default: RUN_DIR/merged)")
    parser.add_argument(
        "--from-original",
        action="store_true",
        help="merge into the original 16-bit weights instead of the dequantized 4-bit base",
    )
    parser.add_argument("--shard-size", default="2GB", help="largest safetensors shard, e.g. 2GB, 500MB (default 2GB)")
    parser.add_argument("--prompts", help="prompts for the logit comparison: one per line, or JSON lines")
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        help="dtype of the saved weights (default: the run's precision dtype)",
    )
    hub = parser.add_argument_group("push to the Hugging Face Hub (token: HF_TOKEN or `hf auth login`)")
    hub.add_argument(
        "--push-to-hub", metavar="REPO", help="then push the merged dir, with its model card, to USER/NAME"
    )
    hub.add_argument("--private", action="store_true", default=None, help="create the repo private (when new)")
    hub.add_argument("--revision", help="the branch to commit to (created when missing; default: main)")
    return parser


def run(argv: list[str], prog: str = "qlora merge") -> None:
    parser = _parser(prog)

    def merge_run() -> int:
        args = parser.parse_args(argv)
        if not args.push_to_hub and (args.private or args.revision):
            raise UserError("--private and --revision apply to a push: add --push-to-hub REPO, or drop them")
        if args.push_to_hub:
            from ..integrations.hub import quiet_but_upload_progress

            quiet_but_upload_progress(logging.INFO)  # huggingface_hub's upload bars stay on for the push
        else:
            quiet_libraries(logging.INFO)
        from ..merge.pipeline import merge
        from ..merge.quality import quality_line

        report = merge(
            args.run_dir,
            out=args.out,
            from_original=args.from_original,
            shard_size=args.shard_size,
            prompts_file=args.prompts,
            dtype=args.dtype,
            push_to_hub=args.push_to_hub,
            private=args.private,
            revision=args.revision,
        )
        print(
            f"merged {report['peft']} adapter into the {report['merged_into']}: {report['out_dir']} "
            f"({len(report['files'])} shard(s), {report['total_bytes'] / 2**20:.1f} MiB {report['dtype']})"
        )
        print(quality_line(report))
        if report.get("pushed_to"):
            print(f"pushed to {report['pushed_to']}")
        return 0

    run_plain(merge_run)
