"""The programs under ``examples/`` run as documented, and the README quotes them truly."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BACKGROUND_EXAMPLE = ROOT / "examples" / "background_delegation.py"
BACKGROUND_SECTION = "## Background delegation"

BACKGROUND_TRANSCRIPT = [
    "user: Review api.py, db.py and web.py for unsafe calls.",
    'parent calls subagent {"provider": "spawn", "prompt": "Review api.py for unsafe calls.", '
    '"background": true}',
    'parent calls subagent {"provider": "spawn", "prompt": "Review db.py for unsafe calls.", '
    '"background": true}',
    'parent calls subagent {"provider": "fork", "prompt": "Review web.py for unsafe calls.", '
    '"background": true}',
    "  -> Started background subagent <handle> (spawn); it is running.",
    "  -> Started background subagent <handle> (spawn); it is running.",
    "  -> Started background subagent <handle> (fork); it is running.",
    'parent calls outline {"title": "Security review"}',
    "  -> Outline of 'Security review': 1. findings, 2. fixes.",
    'parent calls subagent_wait {"mode": "all", "timeout": 60}',
    "  -> api.py: eval() of request data on line 12.",
    "  -> db.py: no unsafe calls.",
    "  -> web.py: pickle.loads() of a cookie on line 40.",
    "parent: Security review: api.py: eval() of request data on line 12. db.py: no unsafe calls. "
    "web.py: pickle.loads() of a cookie on line 40. (completed)",
    "host heard: completed (spawn): Review api.py for unsafe calls.",
    "host heard: completed (spawn): Review db.py for unsafe calls.",
    "host heard: completed (fork): Review web.py for unsafe calls.",
    "runs left after the tool closed: 0",
]
"""What ``examples/background_delegation.py`` prints, on every run and either backend."""


def readme_section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    return text.split(f"\n{title}\n", 1)[1].split("\n## ", 1)[0]


@pytest.mark.subprocess
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_background_delegation_example_prints_its_transcript_exactly(backend: str) -> None:
    done = subprocess.run(
        [sys.executable, str(BACKGROUND_EXAMPLE), backend],
        capture_output=True,
        text=True,
        timeout=90,  # a hang guard: the example takes well under a second
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.splitlines() == BACKGROUND_TRANSCRIPT


def test_the_readme_shows_the_background_example_verbatim_and_its_output() -> None:
    section = readme_section(BACKGROUND_SECTION)
    (code,) = re.findall(r"^```python\n(.*?)^```$", section, flags=re.MULTILINE | re.DOTALL)
    (output,) = re.findall(r"^```text\n(.*?)^```$", section, flags=re.MULTILINE | re.DOTALL)
    example = BACKGROUND_EXAMPLE.read_text(encoding="utf-8")
    # The excerpt is parts of the program, cut where a line says `# ...`.
    parts = [part.strip("\n") for part in re.split(r"^ *# \.\.\.\n", code, flags=re.MULTILINE)]
    assert len(parts) >= 2
    for part in parts:
        assert part in example, f"the README's excerpt is not in {BACKGROUND_EXAMPLE.name}:\n{part}"
    assert output.splitlines() == BACKGROUND_TRANSCRIPT
