"""``eventlight status``: the servers, the stream, the projection and the workers of a namespace."""

from __future__ import annotations

import time
from typing import Any

from rich.markup import escape
from rich.table import Table

from eventlight.cli.common import NamespaceOpt, _run, _settings, console
from eventlight.cli.discovery import _connect_pg, _need_nats, _need_pg
from eventlight.settings import Settings

# ---------------------------------------------------------------------------------------------
# status


def _describe(name: str, found: Any) -> str:
    from eventlight.net import redact

    if found.origin == "embedded":
        where = f"embedded, {name} pid {found.pid}" + (f" ({found.kind})" if found.kind != "embedded" else "")
        return f"{escape(redact(found.url))}  [dim]{escape(where)}[/dim]"
    return f"{escape(redact(found.url))}  [dim]external, from {found.origin}[/dim]"


async def _stream_state(url: str, settings: Settings) -> tuple[int, int] | None:
    """(messages, last sequence) of the namespace's stream, ``None`` when it does not exist."""
    from eventlight.net import redact
    from eventlight.store.jetstream.connect import connect_nats
    from eventlight.store.jetstream.nats_errors import JsNotFoundError, nats_errors

    nc = await connect_nats(url, name="eventlight-cli")
    try:
        with nats_errors(redact(url), "stream info"):
            try:
                info = await nc.jetstream().stream_info(settings.stream_name)
            except JsNotFoundError:
                return None
        return int(info.state.messages), int(info.state.last_seq)
    finally:
        await nc.close()


async def _status(settings: Settings) -> dict[str, Any]:
    nats = await _need_nats(settings)
    pg = await _need_pg(settings)
    stream = await _stream_state(nats.url, settings)
    conn = await _connect_pg(settings, pg)
    try:
        projected = await conn.fetchval("SELECT last_seq FROM projector_checkpoint")
        by_status = await conn.fetch("SELECT status, count(*) FROM rollouts GROUP BY status ORDER BY status")
        workers = await conn.fetch(
            "SELECT worker_id, status, last_heartbeat_time, current_rollout_id FROM workers ORDER BY worker_id"
        )
        spans = await conn.fetchval("SELECT count(*) FROM spans")
    finally:
        await conn.close()
    return {
        "nats": nats,
        "pg": pg,
        "stream": stream,
        "projected": projected,
        "by_status": by_status,
        "workers": workers,
        "spans": spans,
    }


def _projection_line(stream: tuple[int, int] | None, projected: int | None) -> str:
    if stream is None or projected is None or projected >= stream[1]:
        return "up to date"
    return (
        f"at event {projected} of {stream[1]} ({stream[1] - projected} behind: the tables below advance only "
        "while a trainer or another store opened with pg_dsn projects)"
    )


def _workers_table(workers: list[Any], now: float) -> Table:
    from eventlight.cli_output import age

    table = Table("worker", "status", "last heartbeat", "rollout", box=None, pad_edge=False, header_style="dim")
    for w in workers:
        beat = age(now - w["last_heartbeat_time"]) if w["last_heartbeat_time"] is not None else "never"
        table.add_row(escape(w["worker_id"]), w["status"], beat, escape(w["current_rollout_id"] or ""))
    return table


def status(namespace: NamespaceOpt = None) -> None:
    """Show the services, rollouts by status, spans and workers.

    Services: where each server is and whether it is embedded or external; workers: status, last
    heartbeat and current rollout.

    Servers: uses $EVENTLIGHT_NATS_URL / $EVENTLIGHT_PG_DSN when set, else the embedded servers
    `eventlight up` started; never starts or stops any (without them: exit 1, 'run `eventlight up`')."""
    settings = _settings(namespace)
    s = _run(_status(settings))
    stream = f"{s['stream'][0]} events" if s["stream"] is not None else "missing"
    console.print(f"NATS       {_describe('nats-server', s['nats'])}")
    console.print(f"Postgres   {_describe('postgres', s['pg'])}")
    if "embedded" in (s["nats"].origin, s["pg"].origin):
        console.print(f"state      {escape(str(settings.state_dir))}")
    console.print(
        f"namespace  {settings.namespace}  [dim]stream {settings.stream_name} ({stream}), "
        f"schema {settings.pg_schema}[/dim]"
    )
    console.print(f"projection {_projection_line(s['stream'], s['projected'])}")
    console.print("rollouts   " + (", ".join(f"{st}={n}" for st, n in s["by_status"]) or "none"))
    console.print(f"spans      {s['spans']}")
    console.print(f"workers    {len(s['workers']) or 'none'}")
    if s["workers"]:
        console.print(_workers_table(s["workers"], time.time()))
