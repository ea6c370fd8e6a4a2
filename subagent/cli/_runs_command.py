"""``subagent runs``: the run journal's runs, newest first, and ``subagent runs show ID``: one run whole.

What every command that runs agents recorded (:mod:`subagent.journal`; which journal:
:mod:`subagent.cli._journal`). Listing first marks ``interrupted`` the live runs whose process is gone
(:meth:`~subagent.journal.RunJournal.mark_interrupted`) and says which on stderr, once: the listing that
marks a run is the one that reports it.

Light on purpose: no event loop, and nothing of the agent machinery is loaded (``subagent runs`` answers
at once on a journal of 10,000 runs; ``bench/journal_runs.py`` measures it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import typing
from collections.abc import Sequence
from typing import Any, Final

from subagent.cli._console import fit_width, is_terminal, print_stdout, sanitize, terminal_size
from subagent.cli._exits import PROG, Command, CommandError, Parser, UsageError
from subagent.cli._journal import JournalChoice, choose_journal, journal_exists, open_journal
from subagent.journal import JournalError, JournalState, RunJournal, RunRecord

__all__ = [
    "DEFAULT_LIMIT",
    "RUNS_COMMAND",
    "duration_text",
    "interrupted_notice",
    "parse_when",
    "prompt_line",
    "run_table",
]

DEFAULT_LIMIT: Final = 50
"""How many runs ``subagent runs`` lists without ``--limit`` or ``--all``."""

_STATES: Final = typing.get_args(JournalState)
_NOTICE_RUNS: Final = 10
"""How many interrupted runs a notice names one by one."""
_NOTICE_PROMPT_CHARS: Final = 60
_UNITS: Final = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_AGO: Final = re.compile(r"\A(\d+(?:\.\d+)?)\s*([smhdw])\Z")

_DESCRIPTION: Final = """\
List the runs recorded in the run journal, newest first: id, state, stop reason, provider, when it
started (local time), how long it ran, its completed turns and its prompt's first line. A run whose
process is gone (killed, crashed) is marked interrupted first, and stderr says which were newly
found so. `subagent runs show ID` prints one run whole, with its state changes and its children
(ID: a run's id or at least 4 of its first characters). `subagent resume ID` continues a run.
"""

_EPILOG: Final = """\
states: queued, starting, running (its process is at work on it); ended (its last turn ended: the
stop reason says how); failed (its agent never became ready); disposed (shut down before its turn
ended); interrupted (its process died while it was live).

The journal: --journal PATH, else $SUBAGENT_JOURNAL, else the config's top-level `journal` key, else
$XDG_STATE_HOME/subagent/runs.db.
"""


def parse_when(text: str, now: float | None = None) -> float:
    """``--since``/``--until``'s value as seconds since the epoch: an ISO date or date and time (local
    time unless it says its offset), or a time ago (``30m``, ``2h``, ``7d``; s, m, h, d, w)."""
    import datetime  # only for a filter that needs it

    ago = _AGO.match(text.strip().lower())
    if ago is not None:
        return (time.time() if now is None else now) - float(ago[1]) * _UNITS[ago[2]]
    try:
        return datetime.datetime.fromisoformat(text.strip()).timestamp()
    except (ValueError, OverflowError, OSError):
        raise argparse.ArgumentTypeError(
            f"expected an ISO date or time (2025-01-31, 2025-01-31T14:00) or a time ago (30m, 2h, 7d), "
            f"not {text!r}"
        ) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text!r}")
    return value


def _add_journal_arguments(parser: argparse.ArgumentParser, *, default: Any = None) -> None:
    parser.add_argument(
        "--journal",
        metavar="PATH",
        default=default,
        help="read this run journal (default: $SUBAGENT_JOURNAL, else the config's `journal`, else "
        "$XDG_STATE_HOME/subagent/runs.db)",
    )
    parser.add_argument(
        "--config",
        metavar="PATH",
        default=default,
        help="the config file whose top-level `journal` key to read (default: the first found)",
    )


def _add_arguments(parser: Parser) -> None:
    parser.add_argument(
        "--state",
        action="append",
        choices=_STATES,
        help="only runs in this state (repeatable: any of them)",
    )
    parser.add_argument("--provider", metavar="NAME", help="only runs of this provider (acp, spawn, fork...)")
    parser.add_argument(
        "--parent", metavar="ID", help="only the children of this run (its journal id, or a parent id)"
    )
    parser.add_argument(
        "--since",
        metavar="WHEN",
        type=parse_when,
        help="only runs started at or after WHEN: an ISO date or time (2025-01-31, 2025-01-31T14:00, local "
        "time), or a time ago (30m, 2h, 7d)",
    )
    parser.add_argument("--until", metavar="WHEN", type=parse_when, help="only runs started before WHEN")
    most = parser.add_mutually_exclusive_group()
    most.add_argument(
        "--limit",
        metavar="N",
        type=_positive,
        default=DEFAULT_LIMIT,
        help=f"at most N runs ({DEFAULT_LIMIT})",
    )
    most.add_argument("--all", action="store_true", help="every run that matches")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON array of the runs (each as RunRecord.to_json())"
    )
    _add_journal_arguments(parser)
    actions = parser.add_subparsers(dest="action", metavar="show ID", parser_class=Parser)
    show = actions.add_parser(
        "show",
        prog=f"{PROG} runs show",
        help="print one run whole: every field, its state changes, its children",
        description="Print one run of the journal whole: every field, its state changes with their "
        "times, and its children. ID: its id, or at least 4 of its first characters.",
    )
    show.add_argument("id", metavar="ID", help="the run's id (or at least 4 of its first characters)")
    # SUPPRESS: given before `show`, the listing's flags are not reset by the defaults of show's own.
    show.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print one JSON object")
    _add_journal_arguments(show, default=argparse.SUPPRESS)


def _runs_command(args: argparse.Namespace, command: list[str] | None) -> int:
    if command is not None:
        raise UsageError("runs takes no `-- COMMAND`")
    choice = choose_journal(args.journal, False, explicit_config=args.config)
    if choice.path is None:
        raise CommandError(
            f"no run journal is kept ({_off_by(choice)} turned it off): name one with --journal PATH"
        )
    if args.action == "show":
        return _show(args, choice)
    if not journal_exists(choice):
        _print_runs(args, choice, [], exists=False)
        return 0
    journal = open_journal(choice)
    assert journal is not None
    try:
        _mark_interrupted(journal, choice)
        records = journal.runs(
            states=args.state,
            provider=args.provider,
            parent=args.parent,
            since=args.since,
            until=args.until,
            limit=None if args.all else args.limit,
        )
    except JournalError as exc:
        raise CommandError(str(exc)) from None
    finally:
        journal.close()
    _print_runs(args, choice, records, exists=True)
    return 0


def _mark_interrupted(journal: RunJournal, choice: JournalChoice) -> None:
    """Mark the live runs whose process is gone, and say which on stderr (the one report of each)."""
    marked = journal.mark_interrupted()
    if marked:
        ids = ", ".join(record.id for record in marked[:_NOTICE_RUNS])
        more = f" and {len(marked) - _NOTICE_RUNS} more" if len(marked) > _NOTICE_RUNS else ""
        _stderr(
            f"{PROG}: newly interrupted (the process that ran them is gone): {ids}{more}; continue one "
            f"with `{choice.resume_command('ID')}`\n"
        )


def _off_by(choice: JournalChoice) -> str:
    return {"config": "the config's `journal = false`", "SUBAGENT_JOURNAL": "SUBAGENT_JOURNAL=off"}.get(
        choice.source, choice.source
    )


def _stderr(text: str) -> None:
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass  # a closed stderr: the listing on stdout is what was asked for


def _print_runs(
    args: argparse.Namespace, choice: JournalChoice, records: list[RunRecord], *, exists: bool
) -> None:
    if args.json:
        print_stdout(json.dumps([record.to_json() for record in records], ensure_ascii=False) + "\n")
        return
    if not records:
        filtered = any(
            value is not None for value in (args.state, args.provider, args.parent, args.since, args.until)
        )
        where = f"the run journal {choice.path}" + ("" if exists else " (it does not exist yet)")
        print_stdout(f"no runs {'match' if filtered else 'recorded'} in {where}\n")
        return
    print_stdout("".join(line + "\n" for line in run_table(records, _columns())))


def _columns() -> int | None:
    """How wide the listing may be: ``COLUMNS``, else the terminal's width; None (no limit) when stdout is
    no terminal, so that what is piped or saved keeps whole lines."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    return terminal_size(sys.stdout)[0] if is_terminal(sys.stdout) else None


