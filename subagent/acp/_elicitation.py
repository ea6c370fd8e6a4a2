"""Elicitation: an agent asking the person behind the client for structured input (``elicitation/create``).

The client advertises form mode only (``clientCapabilities.elicitation.form``): the agent sends a message
and a flat JSON schema of primitive fields, and gets back ``accept`` with content that matches it,
``decline`` or ``cancel``. Here:

* :func:`question_from_request` turns the request into an :class:`ElicitationQuestion`, a frozen snapshot
  a policy decides on, or refuses it (JSON-RPC -32602) when it cannot be shown and checked: more than
  :data:`MAX_FIELDS` fields, texts longer than :data:`MAX_TEXT_CHARS`, a field kind other than string
  (optionally an enum, titled or not), number, integer or boolean, or a string ``pattern`` (an agent's
  regular expression is not run on a person's answer: it could take exponential time).
* :func:`check_content` checks an answer against the question (types, required fields, enums, bounds,
  formats); nothing unchecked is ever sent to the agent.
* :func:`parse_value` reads a value typed by a person for one field (the terminal form).

Policies: a permission policy may also answer elicitations by having an ``elicit`` method
(:class:`ElicitationPolicy`); one without it declines. ``allow`` and ``deny`` decline (nothing can invent
an answer); :class:`~subagent.acp.handlers.CallbackPolicy` asks its ``elicitation`` callback.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol, runtime_checkable

import msgspec

from subagent.acp import schema
from subagent.acp._errors import RequestError
from subagent.acp._frozen import freeze_json

__all__ = [
    "MAX_ANSWER_CHARS",
    "MAX_CHOICES",
    "MAX_FIELDS",
    "MAX_NAME_CHARS",
    "MAX_TEXT_CHARS",
    "ElicitationAnswer",
    "ElicitationCallback",
    "ElicitationChoice",
    "ElicitationField",
    "ElicitationPolicy",
    "ElicitationQuestion",
    "FieldValue",
    "check_content",
    "check_value",
    "parse_value",
    "question_from_request",
]

MAX_FIELDS: Final = 32
"""The most fields a form may have: a person fills in a handful; more is not a question for one."""

MAX_CHOICES: Final = 100
"""The most choices one enum field may offer (a list a person can still read)."""

MAX_TEXT_CHARS: Final = 4000
"""The longest message, title or description an agent may show (a screenful)."""

MAX_NAME_CHARS: Final = 256
"""The longest field name, enum value or choice title."""

MAX_ANSWER_CHARS: Final = 16_384
"""The longest string answer accepted, whatever the field's own ``maxLength`` says."""

FieldValue = str | int | float | bool
"""One field's value in an accepted answer."""

FieldType = Literal["string", "number", "integer", "boolean"]

_FORMATS: Final = ("email", "uri", "date", "date-time")

_MAX_SAFE_INTEGER: Final = 2**53 - 1
"""The largest whole number every JSON reader keeps exactly (a JavaScript agent reads numbers as doubles)."""


@dataclass(frozen=True, slots=True)
class ElicitationChoice:
    """One choice of an enum field: the value sent, and the title shown (the value when untitled)."""

    value: str
    title: str


@dataclass(frozen=True, slots=True)
class ElicitationField:
    """One field of the form, as checked from the requested schema."""

    name: str
    type: FieldType
    title: str | None = None
    description: str | None = None
    required: bool = False
    default: FieldValue | None = None
    choices: tuple[ElicitationChoice, ...] = ()
    """For a string field that is an enum: the allowed values (none: free text)."""
    minimum: float | None = None
    maximum: float | None = None
    min_length: int | None = None
    max_length: int | None = None
    format: str | None = None
    """``email``, ``uri``, ``date`` or ``date-time`` (strings only)."""

    @property
    def label(self) -> str:
        """What a form shows for the field: its title, else its name."""
        return self.title or self.name


@dataclass(frozen=True, slots=True)
class ElicitationQuestion:
    """A frozen snapshot of an ``elicitation/create`` request (form mode): what a policy decides on.

    ``requested_schema`` is the schema as the agent sent it (frozen JSON); ``fields`` the same, checked
    and in order. ``session_id`` is None for a question outside any session.
    """

    session_id: str | None
    message: str
    requested_schema: Any
    fields: tuple[ElicitationField, ...]
    title: str | None = None
    tool_call_id: str | None = None


@dataclass(frozen=True, slots=True)
class ElicitationAnswer:
    """How a question was answered: ``accept`` with ``content``, ``decline`` or ``cancel``."""

    action: Literal["accept", "decline", "cancel"]
    content: Mapping[str, FieldValue] | None = None

    @classmethod
    def accept(cls, content: Mapping[str, FieldValue]) -> ElicitationAnswer:
        """Accept with ``content`` (checked against the question before it is sent)."""
        return cls("accept", dict(content))

    @classmethod
    def decline(cls) -> ElicitationAnswer:
        """The person said no."""
        return cls("decline")

    @classmethod
    def cancel(cls) -> ElicitationAnswer:
        """The question was dismissed without an answer (a cancelled turn, nobody there in time)."""
        return cls("cancel")

    def to_wire(self) -> schema.CreateElicitationResponse:
        """The ``elicitation/create`` result."""
        if self.action == "accept":
            return schema.ElicitationAcceptAction(content=dict(self.content or {}))
        if self.action == "decline":
            return schema.ElicitationDeclineAction()
        return schema.ElicitationCancelAction()


