"""``logitscope inspect``: a recorded run in the terminal, without a browser (and without torch).

    logitscope inspect runs/                       # one line per run under a folder
    logitscope inspect run.parquet                 # what the run holds, and each sequence's text
    logitscope inspect run.parquet --steps 0:5     # and, step by step, the best tokens at every stage
    logitscope inspect run.parquet --steps 3 --json

It reads runs the way the dashboard does (:class:`dashboard.reader.RunReader`:
the metadata and the id columns, then only the blocks holding the steps asked
for), and shows the dashboard's numbers: the same step table
(:func:`dashboard.views.step_table`) and headline numbers
(:func:`dashboard.views.step_summary`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from logitscope.cli_args import fail, json_text, positive_int, terminal_text

__all__ = ["add_parser", "cmd_inspect", "parse_steps"]


def parse_steps(text: str) -> slice:
    """``N``, ``A:B``, ``A:``, ``:B`` or ``all``: which recorded steps to show (step numbers, ``B`` excluded)."""
    allowed = "a step number N, a range A:B (A or B may be left out) or 'all'"
    if text.strip() == "all":
        return slice(None)
    parts = text.split(":")
    try:
        bounds = [int(p) if p.strip() else None for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}") from None
    if any(b is not None and b < 0 for b in bounds):
        raise argparse.ArgumentTypeError(f"must be {allowed} with steps >= 0, got {text!r}")
    if len(bounds) == 1 and bounds[0] is not None:
        return slice(bounds[0], bounds[0] + 1)
    if len(bounds) != 2:
        raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
    start, stop = bounds
    if start is not None and stop is not None and stop <= start:
        raise argparse.ArgumentTypeError(f"must be a range A:B with A < B (B is excluded), got {text!r}")
    return slice(start, stop)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``inspect`` subcommand to the command line's subparsers."""
    command = sub.add_parser(
        "inspect",
        help="print what a run holds (or list the runs under a folder), without a browser",
        description="Print what a recorded run holds: its model, storage, stages and each sequence's text; "
        "with --steps, the best tokens at every stage of those steps (the dashboard's step table). "
        "Given a folder of runs, print one line per run.",
    )
    command.add_argument("path", metavar="PATH", help="a run file, a run folder, or a folder of runs")
    command.add_argument("--generation", type=int, default=None, help="only this generation (default: all)")
    command.add_argument("--sequence", type=int, default=None, help="only this sequence (default: all)")
    command.add_argument(
        "--steps",
        type=parse_steps,
        default=None,
        metavar="RANGE",
        help="show these steps: N, A:B (B excluded), A:, :B or all (default: none, the text only)",
    )
    command.add_argument("--top", type=positive_int, default=5, metavar="K", help="tokens per step (default: 5)")
    command.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    command.set_defaults(handler=cmd_inspect, command_parser=command)
    return command


# ---------------------------------------------------------------- gathering


def _number(value: float) -> float | None:
    """A float for JSON: NaN (unknown) as null."""
    return None if value != value else float(value)


def _selected(reader: Any, args: argparse.Namespace, parser: argparse.ArgumentParser) -> Iterator[tuple[int, int]]:
    generations = reader.generations()
    if args.generation is not None and args.generation not in generations:
        fail(parser, "--generation", f"{args.generation} is not in this run; its generations are {generations}")
    for g in generations if args.generation is None else [args.generation]:
        sequences = reader.sequences(g)
        if args.sequence is not None and args.sequence not in sequences:
            fail(parser, "--sequence", f"{args.sequence} is not in generation {g}; its sequences are {sequences}")
        for s in sequences if args.sequence is None else [args.sequence]:
            yield g, s


def _step_record(reader: Any, track: Any, position: int, top: int) -> dict[str, Any]:
    from dashboard.views import step_summary, step_table

    row = reader.step(track, position)
    table = step_table(row, reader.vocab, top)
    summary = step_summary(row, reader.vocab)
    stages = list(row.stages)
    tokens = []
    for rank, record in enumerate(table.to_dict("records"), start=1):
        tokens.append(
            {
                "rank": rank,
                "token_id": int(record["token_id"]),
                "token": record["token"],
                "chosen": bool(record["chosen"]),
                "prob": {s: _number(record[f"{s}_prob"]) for s in stages},
                "state": {s: record[f"{s}_state"] for s in stages},
                "removed_by": record["removed_by"] or None,
            }
        )
    return {
        "step": int(summary.step),
        "chosen_id": int(summary.chosen_id),
        "chosen_token": summary.chosen_token,
        "allowed": int(summary.allowed),
        "removed_mass": _number(summary.removed_mass),
        "entropy": {s: _number(v) for s, v in summary.entropy.items()},
        "p_chosen": {s: _number(v) for s, v in summary.p_chosen.items()},
        "processor_error": bool(summary.processor_error),
        "tokens": tokens,
    }


