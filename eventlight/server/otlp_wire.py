"""OTLP/HTTP on the wire: request bytes to an ``ExportTraceServiceRequest``, answers to bytes.

Follows the OTLP/HTTP specification (opentelemetry.io/docs/specs/otlp, "OTLP/HTTP"):

* ``Content-Type: application/x-protobuf`` (binary protobuf) or ``application/json`` (OTLP/JSON:
  lowerCamelCase keys, ``traceId``/``spanId``/``parentSpanId`` as hex, not base64), parameters
  such as ``charset`` aside; any other type (``application/jsonx``, ``text/plain; note=json``) is
  415;
* ``Content-Encoding: gzip`` (or none / ``identity``); any other is 415; a gzip body inflating past
  the body limit is 413, and its inflated bytes count with the body bytes held at once (``hold``);
* the answer has the request's content type; an error's body is a ``google.rpc.Status`` (protobuf,
  or its JSON mapping for a JSON request; ``answer_kind``), the bearer token's 401, the body
  ceiling's 413 and a 5xx included (``eventlight.server.errors.error_response``); a request of no
  Content-Type (a browser's ``GET``) is answered in JSON when its ``Accept`` prefers JSON or HTML
  to protobuf, else in protobuf;
* a body that does not parse, and span or trace ids of the wrong length (or all zeros, which the
  spec calls invalid), are 400 for the whole request: the client must not retry it.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import reprlib
import zlib
from collections.abc import Callable
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from google.rpc import code_pb2
from google.rpc.status_pb2 import Status
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

__all__ = ["OtlpError", "answer_kind", "encode_response", "encode_status", "parse_request"]

OTLP_PATH = "/v1/traces"
PROTOBUF = "application/x-protobuf"
JSON = "application/json"


class OtlpError(Exception):
    """A request refused whole: ``status`` (400, 413, 415, or 503 when the server holds too many
    bytes to inflate it now) and a one-line message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _type_of(value: str) -> str:
    """The ``type/subtype`` of a media type or an ``Accept`` media range, lowercased: what comes
    before its first parameter (RFC 9110 8.3.1: ``type "/" subtype *( OWS ";" OWS parameter )``;
    a token holds no ``;``)."""
    return value.split(";", 1)[0].strip().lower()


def media_type(content_type: str | None) -> str:
    """``application/x-protobuf`` or ``application/json`` (parameters dropped).

    Raises:
        OtlpError: 415 for any other type.
    """
    kind = _type_of(content_type or "")
    if kind in (PROTOBUF, JSON):
        return kind
    shown = kind or "none"
    raise OtlpError(415, f"Content-Type {shown} is not supported: send {PROTOBUF} or {JSON} (OTLP/HTTP)")


_INFLATE_STEP_BYTES = 1 << 20
"""Bytes of a gzip body fed to the inflater at a time, and the most it inflates at a time: each
step's output is counted (``hold``) before it is kept."""


def _decompress(raw: bytes, encoding: str | None, max_bytes: int, hold: Callable[[int], bool]) -> bytes | bytearray:
    """The inflated body; a gzip body of several members (RFC 1952 allows it; ``cat a.gz b.gz``)
    inflates to all of them, and trailing bytes that are no gzip member are an error, not ignored.
    The inflated bytes are counted with ``hold`` as they come, a step at a time."""
    coding = (encoding or "identity").strip().lower()
    if coding == "identity":
        return raw
    if coding != "gzip":
        raise OtlpError(415, f"Content-Encoding {coding} is not supported: send gzip or none")
    out = bytearray()
    rest = memoryview(raw)
    while True:
        rest = _inflate_member(rest, out, max_bytes, hold)
        if not rest or (rest[0] == 0 and not rest.tobytes().strip(b"\0")):  # gzip ignores zeros padding the end
            return out


