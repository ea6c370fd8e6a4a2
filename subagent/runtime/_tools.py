"""Tools an in-process agent can call, and how a call is approved.

A tool call is decoded and checked against the tool's JSON Schema, then frozen into a
:class:`ToolInvocation`. When the tool needs approval, the approver decides on that frozen snapshot
and the tool runs with exactly the same snapshot: nothing the model, the approver or another
listener does in between changes what runs.

A tool sees the calling agent only through a :class:`ToolContext`: its id, its working directory and
a way to show signs of life. It cannot close the agent, run a turn on it or send it messages.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from subagent.runtime._messages import ToolSpec

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
