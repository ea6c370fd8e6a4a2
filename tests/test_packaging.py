"""The wheel carries what the package reads as data: a trace page renders from an installed wheel.

The trace page's style and script are files of ``subagent.observability`` (``trace_page.css``,
``trace_page.js``) read with ``importlib.resources``; a source checkout finds them beside the code
whatever the packaging says, so the wheel is built here and the page rendered from its files alone.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DATA = ("subagent/observability/trace_page.css", "subagent/observability/trace_page.js")

RENDER = """\
import sys
import subagent.observability
from subagent.observability import render_trace_page
print(subagent.observability.__file__)
sys.stdout.write(render_trace_page([{"event": "start", "t": 0.0}, {"event": "end", "t": 1.0}], "packaged"))
"""


def build_wheel(directory: Path) -> Path:
    done = subprocess.run(
        [sys.executable, "-m", "hatchling", "build", "-t", "wheel", "-d", str(directory)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = directory.glob("*.whl")
    return wheel


def test_a_trace_page_renders_from_the_built_wheel_with_its_style_and_script(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path / "dist")
    installed = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        assert set(PACKAGE_DATA) <= set(archive.namelist())
        archive.extractall(installed)

    # From a directory of its own: the checkout (and its editable install) comes after PYTHONPATH.
    done = subprocess.run(
        [sys.executable, "-c", RENDER],
        cwd=tmp_path,
        env={"PYTHONPATH": str(installed), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert done.returncode == 0, done.stderr
    where, page = done.stdout.split("\n", 1)
    assert Path(where).is_relative_to(installed)
    style, script = ((ROOT / name).read_text(encoding="utf-8") for name in PACKAGE_DATA)
    assert f"<style>\n{style}</style>" in page
    assert f"<script>\n{script}</script>" in page
    assert "<title>packaged</title>" in page