def _sampling_of(reader: Any, generation: int, sequence: int) -> str:
    """The sampling parameters a generation recorded for this row ("" when it recorded none)."""
    from dashboard.discover import sampling_text

    for entry in reader.metadata.generations:
        if int(entry.get("generation", -1)) == generation:
            sampling = entry.get("sampling")
            if isinstance(sampling, list):  # one entry per row (the Generator's requests)
                sampling = sampling[sequence] if 0 <= sequence < len(sampling) else None
            if isinstance(sampling, dict):
                # a greedy run's seed drew nothing: not shown, so it cannot read as a way to replay the run
                hidden = ("request", "sample", "seed") if sampling.get("greedy") is True else ("request", "sample")
                sampling = {k: v for k, v in sampling.items() if k not in hidden}
            return sampling_text(sampling)
    return ""


def _labels_of(reader: Any, generation: int) -> str:
    """What the generation was called by whoever sent it (a served request's ``request_id`` and ``title``)."""
    for entry in reader.metadata.generations:
        if int(entry.get("generation", -1)) == generation:
            parts = [f"{key} {entry[key]!r}" for key in ("request_id", "title") if isinstance(entry.get(key), str)]
            return ", ".join(parts)
    return ""


def _sequence_record(reader: Any, generation: int, sequence: int, steps: slice | None, top: int) -> dict[str, Any]:
    from dashboard.views import token_pieces

    track = reader.track(generation, sequence)
    record: dict[str, Any] = {
        "generation": generation,
        "sequence": sequence,
        "steps": track.length,
        "prompt": reader.prompt(generation, sequence),
        "text": "".join(token_pieces(reader.vocab, track.chosen)),
        "sampling": _sampling_of(reader, generation, sequence),
        "labels": _labels_of(reader, generation),
    }
    if steps is not None:
        start = 0 if steps.start is None else steps.start
        stop = None if steps.stop is None else steps.stop
        shown = [p for p, n in enumerate(track.steps.tolist()) if start <= n and (stop is None or n < stop)]
        record["step_details"] = [_step_record(reader, track, p, top) for p in shown]
    return record


# ---------------------------------------------------------------- printing


def _say(out: TextIO, line: str = "") -> None:
    """Print one line: whatever a run file put in it is shown escaped, never obeyed by the terminal."""
    print(terminal_text(line), file=out)


def _say_json(out: TextIO, value: Any) -> None:
    out.write(json_text(json.dumps(value, indent=1, ensure_ascii=False)) + "\n")


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _summary_lines(summary: Any) -> list[str]:
    fields = [
        ("title", summary.title),
        ("model", summary.model),
        ("created", summary.created_at),
        ("storage", summary.storage),
        ("stages", summary.stages),
        ("vocabulary", f"{summary.vocab_size} tokens"),
        ("processors", summary.processors),
        ("sampling", summary.sampling),
        (
            "holds",
            f"{summary.generations} generation(s), up to {summary.sequences} sequence(s) each, "
            f"up to {summary.steps} step(s)",
        ),
        ("note", summary.note),
    ]
    width = max(len(name) for name, _ in fields)
    return [f"  {name:<{width}}  {value}" for name, value in fields if value]


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


def _probability(p: float | None, state: str) -> str:
    from tracker.reading.display import format_probability

    return format_probability(_nan(p)) if state == "kept" else state


