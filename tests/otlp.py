"""Real OTLP receivers for tests: HTTP/protobuf and gRPC, decoding ExportTraceServiceRequest and
ExportMetricsServiceRequest."""

import socket
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.conftest import free_port


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    attributes: dict
    events: list[tuple[str, int, dict]]  # (name, time in ns, attributes)
    links: list[tuple[str, str]]  # (trace id, span id)
    start_ns: int
    end_ns: int
    status_code: int
    resource: dict = field(default_factory=dict)


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attributes(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


def _scoped(resources, scopes: str, items: str):
    """(resource attributes, item) for each item of an OTLP export: resources hold scopes, scopes hold items."""
    for r in resources:
        resource = _attributes(r.resource.attributes)
        for scope in getattr(r, scopes):
            for item in getattr(scope, items):
                yield resource, item


def decode(request: trace_service_pb2.ExportTraceServiceRequest) -> list[Span]:
    return [Span(s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name, _attributes(s.attributes),
                 [(e.name, e.time_unix_nano, _attributes(e.attributes)) for e in s.events],
                 [(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                 s.start_time_unix_nano, s.end_time_unix_nano, s.status.code, resource)
            for resource, s in _scoped(request.resource_spans, "scope_spans", "spans")]


@dataclass
class Point:
    """One data point of an exported metric: a histogram's count, sum and buckets, or a sum's or gauge's value."""
    resource: dict
    name: str
    kind: str  # histogram, sum, gauge
    unit: str
    attributes: dict
    time_ns: int
    value: float | None = None
    count: int | None = None
    sum: float | None = None
    bounds: tuple = ()
    bucket_counts: tuple = ()
    temporality: int = 0  # AggregationTemporality: 1 delta, 2 cumulative (0 for gauges)
    monotonic: bool = False


def decode_metrics(request: metrics_service_pb2.ExportMetricsServiceRequest) -> list[Point]:
    points = []
    for resource, m in _scoped(request.resource_metrics, "scope_metrics", "metrics"):
        kind = m.WhichOneof("data")
        data = getattr(m, kind)
        for dp in data.data_points:
            point = Point(resource, m.name, kind, m.unit, _attributes(dp.attributes), dp.time_unix_nano,
                          temporality=getattr(data, "aggregation_temporality", 0),
                          monotonic=getattr(data, "is_monotonic", False))
            if kind == "histogram":
                point.count, point.sum = dp.count, dp.sum
                point.bounds, point.bucket_counts = tuple(dp.explicit_bounds), tuple(dp.bucket_counts)
            else:
                point.value = getattr(dp, dp.WhichOneof("value"))
            points.append(point)
    return points


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


def latest(points: list[Point]) -> dict[tuple, Point]:
    """The newest point of each series: (service.instance.id, metric name, attributes) -> point."""
    out: dict[tuple, Point] = {}
    for p in sorted(points, key=lambda p: p.time_ns):
        key = (p.resource.get("service.instance.id"), p.name,
               tuple(sorted((k, _hashable(v)) for k, v in p.attributes.items())))
        out[key] = p
    return out


class Receiver:
    """Collects every span and every metric data point exported to it; `protocol` is 'http/protobuf' or 'grpc'."""

    def __init__(self, protocol: str):
        self.protocol = protocol
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.spans: list[Span] = []
        self.points: list[Point] = []
        self.headers: dict[str, str] = {}  # of the last metrics export (HTTP headers or gRPC metadata)
        self._lock = threading.Lock()

    def _add(self, raw: bytes) -> None:
        spans = decode(trace_service_pb2.ExportTraceServiceRequest.FromString(raw))
        with self._lock:
            self.spans.extend(spans)

    def _add_metrics(self, raw: bytes, headers) -> None:
        points = decode_metrics(metrics_service_pb2.ExportMetricsServiceRequest.FromString(raw))
        with self._lock:
            self.points.extend(points)
            self.headers = {k.lower(): v for k, v in headers}

    def __enter__(self) -> "Receiver":
        if self.protocol == "grpc":
            receiver = self

            class Service(trace_service_pb2_grpc.TraceServiceServicer):
                def Export(self, request, context):
                    receiver._add(request.SerializeToString())
                    return trace_service_pb2.ExportTraceServiceResponse()

            class MetricsService(metrics_service_pb2_grpc.MetricsServiceServicer):
                def Export(self, request, context):
                    receiver._add_metrics(request.SerializeToString(), context.invocation_metadata())
                    return metrics_service_pb2.ExportMetricsServiceResponse()

            self._server = grpc.server(futures.ThreadPoolExecutor(4))
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._server)
            metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(MetricsService(), self._server)
            self._server.add_insecure_port(f"127.0.0.1:{self.port}")
            self._server.start()
        else:
            receiver = self

            class Handler(BaseHTTPRequestHandler):
                def do_POST(self):
                    body = self.rfile.read(int(self.headers["Content-Length"]))
                    if self.path == "/v1/metrics":
                        receiver._add_metrics(body, self.headers.items())
                        reply = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
                    else:
                        assert self.path == "/v1/traces", self.path
                        receiver._add(body)
                        reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/x-protobuf")
                    self.send_header("Content-Length", str(len(reply)))
                    self.end_headers()
                    self.wfile.write(reply)

                def log_message(self, *args):
                    pass

            self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
            threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        if self.protocol == "grpc":
            self._server.stop(0)
        else:
            self._server.shutdown()
            self._server.server_close()

    def _wait(self, snapshot, predicate, timeout: float, describe):
        """Poll snapshot() (taken under the lock) until predicate holds on it; return it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                now = snapshot()
            if predicate(now):
                return now
            time.sleep(0.05)
        raise AssertionError(describe(now))

    def wait_for(self, predicate, timeout: float = 60.0) -> list[Span]:
        """Poll until predicate(spans) is true; return the spans."""
        return self._wait(lambda: list(self.spans), predicate, timeout,
                          lambda spans: f"spans never matched; got {[s.name for s in spans]}")

    def wait_for_metrics(self, predicate, timeout: float = 60.0) -> dict[tuple, Point]:
        """Poll until predicate(latest points) is true; return them."""
        return self._wait(lambda: latest(self.points), predicate, timeout,
                          lambda now: f"metrics never matched; got {sorted({(k[0], k[1]) for k in now})}")


class HangingCollector:
    """Accepts TCP connections (the kernel completes the handshake) but never reads or answers."""

    def __enter__(self) -> "HangingCollector":
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.endpoint = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()


class ErroringCollector:
    """Answers every export with 503 (a collector that is up but failing); counts the attempts."""

    def __enter__(self) -> "ErroringCollector":
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                collector.attempts += 1
                self.send_response(503)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.attempts = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
