"""OpenTelemetry spans (subagent.observability): the tree of a delegation, in process and across an ACP
child running ``subagent serve``; nothing without a tracer provider, nothing needed without the API."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import anyio
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from subagent import SubagentRequest, SubagentService
from subagent.acp import schema
from subagent.observability import _telemetry as telemetry
from subagent.providers.acp import AcpProvider
from subagent.providers.spawn import SpawnProvider
from subagent.runtime import (
    AgentRegistry,
    Approver,
    FunctionTool,
    LlmError,
    LlmErrorKind,
    Reply,
    ScriptedLlm,
    Tool,
    When,
    call,
)
from subagent.testing import StubAgentTransport
from subagent.tool import SubagentTool
from subagent.types import SubagentResult, Usage
from tests.test_serve import served

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


async def run_spawned(
    llm: ScriptedLlm,
    prompt: str = "go",
    *,
    delegate: bool = False,
    tools: Sequence[Tool] = (),
    approver: Approver | None = None,
) -> tuple[SubagentResult, str]:
    """One ``spawn`` run to its end, and its id; with ``delegate``, its tools are the lookup tool and
    the subagent tool (so it can spawn children)."""
    service = SubagentService(progress_interval=None)
    if delegate:
        tools = [lookup_tool(), SubagentTool(service).for_agents()]
    service.register_provider(SpawnProvider(llm=llm, agents=AgentRegistry(), tools=tools, approver=approver))
    async with service:
        with anyio.fail_after(30):
            run = service.start("spawn", SubagentRequest(prompt=prompt))
            return await run.result(), run.id


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
    result, run_id = await run_spawned(delegation_script(), "alpha task", delegate=True)
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
        "gen_ai.agent.id": run_id,
        "gen_ai.conversation.id": run_id,
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
        "subagent.parent.id": run_id,
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


# -- failures, waits and content --------------------------------------------------------------------------


def status(span: ReadableSpan) -> tuple[StatusCode, Any]:
    return span.status.status_code, attributes(span).get("error.type")


async def test_a_failing_model_call_ends_its_chat_span_and_the_run_span_with_error_status(
    spans: InMemorySpanExporter,
) -> None:
    failing = NamedModel([Reply(error=LlmError(LlmErrorKind.RATE_LIMITED, "slow down"))])
    result, _ = await run_spawned(failing)
    assert result.stop_reason == "error"

    named = by_name(spans.get_finished_spans())
    ((chat,), (run,)) = named["chat scripted-model"], named["invoke_agent spawn"]
    assert status(chat) == (StatusCode.ERROR, LlmErrorKind.RATE_LIMITED.value)
    assert status(run) == (StatusCode.ERROR, "error")
    assert attributes(run)["subagent.stop_reason"] == "error"
    assert "slow down" not in json.dumps([attributes(chat), attributes(run)])  # no model text on spans


async def test_a_run_disposed_mid_model_call_ends_every_span_it_opened(spans: InMemorySpanExporter) -> None:
    reached = anyio.Event()
    never = anyio.Event()

    async def hold() -> None:
        reached.set()
        await never.wait()

    service = SubagentService(progress_interval=None)
    service.register_provider(
        SpawnProvider(llm=NamedModel([Reply("late", wait=hold)]), agents=AgentRegistry())
    )
    async with service:
        run = service.start("spawn", SubagentRequest(prompt="go"))
        with anyio.fail_after(30):
            await reached.wait()
            await run.dispose()

    named = by_name(spans.get_finished_spans())
    ((chat,), (invoked,)) = named["chat scripted-model"], named["invoke_agent spawn"]
    assert status(chat) == (StatusCode.ERROR, "cancelled")
    assert status(invoked) == (StatusCode.ERROR, "DISPOSED")
    assert parent_of(chat) == span_id(invoked)


async def test_an_approval_wait_is_a_permission_span_inside_its_tool_call(
    spans: InMemorySpanExporter,
) -> None:
    guarded = FunctionTool(
        "shell", "Run a command.", NO_ARGUMENTS, lambda arguments: "ran", needs_approval=True
    )
    llm = NamedModel(
        [
            Reply(tool_calls=[call("shell", {}, id="call-1")], when=When(after_tool_result=False)),
            Reply("refused, as expected", when=When(after_tool_result=True)),
        ]
    )
    result, _ = await run_spawned(llm, tools=[guarded], approver=lambda invocation: False)
    assert result.output == "refused, as expected"

    named = by_name(spans.get_finished_spans())
    ((tool,), (wait,)) = named["execute_tool shell"], named["permission_wait shell"]
    assert parent_of(wait) == span_id(tool)
    assert (wait.kind, attributes(wait)) == (
        SpanKind.INTERNAL,
        {
            "gen_ai.tool.name": "shell",
            "gen_ai.tool.call.id": "call-1",
            "subagent.permission.outcome": "denied",
        },
    )
    assert status(wait) == (StatusCode.UNSET, None)
    assert status(tool) == (StatusCode.ERROR, "not_approved")


async def run_stub(transport: StubAgentTransport, cwd: Path) -> SubagentResult:
    """One run of the stub agent ``transport`` serves, as provider ``stub`` (every question allowed)."""
    provider = AcpProvider(["stub-agent"], name="stub", cwd=cwd, permission="allow", transport=transport)
    async with SubagentService(progress_interval=None) as service:
        service.register_provider(provider)
        with anyio.fail_after(30):
            async with service.start("stub", SubagentRequest(prompt="go")) as run:
                return await run.result()


async def test_a_permission_question_of_an_acp_child_is_a_span_below_its_run(
    spans: InMemorySpanExporter, tmp_path: Path
) -> None:
    transport = StubAgentTransport(
        {
            "turns": [
                [
                    {"step": "tool_call", "toolCallId": "c1", "title": "edit", "kind": "edit"},
                    {
                        "step": "permission",
                        "toolCall": {"toolCallId": "c1", "kind": "edit"},
                        "branches": {
                            "allow": [{"step": "message", "text": "allowed"}],
                            "reject": [{"step": "message", "text": "denied"}],
                        },
                    },
                ]
            ]
        }
    )
    result = await run_stub(transport, tmp_path)
    assert result.output == "allowed"

    named = by_name(spans.get_finished_spans())
    ((invoked,), (wait,)) = named["invoke_agent stub"], named["permission_wait"]
    assert parent_of(wait) == span_id(invoked)
    assert attributes(wait) == {
        "gen_ai.tool.call.id": "c1",
        "subagent.permission.kind": "edit",
        "subagent.permission.outcome": "allowed",
    }


async def test_content_goes_on_spans_only_when_asked_for_and_cut_short(
    spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(telemetry.CAPTURE_CONTENT_ENV, "1")
    long_prompt = "x" * (telemetry.CAPTURED_CONTENT_CHARS + 100)
    await run_spawned(NamedModel(["the answer"]), long_prompt)

    (invoked,) = by_name(spans.get_finished_spans())["invoke_agent spawn"]
    sent = json.loads(attributes(invoked)["gen_ai.input.messages"])
    answered = json.loads(attributes(invoked)["gen_ai.output.messages"])
    assert sent == [
        {"role": "user", "parts": [{"type": "text", "content": "x" * telemetry.CAPTURED_CONTENT_CHARS + "…"}]}
    ]
    assert answered == [{"role": "assistant", "parts": [{"type": "text", "content": "the answer"}]}]


async def test_a_resumed_turn_is_an_invoke_agent_span_of_its_own_below_the_runs(
    spans: InMemorySpanExporter,
) -> None:
    service = SubagentService(progress_interval=None)
    service.register_provider(SpawnProvider(llm=NamedModel(["first", "second"]), agents=AgentRegistry()))
    async with service:
        with anyio.fail_after(30):
            async with service.start("spawn", SubagentRequest(prompt="go")) as run:
                await run.result()
                resumed = await run.resume("again")  # type: ignore[attr-defined]
    assert resumed.output == "second"

    first, second = sorted(
        by_name(spans.get_finished_spans())["invoke_agent spawn"], key=lambda span: span.start_time or 0
    )
    assert parent_of(second) == span_id(first)
    assert attributes(second)["gen_ai.agent.id"] == run.id
    chats = by_name(spans.get_finished_spans())["chat scripted-model"]
    assert sorted(parent_of(chat) or 0 for chat in chats) == sorted([span_id(first), span_id(second)])


def test_a_peers_malformed_trace_context_is_ignored(spans: InMemorySpanExporter) -> None:
    valid = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert telemetry.extract({"traceparent": valid}) is not None
    hostile_metas: list[dict[str, Any] | None] = [
        {"traceparent": 42},
        {"traceparent": "00-garbage"},
        {"traceparent": valid + "x" * 600},
        {"traceparent": ["00", "x"]},
        {"tracestate": "a=b"},
        {},
        None,
    ]
    for hostile in hostile_metas:
        assert telemetry.extract(hostile) is None, hostile


# -- nothing without a provider, nothing needed without the API ---------------------------------------------


async def test_nothing_is_recorded_and_no_tracer_is_asked_for_without_a_tracer_provider(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[str] = []
    monkeypatch.setattr(
        trace.ProxyTracerProvider, "get_tracer", lambda self, *args, **kwargs: asked.append("proxy")
    )
    assert not telemetry.enabled()
    result, _ = await run_spawned(delegation_script(), "alpha task", delegate=True)
    assert result.output == "alpha done"
    assert asked == []
    assert telemetry.inject({"k": 1}) == {"k": 1}
    assert (
        telemetry.extract({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}) is None
    )


WITHOUT_OPENTELEMETRY: Final = """
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, Block())