ElicitationCallback = Callable[[ElicitationQuestion], Awaitable[ElicitationAnswer]]
"""Answers an elicitation question (a :class:`~subagent.acp.handlers.CallbackPolicy`'s ``elicitation``)."""


@runtime_checkable
class ElicitationPolicy(Protocol):
    """A permission policy that also answers elicitations; a policy without ``elicit`` declines them."""

    async def elicit(self, question: ElicitationQuestion) -> ElicitationAnswer:
        """Answer the question; an ``accept`` whose content does not match the schema is sent as decline."""
        ...


# -- reading the request --------------------------------------------------------------------------------


def _refuse(reason: str) -> RequestError:
    return RequestError.invalid_params({"reason": reason})


def _text(value: str | None, what: str, limit: int = MAX_TEXT_CHARS) -> str | None:
    if value is not None and len(value) > limit:
        raise _refuse(f"{what} is {len(value)} characters long; at most {limit} are shown")
    return value


def _bound(value: float | None, what: str) -> float | None:
    if value is not None and not math.isfinite(value):
        raise _refuse(f"{what} must be a finite number")
    return value


def question_from_request(request: schema.ElicitationFormMode) -> ElicitationQuestion:
    """The frozen question for a form-mode request.

    Raises:
        RequestError: -32602, with a ``reason`` in ``data``, for a schema this client cannot show or check
            (see the module docstring) or one past the bounds.
    """
    requested = request.requested_schema
    message = _text(request.message, "the message") or ""
    properties = requested.properties
    if len(properties) > MAX_FIELDS:
        raise _refuse(f"the form has {len(properties)} fields; at most {MAX_FIELDS} are shown")
    required = set(requested.required or ())
    unknown = sorted(name[:MAX_NAME_CHARS] for name in required - set(properties))[:5]
    if unknown:
        raise _refuse(f"required fields {unknown} are not among the properties")
    fields = tuple(_field(name, prop, name in required) for name, prop in properties.items())
    frozen = freeze_json(msgspec.json.decode(schema.encode(requested)))
    return ElicitationQuestion(
        session_id=request.session_id,
        message=message,
        requested_schema=frozen,
        fields=fields,
        title=_text(requested.title, "the form's title"),
        tool_call_id=_text(request.tool_call_id, "the tool call id"),
    )


def _field(name: str, prop: schema.ElicitationPropertySchema, required: bool) -> ElicitationField:
    if not name or len(name) > MAX_NAME_CHARS:
        raise _refuse(f"a field name must have 1 to {MAX_NAME_CHARS} characters")
    where = f"field {name!r}"
    # The parts of its kind first, then what every kind has.
    if isinstance(prop, schema.StringPropertySchema):
        made = _string_field(name, prop, where)
    elif isinstance(prop, schema.NumberPropertySchema | schema.IntegerPropertySchema):
        kind: FieldType = "number" if isinstance(prop, schema.NumberPropertySchema) else "integer"
        low, high = _bound(prop.minimum, f"{where}: minimum"), _bound(prop.maximum, f"{where}: maximum")
        if low is not None and high is not None and low > high:
            raise _refuse(f"{where}: minimum is above maximum")
        made = ElicitationField(name, kind, minimum=low, maximum=high)
    elif isinstance(prop, schema.BooleanPropertySchema):
        made = ElicitationField(name, "boolean")
    else:
        kind_name = (
            "a multi-select (array)" if isinstance(prop, schema.MultiSelectPropertySchema) else "an unknown"
        )
        raise _refuse(f"{where} is {kind_name} field, which this client cannot show")
    made = dataclasses.replace(
        made,
        title=_text(prop.title, f"{where}: title"),
        description=_text(prop.description, f"{where}: description"),
        required=required,
    )
    if prop.default is None:
        return made
    # The default must itself be a valid value: a form offers it as the answer.
    problem = check_value(made, prop.default)
    if problem is not None:
        raise _refuse(f"{where}: the default is not a valid value ({problem})")
    return dataclasses.replace(made, default=prop.default)


def _string_field(name: str, prop: schema.StringPropertySchema, where: str) -> ElicitationField:
    if prop.pattern is not None:
        raise _refuse(f"{where}: a pattern cannot be checked by this client")
    if prop.format is not None and prop.format not in _FORMATS:
        raise _refuse(f"{where}: unknown format")
    if prop.enum is not None and prop.one_of is not None:
        raise _refuse(f"{where}: both enum and oneOf")
    choices = [ElicitationChoice(value, value) for value in prop.enum or ()]
    choices += [ElicitationChoice(option.const, option.title) for option in prop.one_of or ()]
    if len(choices) > MAX_CHOICES:
        raise _refuse(f"{where} offers {len(choices)} choices; at most {MAX_CHOICES} are shown")
    for choice in choices:
        if not choice.value or len(choice.value) > MAX_NAME_CHARS or len(choice.title) > MAX_NAME_CHARS:
            raise _refuse(f"{where}: a choice must have 1 to {MAX_NAME_CHARS} characters")
    if (prop.enum is not None or prop.one_of is not None) and not choices:
        raise _refuse(f"{where}: an enum with no choices")
    low, high = prop.min_length, prop.max_length
    if (low is not None and low < 0) or (high is not None and high < 0):
        raise _refuse(f"{where}: negative length bounds")
    if low is not None and high is not None and low > high:
        raise _refuse(f"{where}: minLength is above maxLength")
    return ElicitationField(
        name, "string", choices=tuple(choices), min_length=low, max_length=high, format=prop.format
    )


