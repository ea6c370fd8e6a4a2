"""Transports by URL: `transport_from_url` builds the transport a URL names (the CLI's ``--on``, the
TOML config's ``transport``), from the table of schemes `TRANSPORT_SCHEMES`."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

from subagent.acp.transports._channel import Transport
from subagent.acp.transports._local import LocalTransport

__all__ = ["TRANSPORT_SCHEMES", "transport_from_url"]

_SCHEME = re.compile(r"\A[A-Za-z][A-Za-z0-9+.-]{0,31}\Z")
"""A URL scheme (RFC 3986), of a sane length: anything else before ``://`` is not a scheme."""

TRANSPORT_SCHEMES: dict[str, str] = {
    "ssh": "subagent.acp.transports._ssh:transport_from_url",
    "ray": "subagent.acp.transports._ray:transport_from_url",
}
"""URL scheme -> ``"module:function"`` building that transport from the whole URL string (raising
`ValueError` for a malformed one). The module is imported only when its scheme is used; a scheme whose
module does not exist yet is reported as not available. ``local`` is not listed: it takes no URL."""


def transport_from_url(url: str | None) -> Transport:
    """The transport a URL names: ``None`` or ``"local"`` -> `LocalTransport` (default options);
    ``ssh://[user@]host[:port]`` -> the SSH transport; ``ray://ADDRESS`` -> the Ray transport.

    Error messages never quote the URL (it may carry a password): only its scheme.

    Raises:
        ValueError: The URL is malformed, its scheme is unknown, or its transport is not available
            in this installation.
    """
    if url is None or url == "local":
        return LocalTransport()
    if not isinstance(url, str):
        raise TypeError(f"a transport URL is a string, not {type(url).__name__}")
    forms = ["'local'", *(f"'{scheme}://…'" for scheme in TRANSPORT_SCHEMES)]
    expected = f"expected {', '.join(forms[:-1])} or {forms[-1]}"
    scheme, separator, _ = url.partition("://")
    if not separator or not _SCHEME.match(scheme):
        raise ValueError(f"not a transport URL: {expected}")
    target = TRANSPORT_SCHEMES.get(scheme.lower())
    if target is None:
        raise ValueError(f"unknown transport scheme {scheme!r}: {expected}")
    module_name, _, function_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise ValueError(f"the {scheme.lower()}:// transport is not available yet") from None
    factory: Callable[[str], Transport] = getattr(module, function_name)
    return factory(url)
