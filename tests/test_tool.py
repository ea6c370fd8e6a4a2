"""The model-facing `subagent` tool, against in-memory fake providers, on asyncio and trio."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from subagent import (
    ErrorCode,
    SubagentCapabilities,
    SubagentError,
    SubagentRequest,
    SubagentResult,
    SubagentService,
    ToolFilter,
    Usage,
)
from subagent.tool import DEFAULT_TOOL_NAME, SubagentTool, SubagentToolResult, ToolDefinition
from subagent.types import thaw_json
from tests.fakes import FakeProvider, FakeRun

pytestmark = pytest.mark.anyio

WAIT = 5  # seconds; a bound on every wait, never a sleep

ALL_FEATURES = SubagentCapabilities(output_schema=True, depth_limit=True, tool_filter=True)

INTRO = (
    "Delegate a task to a subagent: another agent that works on `prompt` by itself and returns its final "
    "answer as this tool's result. It cannot ask you questions while it works, so state the task "
    "completely, including the form of the answer you want."
)
ERROR_NOTE = (
    'If the subagent does not finish its task, the result starts with "Error:", says why, and includes '
    "any partial output."
)
FRESH = "starts fresh and does not see this conversation, so `prompt` must carry everything it needs."
INHERITED = "sees this conversation's earlier turns, so `prompt` may refer to them."
EVERY_FEATURE = "`output_schema`, `depth_limit`, `tool_filter`, `persona`"

PROMPT_PROPERTY = {
    "type": "string",
    "pattern": r"\S",
    "description": "The complete task for the subagent, including the form of the answer you want.",
}
PROVIDER_DESCRIPTION = (
    "Which provider runs the subagent; the tool description says what each one sees and accepts."
)
OUTPUT_SCHEMA_DESCRIPTION = (
    "A JSON Schema the subagent's final answer must satisfy; the answer comes back as the validated "
    "JSON value."
)
DEPTH_LIMIT_DESCRIPTION = (
    "How many levels of subagents the subagent may start below itself; 0 forbids it to delegate, null "
    "(like leaving it out) sets no limit of its own."
)
TOOL_FILTER_DESCRIPTION = (
    "Narrows the subagent's tools, which are otherwise yours; it can never gain a tool you lack."
)
PERSONA_DESCRIPTION = 'A system prompt giving the subagent its role, e.g. "a meticulous code reviewer".'


def tool_filter_property(description: str) -> dict[str, Any]:
    return {
        "type": ["object", "null"],
        "description": description,
        "properties": {
            "allow": {
                "type": ["array", "null"],
                "items": {"type": "string"},
                "description": "Only these of your tools (default: all of them).",
            },
            "deny": {
                "type": ["array", "null"],
                "items": {"type": "string"},
                "description": "Tools to take away.",
            },
        },
        "additionalProperties": False,
    }


def object_schema(properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": ["prompt", "provider"],
        "additionalProperties": False,
    }


def running_task_ids() -> set[int]:
    return {task.id for task in anyio.get_running_tasks()}


@asynccontextmanager
async def open_service(*providers: FakeProvider) -> AsyncIterator[SubagentService]:
    """An open service with `providers` registered; on exit, asserts no task was left running."""
    before = running_task_ids()
    async with SubagentService() as service:
        for provider in providers:
            service.register_provider(provider)
        yield service
    assert running_task_ids() == before


def the_standard_three() -> tuple[FakeProvider, FakeProvider, FakeProvider]:
    """The providers of DESIGN.md's table: acp (no features), spawn and fork (every feature)."""
    return (
        FakeProvider(name="acp"),
        FakeProvider(name="spawn", capabilities=ALL_FEATURES),
        FakeProvider(name="fork", capabilities=ALL_FEATURES, inherits_parent_context=True),
    )


def finish_with(result: SubagentResult) -> Callable[[FakeRun], None]:
    def drive(run: FakeRun) -> None:
        run.make_ready()
        run.finish(result)

    return drive