import anyio
from subagent import SubagentRequest, SubagentService
from subagent.observability import _telemetry as telemetry
from subagent.providers.spawn import SpawnProvider
from subagent.runtime import AgentRegistry, FunctionTool, Reply, ScriptedLlm, When, call
from subagent.serve import ServedAgent
from subagent.tool import SubagentTool

async def main():
    service = SubagentService(progress_interval=None)
    lookup = FunctionTool("lookup", "Look.", {"type": "object"}, lambda a: "found", needs_approval=True)
    tools = [lookup, SubagentTool(service).for_agents()]
    llm = ScriptedLlm([
        Reply(tool_calls=[call("subagent", {"provider": "spawn", "prompt": "beta"})],
              when=When(last_user_contains="alpha", after_tool_result=False)),
        Reply(tool_calls=[call("lookup", {})], when=When(last_user_contains="beta", after_tool_result=False)),
        Reply("beta done", when=When(last_user_contains="beta", after_tool_result=True)),
        Reply("alpha done", when=When(last_user_contains="alpha", after_tool_result=True)),
    ])
    provider = SpawnProvider(llm=llm, agents=AgentRegistry(), tools=tools, approver=lambda i: True)
    service.register_provider(provider)
    async with service:
        result = await service.start("spawn", SubagentRequest(prompt="alpha")).result()
    print(result.output, telemetry.enabled(), telemetry.inject(None), telemetry.extract({"traceparent": "x"}))
    print(sorted(name for name in sys.modules if name.startswith("opentelemetry")))

