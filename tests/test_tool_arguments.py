"""One table of tool arguments, valid and invalid, run through every entry point that checks them: the
``subagent`` tool's ``execute``, its companions' ``execute_companion``, and an in-process agent's tool
call (the runtime checks the call against the tool's published schema). Each gives the same verdict in
the same words: the schema the tool publishes is the only statement of what is valid.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

from subagent import SubagentCapabilities, SubagentService, ToolFilter
from subagent.delegation import BackgroundOptions
from subagent.runtime import Agent, FunctionTool, Reply, ScriptedLlm, ToolCall, call
from subagent.runtime._tools import (
    MAX_ARGUMENT_PROBLEMS,
    MAX_PROBLEM_CHARS,
    InvalidArguments,
    parse_arguments,
)
from subagent.testing.fakes import FakeProvider, completes
from subagent.tool import SubagentTool
from subagent.types import thaw_json

pytestmark = pytest.mark.anyio

WAIT = 10  # seconds; a bound on every wait, never a sleep

ALL_FEATURES = SubagentCapabilities(output_schema=True, depth_limit=True, tool_filter=True)
TAKES = '"prompt", "provider", "output_schema", "depth_limit", "tool_filter", "persona", "background"'
"""The arguments of the tool below, as a refusal names them."""


def invalid(*problems: str) -> str:
    """The words every entry point answers a call with invalid arguments with."""
    return "invalid arguments, nothing was run:\n" + "\n".join(f"- {problem}" for problem in problems)


@dataclass(frozen=True)
class Verdict:
    """What the model reads back: ``text`` after ``Error:`` when ``is_refusal``, else ``text`` itself."""

    text: str
    is_refusal: bool = True


def accepted(text: str) -> Verdict:
    return Verdict(text, is_refusal=False)


def refused(*problems: str) -> Verdict:
    """The refusal of invalid arguments listing ``problems``."""
    return Verdict(invalid(*problems))


DONE = accepted("done")
"""What a subagent started by the tool answers."""

CASES = [
    # -- the tool: what is valid, null included -------------------------------------------------------
    pytest.param("subagent", {"prompt": "p", "provider": "spawn"}, DONE, id="minimal"),
    pytest.param(
        "subagent",
        {
            "prompt": "p",
            "provider": "acp",
            "output_schema": None,
            "depth_limit": None,
            "tool_filter": None,
            "persona": None,
            "background": None,
        },
        DONE,  # by acp, which would refuse any feature requested
        id="every-optional-argument-null-means-left-out",
    ),
    pytest.param("subagent", {"prompt": "p", "provider": "spawn", "depth_limit": 0}, DONE, id="depth-0"),
    pytest.param("subagent", {"prompt": "p", "provider": "spawn", "depth_limit": 2.0}, DONE, id="depth-2.0"),
    pytest.param(
        "subagent",
        {"prompt": "p", "provider": "spawn", "tool_filter": {"allow": None, "deny": ["bash"]}, "persona": ""},
        DONE,
        id="tool-filter-with-a-null-list",
    ),
    pytest.param("subagent", {"prompt": "x" * 1_000_000, "provider": "spawn"}, DONE, id="a-huge-prompt"),
    pytest.param(
        "subagent",
        "",
        refused(
            'missing argument "prompt" (a non-blank string)',
            'missing argument "provider" (one of "acp", "spawn")',
        ),
        id="empty-text",
    ),
    # -- the tool: wrong types and values -------------------------------------------------------------
    pytest.param(
        "subagent",
        {"prompt": "p", "provider": "spawn", "depth_limit": "3"},
        refused('depth_limit: expected an integer >= 0 or null, got "3"'),
        id="depth-as-a-string",
    ),
    pytest.param(
        "subagent",
        {"prompt": "p", "provider": "spawn", "depth_limit": -1},
        refused("depth_limit: expected an integer >= 0 or null, got -1"),
        id="negative-depth",
    ),
    pytest.param(
        "subagent",
        {"prompt": "p", "provider": "spawn", "depth_limit": 1.5},
        refused("depth_limit: expected an integer >= 0 or null, got 1.5"),
        id="fractional-depth",
    ),
    pytest.param(
        "subagent",
        {"prompt": "p", "provider": "spawn", "depth_limit": True},
        refused("depth_limit: expected an integer >= 0 or null, got true"),
        id="boolean-depth",
    ),
    pytest.param(
        "subagent",
        {"prompt": "p", "provider": "spawn", "depth_limit": -(10**400)},
        refused("depth_limit: expected an integer >= 0 or null, got an integer too long to show"),
        id="a-huge-negative-depth",
    ),
    pytest.param(
        "subagent",
        {"prompt": " \n", "provider": "spawn"},
        refused('prompt: expected a non-blank string, got " \\n"'),
        id="blank-prompt",
    ),
    pytest.param(
        "subagent",
        {"prompt": None, "provider": "spawn"},
        refused("prompt: expected a non-blank string, got null"),
        id="null-prompt",
    ),
    pytest.param(
        "subagent",
        {"prompt": "p", "provider": "ACP"},
        refused('provider: expected one of "acp", "spawn", got "ACP"'),
        id="unregistered-provider",
    ),
    pytest.param(
        "subagent",
        {"prompt": "p", "provider": ["acp"]},
        refused('provider: expected one of "acp", "spawn", got an array'),
        id="provider-not-a-string",
    ),
    pytest.param(
        "subagent",
        {"prompt": "p", "provider": "p" * 100_000},
        refused('provider: expected one of "acp", "spawn", got a string of 100000 characters'),
        id="a-huge-provider-is-not-echoed",
    ),
    pytest.param(
        "subagent",
        {"prompt": "p", "provider": "spawn", "output_schema": '{"type": "object"}'},
        refused('output_schema: expected an object or null, got "{\\"type\\": \\"object\\"}"'),
        id="output-schema-as-text",
    ),
    pytest.param(
        "subagent",
        {"prompt": "p", "provider": "spawn", "persona": 7},
        refused("persona: expected a string or null, got 7"),
        id="persona-not-a-string",
    ),
    pytest.param(
        "subagent",
        {"prompt": "p", "provider": "spawn", "background": "yes"},
        refused('background: expected true or false or null, got "yes"'),
        id="background-not-a-boolean",
    ),
    # -- the tool: nested wrong types in tool_filter --------------------------------------------------
    pytest.param(
        "subagent",
        {"prompt": "p", "provider": "spawn", "tool_filter": ["bash"]},
        refused("tool_filter: expected an object or null, got an array"),
        id="tool-filter-not-an-object",
    ),
    pytest.param(
        "subagent",
        {"prompt": "p", "provider": "spawn", "tool_filter": {"allow": ["read", "edit", 3], "only": []}},
        refused(
            "tool_filter.allow[2]: expected a string, got 3",
            'tool_filter: unknown key "only"; it takes "allow", "deny"',
        ),
        id="tool-filter-wrong-item-and-unknown-key",
    ),
    pytest.param(
        "subagent",
        {"prompt": "p", "provider": "spawn", "tool_filter": {"allow": "bash", "deny": [1]}},
        refused(
            'tool_filter.allow: expected an array of strings or null, got "bash"',
            "tool_filter.deny[0]: expected a string, got 1",
        ),
        id="tool-filter-lists",
    ),
    pytest.param(
        "subagent",
        {"prompt": "p", "provider": "spawn", "tool_filter": {"deny": list(range(10_000))}},
        refused(
            *(
                f"tool_filter.deny[{index}]: expected a string, got {index}"
                for index in range(MAX_ARGUMENT_PROBLEMS)
            ),
            "more problems are not listed",
        ),
        id="ten-thousand-wrong-items-are-not-all-listed",
    ),
    # -- the tool: unknown arguments ------------------------------------------------------------------
    pytest.param(
        "subagent",
        {"promt": "p", "provider": "spawn"},
        refused(
            'missing argument "prompt" (a non-blank string)',
            f'unknown argument "promt"; the tool takes {TAKES}',
        ),
        id="misspelt-argument",
    ),
    pytest.param(
        "subagent",
        {"prompt": "p", "provider": "spawn", "cwd": "/", "timeout": 30},
        refused(f'unknown arguments "cwd", "timeout"; the tool takes {TAKES}'),
        id="arguments-the-host-fixes",
    ),
    pytest.param(
        "subagent",
        {"prompt": "p", "provider": "spawn", "k" * 100_000: 1},
        refused(f'unknown argument "{"k" * 39}\u2026"; the tool takes {TAKES}'),
        id="a-huge-key-is-cut",
    ),
    pytest.param(
        "subagent",
        {"prompt": None, "provider": "nope", "depth_limit": -3, "extra": 1},
        refused(
            "prompt: expected a non-blank string, got null",
            'provider: expected one of "acp", "spawn", got "nope"',
            "depth_limit: expected an integer >= 0 or null, got -3",
            f'unknown argument "extra"; the tool takes {TAKES}',
        ),
        id="every-problem-at-once",
    ),
    # -- the tool: not an object, not JSON ------------------------------------------------------------
    pytest.param(
        "subagent",
        ["summarise", "spawn"],
        refused("the arguments: expected an object, got an array"),
        id="an-array",
    ),
    pytest.param(
        "subagent",
        '"just a prompt"',
        refused('the arguments: expected an object, got "just a prompt"'),
        id="a-string",
    ),
    pytest.param(
        "subagent",
        '{"prompt": "p", provider: "spawn"}',
        refused(
            "the arguments are not valid JSON: Expecting property name enclosed in double quotes: "
            "line 1 column 17 (char 16)"
        ),
        id="not-json",
    ),
    pytest.param(
        "subagent",
        '{"prompt": "p", "provider": "spawn", "depth_limit": NaN}',
        refused("the arguments are not valid JSON: NaN is not a JSON number"),
        id="nan",
    ),
    pytest.param(
        "subagent",
        '{"prompt": "p", "provider": "spawn", "depth_limit": 1e400}',
        refused("the arguments are not valid JSON: the number 1e400 is too large"),
        id="a-number-beyond-floats",
    ),
    pytest.param(
        "subagent",
        '{"output_schema": ' + "[" * 100_000 + "]" * 100_000 + "}",
        refused("the arguments are nested too deeply to decode"),
        id="nested-too-deeply",
    ),
    # -- the tool: a rule across two arguments, which the schema does not state ----------------------
    pytest.param(
        "subagent",
        {"prompt": "p", "provider": "acp", "persona": "a critic"},
        Verdict(
            'unsupported parameters for provider "acp", no subagent was started:\n'
            '- `persona` is not supported by "acp"; providers that support it: "spawn".'
        ),
        id="a-feature-the-chosen-provider-lacks",
    ),
    # -- the companions -------------------------------------------------------------------------------
    pytest.param("subagent_list", {}, accepted("You have no background subagents."), id="list"),
    pytest.param(
        "subagent_list",
        {"handle": "x"},
        refused('unknown argument "handle"; the tool takes none'),
        id="list-takes-nothing",
    ),
    pytest.param(
        "subagent_wait",
        {"handles": None, "mode": None, "timeout": None},
        accepted("You have no background subagent whose result you have not received."),
        id="wait-with-nulls",
    ),
    pytest.param(
        "subagent_wait",
        {"handles": ["h1"], "mode": "all", "timeout": 0},
        Verdict("no background subagent of yours has the handle 'h1'"),
        id="wait-for-an-unknown-handle",
    ),
    pytest.param(
        "subagent_wait",
        {"handles": "a", "mode": "some", "timeout": -1},
        refused(
            'handles: expected an array of strings or null, got "a"',
            'mode: expected one of "any", "all", null, got "some"',
            "timeout: expected a number >= 0 or null, got -1",
        ),
        id="wait-with-wrong-types",
    ),
    pytest.param(
        "subagent_wait",
        {"handles": ["a", 1]},
        refused("handles[1]: expected a string, got 1"),
        id="wait-with-a-wrong-handle",
    ),
    pytest.param(
        "subagent_wait",
        '{"timeout": Infinity}',
        refused("the arguments are not valid JSON: Infinity is not a JSON number"),
        id="wait-forever",
    ),
    pytest.param(
        "subagent_send",
        {"handle": "", "extra": 1},
        refused(
            'handle: expected a non-blank string, got ""',
            'missing argument "message" (a non-blank string)',
            'unknown argument "extra"; the tool takes "handle", "message"',
        ),
        id="send-with-everything-wrong",
    ),
    pytest.param(
        "subagent_send",
        {"handle": "h1", "message": "  "},
        refused('message: expected a non-blank string, got "  "'),
        id="send-a-blank-message",
    ),
    pytest.param(
        "subagent_cancel",
        {},
        refused('missing argument "handle" (a non-blank string)'),
        id="cancel-without-a-handle",
    ),
    pytest.param(
        "subagent_cancel",
        {"handle": "h1"},
        Verdict("no background subagent of yours has the handle 'h1'"),
        id="cancel-an-unknown-handle",
    ),
    pytest.param(
        "subagent_result",
        {"handle": None},
        refused("handle: expected a non-blank string, got null"),
        id="result-of-null",
    ),
    pytest.param(
        "subagent_result",
        {"handle": "h" * 50_000},
        Verdict(f"no background subagent of yours has the handle '{'h' * 39}\u2026'"),
        id="result-of-a-huge-handle",
    ),
]


@dataclass
class Bench:
    service: SubagentService
    tool: SubagentTool
    acp: FakeProvider
    spawn: FakeProvider

    @property
    def runs(self) -> int:
        return len(self.acp.runs) + len(self.spawn.runs)


@asynccontextmanager
async def open_bench() -> AsyncIterator[Bench]:
    """A tool with background delegation over ``acp`` (no feature) and ``spawn`` (every feature),
    whose children answer ``done``. On exit, asserts that no task was left running."""
    before = {task.id for task in anyio.get_running_tasks()}
    acp = FakeProvider(name="acp", autopilot=completes("done"))
    spawn = FakeProvider(name="spawn", capabilities=ALL_FEATURES, autopilot=completes("done"))
    async with SubagentService() as service:
        service.register_provider(acp)
        service.register_provider(spawn)
        async with SubagentTool(service, background=BackgroundOptions()) as tool:
            yield Bench(service, tool, acp, spawn)
    assert {task.id for task in anyio.get_running_tasks()} == before


async def through_execute(tool: SubagentTool, tool_name: str, arguments: Any) -> str:
    """The text the model reads from the tool called by a host (``execute``/``execute_companion``)."""
    with anyio.fail_after(WAIT):
        if tool_name == "subagent":
            result = await tool.execute(arguments)
        else:
            result = await tool.execute_companion(tool_name, arguments)
    if result.render().startswith("Error: invalid arguments"):
        # The model's mistake, not the seam's: no code, and nothing ran.
        assert (result.error_code, result.stop_reason, result.run_id, result.provider) == (None,) * 4
    return result.render()


async def through_agent(tool: SubagentTool, tool_name: str, arguments: Any) -> str:
    """The text an in-process agent's model reads back from its call of the tool."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    llm = ScriptedLlm([Reply(tool_calls=[ToolCall("c1", tool_name, text)]), Reply("noted")])
    agent = Agent(llm=llm, tools=tool.agent_tools())
    try:
        with anyio.fail_after(WAIT):
            await agent.run_turn("go")
    finally:
        await agent.close()
    return agent.messages[2].content


