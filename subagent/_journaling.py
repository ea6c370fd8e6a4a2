"""What the service writes to its run journal, and how a journaled request comes back for a resume."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from subagent._budget_codec import budget_to_json
from subagent._usage_codec import usage_to_acp
from subagent.types import Budget, SubagentRequest, ToolFilter, Usage, thaw_json

__all__ = ["DEFAULT_RESUME_PROMPT", "provider_secrets", "request_from_json", "request_to_json", "usage_json"]

DEFAULT_RESUME_PROMPT = (
    "Your work on this task stopped before you finished it ({why}). What you were asked was:\n\n"
    "{prompt}\n\n"
    "Continue where you stopped: first check what is already done, so that nothing is done twice, then "
    "finish the task."
)
"""The prompt of a resumed run's turn when the caller gives none: ``why`` says how the run stopped
(``the process that ran it was killed``...), ``prompt`` is the prompt of the turn that did not finish."""


def request_to_json(request: SubagentRequest) -> dict[str, Any]:
    """The request's options, without its prompt, as the journal keeps them."""
    value: dict[str, Any] = {}
    if request.cwd is not None:
        value["cwd"] = request.cwd
    if request.output_schema is not None:
        value["outputSchema"] = thaw_json(request.output_schema)
    if request.depth_limit is not None:
        value["depthLimit"] = request.depth_limit
    if request.tool_filter is not None:
        allow = request.tool_filter.allow
        value["toolFilter"] = {
            "allow": None if allow is None else sorted(allow),
            "deny": sorted(request.tool_filter.deny),
        }
    if request.persona is not None:
        value["persona"] = request.persona
    if request.timeout is not None:
        value["timeout"] = request.timeout
    if request.metadata:
        value["metadata"] = thaw_json(request.metadata)
    if request.additional_directories:
        value["additionalDirectories"] = list(request.additional_directories)
    budget = budget_to_json(request.budget)
    if budget is not None:
        value["budget"] = budget
    if request.isolation is not None:
        value["isolation"] = request.isolation
        value["cleanup"] = request.cleanup
    return value


def request_from_json(value: Mapping[str, Any], *, prompt: str, parent_id: str | None) -> SubagentRequest:
    """A request like the journaled one (``value``: :func:`request_to_json`'s), with ``prompt``.

    Raises:
        ValueError: the journaled options are not a request's (a hand-edited journal).
    """
    tool_filter = None
    raw_filter = value.get("toolFilter")
    if isinstance(raw_filter, Mapping):
        allow = raw_filter.get("allow")
        tool_filter = ToolFilter(
            allow=None if allow is None else frozenset(allow), deny=frozenset(raw_filter.get("deny") or ())
        )
    budget = value.get("budget")
    return SubagentRequest(
        prompt=prompt,
        cwd=value.get("cwd"),
        output_schema=value.get("outputSchema"),
        depth_limit=value.get("depthLimit"),
        tool_filter=tool_filter,
        persona=value.get("persona"),
        timeout=value.get("timeout"),
        parent_id=parent_id,
        metadata=value.get("metadata") or {},
        additional_directories=tuple(value.get("additionalDirectories") or ()),
        budget=Budget(**budget) if isinstance(budget, Mapping) else None,
        isolation=value.get("isolation"),
        cleanup=value.get("cleanup") or "remove",
    )


def usage_json(usage: Usage | None) -> dict[str, Any] | None:
    """A result's usage as the journal keeps it (ACP's camelCase form)."""
    return usage_to_acp(usage)


def provider_secrets(provider: object) -> Iterator[str]:
    """What a provider holds that must never be written down: an ACP provider's environment values,
    an in-process provider's LLM adapter's API key."""
    env = getattr(provider, "env", None)
    if isinstance(env, Mapping):
        yield from (value for value in env.values() if isinstance(value, str))
    llm = getattr(provider, "llm", None)
    for holder in (provider, llm):
        for attribute in ("api_key", "_api_key"):
            key = getattr(holder, attribute, None)
            if isinstance(key, str):
                yield key
