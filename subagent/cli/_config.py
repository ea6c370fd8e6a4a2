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
    additional_directories = ["../shared"]        # more roots (ACP additionalDirectories), like cwd
    permission = "ask"                            # "allow", "deny" or "ask"
    timeout = 600                                 # inactivity timeout of a turn, in seconds
    ready_timeout = 120                           # spawn to a ready session, in seconds
    max_tokens = 200000                           # the run's budget: input plus output tokens,
    max_cost = 2.5                                # its cost, wall time, tool calls and model
    max_seconds = 900                             # calls (as --max-*: the run and its subagents
    max_tool_calls = 200                          # together; over one: stop reason "budget")
    max_turns = 50
    reports_usage = ["tokens"]                    # what the agent reports: "tokens", "cost"
    isolation = "worktree"                        # its own git worktree ("copy": a copy of the cwd)
    cleanup = "keep"                              # "remove" (default), "keep", "remove-always"
    worktree_root = "../worktrees"                # where workspaces are made (a path, like cwd)
    branch_prefix = "agent/"                      # the branch: the prefix, then the run id
    auth_method = "claude-login"                  # used when the agent demands authentication
    fs = false                                    # offer no fs/* to the agent (default: true)
    subagents = false                             # do not advertise ACP subagents (default: true)
    mode = "default"                              # the session mode to switch to (session/set_mode)
    config_options = { model = "fast", thinking = true }  # session config options to set
    transport = "ssh://build-1"                   # where it runs (default: "local"); see below
    ssh_config = "ssh/build.conf"                 # over ssh://: ssh's config file (ssh -F)
    ssh_options = ["ConnectTimeout=20"]           # over ssh://: more ssh -o options

Three more tables hold for every agent of the file: ``[budget]``, caps any agent's run gets unless its
own table (or a flag) sets that cap; ``[isolation]``, the same for the keys of its workspace
(``isolation``, ``cleanup``, ``worktree_root``, resolved from the file's directory, and
``branch_prefix``); and ``[prices]``, what each model's tokens cost, per million, for ``max_cost`` over
an agent that reports its tokens but no cost (a model is found by its name, else by the longest name it
starts with)::

    [budget]
    max_cost = 5.0
    max_seconds = 1800

    [isolation]
    isolation = "worktree"
    cleanup = "keep"

    [prices]
    currency = "USD"                              # the currency of every price (default: USD)

    [prices."claude-sonnet-4-5"]
    input = 3.0                                   # per million input tokens
    output = 15.0
    cached_read = 0.3                             # cached reads and writes (default: input's price)
    cached_write = 3.75

One key stands alone at the top of the file, before any table: ``journal``, the run journal that every
command which runs agents records them in (``subagent runs`` lists them): a path, relative to the file's
directory (``~`` expanded), or ``false`` for none (default: ``$XDG_STATE_HOME/subagent/runs.db``; the
``--journal PATH`` and ``--no-journal`` flags, then the ``SUBAGENT_JOURNAL`` environment variable, come
first; see :mod:`subagent.cli._journal`)::

    journal = "~/.local/state/subagent/work-runs.db"

Every key but ``description``, ``command`` and ``args`` sets the ``subagent run`` option of the same name,
and is declared with it in :data:`subagent.cli._options.RUN_OPTIONS` (its type, and the words of its
errors). The schema is built from that as typed structs (:data:`ConfigFile`, :data:`AgentTable`) that
msgspec checks every key against: an unknown key, a value of the wrong type or an out-of-range number is a
:class:`ConfigError` whose message names the file and the dotted key (``agents.claude.args[1]``).
So is anything that could not reach the agent's process intact: a NUL character (``"\u0000"``)
in the command, an argument, the cwd or an environment value, and an environment name that is
empty or has ``=`` or NUL in it (values are never repeated in the message: they may be secrets).
A file that is not TOML, is nested too deeply to parse (hundreds of levels), or is larger than
1 MiB is a :class:`ConfigError` too. Options given on the command line override the file's
defaults (``--add-dir``, ``--set`` and ``--ssh-option`` add to theirs).

