"""Finding and reading the command line's config file, and its top-level ``journal`` key: the part of
:mod:`subagent.cli._config` that commands which need no agent (``subagent runs``) use, kept apart so they
load neither the options table nor msgspec.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Literal

from subagent.cli._exits import ConfigError

__all__ = [
    "JOURNAL_KEY_EXPECTED",
    "LOCAL_CONFIG_NAME",
    "MAX_CONFIG_BYTES",
    "config_search_path",
    "find_config",
    "journal_key",
    "read_config_data",
    "user_config_path",
]

LOCAL_CONFIG_NAME: Final = "subagent.toml"
"""The per-directory config file, looked up in the current directory."""

MAX_CONFIG_BYTES: Final = 1024 * 1024
"""The largest config file read (a few agents take a few KiB)."""

JOURNAL_KEY_EXPECTED: Final = 'a path to the run journal (a string, e.g. "runs.db") or false'
"""What the top-level ``journal`` key must be, in the words of an error."""


def user_config_path(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CONFIG_HOME/subagent/config.toml``, or ``~/.config/subagent/config.toml``."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CONFIG_HOME") or ""
    root = Path(base) if os.path.isabs(base) else Path(env.get("HOME") or Path.home()) / ".config"
    return root / "subagent" / "config.toml"


def config_search_path(
    cwd: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> list[Path]:
    """Where a config is looked for when no ``--config`` is given, in order."""
    here = Path(cwd) if cwd is not None else Path.cwd()
    return [here / LOCAL_CONFIG_NAME, user_config_path(environ)]


def find_config(
    explicit: str | os.PathLike[str] | None = None,
    *,
    cwd: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Path | None:
    """The config file to use: ``explicit`` (which must exist), else the first of
    :func:`config_search_path` that exists, else None.

    Raises:
        ConfigError: ``explicit`` does not exist or is not a file.
    """
    if explicit is not None:
        path = Path(explicit)
        if not path.is_file():
            raise ConfigError(path, "no such config file" if not path.exists() else "not a file")
        return path
    for candidate in config_search_path(cwd, environ):
        if candidate.is_file():
            return candidate
    return None


def read_config_data(location: Path) -> dict[str, Any]:
    """The config file at ``location`` as parsed TOML, before any check of its keys.

    Raises:
        ConfigError: the file is unreadable, larger than :data:`MAX_CONFIG_BYTES`, not UTF-8 or not TOML.
    """
    try:
        with location.open("rb") as file:
            raw = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(location, f"cannot read the config file: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(location, f"the config file is larger than {MAX_CONFIG_BYTES // (1024 * 1024)} MiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(location, f"the config file is not UTF-8 ({exc.reason})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(location, f"not valid TOML: {exc}") from None
    except RecursionError:
        # tomllib parses nested arrays and inline tables recursively: a few hundred levels exhaust
        # the interpreter's stack before the file is found wrong.
        raise ConfigError(location, "not valid TOML: arrays or tables nested too deeply") from None


def journal_key(value: Any, location: Path) -> str | Literal[False] | None:
    """The top-level ``journal`` key of the config file at ``location``, checked: a path (relative to the
    file's directory, ``~`` expanded) made absolute, False (no journal), or None (absent, or ``true``:
    the default journal).

    Raises:
        ConfigError: the value is neither a non-empty string without NUL nor a boolean.
    """
    if value is None or value is True:
        return None
    if value is False:
        return False
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        raise ConfigError(location, f"must be {JOURNAL_KEY_EXPECTED}", key="journal")
    return os.path.normpath(location.resolve().parent / os.path.expanduser(value))
