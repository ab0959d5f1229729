"""OTLP ``/v1/traces`` of ``eventlight serve``: the SDK's own exporter, OTLP/JSON, gzip, partial success."""

from __future__ import annotations

import asyncio
import gzip
import importlib
import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from google.protobuf import json_format
from google.rpc.status_pb2 import Status
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

import eventlight as agl
from eventlight.net import free_port
from eventlight.server.app import create_app
from eventlight.server.otlp_wire import parse_request
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore

PB = {"Content-Type": "application/x-protobuf"}


@pytest.fixture
async def served(namespace: Settings) -> AsyncIterator[tuple[JetStreamLightningStore, str]]:
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        async with agl.LightningStoreServer(store, port=free_port()) as server:
            yield store, server.endpoint


async def _attempt(store: JetStreamLightningStore) -> tuple[str, str]:
    claimed = await store.start_rollout({"q": 1})
    return claimed.rollout_id, claimed.attempt.attempt_id


def _json_request(
    rollout_id: str | None, attempt_id: str, *, trace_id: str = "5b8efff798038103d269b633813fc60c"
) -> dict:
    resource_attrs = [{"key": "agentlightning.attempt_id", "value": {"stringValue": attempt_id}}]
    if rollout_id is not None:
        resource_attrs.append({"key": "agentlightning.rollout_id", "value": {"stringValue": rollout_id}})
    span = {
        "traceId": trace_id,
        "spanId": "eee19b7ec3c1b174",
        "parentSpanId": "eee19b7ec3c1b173",
        "name": "json.span",
        "kind": 1,
        "startTimeUnixNano": "1544712660000000000",
        "endTimeUnixNano": "1544712661000000000",
        "attributes": [
            {"key": "gen_ai.request.model", "value": {"stringValue": "m"}},
            {"key": "n", "value": {"intValue": "3"}},
            {"key": "l", "value": {"arrayValue": {"values": [{"boolValue": True}, {"doubleValue": 1.5}]}}},
        ],
        "status": {"code": 2, "message": "boom"},
    }
    return {"resourceSpans": [{"resource": {"attributes": resource_attrs}, "scopeSpans": [{"spans": [span]}]}]}


async def test_the_sdk_exporter_sends_spans_to_the_log(served: tuple[JetStreamLightningStore, str]) -> None:
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult

    store, endpoint = served
    rid, aid = await _attempt(store)
    results: list[SpanExportResult] = []

    def trace_with_the_sdk() -> None:  # the SDK exports synchronously: in a thread, the server's loop runs on
        for compression in (Compression.NoCompression, Compression.Gzip):
            exporter = OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces", compression=compression, timeout=10)
            real_export = exporter.export
            exporter.export = lambda spans, _e=real_export: results.append(_e(spans)) or results[-1]  # type: ignore[method-assign]
            provider = TracerProvider(
                resource=Resource.create({"agentlightning.rollout_id": rid, "agentlightning.attempt_id": aid})
            )
            provider.add_span_processor(SimpleSpanProcessor(exporter))
            tracer = provider.get_tracer("test")
            with tracer.start_as_current_span(f"outer.{compression.name}") as outer:
                outer.set_attribute("k", "v")
                with tracer.start_as_current_span(f"inner.{compression.name}"):
                    pass
            provider.shutdown()

    await asyncio.to_thread(trace_with_the_sdk)
    assert results == [SpanExportResult.SUCCESS] * 4
    spans = await store.query_spans(rid, aid)
    assert [s.name for s in spans] == ["inner.NoCompression", "outer.NoCompression", "inner.Gzip", "outer.Gzip"]
    assert [s.sequence_id for s in spans] == [1, 2, 3, 4]
    inner, outer = spans[0], spans[1]
    assert inner.parent_id == outer.span_id and inner.trace_id == outer.trace_id and len(outer.trace_id) == 32
    assert outer.attributes == {"k": "v"} and outer.resource.attributes["agentlightning.rollout_id"] == rid
    attempt = await store.get_latest_attempt(rid)
    assert attempt is not None and attempt.status == "running"  # spans are heartbeats, as any others