async def execute_driven(
    tool: SubagentTool,
    provider: FakeProvider,
    arguments: Any,
    drive: Callable[[FakeRun], None],
) -> SubagentToolResult:
    """Call `execute` in a task; once everything waits on the child, drive the fake run; return the result."""
    outcome: list[SubagentToolResult] = []

    async def call() -> None:
        outcome.append(await tool.execute(arguments))

    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await anyio.wait_all_tasks_blocked()
            assert outcome == [], "execute returned before its child settled"
            drive(provider.runs[-1])
    (result,) = outcome
    return result


def assert_disposed(service: SubagentService, run: FakeRun) -> None:
    assert run.dispose_calls == 1
    assert not run.child_running()
    assert service.live_runs == ()


# -- the definition: wording derived from the registry -----------------------------------------------


def test_the_description_lists_exactly_the_registered_providers_with_truthful_context_and_features() -> None:
    service = SubagentService()
    for provider in the_standard_three():
        service.register_provider(provider)
    tool = SubagentTool(service)

    assert tool.definition.name == DEFAULT_TOOL_NAME == "subagent"
    assert tool.definition.description == (
        f"{INTRO}\n\n"
        "Providers (set `provider` to one of them):\n"
        f'- "acp": {FRESH} Optional parameters: none.\n'
        f'- "spawn": {FRESH} Optional parameters: {EVERY_FEATURE}.\n'
        f'- "fork": {INHERITED} Optional parameters: {EVERY_FEATURE}.\n\n'
        f"{ERROR_NOTE}"
    )


def test_the_schema_enumerates_the_registered_names_and_marks_features_only_some_providers_support() -> None:
    service = SubagentService()
    for provider in the_standard_three():
        service.register_provider(provider)
    service.register_provider(
        FakeProvider(name="schema-only", capabilities=SubagentCapabilities(output_schema=True))
    )
    tool = SubagentTool(service)

    assert tool.definition.input_schema == object_schema(
        {
            "prompt": PROMPT_PROPERTY,
            "provider": {
                "type": "string",
                "enum": ["acp", "spawn", "fork", "schema-only"],
                "description": PROVIDER_DESCRIPTION,
            },
            "output_schema": {
                "type": ["object", "null"],
                "description": (
                    f'{OUTPUT_SCHEMA_DESCRIPTION} Supported only by "spawn", "fork", "schema-only".'
                ),
            },
            "depth_limit": {
                "type": ["integer", "null"],
                "minimum": 0,
                "description": f'{DEPTH_LIMIT_DESCRIPTION} Supported only by "spawn", "fork".',
            },
            "tool_filter": tool_filter_property(
                f'{TOOL_FILTER_DESCRIPTION} Supported only by "spawn", "fork".'
            ),
            "persona": {
                "type": ["string", "null"],
                "description": f'{PERSONA_DESCRIPTION} Supported only by "spawn", "fork".',
            },
        }
    )


def test_a_feature_every_provider_supports_carries_no_support_note() -> None:
    service = SubagentService()
    service.register_provider(FakeProvider(name="spawn", capabilities=ALL_FEATURES))
    tool = SubagentTool(service)

    assert tool.definition.input_schema == object_schema(
        {
            "prompt": PROMPT_PROPERTY,
            "provider": {"type": "string", "enum": ["spawn"], "description": PROVIDER_DESCRIPTION},
            "output_schema": {"type": ["object", "null"], "description": OUTPUT_SCHEMA_DESCRIPTION},
            "depth_limit": {
                "type": ["integer", "null"],
                "minimum": 0,
                "description": DEPTH_LIMIT_DESCRIPTION,
            },
            "tool_filter": tool_filter_property(TOOL_FILTER_DESCRIPTION),
            "persona": {"type": ["string", "null"], "description": PERSONA_DESCRIPTION},
        }
    )


def test_feature_properties_appear_and_disappear_with_provider_support() -> None:
    service = SubagentService()
    tool = SubagentTool(service)

    def offered() -> list[str]:
        return list(tool.definition.input_schema["properties"])

    service.register_provider(FakeProvider(name="acp"))
    assert offered() == ["prompt", "provider"]
    remove_depth = service.register_provider(
        FakeProvider(name="deep", capabilities=SubagentCapabilities(depth_limit=True))
    )
    assert offered() == ["prompt", "provider", "depth_limit"]
    remove_filter = service.register_provider(
        FakeProvider(name="filtering", capabilities=SubagentCapabilities(tool_filter=True))
    )
    assert offered() == ["prompt", "provider", "depth_limit", "tool_filter", "persona"]
    remove_depth()
    assert offered() == ["prompt", "provider", "tool_filter", "persona"]
    remove_filter()
    assert offered() == ["prompt", "provider"]


