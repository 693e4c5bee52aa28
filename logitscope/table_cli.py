"""``logitscope vacuum TABLE``, ``logitscope compact TABLE`` and ``logitscope convert SOURCE TABLE``: a table's
upkeep from the command line.

``vacuum`` removes what no commit of the table names (a killed writer's
parts, parts a rewritten run replaced, vocabularies no part names), older
than ``--older-than`` hours (a week by default: writers still at work keep
their parts until they commit); ``--dry-run`` lists them. ``compact`` rewrites
each run of at least ``--min-parts`` committed parts (a server's, a part a
commit) as parts of about ``--max-mb`` each (:mod:`tracker.reading.compact`);
``--dry-run`` says what it would do. ``convert`` writes
every complete run at SOURCE (a folder of completion markers written before
tables, a folder of run files, another table) into the table at TABLE, each
read and checked as ``Run.load`` reads it. A bad location ends in one line
saying why (exit status 2). Needs ``deltalake``; no torch.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from logitscope.cli_args import fail, positive_int

__all__ = ["add_parsers", "cmd_vacuum", "cmd_compact", "cmd_convert"]


def _hours(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of hours >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of hours >= 0, got {text!r}")
    return value


def add_parsers(sub: Any) -> None:
    """Add the ``vacuum``, ``compact`` and ``convert`` subcommands to the command line's subparsers."""
    from tracker.format.upkeep import DEFAULT_AGE_HOURS

    vacuum = sub.add_parser(
        "vacuum",
        help="remove a table's files no commit names (debris of killed writers, replaced parts)",
        description="Remove the files of the table at TABLE (a folder or URL) that no commit names and that "
        "are older than --older-than hours: parts a killed writer left, parts a rewritten run replaced, "
        "vocabularies no part names. Readers never see them; this frees their space.",
    )
    vacuum.add_argument("table", metavar="TABLE", help="the table's folder or URL")
    vacuum.add_argument(
        "--older-than",
        type=_hours,
        default=DEFAULT_AGE_HOURS,
        metavar="HOURS",
        help=f"only files older than this (default: {DEFAULT_AGE_HOURS:g}, a week; 0 when no writer is at work)",
    )
    vacuum.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    vacuum.set_defaults(handler=cmd_vacuum, command_parser=vacuum)
    compact = sub.add_parser(
        "compact",
        help="rewrite a table's runs of many small parts (a server's) as a few larger ones",
        description="Rewrite each run of the table at TABLE that has at least --min-parts committed parts as "
        "parts of about --max-mb each, one commit per run that removes exactly the parts it read (parts a writer "
        "commits meanwhile stay), and the parts written before part names carried the digest of their bytes (queries "
        "read those one by one). Readers answer the same; each part read one by one costs a reader about 1.5 ms "
        "whatever its size. The replaced parts stay on disk until `logitscope vacuum`.",
    )
    compact.add_argument("table", metavar="TABLE", help="the table's folder or URL")
    compact.add_argument(
        "--min-parts", type=positive_int, default=16, metavar="N", help="runs of at least N parts, N >= 2 (16)"
    )
    compact.add_argument("--max-mb", type=positive_int, default=256, metavar="MB", help="the most per new part (256)")
    compact.add_argument("--run", action="append", metavar="RUN_ID", help="only this run (repeatable)")
    compact.add_argument("--dry-run", action="store_true", help="say what would be rewritten, write nothing")
    compact.set_defaults(handler=cmd_compact, command_parser=compact)
    convert = sub.add_parser(
        "convert",
        help="copy the runs of a dataset written before tables (or of run files) into a table",
        description="Write every complete run at SOURCE (a folder of run_id= folders with completion markers, "
        "a folder of run files, or a table) into the table at TABLE, a commit each.",
    )
    convert.add_argument("source", metavar="SOURCE", help="the dataset, folder or table to copy (a path or URL)")
    convert.add_argument("table", metavar="TABLE", help="the table to write into (made if missing)")
    convert.set_defaults(handler=cmd_convert, command_parser=convert)


def cmd_vacuum(args: argparse.Namespace, parser: argparse.ArgumentParser, out: TextIO | None = None) -> int:
    from tracker.format.table import TableError
    from tracker.format.upkeep import vacuum

    out = out or sys.stdout
    try:
        removed = vacuum(args.table, older_than_hours=args.older_than, dry_run=args.dry_run)
    except (TableError, ValueError, OSError) as exc:
        fail(parser, "TABLE", exc)
    verb = "would remove" if args.dry_run else "removed"
    for path in [*removed.parts, *removed.vocabularies]:
        print(path, file=out)
    print(
        f"{verb} {len(removed.parts)} part file(s) and {len(removed.vocabularies)} vocabulary file(s)", file=sys.stderr
    )
    return 0


def cmd_compact(args: argparse.Namespace, parser: argparse.ArgumentParser, out: TextIO | None = None) -> int:
    from tracker.format.layout import RunFileError
    from tracker.format.table import TableError
    from tracker.reading.compact import Compacted, compact

    out = out or sys.stdout
    if args.min_parts < 2:
        fail(parser, "--min-parts", f"must be >= 2 (a run of one part has nothing to merge), got {args.min_parts}")

    def said(done: Compacted) -> None:
        print(
            f"{done.run_id}: {done.parts_before} parts ({done.bytes_before / 1e6:.1f} MB) -> {done.parts_after} "
            f"({done.bytes_after / 1e6:.1f} MB)",
            file=out,
            flush=True,
        )

    try:
        done = compact(
            args.table,
            min_parts=args.min_parts,
            max_bytes=args.max_mb << 20,
            run_ids=args.run,
            dry_run=args.dry_run,
            progress=said,
        )
    except (TableError, RunFileError, ValueError, OSError) as exc:
        fail(parser, "TABLE", exc)
    verb = "would rewrite" if args.dry_run else "rewrote"
    print(f"{verb} {len(done)} run(s); `logitscope vacuum` frees the replaced parts' space", file=sys.stderr)
    return 0


def cmd_convert(args: argparse.Namespace, parser: argparse.ArgumentParser, out: TextIO | None = None) -> int:
    from tracker.format.discovery import NoRunError, find_runs
    from tracker.format.layout import RunFileError
    from tracker.format.table import TableError
    from tracker.reading.run import Run

    out = out or sys.stdout
    try:
        found = [r for r in find_runs(args.source) if r.kind != "spill"]
    except (NoRunError, RunFileError, PermissionError, ValueError) as exc:
        fail(parser, "SOURCE", exc)
    if not found:
        fail(parser, "SOURCE", f"no complete run at '{args.source}'")
    for run in found:
        try:
            loaded = Run.load(run.path)
        except (RunFileError, ValueError, OSError) as exc:
            fail(parser, "SOURCE", exc)
        try:
            loaded.to_dataset(args.table)
        except (TableError, ValueError, OSError) as exc:
            fail(parser, "TABLE", exc)
        print(loaded.run_id, file=out)
    print(f"{len(found)} run(s) written into {args.table}", file=sys.stderr)
    return 0
