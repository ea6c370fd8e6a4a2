"""The command-line half of ``subagent serve``: its flags, and the LLM adapter built from them.

``subagent serve --script FILE`` answers with a :class:`~subagent.runtime.ScriptedLlm` (no network,
no keys); ``--base-url URL --model NAME`` with an OpenAI-compatible chat adapter whose key is read
from the environment variable ``--api-key-env`` names. The server itself, which takes an adapter,
is the library's :func:`subagent.serve.serve`; the runtime is imported only when ``serve`` runs.

SIGTERM and SIGHUP close the server as the end of stdin does (every session's agent closed, every
subagent disposed, a private spill directory removed) and then end the process by that same signal, so
whoever started it sees why it ended; a second one while that runs ends it at once. A SIGHUP ignored
when the process started (``nohup``) stays ignored.

The sessions are kept in a run journal (``--journal PATH``, or ``--no-journal`` for none; else
``$SUBAGENT_JOURNAL``, a path or ``off``; else the user's state directory,
:func:`~subagent.journal.default_journal_path`), so a client reopens them after a restart
(``session/load``, ``session/resume``, ``session/list``). The journal is opened before stdin or stdout
is touched: one that cannot be used (not a journal, a newer schema) is bad usage, exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import shlex
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Final

import anyio
import anyio.abc

from subagent.cli._exits import PROG, Command, Parser, UsageError
from subagent.cli._journal import choose_journal
from subagent.journal import JOURNAL_ENV

if TYPE_CHECKING:
    from subagent.delegation._background import BackgroundOptions
    from subagent.journal import RunJournal
    from subagent.runtime._llm import LlmAdapter

__all__ = [
    "DEFAULT_API_KEY_ENV",
    "SERVE_COMMAND",
    "ServeConfigError",
    "build_llm",
    "journal_path",
    "serve_command",
]

logger = logging.getLogger(__name__)

DEFAULT_API_KEY_ENV: Final = "OPENAI_API_KEY"
"""The environment variable the OpenAI-compatible adapter reads its key from unless told otherwise."""

_SERVE_DESCRIPTION: Final = """\
Serve an in-process agent as an ACP agent on stdin/stdout, for an ACP client to spawn: Zed,
`subagent run -- subagent serve ...`, or any other. Each session gets its own agent, which can
delegate to in-process subagents (providers `spawn` and `fork`, and `acp` with --acp) with the
`subagent` tool; a tool call that needs approval is asked about with session/request_permission.
A client that advertises ACP's subagents capability sees each subagent as a session of its own.

The model is a deterministic script (--script FILE: no network, no keys) or an OpenAI-compatible
chat-completions server (--base-url URL --model NAME: OpenAI, DeepSeek, vLLM, Ollama, llama.cpp).
"""

_SERVE_EPILOG: Final = f"""\
the API key:
  read from the environment variable --api-key-env names (default: OPENAI_API_KEY), never
  from the command line; without one no Authorization header is sent (local servers).

scripts (--script):
  a JSON list of replies, or {{"replies": [...], "fallback": reply}}; a reply is a string or
  {{"text", "tool_calls": [{{"name", "arguments", "id"?}}], "finish_reason", "usage", "error",
  "when": {{"last_user_contains", "system_contains", "has_tool", "after_tool_result"}}}}.
  Each reply is used once, the first unused one whose `when` matches; the session's agent
  and its subagents share the script. Details: python -m pydoc subagent.runtime.ScriptedLlm

sessions that outlive the server:
  each session is kept in a run journal (--journal PATH, or --no-journal; default:
  ${JOURNAL_ENV}, a path or 'off'; else the config file's journal key; else
  $XDG_STATE_HOME/subagent/runs.db, by default
  ~/.local/state/subagent/runs.db): after a restart a client lists them (session/list) and
  reopens one (session/resume, or session/load, which replays it) to go on with the
  conversation. `{PROG} runs` lists them too (provider `serve`).

output:
  stdout carries only the protocol; logs go to stderr (-v, -vv for more).

exit status:
  0 when the client closes stdin, once the requests still in flight then are answered (a
  pipe gets every answer); 2 for bad usage or a script that cannot be read. On SIGTERM or
  SIGHUP it closes every session (long answers saved to a private directory go with it),
  then ends by that signal (a shell shows 143 or 129).

