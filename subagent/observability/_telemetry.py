"""OpenTelemetry spans for runs, model calls, tool calls and permission waits: an optional extra.

``pip install subagent-seam[otel]`` brings the OpenTelemetry API; configure an SDK (a
``TracerProvider`` with an exporter) the usual way, or hand one to :func:`set_tracer_provider`,
and the library records:

======================================  ========  ===================================================
span                                    kind      what it covers
======================================  ========  ===================================================
``invoke_agent {gen_ai.agent.name}``    INTERNAL  a run of an in-process provider (``spawn``, ``fork``)
``invoke_agent {gen_ai.agent.name}``    CLIENT    a run of any other provider (an ACP child process)
``invoke_agent subagent-seam``          SERVER    one prompt served by ``subagent serve``
``chat {gen_ai.request.model}``         CLIENT    one model call of the in-process runtime
``execute_tool {gen_ai.tool.name}``     INTERNAL  one tool call of the in-process runtime
``permission_wait {gen_ai.tool.name}``  INTERNAL  a tool call's approver, from question to answer
``permission_wait``                     INTERNAL  a permission question an ACP child asked us
======================================  ========  ===================================================

A run's span lasts from :meth:`~subagent.service.SubagentService.start` to its end (its result
settled, or its disposal). Its parent is the parent run's span when the request's ``parent_id``
is a run of the same service, else whatever span is current where ``start()`` is called. An
in-process child's model and tool calls nest inside its run's span; an ACP child gets the run's
span as W3C ``traceparent`` (and ``tracestate``) in the ``_meta`` of ``session/new``, and
``subagent serve`` makes its prompts' spans children of it, so a served agent's spans join the
caller's trace across processes.

Names follow the OpenTelemetry GenAI semantic conventions (agent and model spans):
``gen_ai.operation.name``, ``gen_ai.provider.name``, ``gen_ai.agent.id``, ``gen_ai.agent.name``,
``gen_ai.conversation.id``, ``gen_ai.request.model``, ``gen_ai.response.finish_reasons``,
``gen_ai.usage.input_tokens``, ``gen_ai.usage.output_tokens``,
``gen_ai.usage.cache_read.input_tokens``, ``gen_ai.usage.cache_creation.input_tokens``,
``gen_ai.usage.reasoning.output_tokens``, ``gen_ai.tool.name``, ``gen_ai.tool.call.id``,
``gen_ai.tool.type`` and ``error.type``. ``gen_ai.provider.name`` is the model's provider on chat
spans (``openai`` for the OpenAI-compatible adapter, else ``_OTHER``) and ``subagent-seam`` on
agent spans. What the conventions lack is in the ``subagent.`` namespace: ``subagent.provider``
(the name of the seam provider that ran the child), ``subagent.parent.id`` (the parent run's or
agent's id), ``subagent.run.depth``, ``subagent.stop_reason``, and on permission waits
``subagent.permission.outcome`` (``allowed``, ``denied`` or ``cancelled``) and
``subagent.permission.kind`` (the ACP tool kind asked about).

A span that ends in failure has status ERROR and ``error.type``: the stop reason (``error``,
``timeout``, ``cancelled``), the :class:`~subagent.types.ErrorCode` value of a run that never
settled with a result (``disposed``, ``start_failed``), the LLM error kind of a model call, or
for a tool call ``unknown_tool``, ``invalid_arguments``, ``not_approved``, ``tool_error`` or the
exception's class name.

Prompts, outputs and tool arguments are never recorded by default: they may be secret. With
``SUBAGENT_OTEL_CAPTURE_CONTENT=1`` in the environment (read when a span starts) the run and
serve spans also carry ``gen_ai.input.messages`` / ``gen_ai.output.messages`` and tool spans
``gen_ai.tool.call.arguments`` / ``gen_ai.tool.call.result``, each cut at
:data:`CAPTURED_CONTENT_CHARS` characters.

Cost: nothing is recorded, and almost nothing done, unless a tracer provider is configured.
``opentelemetry`` is never imported by the library on its own: while nobody imported
``opentelemetry.trace`` no provider can be configured, so the check is a dictionary lookup, and
the library works without the package installed. With the API imported and its default (no-op
or proxy) provider, each run, model call and tool call pays one provider check; no span is ever
made per streamed chunk.
"""

from __future__ import annotations

import enum
import json
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Final, Literal

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer, TracerProvider

    from subagent.types import SubagentResult, Usage

