"""The OTel settings of the manifests work: with OTEL_EXPORTER_OTLP_ENDPOINT set, request
spans reach an OTLP/HTTP collector (a real HTTP server here), carrying the region and the
pod attributes given in OTEL_RESOURCE_ATTRIBUTES."""

from __future__ import annotations

import asyncio

import pytest
import uvicorn
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from edge_proxy.__main__ import parse_args
from edge_proxy.client import EdgeClient
from edge_proxy.server import bind
from edge_proxy.tracing import make_tracer, otlp_processor

from conftest import proxy_for, stubs

pytestmark = pytest.mark.anyio


def test_the_endpoint_variable_turns_export_on(monkeypatch):
    argv = ["--replica", "ws://127.0.0.1:9/v1/replica"]
    assert not parse_args(argv).otel_otlp
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://otel-collector.monitoring:4318")
    assert parse_args(argv).otel_otlp


async def test_spans_reach_an_otlp_collector(monkeypatch):
    bodies: asyncio.Queue[bytes] = asyncio.Queue()

    async def traces(request):
        bodies.put_nowait(await request.body())
        return Response(b"", media_type="application/x-protobuf")  # an empty ExportTraceServiceResponse

    sock = bind("127.0.0.1", 0)
    collector = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/v1/traces", traces, methods=["POST"])]),
                                              log_level="warning", lifespan="off"))
    serving = asyncio.get_running_loop().create_task(collector.serve(sockets=[sock]))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{sock.getsockname()[1]}")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "k8s.pod.name=edgechat-proxy-7d9f,k8s.namespace.name=edgechat")
    tracer = make_tracer("eu", [otlp_processor()])
    try:
        async with stubs("a") as reps, proxy_for(reps, tracer=tracer) as p:
            async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
                await c.complete(prompt="trace me", max_tokens=3)
            req = ExportTraceServiceRequest.FromString(await asyncio.wait_for(bodies.get(), 10))
    finally:
        await asyncio.to_thread(tracer.span_processor.shutdown)
        collector.should_exit = True
        await asyncio.wait_for(serving, 10)
    (rs,) = req.resource_spans
    resource = {kv.key: kv.value.string_value for kv in rs.resource.attributes}
    assert resource["service.name"] == "edgechat-proxy" and resource["edgechat.region"] == "eu"
    assert resource["k8s.pod.name"] == "edgechat-proxy-7d9f" and resource["k8s.namespace.name"] == "edgechat"
    (span,) = [s for ss in rs.scope_spans for s in ss.spans]
    attrs = {kv.key: kv.value for kv in span.attributes}
    assert span.name == "edgechat.generate" and attrs["edgechat.replica"].string_value == "a"
    assert attrs["edgechat.completion_tokens"].int_value == 3