def prompt_line(prompt: str, width: int) -> str:
    """A prompt's first line that is not blank, made inert and cut to ``width`` columns."""
    first = next((line.strip() for line in sanitize(prompt).splitlines() if line.strip()), "")
    return fit_width(" ".join(first.split()), width)


def duration_text(seconds: float) -> str:
    """``0.4s``, ``12.0s``, ``3m05s``, ``2h07m``, ``3d04h``."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def _local_time(when: float, *, fraction: bool = False) -> str:
    text = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))
    return f"{text}.{int(when % 1 * 1000):03d}" if fraction else text


def _duration(record: RunRecord, now: float) -> float:
    """How long the run ran: to its end, to its last sign of life (interrupted), or until now (live)."""
    if record.ended_at is not None:
        end = record.ended_at
    elif record.live:
        end = now
    else:
        end = record.updated_at
    return end - record.created_at


_WHOLE_LINE: Final = 1_000
"""How much of a prompt's first line a listing that is not cut to a terminal shows."""
_HEADER: Final = ("ID", "STATE", "STOP", "PROVIDER", "STARTED", "DURATION", "TURNS", "PROMPT")


def run_table(records: Sequence[RunRecord], columns: int | None, *, now: float | None = None) -> list[str]:
    """One line per run under a header, the prompt's first line cut to fit ``columns`` (None: whole)."""
    now = time.time() if now is None else now
    rows = [
        (
            record.id,
            record.state,
            record.stop_reason or "-",
            sanitize(record.provider),
            _local_time(record.created_at),
            duration_text(_duration(record, now)),
            str(record.turns),
        )
        for record in records
    ]
    widths = [max(len(row[column]) for row in [_HEADER[:7], *rows]) for column in range(7)]
    prefix = sum(widths) + 2 * 7
    room = max(20, columns - prefix) if columns is not None else _WHOLE_LINE
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(_HEADER[:7], widths, strict=True)) + "  PROMPT"
    ]
    for record, row in zip(records, rows, strict=True):
        cells = "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        lines.append(f"{cells}  {prompt_line(record.prompt, room)}".rstrip())
    return lines