``transport`` is a URL for :func:`subagent.acp.transports.transport_from_url` (``local``,
``ssh://[user@]host[:port]``): the agent then runs there, ``command`` and ``cwd`` name a program
and a directory on that host (``cwd`` then absolute, and taken as written), and a remote agent is
offered no fs and no terminals (it reads and writes files itself). A URL that names no available
transport is a :class:`ConfigError` for its key. An agent on ``ssh://`` may name the ssh client's
config file (``ssh_config``, relative to the file's directory, ``~`` expanded: read instead of
``~/.ssh/config``) and more ``-o`` options (``ssh_options``); either is a :class:`ConfigError` for
an agent that does not run over SSH.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import msgspec

from subagent.budget import Price, PriceTable
from subagent.cli._config_file import (
    LOCAL_CONFIG_NAME,
    MAX_CONFIG_BYTES,
    config_search_path,
    find_config,
    journal_key,
    read_config_data,
    user_config_path,
)
from subagent.cli._exits import ConfigError
from subagent.cli._options import (
    BUDGET_OPTIONS,
    ISOLATION_OPTIONS,
    OPTION_KEYS,
    RUN_OPTIONS,
    Argument,
    ConfigKey,
    Program,
)

__all__ = [
    "AGENT_KEYS",
    "LOCAL_CONFIG_NAME",
    "MAX_CONFIG_BYTES",
    "AgentConfig",
    "AgentTable",
    "Config",
    "ConfigError",
    "ConfigFile",
    "config_search_path",
    "find_config",
    "load_config",
    "parse_config",
    "user_config_path",
]

# -- the schema ------------------------------------------------------------------------------------------

AgentName = Annotated[str, msgspec.Meta(pattern=r"\A[A-Za-z0-9][A-Za-z0-9_.-]*\Z")]
"""An agent's name: letters, digits, ``_``, ``-`` and ``.``, starting with a letter or digit."""


class _Agent(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The keys of an ``[agents.NAME]`` table that say which agent it is; :data:`AgentTable` adds the rest."""

    description: str | None = None
    command: Program
    args: list[Argument] = msgspec.field(default_factory=list)


AgentTable: Final = msgspec.defstruct(
    "AgentTable",
    [(name, key.type | msgspec.UnsetType, msgspec.UNSET) for name, key in OPTION_KEYS.items()],
    bases=(_Agent,),
    module=__name__,
    kw_only=True,
    forbid_unknown_fields=True,
)
"""One ``[agents.NAME]`` table as written (see the module docstring): the agent's own keys, then a key for
each option that has one (:data:`~subagent.cli._options.OPTION_KEYS`), unset where the file sets none."""

Agents: Final = dict[AgentName, AgentTable]  # type: ignore[valid-type]  # a type made at run time
"""The ``[agents]`` table: agents by name, in file order."""

ConfigFile: Final = msgspec.defstruct(
    "ConfigFile",
    [("agents", Agents, msgspec.field(default_factory=dict))],
    module=__name__,
    forbid_unknown_fields=True,
)
"""A whole config file as written: its only table is ``[agents]``."""

AGENT_KEYS: Final[tuple[str, ...]] = AgentTable.__struct_fields__
"""The keys an agent table may have, in the order the documentation lists them."""

_NAMED_TABLES: Final[Mapping[str, Any]] = {
    "agents": Agents,
    **{
        f"agents.*.{name}": key.type
        for name, key in OPTION_KEYS.items()
        if typing.get_origin(key.type) is dict
    },
}
"""The tables keyed by names, by their place in the schema: an error inside one names no key, so the
entry it is about is found by checking each entry alone against the table's type."""


def _item_place(name: str, key: ConfigKey) -> str:
    """Where an item of the key ``name``'s array or table is in the schema."""
    return f"agents.*.{name}" + ("[]" if typing.get_origin(key.type) is list else ".*")


_EXPECTED: Final[Mapping[str, str]] = {
    "agents": "a table of agents, e.g. [agents.NAME]",
    "agents.*": "a table, e.g. [agents.NAME] with a `command`",
    "agents.*.description": "a string",
    "agents.*.command": "a string",
    "agents.*.args": "an array of strings",
    "agents.*.args[]": "a string",
    **{f"agents.*.{name}": key.expected for name, key in OPTION_KEYS.items()},
    **{_item_place(name, key): key.item for name, key in OPTION_KEYS.items() if key.item is not None},
}
"""What each key must be, by its place in the schema (``*`` any table key, ``[]`` any array item):
the words of an error message, where msgspec's own would name Python types."""

_BAD_NAME: Final[Mapping[str, str]] = {
    "agents.*": "an agent name uses letters, digits, '_', '-' and '.', and starts with a letter or digit",
    **{_item_place(name, key): key.bad_name for name, key in OPTION_KEYS.items() if key.bad_name is not None},
}
"""What is wrong with a table key its pattern refused, by the key's place in the schema."""


@dataclass(frozen=True, slots=True, init=False)
class AgentConfig:
    """One named agent: how to start it, and the options its table sets for ``subagent run --agent NAME``.

    An option's value reads as an attribute too (``agent.cwd``): the table's, else the option's default.
    """

    name: str
    command: tuple[str, ...]
    """The full argv: ``command`` followed by ``args``."""
    source: Path
    """The file this agent was read from."""
    description: str | None
    options: Mapping[str, Any]
    """The options the table sets, by key (:data:`~subagent.cli._options.OPTION_KEYS`): as written, but
    arrays as tuples and paths resolved as their :class:`~subagent.cli._options.ConfigKey` says."""

    def __init__(
        self,
        name: str,
        command: tuple[str, ...],
        source: Path,
        description: str | None = None,
        **options: Any,
    ) -> None:
        unknown = options.keys() - OPTION_KEYS.keys()
        if unknown:
            raise TypeError(f"not an option of an agent: {', '.join(sorted(unknown))}")
        for attribute, value in zip(
            ("name", "command", "source", "description", "options"),
            (name, command, source, description, options),
            strict=True,
        ):
            object.__setattr__(self, attribute, value)

    def __getattr__(self, key: str) -> Any:
        # Called only for a name that is no attribute: an option, as the table leaves it.
        option = next((option for option in RUN_OPTIONS if option.name == key and option.config), None)
        if option is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {key!r}")
        return option.merged(None, self.options.get(key))


@dataclass(frozen=True, slots=True)
class Config:
    """The agents of one config file, in file order, and the budget and prices its runs share."""

    path: Path
    agents: Mapping[str, AgentConfig]
    budget: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The ``[budget]`` table: a cap for every agent's run by option name (``max_tokens``...), under an
    agent's own key of that name and the flag."""
    isolation: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The ``[isolation]`` table: how every agent's run is isolated, by option name (``isolation``,
    ``cleanup``, ``worktree_root``, ``branch_prefix``), under an agent's own key of that name and the flag."""
    prices: PriceTable | None = None
    """The ``[prices]`` table: what each model's tokens cost, for ``max_cost`` over an agent that reports
    tokens but no cost (None: the file has none)."""
    journal: str | Literal[False] | None = None
    """The top-level ``journal`` key: the run journal's path (absolute), False for none, None when the
    file leaves it to the default."""


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a config file.

    Raises:
        ConfigError: the file is unreadable, not TOML, or breaks the schema (the message names the key).
    """
    location = Path(path)
    return parse_config(read_config_data(location), location)


def parse_config(data: Mapping[str, Any], path: str | os.PathLike[str]) -> Config:
    """Validate already-parsed TOML ``data`` as the config file ``path`` (used to name errors and to
    resolve relative ``cwd`` values).

    Raises:
        ConfigError: the data breaks the schema.
    """
    location = Path(path)
    data = dict(data)
    # Checked by hand, before the agents: their errors name their keys as the agents' do.
    journal = journal_key(data.pop("journal", None), location)
    budget = _budget_table(data.pop("budget", {}), location)
    isolation = _isolation_table(data.pop("isolation", {}), location)
    prices = _price_table(data.pop("prices", None), location)
    try:
        agents = msgspec.structs.asdict(msgspec.convert(data, ConfigFile, strict=True))["agents"]
    except msgspec.ValidationError as exc:
        key, message = _explain(str(exc), data)
        raise ConfigError(location, message, key=key) from None
    tables = {name: msgspec.structs.asdict(table) for name, table in agents.items()}
    remote = {name for name, table in tables.items() if _is_remote(location, name, table)}
    return Config(
        path=location,
        agents={
            name: _agent_config(name, table, location, remote=name in remote)
            for name, table in tables.items()
        },
        budget=budget,
        isolation=isolation,
        prices=prices,
        journal=journal,
    )


def _budget_table(table: Any, location: Path) -> dict[str, Any]:
    """The ``[budget]`` table's caps by option name; ConfigError naming the key that is wrong."""
    return _shared_table(
        table, location, "budget", BUDGET_OPTIONS, "a table of caps, e.g. [budget] max_tokens = 100000"
    )


def _isolation_table(table: Any, location: Path) -> dict[str, Any]:
    """The ``[isolation]`` table's settings by option name (a relative ``worktree_root`` from the file's
    directory); ConfigError naming the key that is wrong."""
    settings = _shared_table(
        table, location, "isolation", ISOLATION_OPTIONS, 'a table, e.g. [isolation] isolation = "worktree"'
    )
    if "worktree_root" in settings:
        root = settings["worktree_root"]
        settings["worktree_root"] = os.path.normpath(location.resolve().parent / os.path.expanduser(root))
    return settings


def _shared_table(
    table: Any, location: Path, name: str, options: tuple[str, ...], example: str
) -> dict[str, Any]:
    """A top-level table of the options ``options`` (values as an agent's keys of those names take
    them) for every agent of the file; ConfigError naming the key that is wrong."""
    if not isinstance(table, Mapping):
        raise ConfigError(location, f"must be {example}, not {_toml_type(table)}", key=name)
    values: dict[str, Any] = {}
    for option, value in table.items():
        key = _key_text([name, option])
        if option not in options:
            raise ConfigError(location, f"unknown key (known keys: {', '.join(options)})", key=key)
        config = OPTION_KEYS[option]
        if isinstance(value, str) and not value.strip():
            raise ConfigError(location, "must not be empty", key=key)
        if _fails(value, config.type):
            shown = (
                repr(value)
                if isinstance(value, int | float) and not isinstance(value, bool)
                else _toml_type(value)
            )
            raise ConfigError(location, f"must be {config.expected}, not {shown}", key=key)
        values[option] = value
    return values


_PRICE_FIELDS: Final = ("input", "output", "cached_read", "cached_write")
"""The keys of a model's price table, per million tokens."""


def _price_table(table: Any, location: Path) -> PriceTable | None:
    """The ``[prices]`` table: ``currency`` (default USD) and one table per model of its prices per
    million tokens; ConfigError naming the key that is wrong."""
    if table is None:
        return None
    if not isinstance(table, Mapping):
        raise ConfigError(
            location,
            f'must be a table of models, e.g. [prices."model-name"], not {_toml_type(table)}',
            key="prices",
        )
    currency = table.get("currency", "USD")
    if not isinstance(currency, str) or not currency.strip() or len(currency) > 16:
        raise ConfigError(
            location,
            f'must be a currency\'s name of 1 to 16 characters, e.g. "USD", not {_toml_type(currency)}',
            key="prices.currency",
        )
    prices: dict[str, Price] = {}
    for model, fields in table.items():
        if model == "currency":
            continue
        where = ["prices", model]
        if not isinstance(fields, Mapping):
            raise ConfigError(
                location,
                "must be a model's prices per million tokens, e.g. { input = 3.0, output = 15.0 }, "
                f"not {_toml_type(fields)}",
                key=_key_text(where),
            )
        for name, value in fields.items():
            if name not in _PRICE_FIELDS:
                raise ConfigError(
                    location,
                    f"unknown key (known keys: {', '.join(_PRICE_FIELDS)})",
                    key=_key_text([*where, name]),
                )
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
            ):
                shown = (
                    repr(value)
                    if isinstance(value, int | float) and not isinstance(value, bool)
                    else _toml_type(value)
                )
                raise ConfigError(
                    location,
                    f"must be a price per million tokens, a number >= 0, not {shown}",
                    key=_key_text([*where, name]),
                )
        for name in ("input", "output"):
            if name not in fields:
                raise ConfigError(
                    location,
                    "missing: the price per million tokens, e.g. input = 3.0",
                    key=_key_text([*where, name]),
                )
        prices[model] = Price(**{name: float(value) for name, value in fields.items()})
    return PriceTable(prices, currency=currency)


