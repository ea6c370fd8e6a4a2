"""Elicitation (``elicitation/create``, form mode): the question a policy sees, the answers that may go out,
and who answers (deny and allow decline, a callback answers), in memory and with the stub agent."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from subagent import SubagentRequest, SubagentService
from subagent.acp import (
    ElicitationAnswer,
    ElicitationChoice,
    ElicitationField,
    ElicitationQuestion,
    RequestError,
    schema,
)
from subagent.acp._elicitation import (
    MAX_FIELDS,
    MAX_TEXT_CHARS,
    check_content,
    parse_value,
    question_from_request,
)
from subagent.acp.handlers import CallbackPolicy, PermissionDecision, PermissionOutcome, PermissionQuestion
from subagent.providers.acp import AcpProvider, AcpRun
from subagent.testing import StubAgentTransport
from tests.leaks import assert_no_leaks
from tests.test_client import FakeAgent, connected

FORM: dict[str, Any] = {
    "type": "object",
    "title": "Deploy",
    "properties": {
        "target": {"type": "string", "title": "Target", "oneOf": [
            {"const": "prod", "title": "Production"}, {"const": "staging", "title": "Staging"}]},
        "replicas": {"type": "integer", "minimum": 1, "maximum": 5, "default": 2},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "confirm": {"type": "boolean", "description": "Really?"},
        "owner": {"type": "string", "format": "email", "maxLength": 40},
        "note": {"type": "string", "enum": ["a", "b"]},
    },
    "required": ["target", "confirm"],
}  # fmt: skip


def form_request(requested: dict[str, Any] = FORM, **extra: Any) -> schema.ElicitationFormMode:
    params = {
        "mode": "form",
        "sessionId": "s1",
        "message": "Where to?",
        "requestedSchema": requested,
        **extra,
    }
    request = schema.decode(msgspec.json.encode(params), type=schema.CreateElicitationRequest)
    assert isinstance(request, schema.ElicitationFormMode)
    return request


def question(requested: dict[str, Any] = FORM) -> ElicitationQuestion:
    return question_from_request(form_request(requested))


# -- the question ---------------------------------------------------------------------------------------


def test_the_question_is_a_frozen_snapshot_with_the_fields_checked_in_order() -> None:
    asked = question()
    assert (asked.session_id, asked.message, asked.title) == ("s1", "Where to?", "Deploy")
    assert [(field.name, field.type, field.required) for field in asked.fields] == [
        ("target", "string", True),
        ("replicas", "integer", False),
        ("ratio", "number", False),
        ("confirm", "boolean", True),
        ("owner", "string", False),
        ("note", "string", False),
    ]
    target = asked.fields[0]
    assert target.choices == (
        ElicitationChoice("prod", "Production"),
        ElicitationChoice("staging", "Staging"),
    )
    assert (asked.fields[1].minimum, asked.fields[1].maximum, asked.fields[1].default) == (1, 5, 2)
    assert asked.requested_schema["properties"]["confirm"] == {"type": "boolean", "description": "Really?"}
    with pytest.raises(TypeError):
        asked.requested_schema["properties"]["x"] = 1


UNRENDERABLE = [
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "enum": []}}}},
     "multi-select"),
    ({"type": "object", "properties": {"x": {"type": "object"}}}, "unknown"),
    ({"type": "object", "properties": {"code": {"type": "string", "pattern": "(a+)+$"}}}, "pattern"),
    ({"type": "object", "properties": {f"f{i}": {"type": "boolean"} for i in range(MAX_FIELDS + 1)}},
     f"at most {MAX_FIELDS}"),
    ({"type": "object", "properties": {"x": {"type": "string", "description": "d" * (MAX_TEXT_CHARS + 1)}}},
     "characters long"),
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}}, "minimum"),
    ({"type": "object", "properties": {"n": {"type": "integer", "maximum": 3, "default": 9}}}, "default"),
    ({"type": "object", "properties": {}, "required": ["ghost"]}, "not among the properties"),
]  # fmt: skip


@pytest.mark.parametrize(("requested", "reason"), UNRENDERABLE)
def test_a_form_that_cannot_be_shown_or_checked_is_refused_with_invalid_params(
    requested: dict[str, Any], reason: str
) -> None:
    with pytest.raises(RequestError) as caught:
        question(requested)
    assert caught.value.code == -32602
    assert reason in caught.value.data["reason"]


def test_a_message_past_the_bound_is_refused() -> None:
    with pytest.raises(RequestError) as caught:
        question_from_request(form_request(message="m" * (MAX_TEXT_CHARS + 1)))
    assert caught.value.code == -32602


# -- checking answers -----------------------------------------------------------------------------------

GOOD = {"target": "prod", "confirm": True}


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (GOOD, None),
        ({**GOOD, "replicas": 5, "ratio": 0.5, "owner": "a@b.io", "note": "b"}, None),
        ({"target": "prod"}, "'confirm' is required"),
        ({**GOOD, "target": "Production"}, "'target': is not one of the choices"),
        ({**GOOD, "replicas": 6}, "'replicas': must be at most 5"),
        ({**GOOD, "replicas": 2.5}, "'replicas': must be a whole number"),
        ({**GOOD, "replicas": True}, "'replicas': must be a number"),
        ({**GOOD, "ratio": float("nan")}, "'ratio': must be a finite number"),
        ({**GOOD, "ratio": 10**400}, "'ratio': is too large to be sent exactly"),
        ({**GOOD, "confirm": "yes"}, "'confirm': must be true or false"),
        ({**GOOD, "owner": "not an email"}, "'owner': must be a valid email"),
        ({**GOOD, "owner": "x" * 36 + "@b.io"}, "'owner': must be at most 40 characters"),
        ({**GOOD, "extra": 1}, "'extra' is not a field of the form"),
        (["prod"], "the content must be an object"),
    ],
)
def test_an_answer_is_checked_against_the_requested_schema(content: Any, problem: str | None) -> None:
    assert check_content(question(), content) == problem


@pytest.mark.parametrize(
    ("index", "typed", "value"),
    [(0, "2", "staging"), (0, "prod", "prod"), (0, "production", "prod"), (1, " 3 ", 3), (2, "0.25", 0.25),
     (2, "1", 1), (3, "Y", True), (3, "no", False), (4, "me@example.org", "me@example.org")],
)  # fmt: skip
def test_a_typed_value_is_read_for_its_field(index: int, typed: str, value: Any) -> None:
    assert parse_value(question().fields[index], typed) == value


@pytest.mark.parametrize(
    ("index", "typed", "problem"),
    [(0, "3", "not one of the choices"), (1, "9", "must be at most 5"), (1, "2x", "must be a whole number"),
     (2, "nan", "must be a finite"), (3, "maybe", "answer y or n"), (4, "me", "must be a valid email")],
)  # fmt: skip
def test_a_typed_value_that_is_not_valid_says_why(index: int, typed: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_value(question().fields[index], typed)


def test_a_date_and_a_date_time_field_take_only_valid_iso_values() -> None:
    date = ElicitationField("d", "string", format="date")
    moment = ElicitationField("t", "string", format="date-time")
    assert parse_value(date, "2026-12-02") == "2026-12-02"
    assert parse_value(moment, "2026-12-02T10:00:00+00:00") == "2026-12-02T10:00:00+00:00"
    for field, typed in ((date, "02/12/2026"), (moment, "2026-12-02"), (moment, "2026-12-02T10:00:00")):
        with pytest.raises(ValueError, match="must be a valid"):
            parse_value(field, typed)


# -- the client answers by the policy -------------------------------------------------------------------

ELICIT = {"mode": "form", "sessionId": "s1", "message": "Where to?", "requestedSchema": FORM}


def eliciting(replies: list[Any], params: dict[str, Any] = ELICIT) -> Any:
    """A session/prompt handler that asks one elicitation and records the client's answer (or error)."""

    async def prompt(agent: FakeAgent, _: Any) -> Any:
        try:
            replies.append(await agent.ask("elicitation/create", params))
        except RequestError as exc:
            replies.append(exc.to_wire())
        return {"stopReason": "end_turn"}

    return prompt


