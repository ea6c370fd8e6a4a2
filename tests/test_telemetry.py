"""OpenTelemetry spans (subagent.telemetry): the tree of a delegation, in process and across an ACP
child running ``subagent serve``; nothing without a tracer provider, nothing needed without the API."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import anyio
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from subagent import SubagentRequest, SubagentService, telemetry
from subagent.providers.spawn import SpawnProvider
from subagent.runtime import AgentRegistry, FunctionTool, Reply, ScriptedLlm, Tool, When, call
from subagent.tool import SubagentTool
from subagent.types import Usage

pytestmark = pytest.mark.anyio

ROOT: Final = Path(__file__).resolve().parent
NO_ARGUMENTS: Final = {"type": "object", "properties": {}}


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Spans recorded by a provider of the test's own (the global one is left alone)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry.set_tracer_provider(provider)
    try:
        yield exporter
    finally:
        telemetry.set_tracer_provider(None)
        provider.shutdown()


class NamedModel(ScriptedLlm):
    """A scripted adapter that names its model, as real adapters do."""

    model = "scripted-model"


def lookup_tool() -> FunctionTool:
    return FunctionTool("lookup", "Look something up.", NO_ARGUMENTS, lambda arguments: "found it")


def by_name(finished: Sequence[ReadableSpan]) -> dict[str, list[ReadableSpan]]:
    named: dict[str, list[ReadableSpan]] = {}
    for span in finished:
        named.setdefault(span.name, []).append(span)
    return named


def parent_of(span: ReadableSpan) -> int | None:
    return None if span.parent is None else span.parent.span_id


def span_id(span: ReadableSpan) -> int:
    context = span.get_span_context()
    assert context is not None
    return context.span_id


def attributes(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def depth(span: ReadableSpan) -> int:
    value = attributes(span)["subagent.run.depth"]
    assert isinstance(value, int)
    return value


def delegation_script() -> NamedModel:
    """A parent that delegates to a spawned child, which calls the lookup tool, then both answer."""
    return NamedModel(
        [
            Reply(
                tool_calls=[call("subagent", {"provider": "spawn", "prompt": "beta task"}, id="call-p")],
                usage=Usage(input_tokens=10, output_tokens=3),
                when=When(last_user_contains="alpha", after_tool_result=False),
            ),
            Reply(
                tool_calls=[call("lookup", {}, id="call-c")],
                usage=Usage(input_tokens=20, output_tokens=4),
                when=When(last_user_contains="beta", after_tool_result=False),
            ),
            Reply(
                "beta done",
                usage=Usage(input_tokens=30, output_tokens=5),
                when=When(last_user_contains="beta", after_tool_result=True),
            ),
            Reply(
                "alpha done",
                usage=Usage(input_tokens=40, output_tokens=6),
                when=When(last_user_contains="alpha", after_tool_result=True),
            ),
        ]
    )


async def test_a_spawned_delegation_is_one_trace_of_agent_chat_and_tool_spans_nested_along_the_chain(
    spans: InMemorySpanExporter,
) -> None:
    service = SubagentService(progress_interval=None)
    tools: list[Tool] = [lookup_tool(), SubagentTool(service).for_agents()]
    service.register_provider(SpawnProvider(llm=delegation_script(), agents=AgentRegistry(), tools=tools))
    async with service:
        with anyio.fail_after(30):
            run = service.start("spawn", SubagentRequest(prompt="alpha task"))
            result = await run.result()
    assert result.output == "alpha done"

    named = by_name(spans.get_finished_spans())
    assert sorted((name, len(found)) for name, found in named.items()) == [
        ("chat scripted-model", 4),
        ("execute_tool lookup", 1),
        ("execute_tool subagent", 1),
        ("invoke_agent spawn", 2),
    ]
    parent, child = sorted(
        named["invoke_agent spawn"], key=lambda span: attributes(span)["subagent.run.depth"]
    )
    assert parent.parent is None
    assert parent_of(child) == span_id(parent)
    assert {span.context.trace_id for span in spans.get_finished_spans()} == {parent.context.trace_id}
    assert parent.kind is child.kind is SpanKind.INTERNAL
    child_id = attributes(child)["gen_ai.agent.id"]
    assert attributes(parent) == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.provider.name": "subagent-seam",
        "gen_ai.agent.name": "spawn",
        "gen_ai.agent.id": run.id,
        "gen_ai.conversation.id": run.id,
        "subagent.provider": "spawn",
        "subagent.run.depth": 1,
        "subagent.stop_reason": "completed",
        "gen_ai.usage.input_tokens": 50,
        "gen_ai.usage.output_tokens": 9,
    }
    assert attributes(child) == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.provider.name": "subagent-seam",
        "gen_ai.agent.name": "spawn",
        "gen_ai.agent.id": child_id,
        "gen_ai.conversation.id": child_id,
        "subagent.provider": "spawn",
        "subagent.parent.id": run.id,
        "subagent.run.depth": 2,
        "subagent.stop_reason": "completed",
        "gen_ai.usage.input_tokens": 50,
        "gen_ai.usage.output_tokens": 9,
    }

    chats = sorted(named["chat scripted-model"], key=lambda span: span.start_time or 0)
    assert [(parent_of(chat), attributes(chat)) for chat in chats] == [
        (
            span_id(owner),
            {
                "gen_ai.operation.name": "chat",
                "gen_ai.provider.name": "_OTHER",
                "gen_ai.request.model": "scripted-model",
                "gen_ai.usage.input_tokens": tokens[0],
                "gen_ai.usage.output_tokens": tokens[1],
                "gen_ai.response.finish_reasons": (finish,),
            },
        )
        for owner, tokens, finish in [
            (parent, (10, 3), "tool_calls"),
            (child, (20, 4), "tool_calls"),
            (child, (30, 5), "stop"),
            (parent, (40, 6), "stop"),
        ]
    ]
    assert {chat.kind for chat in chats} == {SpanKind.CLIENT}

    (delegating,) = named["execute_tool subagent"]
    (looking,) = named["execute_tool lookup"]
    assert (parent_of(delegating), delegating.kind, attributes(delegating)) == (
        span_id(parent),
        SpanKind.INTERNAL,
        {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": "subagent",
            "gen_ai.tool.call.id": "call-p",
            "gen_ai.tool.type": "function",
        },
    )
    assert (parent_of(looking), attributes(looking)["gen_ai.tool.call.id"]) == (span_id(child), "call-c")
    assert all(span.status.status_code is StatusCode.UNSET for span in spans.get_finished_spans())
