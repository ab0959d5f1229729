"""Apply the JetStream stream and durable consumers of ``eventlight/_data/streams/*.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.js import api as js_api

from eventlight.settings import Settings
from eventlight.store.jetstream.connect import connected_server
from eventlight.store.jetstream.definitions import consumer_from, load_definitions, stream_config
from eventlight.store.jetstream.nats_errors import JsNotFoundError, nats_errors


async def apply_streams(nc_or_js: Any, settings: Settings, streams_dir: Path | None = None) -> list[str]:
    """Create or update the JetStream streams and durable consumers defined in ``streams/*.json``.

    ``{ns}``/``{NS}`` in the files become ``settings.namespace`` in lower/upper case; keys
    ending in ``_s`` are seconds. Streams are applied before consumers. A definition with
    ``"when": "retention"`` (the archive, ``004_archive.json``) is applied only when
    ``settings.retention_s`` is set. Safe to repeat.

    Args:
        nc_or_js: A connected ``nats.aio.client.Client`` or a JetStream context/manager.
        settings: Gives the namespace.
        streams_dir: Folder of definitions; default the packaged ``eventlight/_data/streams``.

    Returns:
        What was applied, e.g. ``["stream EL_DEFAULT", "consumer EL_DEFAULT/runners"]``.

    Raises:
        InvalidInputError: A definition has an unknown kind or field.
        FileNotFoundError: No streams folder was found.
        ServiceUnavailableError: NATS failed, or refused a definition (e.g. an immutable field changed).
    """
    js = nc_or_js.jetstream() if isinstance(nc_or_js, NatsClient) else nc_or_js
    server = connected_server(nc_or_js) if isinstance(nc_or_js, NatsClient) else "NATS"
    defs = load_definitions(settings.namespace, streams_dir)
    applied = []
    for path, spec in sorted(defs, key=lambda d: d[1]["kind"] != "stream"):
        if spec.get("when") == "retention" and settings.retention_s is None:
            continue  # the archive exists only where retirement is on (Settings.retention_s)
        with nats_errors(server, f"applying {path.name}"):
            if spec["kind"] == "stream":
                if settings.replicas is not None:
                    spec = {**spec, "num_replicas": settings.replicas}
                applied.append(await _apply_stream(js, stream_config(path, spec)))
            elif spec["kind"] == "consumer":
                consumer = consumer_from(path, spec)
                await js.add_consumer(spec["stream"], consumer)
                applied.append(f"consumer {spec['stream']}/{consumer.durable_name}")
    return applied


async def _apply_stream(js: Any, config: js_api.StreamConfig) -> str:
    try:
        await js.stream_info(config.name)
    except JsNotFoundError:
        await js.add_stream(config)
        return f"stream {config.name}"
    await js.update_stream(config)
    return f"stream {config.name}"
