"""The `import-hf`, `export-hf` and `eval` subcommands of `trn-accum` (registered by trn_accum.cli).

    trn-accum import-hf HF_DIR --config FILE [--set SECTION.KEY=VALUE ...] --run-dir DIR
                        [--allow-unused-tensors]
    trn-accum export-hf RUN_DIR OUT_DIR [--dtype bfloat16|float32] [--eos-token-id ID[,ID]]
                        [--bos-token-id ID] [--pad-token-id ID]
    trn-accum eval --run-dir DIR (--data TOKEN_DIR | --tokens FILE.npy) [--json]

JAX and the converters are imported inside the commands, as trn_accum.cli does for its own.
import-hf and export-hf show their progress on stderr (`trn_accum.data.progress.Meter`: a bar on
a terminal, lines in a log file); stdout holds only each command's own result line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from trn_accum.errors import EXIT_OK

# export-hf's flags for what generation needs (over the ids import-hf kept from the checkpoint)
TOKEN_FLAGS = {
    "bos_token_id": "the id generation starts from",
    "eos_token_id": "the id(s) generation stops at: ID or ID,ID,...",
    "pad_token_id": "the padding id of batched generation",
}


def _cmd_import(args) -> int:
    from trn_accum.interop import convert

    n = convert.import_hf(
        args.hf_dir,
        args.config,
        args.overrides,
        args.run_dir,
        args.allow_unused_tensors,
        progress=sys.stderr,
    )
    print(
        f"imported {n:,} parameters from {args.hf_dir} into "
        f"{os.path.join(args.run_dir, 'checkpoints', '0')} (step 0, fresh optimizer state); "
        f"train it with: trn-accum train --config {args.config} --run-dir {args.run_dir}"
        + "".join(f" --set {s}" for s in args.overrides)
    )
    return EXIT_OK


def _cmd_export(args) -> int:
    from trn_accum.interop import convert

    tokens = {k: getattr(args, k) for k in TOKEN_FLAGS}
    files = convert.export_hf(args.run_dir, args.out_dir, args.dtype, tokens, sys.stderr)
    if files:
        print(f"wrote {', '.join(files)} ({args.dtype}) to {args.out_dir}")
    if files and "generation_config.json" not in files:  # process 0 wrote the export
        note = (
            "no generation_config.json: the run holds no bos/eos/pad token ids (it was not "
            "imported with import-hf), so transformers' generate would not know where to stop; "
            "pass --eos-token-id ID (and --bos-token-id ID) to write one"
        )
        print(note, file=sys.stderr)
    return EXIT_OK


def token_ids(text: str) -> int | list[int]:
    """An argparse type: "128001" -> 128001, "128001,128009" -> [128001, 128009]."""
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a token id (an integer, or integers joined by commas)"
        ) from None
    return ids[0] if len(ids) == 1 else ids


def _cmd_eval(args) -> int:
    from trn_accum.interop import evaluate

    if args.tokens:
        loss, tokens = evaluate.eval_tokens(args.run_dir, args.tokens)
    else:
        loss, tokens = evaluate.eval_data(args.run_dir, args.data)
    if args.json:
        print(json.dumps({"loss": loss, "tokens": tokens}))
    else:
        print(f"loss {loss:.6f} over {tokens} target tokens")
    return EXIT_OK


def add_parsers(sub) -> None:
    """Adds `import-hf`, `export-hf` and `eval` to the subparsers action `sub`."""
    im = sub.add_parser(
        "import-hf", help="start a run dir (step 0) from a Hugging Face Llama checkpoint"
    )
    im.add_argument("hf_dir", metavar="HF_DIR", help="config.json + safetensors (or sharded)")
    im.add_argument("--config", required=True, metavar="FILE", help="TOML config of the run")
    im.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        dest="overrides",
        help="override a config value (repeatable); pass the same ones to `train`",
    )
    im.add_argument("--run-dir", required=True, metavar="DIR", help="a new run directory")
    im.add_argument(
        "--allow-unused-tensors",
        action="store_true",
        help="import even when the checkpoint holds tensors the model does not use (they are "
        "named, then dropped); without it such a checkpoint is refused",
    )
    im.set_defaults(func=_cmd_import)

    ex = sub.add_parser(
        "export-hf", help="write a run's newest checkpoint as a Hugging Face Llama checkpoint"
    )
    ex.add_argument("run_dir", metavar="RUN_DIR")
    ex.add_argument("out_dir", metavar="OUT_DIR", help="config.json + safetensors go here")
    ex.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    for key, help_ in TOKEN_FLAGS.items():
        ex.add_argument(f"--{key.replace('_', '-')}", type=token_ids, dest=key, help=help_)
    ex.set_defaults(func=_cmd_export)

    ev = sub.add_parser("eval", help="mean next-token cross-entropy of a run's newest checkpoint")
    ev.add_argument("--run-dir", required=True, metavar="DIR")
    what = ev.add_mutually_exclusive_group(required=True)
    what.add_argument("--data", metavar="TOKEN_DIR", help="held-out split of prepared tokens")
    what.add_argument(
        "--tokens", metavar="FILE.npy", help="int [N, S]: every position; negative = padding"
    )
    ev.add_argument("--json", action="store_true", help='last line {"loss": ..., "tokens": ...}')
    ev.set_defaults(func=_cmd_eval)
