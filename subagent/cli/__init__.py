"""The ``subagent`` command line: run one prompt through an ACP agent, try the bundled stub agent,
list configured agents, serve an in-process agent over ACP, list the runs of the run journal and resume
one that did not complete.

Every turn goes through :class:`~subagent.service.SubagentService` and
:class:`~subagent.providers.acp.AcpProvider`, so the command line uses the seam exactly as a
library caller would. ``subagent --help`` and ``subagent run --help`` document the behaviour;
the summary:

* exit status 0 when the turn completed, 1 for any other stop reason (Ctrl-C included), 2 for bad
  usage or an agent that failed to start (with one paragraph on stderr naming the command, its
  exit status and the tail of its stderr);
* stdout carries only the answer (or, with ``--json``, exactly one JSON object); progress,
  ``--events`` lines, permission prompts and diagnostics go to stderr;
* the first Ctrl-C cancels the turn (``session/cancel``, then the provider's grace and teardown),
  a second one SIGKILLs the agent's whole process tree at once, even mid-teardown (on another host:
  SIGTERM, then SIGKILL a second later, from its supervisor there); SIGTERM and
  SIGHUP do the same as a second Ctrl-C (no grace is waited out);
* every run is recorded in a run journal (``--journal``, ``SUBAGENT_JOURNAL``, the config's
  ``journal``, else ``$XDG_STATE_HOME/subagent/runs.db``), which ``subagent runs`` lists and
  ``subagent resume`` continues a run from.

The package, one job per module::

    _main.py               the table of commands, the parser, main(): argv to a command, failures to statuses;
                           a command's module is loaded only when its parser is needed
    _exits.py              a command's row (Command), exit statuses, the errors that end a command with 2
    _commands.py           the commands run, demo and agents: options to a turn, its outcome printed
    _journal.py            which run journal a command keeps (--journal, SUBAGENT_JOURNAL, config, default)
    _runs_command.py       the command runs (and runs show): the journal's runs; light, no event loop
    _resume_command.py     the command resume: a journaled run's provider rebuilt, its turn driven as run's
    _options.py            every option of `subagent run`, declared once: flags, config key, type, help, merge
    _describe.py           the command describe: what an agent offers, without a turn
    _worktrees_command.py  the command worktrees: the isolated workspaces recorded, orphans recovered
    _serve_command.py      the command-line half of `subagent serve`: its flags, the LLM built from them
    _recording.py          a run recorded (--events-file, --trace) and the command trace: events to a page
    _turn.py               one turn through the seam: the driver, the start gate, how each ending reads
    _interrupts.py         Ctrl-C, SIGTERM and SIGHUP during a turn: cancel, then tear down at once
    _views.py              what a run shows on stderr: live progress for a person, or JSON events
    _run_tree.py           the tree of runs below the agent, as the live view draws it
    _tool_call_tracker.py  the turn's tool calls, merged from session updates (a bounded number)
    _permission.py         answering permission questions: allow, deny, or ask a person on a terminal
    _console.py            the two streams: stderr for people (sanitized, coloured on a terminal), stdout
    _logs.py               log records to the current view, else stderr; -v and -vv
    _config.py             named agents from a TOML file, its schema as typed structs made from the options
    _config_file.py        finding and reading the config file, its top-level journal key (no msgspec)
    _demo.py               the demo's second half: an in-process agent delegating to fork, spawn and acp
"""

from __future__ import annotations

from subagent.cli._main import main

__all__ = ["main"]
