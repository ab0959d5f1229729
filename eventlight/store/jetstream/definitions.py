"""Stream and consumer definitions, read from ``eventlight/_data/streams/*.json``: the one source.

``{ns}``/``{NS}`` in the files become the namespace in lower/upper case; keys ending in ``_s`` are
seconds; enums are given by value. ``eventlight.ops.apply_streams`` creates them; the projector and
the runners' queue bind to their durables with the same ``ConsumerConfig`` (``consumer_config``).
"""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from pathlib import Path
from typing import Any

from nats.js import api as js_api

from eventlight._data import data_dir
from eventlight.core.errors import InvalidInputError

__all__ = ["Definition", "consumer_config", "load_definitions"]

Definition = tuple[Path, dict[str, Any]]
"""A definition file and its JSON, the namespace substituted."""

_ENUMS: dict[str, type] = {
    "storage": js_api.StorageType,
    "retention": js_api.RetentionPolicy,
    "discard": js_api.DiscardPolicy,
    "ack_policy": js_api.AckPolicy,
    "deliver_policy": js_api.DeliverPolicy,
    "replay_policy": js_api.ReplayPolicy,
}


def _substitute(value: Any, ns: str) -> Any:
    if isinstance(value, str):
        return value.replace("{ns}", ns.lower()).replace("{NS}", ns.upper())
    if isinstance(value, list):
        return [_substitute(v, ns) for v in value]
    if isinstance(value, dict):
        return {k: _substitute(v, ns) for k, v in value.items()}
    return value


def config_kwargs(spec: dict[str, Any], cls: type[Any], source: Path) -> dict[str, Any]:
    """Map a JSON definition onto nats-py config fields: ``*_s`` keys are seconds, enums by value.

    Raises:
        InvalidInputError: A key that ``cls`` does not have.
    """
    fields = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, Any] = {}
    for key, value in spec.items():
        if key in ("kind", "stream", "when"):
            continue
        name = key[:-2] if key.endswith("_s") and key[:-2] in fields else key
        if name not in fields:
            raise InvalidInputError(f"{source.name}: unknown {cls.__name__} field {key!r}")
        out[name] = _ENUMS[name](value) if name in _ENUMS else value
    return out


def load_definitions(ns: str, streams_dir: Path | None = None) -> list[Definition]:
    """The definitions in ``streams_dir`` (default: the packaged ones), in file-name order.

    Raises:
        InvalidInputError: A definition's ``kind`` is not ``stream``, ``consumer`` (a durable that
            ``apply_streams`` creates) or ``consumer_template`` (settings of consumers a component
            creates itself, such as the projector's reader; ``consumer_config`` finds it by ``name``).
        FileNotFoundError: No such folder.
    """
    folder = streams_dir or data_dir("streams")
    defs = [(p, _substitute(json.loads(p.read_text()), ns)) for p in sorted(folder.glob("*.json"))]
    for path, spec in defs:
        if spec.get("kind") not in ("stream", "consumer", "consumer_template"):
            raise InvalidInputError(f"{path.name}: 'kind' must be 'stream', 'consumer' or 'consumer_template'")
    return defs


def stream_config(path: Path, spec: dict[str, Any]) -> js_api.StreamConfig:
    """The ``StreamConfig`` of a ``"kind": "stream"`` definition (``sources`` with their subject
    transforms as JetStream's JSON has them)."""
    kwargs = config_kwargs(spec, js_api.StreamConfig, path)
    if "sources" in kwargs:
        kwargs["sources"] = [js_api.StreamSource.from_response(dict(s)) for s in kwargs["sources"]]
    return js_api.StreamConfig(**kwargs)


def consumer_from(path: Path, spec: dict[str, Any]) -> js_api.ConsumerConfig:
    """The ``ConsumerConfig`` of a ``"kind": "consumer"`` definition."""
    return js_api.ConsumerConfig(**config_kwargs(spec, js_api.ConsumerConfig, path))


@cache
def _packaged_consumers(ns: str) -> dict[str, js_api.ConsumerConfig]:
    return {
        spec.get("durable_name") or spec["name"]: consumer_from(path, spec)
        for path, spec in load_definitions(ns)
        if spec["kind"] in ("consumer", "consumer_template")
    }


def consumer_config(durable: str, ns: str) -> js_api.ConsumerConfig:
    """The packaged definition of the consumer ``durable`` (a durable's name, or a template's ``name``)
    in namespace ``ns`` (a fresh copy).

    Raises:
        InvalidInputError: No packaged definition names that durable.
    """
    try:
        config = _packaged_consumers(ns)[durable]
    except KeyError:
        raise InvalidInputError(f"no consumer {durable!r} in the packaged streams/*.json") from None
    return dataclasses.replace(config)  # a copy: nats-py's pull_subscribe fills in fields