def test_the_definition_follows_registration_and_removal_and_reports_each_change() -> None:
    service = SubagentService()
    changes: list[ToolDefinition] = []
    tool = SubagentTool(service, on_change=changes.append)
    assert tool.version == 0

    def enum() -> Any:
        return tool.definition.input_schema["properties"]["provider"].get("enum")

    remove_acp = service.register_provider(FakeProvider(name="acp"))
    assert (tool.version, enum()) == (1, ["acp"])
    service.register_provider(FakeProvider(name="fork", inherits_parent_context=True))
    assert (tool.version, enum()) == (2, ["acp", "fork"])
    remove_acp()
    assert (tool.version, enum()) == (3, ["fork"])
    assert tool.definition.description == (
        f"{INTRO}\n\nProviders (set `provider` to one of them):\n"
        f'- "fork": {INHERITED} Optional parameters: none.\n\n{ERROR_NOTE}'
    )
    # Each callback got the definition as it was right after its change.
    assert [change.input_schema["properties"]["provider"]["enum"] for change in changes] == [
        ["acp"],
        ["acp", "fork"],
        ["fork"],
    ]
    assert changes[-1] == tool.definition
    remove_acp()  # idempotent disposer: no event, no change
    assert tool.version == 3
    assert len(changes) == 3


def test_reregistering_a_name_with_different_capabilities_rewords_the_tool() -> None:
    service = SubagentService()
    tool = SubagentTool(service)
    remove = service.register_provider(FakeProvider(name="worker"))
    before = tool.definition
    remove()
    service.register_provider(
        FakeProvider(
            name="worker",
            capabilities=SubagentCapabilities(output_schema=True),
            inherits_parent_context=True,
        )
    )

    assert f'- "worker": {FRESH} Optional parameters: none.' in before.description
    assert f'- "worker": {INHERITED} Optional parameters: `output_schema`.' in tool.definition.description
    assert list(before.input_schema["properties"]) == ["prompt", "provider"]
    assert list(tool.definition.input_schema["properties"]) == ["prompt", "provider", "output_schema"]
    assert tool.version == 3


async def test_with_no_provider_the_tool_says_so_and_a_call_gives_an_error_result() -> None:
    async with open_service() as service:
        tool = SubagentTool(service)

        assert not tool.available
        assert tool.definition.description == (
            f"{INTRO}\n\nNo subagent provider is registered right now, so this tool cannot start a "
            "subagent; a call returns an error."
        )
        assert tool.definition.input_schema == object_schema(
            {
                "prompt": PROMPT_PROPERTY,
                "provider": {
                    "type": "string",
                    "description": "No provider is registered now; the tool cannot run.",
                },
            }
        )
        with anyio.fail_after(WAIT):
            result = await tool.execute({"prompt": "summarise", "provider": "acp"})

    assert result == SubagentToolResult(
        is_error=True,
        error="no subagent provider is registered right now, so no subagent can be started.",
        error_code=ErrorCode.NO_PROVIDER,
    )
    assert result.render() == (
        "Error: no subagent provider is registered right now, so no subagent can be started."
    )


def test_close_stops_following_the_registry_and_removes_its_listeners() -> None:
    service = SubagentService()
    service.register_provider(FakeProvider(name="acp"))
    listeners_before = (
        service.events.listener_count("subagent/provider-added"),
        service.events.listener_count("subagent/provider-removed"),
    )
    changes: list[ToolDefinition] = []
    with SubagentTool(service, on_change=changes.append) as tool:
        assert service.events.listener_count("subagent/provider-added") == listeners_before[0] + 1
        assert service.events.listener_count("subagent/provider-removed") == listeners_before[1] + 1
        frozen = tool.definition
    assert tool.closed
    assert (
        service.events.listener_count("subagent/provider-added"),
        service.events.listener_count("subagent/provider-removed"),
    ) == listeners_before

    service.register_provider(FakeProvider(name="spawn"))
    assert tool.definition == frozen
    assert tool.version == 0
    assert changes == []
    tool.close()  # idempotent
    assert tool.closed


