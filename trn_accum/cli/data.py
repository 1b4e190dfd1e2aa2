"""`trn-accum prepare-data` and `trn-accum plot`: text into a token directory, a run's metrics
into a figure."""

from __future__ import annotations

from trn_accum.errors import EXIT_OK


def _cmd_prepare_data(args) -> int:
    from trn_accum.data.prepare import parse_shard, prepare_data

    shard = parse_shard(args.shard) if args.shard is not None else None
    meta = prepare_data(
        args.text_files,
        args.out,
        args.tokenizer,
        binary_ok=args.binary_ok,
        text_field=args.text_field,
        workers=args.workers,
        progress=True,
        shard=shard,
    )
    print(
        f"wrote {meta['num_tokens']:,} tokens ({meta['num_documents']} documents, "
        f"{meta['dtype']}, vocab {meta['vocab_size']}) to {args.out}"
    )
    return EXIT_OK


def _cmd_plot(args) -> int:
    from trn_accum.train.metrics import plot_run

    print(plot_run(args.run_dir, args.out))
    return EXIT_OK


def add_parsers(sub) -> None:
    """Adds `prepare-data` and `plot` to the subparsers action `sub`."""
    pd = sub.add_parser(
        "prepare-data",
        help="tokenize text, JSONL (.gz/.zst) or Parquet files into a token directory",
    )
    pd.add_argument("text_files", nargs="+", metavar="FILE")
    pd.add_argument("--out", required=True, metavar="DIR")
    pd.add_argument("--tokenizer", default="bytes", help="'bytes' or a tokenizer.json path")
    pd.add_argument(
        "--text-field", default="text", help="the JSONL field / Parquet column with the text"
    )
    pd.add_argument(
        "--workers",
        type=int,
        default=None,
        help="encoder processes (default: the cores; never more than the tasks)",
    )
    pd.add_argument(
        "--shard", default=None, metavar="I/N", help="prepare only part I (0..N-1) of N, by file"
    )
    pd.add_argument("--binary-ok", action="store_true", help="tokenize archives/binary too")
    pd.set_defaults(func=_cmd_prepare_data)

    pl = sub.add_parser("plot", help="plot loss, learning rate and gradient norm of a run")
    pl.add_argument("run_dir", metavar="RUN_DIR")
    pl.add_argument("-o", "--out", metavar="FILE.png", default=None)
    pl.set_defaults(func=_cmd_plot)