async def test_otlp_json_with_hex_ids_and_span_level_ids(served: tuple[JetStreamLightningStore, str]) -> None:
    store, endpoint = served
    rid, aid = await _attempt(store)
    doc = _json_request(None, "at-overridden")  # rollout id only on the span, attempt id overridden there
    span = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    span["attributes"] += [
        {"key": "agentlightning.rollout_id", "value": {"stringValue": rid}},
        {"key": "agentlightning.attempt_id", "value": {"stringValue": aid}},
        {"key": "agentlightning.span_sequence_id", "value": {"stringValue": "7"}},
    ]
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{endpoint}/v1/traces", json=doc)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    assert r.json() == {}
    [stored] = await store.query_spans(rid)
    assert (stored.trace_id, stored.span_id, stored.parent_id) == (
        "5b8efff798038103d269b633813fc60c",
        "eee19b7ec3c1b174",
        "eee19b7ec3c1b173",
    )
    assert stored.sequence_id == 7 and stored.status.status_code == "ERROR" and stored.status.description == "boom"
    assert stored.attributes["n"] == 3 and stored.attributes["l"] == [True, 1.5]
    assert stored.start_time == 1544712660.0 and stored.end_time == 1544712661.0


async def test_otlp_json_ids_are_hex_in_either_case_and_base64_ids_are_refused(
    served: tuple[JetStreamLightningStore, str],
) -> None:
    """peer_failures C22: OTLP/JSON ids are hex (not protobuf-JSON's base64). Upper-case hex is
    stored as lower-case hex with a JSON answer; base64 ids are a 400 naming the field, answered
    in JSON, and nothing of that request is stored."""
    store, endpoint = served
    rid, aid = await _attempt(store)

    def doc(trace_id: str, span_id: str) -> dict:
        ids = [("agentlightning.rollout_id", rid), ("agentlightning.attempt_id", aid)]
        resource = {"attributes": [{"key": k, "value": {"stringValue": v}} for k, v in ids]}
        span = {"traceId": trace_id, "spanId": span_id, "name": "llm", "startTimeUnixNano": "1", "endTimeUnixNano": "2"}
        return {"resourceSpans": [{"resource": resource, "scopeSpans": [{"spans": [span]}]}]}

    async with httpx.AsyncClient() as http:
        upper = await http.post(
            f"{endpoint}/v1/traces", json=doc("5B8EFFF798038103D269B633813FC60C", "EEE19B7EC3C1B173")
        )
        base64 = await http.post(f"{endpoint}/v1/traces", json=doc("W47/95gDgQPSabYzgT/GDA==", "7uGbfsPBsXM="))
    assert (upper.status_code, upper.headers["content-type"], upper.json()) == (200, "application/json", {})
    assert base64.status_code == 400 and base64.headers["content-type"] == "application/json"
    message = base64.json()["message"]
    assert "traceId 'W47/95gDgQPSabYzgT/GDA==' is not hex" in message, message
    [stored] = await store.query_spans(rid)
    assert (stored.trace_id, stored.span_id) == ("5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b173")


async def test_partial_success_counts_and_explains_every_rejected_span(
    served: tuple[JetStreamLightningStore, str],
) -> None:
    """peer_failures C22: a gzipped protobuf export is answered 200 in protobuf, an
    ``ExportTraceServiceResponse`` (here with its partial success)."""
    store, endpoint = served
    rid, aid = await _attempt(store)
    good = _json_request(rid, aid)["resourceSpans"][0]
    no_rollout = _json_request(None, aid)["resourceSpans"][0]
    unknown = _json_request("ro-000000000000", "at-00000000")["resourceSpans"][0]
    request = parse_request(
        json.dumps({"resourceSpans": [good, no_rollout, unknown]}).encode(), "application/json", None, 1 << 20
    )[0]
    async with httpx.AsyncClient() as http:
        r = await http.post(
            f"{endpoint}/v1/traces",
            content=gzip.compress(request.SerializeToString()),
            headers={**PB, "Content-Encoding": "gzip"},
        )
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-protobuf"
    answer = ExportTraceServiceResponse.FromString(r.content)
    assert answer.partial_success.rejected_spans == 2
    message = answer.partial_success.error_message
    assert "2 span(s) rejected" in message and "no agentlightning.rollout_id in its span or resource" in message
    assert "ro-000000000000" in message and "does not exist" in message
    assert [s.name for s in await store.query_spans(rid)] == ["json.span"]