async def answer_with(permission: Any, params: dict[str, Any] = ELICIT) -> Any:
    replies: list[Any] = []
    async with connected(
        FakeAgent(handlers={"session/prompt": eliciting(replies, params)}), permission=permission
    ) as client:
        with anyio.fail_after(5):
            await client.initialize()
            session = await client.new_session("/home/user")
            await session.prompt("go")
    return replies[0]


pytestmark = pytest.mark.anyio


async def test_initialize_advertises_form_elicitation_only() -> None:
    agent = FakeAgent()
    async with connected(agent) as client:
        with anyio.fail_after(5):
            await client.initialize()
    assert agent.received[0][1]["clientCapabilities"]["elicitation"] == {"form": {}}


@pytest.mark.parametrize("permission", ["deny", "allow"])
async def test_deny_and_allow_decline_an_elicitation(permission: str) -> None:
    assert await answer_with(permission) == {"action": "decline"}


async def test_a_callback_policy_answers_an_elicitation_with_checked_content() -> None:
    seen: list[ElicitationQuestion] = []

    async def permission(question: PermissionQuestion) -> str | None:
        return None

    async def answer(question: ElicitationQuestion) -> ElicitationAnswer:
        seen.append(question)
        return ElicitationAnswer.accept({"target": "staging", "confirm": False, "replicas": 3})

    policy = CallbackPolicy(permission, elicitation=answer)
    reply = await answer_with(policy)
    assert reply == {"action": "accept", "content": {"target": "staging", "confirm": False, "replicas": 3}}
    assert seen[0].session_id == "s1"
    assert seen[0].message == "Where to?"