def _agent_config(name: str, table: Mapping[str, Any], source: Path, *, remote: bool) -> AgentConfig:
    """The agent ``name`` of ``source``: its table as written, but for ``command`` with ``args`` as one
    argv, arrays as tuples, and paths resolved (a remote agent's directories taken as written)."""
    directory = source.resolve().parent
    options: dict[str, Any] = {}
    for key, config in OPTION_KEYS.items():
        value = table[key]
        if value is msgspec.UNSET:
            continue
        if isinstance(value, list):
            options[key] = tuple(_resolved(item, config, directory, remote=remote) for item in value)
        else:
            options[key] = _resolved(value, config, directory, remote=remote)
    return AgentConfig(name, (table["command"], *table["args"]), source, table["description"], **options)


def _resolved(value: Any, key: ConfigKey, directory: Path, *, remote: bool) -> Any:
    """``value`` resolved against the file's ``directory`` (``~`` expanded) if it is a path, unless it is a
    directory on the host of a remote agent: that is taken as written (an absolute path there)."""
    if key.paths is None or (key.paths == "agent" and remote):
        return value
    return os.path.normpath(directory / os.path.expanduser(value))


def _is_remote(location: Path, agent: str, table: Mapping[str, Any]) -> bool:
    """Whether the agent runs where this host's files are not; ConfigError for a transport URL that
    names no transport available here, and for a remote agent's directory that is not absolute."""
    url = table["transport"]
    if url is msgspec.UNSET or url == "local":
        _check_ssh_keys(location, agent, table, "local")
        return False
    # Imported only for a file that names a transport: the process layer is not needed to read one.
    from subagent.acp.transports._schemes import transport_from_url

    try:
        transport = transport_from_url(url)
    except ValueError as exc:
        raise ConfigError(location, str(exc), key=_key_text(["agents", agent, "transport"])) from None
    _check_ssh_keys(location, agent, table, transport.name)
    if transport.local_files:
        return False
    for key, config in OPTION_KEYS.items():
        value = table[key]
        if config.paths != "agent" or value is msgspec.UNSET:
            continue
        places: list[tuple[list[str | int], str]] = (
            [(["agents", agent, key, index], path) for index, path in enumerate(value)]
            if isinstance(value, list)
            else [(["agents", agent, key], value)]
        )
        for keys, path in places:
            if not os.path.isabs(path):
                raise ConfigError(
                    location,
                    "must be an absolute path on the agent's host (its transport runs it elsewhere)",
                    key=_key_text(keys),
                )
    return True