# -- checking answers -----------------------------------------------------------------------------------


def check_content(question: ElicitationQuestion, content: Any) -> str | None:
    """Why ``content`` is not a valid answer to ``question``, or None when it is."""
    if not isinstance(content, Mapping):
        return "the content must be an object"
    fields = {field.name: field for field in question.fields}
    for name in content:
        if name not in fields:
            return f"{str(name)[:MAX_NAME_CHARS]!r} is not a field of the form"
    for field in question.fields:
        if field.name not in content:
            if field.required:
                return f"{field.name!r} is required"
            continue
        problem = check_value(field, content[field.name])
        if problem is not None:
            return f"{field.name!r}: {problem}"
    return None


def check_value(field: ElicitationField, value: Any) -> str | None:
    """Why ``value`` is not valid for ``field``, or None when it is."""
    if field.type == "boolean":
        return None if isinstance(value, bool) else "must be true or false"
    if field.type in ("number", "integer"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            return "must be a number"
        if field.type == "integer" and not isinstance(value, int):
            return "must be a whole number"
        if isinstance(value, float) and not math.isfinite(value):
            return "must be a finite number"
        if isinstance(value, int) and abs(value) > _MAX_SAFE_INTEGER:
            return "is too large to be sent exactly"
        if field.minimum is not None and value < field.minimum:
            return f"must be at least {field.minimum:g}"
        if field.maximum is not None and value > field.maximum:
            return f"must be at most {field.maximum:g}"
        return None
    if not isinstance(value, str):
        return "must be text"
    if len(value) > MAX_ANSWER_CHARS:
        return f"must be at most {MAX_ANSWER_CHARS} characters"
    if field.choices:
        return None if any(value == choice.value for choice in field.choices) else "is not one of the choices"
    if field.min_length is not None and len(value) < field.min_length:
        return f"must be at least {field.min_length} characters"
    if field.max_length is not None and len(value) > field.max_length:
        return f"must be at most {field.max_length} characters"
    if field.format is not None and not _has_format(value, field.format):
        return f"must be a valid {field.format}"
    return None


def _has_format(value: str, form: str) -> bool:
    if form == "date":
        try:
            datetime.date.fromisoformat(value)
        except ValueError:
            return False
        return True
    if form == "date-time":
        try:
            moment = datetime.datetime.fromisoformat(value)
        except ValueError:
            return False
        return "T" in value.upper() and moment.tzinfo is not None  # RFC 3339: a time and an offset
    if form == "email":
        local, at, domain = value.rpartition("@")
        return bool(at and local and "." in domain and not any(c.isspace() for c in value))
    parsed = urllib.parse.urlsplit(value)  # uri
    return bool(parsed.scheme and (parsed.netloc or parsed.path)) and not any(c.isspace() for c in value)


_YES: Final = frozenset({"y", "yes", "true", "1"})
_NO: Final = frozenset({"n", "no", "false", "0"})


def parse_value(field: ElicitationField, text: str) -> FieldValue:
    """The value a person typed for ``field`` (a choice by its number, value or title; a boolean as
    y/yes/true/1 or n/no/false/0), checked.

    Raises:
        ValueError: the text is not a valid value; the message says why, for the person to try again.
    """
    typed = text.strip()
    value: FieldValue
    if field.type == "boolean":
        folded = typed.casefold()
        if folded not in _YES | _NO:
            raise ValueError("answer y or n")
        value = folded in _YES
    elif field.type == "integer":
        try:
            value = int(typed)
        except ValueError:
            raise ValueError("must be a whole number") from None
    elif field.type == "number":
        try:
            value = float(typed)
        except ValueError:
            raise ValueError("must be a number") from None
        if value.is_integer() and "." not in typed and "e" not in typed.casefold():
            value = int(typed)
    elif field.choices:
        value = _choice(field, typed)
    else:
        value = text  # free text is taken as typed
    problem = check_value(field, value)
    if problem is not None:
        raise ValueError(problem)
    return value


def _choice(field: ElicitationField, typed: str) -> str:
    if typed.isdigit():
        index = int(typed) - 1
        if 0 <= index < len(field.choices):
            return field.choices[index].value
    for choice in field.choices:
        if typed == choice.value:
            return choice.value
    folded = typed.casefold()
    for choice in field.choices:
        if folded == choice.title.casefold():
            return choice.value
    raise ValueError("not one of the choices")
