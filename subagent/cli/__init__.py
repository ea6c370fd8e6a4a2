"""The ``subagent`` command line (``subagent.cli:main``, also ``python -m subagent``)."""

from __future__ import annotations

from subagent.cli.main import main

__all__ = ["main"]