async def test_an_answer_that_does_not_match_the_schema_is_sent_as_decline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def answer(question: ElicitationQuestion) -> ElicitationAnswer:
        return ElicitationAnswer.accept({"target": "moon", "confirm": True})

    async def permission(question: PermissionQuestion) -> str | None:
        return None

    with caplog.at_level(logging.ERROR, logger="subagent.acp.client"):
        reply = await answer_with(CallbackPolicy(permission, elicitation=answer))
    assert reply == {"action": "decline"}
    assert any(
        "invalid content ('target': is not one of the choices)" in r.getMessage() for r in caplog.records
    )


async def test_a_callback_without_an_elicitation_answer_declines_and_one_too_slow_cancels() -> None:
    async def permission(question: PermissionQuestion) -> str | None:
        return None

    async def slow(question: ElicitationQuestion) -> ElicitationAnswer:
        await anyio.sleep_forever()
        raise AssertionError

    assert await answer_with(CallbackPolicy(permission)) == {"action": "decline"}
    assert await answer_with(CallbackPolicy(permission, elicitation=slow, timeout=0.05)) == {
        "action": "cancel"
    }


async def test_a_policy_object_of_its_own_without_elicit_keeps_working_and_declines() -> None:
    class Mine:
        async def decide(self, question: PermissionQuestion) -> PermissionDecision:
            return PermissionOutcome.CANCELLED

    assert await answer_with(Mine()) == {"action": "decline"}


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        ({**ELICIT, "requestedSchema": UNRENDERABLE[0][0]}, "multi-select"),
        (
            {"mode": "url", "sessionId": "s1", "message": "m", "elicitationId": "e", "url": "https://x"},
            "form-mode",
        ),
        ({**ELICIT, "sessionId": "nobody"}, "unknown session"),
        ({"mode": "form", "sessionId": "s1", "message": 3}, "needs a message and a requestedSchema"),
    ],
    ids=["unrenderable", "url", "unknown-session", "malformed"],
)
async def test_an_elicitation_the_client_cannot_take_is_answered_invalid_params_without_asking(
    params: dict[str, Any], reason: str
) -> None:
    asked: list[ElicitationQuestion] = []

    async def permission(question: PermissionQuestion) -> str | None:
        return None

    async def answer(question: ElicitationQuestion) -> ElicitationAnswer:
        asked.append(question)
        return ElicitationAnswer.decline()

    reply = await answer_with(CallbackPolicy(permission, elicitation=answer), params)
    assert reply["code"] == -32602
    assert reason in str(reply["data"])
    assert asked == []


