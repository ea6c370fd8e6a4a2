"""Session modes and config options chosen by the caller, and a permission policy that holds.

The client keeps a session's modes and config options current from the agent's updates and answers, and
switches them by whichever route the agent offers. Every write through the client's file system goes through
the permission policy unless an answer given in the same turn covers it, so an agent whose mode approves by
itself still cannot write under ``deny``. The provider applies the caller's mode and config options before
the first prompt, and moves a session that starts in an approving mode to the agent's asking mode.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

import anyio
import pytest

from subagent.acp import ModeChoice, SessionSettingError, schema
from subagent.acp._modes import KNOWN_AGENT_MODES, mode_advice, reads_as_approving
from subagent.acp.handlers import FsSandbox, PermissionQuestion
from subagent.providers.acp import AcpProvider
from subagent.testing import StubAgentTransport
from subagent.types import ErrorCode, SubagentError, SubagentResult
from tests.test_acp_provider import run_once
from tests.test_client import FakeAgent, connected, ready_session

pytestmark = pytest.mark.anyio

WAIT = 30.0
STUB = ["stub-agent"]
"""The command of a stub agent served in process: a name only."""

MODES: dict[str, Any] = {
    "currentModeId": "auto",
    "availableModes": [
        {"id": "default", "name": "Default", "description": "Asks before edits"},
        {"id": "auto", "name": "Auto"},
        {"id": "yolo", "name": "YOLO"},
    ],
}
CONFIG_OPTIONS: list[dict[str, Any]] = [
    {
        "type": "select",
        "id": "model",
        "name": "Model",
        "category": "model",
        "currentValue": "small",
        "options": [{"value": "small", "name": "Small"}, {"value": "big", "name": "Big"}],
    },
    {"type": "boolean", "id": "thinking", "name": "Thinking", "currentValue": False},
]


def write(path: Path, content: str = "written") -> dict[str, Any]:
    return {"sessionId": "s1", "path": str(path), "content": content}


async def asked(agent: FakeAgent, method: str, params: dict[str, Any]) -> Any:
    """The agent's request, answered: its result, or the error object the client answered."""
    from subagent.acp import RequestError

    try:
        return {"result": await agent.ask(method, params)}
    except RequestError as exc:
        return {"error": exc.to_wire()}


# -- the client: writes under the policy ----------------------------------------------------------------


async def test_under_deny_a_write_nobody_asked_about_is_refused_with_an_error_naming_the_policy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    replies: list[Any] = []

    async def prompt(agent: FakeAgent, params: Any) -> Any:
        replies.append(await asked(agent, "fs/write_text_file", write(tmp_path / "out.txt")))
        return {"stopReason": "end_turn"}

    agent = FakeAgent(handlers={"session/prompt": prompt})
    async with connected(agent, fs=FsSandbox([tmp_path]), permission="deny") as client:
        with anyio.fail_after(5):
            turn = await (await ready_session(client)).prompt("go")
    assert replies == [
        {
            "error": {
                "code": -32003,
                "message": "Permission denied: the client's permission policy (deny) refused this write",
                "data": {"path": str(tmp_path / "out.txt"), "policy": "deny"},
            }
        }
    ]
    assert not (tmp_path / "out.txt").exists()
    assert (turn.stop_reason, turn.permissions_denied, turn.last_denied) == (
        "end_turn",
        1,
        f"Write {tmp_path / 'out.txt'}",
    )
    assert f"refused the agent's write to {tmp_path / 'out.txt'}" in caplog.text


async def test_under_allow_a_write_is_written_without_any_question(tmp_path: Path) -> None:
    replies: list[Any] = []

    async def prompt(agent: FakeAgent, params: Any) -> Any:
        replies.append(await asked(agent, "fs/write_text_file", write(tmp_path / "out.txt")))
        return {"stopReason": "end_turn"}

    agent = FakeAgent(handlers={"session/prompt": prompt})
    async with connected(agent, fs=FsSandbox([tmp_path]), permission="allow") as client:
        with anyio.fail_after(5):
            turn = await (await ready_session(client)).prompt("go")
    assert replies == [{"result": {}}]
    assert (tmp_path / "out.txt").read_text() == "written"
    assert turn.permissions_denied == 0