def _step_lines(step: dict[str, Any], stages: list[str], names: dict[str, str]) -> list[str]:
    from tracker.reading.display import format_probability, token_label

    chosen = f"{token_label(step['chosen_token'])!r} (id {step['chosen_id']})" if step["chosen_id"] >= 0 else "unknown"
    failed = "  [the wrapped processor raised at this step]" if step["processor_error"] else ""
    p_chosen = ", ".join(f"{names[s]} {format_probability(_nan(v))}" for s, v in step["p_chosen"].items())
    entropy = ", ".join(f"{names[s]} {_nats(v)}" for s, v in step["entropy"].items())
    lines = [
        f"  step {step['step']}: chose {chosen}{failed}",
        f"    p(chosen): {p_chosen}",
        f"    entropy (nats): {entropy}",
    ]
    removed = step["removed_mass"] if "constrained" in stages else None  # nothing to remove without a constraint
    lines.append(f"    allowed: {step['allowed']}" + _removed(removed))
    header = ["", "token", "id", *(names[s] for s in stages), "removed by"]
    rows = [
        [
            "*" if t["chosen"] else "",
            token_label(t["token"]),
            str(t["token_id"]),
            *(_probability(t["prob"][s], t["state"][s]) for s in stages),
            names.get(t["removed_by"], t["removed_by"]) if t["removed_by"] else "",
        ]
        for t in step["tokens"]
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        lines.append("    " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    return lines


def _nats(v: float | None) -> str:
    return "—" if v is None else f"{v:.3f}"


def _removed(mass: float | None) -> str:
    from tracker.reading.display import format_probability

    return "" if mass is None else f", probability mass removed by constraints: {format_probability(mass)}"


def _print_run(out: TextIO, summary: Any, sequences: list[dict[str, Any]], names: dict[str, str]) -> None:
    _say(out, f"{summary.path}  (run {summary.run_id}, {_size(summary.size_bytes)})")
    if any(seq["sampling"] for seq in sequences):  # each sequence says its own: the run's is the latest generation's
        summary = replace(summary, sampling="")
    for line in _summary_lines(summary):
        _say(out, line)
    for seq in sequences:
        _say(out)
        labels = f" ({seq['labels']})" if seq.get("labels") else ""
        _say(out, f"generation {seq['generation']}, sequence {seq['sequence']}{labels}: {seq['steps']} step(s)")
        if seq["sampling"]:
            _say(out, f"  sampling: {seq['sampling']}")
        _say(out, f"  prompt: {seq['prompt']!r}")
        _say(out, f"  text:   {seq['text']!r}")
        for step in seq.get("step_details", []):
            stages = list(step["p_chosen"])
            for line in _step_lines(step, stages, names):
                _say(out, line)
        if "step_details" in seq and not seq["step_details"]:
            _say(out, "  (no recorded step in the range asked for)")


def _print_listing(out: TextIO, summaries: list[Any]) -> None:
    for s in summaries:
        if s.error:
            _say(out, f"{s.label}: not a readable run: {s.error}")
            continue
        prompt = s.prompt if len(s.prompt) <= 40 else s.prompt[:39] + "…"
        line = (
            f"{s.label}: {s.steps} step(s), {s.generations} generation(s) x {s.sequences} sequence(s), "
            f"{s.storage}, {s.model or 'unknown model'}, prompt {prompt!r}"
        )
        _say(out, line + (f" ({s.note})" if s.note else ""))


# ---------------------------------------------------------------- the command


def cmd_inspect(args: argparse.Namespace, parser: argparse.ArgumentParser, out: TextIO | None = None) -> int:
    """Print a run (or the runs under a folder); exit status 1 if a run asked for cannot be read."""
    from pyarrow import ArrowException

    from dashboard.discover import find_runs, summarize, summary_of, unexpected_reason
    from dashboard.reader import BadRunError, RunReader
    from tracker.format.fs import is_url

    out = out or sys.stdout
    path: Path | str = args.path if is_url(args.path) else Path(args.path)  # a URL: s3://bucket/runs
    try:
        found = find_runs(path)
    except (FileNotFoundError, PermissionError) as exc:
        fail(parser, "PATH", f"cannot read '{path}': {exc}")
    if not found:
        fail(parser, "PATH", f"no runs under '{path}' (runs are .parquet/.arrow files or run folders)")
    if len(found) > 1 or found[0] != path:
        if args.steps is not None or args.generation is not None or args.sequence is not None:
            fail(
                parser,
                "PATH",
                f"'{path}' is a folder of runs; --steps, --generation and --sequence need one run "
                f"(give one of its {len(found)} runs)",
            )
        summaries = [summarize(p, path) for p in found]
        if args.json:
            _say_json(out, [vars(s) for s in summaries])
        else:
            _print_listing(out, summaries)
        return 1 if any(s.error for s in summaries) else 0
    try:
        reader = RunReader(path)
        summary = summary_of(reader, str(path).rstrip("/").rsplit("/", 1)[-1])
        sequences = [_sequence_record(reader, g, s, args.steps, args.top) for g, s in _selected(reader, args, parser)]
    except BadRunError as exc:
        _say(sys.stderr, f"logitscope inspect: '{exc.path}' is not a readable run: {exc.reason}")
        return 1
    except (ValueError, TypeError, KeyError, IndexError, RecursionError, MemoryError, ArrowException) as exc:
        _say(sys.stderr, f"logitscope inspect: '{path}' is not a readable run: {unexpected_reason(exc)}")
        return 1
    if args.json:
        _say_json(out, {"run": vars(summary), "sequences": sequences})
        return 0
    back = {v: k for k, v in reader.metadata.stage_aliases.items()}
    names = {s: back.get(s, s) for s in reader.stages}
    _print_run(out, summary, sequences, names)
    return 0
