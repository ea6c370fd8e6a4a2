"""Tools an in-process agent can call, how a call's arguments are checked, and how a call is approved.

A tool call is decoded and checked against the tool's JSON Schema (:func:`parse_arguments`), then
frozen into a :class:`ToolInvocation`. When the tool needs approval, the approver decides on that
frozen snapshot and the tool runs with exactly the same snapshot: nothing the model, the approver or
another listener does in between changes what runs.

:func:`parse_arguments` is the one check of a tool call's arguments: the runtime runs it on every
call, and the ``subagent`` tool and its companions (:mod:`subagent.tool`) run it on theirs, so every
entry point gives the same verdict in the same words. The schema is the only statement of what is
valid; the words come from a table of JSON Schema keywords (``depth_limit: expected an integer >= 0
or null, got "3"``), and the answer is bounded in size however large the arguments are.

A tool sees the calling agent only through a :class:`ToolContext`: its id, its working directory and
a way to show signs of life. It cannot close the agent, run a turn on it or send it messages.
"""

from __future__ import annotations

import collections
import inspect
import json
import math
import re
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, Protocol, runtime_checkable

from subagent._finite_json import loads_finite
from subagent._text import cut
from subagent.runtime._messages import ToolSpec
from subagent.types import thaw_json

__all__ = ["Approver", "FunctionTool", "Tool", "ToolContext", "ToolError", "ToolInvocation"]


class ToolError(Exception):
    """Raised by a tool to answer the model with an error it can act on (the message is shown)."""


@runtime_checkable
class ToolContext(Protocol):
    """What a tool sees of the agent calling it: read-only facts and a way to show signs of life.

    Deliberately not the agent: a tool cannot close it, run a turn on it or send it messages.
    """

    @property
    def id(self) -> str:
        """The calling agent's id (a subagent started by the tool names it as its parent)."""
        ...

    @property
    def cwd(self) -> str | None:
        """The directory the agent's work is about, for tools that touch files; None when unset."""
        ...

    def touch(self) -> None:
        """Record a sign of life now. A tool that works for long (one waiting on a busy subagent)
        calls it while it makes progress, so the turn's ``idle_timeout`` counts real silence."""
        ...


@dataclass(frozen=True, slots=True)
class ToolInvocation:
    """One tool call, decoded and frozen: what an approver decides on and what the tool runs with.

    ``arguments`` is a deep-frozen JSON value (read-only mappings, tuples); ``context`` is what the
    tool sees of the agent making the call (not part of equality).
    """

    call_id: str
    tool: str
    arguments: Any
    context: ToolContext = field(repr=False, compare=False)


Approver = Callable[[ToolInvocation], Awaitable[bool] | bool]
"""Decides whether a tool call that needs approval may run. Without one, such calls are refused:
a headless agent never waits for an answer nobody will give."""


@runtime_checkable
class Tool(Protocol):
    """A tool an agent can call."""

    @property
    def spec(self) -> ToolSpec:
        """The name, description and argument schema the model sees."""
        ...

    @property
    def needs_approval(self) -> bool:
        """Whether each call must be approved before it runs."""
        ...

    async def run(self, invocation: ToolInvocation) -> str:
        """Do the work and return the text the model reads. Raise :class:`ToolError` to answer
        with an error the model can act on."""
        ...


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """A tool made of a function that takes the decoded arguments (a frozen mapping) and returns
    text, synchronously or not.

    ```python
    add = FunctionTool("add", "Add two integers.", {"type": "object", "properties": {...}},
                       lambda args: str(args["a"] + args["b"]))
    ```
    """

    name: str
    description: str
    parameters: Mapping[str, Any]
    function: Callable[[Mapping[str, Any]], Awaitable[str] | str] = field(repr=False)
    needs_approval: bool = False
    spec: ToolSpec = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "spec", ToolSpec(self.name, self.description, self.parameters))

    async def run(self, invocation: ToolInvocation) -> str:
        """Call the function with the invocation's frozen arguments."""
        outcome = self.function(invocation.arguments)
        if inspect.isawaitable(outcome):
            outcome = await outcome
        return str(outcome)


# -- checking a call's arguments ---------------------------------------------------------------------

MAX_ARGUMENT_PROBLEMS: Final = 8
"""The most problems one refusal lists: enough to fix a call in one retry, and a bound on the answer
however many a hostile model packs into its arguments."""

MAX_PROBLEM_CHARS: Final = 300
"""The longest line one problem takes; a value or a key is never echoed at length."""