async def test_a_write_covered_by_a_permission_allowed_in_the_turn_is_not_asked_again_and_any_other_is(
    tmp_path: Path,
) -> None:
    questions: list[PermissionQuestion] = []

    async def policy(question: PermissionQuestion) -> str | None:
        questions.append(question)
        return "allow" if question.tool_call_id == "call-1" else "reject_once"

    replies: list[Any] = []
    covered, relative, other = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "c.txt"

    async def prompt(agent: FakeAgent, params: Any) -> Any:
        await agent.ask(
            "session/request_permission",
            {
                "sessionId": "s1",
                "toolCall": {
                    "toolCallId": "call-1",
                    "title": "Edit two files",
                    "kind": "edit",
                    "locations": [{"path": str(covered)}],
                    "rawInput": {"file_path": "b.txt", "note": "not a path"},
                },
                "options": [
                    {"optionId": "allow", "name": "Allow", "kind": "allow_once"},
                    {"optionId": "no", "name": "No", "kind": "reject_once"},
                ],
            },
        )
        replies.extend(
            [await asked(agent, "fs/write_text_file", write(path)) for path in (covered, relative, other)]
        )
        return {"stopReason": "end_turn"}

    async def new_session(agent: FakeAgent, params: Any) -> Any:
        return {"sessionId": "s1"}

    agent = FakeAgent(handlers={"session/prompt": prompt, "session/new": new_session})
    async with connected(agent, fs=FsSandbox([tmp_path]), permission=policy) as client:
        with anyio.fail_after(5):
            await client.initialize()
            session = await client.new_session(tmp_path)
            await session.prompt("go")
    assert [reply.get("result", reply.get("error", {}).get("code")) for reply in replies] == [{}, {}, -32003]
    assert (covered.exists(), relative.exists(), other.exists()) == (True, True, False)
    assert [(q.tool_call_id, q.title, q.kind) for q in questions] == [
        ("call-1", "Edit two files", "edit"),
        (f"fs/write_text_file {other}", f"Write {other}", "edit"),
    ]
    assert [(o.option_id, o.kind) for o in questions[1].options] == [
        ("allow_once", "allow_once"),
        ("allow_always", "allow_always"),
        ("reject_once", "reject_once"),
    ]
    assert dict(questions[1].raw_input) == {"path": str(other), "bytes": len("written")}


async def test_allow_always_for_a_write_covers_every_later_write_of_the_session(tmp_path: Path) -> None:
    questions: list[PermissionQuestion] = []

    async def policy(question: PermissionQuestion) -> str | None:
        questions.append(question)
        return "allow_always"

    async def prompt(agent: FakeAgent, params: Any) -> Any:
        for name in ("a.txt", "b.txt"):
            await agent.ask("fs/write_text_file", write(tmp_path / name))
        return {"stopReason": "end_turn"}

    agent = FakeAgent(handlers={"session/prompt": prompt})
    async with connected(agent, fs=FsSandbox([tmp_path]), permission=policy) as client:
        with anyio.fail_after(5):
            session = await ready_session(client)
            await session.prompt("go")
            await session.prompt("again")
    assert [q.title for q in questions] == [f"Write {tmp_path / 'a.txt'}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt"]  # noqa: ASYNC240


async def test_a_write_outside_the_sandbox_is_refused_by_the_sandbox_and_never_put_to_the_policy(
    tmp_path: Path,
) -> None:
    questions: list[PermissionQuestion] = []

    async def policy(question: PermissionQuestion) -> str | None:
        questions.append(question)
        return "allow_once"

    replies: list[Any] = []

    async def prompt(agent: FakeAgent, params: Any) -> Any:
        replies.append(await asked(agent, "fs/write_text_file", write(tmp_path.parent / "planted.txt")))
        return {"stopReason": "end_turn"}

    root = tmp_path / "root"
    root.mkdir()
    agent = FakeAgent(handlers={"session/prompt": prompt})
    async with connected(agent, fs=FsSandbox([root]), permission=policy) as client:
        with anyio.fail_after(5):
            await (await ready_session(client)).prompt("go")
    assert replies[0]["error"]["code"] == -32602
    assert questions == []


# -- the client: modes and config options -------------------------------------------------------------


async def test_modes_and_config_options_stay_current_from_the_agents_updates_in_and_out_of_turns() -> None:
    async def new_session(agent: FakeAgent, params: Any) -> Any:
        return {"sessionId": "s1", "modes": MODES, "configOptions": CONFIG_OPTIONS}

    changed = [dict(CONFIG_OPTIONS[0], currentValue="big"), CONFIG_OPTIONS[1]]

    async def prompt(agent: FakeAgent, params: Any) -> Any:
        await agent.update("s1", {"sessionUpdate": "current_mode_update", "currentModeId": "yolo"})
        await agent.update("s1", {"sessionUpdate": "config_option_update", "configOptions": changed})
        return {"stopReason": "end_turn"}

    agent = FakeAgent(handlers={"session/new": new_session, "session/prompt": prompt})
    async with connected(agent) as client:
        with anyio.fail_after(5):
            session = await ready_session(client)
            assert session.current_mode_id == "auto"
            assert [mode.id for mode in session.offered_modes] == ["default", "auto", "yolo"]
            await session.prompt("go")
            assert session.current_mode_id == "yolo"
            assert [schema.to_builtins(o) for o in session.config_options or ()] == changed
            # Outside a turn too.
            arrived = anyio.Event()
            session.on_update(lambda update: arrived.set())
            await agent.update("s1", {"sessionUpdate": "current_mode_update", "currentModeId": "default"})
            await arrived.wait()
            assert session.current_mode_id == "default"


