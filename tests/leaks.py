"""The leak checker, public in `subagent.testing`; re-exported so the tests import it unchanged."""

from subagent.testing import (
    LEAK_TAG_VARIABLE,
    ProcessInfo,
    assert_no_leaks,
    leaked_processes,
    live_group_members,
    open_fd_count,
    open_fds,
    process_info,
    process_is_gone,
)

__all__ = [
    "LEAK_TAG_VARIABLE",
    "ProcessInfo",
    "assert_no_leaks",
    "leaked_processes",
    "live_group_members",
    "open_fd_count",
    "open_fds",
    "process_info",
    "process_is_gone",
]