def as_seen(verdict: Verdict, prefix: str) -> str:
    return f"{prefix}{verdict.text}" if verdict.is_refusal else verdict.text


@pytest.mark.parametrize(("tool_name", "arguments", "verdict"), CASES)
async def test_every_entry_point_gives_the_same_verdict_in_the_same_words(
    tool_name: str, arguments: Any, verdict: Verdict
) -> None:
    async with open_bench() as bench:
        from_host = await through_execute(bench.tool, tool_name, arguments)
        started_by_execute = bench.runs
        from_agent = await through_agent(bench.tool, tool_name, arguments)
        started_by_agent = bench.runs - started_by_execute

    assert from_host == as_seen(verdict, "Error: ")
    assert from_agent == as_seen(verdict, "error: ")

    # A refusal starts nothing; an accepted call of the tool starts one child, the same way each time.
    expected_runs = 1 if tool_name == "subagent" and not verdict.is_refusal else 0
    assert (started_by_execute, started_by_agent) == (expected_runs, expected_runs)
    if expected_runs:
        host_run, agent_run = (bench.acp.runs or bench.spawn.runs)[-2:]
        fields = ("prompt", "output_schema", "depth_limit", "tool_filter", "persona")
        assert [getattr(host_run.request, name) for name in fields] == [
            getattr(agent_run.request, name) for name in fields
        ]
    # However large the arguments: the lead, at most MAX_ARGUMENT_PROBLEMS lines and the "more" line.
    assert len(from_host) <= 100 + (MAX_ARGUMENT_PROBLEMS + 1) * (MAX_PROBLEM_CHARS + 3)