def test_an_on_change_callback_that_raises_is_logged_and_the_tool_still_updates(
    caplog: pytest.LogCaptureFixture,
) -> None:
    service = SubagentService()

    def broken(definition: ToolDefinition) -> None:
        raise RuntimeError("host bug")

    tool = SubagentTool(service, on_change=broken)
    with caplog.at_level(logging.ERROR, logger="subagent.events"):
        service.register_provider(FakeProvider(name="acp"))

    assert tool.version == 1
    assert tool.definition.input_schema["properties"]["provider"]["enum"] == ["acp"]
    assert [record.getMessage() for record in caplog.records] == [
        "listener for subagent/provider-added raised; ignored"
    ]


def test_the_renderings_have_the_exact_shapes_of_each_tool_calling_format() -> None:
    definition = ToolDefinition(
        name="subagent",
        description="Delegate.",
        input_schema={"type": "object", "properties": {"prompt": {"type": "string"}}},
    )
    schema = {"type": "object", "properties": {"prompt": {"type": "string"}}}

    assert definition.to_openai() == {
        "type": "function",
        "function": {"name": "subagent", "description": "Delegate.", "parameters": schema},
    }
    assert definition.to_openai_responses() == {
        "type": "function",
        "name": "subagent",
        "description": "Delegate.",
        "parameters": schema,
    }
    assert definition.to_anthropic() == {
        "name": "subagent",
        "description": "Delegate.",
        "input_schema": schema,
    }
    assert definition.to_mcp() == {"name": "subagent", "description": "Delegate.", "inputSchema": schema}


def test_a_custom_tool_name_reaches_every_rendering() -> None:
    service = SubagentService()
    service.register_provider(FakeProvider(name="acp"))
    tool = SubagentTool(service, name="delegate_task")
    definition = tool.definition

    assert tool.name == "delegate_task"
    assert definition.to_openai()["function"]["name"] == "delegate_task"
    assert definition.to_anthropic()["name"] == "delegate_task"
    assert definition.to_openai()["function"]["parameters"] == definition.input_schema
    assert definition.to_anthropic()["input_schema"] == definition.input_schema


def test_the_definition_and_its_renderings_are_copies_the_host_may_change() -> None:
    service = SubagentService()
    service.register_provider(FakeProvider(name="acp"))
    tool = SubagentTool(service)
    pristine = tool.definition

    definition = tool.definition
    definition.input_schema["properties"]["provider"]["enum"].append("injected")
    openai = definition.to_openai()
    openai["function"]["parameters"]["properties"].clear()
    openai["function"]["strict"] = True

    assert tool.definition == pristine
    assert definition.input_schema["properties"]["prompt"] == PROMPT_PROPERTY


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"name": "sub agent"}, "a tool name must match ^[A-Za-z0-9_-]{1,64}$, got 'sub agent'"),
        ({"name": ""}, "a tool name must match ^[A-Za-z0-9_-]{1,64}$, got ''"),
        ({"name": "x" * 65}, "a tool name must match ^[A-Za-z0-9_-]{1,64}$, got '" + "x" * 65 + "'"),
        ({"timeout": 0}, "timeout must be > 0 seconds, got 0"),
        ({"timeout": -1.5}, "timeout must be > 0 seconds, got -1.5"),
        ({"timeout": float("nan")}, "timeout must be > 0 seconds, got nan"),
    ],
)
def test_a_name_the_apis_would_refuse_or_a_timeout_not_above_zero_is_refused_at_construction(
    options: dict[str, Any], message: str
) -> None:
    service = SubagentService()
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        SubagentTool(service, **options)
    assert str(caught.value) == message
    assert service.events.listener_count("subagent/provider-added") == 0


# -- execution: outcomes -----------------------------------------------------------------------------


