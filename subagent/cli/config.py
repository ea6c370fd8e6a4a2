"""Named agents for the command line, read from a TOML file.

``subagent run --agent NAME`` takes the agent's command line and defaults from the first of these
files that exists (they are not merged):

1. the file given with ``--config PATH`` (it must exist);
2. ``./subagent.toml`` in the current directory;
3. ``$XDG_CONFIG_HOME/subagent/config.toml`` (``~/.config/subagent/config.toml`` by default).

The schema, one table per agent under ``[agents]``; only ``command`` is required::

    [agents.claude]
    description = "Claude Code over ACP"          # shown by `subagent agents`
    command = "npx"                               # the program (looked up on PATH)
    args = ["-y", "@agentclientprotocol/claude-agent-acp"]
    env = { ANTHROPIC_LOG = "error" }             # merged over the caller's environment
    cwd = "~/src/project"                         # relative paths: from the file's directory
    permission = "ask"                            # "allow", "deny" or "ask"
    timeout = 600                                 # inactivity timeout of a turn, in seconds
    ready_timeout = 120                           # spawn to a ready session, in seconds
    auth_method = "claude-login"                  # used when the agent demands authentication
    fs = false                                    # offer no fs/* to the agent (default: true)

Every key is checked: an unknown key, a value of the wrong type or an out-of-range number is a
:class:`ConfigError` whose message names the file and the dotted key (``agents.claude.args[1]``).
So is anything that could not reach the agent's process intact: a NUL character (``"\u0000"``)
in the command, an argument, the cwd or an environment value, and an environment name that is
empty or has ``=`` or NUL in it (values are never repeated in the message: they may be secrets).
A file that is not TOML, is nested too deeply to parse (hundreds of levels), or is larger than
1 MiB is a :class:`ConfigError` too. Options given on the command line override the file's
defaults.
"""

from __future__ import annotations

import json
import math
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

__all__ = [
    "AGENT_KEYS",
    "LOCAL_CONFIG_NAME",
    "MAX_CONFIG_BYTES",
    "AgentConfig",
    "Config",
    "ConfigError",
    "PermissionMode",
    "config_search_path",
    "find_config",
    "load_config",
    "parse_config",
    "user_config_path",
]

PermissionMode = Literal["allow", "deny", "ask"]
"""How the command line answers an agent's permission questions."""

LOCAL_CONFIG_NAME: Final = "subagent.toml"
"""The per-directory config file, looked up in the current directory."""

AGENT_KEYS: Final = (
    "description",
    "command",
    "args",
    "env",
    "cwd",
    "permission",
    "timeout",
    "ready_timeout",
    "auth_method",
    "fs",
)
"""The keys an agent table may have, in the order the documentation lists them."""