async def test_null_depth_limit_sets_no_limit_of_its_own_and_2_0_is_the_integer_2() -> None:
    async with open_bench() as bench:
        for depth_limit in (None, 2.0):
            arguments = {"prompt": "p", "provider": "spawn", "depth_limit": depth_limit}
            assert await through_execute(bench.tool, "subagent", arguments) == "done"
            assert await through_agent(bench.tool, "subagent", arguments) == "done"
        requested = [run.request for run in bench.spawn.runs]
    assert [(r.depth_limit, type(r.depth_limit)) for r in requested] == [
        (None, type(None)),
        (None, type(None)),
        (2, int),
        (2, int),
    ]
    assert [r.requested_features() for r in requested] == [(), (), ("depth_limit",), ("depth_limit",)]
    assert [r.lineage.depth_budget if r.lineage else "?" for r in requested] == [None, None, 2, 2]


async def test_a_tool_filter_with_a_null_allow_list_allows_every_tool_and_denies_the_listed() -> None:
    async with open_bench() as bench:
        arguments = {"prompt": "p", "provider": "spawn", "tool_filter": {"allow": None, "deny": ["bash"]}}
        assert await through_execute(bench.tool, "subagent", arguments) == "done"
    assert bench.spawn.runs[0].request.tool_filter == ToolFilter(allow=None, deny=frozenset({"bash"}))