async def test_a_completed_run_gives_a_success_result_with_the_exact_output_and_is_disposed() -> None:
    provider = FakeProvider(name="spawn")
    usage = Usage(input_tokens=12, output_tokens=34)
    async with open_service(provider) as service:
        tool = SubagentTool(service)
        result = await execute_driven(
            tool,
            provider,
            {"prompt": "Summarise README.md", "provider": "spawn"},
            finish_with(SubagentResult(output="It is a seam.", stop_reason="completed", usage=usage)),
        )
        fake = provider.runs[0]
        assert_disposed(service, fake)

    assert result == SubagentToolResult(
        is_error=False,
        output="It is a seam.",
        stop_reason="completed",
        run_id=fake.id,
        provider="spawn",
        usage=usage,
    )
    assert result.render() == result.text == "It is a seam."
    assert result.to_openai("call_1") == {
        "role": "tool",
        "tool_call_id": "call_1",
        "content": "It is a seam.",
    }
    assert result.to_anthropic("toolu_1") == {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": "It is a seam.",
        "is_error": False,
    }
    assert fake.request.prompt == "Summarise README.md"


async def test_a_completed_run_without_output_says_so_to_the_model() -> None:
    provider = FakeProvider(name="spawn")
    async with open_service(provider) as service:
        result = await execute_driven(
            SubagentTool(service),
            provider,
            {"prompt": "touch the file", "provider": "spawn"},
            finish_with(SubagentResult(output="", stop_reason="completed")),
        )
    assert not result.is_error
    assert result.output == ""
    assert result.render() == "(the subagent finished without output)"


async def test_a_completed_run_with_an_output_schema_returns_the_structured_value_as_json() -> None:
    provider = FakeProvider(name="spawn", capabilities=SubagentCapabilities(output_schema=True))
    schema = {"type": "object", "properties": {"count": {"type": "integer"}}, "required": ["count"]}
    async with open_service(provider) as service:
        result = await execute_driven(
            SubagentTool(service),
            provider,
            {"prompt": "count the files", "provider": "spawn", "output_schema": schema},
            finish_with(
                SubagentResult(
                    output='Here you are: {"count": 3, "note": "café"}',
                    stop_reason="completed",
                    structured={"count": 3, "note": "café"},
                )
            ),
        )
        assert thaw_json(provider.runs[0].request.output_schema) == schema
        assert_disposed(service, provider.runs[0])

    assert result.structured == {"count": 3, "note": "café"}
    assert result.output == 'Here you are: {"count": 3, "note": "café"}'
    assert result.render() == '{"count": 3, "note": "café"}'


async def test_a_structured_value_the_call_did_not_ask_for_is_not_passed_on() -> None:
    provider = FakeProvider(name="spawn")
    async with open_service(provider) as service:
        result = await execute_driven(
            SubagentTool(service),
            provider,
            {"prompt": "p", "provider": "spawn"},
            finish_with(SubagentResult(output="text", stop_reason="completed", structured={"stray": 1})),
        )
    assert result.structured is None
    assert result.render() == "text"