_SHOWN_CHARS: Final = 40
"""The longest string (or key) shown as it is; a longer one is named by its length."""


class InvalidArguments(ValueError):
    """A tool call that was not run: its arguments are not JSON, break the tool's schema, or the
    schema itself is unusable. The message is what the model reads; ``problems`` lists the broken
    rules (at most :data:`MAX_ARGUMENT_PROBLEMS`, each line at most :data:`MAX_PROBLEM_CHARS`)."""

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems = tuple(problems)


def parse_arguments(arguments: Mapping[str, Any] | str | bytes, schema: Mapping[str, Any]) -> Any:
    """A tool call's arguments, decoded (from JSON text, when given as text) and checked against the
    tool's JSON Schema, with the draft the schema declares (2020-12 when it declares none).

    Empty text counts as ``{}`` (some models send it for "no arguments"). A number that is not
    finite (``NaN``, ``1e400``) is not JSON: refused in text, and in a mapping wherever the schema
    asks for a number.

    Raises:
        InvalidArguments: the arguments are not JSON or break the schema (every broken rule, in the
            schema's words), or the schema is unusable; nothing should run.
    """
    value = _decode(arguments)
    validator = _validator(schema)
    if isinstance(validator, str):
        raise InvalidArguments(f"{validator}; nothing was run")
    try:
        problems = _problems(validator, value)
    except RecursionError:
        problems = ["the arguments are nested too deeply to check"]
    except Exception as exc:
        # A schema valid against its metaschema can still fail to apply: a $ref pointing nowhere.
        problem = f"the tool's own argument schema cannot be applied ({cut(str(exc), 500)})"
        raise InvalidArguments(f"{problem}; nothing was run") from None
    if problems:
        raise _invalid(problems)
    return value


def _invalid(problems: Sequence[str]) -> InvalidArguments:
    lines = "\n".join(f"- {problem}" for problem in problems)
    return InvalidArguments(f"invalid arguments, nothing was run:\n{lines}", problems)


def _decode(arguments: Mapping[str, Any] | str | bytes) -> Any:
    if not isinstance(arguments, str | bytes):
        return arguments
    if not arguments.strip():
        return {}
    try:
        return loads_finite(arguments)
    except RecursionError:
        raise _invalid(["the arguments are nested too deeply to decode"]) from None
    except ValueError as exc:  # JSONDecodeError, bad UTF-8, an over-long integer, the hooks above
        raise _invalid([f"the arguments are not valid JSON: {cut(str(exc), 200)}"]) from None


_VALIDATORS: collections.OrderedDict[int | str, tuple[Mapping[str, Any], Any]] = collections.OrderedDict()
"""Schemas with their validators (or what is wrong with them), by the schema's identity when it is
read-only (a :class:`ToolSpec`'s: the same object is the same schema), else by its JSON text:
checking a schema against its metaschema costs milliseconds, and a tool's schema is the same call
after call. The schema is kept with its validator, so its id cannot be reused while cached."""

_VALIDATORS_KEPT: Final = 256

_FINITE_CLASSES: dict[type, Any] = {}
"""Each draft's validator class, with numbers that are finite: ``NaN`` passes every bound."""


def _validator(schema: Mapping[str, Any]) -> Any:
    """The validator of ``schema``, or what is wrong with the schema."""
    import jsonschema  # on first use: ~80 ms that importing the runtime (and the CLI) need not pay

    key = _cache_key(schema)
    if key is not None and key in _VALIDATORS:
        _VALIDATORS.move_to_end(key)
        return _VALIDATORS[key][1]
    plain = thaw_json(schema)
    validator: Any
    try:
        draft = jsonschema.validators.validator_for(plain, default=jsonschema.Draft202012Validator)
        # Validators do not check their schema themselves: an invalid one raises anything, or nothing.
        draft.check_schema(plain)
        validator = _finite_numbers(draft)(plain)
    except jsonschema.exceptions.SchemaError as exc:
        validator = f"the tool's own argument schema is invalid ({cut(exc.message, 500)})"
    except Exception as exc:
        validator = f"the tool's own argument schema cannot be applied ({cut(str(exc), 500)})"
    if key is not None:
        _VALIDATORS[key] = (schema, validator)
        if len(_VALIDATORS) > _VALIDATORS_KEPT:
            _VALIDATORS.popitem(last=False)
    return validator