async def test_a_non_finite_number_a_host_passes_in_a_mapping_is_refused_like_one_in_json_text() -> None:
    async with open_bench() as bench:
        text = await through_execute(bench.tool, "subagent_wait", {"timeout": float("nan")})
        assert text == "Error: " + invalid("timeout: expected a number >= 0 or null, got NaN")
        text = await through_execute(
            bench.tool, "subagent", {"prompt": "p", "provider": "spawn", "depth_limit": float("inf")}
        )
        assert text == "Error: " + invalid("depth_limit: expected an integer >= 0 or null, got Infinity")
    assert bench.runs == 0


async def test_a_feature_no_registered_provider_supports_is_not_an_argument_anywhere() -> None:
    acp = FakeProvider(name="acp", autopilot=completes("done"))
    async with SubagentService() as service:
        service.register_provider(acp)
        with SubagentTool(service) as tool:
            assert "depth_limit" not in tool.definition.input_schema["properties"]
            arguments = {"prompt": "p", "provider": "acp", "depth_limit": None}
            expected = invalid('unknown argument "depth_limit"; the tool takes "prompt", "provider"')
            assert await through_execute(tool, "subagent", arguments) == f"Error: {expected}"
            assert await through_agent(tool, "subagent", arguments) == f"error: {expected}"
    assert acp.start_calls == 0