def _pb_span(scope: Any, name: str, rid: str, aid: str, seq: int | None = None, blob: int = 0) -> str:
    span = scope.spans.add(trace_id=os.urandom(16), span_id=os.urandom(8), name=name)
    span.start_time_unix_nano = span.end_time_unix_nano = time.time_ns()
    attrs = {"agentlightning.rollout_id": rid, "agentlightning.attempt_id": aid}
    if seq is not None:
        attrs["agentlightning.span_sequence_id"] = seq
    if blob:
        attrs["blob"] = "b" * blob
    for key, value in attrs.items():
        kv = span.attributes.add(key=key)
        if isinstance(value, int):
            kv.value.int_value = value
        else:
            kv.value.string_value = value
    return span.span_id.hex()


@pytest.mark.parametrize(
    ("specs", "bad"),
    [
        pytest.param([("good-1", None, 0), ("big", None, 9 << 20), ("good-2", None, 0)], "big", id="over-8MiB"),
        pytest.param(
            [("numbered", 50, 0), ("id-too-big", 2**40, 0), ("unnumbered", None, 0)], "id-too-big", id="id-over-int32"
        ),
        pytest.param(
            [("numbered", 50, 0), ("numbered-big", 51, 9 << 20), ("unnumbered", None, 0)],
            "numbered-big",
            id="numbered-over-8MiB",
        ),
    ],
)
async def test_one_bad_span_is_rejected_alone_and_its_attempts_good_spans_are_kept(
    served: tuple[JetStreamLightningStore, str], specs: list[tuple[str, int | None, int]], bad: str
) -> None:
    """A span the store refuses does not take the attempt's good spans with it, and
    ``partial_success`` names exactly the spans not stored (a reviewer: all three lost, or a
    stored span reported rejected, so a resending exporter doubled it)."""
    store, endpoint = served
    rid, aid = await _attempt(store)
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    ids = {_pb_span(scope, name, rid, aid, seq, blob): name for name, seq, blob in specs}
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(f"{endpoint}/v1/traces", content=request.SerializeToString(), headers=PB)
    assert r.status_code == 200
    answer = ExportTraceServiceResponse.FromString(r.content).partial_success
    assert answer.rejected_spans == 1
    assert [name for span_id, name in ids.items() if span_id in answer.error_message] == [bad]
    await store.update_attempt(rid, aid, status="succeeded")
    await store.wait_for_rollouts(rollout_ids=[rid], timeout=10)
    stored = await store.query_spans(rid)
    assert sorted(s.name for s in stored) == sorted(name for name, _, _ in specs if name != bad)


async def test_an_infinite_sequence_id_does_not_fail_the_export(served: tuple[JetStreamLightningStore, str]) -> None:
    """``agentlightning.span_sequence_id`` sent as an infinite double answered 500, and the good
    spans of the request were lost with it (a reviewer); it reads as unreadable, so the store
    numbers the span."""
    store, endpoint = served
    rid, aid = await _attempt(store)
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    _pb_span(scope, "good", rid, aid)
    _pb_span(scope, "infinite", rid, aid)
    scope.spans[-1].attributes.add(key="agentlightning.span_sequence_id").value.double_value = float("inf")
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(f"{endpoint}/v1/traces", content=request.SerializeToString(), headers=PB)
    assert r.status_code == 200, r.content
    assert ExportTraceServiceResponse.FromString(r.content).partial_success.rejected_spans == 0
    await store.update_attempt(rid, aid, status="succeeded")
    await store.wait_for_rollouts(rollout_ids=[rid], timeout=10)
    spans = {s.name: s for s in await store.query_spans(rid)}
    assert sorted(spans) == ["good", "infinite"]
    # a NaN or infinite double is kept as OTLP/JSON writes it: the store's JSON has neither
    assert spans["infinite"].attributes["agentlightning.span_sequence_id"] == "Infinity"