async def test_select_mode_uses_set_mode_for_a_mode_and_the_mode_config_option_otherwise() -> None:
    mode_option = {
        "type": "select",
        "id": "mode",
        "name": "Mode",
        "category": "mode",
        "currentValue": "ask",
        "options": [{"value": "ask", "name": "Ask"}, {"value": "code", "name": "Code"}],
    }

    async def new_session(agent: FakeAgent, params: Any) -> Any:
        return {"sessionId": "s1", "configOptions": [mode_option]}

    async def set_option(agent: FakeAgent, params: Any) -> Any:
        return {"configOptions": [dict(mode_option, currentValue=params["value"])]}

    agent = FakeAgent(handlers={"session/new": new_session, "session/set_config_option": set_option})
    async with connected(agent) as client:
        with anyio.fail_after(5):
            session = await ready_session(client)
            assert session.offered_modes == [
                ModeChoice("ask", "Ask", None, "mode"),
                ModeChoice("code", "Code", None, "mode"),
            ]
            await session.select_mode("code")
    assert (
        "session/set_config_option",
        {"sessionId": "s1", "configId": "mode", "value": "code"},
    ) in agent.received
    assert session.current_mode_id == "code"
    assert not any(method == "session/set_mode" for method, _ in agent.received)


async def test_configure_refuses_an_unknown_option_or_value_listing_what_the_agent_offers() -> None:
    async def new_session(agent: FakeAgent, params: Any) -> Any:
        return {"sessionId": "s1", "modes": MODES, "configOptions": CONFIG_OPTIONS}

    async with connected(FakeAgent(handlers={"session/new": new_session})) as client:
        with anyio.fail_after(5):
            session = await ready_session(client)
            with pytest.raises(SessionSettingError) as unknown:
                await session.configure({"temperature": "hot"})
            with pytest.raises(SessionSettingError) as value:
                await session.configure({"model": "huge"})
            with pytest.raises(SessionSettingError) as flag:
                await session.configure({"thinking": "maybe"})
            with pytest.raises(SessionSettingError) as mode:
                await session.select_mode("plan")
    assert (unknown.value.setting, unknown.value.offered) == ("temperature", ("model", "thinking"))
    assert (
        str(value.value)
        == "the agent's config option 'model' takes no value 'huge' (its values: 'small', 'big')"
    )
    assert flag.value.offered == ("true", "false")
    assert str(mode.value) == "the agent offers no mode 'plan' (its modes: 'default', 'auto', 'yolo')"


def test_mode_advice_follows_the_table_for_known_agents_and_the_name_for_others() -> None:
    qwen = [ModeChoice("default", "Default"), ModeChoice("auto", "Auto"), ModeChoice("plan", "Plan")]
    advice = mode_advice("qwen-code", qwen, "auto")
    assert advice is not None
    assert (advice.known, advice.switch_to) == (True, ModeChoice("default", "Default"))
    assert mode_advice("qwen-code", qwen, "plan") is None
    assert mode_advice("qwen-code", qwen, "default") is None
    other = [ModeChoice("careful", "Careful"), ModeChoice("bypass", "Bypass permissions")]
    unknown = mode_advice("some-agent", other, "bypass")
    assert unknown is not None
    assert (unknown.known, unknown.switch_to) == (False, None)
    assert mode_advice("some-agent", other, "careful") is None
    assert all(reads_as_approving(ModeChoice(id_, id_)) for id_ in ("yolo", "acceptEdits", "full-access"))
    for known in KNOWN_AGENT_MODES:
        assert known.asking not in known.approving


# -- the provider: before the first prompt -------------------------------------------------------------


def scenario(*, agent_name: str, out: Path, modes: dict[str, Any] = MODES) -> StubAgentTransport:
    """A stub agent (served in process) that, unless its mode approves by itself, asks before it writes
    ``out``."""
    return StubAgentTransport(
        {
            "initialize": {"agentInfo": {"name": agent_name, "version": "1.0"}},
            "newSession": {"modes": modes, "configOptions": CONFIG_OPTIONS},
            "turns": [
                [
                    {
                        "step": "permission",
                        "skipInModes": ["auto", "yolo"],
                        "toolCall": {"toolCallId": "w", "title": "Write out.txt", "kind": "edit"},
                        "branches": {"allow": [{"step": "write_file", "path": str(out), "content": "x"}]},
                    },
                    {"step": "message", "text": "done"},
                ]
            ],
        }
    )


