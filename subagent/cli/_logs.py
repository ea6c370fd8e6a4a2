"""Where the command line's log records go: to the view of the turn under way (as text, or as
``log`` events with ``--events``), else to stderr; ``-v`` and ``-vv`` choose how much."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from subagent.cli._exits import PROG

if TYPE_CHECKING:
    from subagent.cli._views import RunView

__all__ = ["LOG_HANDLER", "ViewLogHandler", "configure_logging"]


class ViewLogHandler(logging.Handler):
    """Sends log records to the current view (as text, or as ``log`` events), else to stderr."""

    def __init__(self) -> None:
        super().__init__()
        self.view: RunView | None = None
        """The view of the turn under way, if any."""
        self.setFormatter(logging.Formatter("%(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        """Show ``record`` on the view, or on stderr."""
        try:
            message = self.format(record)
            view = self.view
            if view is not None:
                view.log(record, message)
            else:
                sys.stderr.write(f"{PROG}: {record.levelname.lower()}: {message}\n")
                sys.stderr.flush()
        except Exception:
            self.handleError(record)


LOG_HANDLER: Final = ViewLogHandler()
"""The one handler the command line installs on the root logger while a command runs."""


def configure_logging(verbosity: int) -> Callable[[], None]:
    """Log at WARNING, INFO (``-v``) or DEBUG (``-vv``) through :data:`LOG_HANDLER`; return the undo."""
    root = logging.getLogger()
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    previous_level = root.level
    root.addHandler(LOG_HANDLER)
    root.setLevel(level)

    def restore() -> None:
        root.removeHandler(LOG_HANDLER)
        root.setLevel(previous_level)

    return restore