_PERMISSIONS: Final = ("allow", "deny", "ask")
_NAME: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_BARE_KEY: Final = re.compile(r"^[A-Za-z0-9_-]+$")
MAX_CONFIG_BYTES: Final = 1024 * 1024
"""The largest config file read (a few agents take a few KiB)."""


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and, when it applies, the key."""

    def __init__(self, path: Path | str, message: str, *, key: str | None = None) -> None:
        self.path = Path(path)
        self.key = key
        where = f"{self.path}: {key}" if key is not None else f"{self.path}"
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """One named agent: how to start it and the defaults ``subagent run --agent NAME`` uses."""

    name: str
    command: tuple[str, ...]
    """The full argv: ``command`` followed by ``args``."""
    source: Path
    """The file this agent was read from."""
    description: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    """Absolute (resolved against the file's directory, ``~`` expanded), or None."""
    permission: PermissionMode | None = None
    timeout: float | None = None
    ready_timeout: float | None = None
    auth_method: str | None = None
    fs: bool = True
    """Whether the client offers the agent its file system (``fs/read_text_file`` and
    ``fs/write_text_file``); ``fs = false`` is a workaround for an agent whose use of it is broken."""


@dataclass(frozen=True, slots=True)
class Config:
    """The agents of one config file, in file order."""

    path: Path
    agents: Mapping[str, AgentConfig]


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


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a config file.

    Raises:
        ConfigError: the file is unreadable, not TOML, or breaks the schema (the message names the key).
    """
    location = Path(path)
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
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(location, f"not valid TOML: {exc}") from None
    except RecursionError:
        # tomllib parses nested arrays and inline tables recursively: a few hundred levels exhaust
        # the interpreter's stack before the file is found wrong.
        raise ConfigError(location, "not valid TOML: arrays or tables nested too deeply") from None
    return parse_config(data, location)


def parse_config(data: Mapping[str, Any], path: str | os.PathLike[str]) -> Config:
    """Validate already-parsed TOML ``data`` as the config file ``path`` (used to name errors and to
    resolve relative ``cwd`` values).

    Raises:
        ConfigError: the data breaks the schema.
    """
    location = Path(path)
    unknown = [key for key in data if key != "agents"]
    if unknown:
        raise ConfigError(location, "unknown key (the only top-level table is [agents])", key=unknown[0])
    agents_table = data.get("agents", {})
    if not isinstance(agents_table, Mapping):
        raise ConfigError(location, "must be a table of agents, e.g. [agents.NAME]", key="agents")
    agents: dict[str, AgentConfig] = {}
    for name, table in agents_table.items():
        key = f"agents.{name}"
        if not _NAME.match(name):
            raise ConfigError(
                location,
                "an agent name uses letters, digits, '_', '-' and '.', and starts with a letter or digit",
                key=key,
            )
        if not isinstance(table, Mapping):
            raise ConfigError(location, "must be a table, e.g. [agents.NAME] with a `command`", key=key)
        agents[name] = _parse_agent(name, table, location)
    return Config(path=location, agents=agents)


def _parse_agent(name: str, table: Mapping[str, Any], path: Path) -> AgentConfig:
    prefix = f"agents.{name}"
    for key in table:
        if key not in AGENT_KEYS:
            raise ConfigError(
                path, f"unknown key (known keys: {', '.join(AGENT_KEYS)})", key=f"{prefix}.{key}"
            )
    if "command" not in table:
        raise ConfigError(path, 'missing: the program to run, e.g. command = "npx"', key=f"{prefix}.command")
    program = _no_nul(
        _string(table["command"], path, f"{prefix}.command", non_empty=True), path, f"{prefix}.command"
    )
    args = [
        _no_nul(arg, path, f"{prefix}.args[{index}]")
        for index, arg in enumerate(_strings(table.get("args", []), path, f"{prefix}.args"))
    ]
    env_value = table.get("env", {})
    if not isinstance(env_value, Mapping):
        raise ConfigError(
            path, 'must be a table of strings, e.g. env = { KEY = "value" }', key=f"{prefix}.env"
        )
    env: dict[str, str] = {}
    for name, value in env_value.items():
        key = f"{prefix}.env.{_key_text(name)}"
        if not name or "=" in name or "\0" in name:
            raise ConfigError(
                path, "an environment name must be non-empty, with no '=' and no NUL character", key=key
            )
        env[name] = _no_nul(_string(value, path, key), path, key)
    cwd: str | None = None
    if "cwd" in table:
        raw_cwd = _no_nul(_string(table["cwd"], path, f"{prefix}.cwd", non_empty=True), path, f"{prefix}.cwd")
        raw_cwd = os.path.expanduser(raw_cwd)
        cwd = os.path.normpath(os.path.join(path.resolve().parent, raw_cwd))
    permission: PermissionMode | None = None
    if "permission" in table:
        value = table["permission"]
        if value not in _PERMISSIONS:
            raise ConfigError(
                path,
                f"must be one of {', '.join(map(repr, _PERMISSIONS))}, not {value!r}",
                key=f"{prefix}.permission",
            )
        permission = value
    return AgentConfig(
        name=name,
        command=(program, *args),
        source=path,
        description=_optional_string(table, "description", path, prefix),
        env=env,
        cwd=cwd,
        permission=permission,
        timeout=_optional_seconds(table, "timeout", path, prefix),
        ready_timeout=_optional_seconds(table, "ready_timeout", path, prefix),
        auth_method=_optional_string(table, "auth_method", path, prefix, non_empty=True),
        fs=_optional_bool(table, "fs", path, prefix, default=True),
    )


def _string(value: Any, path: Path, key: str, *, non_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise ConfigError(path, f"must be a string, not {_toml_type(value)}", key=key)
    if non_empty and not value.strip():
        raise ConfigError(path, "must not be empty", key=key)
    return value


def _no_nul(value: str, path: Path, key: str) -> str:
    # A C string ends at NUL: the program would get a cut-short argument, variable or path.
    if "\0" in value:
        raise ConfigError(path, "contains a NUL character, which no program can receive", key=key)
    return value


def _key_text(name: str) -> str:
    """A table key as TOML would write it: bare when it can be, else quoted (escapes shown)."""
    return name if _BARE_KEY.match(name) else json.dumps(name)


def _strings(value: Any, path: Path, key: str) -> list[str]:
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise ConfigError(path, f"must be an array of strings, not {_toml_type(value)}", key=key)
    return [_string(item, path, f"{key}[{index}]") for index, item in enumerate(value)]


def _optional_string(
    table: Mapping[str, Any], name: str, path: Path, prefix: str, *, non_empty: bool = False
) -> str | None:
    if name not in table:
        return None
    return _string(table[name], path, f"{prefix}.{name}", non_empty=non_empty)


def _optional_bool(table: Mapping[str, Any], name: str, path: Path, prefix: str, *, default: bool) -> bool:
    if name not in table:
        return default
    value = table[name]
    if not isinstance(value, bool):
        raise ConfigError(path, f"must be true or false, not {_toml_type(value)}", key=f"{prefix}.{name}")
    return value


def _optional_seconds(table: Mapping[str, Any], name: str, path: Path, prefix: str) -> float | None:
    if name not in table:
        return None
    value = table[name]
    key = f"{prefix}.{name}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(path, f"must be a number of seconds, not {_toml_type(value)}", key=key)
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(path, f"must be a positive number of seconds, not {value!r}", key=key)
    return float(value)


def _toml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return f"a number ({value!r})"
    if isinstance(value, str):
        return f"a string ({value!r})"
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, Sequence):
        return "an array"
    return f"a {type(value).__name__}"  # dates and times