anyio.run(main)
"""


def test_the_library_works_where_opentelemetry_cannot_be_imported() -> None:
    completed = subprocess.run(
        [sys.executable, "-c", WITHOUT_OPENTELEMETRY], capture_output=True, text=True, timeout=60, check=False
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.splitlines() == ["alpha done False None None", "[]"]


async def test_an_id_a_model_chose_goes_on_a_span_cut_to_a_bound(spans: InMemorySpanExporter) -> None:
    huge_id = "call-" + "x" * 100_000
    llm = NamedModel(
        [
            Reply(tool_calls=[call("lookup", {}, id=huge_id)], when=When(after_tool_result=False)),
            Reply("done", when=When(after_tool_result=True)),
        ]
    )
    result, _ = await run_spawned(llm, tools=[lookup_tool()])
    assert result.output == "done"

    (tool,) = by_name(spans.get_finished_spans())["execute_tool lookup"]
    assert attributes(tool)["gen_ai.tool.call.id"] == huge_id[: telemetry.MAX_ID_CHARS] + "…"


# -- subagent serve in memory: which trace context a prompt continues -------------------------------------

SESSION_TRACE: Final = "00-11111111111111111111111111111111-2222222222222222-01"
PROMPT_TRACE: Final = "00-33333333333333333333333333333333-4444444444444444-01"


async def serve_one_prompt(session_meta: dict[str, Any] | None, prompt_meta: dict[str, Any] | None) -> None:
    """One session of ``subagent serve`` in memory, and one prompt in it, with those ``_meta``."""
    async with served(NamedModel(fallback="hello")) as (_, client):
        with anyio.fail_after(30):
            created = await client.connection.request(
                schema.SESSION_NEW,
                {"cwd": str(ROOT), "mcpServers": [], "_meta": session_meta},
                result_type=dict,
            )
            prompt = {"sessionId": created["sessionId"], "prompt": [{"type": "text", "text": "hi"}]}
            if prompt_meta is not None:
                prompt["_meta"] = prompt_meta
            answer = await client.connection.request(schema.SESSION_PROMPT, prompt, result_type=dict)
    assert answer["stopReason"] == "end_turn"


async def test_a_served_prompt_continues_its_own_trace_context_else_its_sessions(
    spans: InMemorySpanExporter,
) -> None:
    await serve_one_prompt({"traceparent": SESSION_TRACE}, {"traceparent": PROMPT_TRACE})
    await serve_one_prompt({"traceparent": SESSION_TRACE}, None)
    await serve_one_prompt({"traceparent": "00-not-a-trace-context"}, None)

    prompts = sorted(
        by_name(spans.get_finished_spans())["invoke_agent subagent-seam"],
        key=lambda span: span.start_time or 0,
    )
    parents = [
        None
        if span.parent is None
        else (format(span.parent.trace_id, "032x"), format(span.parent.span_id, "016x"))
        for span in prompts
    ]
    assert parents == [
        ("33333333333333333333333333333333", "4444444444444444"),
        ("11111111111111111111111111111111", "2222222222222222"),
        None,  # a malformed trace context is ignored: the prompt starts a trace of its own
    ]
    assert {span.kind for span in prompts} == {SpanKind.SERVER}


async def test_an_acp_agents_own_subagents_are_invoke_agent_spans_below_its_run_with_their_usage(
    spans: InMemorySpanExporter, tmp_path: Path
) -> None:
    usage = {"inputTokens": 10, "outputTokens": 2, "totalTokens": 12}
    failure = {"code": -32603, "message": "the child broke"}
    grandchild = {"step": "subagent", "sessionId": "g1", "title": "Deeper", "usage": usage}
    child = {"step": "subagent", "sessionId": "c1", "title": "Explore", "steps": [grandchild], "usage": usage}
    broken = {"step": "subagent", "sessionId": "c2", "stopReason": "error", "error": failure}
    transport = StubAgentTransport({"turns": [[child, broken, {"step": "message", "text": "done"}]]})
    result = await run_stub(transport, tmp_path)
    assert result.output == "done"

    named = by_name(spans.get_finished_spans())
    (root,) = named["invoke_agent stub"]
    ((explore,), (deeper,), (unnamed,)) = (
        named["invoke_agent Explore"],
        named["invoke_agent Deeper"],
        named["invoke_agent c2"],
    )
    assert (parent_of(explore), parent_of(deeper), parent_of(unnamed)) == (
        span_id(root),
        span_id(explore),
        span_id(root),
    )
    assert explore.kind == SpanKind.INTERNAL
    assert attributes(explore) == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.provider.name": "subagent-seam",
        "gen_ai.agent.id": "c1",
        "gen_ai.agent.name": "Explore",
        "subagent.provider": "stub",
        "subagent.parent.id": attributes(root)["gen_ai.conversation.id"],
        "subagent.run.depth": 1,
        "subagent.stop_reason": "end_turn",
        "gen_ai.usage.input_tokens": 10,
        "gen_ai.usage.output_tokens": 2,
    }
    assert (attributes(deeper)["subagent.parent.id"], depth(deeper)) == ("c1", 2)
    assert (status(explore), status(deeper)) == ((StatusCode.UNSET, None), (StatusCode.UNSET, None))
    # A failed child's span ends in error, with the stop reason as its type; no usage was said.
    assert status(unnamed) == (StatusCode.ERROR, "error")
    assert attributes(unnamed)["subagent.stop_reason"] == "error"
    assert "gen_ai.usage.input_tokens" not in attributes(unnamed)