def _check_ssh_keys(location: Path, agent: str, table: Mapping[str, Any], where: str) -> None:
    """ssh's config file and options belong to an agent on ``ssh://`` only."""
    if where.startswith("ssh://"):
        return
    for key, config in OPTION_KEYS.items():
        if config.ssh_only and table[key]:
            raise ConfigError(
                location, f"for an agent on ssh://HOST, not {where}", key=_key_text(["agents", agent, key])
            )


# -- error messages --------------------------------------------------------------------------------------

_WHERE: Final = re.compile(r" - at (`key` in )?`(\$[\w.\[\]]*)`\Z")
"""The end of a msgspec error that says where: a path like ``$.agents[...].args[1]`` (``[...]``
stands for a table key msgspec does not name), after "`key` in" when the key itself was refused."""
_PATH_STEP: Final = re.compile(r"\.(\w+)|\[(\d+)\]|\[(\.\.\.)\]")
"""One step of such a path: a field, an array index, or ``[...]``."""
_ANY_KEY: Final = object()
"""A ``[...]`` step: some key of a table, to be found."""
_BARE_KEY: Final = re.compile(r"\A[A-Za-z0-9_-]+\Z")
"""A key TOML writes without quotes."""


def _explain(error: str, data: Mapping[str, Any]) -> tuple[str | None, str]:
    """The dotted key and the message for msgspec's ``error`` about ``data``."""
    where = _WHERE.search(error)
    what = error[: where.start()] if where else error
    steps: list[Any] = []
    for match in _PATH_STEP.finditer(where.group(2) if where else ""):
        name, index, _ = match.groups()
        steps.append(name if name is not None else int(index) if index is not None else _ANY_KEY)
    refused_key = where is not None and where.group(1) is not None
    if refused_key:
        steps.append(_ANY_KEY)
    try:
        keys, value = _locate(data, steps)
    except (LookupError, TypeError, ValueError):
        return None, error  # a path a key's own text made up (`a - at `$.x`` = 1): msgspec's words
    key, place = _key_text(keys), _schema_place(keys)
    if refused_key:
        return key, _BAD_NAME.get(place, what)
    if what.startswith("Object contains unknown field"):
        known = AGENT_KEYS if keys else ("agents",)
        unknown = next(name for name in value if name not in known)
        key = _key_text([*keys, unknown])
        if not keys:
            return key, (
                "unknown key (the top level has the key journal and the tables [agents], [budget], "
                "[isolation] and [prices])"
            )
        return key, f"unknown key (known keys: {', '.join(AGENT_KEYS)})"
    if what.startswith("Object missing required field"):
        return _key_text([*keys, "command"]), 'missing: the program to run, e.g. command = "npx"'
    if isinstance(value, str) and "matching regex" in what:
        if "\0" in value:
            # A C string ends at NUL: the program would get a cut-short argument, variable or path.
            return key, "contains a NUL character, which no program can receive"
        if not value.strip() or place not in _EXPECTED:
            return key, "must not be empty"
        # A value its pattern refused (a branch prefix, an ssh option), not repeated: it may be a secret.
        return key, f"must be {_EXPECTED[place]}"
    expected = _EXPECTED.get(place, what)
    if what.startswith("Invalid enum value") or (
        isinstance(value, int | float) and not isinstance(value, bool) and "got" not in what
    ):
        # Out of range, or not one of the choices: the value shown is a number or a mistyped choice,
        # never a string that reached a program (the NUL and blank cases above show none).
        return key, f"must be {expected}, not {value!r}"
    return key, f"must be {expected}, not {_toml_type(value)}"


