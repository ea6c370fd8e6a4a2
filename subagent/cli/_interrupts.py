"""Signals during a turn: the first Ctrl-C cancels the turn, a second one (or SIGTERM, SIGHUP) tears
the agent down at once, even mid-teardown. See :class:`Interrupts`."""

from __future__ import annotations

import logging
import signal
from typing import Final

import anyio
import anyio.abc

from subagent.cli._views import RunView
from subagent.providers.acp import AcpRun
from subagent.service import ServiceRun

__all__ = ["Interrupts"]

logger = logging.getLogger(__name__)


class Interrupts:
    """Turns signals into actions on the run: the first SIGINT cancels the turn; a second SIGINT,
    SIGTERM or SIGHUP (or any signal once a teardown is under way) kills the agent's whole process
    tree at once (SIGKILL through its supervisor; on another host, SIGTERM then SIGKILL a second
    later, from its supervisor there) and then disposes of the run, so no grace period is waited
    out, not even one a teardown under way is in. Signals before the run exists are kept for it."""

    SIGNALS: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, view: RunView, task_group: anyio.abc.TaskGroup) -> None:
        self.view = view
        self.count = 0
        self._task_group = task_group
        self._run: ServiceRun | None = None
        self._pending: str | None = None
        self._cancelling = False
        self.stopped_by: str | None = None
        """What tore the agent down at once: "a second SIGINT", "SIGTERM" or "SIGHUP"."""

    async def watch(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        with anyio.open_signal_receiver(*self.SIGNALS) as signals:
            task_status.started()
            async for signum in signals:
                self._on_signal(signal.Signals(signum))

    def attach(self, run: ServiceRun) -> None:
        self._run = run
        if self._pending is not None:
            self._act(self._pending)

    def _on_signal(self, signum: signal.Signals) -> None:
        self.count += 1
        if self.stopped_by is not None:
            # Insisting while a teardown runs: no grace is left to wait out.
            logger.debug("%s received (%d so far) during teardown: killing", signum.name, self.count)
            self._kill_now()
            return
        action = "cancel" if signum == signal.SIGINT and not self._cancelling else "stop"
        if action == "cancel":
            self._cancelling = True
        else:
            self.stopped_by = f"a second {signum.name}" if signum == signal.SIGINT else signum.name
        logger.debug("%s received (%d so far): %s", signum.name, self.count, action)
        self.view.interrupted(signum.name, self.count, action)
        if self._run is None:
            self._pending = action
        else:
            self._act(action)

    def _act(self, action: str) -> None:
        run = self._run
        assert run is not None
        if action == "stop":
            # A second Ctrl-C, SIGTERM or SIGHUP all mean "stop now": whatever grace a first Ctrl-C
            # started is over, and none is waited out (a graceful teardown of an agent that ignores
            # its stdin's end and SIGTERM takes seconds, which a service manager's SIGTERM or a closed
            # terminal's SIGHUP would wait on).
            self._kill_now()
        self._task_group.start_soon(run.cancel if action == "cancel" else run.dispose)

    def _kill_now(self) -> None:
        """SIGKILL the agent's whole tree, if it has one yet; a teardown under way then finds it gone
        at its next look (within ~50 ms) instead of waiting out its grace. Idempotent."""
        run = self._run
        if run is None:
            return  # the start is abandoned by dispose() once the run exists (see attach)
        acp_run = run.provider_run
        assert isinstance(acp_run, AcpRun)
        acp_run.kill()