async def test_a_span_sent_twice_is_recorded_once_within_a_request_as_across_requests(store: Any) -> None:
    """A span id repeated inside one request is handled as one repeated by a later request, on both
    backends: recorded once (no sequence id spent on the copy), and never a rejection in
    ``partial_success`` (a copy is accepted: an exporter's retry must not count as a failure)."""
    claimed = await store.start_rollout({"q": 1})
    rid, aid = claimed.rollout_id, claimed.attempt.attempt_id
    doc = _json_request(rid, aid)
    spans = doc["resourceSpans"][0]["scopeSpans"][0]["spans"]
    numbered = {**spans[0], "spanId": "eee19b7ec3c1b175", "name": "numbered"}
    numbered["attributes"] = [
        *numbered["attributes"],
        {"key": "agentlightning.span_sequence_id", "value": {"intValue": "7"}},
    ]
    spans += [json.loads(json.dumps(spans[0])), numbered, {**numbered, "name": "numbered copy"}]
    app = create_app(store)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://store") as http:
        answers = [await http.post("/v1/traces", json=doc) for _ in range(2)]
    assert [(r.status_code, r.json()) for r in answers] == [(200, {}), (200, {})]
    stored = await store.query_spans(rid)
    assert [(s.span_id, s.name, s.sequence_id) for s in stored] == [
        ("eee19b7ec3c1b174", "json.span", 1),
        ("eee19b7ec3c1b175", "numbered", 7),
    ]
    assert (await store.statistics())["total_spans"] == 2