def _inflate_member(data: memoryview, out: bytearray, max_bytes: int, hold: Callable[[int], bool]) -> memoryview:
    """Inflate the gzip member ``data`` starts with onto ``out``; returns what follows it."""
    inflater = zlib.decompressobj(wbits=31)
    pos = 0
    pending: bytes | memoryview = b""
    while not inflater.eof:
        if not pending:
            pending = data[pos : pos + _INFLATE_STEP_BYTES]
            pos += len(pending)
        fed = len(pending)
        try:
            piece = inflater.decompress(pending, min(_INFLATE_STEP_BYTES, max_bytes + 1 - len(out)))
        except zlib.error as e:
            raise OtlpError(400, f"the body is not valid gzip: {e}") from None
        pending = inflater.unconsumed_tail
        if not piece and not fed:
            raise OtlpError(400, "the gzip body is truncated")
        if len(out) + len(piece) > max_bytes:
            raise OtlpError(413, f"the body inflates to more than the server's limit of {max_bytes} bytes")
        if not hold(len(piece)):
            raise OtlpError(
                503,
                f"the body inflates to more than the server can hold beside the other requests' bodies now"
                f" ({len(out) + len(piece)} bytes inflated so far; its max_buffered_bytes): retry shortly",
            )
        out += piece
    return data[pos - len(pending) - len(inflater.unused_data) :]


def _hex_to_b64(value: Any, where: str) -> Any:
    if not isinstance(value, str):
        raise OtlpError(400, f"{where} must be a hex string, got {type(value).__name__}")
    try:
        return base64.b64encode(binascii.unhexlify(value)).decode()
    except (binascii.Error, ValueError):
        raise OtlpError(400, f"{where} {value[:40]!r} is not hex (OTLP/JSON ids are hex strings)") from None


def _array(value: Any, where: str) -> list[Any]:
    """``value`` if it is a JSON array (``None``: empty)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise OtlpError(400, f"{where} must be an array, got {type(value).__name__}")
    return value


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise OtlpError(400, f"{where} is not an object")
    return value


def _json_ids_to_b64(doc: Any) -> None:
    """Rewrite the hex ids of an OTLP/JSON document into the base64 that protobuf's JSON mapping reads.

    Raises:
        OtlpError: 400 naming the first place that is not of its OTLP/JSON shape (an object, an
            array) on the way to the ids, or an id that is not hex.
    """
    if not isinstance(doc, dict):
        raise OtlpError(400, f"an OTLP/JSON body is an object, got {type(doc).__name__}")
    for r, rs in enumerate(_array(doc.get("resourceSpans") or doc.get("resource_spans"), "resourceSpans")):
        rs = _object(rs, f"resourceSpans[{r}]")
        scopes = _array(rs.get("scopeSpans") or rs.get("scope_spans"), f"resourceSpans[{r}].scopeSpans")
        for s, ss in enumerate(scopes):
            ss = _object(ss, f"resourceSpans[{r}].scopeSpans[{s}]")
            for i, span in enumerate(_array(ss.get("spans"), f"resourceSpans[{r}].scopeSpans[{s}].spans")):
                where = f"resourceSpans[{r}].scopeSpans[{s}].spans[{i}]"
                span = _object(span, where)
                for key in ("traceId", "trace_id", "spanId", "span_id", "parentSpanId", "parent_span_id"):
                    if key in span:
                        span[key] = _hex_to_b64(span[key], f"{where}.{key}")
                for j, link in enumerate(_array(span.get("links"), f"{where}.links")):
                    link = _object(link, f"{where}.links[{j}]")
                    for key in ("traceId", "trace_id", "spanId", "span_id"):
                        if key in link:
                            link[key] = _hex_to_b64(link[key], f"{where}.links[{j}].{key}")


def _ignored_fields(doc: dict[str, Any]) -> list[str]:
    """The top-level fields of an OTLP/JSON request that holds no ``resourceSpans``: unknown ones,
    ignored as the spec asks, that likely stand for it (a typo such as ``resourceSpan``), each
    quoted and shortened (a name may be megabytes long)."""
    if "resourceSpans" in doc or "resource_spans" in doc:
        return []
    return [reprlib.repr(name) for name in doc]


_MAX_SCANNED_FIELDS = 10_000
"""Top-level fields of a protobuf request of no ``resource_spans`` read for their numbers
(``_ignored_numbers``). A 16 MiB body holds millions of two-byte fields: protobuf's
``UnknownFieldSet`` made an object of each, seconds of the event loop's time and hundreds of MiB."""