def _cache_key(schema: Mapping[str, Any]) -> int | str | None:
    if isinstance(schema, MappingProxyType):
        return id(schema)
    try:
        return json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError):
        return None  # not plain JSON: checked afresh at every call, never kept


def _finite_numbers(draft: type) -> Any:
    import jsonschema

    extended = _FINITE_CLASSES.get(draft)
    if extended is None:
        checker = draft.TYPE_CHECKER  # type: ignore[attr-defined]

        def is_number(types: Any, instance: object) -> bool:
            return bool(checker.is_type(instance, "number")) and not (
                isinstance(instance, float) and not math.isfinite(instance)
            )

        extended = jsonschema.validators.extend(  # type: ignore[no-untyped-call]
            draft, type_checker=checker.redefine("number", is_number)
        )
        _FINITE_CLASSES[draft] = extended
    return extended


# The wording table: JSON Schema's keywords in words a model reads. Every fact comes from the schema;
# this only says it.

_NOUNS: Final[Mapping[str, str]] = {
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "true or false",
    "null": "null",
    "object": "an object",
    "array": "an array",
}
_PLURALS: Final[Mapping[str, str]] = {
    "string": "strings",
    "integer": "integers",
    "number": "numbers",
    "boolean": "booleans",
    "object": "objects",
    "array": "arrays",
}
_PATTERNS: Final[Mapping[str, str]] = {r"\S": "non-blank"}
"""Patterns with a word: ``"pattern": "\\S"`` is "a non-blank string"; others are shown."""
_BOUNDS: Final = (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<"))
_VALUE_KEYWORDS: Final = frozenset(
    {"type", "enum", "const", "multipleOf", "minLength", "maxLength", "pattern", "minItems", "maxItems"}
    | {"uniqueItems", "anyOf", "oneOf"}
    | {keyword for keyword, _ in _BOUNDS}
)
"""Keywords about a value alone: a value breaking any of them gets one line, "expected" what its
schema allows."""
_CHOICES_SHOWN: Final = 10
_NAMES_SHOWN: Final = 5
_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


def _problems(validator: Any, value: Any) -> list[str]:
    """What is wrong with ``value``, one line per value or object at fault, in the schema's order."""
    problems: list[str] = []
    seen: set[Hashable] = set()
    for error in validator.iter_errors(value):
        path = tuple(error.absolute_path)
        key, lines = _explain(error, path)
        if key in seen:
            continue
        seen.add(key)
        for line in lines:
            if len(problems) == MAX_ARGUMENT_PROBLEMS:
                problems.append("more problems are not listed")
                return problems
            problems.append(cut(line, MAX_PROBLEM_CHARS))
    return problems


def _explain(error: Any, path: tuple[str | int, ...]) -> tuple[Hashable, list[str]]:
    """A key that says which problem this is (another error with the same key says nothing new), and
    its lines."""
    keyword = error.validator
    where = _where(path) or "the arguments"
    if keyword == "required" and isinstance(error.instance, Mapping):
        properties = error.schema.get("properties", {})
        missing = [name for name in error.validator_value if name not in error.instance]
        lines = []
        for name in missing:
            expected = _expected(properties.get(name))
            line = f"missing {'argument' if not path else 'key'} {_shown_name(name)}"
            line += f" ({expected})" if expected else ""
            lines.append(f"{where}: {line}" if path else line)
        return ("required", path), lines
    if keyword == "additionalProperties" and error.validator_value is False:
        return ("additional", path), [_unknown(error.schema, error.instance, path)]
    expected = _expected(error.schema) if keyword in _VALUE_KEYWORDS else None
    if keyword == "oneOf" and not error.context:
        expected = None  # more than one alternative matched: not a matter of the value's form
    if expected is not None:
        return ("value", path), [f"{where}: expected {expected}, got {_shown(error.instance)}"]
    return (keyword, path), [f"{where}: {cut(error.message, 200)}"]


def _unknown(schema: Mapping[str, Any], instance: Mapping[str, Any], path: tuple[str | int, ...]) -> str:
    properties = list(schema.get("properties", {}))
    patterns = list(schema.get("patternProperties", {}))
    extra = [
        name
        for name in instance
        if name not in properties and not any(re.search(pattern, name) for pattern in patterns)
    ]
    shown = ", ".join(_shown_name(name) for name in extra[:_NAMES_SHOWN])
    if len(extra) > _NAMES_SHOWN:
        shown += f" and {len(extra) - _NAMES_SHOWN} more"
    known = ", ".join(_shown_name(name) for name in properties) or "none"
    plural = "s" if len(extra) > 1 else ""
    if not path:
        return f"unknown argument{plural} {shown}; the tool takes {known}"
    return f"{_where(path)}: unknown key{plural} {shown}; it takes {known}"


def _where(path: tuple[str | int, ...]) -> str:
    """A place in the arguments: ``tool_filter.allow[2]``; empty for the arguments themselves."""
    text = ""
    for step in path:
        if isinstance(step, int):
            text += f"[{step}]"
        elif _NAME.fullmatch(step) and len(step) <= _SHOWN_CHARS:
            text += f".{step}" if text else step
        else:
            text += f"[{_shown_name(step)}]"
    return text


def _shown_name(name: str) -> str:
    return json.dumps(cut(name, _SHOWN_CHARS), ensure_ascii=False)


def _shown(value: Any) -> str:
    """A value as the model would write it, if short; else what it is."""
    if value is None or isinstance(value, bool | float):
        return json.dumps(value)  # null, true, false, 1.5, NaN, Infinity
    if isinstance(value, int):
        return str(value) if -(10**_SHOWN_CHARS) < value < 10**_SHOWN_CHARS else "an integer too long to show"
    if isinstance(value, str):
        if len(value) > _SHOWN_CHARS:
            return f"a string of {len(value)} characters"
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list):
        return "an array" if value else "an empty array"
    return f"a {type(value).__name__}"  # a host's own value, not JSON