def interrupted_notice(records: Sequence[RunRecord], resume: str) -> list[str]:
    """The lines that say which runs were found interrupted (their process gone) and how to continue
    one (``resume``: the command, with ``ID`` for the run's id)."""
    count = len(records)
    runs, them = ("runs", "them") if count != 1 else ("run", "it")
    lines = [f"{PROG}: {count} {runs} found interrupted (the process that ran {them} is gone):"]
    lines += [
        f"  {record.id}  {sanitize(record.provider)}  {prompt_line(record.prompt, _NOTICE_PROMPT_CHARS)}"
        for record in records[:_NOTICE_RUNS]
    ]
    if count > _NOTICE_RUNS:
        lines.append(f"  and {count - _NOTICE_RUNS} more")
    lines.append(f"{PROG}: continue one with `{resume}`; `{PROG} runs --state interrupted` lists them")
    return lines


# -- runs show --------------------------------------------------------------------------------------------


def _show(args: argparse.Namespace, choice: JournalChoice) -> int:
    if not journal_exists(choice):
        raise CommandError(f"no run {args.id!r}: the run journal {choice.path} does not exist")
    journal = open_journal(choice)
    assert journal is not None
    try:
        _mark_interrupted(journal, choice)
        record = journal.get(args.id)
        children = journal.children(record.id) if record is not None else []
    except JournalError as exc:
        raise CommandError(str(exc)) from None
    finally:
        journal.close()
    if record is None:
        short = " (give at least 4 characters of its id)" if len(args.id) < 4 else ""
        raise CommandError(f"no run {args.id!r} in the run journal {choice.path}{short}")
    if args.json:
        value = record.to_json()
        value["checkpoint"] = None if record.checkpoint is None else dict(record.checkpoint)
        value["children"] = [child.to_json() for child in children]
        print_stdout(json.dumps(value, ensure_ascii=False) + "\n")
        return 0
    print_stdout("".join(line + "\n" for line in _details(record, children, choice)))
    return 0


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def _block(title: str, text: str) -> list[str]:
    lines = sanitize(text).splitlines() or [""]
    return [f"{title}:", *(f"  {line}" for line in lines)]


