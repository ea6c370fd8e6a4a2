"""Test-only: a child process started with this directory on PYTHONPATH records its spans as JSON
lines in the file ``SUBAGENT_OTEL_TEST_EXPORT`` names (tests/test_telemetry.py reads them back).
The library never reads that variable: this is how a test sees a served agent's spans."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

_PATH = os.environ.get("SUBAGENT_OTEL_TEST_EXPORT")

if _PATH:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    class _JsonLinesExporter(SpanExporter):
        def __init__(self, path: str) -> None:
            self._path = path

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            with open(self._path, "a", encoding="utf-8") as file:
                for span in spans:
                    context = span.get_span_context()
                    assert context is not None
                    record = {
                        "name": span.name,
                        "kind": span.kind.name,
                        "trace_id": format(context.trace_id, "032x"),
                        "span_id": format(context.span_id, "016x"),
                        "parent_id": None if span.parent is None else format(span.parent.span_id, "016x"),
                        "status": span.status.status_code.name,
                        "attributes": dict(span.attributes or {}),
                    }
                    file.write(json.dumps(record, default=list) + "\n")
            return SpanExportResult.SUCCESS

    _provider = TracerProvider()
    _provider.add_span_processor(SimpleSpanProcessor(_JsonLinesExporter(_PATH)))
    trace.set_tracer_provider(_provider)