__all__ = [
    "CAPTURED_CONTENT_CHARS",
    "CAPTURE_CONTENT_ENV",
    "PROVIDER_NAME",
    "enabled",
    "set_tracer_provider",
]

CAPTURE_CONTENT_ENV: Final = "SUBAGENT_OTEL_CAPTURE_CONTENT"
"""Set to ``1`` to record prompts, outputs and tool arguments and results on spans (cut short)."""

CAPTURED_CONTENT_CHARS: Final = 4096
"""How many characters of one captured prompt, output, argument list or result a span carries."""

MAX_ID_CHARS: Final = 256
"""How many characters of an id or a name a peer or a model chose (a tool call's) a span carries."""

PROVIDER_NAME: Final = "subagent-seam"
"""The ``gen_ai.provider.name`` of agent spans, and the ``gen_ai.agent.name`` of served prompts."""

TRACER_NAME: Final = "subagent-seam"
"""The instrumentation scope of every span."""

_TRACE_HEADERS: Final = ("traceparent", "tracestate")
"""The W3C trace context keys ACP reserves at the root of ``_meta``."""

_MAX_HEADER_CHARS: Final = 512
"""The longest ``tracestate`` W3C allows; anything longer from a peer is ignored."""

SpanKind = Literal["internal", "client", "server"]
Parent = Any
"""Where a span hangs: a span, an extracted context, or None for the current context."""

_explicit_provider: TracerProvider | None = None
_cached: tuple[object, Tracer] | None = None


def set_tracer_provider(provider: TracerProvider | None) -> None:
    """Record spans with ``provider`` rather than OpenTelemetry's global one (None: the global one
    again). For tests and for hosts that keep a provider of their own."""
    global _explicit_provider, _cached
    _explicit_provider = provider
    _cached = None


def _tracer() -> Tracer | None:
    """The tracer to record with, or None when no tracer provider is configured."""
    global _cached
    provider: object | None = _explicit_provider
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return None  # nobody imported the API: no provider can be configured
    if provider is None:
        provider = trace.get_tracer_provider()
        if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
            return None
    cached = _cached
    if cached is not None and cached[0] is provider:
        return cached[1]
    from subagent._version import __version__

    tracer: Tracer = provider.get_tracer(TRACER_NAME, __version__)  # type: ignore[union-attr]
    _cached = (provider, tracer)
    return tracer


def enabled() -> bool:
    """Whether spans are recorded now: a tracer provider is configured."""
    return _tracer() is not None


def capture_content() -> bool:
    """Whether content may go on spans (:data:`CAPTURE_CONTENT_ENV`)."""
    return os.environ.get(CAPTURE_CONTENT_ENV, "").strip().lower() in {"1", "true", "yes"}


def clip(text: str, limit: int = CAPTURED_CONTENT_CHARS) -> str:
    """``text`` cut to ``limit`` characters (:data:`CAPTURED_CONTENT_CHARS` unless given)."""
    if len(text) <= limit:
        return text
    return text[:limit] + "…"


def clip_id(text: str | None) -> str | None:
    """An id or name a peer or a model chose, cut to :data:`MAX_ID_CHARS` characters: a span's
    attributes are exported, so a peer must not make them large."""
    return None if text is None else clip(text, MAX_ID_CHARS)


def messages_json(role: str, text: str, finish_reason: str | None = None) -> str:
    """One message as ``gen_ai.input.messages`` / ``gen_ai.output.messages`` hold it (JSON)."""
    message: dict[str, Any] = {"role": role, "parts": [{"type": "text", "content": clip(text)}]}
    if finish_reason is not None:
        message["finish_reason"] = finish_reason
    return json.dumps([message], ensure_ascii=False)


def start_span(
    name: str, kind: SpanKind, attributes: Mapping[str, Any], parent: Parent = None
) -> Span | None:
    """Start a span (not made current), or None when nothing is recorded.

    ``parent``: a span (its context), a context from :func:`extract`, or None for the current one.
    """
    tracer = _tracer()
    if tracer is None:
        return None
    from opentelemetry import context as otel_context
    from opentelemetry import trace

    context: Context | None
    if parent is None or isinstance(parent, otel_context.Context):
        context = parent  # None: the current context
    else:
        context = trace.set_span_in_context(parent)
    return tracer.start_span(
        name,
        context=context,
        kind=getattr(trace.SpanKind, kind.upper()),
        attributes={key: value for key, value in attributes.items() if value is not None},
    )