examples:
  {PROG} serve --script fixtures/scripts/delegate_to_spawn.json
  {PROG} run -p "Ask a subagent what 6 times 7 is" -- {PROG} serve --script delegate.json
  OPENAI_API_KEY=... {PROG} serve --base-url https://api.openai.com/v1 --model gpt-4.1-mini
"""


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, not {value}")
        return value

    return parse


def _add_serve_arguments(serve: Parser) -> None:
    model = serve.add_mutually_exclusive_group()
    model.add_argument("--script", metavar="FILE", help="answer with this ScriptedLlm JSON script")
    model.add_argument("--base-url", metavar="URL", help="an OpenAI-compatible API root, e.g. .../v1")
    serve.add_argument("--model", metavar="NAME", help="the model name to ask for (with --base-url)")
    serve.add_argument(
        "--api-key-env",
        metavar="VAR",
        help="the environment variable holding the API key (with --base-url; default: OPENAI_API_KEY)",
    )
    serve.add_argument(
        "--persona",
        metavar="TEXT",
        help="the system prompt of every session's agent (default: a short generic one; '' for none)",
    )
    serve.add_argument(
        "--max-model-calls",
        type=_count(1),
        metavar="N",
        # The runtime's default (not imported here: building the parser must stay cheap for every command).
        help="model calls one turn may make before it stops with max_turn_requests (default: 32)",
    )
    serve.add_argument("--no-delegate", action="store_true", help="no subagent tool: the agent works alone")
    serve.add_argument(
        "--depth-limit",
        type=_count(0),
        metavar="N",
        help="each subagent may start at most N levels of subagents below itself (0: none); a larger "
        "depth_limit the model asks for is lowered to N (default: the model decides)",
    )
    serve.add_argument(
        "--no-background",
        action="store_true",
        help="no background delegation: each subagent call waits for its child (no companion tools)",
    )
    serve.add_argument(
        "--max-background",
        type=_count(1),
        metavar="N",
        help="background subagents one agent may have running at once; more are queued (default: 4)",
    )
    serve.add_argument(
        "--spill-bytes",
        type=_count(0),
        metavar="N",
        help="a subagent's answer longer than N bytes is saved to a file and shown by its start and end "
        "(default: 32768; 0: never)",
    )
    serve.add_argument(
        "--acp",
        metavar="COMMAND",
        help="also delegate to this ACP agent command line (split as a shell would; provider `acp`): "
        "its own subagents reach a client that shows subagent sessions; its permission questions are "
        "refused",
    )
    serve.add_argument(
        "--spill-dir",
        metavar="DIR",
        help="where long answers are saved, and kept (default: a private directory removed at exit)",
    )
    serve.add_argument(
        "--journal",
        metavar="PATH",
        help=f"the run journal the sessions are kept in, for clients to reopen after a restart (default: "
        f"${JOURNAL_ENV}, else the config file's journal key, else the user's state directory)",
    )
    serve.add_argument(
        "--no-journal", action="store_true", help="keep no journal: no session outlives the server"
    )


def serve_command(args: argparse.Namespace, command: list[str] | None) -> int:
    """``subagent serve``: check the flags, then serve until the client closes stdin."""
    if command is not None:
        raise UsageError("serve takes no `-- COMMAND`: it is the agent")
    if args.script is None and args.base_url is None:
        raise UsageError("no model: give --script FILE, or --base-url URL and --model NAME")
    if args.base_url is not None and not args.model:
        raise UsageError("--base-url needs --model NAME")
    if args.base_url is None and (args.model is not None or args.api_key_env is not None):
        raise UsageError("--model and --api-key-env go with --base-url (a script needs neither)")
    if args.no_delegate and args.depth_limit is not None:
        raise UsageError("--depth-limit limits delegation; it has no meaning with --no-delegate")
    if args.acp is not None and args.no_delegate:
        raise UsageError("--acp is a provider to delegate to; it has no meaning with --no-delegate")
    acp_command = _acp_command(args.acp)
    tuning = [
        flag
        for flag, value in (
            ("--max-background", args.max_background),
            ("--spill-bytes", args.spill_bytes),
            ("--spill-dir", args.spill_dir),
        )
        if value is not None
    ]
    if tuning and (args.no_delegate or args.no_background):
        off = "--no-delegate" if args.no_delegate else "--no-background"
        raise UsageError(f"{tuning[0]} tunes background delegation; it has no meaning with {off}")
    api_key_env = args.api_key_env or DEFAULT_API_KEY_ENV
    if args.base_url is not None and api_key_env not in os.environ:
        logger.info("%s is not set: requests go without an API key", api_key_env)
    if sys.stdin is not None and sys.stdin.isatty():
        sys.stderr.write(
            f"{PROG} serve: speaking ACP on stdin/stdout, for an ACP client to drive; Ctrl-D ends\n"
        )
        sys.stderr.flush()
    if args.journal is not None and args.no_journal:
        raise UsageError("give either --journal PATH or --no-journal, not both")
    journal = journal_path(args.journal, off=args.no_journal)
    try:
        stopped_by = anyio.run(_build_and_serve, args, api_key_env, acp_command, journal)
    except ServeConfigError as exc:
        raise UsageError(str(exc)) from exc
    if stopped_by is not None:
        _end_by(stopped_by)
        return 128 + stopped_by  # only if the signal could not end the process
    return 0


def journal_path(option: str | None, *, off: bool = False) -> Path | None:
    """The journal ``serve`` keeps (None: none), chosen as every command chooses it
    (:func:`~subagent.cli._journal.choose_journal`): ``--journal`` (``option``), none for ``--no-journal``
    (``off``), else ``$SUBAGENT_JOURNAL`` (a path, ``off`` for none), else the config file's ``journal``
    key, else the default path."""
    choice = choose_journal(option, off)
    return None if choice.path is None else Path(choice.path)


async def _open_journal(path: Path | None) -> RunJournal | None:
    """The journal at ``path`` opened (None: none), off the event loop.

    Raises:
        ServeConfigError: it cannot be used (not a journal, a newer schema, not writable).
    """
    if path is None:
        return None
    from subagent.journal import JournalError, RunJournal

    try:
        return await anyio.to_thread.run_sync(RunJournal.open, path)
    except JournalError as exc:
        raise ServeConfigError(str(exc)) from exc


def _acp_command(text: str | None) -> list[str] | None:
    """``--acp``'s command line as argv (None without it)."""
    if text is None:
        return None
    try:
        argv = shlex.split(text)
    except ValueError as exc:
        raise UsageError(f"--acp: not a command line: {exc}") from exc
    if not argv:
        raise UsageError("--acp needs a command")
    return argv


