"""Lazy exports for a package's ``__init__`` (PEP 562): a name's module is imported when the name is
first looked up, so importing a package costs only what its caller uses.

The package imports its exports for type checkers in an ``if TYPE_CHECKING:`` block (``__all__``
makes them re-exports), and calls `lazy_exports` in the ``else`` branch, where type checkers do not
look: they see the real names, never a catch-all ``__getattr__`` that would let any misspelt name
through.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str,
    names: Sequence[str],
    modules: Mapping[str, Sequence[str]],
    *,
    default: str | None = None,
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of `package`, which exports ``names`` (its ``__all__``).

    Each name is found in the module that ``modules`` (``{module: names}``) lists it under, or else in
    ``default``. A name resolved once is stored in the package's namespace, so later lookups do not come
    back here. Any other name raises `AttributeError`, which is also what lets ``from package import
    submodule`` fall back to importing the submodule.

    Raises:
        ValueError: ``modules`` lists a name that is not in ``names``, or a name has no module.
    """
    home = {name: module for module, listed in modules.items() for name in listed}
    strays = sorted(set(home) - set(names))
    if strays:
        raise ValueError(f"{package}: {', '.join(strays)} not in __all__")
    for name in names:
        if name not in home:
            if default is None:
                raise ValueError(f"{package}: no module exports {name}")
            home[name] = default
    namespace = vars(sys.modules[package])

    def __getattr__(name: str) -> object:
        module = home.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        # The import statement's own path (importlib.import_module is not), so -X importtime lists it.
        __import__(module)
        value = getattr(sys.modules[module], name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *home})

    return __getattr__, __dir__