async def run_turn(provider: AcpProvider, cwd: Path) -> tuple[SubagentResult, tuple[str | None, list[Any]]]:
    """One turn in ``cwd`` (nothing may leak); its result, and the session's mode and config options."""
    result, run = await run_once(provider, cwd=str(cwd))
    return result, (run.current_mode, [schema.to_builtins(option) for option in run.config_options])


async def test_the_callers_mode_and_config_options_are_applied_before_the_first_prompt(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out.txt"
    provider = AcpProvider(
        STUB,
        transport=scenario(agent_name="some-agent", out=out),
        mode="default",
        config_options={"model": "big", "thinking": "on"},
        permission="allow",
    )
    result, (mode, options) = await run_turn(provider, tmp_path)
    assert (result.stop_reason, mode) == ("completed", "default")
    assert [(o["id"], o["currentValue"]) for o in options] == [("model", "big"), ("thinking", True)]
    assert out.read_text() == "x"  # asked (mode default) and allowed


async def test_a_mode_the_agent_does_not_offer_fails_the_start_with_the_modes_it_does(tmp_path: Path) -> None:
    transport = scenario(agent_name="some-agent", out=tmp_path / "out.txt")
    provider = AcpProvider(STUB, transport=transport, mode="plan")
    with pytest.raises(SubagentError) as failed:
        await run_turn(provider, tmp_path)
    assert failed.value.code == ErrorCode.START_FAILED
    assert failed.value.message.endswith(
        "the agent offers no mode 'plan' (its modes: 'default', 'auto', 'yolo')"
    )


@pytest.mark.parametrize("permission", ["deny", "allow"])
async def test_a_known_agent_starting_in_an_approving_mode_is_moved_to_its_asking_mode_unless_all_is_allowed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, permission: Literal["allow", "deny"]
) -> None:
    out = tmp_path / "out.txt"
    provider = AcpProvider(STUB, transport=scenario(agent_name="qwen-code", out=out), permission=permission)
    result, (mode, _) = await run_turn(provider, tmp_path)
    assert result.stop_reason == "completed"
    if permission == "deny":
        assert mode == "default"
        assert not out.exists()
        assert (
            "started its session in mode 'auto', which approves tool calls by itself; switched it to "
            in caplog.text
        )
    else:
        assert mode == "auto"
        assert out.read_text() == "x"
        assert "switched" not in caplog.text


async def test_an_unknown_agent_in_a_mode_named_like_approval_is_warned_about_and_its_writes_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "out.txt"
    modes = dict(MODES, currentModeId="yolo")
    provider = AcpProvider(
        STUB,
        transport=scenario(agent_name="some-agent", out=out, modes=modes),
        permission="deny",
    )
    with caplog.at_level(logging.WARNING):
        result, (mode, _) = await run_turn(provider, tmp_path)
    assert (result.stop_reason, mode) == ("completed", "yolo")
    assert not out.exists()
    assert '"code":-32003' in result.output
    assert "runs its session in mode 'yolo', which may approve tool calls by itself" in caplog.text
    assert "choose a mode that asks with --mode ID (modes: default, auto, yolo)" in caplog.text


async def test_a_mode_chosen_by_the_caller_always_wins_and_the_write_is_still_refused_under_deny(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "out.txt"
    provider = AcpProvider(
        STUB,
        transport=scenario(agent_name="qwen-code", out=out),
        mode="auto",
        permission="deny",
    )
    result, (mode, _) = await run_turn(provider, tmp_path)
    assert (result.stop_reason, mode) == ("completed", "auto")
    assert not out.exists()
    assert "switched" not in caplog.text


class _NodeServedFiles:
    """A transport whose agents' files are served where they run (as ``RayTransport(fs_roots=...)``)."""

    name = "ray://test"
    local_files = False
    stdin_close_timeout = 1.0
    fs_roots = ("/srv/work",)

    def open(self, argv: Any, *, env: Any = None, cwd: Any = None) -> Any:
        raise NotImplementedError  # never opened: only the provider's construction is under test


@pytest.mark.parametrize("permission", ["deny", "allow"])
def test_a_transport_that_serves_writes_on_its_node_is_warned_about_unless_everything_is_allowed(
    caplog: pytest.LogCaptureFixture, permission: Literal["allow", "deny"]
) -> None:
    with caplog.at_level(logging.WARNING):
        AcpProvider(["agent"], transport=_NodeServedFiles(), permission=permission)  # type: ignore[arg-type]
    warned = "serves the agent's file writes on its node, inside its fs_roots, without asking the permission"
    assert (warned in caplog.text) == (permission == "deny")