async def test_with_no_provider_registered_bad_arguments_are_refused_and_good_ones_find_no_provider() -> None:
    async with SubagentService() as service:
        with SubagentTool(service) as tool, anyio.fail_after(WAIT):
            missing = await tool.execute({})
            unrunnable = await tool.execute({"prompt": "p", "provider": "acp"})
    assert missing.render() == "Error: " + invalid(
        'missing argument "prompt" (a non-blank string)', 'missing argument "provider" (a string)'
    )
    assert (
        unrunnable.render()
        == "Error: no subagent provider is registered right now, so no subagent can be started."
    )


# -- the wording table, for any tool's schema --------------------------------------------------------


WORDED = [
    pytest.param(
        {"type": "string", "minLength": 1}, 5, "expected a non-empty string, got 5", id="min-length-1"
    ),
    pytest.param(
        {"type": "string", "minLength": 3, "maxLength": 5},
        "ab",
        'expected a string of at least 3 characters and of at most 5 characters, got "ab"',
        id="lengths",
    ),
    pytest.param(
        {"type": "string", "pattern": "^[a-z]+$"},
        "A",
        'expected a string matching "^[a-z]+$", got "A"',
        id="pattern",
    ),
    pytest.param(
        {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        2,
        "expected a number > 0 and <= 1, got 2",
        id="bounds",
    ),
    pytest.param(
        {"type": "integer", "multipleOf": 5},
        7,
        "expected an integer that is a multiple of 5, got 7",
        id="multiple",
    ),
    pytest.param(
        {"type": "array", "items": {"type": "integer"}, "maxItems": 1, "uniqueItems": True},
        [1, 2],
        "expected an array of integers of at most 1 items and without repeats, got an array",
        id="array",
    ),
    pytest.param({"const": "on"}, "off", 'expected "on", got "off"', id="const"),
    pytest.param(
        {"enum": list(range(12))},
        99,
        "expected one of 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, ..., got 99",
        id="long-enum",
    ),
    pytest.param(
        {"anyOf": [{"type": "string"}, {"type": "integer", "minimum": 1}]},
        0,
        "expected a string or an integer >= 1, got 0",
        id="any-of",
    ),
    pytest.param({"type": "object"}, {}, None, id="valid"),
    pytest.param(
        {"not": {"type": "string"}}, "s", "'s' should not be valid under {'type': 'string'}", id="unworded"
    ),
]


@pytest.mark.parametrize(("schema", "value", "problem"), WORDED)
def test_the_wording_table_says_what_any_schema_allows(
    schema: Mapping[str, Any], value: Any, problem: str | None
) -> None:
    full = {"type": "object", "properties": {"x": schema}}
    if problem is None:
        assert parse_arguments({"x": value}, full) == {"x": value}
        return
    with pytest.raises(InvalidArguments) as refused:
        parse_arguments({"x": value}, full)
    assert refused.value.problems == (f"x: {problem}",)
    assert str(refused.value) == invalid(f"x: {problem}")


async def test_a_function_tool_with_a_draft_7_schema_is_checked_by_draft_7() -> None:
    # Draft 7 reads `items` as a list as one schema per position; 2020-12 would refuse the schema.
    ran: list[Any] = []
    schema = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "properties": {"pair": {"type": "array", "items": [{"type": "string"}, {"type": "integer"}]}},
    }

    def take(arguments: Mapping[str, Any]) -> str:
        ran.append(arguments)
        return "ok"

    tool = FunctionTool("pair", "Takes a pair.", schema, take)
    llm = ScriptedLlm(
        [
            Reply(
                tool_calls=[
                    call("pair", {"pair": ["a", "b"]}, id="c1"),
                    call("pair", {"pair": ["a", 1]}, id="c2"),
                ]
            ),
            Reply("noted"),
        ]
    )
    agent = Agent(llm=llm, tools=[tool])
    with anyio.fail_after(WAIT):
        await agent.run_turn("go")
    await agent.close()
    assert [message.content for message in agent.messages[2:4]] == [
        "error: " + invalid('pair[1]: expected an integer, got "b"'),
        "ok",
    ]
    assert [thaw_json(arguments) for arguments in ran] == [{"pair": ["a", 1]}]