async def _build_and_serve(
    args: argparse.Namespace,
    api_key_env: str,
    acp_command: list[str] | None = None,
    journal_at: Path | None = None,
) -> signal.Signals | None:
    """Build the LLM the flags describe and open the journal at ``journal_at`` (both checked before
    stdin or stdout is touched), serve on them until the client closes stdin or a stopping signal
    comes, and close them at the end. Returns the signal that stopped it, if one did."""
    # Imported here: the other commands do not need the in-process runtime.
    from subagent.runtime._inprocess_agent import DEFAULT_MAX_MODEL_CALLS
    from subagent.serve import serve
    from subagent.types import SubagentProvider

    providers: list[SubagentProvider] = []
    if acp_command is not None:
        from subagent.providers.acp import AcpProvider

        # Refused: a served agent cannot yet pass an acp child's question up to its own client.
        providers.append(AcpProvider(acp_command, permission="deny"))

    llm = build_llm(script=args.script, base_url=args.base_url, model=args.model, api_key_env=api_key_env)
    stopped_by: list[signal.Signals] = []
    async with contextlib.AsyncExitStack() as stack:
        aclose = getattr(llm, "aclose", None)
        if aclose is not None:
            stack.push_async_callback(aclose)
        journal = await _open_journal(journal_at)
        if journal is not None:
            # Closed last (commits what is queued): the sessions and the service write to it until then.
            stack.push_async_callback(anyio.to_thread.run_sync, journal.close)
        async with anyio.create_task_group() as task_group:
            await task_group.start(_stop_on_signals, task_group.cancel_scope, stopped_by)
            # Cancelled by a signal, serve() still closes every session and the service (shielded) on
            # its way out: that is what removes the spill directory and ends the subagents.
            await serve(
                llm,
                persona=args.persona,
                max_model_calls=args.max_model_calls or DEFAULT_MAX_MODEL_CALLS,
                delegate=not args.no_delegate,
                depth_limit=args.depth_limit,
                background=None if args.no_background or args.no_delegate else _background_options(args),
                providers=providers,
                journal=journal,
            )
            task_group.cancel_scope.cancel()  # stdin ended: stop listening
    return stopped_by[0] if stopped_by else None


