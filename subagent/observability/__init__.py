"""What a run leaves to look at: OpenTelemetry spans, and the trace page.

The package, one job per module:

* ``_telemetry``: spans for runs, model calls, tool calls and permission waits (OpenTelemetry's API is
  an extra, ``subagent-seam[otel]``; nothing is recorded unless a tracer provider is configured, or
  handed over with `set_tracer_provider`);
* ``_trace_page``: `TraceBuilder` and `render_trace_page`, a recorded event stream in, one
  self-contained HTML page out, each kept part bounded (`MAX_RUNS`, `MAX_MARKS`...), the page of any
  event stream at most `MAX_PAGE_BYTES`; the page's style and script are the package data files
  ``trace_page.css`` and ``trace_page.js``.

The command line records a run for the page (``subagent run --events-file``, ``--trace`` and
``subagent trace``) in its own package, as a view of the run like its others. The names below are
loaded when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = [
    "CAPTURED_CONTENT_CHARS",
    "CAPTURE_CONTENT_ENV",
    "MAX_KEPT_LABEL_BYTES",
    "MAX_KEPT_MARKS",
    "MAX_KEPT_TEXT_BYTES",
    "MAX_MARKS",
    "MAX_PAGE_BYTES",
    "MAX_RUNS",
    "MAX_TEXT_CHARS",
    "PROVIDER_NAME",
    "TraceBuilder",
    "render_trace_page",
    "set_tracer_provider",
]

if TYPE_CHECKING:
    from subagent.observability._telemetry import (
        CAPTURE_CONTENT_ENV,
        CAPTURED_CONTENT_CHARS,
        PROVIDER_NAME,
        set_tracer_provider,
    )
    from subagent.observability._trace_page import (
        MAX_KEPT_LABEL_BYTES,
        MAX_KEPT_MARKS,
        MAX_KEPT_TEXT_BYTES,
        MAX_MARKS,
        MAX_PAGE_BYTES,
        MAX_RUNS,
        MAX_TEXT_CHARS,
        TraceBuilder,
        render_trace_page,
    )
else:
    from subagent._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(
        __name__,
        __all__,
        {
            "subagent.observability._telemetry": (
                "CAPTURED_CONTENT_CHARS",
                "CAPTURE_CONTENT_ENV",
                "PROVIDER_NAME",
                "set_tracer_provider",
            ),
        },
        default="subagent.observability._trace_page",
    )