@pytest.mark.parametrize(
    ("result", "timeout", "rendered"),
    [
        (
            SubagentResult(output="Half of it", stop_reason="cancelled"),
            None,
            "Error: the subagent stopped before finishing (stop reason: cancelled): it was cancelled."
            "\n\nPartial output:\nHalf of it",
        ),
        (
            SubagentResult(
                output="Reading files",
                stop_reason="error",
                error="child exited with status 1; stderr tail: out of memory",
            ),
            None,
            "Error: the subagent stopped before finishing (stop reason: error): it failed: child exited "
            "with status 1; stderr tail: out of memory\n\nPartial output:\nReading files",
        ),
        (
            SubagentResult(output="", stop_reason="error"),
            None,
            "Error: the subagent stopped before finishing (stop reason: error): it failed."
            "\n\nIt produced no output.",
        ),
        (
            SubagentResult(output="Still thinking", stop_reason="timeout"),
            90.0,
            "Error: the subagent stopped before finishing (stop reason: timeout): it was silent for longer "
            "than the inactivity timeout (90 s) and was stopped.\n\nPartial output:\nStill thinking",
        ),
        (
            SubagentResult(output="Still thinking", stop_reason="timeout"),
            None,
            "Error: the subagent stopped before finishing (stop reason: timeout): it was silent for longer "
            "than the inactivity timeout and was stopped.\n\nPartial output:\nStill thinking",
        ),
        (
            SubagentResult(output="The list goes on: a, b, c", stop_reason="max_tokens"),
            None,
            "Error: the subagent stopped before finishing (stop reason: max_tokens): it reached its output "
            "token limit.\n\nPartial output:\nThe list goes on: a, b, c",
        ),
        (
            SubagentResult(output="Tried three fixes", stop_reason="max_turns"),
            None,
            "Error: the subagent stopped before finishing (stop reason: max_turns): it reached its limit on "
            "turns.\n\nPartial output:\nTried three fixes",
        ),
        (
            SubagentResult(output="I can't help with that.", stop_reason="refusal"),
            None,
            "Error: the subagent stopped before finishing (stop reason: refusal): it refused the task."
            "\n\nPartial output:\nI can't help with that.",
        ),
    ],
    ids=[
        "cancelled",
        "error",
        "error-without-diagnosis-or-output",
        "timeout",
        "timeout-of-the-provider",
        "max_tokens",
        "max_turns",
        "refusal",
    ],
)
async def test_each_non_completed_stop_reason_gives_an_error_result_with_partial_output_and_reason(
    result: SubagentResult, timeout: float | None, rendered: str
) -> None:
    provider = FakeProvider(name="spawn")
    async with open_service(provider) as service:
        tool = SubagentTool(service, timeout=timeout)
        outcome = await execute_driven(
            tool, provider, {"prompt": "do it", "provider": "spawn"}, finish_with(result)
        )
        assert_disposed(service, provider.runs[0])

    assert outcome.is_error
    assert outcome.stop_reason == result.stop_reason
    assert outcome.output == result.output
    assert outcome.error_code is None
    assert outcome.run_id == provider.runs[0].id
    assert outcome.provider == "spawn"
    assert outcome.render() == rendered
    assert outcome.to_anthropic("toolu_9") == {
        "type": "tool_result",
        "tool_use_id": "toolu_9",
        "content": rendered,
        "is_error": True,
    }


# -- execution: bad input from the model -------------------------------------------------------------

# Invalid arguments: through every entry point at once, in tests/test_tool_arguments.py.


@pytest.mark.parametrize(
    "arguments",
    [
        '{"prompt": "list the tests", "provider": "spawn", "depth_limit": 1}',
        b'{"prompt": "list the tests", "provider": "spawn", "depth_limit": 1}',
    ],
    ids=["str", "bytes"],
)
async def test_arguments_given_as_json_text_are_decoded_like_a_mapping(arguments: str | bytes) -> None:
    provider = FakeProvider(name="spawn", capabilities=ALL_FEATURES)
    async with open_service(provider) as service:
        result = await execute_driven(
            SubagentTool(service),
            provider,
            arguments,
            finish_with(SubagentResult(output="3 tests", stop_reason="completed")),
        )
    assert result.render() == "3 tests"
    assert provider.runs[0].request.prompt == "list the tests"
    assert provider.runs[0].request.depth_limit == 1


async def test_unsupported_features_give_an_error_naming_each_and_who_supports_it_and_start_nothing() -> None:
    acp = FakeProvider(name="acp")
    schema_only = FakeProvider(name="schema-only", capabilities=SubagentCapabilities(output_schema=True))
    spawn = FakeProvider(name="spawn", capabilities=ALL_FEATURES)
    async with open_service(acp, schema_only, spawn) as service:
        with anyio.fail_after(WAIT):
            result = await SubagentTool(service).execute(
                {"prompt": "p", "provider": "acp", "output_schema": {"type": "object"}, "persona": "a critic"}
            )

    assert result == SubagentToolResult(
        is_error=True,
        error='unsupported parameters for provider "acp", no subagent was started:\n'
        '- `output_schema` is not supported by "acp"; providers that support it: "schema-only", "spawn".\n'
        '- `persona` is not supported by "acp"; providers that support it: "spawn".',
        error_code=ErrorCode.UNSUPPORTED_CAPABILITY,
        provider="acp",
    )
    assert result.render() == f"Error: {result.error}"
    assert (acp.start_calls, schema_only.start_calls, spawn.start_calls) == (0, 0, 0)


