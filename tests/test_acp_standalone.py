"""The ACP client stands on its own, and the packages export their names lazily.

``subagent.acp`` is a library of its own (an ACP client, an agent side, a child-process owner): using
it must not load the seam (service, run types, events, providers, runtime, command line). The
package roots (`subagent`, `subagent.acp`, `subagent.providers`) load a name's module when the name is
first used (PEP 562), and every public name still resolves and is listed by ``dir()``. Every exception
of the ACP package is defined in `subagent.acp._errors`, derives from `AcpError`, and is drawn in the
module's tree.
"""

from __future__ import annotations

import importlib
import json
import math
import pkgutil
import re
import subprocess
import sys
from types import ModuleType

import pytest

import subagent
import subagent.acp
import subagent.acp.transports
import subagent.providers
from subagent._lazy import lazy_exports
from subagent.acp import _errors as errors

SEAM_MODULES = (
    "subagent.service",
    "subagent.types",
    "subagent.events",
    "subagent.tool",
    "subagent.serve",
    "subagent.delegation",
    "subagent.observability",
    "subagent.runtime",
    "subagent.providers",
    "subagent.cli",
    "subagent.testing",
    "subagent._structured",
    "subagent._usage_codec",
)
"""Every module (or package, with all below it) of the seam, which the ACP package must not load."""

ACP_CLIENT_MODULES = (
    "subagent.acp.client",
    "subagent.acp.connection",
    "subagent.acp._errors",
    "subagent.acp.handlers",
    "subagent.acp.transports._local",
    "subagent.acp.schema",
)
"""What using the ACP client (``from subagent.acp import AcpClient``) has to load."""

ACP_MODULES = tuple(
    info.name
    for info in pkgutil.walk_packages(subagent.acp.__path__, "subagent.acp.")
    if info.name != "subagent.acp.transports._supervisor"  # run by a child Python, never imported here
)
"""Every module of the ACP package, its subpackages' included."""

TRANSPORT_MODULES = tuple(name for name in ACP_MODULES if name.startswith("subagent.acp.transports."))
"""Every module of the transports package."""

CLIENT_LAYERS = (
    "subagent.acp.connection",
    "subagent.acp.client",
    "subagent.acp.handlers",
    "subagent.acp.terminals",
    "subagent.acp._file_router",
    "subagent.acp.agent",
)
"""The layers of the ACP package above the transports, which move bytes and own processes only."""


