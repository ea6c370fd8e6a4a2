"""Structured output, shared by every provider: ask for JSON, parse it, validate it, ask once more.

The seam validates on the parent's side whatever the child is: an ACP agent, an in-process agent,
a model with constrained decoding or without. A child's answer is accepted only once it parses and
matches the caller's JSON Schema; one repair turn is asked for before giving up.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from subagent.types import SubagentResult, thaw_json

__all__ = ["accept_or_repair", "ask_for_json", "check_schema", "parse_and_validate", "repair_request"]

logger = logging.getLogger(__name__)


def check_schema(output_schema: Mapping[str, Any]) -> None:
    """Raise ``jsonschema.SchemaError`` when ``output_schema`` is not a valid JSON Schema."""
    import jsonschema

    plain = thaw_json(output_schema)
    jsonschema.validators.validator_for(plain).check_schema(plain)


def ask_for_json(prompt: str, wanted: Mapping[str, Any]) -> str:
    """``prompt`` with the instruction to answer with JSON matching ``wanted``."""
    return (
        f"{prompt}\n\nAnswer with a single JSON value that matches this JSON Schema, and nothing else: "
        f"no prose, no code fences.\n\n{json.dumps(thaw_json(wanted), indent=2)}"
    )


def repair_request(problem: str, wanted: Mapping[str, Any]) -> str:
    """The message of the one repair turn: what was wrong, and the schema again."""
    return (
        f"Your previous answer cannot be used: {problem}\n\nReply again with only the corrected JSON "
        f"value matching this JSON Schema, and nothing else:\n\n{json.dumps(thaw_json(wanted), indent=2)}"
    )


_FENCE = re.compile(r"^\s*```[A-Za-z0-9_-]*\s*\n(?P<body>.*?)\n\s*```\s*$", re.DOTALL)
"""A whole answer wrapped in a Markdown code fence, as models often write JSON: the body is the answer."""


def parse_and_validate(text: str, wanted: Mapping[str, Any]) -> tuple[Any, str | None]:
    """The JSON value in ``text`` and None, or None and what is wrong with it."""
    import jsonschema

    fenced = _FENCE.match(text)
    candidate = fenced.group("body") if fenced else text
    try:
        value = json.loads(candidate)
    except json.JSONDecodeError as exc:
        return None, f"it is not valid JSON ({exc})"
    plain = thaw_json(wanted)
    validator_class = jsonschema.validators.validator_for(plain)
    error = jsonschema.exceptions.best_match(validator_class(plain).iter_errors(value))
    if error is not None:
        where = "/".join(str(part) for part in error.absolute_path) or "the top level"
        return None, f"at {where}: {error.message}"
    return value, None


async def accept_or_repair(
    result: SubagentResult,
    wanted: Mapping[str, Any],
    repair_turn: Callable[[str], Awaitable[SubagentResult]],
    *,
    who: str,
) -> SubagentResult:
    """``result`` with its validated ``structured`` value; else the outcome of one repair turn
    (``repair_turn(message)``) validated the same way; else an ``error`` result saying what is wrong.

    A result that did not complete is returned as it is: there is no answer to validate.
    """
    problem = _validate_in_place(result, wanted)
    if problem is None:
        return result
    logger.info("%s: the answer does not match the output schema (%s); one repair turn", who, problem)
    repaired = await repair_turn(repair_request(problem, wanted))
    problem = _validate_in_place(repaired, wanted)
    if problem is None:
        return repaired
    return SubagentResult(
        output=repaired.output,
        stop_reason="error",
        error=f"the answer does not match the output schema after one repair turn: {problem}",
        usage=repaired.usage,
    )


def _validate_in_place(result: SubagentResult, wanted: Mapping[str, Any]) -> str | None:
    """None when ``result`` stands as it is: it did not complete (there is no answer to validate), or
    its answer validated and is now its ``structured`` value. Else what is wrong with the answer."""
    if result.stop_reason != "completed":
        return None
    value, problem = parse_and_validate(result.output, wanted)
    if problem is None:
        result.structured = value
    return problem