# -- execution: seam failures -----------------------------------------------------------------------


async def test_a_readiness_failure_gives_a_start_failed_error_result_and_disposes_the_run() -> None:
    provider = FakeProvider(name="acp")
    crash = SubagentError(ErrorCode.START_FAILED, "agent exited with status 127: npx: not found")
    async with open_service(provider) as service:
        result = await execute_driven(
            SubagentTool(service),
            provider,
            {"prompt": "p", "provider": "acp"},
            lambda run: run.fail_ready(crash),
        )
        assert_disposed(service, provider.runs[0])

    assert result == SubagentToolResult(
        is_error=True,
        error="the subagent could not be started (START_FAILED): "
        "agent exited with status 127: npx: not found",
        error_code=ErrorCode.START_FAILED,
        run_id=provider.runs[0].id,
        provider="acp",
    )
    assert result.render() == f"Error: {result.error}"


async def test_a_provider_whose_start_raises_gives_a_start_failed_error_result() -> None:
    class BrokenProvider(FakeProvider):
        def start(self, request: SubagentRequest, task_group: Any) -> FakeRun:
            self.start_calls += 1
            raise OSError("no such executable")

    provider = BrokenProvider(name="acp")
    async with open_service(provider) as service:
        with anyio.fail_after(WAIT):
            result = await SubagentTool(service).execute({"prompt": "p", "provider": "acp"})

    assert result == SubagentToolResult(
        is_error=True,
        error="the subagent could not be started (START_FAILED): provider 'acp' failed to start a run: "
        "no such executable",
        error_code=ErrorCode.START_FAILED,
        provider="acp",
    )
    assert provider.start_calls == 1


async def test_a_subagent_error_from_the_result_gives_an_error_result_with_its_code() -> None:
    provider = FakeProvider(name="acp")

    def drive(run: FakeRun) -> None:
        run.make_ready()
        run.fail_result(SubagentError(ErrorCode.DISPOSED, "the session was torn down"))

    async with open_service(provider) as service:
        result = await execute_driven(
            SubagentTool(service), provider, {"prompt": "p", "provider": "acp"}, drive
        )
        assert_disposed(service, provider.runs[0])

    assert result == SubagentToolResult(
        is_error=True,
        error="the subagent run failed (DISPOSED): the session was torn down",
        error_code=ErrorCode.DISPOSED,
        run_id=provider.runs[0].id,
        provider="acp",
    )


async def test_a_result_that_raises_anything_else_propagates_after_the_run_is_disposed() -> None:
    provider = FakeProvider(name="acp")
    raised: list[BaseException] = []
    async with open_service(provider) as service:
        tool = SubagentTool(service)

        async def call() -> None:
            try:
                await tool.execute({"prompt": "p", "provider": "acp"})
            except LookupError as exc:
                raised.append(exc)

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                await anyio.wait_all_tasks_blocked()
                provider.runs[0].make_ready()
                provider.runs[0].fail_result(LookupError("provider bug"))
        assert_disposed(service, provider.runs[0])

    assert [str(exc) for exc in raised] == ["provider bug"]


async def test_a_call_on_a_closed_service_gives_a_disposed_error_result() -> None:
    provider = FakeProvider(name="acp")
    async with open_service(provider) as service:
        tool = SubagentTool(service)
    with anyio.fail_after(WAIT):
        result = await tool.execute({"prompt": "p", "provider": "acp"})

    assert result == SubagentToolResult(
        is_error=True,
        error="the subagent could not be started (DISPOSED): the subagent service is closed",
        error_code=ErrorCode.DISPOSED,
        provider="acp",
    )
    assert provider.start_calls == 0


# -- execution: disposal on cancellation --------------------------------------------------------------