def _varint(data: bytes | bytearray, pos: int) -> tuple[int, int]:
    """The base-128 varint at ``data[pos:]`` and the position after it (``data`` parsed already)."""
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _skip_field(data: bytes | bytearray, pos: int, key: int) -> int:
    """The position after the value of the field of ``key`` (number and wire type) at ``pos``."""
    wire_type = key & 7
    if wire_type == 0:
        return _varint(data, pos)[1]
    if wire_type == 1:
        return pos + 8
    if wire_type == 2:
        size, pos = _varint(data, pos)
        return pos + size
    if wire_type == 5:
        return pos + 4
    while True:  # 3: a group, up to its end-group key (4) of the same number
        inner, pos = _varint(data, pos)
        if inner == (key & ~7) | 4:
            return pos
        pos = _skip_field(data, pos, inner)


def _ignored_numbers(request: ExportTraceServiceRequest, data: bytes | bytearray) -> list[str]:
    """The top-level fields of a protobuf request that holds no ``resource_spans``: unknown field
    numbers (``#2``), ignored as the spec asks, that likely stand for it (a message of another
    type, or of a newer version, sent to this path). Read from ``data`` (the request's bytes, which
    parsed: every field of it is unknown), the first ``_MAX_SCANNED_FIELDS`` fields at most."""
    if request.resource_spans:
        return []
    numbers: dict[str, None] = {}
    pos = 0
    for _ in range(_MAX_SCANNED_FIELDS):
        if pos >= len(data):
            break
        key, pos = _varint(data, pos)
        numbers[f"#{key >> 3}"] = None
        pos = _skip_field(data, pos, key)
    return list(numbers)


def _parse_json(data: bytes | bytearray) -> tuple[ExportTraceServiceRequest, list[str]]:
    try:
        doc = json.loads(data) if data.strip() else {}
    except (ValueError, UnicodeDecodeError) as e:
        raise OtlpError(400, f"the body is not JSON: {e}") from None
    except RecursionError:  # arrays or objects nested thousands deep: bad input, not a server fault
        raise OtlpError(400, "the body is not JSON this server reads: it is nested too deeply") from None
    _json_ids_to_b64(doc)
    request = ExportTraceServiceRequest()
    try:
        json_format.ParseDict(doc, request, ignore_unknown_fields=True)
    except (json_format.ParseError, TypeError, ValueError) as e:
        raise OtlpError(400, f"the body is not an OTLP/JSON ExportTraceServiceRequest: {e}") from None
    return request, _ignored_fields(doc)


def _parse_protobuf(data: bytes | bytearray) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(data)
    except DecodeError as e:
        raise OtlpError(400, f"the body is not a protobuf ExportTraceServiceRequest: {e}") from None
    return request


def _check_id(value: bytes, size: int, where: str, *, optional: bool = False) -> None:
    if optional and not value:
        return
    if len(value) != size:
        raise OtlpError(400, f"{where} must be {size} bytes ({2 * size} hex digits), got {len(value)}")
    if not any(value):
        raise OtlpError(400, f"{where} is all zeros, which OTLP calls invalid")


def check_ids(request: ExportTraceServiceRequest) -> None:
    """Every span's ``trace_id`` is 16 bytes, ``span_id`` 8, ``parent_span_id`` empty or 8, none all zeros.

    Raises:
        OtlpError: 400 naming the first span that breaks it.
    """
    for r, rs in enumerate(request.resource_spans):
        for s, ss in enumerate(rs.scope_spans):
            for i, span in enumerate(ss.spans):
                where = f"resourceSpans[{r}].scopeSpans[{s}].spans[{i}]"
                _check_id(span.trace_id, 16, f"{where}.traceId")
                _check_id(span.span_id, 8, f"{where}.spanId")
                _check_id(span.parent_span_id, 8, f"{where}.parentSpanId", optional=True)


def parse_request(
    raw: bytes,
    content_type: str | None,
    content_encoding: str | None,
    max_bytes: int,
    hold: Callable[[int], bool] = lambda size_bytes: True,
) -> tuple[ExportTraceServiceRequest, str, list[str]]:
    """The request, its media type (what the answer is encoded in), and the fields ignored in a
    request that holds no ``resourceSpans`` (``[]`` for one that does): OTLP/JSON names, quoted
    (``'resourceSpan'``), or protobuf field numbers (``#2``).

    Fields of unknown names or numbers are ignored, as the OTLP specification asks (a newer sender
    may add some); they are returned for the caller to say so when they are all the request holds.

    ``hold(size_bytes)`` is called with each step of a gzip body's inflated bytes (at most 1 MiB)
    before it is kept; ``False`` refuses the request (the server's ``BodyReads.holding``).

    Raises:
        OtlpError: 415 (type or encoding), 413 (inflates past ``max_bytes``), 503 (``hold`` refused
            the inflated bytes), 400 (does not parse, bad ids).
    """
    kind = media_type(content_type)
    data = _decompress(raw, content_encoding, max_bytes, hold)
    if kind == JSON:
        request, ignored = _parse_json(data)
    else:
        request = _parse_protobuf(data)
        ignored = _ignored_numbers(request, data)
    check_ids(request)
    return request, kind, ignored


