"""`ettflow publish`: anchor checkpoint -> validated inference snapshot, on the CPU.

    ettflow publish --anchor WORK/checkpoints/step_0000000064 --data DATA_ROOT \\
        [--windows window=2024010102 ...] [--out DIR] [--no-quantize] [--delta-on CURRENT_SNAPSHOT]
    ettflow publish --materialize DELTA_SNAPSHOT [--out DIR] [--run-id NAME]

`--delta-on` stores the snapshot as a delta on a published one (the rows that changed);
`--materialize` writes the full snapshot (model.pt) a delta snapshot stands for.

It publishes once. Exit status: 0 published, 2 refused (torn anchor, validation failed, bad
arguments: running it again will not help), 1 failed in a way that may pass when the same
command runs again (it says so).

`register(subparsers)` adds the command to `ettflow`'s sub-parsers (its `func` returns that
exit status); `main(argv)` runs it alone (`python -m ettflow.publish.cli --anchor ...`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ettflow.console import user_doc


def default_output_root() -> str:
    from ettflow import paths

    return str(paths.data_home() / "snapshots")


def _publish(args: argparse.Namespace) -> int:
    from ettflow.publish.config import PublishConfig
    from ettflow.publish.delta_snapshot import materialize
    from ettflow.publish.publisher import is_retryable, publish_snapshot

    if args.materialize is None and (args.anchor is None or args.data is None):
        print("ettflow publish: give --anchor and --data (publish), or --materialize (a delta snapshot)",
              file=sys.stderr)
        return 2
    try:
        if args.materialize is not None:
            manifest = materialize(args.materialize, args.out or default_output_root(), run_id=args.run_id)
            print(f"materialized {manifest.path} from {args.materialize} (run {manifest.run_id}, step {manifest.step})")
            return 0
        config = PublishConfig(anchor=args.anchor, output_root=args.out or default_output_root(),
                               data_root=args.data, windows=args.windows, batch_size=args.batch_size,
                               validation_batches=args.batches, tolerance=args.tolerance,
                               quantize=not args.no_quantize, run_id=args.run_id, delta_on=args.delta_on)
        manifest = publish_snapshot(config)
    except Exception as e:  # noqa: BLE001 - a command's last stop: the message says what was wrong and what to do
        print(f"ettflow publish: {e}", file=sys.stderr)
        if not is_retryable(e):
            return 2
        print("ettflow publish: this failure may pass on another try (nothing was published, nothing retrains): "
              "run the same command again", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(manifest.to_dict(), indent=1, sort_keys=True))
        return 0
    m, t = manifest.metrics, manifest.timings_s
    print(f"published {manifest.path} (run {manifest.run_id}, step {manifest.step}, "
          f"{'int8' if manifest.quantization['enabled'] else 'float'} tables)")
    print(f"  validated on {m['n_examples']} examples of {', '.join(manifest.data['windows'])}: "
          f"max |p_snapshot - p_float| = {m['max_abs_diff']:.2g} <= {manifest.validation['tolerance']}, "
          f"AUC float {m['auc_float']} snapshot {m['auc_snapshot']}")
    if manifest.delta:
        d = manifest.delta
        print(f"  stored as a delta on {d['base']}: {d['changed_rows']} of {d['rows']} rows changed, "
              f"{d['bytes']} bytes (the full module {d['full_bytes']})")
    print("  took " + ", ".join(f"{k} {v:.2f} s" for k, v in t.items()))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ettflow.publish.config import DEFAULT_TOLERANCE

    parser.add_argument("--anchor", help="the anchor checkpoint folder (<work_dir>/checkpoints/step_<n>)")
    parser.add_argument("--data", help="folder of held-out data windows to validate on")
    parser.add_argument("--windows", nargs="+", help="held-out window names (default: the last window of --data)")
    parser.add_argument("--out", help="snapshot root; the snapshot goes to OUT/<run_id>/ "
                        "(default: $ETTFLOW_HOME/snapshots)")
    parser.add_argument("--batch-size", type=int, default=512, help="validation batch size (default 512)")
    parser.add_argument("--batches", type=int, default=8, help="validation batches (default 8)")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help=f"largest allowed |p_snapshot - p_float| (default {DEFAULT_TOLERANCE})")
    parser.add_argument("--no-quantize", action="store_true", help="keep float32 embedding tables")
    parser.add_argument("--run-id", help="output folder name (default: the run id in anchor.json)")
    parser.add_argument("--delta-on", help="a published snapshot folder (the current one): store this snapshot as "
                        "a delta on it, the rows that changed")
    parser.add_argument("--materialize", metavar="DELTA_SNAPSHOT",
                        help="write the full snapshot a delta snapshot stands for into OUT/<run_id>/ (no --anchor)")
    parser.add_argument("--json", action="store_true", help="print the manifest as JSON")
    parser.set_defaults(func=_publish)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `publish` to `ettflow`'s sub-parsers."""
    parser = subparsers.add_parser("publish", help="anchor checkpoint -> validated inference snapshot (CPU)",
                                   description=user_doc(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ettflow publish", description=user_doc(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
