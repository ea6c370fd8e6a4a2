"""docs/api.md and the code agree on the public API: which modules are public, and what each exports.

A module is public when no part of its name starts with an underscore; each public module has a
section in docs/api.md (``## `module```) listing its ``__all__``, one ``- `name`: what it is`` line a
name (a generated module says so instead of listing). The implementation modules are private, so
moving one breaks no documented import.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import subagent

API_PAGE = Path(__file__).resolve().parent.parent / "docs" / "api.md"
GENERATED = "Generated, so not listed here"
"""What the section of a generated module (the ACP wire types) says in place of its names."""


def documented_api() -> dict[str, list[str] | None]:
    """Each module docs/api.md has a section for, with the names it lists (None: generated)."""
    sections: dict[str, list[str] | None] = {}
    module: str | None = None
    for line in API_PAGE.read_text(encoding="utf-8").splitlines():
        if heading := re.fullmatch(r"## `([\w.]+)`", line):
            module = heading[1]
            assert module not in sections, f"two sections for {module}"
            sections[module] = []
        elif module is not None and (item := re.match(r"- `(\w+)`: \S", line)):
            listed = sections[module]
            assert listed is not None, f"{module}: a generated module's section lists {item[1]}"
            listed.append(item[1])
        elif module is not None and GENERATED in line:
            sections[module] = None
    return sections


def public_modules() -> list[str]:
    """Every module of the package that no underscore makes private, the package itself first."""
    found = [
        info.name
        for info in pkgutil.walk_packages(subagent.__path__, "subagent.")
        if not any(part.startswith("_") for part in info.name.split(".")[1:])
    ]
    return ["subagent", *sorted(found)]


DOCUMENTED = documented_api()


def test_every_public_module_and_no_other_has_a_section_in_the_api_page() -> None:
    assert sorted(DOCUMENTED) == sorted(public_modules())


@pytest.mark.parametrize("module_name", sorted(DOCUMENTED))
def test_a_public_module_exports_exactly_what_the_api_page_lists(module_name: str) -> None:
    module = importlib.import_module(module_name)
    listed = DOCUMENTED[module_name]
    exported = list(module.__all__)

    if listed is None:
        assert exported
    else:
        assert sorted(listed) == sorted(exported)
    assert [name for name in exported if not hasattr(module, name)] == []


RE_EXPORTS = {("subagent.delegation", "subagent.tool")}
"""Modules that share names without one being a package of the other: the tool's shim."""


def test_a_package_exports_the_very_objects_its_modules_define() -> None:
    pairs = RE_EXPORTS | {
        (package, module)
        for package in DOCUMENTED
        for module in DOCUMENTED
        if module.startswith(f"{package}.")
    }
    differing = [
        f"{package}.{name} is not {module}.{name}"
        for package, module in sorted(pairs)
        for name in sorted(set(DOCUMENTED[package] or ()) & set(DOCUMENTED[module] or ()))
        if getattr(importlib.import_module(package), name)
        is not getattr(importlib.import_module(module), name)
    ]
    assert differing == []


def test_the_tool_module_exports_the_tools_names_from_delegation_and_nothing_of_its_own() -> None:
    assert set(DOCUMENTED["subagent.tool"] or ()) <= set(DOCUMENTED["subagent.delegation"] or ())