def test_a_gzip_body_of_several_members_inflates_whole() -> None:
    """``cat a.gz b.gz`` is one gzip body (RFC 1952); its second member's spans were dropped
    silently (a 200 without partial_success). Concatenated protobuf messages merge, so the body
    is one request of both."""
    requests = []
    for n in (1, 2):
        request = ExportTraceServiceRequest()
        span = request.resource_spans.add().scope_spans.add().spans.add()
        span.trace_id, span.span_id, span.name = b"\x01" * 16, bytes([n]) * 8, f"s{n}"
        requests.append(gzip.compress(request.SerializeToString()))
    parsed = parse_request(b"".join(requests), PB["Content-Type"], "gzip", 1 << 20)[0]
    names = [s.name for rs in parsed.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert names == ["s1", "s2"]


async def test_a_sequence_id_that_is_no_integer_is_not_truncated_and_is_said(store: Any) -> None:
    """``agentlightning.span_sequence_id`` 3.7 was stored as 3 without a word (a reviewer). As
    Agent-lightning 0.3.0 (``int(str(value))`` fails, so it numbers the span itself), the store
    numbers such a span; ``partial_success`` says so, with no span counted rejected (it is
    recorded). An integral double, 3.0, is 3. On both backends."""
    claimed = await store.start_rollout({"q": 1})
    rid, aid = claimed.rollout_id, claimed.attempt.attempt_id
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    names = ("unnumbered", "fractional", "integral", "negative", "long")
    ids = {name: _pb_span(scope, name, rid, aid) for name in names}
    for span, value in zip(scope.spans[1:4], (3.7, 3.0, -2.0), strict=True):
        span.attributes.add(key="agentlightning.span_sequence_id").value.double_value = value
    scope.spans[4].attributes.add(key="agentlightning.span_sequence_id").value.string_value = "x" * 5000
    app = create_app(store)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://store") as http:
        r = await http.post("/v1/traces", content=request.SerializeToString(), headers=PB)
    assert r.status_code == 200, r.content
    answer = ExportTraceServiceResponse.FromString(r.content).partial_success
    assert answer.rejected_spans == 0
    assert answer.error_message.startswith("3 span(s) recorded with a sequence id the store allocated: ")
    assert f"span {ids['fractional']} ('fractional'): agentlightning.span_sequence_id 3.7 is not an integer" in (
        answer.error_message
    )
    assert "-2.0" in answer.error_message and ids["integral"] not in answer.error_message
    assert len(answer.error_message) < 500  # the 5000 characters shown shortened
    stored = {s.name: s for s in await store.query_spans(rid)}
    assert stored["integral"].sequence_id == 3
    assert [stored[n].sequence_id for n in ("unnumbered", "fractional", "negative", "long")] == [1, 2, 3, 4]
    assert stored["fractional"].attributes["agentlightning.span_sequence_id"] == 3.7  # kept as sent


async def test_an_export_while_nats_is_down_is_503_as_a_status_in_the_requests_encoding(
    namespace: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 503 (NATS did not answer: the exporter retries) was an ``ErrorBody`` in JSON whatever the
    request's encoding; OTLP/HTTP asks for a ``google.rpc.Status`` in it (a reviewer)."""
    from google.protobuf import json_format
    from google.rpc import code_pb2
    from google.rpc.status_pb2 import Status

    jetstream_log = importlib.import_module("eventlight.store.jetstream.log")  # the package names a logger `log`
    from tests.faults import Relay

    assert namespace.nats_url is not None
    monkeypatch.setattr(jetstream_log, "PUBLISH_TIMEOUT_S", 1.0)  # NATS is down after 1 s, not 10
    nats = Relay(namespace.nats_url)
    await nats.mend()
    try:
        async with (
            JetStreamLightningStore(namespace, nats_url=nats.url, pg_dsn=namespace.pg_dsn) as store,
            agl.LightningStoreServer(store, port=free_port()) as server,
            httpx.AsyncClient(base_url=server.endpoint, timeout=60) as http,
        ):
            rid, aid = await _attempt(store)
            doc = _json_request(rid, aid)
            nats.cut()
            pb = parse_request(json.dumps(doc).encode(), "application/json", None, 1 << 20)[0].SerializeToString()
            answers = [await http.post("/v1/traces", content=pb, headers=PB), await http.post("/v1/traces", json=doc)]
            for kind, r in zip((PB["Content-Type"], "application/json"), answers, strict=True):
                assert (r.status_code, r.headers["content-type"]) == (503, kind), r.content
                answer = Status()
                if kind == PB["Content-Type"]:
                    answer.ParseFromString(r.content)
                else:
                    json_format.Parse(r.text, answer)
                assert answer.code == code_pb2.UNAVAILABLE and "NATS" in answer.message, answer
    finally:
        nats.cut()


@pytest.mark.parametrize("kind", [PB["Content-Type"], "application/json"], ids=["protobuf", "json"])
async def test_an_internal_error_is_a_500_status_in_the_requests_encoding(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 500 (a bug: none can be caused from outside, so the store is made to raise) is a
    ``google.rpc.Status`` in the request's encoding too, naming no more than the error's type."""
    from google.protobuf import json_format
    from google.rpc import code_pb2
    from google.rpc.status_pb2 import Status

    async with agl.InMemoryLightningStore() as store:
        rid, aid = await _attempt(store)  # type: ignore[arg-type]

        async def broken(*args: Any) -> None:
            raise RuntimeError("a bug")

        monkeypatch.setattr(store, "add_spans_numbered", broken)
        app = create_app(store)
        transport = httpx.ASGITransport(app, raise_app_exceptions=False)  # Starlette re-raises after answering
        async with httpx.AsyncClient(transport=transport, base_url="http://store") as http:
            doc = _json_request(rid, aid)
            body = json.dumps(doc).encode()
            if kind == PB["Content-Type"]:
                body = parse_request(body, "application/json", None, 1 << 20)[0].SerializeToString()
            r = await http.post("/v1/traces", content=body, headers={"Content-Type": kind})
    assert (r.status_code, r.headers["content-type"]) == (500, kind), r.content
    answer = Status()
    if kind == PB["Content-Type"]:
        answer.ParseFromString(r.content)
    else:
        json_format.Parse(r.text, answer)
    assert answer.code == code_pb2.INTERNAL and answer.message.startswith("internal server error (RuntimeError)")


def test_an_empty_id_on_a_span_does_not_hide_its_resources() -> None:
    """An ``agentlightning.rollout_id`` of ``""`` on a span overrode its resource's good one, and the
    span was rejected as having "no agentlightning.rollout_id in its span or resource attributes" (a
    reviewer). An empty or unset value on the span is none (0.3.0 too falls back on an unset one):
    the resource's is used; with none there either, the reason says where the id is empty."""
    from eventlight.server.otlp_spans import spans_from_request

    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    for key, value in (("rollout_id", "ro-1"), ("attempt_id", "at-1"), ("span_sequence_id", "5")):
        rs.resource.attributes.add(key=f"agentlightning.{key}").value.string_value = value
    scope = rs.scope_spans.add()
    for name, key in (
        ("empty-rollout", "rollout_id"),
        ("unset-attempt", "attempt_id"),
        ("empty-seq", "span_sequence_id"),
    ):
        _pb_span(scope, name, "ro-1", "at-1")
        attrs = scope.spans[-1].attributes
        kv = next((kv for kv in attrs if kv.key == f"agentlightning.{key}"), None) or attrs.add(
            key=f"agentlightning.{key}"
        )
        if name.startswith("unset"):
            kv.value.Clear()
        else:
            kv.value.string_value = ""
    bare = request.resource_spans.add().scope_spans.add()
    _pb_span(bare, "empty-nowhere", "", "at-1")
    spans, rejected, renumbered = spans_from_request(request)
    assert [(s.name, s.rollout_id, s.attempt_id, s.sequence_id) for s in spans] == [
        ("empty-rollout", "ro-1", "at-1", 5),
        ("unset-attempt", "ro-1", "at-1", 5),
        ("empty-seq", "ro-1", "at-1", 5),
    ]
    assert renumbered == []
    assert [(n.name, n.reason) for n in rejected] == [
        (
            "empty-nowhere",
            "agentlightning.rollout_id is empty in its span attributes and missing from its resource attributes",
        )
    ]


async def test_a_json_request_of_no_resource_spans_but_other_fields_says_so(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``resourceSpan`` (a typo) answered 200 ``{}`` and stored nothing, without a word (a reviewer).
    Unknown fields are still ignored (the OTLP spec), but a request holding nothing else is answered
    with ``partial_success.error_message`` naming them, and logged once per field name."""
    from eventlight.server import otlp

    monkeypatch.setattr(otlp, "_warned_fields", set())
    async with agl.InMemoryLightningStore() as store:
        rid, aid = await _attempt(store)  # type: ignore[arg-type]
        typo = {"resourceSpan": _json_request(rid, aid)["resourceSpans"], "x" * 10_000: 1}
        app = create_app(store)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://store") as http:
            with caplog.at_level("WARNING", logger="eventlight.server.otlp"):
                answers = [await http.post("/v1/traces", json=typo) for _ in range(3)]
                fine = await http.post("/v1/traces", json={**_json_request(rid, aid), "extra": 1})
        assert await store.query_spans(rid) != []  # the good request's span
    for r in answers:
        assert r.status_code == 200, r.text
        message = r.json()["partialSuccess"]["errorMessage"]
        assert message.startswith("no resourceSpans in the request, so no span was recorded: its field(s) ")
        assert "'resourceSpan'" in message and "were ignored" in message and len(message) < 300
    assert fine.status_code == 200 and fine.json() == {}  # an unknown field beside resourceSpans: ignored
    logged = [r.getMessage() for r in caplog.records if "no resourceSpans" in r.getMessage()]
    assert len(logged) == 1 and "'resourceSpan'" in logged[0], logged


async def test_an_out_of_range_sequence_id_is_echoed_shortened(store: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A sequence id the store refuses as out of range (1e300, a 4000-digit string) went whole into
    ``partial_success`` and the log (a reviewer); it is shown shortened, as other echoed values are.
    On both backends."""
    claimed = await store.start_rollout({"q": 1})
    rid, aid = claimed.rollout_id, claimed.attempt.attempt_id
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    ids = [_pb_span(scope, name, rid, aid) for name in ("double", "digits")]
    scope.spans[0].attributes.add(key="agentlightning.span_sequence_id").value.double_value = 1e300
    scope.spans[1].attributes.add(key="agentlightning.span_sequence_id").value.string_value = "9" * 4000
    app = create_app(store)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://store") as http:
        with caplog.at_level("WARNING", logger="eventlight.server.otlp"):
            r = await http.post("/v1/traces", content=request.SerializeToString(), headers=PB)
    assert r.status_code == 200, r.content
    answer = ExportTraceServiceResponse.FromString(r.content).partial_success
    assert answer.rejected_spans == 2 and all(i in answer.error_message for i in ids)
    assert answer.error_message.count("has an invalid sequence_id 99999") == 1
    assert answer.error_message.count("has an invalid sequence_id 10000000000") == 1
    assert len(answer.error_message) < 1000, answer.error_message
    assert "9" * 100 not in caplog.text and "0" * 100 not in caplog.text and "invalid sequence_id" in caplog.text


def _status_of(r: httpx.Response) -> Status:
    """The ``google.rpc.Status`` of an error answer, read in the encoding its Content-Type names."""
    if r.headers["content-type"] == "application/json":
        return json_format.Parse(r.text, Status())
    assert r.headers["content-type"] == PB["Content-Type"], r.headers
    return Status.FromString(r.content)


@pytest.mark.parametrize(
    ("content_type", "status", "answer"),
    [
        ("application/json; charset=utf-8", 200, "application/json"),
        ("Application/JSON;charset=UTF-8", 200, "application/json"),
        ("application/x-protobuf", 200, PB["Content-Type"]),
        ("application/jsonx", 415, PB["Content-Type"]),
        ("text/plain; note=json", 415, PB["Content-Type"]),
        ("application/x-ndjson", 415, PB["Content-Type"]),
    ],
)
async def test_the_answer_is_encoded_by_the_requests_media_type_not_by_a_word_in_it(
    content_type: str, status: int, answer: str
) -> None:
    """A Content-Type holding "json" anywhere (``application/jsonx``, ``text/plain; note=json``) got
    its 415 as JSON (a reviewer); the media type is read before its parameters, and an unsupported
    one is answered in protobuf, OTLP/HTTP's default encoding."""
    body = b"{}" if "json" in content_type.split(";")[0].lower() else b""
    async with agl.InMemoryLightningStore() as store:
        app = create_app(store)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://store") as http:
            r = await http.post("/v1/traces", content=body, headers={"Content-Type": content_type})
    assert (r.status_code, r.headers["content-type"]) == (status, answer), r.content
    if status == 415:
        message = _status_of(r).message
        assert f"Content-Type {content_type.split(';')[0].lower()} is not supported" in message, message


async def test_a_protobuf_request_of_unknown_fields_only_says_so(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A protobuf body of only unknown fields (another message sent to this path) parsed to an empty
    request and was answered 200 without a word; as OTLP/JSON's request of no ``resourceSpans``, its
    answer's ``partial_success`` names the field numbers ignored, and the log says so once."""
    from eventlight.server import otlp

    monkeypatch.setattr(otlp, "_warned_fields", set())
    unknown = b"\x10\x01" + b"\x2a\x03abc" + b"\x10\x02"  # field 2 (varint) twice, field 5 (bytes)
    async with agl.InMemoryLightningStore() as store:
        rid, aid = await _attempt(store)  # type: ignore[arg-type]
        good = parse_request(json.dumps(_json_request(rid, aid)).encode(), "application/json", None, 1 << 20)[0]
        app = create_app(store)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://store") as http:
            with caplog.at_level("WARNING", logger="eventlight.server.otlp"):
                answers = [await http.post("/v1/traces", content=unknown, headers=PB) for _ in range(2)]
                fine = await http.post("/v1/traces", content=good.SerializeToString() + b"\x10\x01", headers=PB)
                empty = await http.post("/v1/traces", content=b"", headers=PB)
        assert [s.name for s in await store.query_spans(rid)] == ["json.span"]
    for r in answers:
        assert r.status_code == 200, r.content
        partial = ExportTraceServiceResponse.FromString(r.content).partial_success
        assert partial.rejected_spans == 0
        assert partial.error_message == (
            "no resourceSpans in the request, so no span was recorded: its field(s) #2, #5 are not "
            "ExportTraceServiceRequest fields and were ignored"
        )
    for r in (fine, empty):  # an unknown field beside resource_spans, and an empty request: nothing to say
        assert r.status_code == 200 and not ExportTraceServiceResponse.FromString(r.content).HasField("partial_success")
    logged = [r.getMessage() for r in caplog.records if "no resourceSpans" in r.getMessage()]
    assert len(logged) == 1 and "#2, #5" in logged[0], logged


def test_a_request_of_millions_of_unknown_fields_is_read_in_bounded_memory() -> None:
    """The numbers of a protobuf request's unknown fields were read with protobuf's
    ``UnknownFieldSet``, an object per field: a 16 MiB body of a two-byte field made 8 million of
    them, seconds of the event loop (every route of the server waited) and hundreds of MiB, for a
    body protobuf itself parses in milliseconds. Now its fields' numbers are read from the bytes,
    the first ``_MAX_SCANNED_FIELDS`` of them, groups and every wire type included."""
    import tracemalloc

    group = b"\x1b" + b"\x08\x01" + b"\x23\x0d" + bytes(4) + b"\x24" + b"\x1c"  # group 3 holding #1 and group 4
    fields = b"\x11" + bytes(8) + b"\x3d" + bytes(4) + b"\x92\x01\x02ab" + group  # #2 fixed64, #7 fixed32, #18 bytes
    _, _, ignored = parse_request(fields + b"\x10\x01", PB["Content-Type"], None, 1 << 20)
    assert ignored == ["#2", "#7", "#18", "#3"], ignored
    body = b"\x10\x00" * (1 << 20)  # 2 MiB: a million fields #2, each holding 0
    tracemalloc.start()
    try:
        _, _, ignored = parse_request(body, PB["Content-Type"], None, 1 << 22)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ignored == ["#2"]
    assert peak < 1 << 20, f"{peak} bytes held at most reading a body of {len(body)}"


BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8"


@pytest.mark.parametrize(
    ("headers", "answer"),
    [
        ({"Accept": BROWSER_ACCEPT}, "application/json"),
        ({"Accept": "application/json"}, "application/json"),
        ({"Accept": "application/x-protobuf;q=0.5, application/json"}, "application/json"),
        ({"Accept": "application/x-protobuf, application/json;q=0.5"}, PB["Content-Type"]),
        ({"Accept": "application/*;q=0.9, text/html;q=0.1"}, PB["Content-Type"]),
        ({"Accept": "text/html;q=bad, */*"}, PB["Content-Type"]),  # an ill-formed q: that range skipped
        ({"Accept": "*/*"}, PB["Content-Type"]),
        ({}, PB["Content-Type"]),
        ({**PB, "Accept": BROWSER_ACCEPT}, PB["Content-Type"]),  # a protobuf client's request: protobuf
    ],
    ids=["browser", "json", "json-preferred", "protobuf-preferred", "wildcard-type", "bad-q", "any", "none", "pb"],
)
async def test_a_browsers_get_of_the_otlp_path_is_answered_in_json(headers: dict[str, str], answer: str) -> None:
    """A browser's ``GET /v1/traces`` got its 405 as protobuf bytes it shows as garbage; a request
    of no Content-Type whose Accept prefers JSON or HTML is answered in JSON, still with ``Allow``."""
    from google.rpc import code_pb2

    async with agl.InMemoryLightningStore() as store:
        app = create_app(store)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://store") as http:
            http.headers.pop("Accept")  # httpx's default */*: the "none" case sends no Accept at all
            r = await http.get("/v1/traces", headers=headers)
    assert (r.status_code, r.headers["content-type"], r.headers["allow"]) == (405, answer, "POST"), r.headers
    status = _status_of(r)
    assert status.code == code_pb2.UNIMPLEMENTED and "/v1/traces does not accept GET" in status.message
