"""OpenTelemetry spans (subagent.telemetry): the tree of a delegation, in process and across an ACP
child running ``subagent serve``; nothing without a tracer provider, nothing needed without the API."""

from __future__ import annotations

import json
import sys
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
from subagent.providers.acp import AcpProvider
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


# -- across processes: an ACP child running `subagent serve` ----------------------------------------------

SERVE: Final = [sys.executable, "-m", "subagent", "serve"]
DELEGATING_SCRIPT: Final = ROOT.parent / "fixtures" / "scripts" / "delegate_to_spawn.json"
USER_PROMPT: Final = "Ask a subagent what 6 times 7 is."
CHILD_HOOK: Final = ROOT / "otel_child"
"""A sitecustomize that makes a child process export its spans to a file (a test-only hook)."""


def child_spans(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_a_served_agents_spans_join_the_callers_trace_below_its_invoke_agent_span(
    spans: InMemorySpanExporter, tmp_path: Path
) -> None:
    exported = tmp_path / "child-spans.jsonl"
    env = {"PYTHONPATH": str(CHILD_HOOK), "SUBAGENT_OTEL_TEST_EXPORT": str(exported)}
    provider = AcpProvider([*SERVE, "--script", str(DELEGATING_SCRIPT)], name="served", cwd=tmp_path, env=env)
    async with SubagentService(progress_interval=None) as service:
        service.register_provider(provider)
        with anyio.fail_after(30):
            async with service.start(
                "served", SubagentRequest(prompt="Ask a subagent what 6 times 7 is.")
            ) as run:
                result = await run.result()
    assert result.output == "The subagent says 6 times 7 is 42."

    (caller,) = spans.get_finished_spans()
    assert (caller.name, caller.kind, caller.parent) == ("invoke_agent served", SpanKind.CLIENT, None)
    assert attributes(caller)["gen_ai.conversation.id"] == run.provider_run.session_id  # type: ignore[attr-defined]
    trace_id = format(caller.context.trace_id, "032x")
    caller_id = format(span_id(caller), "016x")

    served = child_spans(exported)
    assert {span["trace_id"] for span in served} == {trace_id}
    ids = {span["span_id"]: span for span in served}
    tree = sorted(
        (
            span["name"],
            span["kind"],
            ids[span["parent_id"]]["name"] if span["parent_id"] in ids else span["parent_id"],
        )
        for span in served
    )
    assert tree == [
        ("chat", "CLIENT", "invoke_agent spawn"),
        ("chat", "CLIENT", "invoke_agent subagent-seam"),
        ("chat", "CLIENT", "invoke_agent subagent-seam"),
        ("execute_tool subagent", "INTERNAL", "invoke_agent subagent-seam"),
        ("invoke_agent spawn", "INTERNAL", "execute_tool subagent"),
        ("invoke_agent subagent-seam", "SERVER", caller_id),
    ]
    (prompt,) = (span for span in served if span["name"] == "invoke_agent subagent-seam")
    session_id = prompt["attributes"]["gen_ai.agent.id"]
    assert prompt["attributes"] == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.provider.name": "subagent-seam",
        "gen_ai.agent.name": "subagent-seam",
        "gen_ai.agent.id": session_id,
        "gen_ai.conversation.id": session_id,
        "subagent.stop_reason": "completed",
        "gen_ai.usage.input_tokens": 60,
        "gen_ai.usage.output_tokens": 22,
    }
    assert session_id == run.provider_run.session_id  # type: ignore[attr-defined]
    assert sorted(
        (span["attributes"]["gen_ai.usage.input_tokens"], span["attributes"]["gen_ai.usage.output_tokens"])
        for span in served
        if span["name"] == "chat"
    ) == [(9, 1), (20, 12), (40, 10)]
