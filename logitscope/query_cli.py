"""``logitscope query DATASET "SQL"``: SQL across runs (:func:`tracker.open_dataset`) from the command line.

The answer is printed as a table, or as CSV (``--csv``) or JSON Lines
(``--json``) for other tools, or written to a Parquet file (``--parquet``,
atomically). A bad path or SQL that DuckDB refuses ends in one line saying
why (exit status 2). Needs duckdb and pyarrow; no torch.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from logitscope.cli_args import fail, json_text, positive_int, terminal_text

__all__ = ["add_parser", "cmd_query"]

_EPILOG = """views (columns: docs/guide.md, "At scale"):
  runs        one row per run (run_id, title, model, processors, sampling, storage, stages, steps, created_at, ...)
  steps       one row per run, generation, sequence and step: chosen_id, chosen_token and every statistic of
              Run.stats() per stage (entropy_natural, p_chosen_constrained, removed_mass, margin, p_eos_natural, ...)
  sequences   one row per run, generation and sequence: prompt, text, steps
  candidates  the K best tokens of every step and stage: stage, rank, token_id, token, logit, probability, masked

examples:
  logitscope query runs/ "SELECT run_id, avg(entropy_natural) FROM steps GROUP BY run_id"
  logitscope query runs/ "SELECT * FROM steps WHERE removed_mass > 0.5" --csv > masked.csv"""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``query`` subcommand to the command line's subparsers."""
    command = sub.add_parser(
        "query",
        help="answer SQL across runs (DuckDB views runs, steps, sequences, candidates)",
        description="Answer a SQL query (DuckDB's dialect) over the runs at DATASET: a run file, a folder of runs, "
        "a run_id= dataset, or a storage URL (s3://..., gs://..., file://...).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.add_argument("dataset", metavar="DATASET", help="a run file, a folder of runs, a dataset, or a URL")
    command.add_argument("sql", metavar="SQL", help='the query, e.g. "SELECT * FROM runs"')
    form = command.add_mutually_exclusive_group()
    form.add_argument("--csv", action="store_true", help="print CSV (with a header line)")
    form.add_argument("--json", action="store_true", help="print one JSON object per row")
    form.add_argument("--parquet", default=None, metavar="FILE", help="write the answer to a Parquet file")
    command.add_argument(
        "--k", type=positive_int, default=10, metavar="K", help="tokens per step and stage in candidates (default: 10)"
    )
    command.add_argument(
        "--max-rows", type=positive_int, default=50, metavar="N", help="rows the table shows (default: 50)"
    )
    command.add_argument(
        "--timeout",
        type=_seconds,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"stop a query that runs longer, reading the runs included (default: {DEFAULT_TIMEOUT:g}; 0: no limit)",
    )
    command.add_argument(
        "--memory",
        type=_size,
        default=None,
        metavar="SIZE",
        help="the most memory the query engine may use, e.g. 500MB or 4GB (default: DuckDB's, 80%% of this machine's)",
    )
    command.set_defaults(handler=cmd_query, command_parser=command)
    return command


#: Seconds a query may run by default (``--timeout``).
DEFAULT_TIMEOUT = 600.0


def _seconds(text: str) -> float | None:
    """``--timeout``: seconds > 0, or 0 for no limit (None)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds (0: no limit), got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0 (0: no limit), got {text!r}")
    return value or None


def _size(text: str) -> str:
    """``--memory``: a size DuckDB reads (``500MB``, ``4GB``)."""
    from tracker.reading.query import memory_size

    try:
        return memory_size(text)  # type: ignore[return-value]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a size such as 500MB or 4GB, got {text!r}") from None


def _write_parquet(table: Any, target: str) -> None:
    """Write ``table`` to ``target`` (a path, written atomically, or a storage URL)."""
    import pyarrow.parquet as pq

    from tracker.format.fs import is_url, resolve
    from tracker.format.spill import atomic_path

    if is_url(target):  # an object is written whole by its last write: no reader sees half of it
        fs, path = resolve(target, "--parquet")
        pq.write_table(table, path, filesystem=fs)
        return
    with atomic_path(target) as tmp:
        pq.write_table(table, tmp)


def cmd_query(args: argparse.Namespace, parser: argparse.ArgumentParser, out: TextIO | None = None) -> int:
    """Answer the query and print (or write) the answer."""
    from tracker.format.layout import NoRunError, RunFileError
    from tracker.reading.query import QueryError, QueryLimitError, open_dataset

    out = out or sys.stdout
    try:
        dataset = open_dataset(args.dataset, k=args.k, memory=args.memory)
    except (NoRunError, RunFileError, PermissionError, ValueError) as exc:
        fail(parser, "DATASET", exc)
    except ImportError as exc:
        fail(parser, None, exc)
    try:
        table = dataset.sql(args.sql, timeout=args.timeout)
    except QueryLimitError as exc:
        fail(parser, f"--{exc.limit}", f"{exc}; give more with --{exc.limit} (or narrow the query)")
    except QueryError as exc:
        fail(parser, "SQL", exc)
    except (RunFileError, ValueError) as exc:  # a run that cannot be read when a view needs its values
        fail(parser, "DATASET", exc)
    if args.parquet is not None:
        try:
            _write_parquet(table, args.parquet)
        except (OSError, ValueError) as exc:
            fail(parser, "--parquet", f"cannot write '{args.parquet}': {exc}")
        print(f"{table.num_rows} rows written to {args.parquet}", file=sys.stderr)
        return _say_skipped(parser, dataset.skipped)
    frame = table.to_pandas()
    if args.csv:  # data for other tools: escaped only where a terminal shows it
        (_escaped(frame) if out.isatty() else frame).to_csv(out, index=False)
    elif args.json:
        if len(frame):
            out.write(json_text(frame.to_json(orient="records", lines=True, force_ascii=False)))
    else:
        print(_escaped(frame).to_string(index=False, max_rows=args.max_rows, max_colwidth=60), file=out)
        if len(frame) > args.max_rows:
            print(f"({len(frame)} rows; --max-rows to show more, --csv or --parquet for all)", file=out)
    return _say_skipped(parser, dataset.skipped)


def _escaped(frame: Any) -> Any:
    """``frame`` with its text cells through :func:`~logitscope.cli_args.terminal_text` (titles, tokens and
    prompts come from run files: a terminal shows them, never obeys them)."""
    from pandas.api.types import is_object_dtype, is_string_dtype

    frame = frame.copy()
    for i in range(frame.shape[1]):  # by position: an answer may name two columns alike
        column = frame.iloc[:, i]
        if is_object_dtype(column) or is_string_dtype(column):
            frame.isetitem(i, column.map(lambda v: terminal_text(v) if isinstance(v, str) else v))
    return frame


def _say_skipped(parser: argparse.ArgumentParser, skipped: list) -> int:
    """One line on stderr per run left out of the answer (a file of the folder that cannot be read): exit
    status 1 then, 0 when every run was read."""
    for exc in skipped:
        print(terminal_text(f"{parser.prog}: left out of the answer: {exc}"), file=sys.stderr)
    return 1 if skipped else 0
