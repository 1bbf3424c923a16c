"""`ettflow data ...` commands: `generate` (synthetic Criteo-like windows), `append` (the next
hourly synthetic window of a root) and `movielens`.

`register(subparsers)` adds the `data` command, with both under it, to the top-level
sub-parsers of `ettflow`; `add_data_commands(subparsers)` adds the two directly. Each sets
`func`: it takes the parsed args and returns an exit code (2, with the reason on stderr, when
the data cannot be written). `main(argv)` runs them alone
(`python -m ettflow.trainer.data.cli generate --out ...`).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence


def _reported(handler: Callable[[argparse.Namespace], int]) -> Callable[..., int]:
    """Errors about the data or the arguments end the command with a message, not a trace."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except (ValueError, FileExistsError, RuntimeError) as e:
            print(f"ettflow data: {e}", file=sys.stderr)
            return 2

    return run


@_reported
def _generate(args: argparse.Namespace) -> int:
    from ettflow.trainer.data.synthetic import SyntheticConfig, generate_windows

    config = SyntheticConfig(windows=args.windows, rows_per_window=args.rows_per_window,
                             files_per_window=args.files_per_window,
                             **({} if args.row_group_size is None else {"row_group_size": args.row_group_size}),
                             seed=args.seed,
                             start=args.start, overwrite=args.overwrite, drift=args.drift)
    folders = generate_windows(args.out, config, progress=True)
    print(f"wrote {len(folders)} windows x {config.rows_per_window} rows to {args.out} "
          f"({folders[0].name} .. {folders[-1].name}); schema in {args.out}/_schema.json")
    return 0


@_reported
def _append(args: argparse.Namespace) -> int:
    from ettflow.trainer.data.synthetic import append_window

    overrides = {"rows_per_window": args.rows_per_window} if args.rows_per_window else {}
    folder = append_window(args.root, **overrides)
    print(f"appended {folder.name} to {args.root}")
    return 0


@_reported
def _movielens(args: argparse.Namespace) -> int:
    from ettflow.trainer.data.movielens import movielens_windows

    folders = movielens_windows(args.out, windows=args.windows,
                                files_per_window=args.files_per_window,
                                cache_dir=args.cache_dir, overwrite=args.overwrite)
    print(f"wrote MovieLens-100K as {len(folders)} time-ordered windows to {args.out}; "
          f"schema in {args.out}/_schema.json")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `data` (with `generate`, `append` and `movielens` under it) to `ettflow`'s sub-parsers."""
    data = subparsers.add_parser("data", help="write data windows (synthetic or MovieLens)")
    add_data_commands(data.add_subparsers(dest="data_command", required=True))


def add_data_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add `generate`, `append` and `movielens` to `subparsers`."""
    g = subparsers.add_parser("generate", help="write synthetic Criteo-like Parquet windows",
                              description="Write hourly windows (13 dense, 26 categorical "
                              "features, clicks from a hidden model) as Parquet.")
    g.add_argument("--out", required=True, help="folder to write the window folders into")
    g.add_argument("--windows", type=int, default=4, help="number of hourly windows")
    g.add_argument("--rows-per-window", type=int, default=10_000)
    g.add_argument("--files-per-window", type=int, default=2)
    g.add_argument("--row-group-size", type=int, default=None,
                   help="rows per Parquet row group (default: SyntheticConfig's, 65,536)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--start", default="2024010100", help="first window's hour, YYYYMMDDHH")
    g.add_argument("--overwrite", action="store_true", help="replace existing windows")
    g.add_argument("--drift", type=float, default=0.02,
                   help="how far the click model moves per hourly window (0: a fixed relationship)")
    g.set_defaults(func=_generate)

    a = subparsers.add_parser("append", help="add the next hourly window to a synthetic root",
                              description="Write the window one hour after the root's last one, with the "
                              "seed, sizes and drift the root was generated with (its _synthetic.json).")
    a.add_argument("--root", required=True, help="the synthetic root (written by `ettflow data generate`)")
    a.add_argument("--rows-per-window", type=int, default=None, help="default: the root's")
    a.set_defaults(func=_append)

    m = subparsers.add_parser("movielens", help="write MovieLens-100K as time-ordered windows",
                              description="Download the recbole==1.2.1 wheel (no dependencies), "
                              "extract MovieLens-100K and write it as Parquet windows.")
    m.add_argument("--out", required=True, help="folder to write the window folders into")
    m.add_argument("--windows", type=int, default=10)
    m.add_argument("--files-per-window", type=int, default=1)
    m.add_argument("--cache-dir", default=None,
                   help="where the extracted files are kept (default: OUT/_source)")
    m.add_argument("--overwrite", action="store_true", help="replace existing windows")
    m.set_defaults(func=_movielens)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ettflow data")
    add_data_commands(parser.add_subparsers(dest="data_command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
