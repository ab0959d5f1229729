"""JSON in and out of the routes with msgspec, and the OpenAPI entries that describe it.

Bodies are decoded from the request bytes into the route's struct (``body``); answers are encoded
from the store's structs (``json_response``), pages as ``{"items", "limit", "offset", "total"}``
(Agent-lightning's ``PaginatedResult``). FastAPI does not see these types, so each route states its
request and response schemas with ``doc(...)``, and ``openapi_components`` adds msgspec's JSON
schemas of them to the description.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from fastapi import Request
from starlette.responses import Response

from eventlight.core.types import PaginatedResult

__all__ = ["body", "doc", "json_response", "openapi_components"]

T = TypeVar("T")

_REF = "#/components/schemas/{name}"
_documented: dict[str, Any] = {}  # struct name -> struct, filled by doc()
_extra: dict[str, Any] = {}  # components of inline schemas (lists, unions of structs)


def _page(obj: PaginatedResult[Any]) -> dict[str, Any]:
    return {"items": obj.items, "limit": obj.limit, "offset": obj.offset, "total": obj.total}


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, PaginatedResult):
        return _page(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__} as JSON")


_encoder = msgspec.json.Encoder(enc_hook=_enc_hook)


def json_response(obj: Any, status_code: int = 200) -> Response:
    """``obj`` (structs, pages, builtins) as a JSON answer."""
    return Response(_encoder.encode(obj), status_code=status_code, media_type="application/json")


async def body(request: Request, cls: type[T], *, empty: T | None = None) -> T:
    """The request body decoded as ``cls``; ``empty`` (when given) stands for a missing or ``null`` body.

    Raises:
        msgspec.DecodeError: Not JSON (400) — msgspec.ValidationError: the wrong shape (422).
    """
    raw = await request.body()
    if empty is not None and raw.strip() in (b"", b"null"):
        return empty
    try:
        return msgspec.json.decode(raw, type=cls)
    except RecursionError:  # arrays or objects nested thousands deep: bad input, not a server fault
        raise msgspec.DecodeError("JSON is nested too deeply") from None
    except UnicodeDecodeError as e:  # msgspec checks UTF-8 only where it decodes a string
        bad = e.object[e.start : e.start + 1]
        raise msgspec.DecodeError(f"the body is not valid UTF-8 (byte {bad!r} at position {e.start})") from None


def _schema_of(tp: Any) -> dict[str, Any]:
    """A schema naming ``tp`` (a ref for a struct, inline otherwise), and remembers ``tp``."""
    name = getattr(tp, "__name__", None)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct) and name:
        _documented[name] = tp
        return {"$ref": _REF.format(name=name)}
    schema, components = msgspec.json.schema_components([tp], ref_template=_REF)
    _extra.update(components)
    return dict(schema[0])


def doc(request: Any = None, response: Any = None, status: int = 200, *, optional: bool = False) -> dict[str, Any]:
    """``openapi_extra`` of a route: its JSON request body (``request``) and its answer (``response``).

    ``optional``: the body may be left out. Use as ``@router.post(..., openapi_extra=doc(X, Y))``.
    """
    extra: dict[str, Any] = {}
    if request is not None:
        extra["requestBody"] = {
            "required": not optional,
            "content": {"application/json": {"schema": _schema_of(request)}},
        }
    if response is not None:
        extra["responses"] = {
            str(status): {"description": "OK", "content": {"application/json": {"schema": _schema_of(response)}}}
        }
    return extra


def openapi_components() -> dict[str, Any]:
    """JSON schemas of every type a ``doc(...)`` named, for ``components/schemas``."""
    _, components = msgspec.json.schema_components(list(_documented.values()), ref_template=_REF)
    return {**_extra, **components}