@pytest.fixture
def schema_checks(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every schema checked against the 2020-12 metaschema while the test runs."""
    import jsonschema

    checked: list[object] = []
    original = jsonschema.Draft202012Validator.check_schema

    def counting(schema: Any, *args: Any, **kwargs: Any) -> None:
        checked.append(schema)
        original(schema, *args, **kwargs)

    monkeypatch.setattr(jsonschema.Draft202012Validator, "check_schema", staticmethod(counting))
    return checked


async def test_a_function_tools_schema_is_checked_once_however_often_it_is_called(
    schema_checks: list[object],
) -> None:
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object"}
    tool = FunctionTool("count", "Count.", schema, lambda arguments: "counted")
    llm = ScriptedLlm([Reply(tool_calls=[call("count", id=f"c{n}") for n in range(3)]), "Done."])
    agent = Agent(llm=llm, tools=[tool])
    with anyio.fail_after(WAIT):
        result = await agent.run_turn("Count thrice.")
    await agent.close()
    assert result.output == "Done."
    assert [m.content for m in agent.messages if m.role == "tool"] == ["counted"] * 3
    assert len(schema_checks) == 1


async def test_the_subagent_tools_schema_is_checked_once_however_often_it_is_called(
    schema_checks: list[object],
) -> None:
    # A provider name no other test uses: a schema the validators' cache has not seen.
    provider = FakeProvider(name=f"p-{uuid.uuid4().hex}", autopilot=completes("done"))
    async with SubagentService() as service:
        service.register_provider(provider)
        with SubagentTool(service) as tool, anyio.fail_after(WAIT):
            outcomes = [await tool.execute({"prompt": "p", "provider": provider.name}) for _ in range(3)]
    assert [outcome.render() for outcome in outcomes] == ["done"] * 3
    assert len(schema_checks) == 1