async def _stop_on_signals(
    scope: anyio.CancelScope,
    stopped_by: list[signal.Signals],
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """On the first SIGTERM or SIGHUP, note it in ``stopped_by`` and cancel ``scope`` (the serving).
    This task is in that scope: its end gives the signals back their default action, so a second one
    during the close ends the process at once."""
    wanted = [signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:
        wanted.append(signal.SIGHUP)
    with anyio.open_signal_receiver(*wanted) as signals:
        task_status.started()
        async for signum in signals:
            logger.info("%s received: closing every session", signal.Signals(signum).name)
            stopped_by.append(signal.Signals(signum))
            scope.cancel()
            return


def _end_by(signum: signal.Signals) -> None:
    """End this process by ``signum``'s default action, now that it has cleaned up: a shell, a service
    manager or an ACP client sees that it died of that signal, as it would have without the cleanup."""
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _background_options(args: argparse.Namespace) -> BackgroundOptions:
    """The background options the flags ask for, the library's defaults for the rest."""
    from subagent.delegation._background import BackgroundOptions

    options = BackgroundOptions()
    if args.max_background is not None:
        options = dataclasses.replace(options, max_running=args.max_background)
    if args.spill_bytes is not None:
        options = dataclasses.replace(options, spill_bytes=args.spill_bytes or None)  # 0: never
    if args.spill_dir is not None:
        options = dataclasses.replace(options, run_dir=args.spill_dir)
    return options


SERVE_COMMAND: Final = Command(
    help="serve an in-process agent as an ACP agent on stdin/stdout",
    description=_SERVE_DESCRIPTION,
    epilog=_SERVE_EPILOG,
    usage=f"{PROG} serve (--script FILE | --base-url URL --model NAME [--api-key-env VAR]) [OPTIONS]",
    add_arguments=_add_serve_arguments,
    run=serve_command,
    verbose_help="log to stderr: -v sessions opened and closed, -vv protocol detail",
)
"""``subagent serve``, for the command line's table of commands."""


class ServeConfigError(ValueError):
    """The options cannot make an LLM adapter (no script, an unreadable or invalid one, a bad URL)."""


def build_llm(
    *,
    script: str | os.PathLike[str] | None = None,
    base_url: str | None = None,
    model: str | None = None,
    api_key_env: str | None = DEFAULT_API_KEY_ENV,
) -> LlmAdapter:
    """The adapter the options describe: a :class:`~subagent.runtime.ScriptedLlm` read from the
    JSON ``script`` file, or an OpenAI-compatible chat adapter for ``base_url`` and ``model`` whose
    key is read from the environment variable ``api_key_env`` (never passed as a value).

    Raises:
        ServeConfigError: not exactly one of ``script`` and ``base_url``; ``base_url`` without
            ``model``; a script that cannot be read or is not a valid script; an invalid URL.
    """
    if (script is None) == (base_url is None):
        raise ServeConfigError("give either a script file or a base URL and a model name")
    if script is not None:
        from subagent.runtime._scripted import ScriptedLlm

        path = Path(script)
        try:
            return ScriptedLlm.from_file(path)
        except OSError as exc:
            raise ServeConfigError(f"cannot read the script {str(path)!r}: {exc.strerror or exc}") from exc
        except ValueError as exc:
            raise ServeConfigError(f"the script {str(path)!r} is not valid: {exc}") from exc
    assert base_url is not None
    if not model:
        raise ServeConfigError("a base URL needs a model name")
    # Imported here: a scripted server never needs httpx, and starts faster without it.
    from subagent.runtime.openai import OpenAiChatAdapter

    try:
        return OpenAiChatAdapter(model=model, base_url=base_url, api_key_env=api_key_env)
    except ValueError as exc:
        raise ServeConfigError(str(exc)) from exc
