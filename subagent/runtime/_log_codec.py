"""The JSON form of an agent's message log, for the run journal: what an in-process run's checkpoint
holds (:meth:`~subagent.providers._inprocess.InProcessRun.checkpoint`) and what a resumed child starts
from (:meth:`~subagent.providers._inprocess.InProcessProvider.reopen`).

Each message is an object: ``{"role", "content"}``, plus ``"tool_calls": [{"id", "name", "arguments"}]``
on an assistant message that asked for tools, and ``"tool_call_id"`` and ``"name"`` on a tool result.
Decoding is strict: a log read back from a journal another version (or a torn write) made must fail
here, with what is wrong and where, rather than deep inside a turn or as a request the model's API
refuses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final, get_args

from subagent.runtime._messages import Message, Role, ToolCall

__all__ = ["decode_log", "encode_log", "json_type"]

_ROLES: Final[tuple[str, ...]] = get_args(Role)
_MESSAGE_KEYS: Final = frozenset({"role", "content", "tool_calls", "tool_call_id", "name"})
_CALL_KEYS: Final = ("id", "name", "arguments")


def encode_log(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """``messages`` as plain JSON-able objects, in order; fields at their defaults are left out."""
    return [_encode_message(message) for message in messages]


def _encode_message(message: Message) -> dict[str, Any]:
    encoded: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        encoded["tool_calls"] = [
            {"id": call.id, "name": call.name, "arguments": call.arguments} for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        encoded["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        encoded["name"] = message.name
    return encoded


def decode_log(raw: object) -> tuple[Message, ...]:
    """The messages of a log :func:`encode_log` wrote (arrays may be tuples, objects any mapping, as a
    frozen JSON value has them).

    Raises:
        ValueError: the log is malformed; the message says where (``messages[2].tool_calls[0].id``)
            and what is wrong.
    """
    if not _is_array(raw):
        raise ValueError(f"messages must be an array, not {json_type(raw)}")
    assert isinstance(raw, Sequence)
    return tuple(_decode_message(item, f"messages[{index}]") for index, item in enumerate(raw))


def _decode_message(raw: object, where: str) -> Message:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} must be an object, not {json_type(raw)}")
    unknown = sorted(repr(key) for key in raw if key not in _MESSAGE_KEYS)
    if unknown:
        raise ValueError(f"{where} has unknown keys: {', '.join(unknown)}")
    if "role" not in raw:
        raise ValueError(f"{where} has no role")
    role = raw["role"]
    if role not in _ROLES:
        allowed = ", ".join(repr(name) for name in _ROLES)
        raise ValueError(f"{where}.role must be one of {allowed}, not {role!r}")
    content = _string(raw, "content", where)
    calls_raw = raw.get("tool_calls", ())
    if not _is_array(calls_raw):
        raise ValueError(f"{where}.tool_calls must be an array, not {json_type(calls_raw)}")
    assert isinstance(calls_raw, Sequence)
    calls = tuple(_decode_call(item, f"{where}.tool_calls[{index}]") for index, item in enumerate(calls_raw))
    tool_call_id = _optional_string(raw, "tool_call_id", where)
    name = _optional_string(raw, "name", where)
    # The shape chat APIs require (and the runtime makes): a log breaking it would be refused there.
    if calls and role != "assistant":
        raise ValueError(f"{where} ({role}) has tool_calls, which only assistant messages have")
    if role == "tool":
        if tool_call_id is None:
            raise ValueError(f"{where} (tool) has no tool_call_id")
    elif tool_call_id is not None or name is not None:
        field = "tool_call_id" if tool_call_id is not None else "name"
        raise ValueError(f"{where} ({role}) has a {field}, which only tool results have")
    return Message(role, content, calls, tool_call_id, name)


def _decode_call(raw: object, where: str) -> ToolCall:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} must be an object, not {json_type(raw)}")
    unknown = sorted(repr(key) for key in raw if key not in _CALL_KEYS)
    if unknown:
        raise ValueError(f"{where} has unknown keys: {', '.join(unknown)}")
    call_id, name, arguments = (_string(raw, key, where) for key in _CALL_KEYS)
    return ToolCall(call_id, name, arguments)


def _string(raw: Mapping[Any, Any], key: str, where: str) -> str:
    if key not in raw:
        raise ValueError(f"{where} has no {key}")
    value = raw[key]
    if not isinstance(value, str):
        raise ValueError(f"{where}.{key} must be a string, not {json_type(value)}")
    return value


def _optional_string(raw: Mapping[Any, Any], key: str, where: str) -> str | None:
    value = raw.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{where}.{key} must be a string or null, not {json_type(value)}")
    return value


def _is_array(value: object) -> bool:
    return isinstance(value, list | tuple)


def json_type(value: object) -> str:
    """What ``value`` is, in JSON's words (a journal's record is JSON, whatever wrote it)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if _is_array(value):
        return "an array"
    return f"a {type(value).__name__}"