def _expected(schema: Any) -> str | None:
    """What ``schema`` allows, in words; None when the table has none for it."""
    if not isinstance(schema, Mapping):
        return None
    if "const" in schema:
        return _shown(schema["const"])
    choices = schema.get("enum")
    if isinstance(choices, list):
        words = ", ".join(_shown(choice) for choice in choices[:_CHOICES_SHOWN])
        return f"one of {words}" + (", ..." if len(choices) > _CHOICES_SHOWN else "")
    types = schema.get("type")
    alternatives = schema.get("anyOf", schema.get("oneOf"))
    if types is None and isinstance(alternatives, list) and alternatives:
        phrases = [_expected(alternative) for alternative in alternatives]
        return None if None in phrases else " or ".join(phrase for phrase in phrases if phrase)
    names = [types] if isinstance(types, str) else types
    if not isinstance(names, list) or not names:
        return None
    phrases = [_typed(name, schema) for name in names]
    return None if None in phrases else " or ".join(phrase for phrase in phrases if phrase)


def _typed(name: object, schema: Mapping[str, Any]) -> str | None:
    """What ``schema`` allows of the JSON type ``name``, in words."""
    if not isinstance(name, str) or name not in _NOUNS:
        return None
    limits: list[str] = []
    if name == "string":
        pattern = schema.get("pattern")
        worded = _PATTERNS.get(pattern) if isinstance(pattern, str) else None
        shortest = schema.get("minLength", 0)
        # A worded pattern says all there is (every one of them rules out ""); else minLength 1 has one.
        adjective = worded or ("non-empty" if shortest == 1 else None)
        if isinstance(shortest, int) and shortest > 1:
            limits.append(f"of at least {shortest} characters")
        if "maxLength" in schema:
            limits.append(f"of at most {schema['maxLength']} characters")
        if isinstance(pattern, str) and worded is None:
            limits.append(f"matching {_shown_name(pattern)}")
        noun = f"a {adjective} string" if adjective else "a string"
    elif name in ("integer", "number"):
        limits += [
            f"{sign} {_shown(schema[keyword])}"
            for keyword, sign in _BOUNDS
            if isinstance(schema.get(keyword), int | float) and not isinstance(schema.get(keyword), bool)
        ]
        if "multipleOf" in schema:
            limits.append(f"that is a multiple of {_shown(schema['multipleOf'])}")
        noun = _NOUNS[name]
    elif name == "array":
        items = schema.get("items")
        kind = items.get("type") if isinstance(items, Mapping) else None
        noun = f"an array of {_PLURALS[kind]}" if isinstance(kind, str) and kind in _PLURALS else "an array"
        if "minItems" in schema:
            limits.append(f"of at least {schema['minItems']} items")
        if "maxItems" in schema:
            limits.append(f"of at most {schema['maxItems']} items")
        if schema.get("uniqueItems") is True:
            limits.append("without repeats")
    else:
        noun = _NOUNS[name]
    return " ".join([noun, " and ".join(limits)]) if limits else noun