def set_attributes(span: Span | None, attributes: Mapping[str, Any]) -> None:
    """Set the attributes that are not None on ``span`` (nothing when None)."""
    if span is None:
        return
    for key, value in attributes.items():
        if value is not None:
            span.set_attribute(key, value)


def set_usage(span: Span | None, usage: Usage | None) -> None:
    """Token counts as the GenAI conventions name them."""
    if span is None or usage is None:
        return
    set_attributes(
        span,
        {
            "gen_ai.usage.input_tokens": usage.input_tokens,
            "gen_ai.usage.output_tokens": usage.output_tokens,
            "gen_ai.usage.cache_read.input_tokens": usage.cached_read_tokens,
            "gen_ai.usage.cache_creation.input_tokens": usage.cached_write_tokens,
            "gen_ai.usage.reasoning.output_tokens": usage.thought_tokens,
        },
    )


def end_span(span: Span | None, error_type: str | None = None, description: str | None = None) -> None:
    """End ``span``: status ERROR with ``error.type`` when ``error_type`` is given. The description
    is for errors the library made itself; never pass a peer's or a model's text."""
    if span is None:
        return
    if error_type is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute("error.type", error_type)
        span.set_status(Status(StatusCode.ERROR, description))
    span.end()


_FAILED_STOP_REASONS: Final = frozenset({"error", "timeout", "cancelled"})
"""The stop reasons that end an agent span with status ERROR (the others are answers)."""


def error_type(exc: BaseException) -> str:
    """The ``error.type`` of an exception: a :class:`~subagent.types.SubagentError`'s code,
    ``cancelled`` for a cancellation, else the exception's class name."""
    code = getattr(exc, "code", None)
    if isinstance(code, enum.Enum):
        return str(code.value)
    import anyio

    if isinstance(exc, anyio.get_cancelled_exc_class()):
        return "cancelled"
    return type(exc).__qualname__


def end_agent_span(span: Span | None, outcome: SubagentResult | BaseException) -> None:
    """End an ``invoke_agent`` span with how the turn ended: its usage and stop reason, or the
    exception it ended with."""
    if span is None:
        return
    if isinstance(outcome, BaseException):
        end_span(span, error_type(outcome))
        return
    set_usage(span, outcome.usage)
    attributes: dict[str, Any] = {"subagent.stop_reason": outcome.stop_reason}
    if capture_content():
        attributes["gen_ai.output.messages"] = messages_json("assistant", str(outcome.output))
    set_attributes(span, attributes)
    end_span(span, outcome.stop_reason if outcome.stop_reason in _FAILED_STOP_REASONS else None)


_NOT_RECORDING: Final = nullcontext()


def current(span: Span | None) -> AbstractContextManager[None]:
    """Make ``span`` the current span for the block (nothing, at no cost, when None)."""
    return _NOT_RECORDING if span is None else _current(span)


@contextmanager
def _current(span: Span) -> Iterator[None]:
    from opentelemetry import context, trace

    token = context.attach(trace.set_span_in_context(span))
    try:
        yield
    finally:
        context.detach(token)


def current_context() -> Parent:
    """The current context, to hang spans on later from another task; None when nothing is
    recorded."""
    if _tracer() is None:
        return None
    from opentelemetry import context

    return context.get_current()


def inject(meta: dict[str, Any] | None) -> dict[str, Any] | None:
    """``meta`` with the current span's W3C ``traceparent`` (and ``tracestate``) added at its root,
    as ACP reserves them: a new dict (None stays None when there is nothing to add)."""
    if _tracer() is None:
        return meta
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    if not carrier:
        return meta
    return {**(meta or {}), **carrier}


def extract(meta: Mapping[str, Any] | None) -> Parent:
    """The trace context a peer sent at the root of ``_meta``, or None (no recording, none sent,
    or a malformed one: a peer's bad header costs it its link, nothing else)."""
    if meta is None or "traceparent" not in meta or _tracer() is None:
        return None
    carrier = {
        key: value
        for key in _TRACE_HEADERS
        if isinstance(value := meta.get(key), str) and len(value) <= _MAX_HEADER_CHARS
    }
    if "traceparent" not in carrier:
        return None
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    try:
        context = TraceContextTextMapPropagator().extract(carrier)
    except Exception:
        return None
    if not trace.get_current_span(context).get_span_context().is_valid:
        return None
    return context