def _locate(data: Mapping[str, Any], steps: list[Any]) -> tuple[list[str | int], Any]:
    """The concrete keys of ``steps`` in ``data``, and the value there. A ``[...]`` step is the first
    entry of its table that fails validation on its own: msgspec reports the first error in file order."""
    keys: list[str | int] = []
    node: Any = data
    for step in steps:
        if step is _ANY_KEY:
            table = _NAMED_TABLES[_schema_place(keys)]
            step = next(key for key in node if _fails({key: node[key]}, table))
        keys.append(step)
        node = node[step]
    return keys, node


def _fails(value: Any, kind: Any) -> bool:
    try:
        msgspec.convert(value, kind, strict=True)
    except msgspec.ValidationError:
        return True
    return False


def _key_text(keys: list[str | int]) -> str:
    """A dotted key as TOML would write it (``agents.claude.args[1]``, ``env."A=B"``)."""
    text = ""
    for key in keys:
        if isinstance(key, int):
            text += f"[{key}]"
        else:
            text += ("." if text else "") + (key if _BARE_KEY.match(key) else json.dumps(key))
    return text


def _schema_place(keys: list[str | int]) -> str:
    """Where ``keys`` are in the schema, as the keys of :data:`_EXPECTED` write it."""
    place = ""
    for depth, key in enumerate(keys):
        if isinstance(key, int):
            place += "[]"
        elif depth == 1 or (depth == 3 and f"agents.*.{keys[2]}" in _NAMED_TABLES):
            place += ".*"  # an agent's name, an environment name
        else:
            place += ("." if place else "") + key
    return place


def _toml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return f"a number ({value!r})"
    if isinstance(value, str):
        return f"a string ({value!r})"
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return f"a {type(value).__name__}"  # dates and times