def modules_loaded_by(code: str) -> set[str]:
    """The modules a fresh interpreter imports to run ``code``, read from ``-X importtime``."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    loaded = set()
    for line in done.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":  # the header line
                loaded.add(name)
    return loaded


def seam_modules_in(loaded: set[str]) -> list[str]:
    return sorted(
        name for name in loaded for seam in SEAM_MODULES if name == seam or name.startswith(f"{seam}.")
    )


def test_importing_the_acp_package_loads_nothing_of_the_seam() -> None:
    loaded = modules_loaded_by("import subagent.acp")

    assert "subagent.acp" in loaded
    assert seam_modules_in(loaded) == []


def test_using_the_acp_client_loads_the_client_and_nothing_of_the_seam() -> None:
    loaded = modules_loaded_by("from subagent.acp import AcpClient, spawn_agent")

    assert set(ACP_CLIENT_MODULES) <= loaded
    assert seam_modules_in(loaded) == []


def test_no_module_of_the_acp_package_loads_the_seam() -> None:
    assert {"subagent.acp.agent", "subagent.acp._stdio", "subagent.acp._frozen"} <= set(ACP_MODULES)
    loaded = modules_loaded_by("; ".join(f"import {name}" for name in ACP_MODULES))

    assert set(ACP_MODULES) <= loaded
    assert seam_modules_in(loaded) == []


def test_the_transports_load_none_of_the_clients_layers() -> None:
    assert {"subagent.acp.transports._local", "subagent.acp.transports._ray"} <= set(TRANSPORT_MODULES)
    loaded = modules_loaded_by("; ".join(f"import {name}" for name in TRANSPORT_MODULES))

    assert set(TRANSPORT_MODULES) <= loaded
    assert sorted(loaded & set(CLIENT_LAYERS)) == []
    assert seam_modules_in(loaded) == []


def test_the_seam_vocabulary_does_not_load_the_acp_client() -> None:
    # subagent.types takes freeze_json/thaw_json from a small module of the ACP package, not the client.
    loaded = modules_loaded_by("import subagent.types")

    assert "subagent.acp._frozen" in loaded
    assert "subagent.acp.client" not in loaded
    assert "subagent.acp.connection" not in loaded


def test_importing_the_spawn_provider_does_not_load_the_acp_provider() -> None:
    loaded = modules_loaded_by("import subagent.providers.spawn")

    assert "subagent.providers.spawn" in loaded
    assert "subagent.providers.acp" not in loaded
    assert "subagent.acp.client" not in loaded


@pytest.mark.parametrize(
    "package",
    [subagent, subagent.acp, subagent.acp.transports, subagent.providers],
    ids=lambda p: p.__name__,
)
def test_every_public_name_of_a_package_resolves_and_is_listed(package: ModuleType) -> None:
    names = list(package.__all__)

    missing = [name for name in names if getattr(package, name, None) is None]
    assert missing == []
    assert set(names) <= set(dir(package))


@pytest.mark.parametrize(
    ("package", "name", "module"),
    [
        ("subagent.acp.transports", "LocalTransport", "subagent.acp.transports._local"),
        ("subagent.acp.transports", "Channel", "subagent.acp.transports._channel"),
        ("subagent.acp.transports", "SshTransport", "subagent.acp.transports._ssh"),
        ("subagent", "SubagentService", "subagent.service"),
        ("subagent", "SubagentRequest", "subagent.types"),
        ("subagent", "EventHub", "subagent.events"),
        ("subagent.acp", "AcpClient", "subagent.acp.client"),
        ("subagent.acp", "AgentSpawnError", "subagent.acp._errors"),
        ("subagent.providers", "AcpProvider", "subagent.providers.acp"),
        ("subagent.providers", "SpawnProvider", "subagent.providers.spawn"),
        ("subagent.providers", "ForkProvider", "subagent.providers.fork"),
    ],
)
def test_a_lazily_exported_name_is_the_object_its_module_defines(
    package: str, name: str, module: str
) -> None:
    exported = getattr(importlib.import_module(package), name)

    assert exported is getattr(importlib.import_module(module), name)


def test_a_name_a_package_does_not_export_raises_attribute_error() -> None:
    with pytest.raises(AttributeError) as caught:
        _ = subagent.acp.NoSuchName  # type: ignore[attr-defined]

    assert str(caught.value) == "module 'subagent.acp' has no attribute 'NoSuchName'"


def test_the_json_freezing_helpers_are_still_importable_from_the_seam_vocabulary() -> None:
    from subagent.acp._frozen import freeze_json as acp_freeze
    from subagent.types import freeze_json, thaw_json

    assert freeze_json is acp_freeze
    frozen = freeze_json({"a": [1, {"b": 2}]})
    with pytest.raises(TypeError):
        frozen["a"] = 0
    assert frozen["a"] == (1, {"b": 2})
    assert thaw_json(frozen) == {"a": [1, {"b": 2}]}


def test_an_export_table_that_disagrees_with_all_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fake_package", ModuleType("fake_package"))

    with pytest.raises(ValueError, match=r"^fake_package: Stray not in __all__$"):
        lazy_exports("fake_package", ["Listed"], {"json": ("Listed", "Stray")})
    with pytest.raises(ValueError, match=r"^fake_package: no module exports Homeless$"):
        lazy_exports("fake_package", ["Listed", "Homeless"], {"json": ("Listed",)})


def test_a_name_no_module_lists_comes_from_the_default_module(monkeypatch: pytest.MonkeyPatch) -> None:
    package = ModuleType("fake_package")
    monkeypatch.setitem(sys.modules, "fake_package", package)
    getattr_, dir_ = lazy_exports("fake_package", ["dumps", "sqrt"], {"math": ("sqrt",)}, default="json")

    assert getattr_("dumps") is json.dumps
    assert getattr_("sqrt") is math.sqrt
    assert vars(package)["dumps"] is json.dumps  # stored: the next lookup does not come back
    assert dir_() == sorted({*vars(package), "dumps", "sqrt"})


def exceptions_defined_in(module: ModuleType) -> dict[str, type[BaseException]]:
    return {
        name: value
        for name, value in vars(module).items()
        if isinstance(value, type)
        and issubclass(value, BaseException)
        and value.__module__ == module.__name__
    }


def test_every_public_exception_of_the_acp_package_is_in_errors_and_derives_from_acp_error() -> None:
    elsewhere = [
        f"{module}.{name}"
        for module in ACP_MODULES
        if module != "subagent.acp._errors"
        for name in exceptions_defined_in(importlib.import_module(module))
        if not name.startswith("_")  # an internal signal, caught where it is raised
    ]
    in_errors = exceptions_defined_in(errors)

    assert elsewhere == []
    assert [name for name, cls in in_errors.items() if not issubclass(cls, errors.AcpError)] == []
    assert set(in_errors) <= set(errors.__all__)


def test_the_errors_module_draws_every_exception_of_the_tree() -> None:
    # The tree is the docstring's only indented block: one class a line, after its branch lines.
    drawn = re.findall(r"^    [│ ]*(?:[├└]── )?(\w+)", errors.__doc__ or "", re.MULTILINE)

    assert sorted(drawn) == sorted(exceptions_defined_in(errors))