def encode_response(kind: str, rejected: int = 0, message: str = "") -> bytes:
    """An ``ExportTraceServiceResponse``; ``partial_success`` set when spans were rejected or there is a message."""
    response = ExportTraceServiceResponse()
    if rejected or message:
        response.partial_success.rejected_spans = rejected
        response.partial_success.error_message = message
    if kind == JSON:
        text: str = json_format.MessageToJson(response, indent=None)
        return text.encode()
    data: bytes = response.SerializeToString()
    return data


_GRPC_CODES = {
    400: code_pb2.INVALID_ARGUMENT,
    401: code_pb2.UNAUTHENTICATED,
    404: code_pb2.NOT_FOUND,
    405: code_pb2.UNIMPLEMENTED,
    408: code_pb2.DEADLINE_EXCEEDED,
    409: code_pb2.ABORTED,
    413: code_pb2.RESOURCE_EXHAUSTED,
    415: code_pb2.INVALID_ARGUMENT,
    422: code_pb2.INVALID_ARGUMENT,
    500: code_pb2.INTERNAL,
    503: code_pb2.UNAVAILABLE,
}
"""The ``google.rpc.Code`` of each HTTP status the server answers (as ``google/rpc/code.proto`` pairs
them; 413 as gRPC's own "message larger than max"). OTLP clients read only the HTTP status."""


_QVALUE = re.compile(r"0(\.\d{0,3})?|1(\.0{0,3})?")
"""A ``qvalue`` (RFC 9110 12.4.2)."""


def _weight(media_range: str) -> float | None:
    """The ``q`` parameter of one ``Accept`` media range (1 when it has none), ``None`` when ill-formed."""
    for param in media_range.split(";")[1:]:
        name, _, value = param.partition("=")
        if name.strip().lower() == "q":
            return float(value.strip()) if _QVALUE.fullmatch(value.strip()) else None
    return 1.0


def _quality(accept: str, media: str) -> float:
    """The ``q`` an ``Accept`` header gives ``media``: that of the most specific range matching it
    (``media`` itself, then ``type/*``, then ``*/*``; RFC 9110 12.5.1), 0 when none does. A range
    of an ill-formed ``q`` is skipped."""
    specificity = {media: 3, media.split("/", 1)[0] + "/*": 2, "*/*": 1}
    best, quality = 0, 0.0
    for media_range in accept.split(","):
        rank, weight = specificity.get(_type_of(media_range), 0), _weight(media_range)
        if rank > best and weight is not None:
            best, quality = rank, weight
    return quality


def answer_kind(content_type: str | None, accept: str | None = None) -> str:
    """The media type an answer to a request with ``content_type`` is encoded in: ``application/json``
    when that is the request's media type (parameters such as ``charset`` aside), else
    ``application/x-protobuf`` (OTLP/HTTP's default encoding; also for an unsupported type, which is
    answered 415). A request of no Content-Type, a browser's ``GET`` say, is answered in JSON when
    ``accept`` (its Accept header) prefers ``application/json`` or ``text/html`` to
    ``application/x-protobuf``, else in protobuf."""
    if content_type and content_type.strip():
        return JSON if _type_of(content_type) == JSON else PROTOBUF
    if accept and max(_quality(accept, JSON), _quality(accept, "text/html")) > _quality(accept, PROTOBUF):
        return JSON
    return PROTOBUF


def encode_status(kind: str, status: int, message: str) -> bytes:
    """A ``google.rpc.Status`` (``code`` from the HTTP ``status``, ``message``) in ``kind``'s encoding:
    protobuf, or its JSON mapping for ``application/json``."""
    body = Status(code=_GRPC_CODES.get(status, code_pb2.UNKNOWN), message=message)
    if kind == JSON:
        text: str = json_format.MessageToJson(body, indent=None)
        return text.encode()
    data: bytes = body.SerializeToString()
    return data