def _details(record: RunRecord, children: Sequence[RunRecord], choice: JournalChoice) -> list[str]:
    now = time.time()
    stop = f" ({record.stop_reason})" if record.stop_reason else ""
    fields: list[tuple[str, str]] = [
        ("state", record.state + stop),
        ("provider", f"{sanitize(record.provider)} (its run {sanitize(record.run_id)})"),
        ("parent", record.parent or "-"),
        ("parent id", sanitize(record.parent_id) if record.parent_id is not None else "-"),
        ("started", _local_time(record.created_at)),
        ("updated", _local_time(record.updated_at)),
        ("ended", _local_time(record.ended_at) if record.ended_at is not None else "-"),
        ("duration", duration_text(_duration(record, now))),
        ("turns", f"{record.turns} completed"),
        ("resumes", str(record.resumes)),
        ("session", sanitize(record.session_id) if record.session_id is not None else "-"),
        ("agent", _agent_text(record.agent)),
        ("owner", _owner_text(record.owner)),
        ("request", _json_text(dict(record.request)) if record.request else "{}"),
        ("usage", _json_text(dict(record.usage)) if record.usage is not None else "-"),
        ("spent", _json_text(dict(record.spent)) if record.spent is not None else "-"),
        ("progress", _json_text(dict(record.progress)) if record.progress is not None else "-"),
        ("checkpoint", _checkpoint_text(record.checkpoint)),
    ]
    width = max(len(name) for name, _ in fields) + 1
    lines = [f"run {record.id}"]
    lines += [f"  {(name + ':').ljust(width)} {value}" for name, value in fields]
    cut = f", cut to {len(record.prompt):,}" if record.prompt_chars > len(record.prompt) else ""
    lines += _block(f"prompt ({record.prompt_chars:,} characters{cut})", record.prompt)
    if record.turn_prompt != record.prompt:
        lines += _block("latest turn's prompt", record.turn_prompt)
    if record.output is not None:
        lines += _block("output", record.output)
    if record.structured is not None:
        lines += _block("structured", _json_text(record.structured))
    if record.error is not None:
        lines += _block("error", record.error)
    lines.append("state changes:")
    lines += [
        f"  {_local_time(change.at, fraction=True)}  {change.state}"
        + (f"  {sanitize(change.detail)}" if change.detail else "")
        for change in record.transitions
    ]
    if children:
        lines.append(f"children ({len(children)}):")
        columns = _columns()
        lines += [f"  {line}" for line in run_table(children, columns and columns - 2, now=now)]
    else:
        lines.append("children: none")
    if _resumable_here(record):
        lines.append(f"continue it with `{choice.resume_command(record.id)}`")
    return lines


def _resumable_here(record: RunRecord) -> bool:
    """Whether ``subagent resume`` may continue the run: its last turn did not complete, nothing runs it,
    and it is an ACP agent's session, outside any isolated workspace (its agent decides the rest)."""
    if record.live or (record.state == "ended" and record.stop_reason == "completed"):
        return False
    agent = record.agent
    return (
        record.session_id is not None
        and isinstance(agent, dict)
        and isinstance(agent.get("command"), list)
        and record.request.get("isolation") is None
    )


def _agent_text(agent: Any) -> str:
    if not isinstance(agent, dict):
        return "-"
    command = agent.get("command")
    if isinstance(command, list) and all(isinstance(part, str) for part in command):
        import shlex

        where = agent.get("transport") or "local"
        cwd = agent.get("cwd")
        return sanitize(f"{shlex.join(command)} (on {where}" + (f", in {cwd})" if cwd else ")"))
    return sanitize(_json_text(agent))


def _owner_text(owner: Any) -> str:
    if not isinstance(owner, dict):
        return "-"
    return f"pid {owner.get('pid')} on host {str(owner.get('host'))[:8]}"


def _checkpoint_text(checkpoint: Any) -> str:
    if checkpoint is None:
        return "none"
    text = _json_text(checkpoint)
    if len(text) <= 200:
        return sanitize(text)
    keys = ", ".join(sorted(str(key) for key in checkpoint)) if isinstance(checkpoint, dict) else "?"
    return f"{len(text):,} characters of JSON ({keys}; `--json` shows it)"


RUNS_COMMAND: Final = Command(
    help="list the runs recorded in the run journal; `runs show ID` prints one",
    description=_DESCRIPTION,
    epilog=_EPILOG,
    add_arguments=_add_arguments,
    run=_runs_command,
    usage=f"{PROG} runs [--state STATE] [--provider NAME] [--parent ID] [--since WHEN] [--until WHEN] "
    "[--limit N | --all] [--json]\n       "
    f"{PROG} runs show ID [--json]",
)
