"""The one JSON form of an isolated run's workspace, for machines: ``subagent run --json`` and the ``end``
event of ``--events`` write it.

``{"mode", "path", "changed", "branch", "base", "commit", "removed", "files"}``, each file ``{"path",
"added", "deleted"}`` (the counts null for a binary file): :class:`~subagent.types.WorkspaceChange` as it
is, its names kept (they are one word each).
"""

from __future__ import annotations

from typing import Any

from subagent.types import WorkspaceChange

__all__ = ["workspace_to_json"]


def workspace_to_json(change: WorkspaceChange | None) -> dict[str, Any] | None:
    """Where the child worked and what it changed (None: it had no workspace, or never got one)."""
    if change is None:
        return None
    return {
        "mode": change.mode,
        "path": change.path,
        "changed": change.changed,
        "branch": change.branch,
        "base": change.base,
        "commit": change.commit,
        "removed": change.removed,
        "files": [{"path": file.path, "added": file.added, "deleted": file.deleted} for file in change.files],
    }
