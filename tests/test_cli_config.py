"""The command line's config loader, in process: the schema's typed structs, and the message of every way
a file can break them (the file, the dotted key, what is wrong; never a value that may be a secret).

tests/test_cli.py runs the same files through `subagent run --agent` as a subprocess.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from subagent.cli._config import AGENT_KEYS, AgentConfig, ConfigError, load_config


def load(tmp_path: Path, text: str) -> dict[str, AgentConfig]:
    path = tmp_path / "subagent.toml"
    path.write_text(text, encoding="utf-8")
    return dict(load_config(path).agents)


def error_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, text)
    prefix = f"{tmp_path / 'subagent.toml'}: "
    message = str(caught.value)
    assert message.startswith(prefix)
    return message.removeprefix(prefix)


def test_every_key_of_an_agent_is_read_with_its_type(tmp_path: Path) -> None:
    agents = load(
        tmp_path,
        '[agents.claude]\ndescription = "Claude"\ncommand = "npx"\nargs = ["-y", "pkg"]\n'
        'env = { LOG = "error" }\ncwd = "work"\npermission = "ask"\ntimeout = 600\nready_timeout = 1.5\n'
        'auth_method = "login"\nfs = false\ntransport = "local"\n\n[agents.plain]\ncommand = "agent"\n',
    )
    assert agents == {
        "claude": AgentConfig(
            name="claude",
            command=("npx", "-y", "pkg"),
            source=tmp_path / "subagent.toml",
            description="Claude",
            env={"LOG": "error"},
            cwd=os.path.join(tmp_path.resolve(), "work"),
            permission="ask",
            timeout=600.0,
            ready_timeout=1.5,
            auth_method="login",
            fs=False,
            transport="local",
        ),
        "plain": AgentConfig(name="plain", command=("agent",), source=tmp_path / "subagent.toml"),
    }


KNOWN = ", ".join(AGENT_KEYS)

BROKEN_FILES = [
    ("[agent.typo]\n",
     "agent: unknown key (the top level has the key journal and the tables [agents], [budget], [isolation] "
     "and [prices])"),
    ("journal = 3\n", 'journal: must be a path to the run journal (a string, e.g. "runs.db") or false'),
    ('journal = ""\n', 'journal: must be a path to the run journal (a string, e.g. "runs.db") or false'),
    ("agents = 3\n", "agents: must be a table of agents, e.g. [agents.NAME], not a number (3)"),
    ("[agents]\nb = 3\n", "agents.b: must be a table, e.g. [agents.NAME] with a `command`, not a number (3)"),
    ('[agents."a b"]\ncommand = "x"\n',
     "agents.\"a b\": an agent name uses letters, digits, '_', '-' and '.', "
     "and starts with a letter or digit"),
    ('[agents.b]\ncomand = "x"\n', f"agents.b.comand: unknown key (known keys: {KNOWN})"),
    ('[agents.b]\nargs = ["x"]\n', 'agents.b.command: missing: the program to run, e.g. command = "npx"'),
    ('[agents.b]\ncommand = "  "\n', "agents.b.command: must not be empty"),
    ("[agents.b]\ncommand = 2024-01-01\n", "agents.b.command: must be a string, not a date"),
]  # fmt: skip

BROKEN_KEYS = [
    ('args = "one"', "args: must be an array of strings, not a string ('one')"),
    ('args = ["ok", 3]', "args[1]: must be a string, not a number (3)"),
    ("env = 3", 'env: must be a table of strings, e.g. env = { KEY = "value" }, not a number (3)'),
    ('env = { A = "1", B = 2 }', "env.B: must be a string, not a number (2)"),
    ('permission = "maybe"', "permission: must be one of 'allow', 'deny', 'ask', not 'maybe'"),
    ("timeout = 0", "timeout: must be a positive number of seconds, not 0"),
    ("timeout = inf", "timeout: must be a positive number of seconds, not inf"),
    ("ready_timeout = true", "ready_timeout: must be a positive number of seconds, not a boolean"),
    ('auth_method = ""', "auth_method: must not be empty"),
    ('fs = "no"', "fs: must be true or false, not a string ('no')"),
    ("transport = 3", 'transport: must be a transport URL, e.g. "ssh://host", not a number (3)'),
    ('transport = " "', "transport: must not be empty"),
    ('transport = "build-1"',
     "transport: not a transport URL: expected 'local', 'ssh://…' or 'ray://…'"),
    ('transport = "https://me:secret@host"',
     "transport: unknown transport scheme 'https': expected 'local', 'ssh://…' or 'ray://…'"),
    ('transport = "ray://head"',
     "transport: a ray transport URL names the cluster's GCS address: ray://HOST:PORT or ray://auto"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "message"), BROKEN_FILES)
def test_a_file_that_breaks_the_schema_is_refused_naming_the_key_and_what_is_wrong(
    tmp_path: Path, text: str, message: str
) -> None:
    assert error_of(tmp_path, text) == message


@pytest.mark.parametrize(("line", "message"), BROKEN_KEYS)
def test_an_agent_key_of_the_wrong_type_or_range_is_refused_naming_it(
    tmp_path: Path, line: str, message: str
) -> None:
    assert error_of(tmp_path, f'[agents.b]\ncommand = "x"\n{line}\n') == f"agents.b.{message}"


def test_the_entry_an_error_is_about_is_named_among_many_good_ones(tmp_path: Path) -> None:
    good = "".join(f'[agents.a{index}]\ncommand = "x"\nenv = {{ K = "v" }}\n' for index in range(50))
    text = good + '[agents.z]\ncommand = "x"\nenv = { A = "1", "B=C" = "2", D = 3 }\n'
    assert error_of(tmp_path, text) == (
        "agents.z.env.\"B=C\": an environment name must be non-empty, with no '=' and no NUL character"
    )


def test_a_secret_with_a_nul_is_refused_without_repeating_it(tmp_path: Path) -> None:
    message = error_of(tmp_path, '[agents.b]\ncommand = "x"\nenv = { TOKEN = "hunter\\u00002" }\n')
    assert message == "agents.b.env.TOKEN: contains a NUL character, which no program can receive"


def test_a_key_whose_text_looks_like_an_error_path_is_still_refused(tmp_path: Path) -> None:
    # The key's own text ends like msgspec's "- at `$.agents`": the message keeps it, never a traceback.
    message = error_of(tmp_path, '["x - at `$.agents"]\n')
    assert "unknown field `x - at `$.agents`" in message


def test_an_agent_on_another_host_keeps_its_transport_url(tmp_path: Path) -> None:
    agents = load(tmp_path, '[agents.far]\ncommand = "codex-acp"\ntransport = "ssh://builder@build-1:2222"\n')
    assert agents["far"].transport == "ssh://builder@build-1:2222"


def test_an_agent_on_ssh_keeps_its_ssh_options_and_its_ssh_config_resolved_from_the_file(
    tmp_path: Path,
) -> None:
    agents = load(
        tmp_path,
        '[agents.far]\ncommand = "codex-acp"\ntransport = "ssh://build-1"\nssh_config = "ssh/../ssh.conf"\n'
        'ssh_options = ["ConnectTimeout=20", "ProxyJump bastion"]\n',
    )
    assert (agents["far"].ssh_config, agents["far"].ssh_options) == (
        os.path.join(tmp_path.resolve(), "ssh.conf"),
        ("ConnectTimeout=20", "ProxyJump bastion"),
    )


def test_a_transport_url_with_a_password_is_refused_without_repeating_it(tmp_path: Path) -> None:
    message = error_of(tmp_path, '[agents.far]\ncommand = "x"\ntransport = "ssh://me:hunter22@build-1"\n')
    assert message.startswith("agents.far.transport: ")
    assert "hunter22" not in message