async def test_cancelling_the_turn_answers_a_pending_elicitation_cancel() -> None:
    replies: list[Any] = []
    waiting = anyio.Event()

    async def permission(question: PermissionQuestion) -> str | None:
        return None

    async def never(question: ElicitationQuestion) -> ElicitationAnswer:
        waiting.set()
        await anyio.sleep_forever()
        raise AssertionError

    async def prompt(agent: FakeAgent, _: Any) -> Any:
        replies.append(await agent.ask("elicitation/create", ELICIT))
        return {"stopReason": "cancelled"}

    policy = CallbackPolicy(permission, elicitation=never)
    async with connected(FakeAgent(handlers={"session/prompt": prompt}), permission=policy) as client:
        with anyio.fail_after(5):
            await client.initialize()
            session = await client.new_session("/home/user")
            async with anyio.create_task_group() as group:
                group.start_soon(session.prompt, "go")
                await waiting.wait()
                assert session.pending_permissions == 1  # the inactivity clock is paused meanwhile
                await session.cancel()
    assert replies == [{"action": "cancel"}]
    assert session.pending_permissions == 0


# -- with the stub agent, through the provider ----------------------------------------------------------

TOOL_CALL = {"step": "tool_call", "toolCallId": "c1", "title": "Deploy"}  # ends the report's message


async def provider_reply(scenario: dict[str, Any], tmp_path: Path, permission: Any) -> tuple[Any, str]:
    """The stub agent's report of its elicitation and its output, playing ``scenario`` in process."""
    transport = StubAgentTransport(scenario)
    provider = AcpProvider(["stub-agent"], cwd=tmp_path, permission=permission, transport=transport)
    async with assert_no_leaks(), SubagentService() as service:
        service.register_provider(provider)
        async with service.start("acp", SubagentRequest(prompt="go")) as run:
            with anyio.fail_after(20):
                result = await run.result()
            acp_run = run.provider_run
            assert isinstance(acp_run, AcpRun)
    reports = [
        msgspec.json.decode(update.content.text)
        for update in acp_run.updates
        if isinstance(update, schema.AgentMessageChunk)
        and isinstance(update.content, schema.TextContent)
        and update.content.text.startswith("{")
    ]
    return reports[0], result.output


@pytest.mark.parametrize("permission", ["deny", "allow"])
async def test_the_stub_agents_elicitation_is_declined_under_deny_and_allow(
    tmp_path: Path, permission: str
) -> None:
    step = {"step": "elicit", "message": "Where to?", "requestedSchema": FORM,
            "branches": {"decline": [TOOL_CALL, {"step": "message", "text": "fine, I won't"}]}}  # fmt: skip
    report, output = await provider_reply({"turns": [[step]]}, tmp_path, permission)
    assert report == {"method": "elicitation/create", "result": {"action": "decline"}}
    assert output == "fine, I won't"


async def test_the_stub_agents_elicitation_gets_the_callbacks_answer(tmp_path: Path) -> None:
    async def permission(question: PermissionQuestion) -> str | None:
        return None

    async def answer(question: ElicitationQuestion) -> ElicitationAnswer:
        return ElicitationAnswer.accept({"target": "prod", "confirm": True})

    step = {"step": "elicit", "message": "Where to?", "requestedSchema": FORM,
            "branches": {"accept": [TOOL_CALL, {"step": "message", "text": "deploying"}]}}  # fmt: skip
    policy = CallbackPolicy(permission, elicitation=answer)
    report, output = await provider_reply({"turns": [[step]]}, tmp_path, policy)
    assert report == {
        "method": "elicitation/create",
        "result": {"action": "accept", "content": {"target": "prod", "confirm": True}},
    }
    assert output == "deploying"