@pytest.mark.parametrize("ready", [True, False], ids=["mid-run", "before-ready"])
async def test_cancelling_the_caller_disposes_the_run_and_the_cancellation_propagates(ready: bool) -> None:
    provider = FakeProvider(name="spawn")
    outcome: list[str] = []
    async with open_service(provider) as service:
        tool = SubagentTool(service)

        async def call() -> None:
            try:
                await tool.execute({"prompt": "p", "provider": "spawn"})
            except anyio.get_cancelled_exc_class():
                # Disposal happened before the cancellation reached us.
                outcome.append(f"cancelled, dispose_calls={provider.runs[0].dispose_calls}")
                raise
            outcome.append("returned")

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                await anyio.wait_all_tasks_blocked()
                fake = provider.runs[0]
                if ready:
                    fake.make_ready()
                    await anyio.wait_all_tasks_blocked()
                assert fake.child_running()
                assert outcome == []
                tg.cancel_scope.cancel()
        assert_disposed(service, fake)

    assert outcome == ["cancelled, dispose_calls=1"]
    assert fake.cancel_calls == 0  # torn down by dispose(), not asked to stop politely


# -- execution: the request ---------------------------------------------------------------------------


async def test_parent_id_timeout_cwd_and_features_reach_the_request() -> None:
    provider = FakeProvider(name="spawn", capabilities=ALL_FEATURES)
    async with open_service(provider) as service:
        tool = SubagentTool(service, parent_id="agent-7", timeout=90, cwd="/srv/repo")
        assert (tool.parent_id, tool.timeout) == ("agent-7", 90)
        await execute_driven(
            tool,
            provider,
            {
                "prompt": "review the diff",
                "provider": "spawn",
                "output_schema": {"type": "object"},
                "depth_limit": 2,
                "tool_filter": {"allow": ["read", "grep"], "deny": ["bash"]},
                "persona": "a meticulous reviewer",
            },
            finish_with(SubagentResult(output="{}", stop_reason="completed", structured={})),
        )

    assert provider.runs[0].request == SubagentRequest(
        prompt="review the diff",
        cwd="/srv/repo",
        output_schema={"type": "object"},
        depth_limit=2,
        tool_filter=ToolFilter(allow={"read", "grep"}, deny={"bash"}),
        persona="a meticulous reviewer",
        timeout=90,
        parent_id="agent-7",
    )


async def test_a_tool_filter_with_only_a_deny_list_allows_everything_else() -> None:
    provider = FakeProvider(name="spawn", capabilities=ALL_FEATURES)
    async with open_service(provider) as service:
        await execute_driven(
            SubagentTool(service),
            provider,
            {"prompt": "p", "provider": "spawn", "tool_filter": {"deny": ["bash"]}},
            finish_with(SubagentResult(output="ok", stop_reason="completed")),
        )
    assert provider.runs[0].request.tool_filter == ToolFilter(allow=None, deny={"bash"})


async def test_concurrent_calls_each_get_their_own_run_and_result() -> None:
    provider = FakeProvider(name="spawn")
    results: dict[str, SubagentToolResult] = {}
    async with open_service(provider) as service:
        tool = SubagentTool(service)

        async def call(prompt: str) -> None:
            results[prompt] = await tool.execute({"prompt": prompt, "provider": "spawn"})

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(call, "first")
                tg.start_soon(call, "second")
                await anyio.wait_all_tasks_blocked()
                by_prompt = {run.request.prompt: run for run in provider.runs}
                finish_with(SubagentResult(output="second done", stop_reason="completed"))(
                    by_prompt["second"]
                )
                await anyio.wait_all_tasks_blocked()
                assert list(results) == ["second"]
                finish_with(SubagentResult(output="first stopped", stop_reason="max_turns"))(
                    by_prompt["first"]
                )
        assert [run.dispose_calls for run in provider.runs] == [1, 1]

    assert (results["first"].is_error, results["first"].output) == (True, "first stopped")
    assert (results["second"].is_error, results["second"].output) == (False, "second done")
    assert results["first"].run_id == by_prompt["first"].id
    assert results["second"].run_id == by_prompt["second"].id


async def test_after_close_a_call_still_validates_against_the_live_registry() -> None:
    provider = FakeProvider(name="spawn")
    async with open_service() as service:
        tool = SubagentTool(service)
        tool.close()
        service.register_provider(provider)
        result = await execute_driven(
            tool,
            provider,
            {"prompt": "p", "provider": "spawn"},
            finish_with(SubagentResult(output="ok", stop_reason="completed")),
        )
    assert result.render() == "ok"
    assert tool.version == 0
