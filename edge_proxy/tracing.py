"""OpenTelemetry spans, one per request, continuing the client's W3C `traceparent`
and forwarding the span's own context to the replica in `Generate.traceparent`.

No global provider is installed: the app owns its `TracerProvider`, so tests and
several apps in one process stay apart. Span work happens once per request and
per failover, never per token. Spans go to stdout (`--otel-console`) and/or to an
OTLP collector (`OTEL_EXPORTER_OTLP_ENDPOINT`); `OTEL_RESOURCE_ATTRIBUTES` (pod,
node) joins the resource.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()


def make_tracer(region: str, processors: list[SpanProcessor] = ()) -> trace.Tracer:
    provider = TracerProvider(resource=Resource.create({"service.name": "edgechat-proxy", "edgechat.region": region}))
    for p in processors:
        provider.add_span_processor(p)
    return provider.get_tracer("edge_proxy")


def console_processor() -> SpanProcessor:
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    return BatchSpanProcessor(ConsoleSpanExporter())


def otlp_processor() -> SpanProcessor:
    """Spans to an OTLP/HTTP collector, set up by the standard variables
    (OTEL_EXPORTER_OTLP_ENDPOINT or ..._TRACES_ENDPOINT, ..._HEADERS, OTEL_BSP_*)."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as e:
        raise ValueError("OTEL_EXPORTER_OTLP_ENDPOINT is set but the OTLP exporter is not installed: "
                         "pip install 'edgechat[otlp]' (the proxy image has it)") from e
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    return BatchSpanProcessor(OTLPSpanExporter())


def start_request_span(tracer: trace.Tracer, traceparent: str | None, attrs: dict) -> trace.Span:
    ctx = _PROPAGATOR.extract({"traceparent": traceparent}) if traceparent else None
    return tracer.start_span("edgechat.generate", context=ctx, kind=trace.SpanKind.SERVER, attributes=attrs)


def traceparent_of(span: trace.Span) -> str:
    """The W3C header value naming `span` as the parent (what the replica continues)."""
    sc = span.get_span_context()
    if not sc.is_valid:
        return ""
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"
