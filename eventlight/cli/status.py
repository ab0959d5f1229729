"""``eventlight status``: the servers, the stream, the projection, the queue and the workers of a namespace.

The processes that hold a lease on the state folder's embedded servers (``eventlight.ops.leases``:
a trainer's run, ``eventlight runner``, ``eventlight serve``) are listed with their pid and since
when, one row a process (a demo's ``use_services`` block and the ``Trainer`` inside it hold two
leases in one process: one row naming both); a lease file whose process ended (no lock held) is not.

Workers are listed by the age of their last heartbeat, live ones first (alive: a heartbeat within
``LIVE_HEARTBEAT_S``, ``eventlight.store.liveness``); a runner that stopped in an orderly way (its
last heartbeat says so, ``liveness.stopped_at``) shows ``stopped`` at once; when rollouts wait and no
worker is alive, a ``warning`` line says so.
"""

from __future__ import annotations

import time
from typing import Any

from rich.markup import escape
from rich.table import Table

from eventlight.cli.common import EXIT_UNAVAILABLE, CliError, NamespaceOpt, _run, _settings, console
from eventlight.cli.discovery import _connect_pg, _need_nats, _need_pg, _no_namespace
from eventlight.settings import Settings

# ---------------------------------------------------------------------------------------------
# status


def _describe(name: str, found: Any) -> str:
    from eventlight.net import redact

    if found.origin == "embedded":
        where = f"embedded, {name} pid {found.pid}" + (f" ({found.kind})" if found.kind != "embedded" else "")
        return f"{escape(redact(found.url))}  [dim]{escape(where)}[/dim]"
    if found.recorded:  # the variable is unset now: `up` recorded the server it named then
        return f"{escape(redact(found.url))}  [dim]external, recorded by `eventlight up` ({found.origin} then)[/dim]"
    return f"{escape(redact(found.url))}  [dim]external, from {found.origin}[/dim]"


async def _stream_state(url: str, settings: Settings) -> tuple[int, int] | None:
    """(messages, last sequence) of the namespace's stream, ``None`` when it does not exist."""
    from eventlight.net import redact
    from eventlight.store.jetstream.connect import connect_nats
    from eventlight.store.jetstream.nats_errors import JsNotFoundError, nats_errors

    nc = await connect_nats(url, auth=settings.nats_auth, name="eventlight-cli")
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
    """What the servers tell: ``nats``/``pg`` (where each is), ``stream`` and the Postgres rows
    (``_from_pg``); with one server down, ``nats_down`` or ``pg_down`` (its error) and what the
    other tells.

    Raises:
        ServiceUnavailableError / CliError: Both are down, or no server is configured or recorded.
    """
    from eventlight.core.errors import ServiceUnavailableError

    try:
        nats = await _need_nats(settings)
    except ServiceUnavailableError as e:  # Postgres alone still tells the projection, rollouts, spans and workers
        return await _status_without_nats(settings, e)
    stream = await _stream_state(nats.url, settings)
    try:
        pg = await _need_pg(settings)
    except ServiceUnavailableError as e:  # NATS alone still tells where the servers and the stream are
        if stream is None:
            raise _no_namespace(settings, f"no stream {settings.stream_name}") from None
        return {"nats": nats, "stream": stream, "pg": None, "pg_down": e}
    return {"nats": nats, "stream": stream, "pg": pg, **await _from_pg(settings, pg)}


async def _status_without_nats(settings: Settings, nats_down: Exception) -> dict[str, Any]:
    """``_status`` while NATS is down or too old (``ServerTooOldError``): what Postgres tells
    (``nats_down``: NATS's error).

    Raises:
        ServiceUnavailableError: NATS's error, when no Postgres is configured or recorded either.
        CliError: Postgres is down too, the recorded one is another NATS's (``find_pg``), or the
            namespace has no schema there: NATS's error first, then Postgres's.
    """
    from eventlight.core.errors import InvalidInputError, ServiceUnavailableError

    try:
        pg = await _need_pg(settings)
    except (ServiceUnavailableError, InvalidInputError) as e:  # down, or another deployment's (find_pg)
        raise CliError(f"{nats_down}; and {e}", EXIT_UNAVAILABLE) from None
    except CliError:  # no Postgres at all: NATS's error says what is wrong
        raise nats_down from None
    try:
        rows = await _from_pg(settings, pg)
    except CliError as e:  # no schema for the namespace: NATS's problem is said first, not hidden
        raise CliError(f"{nats_down}; and {e}", EXIT_UNAVAILABLE) from None
    return {"nats": None, "nats_down": nats_down, "stream": None, "pg": pg, **rows}


async def _from_pg(settings: Settings, pg: Any) -> dict[str, Any]:
    """The projector's checkpoint (``projected``), rollouts ``by_status``, ``workers`` and ``spans``."""
    from eventlight.store.liveness import STOPPED_AT

    conn = await _connect_pg(settings, pg)
    try:
        projected = await conn.fetchval("SELECT min(last_seq) FROM projector_checkpoint")
        by_status = await conn.fetch("SELECT status, count(*) FROM rollouts GROUP BY status ORDER BY status")
        workers = await conn.fetch(
            "SELECT worker_id, status, last_heartbeat_time, current_rollout_id, "
            "CASE WHEN jsonb_typeof(heartbeat_stats->$1::text) = 'number' "
            "THEN (heartbeat_stats->>$1::text)::float8 END AS stopped_at FROM workers "
            "ORDER BY last_heartbeat_time DESC NULLS LAST, worker_id",
            STOPPED_AT,
        )
        spans = await conn.fetchval("SELECT count(*) FROM spans")
    finally:
        await conn.close()
    return {"projected": projected, "by_status": by_status, "workers": workers, "spans": spans}


def _projection_line(stream: tuple[int, int] | None, projected: int | None, nats_down: Exception | None = None) -> str:
    if nats_down is not None:
        return f"at event {projected or 0} (the stream's last event is unknown while NATS is {_nats_state(nats_down)})"
    if stream is None or projected is None or projected >= stream[1]:
        return "up to date (lag 0 events)"
    from eventlight.cli.projection import WHAT_PROJECTS

    return (
        f"at event {projected} of {stream[1]} (lag {stream[1] - projected} events: `eventlight sql --catch-up` "
        f"projects up to the head; the tables below also catch up while {WHAT_PROJECTS} has the namespace open)"
    )


def _queue_line(by_status: dict[str, int]) -> str:
    from eventlight.store.liveness import QUEUED_STATUSES

    depth = sum(by_status.get(s, 0) for s in QUEUED_STATUSES)
    parts = ", ".join(f"{s}={by_status[s]}" for s in QUEUED_STATUSES if by_status.get(s))
    return f"{depth} rollout(s) waiting" + (f" ({parts})" if parts else "")


def _as_workers(rows: list[Any]) -> list[Any]:
    from eventlight.core.types import Worker
    from eventlight.store.liveness import STOPPED_AT

    return [
        Worker(
            worker_id=r["worker_id"],
            last_heartbeat_time=r["last_heartbeat_time"],
            heartbeat_stats=None if r["stopped_at"] is None else {STOPPED_AT: r["stopped_at"]},
        )
        for r in rows
    ]


def _workers_line(rows: list[Any], now: float) -> str:
    from eventlight.store.liveness import LIVE_HEARTBEAT_S, is_alive, stopped_at

    if not rows:
        return "none"
    workers = _as_workers(rows)
    live = sum(is_alive(w, now) for w in workers)
    stopped = sum(stopped_at(w) is not None for w in workers)
    said = f", {stopped} stopped" if stopped else ""
    return f"{live} live (a heartbeat in the last {LIVE_HEARTBEAT_S:.0f} s){said}, {len(rows) - live - stopped} silent"


def _workers_table(rows: list[Any], now: float) -> Table:
    from eventlight.cli_output import age
    from eventlight.store.liveness import is_alive, stopped_at

    table = Table(
        "worker", "alive", "status", "last heartbeat", "rollout", box=None, pad_edge=False, header_style="dim"
    )
    listed = sorted(zip(rows, _as_workers(rows), strict=True), key=lambda rw: not is_alive(rw[1], now))  # stable
    for r, w in listed:
        beat = age(now - r["last_heartbeat_time"]) if r["last_heartbeat_time"] is not None else "never"
        if is_alive(w, now):
            alive = "yes"
        else:
            alive = "[dim]stopped[/dim]" if stopped_at(w) is not None else "[yellow]no[/yellow]"
        table.add_row(escape(r["worker_id"]), alive, r["status"], beat, escape(r["current_rollout_id"] or ""))
    return table


def _durability_line(settings: Settings, nats_origin: str) -> str:
    """The level in force: the embedded server's, from its config; else the setting (external servers)."""
    from eventlight.ops.nats_server import embedded_durability

    level = embedded_durability(settings.state_dir) if nats_origin == "embedded" else None
    if level is None:
        level = settings.durability
    note = "" if level == settings.durability else f" (EVENTLIGHT_DURABILITY asks {settings.durability})"
    return f"{level}{note}"


def status(namespace: NamespaceOpt = None) -> None:
    """Show the services, projector lag, queue depth, rollouts by status, spans and workers.

    Services: where each server is and whether it is embedded or external; workers: alive or not
    (a heartbeat in the last 30 s; 'stopped' once a runner stopped in an orderly way), status,
    last heartbeat and current rollout, live ones first; a warning when rollouts wait and no worker
    is alive.

    Servers: uses $EVENTLIGHT_NATS_URL / $EVENTLIGHT_PG_DSN when set, else the embedded servers
    `eventlight up` started; never starts or stops any (without them: exit 1, 'run `eventlight up`').
    With NATS up and Postgres down: the services and the stream, then exit 1 naming Postgres; with
    Postgres up and NATS down, or answering as a nats-server older than eventlight needs ('up, but
    too old', both versions): the services and what Postgres holds, then exit 1 naming NATS. With
    $EVENTLIGHT_NATS_URL set and $EVENTLIGHT_PG_DSN not, the Postgres `eventlight up` recorded is used
    only when it recorded that NATS too."""
    settings = _settings(namespace)
    s = _run(_status(settings))
    _print_services(settings, s)
    pg_down, nats_down = s.get("pg_down"), s.get("nats_down")
    if pg_down is not None:
        raise CliError(
            f"{pg_down}; the projection, rollouts, queue, spans and workers come from Postgres "
            "(runners need only NATS)",
            EXIT_UNAVAILABLE,
        )
    _print_from_postgres(s)
    if nats_down is not None:
        raise CliError(
            f"{nats_down}; the stream and its last event come from NATS, and runners, writes and the "
            "projector need it (the rest above is Postgres's projection)",
            EXIT_UNAVAILABLE,
        )


def _nats_state(nats_down: Exception) -> str:
    """``"too old"`` for a NATS that answered with a version eventlight cannot use, else ``"down"``."""
    from eventlight.core.errors import ServerTooOldError

    return "too old" if isinstance(nats_down, ServerTooOldError) else "down"


def _down_line(e: Any) -> str:
    from eventlight.core.errors import ServerTooOldError

    if isinstance(e, ServerTooOldError):  # it answered: up, but unusable
        return (
            f"{escape(e.server)}  [red]up, but too old[/red]: nats-server {escape(e.found)} answered; "
            f"eventlight needs >= {escape(e.required)}"
        )
    return f"{escape(e.server)}  [red]down[/red]: {escape(e.detail)}"


def _print_services(settings: Settings, s: dict[str, Any]) -> None:
    """The servers (one of them maybe down), the durability level, the state folder and the namespace."""
    pg_down, nats_down = s.get("pg_down"), s.get("nats_down")
    console.print(f"NATS       {_describe('nats-server', s['nats']) if nats_down is None else _down_line(nats_down)}")
    console.print(f"Postgres   {_describe('postgres', s['pg']) if pg_down is None else _down_line(pg_down)}")
    nats_origin = s["nats"].origin if nats_down is None else nats_down.server.split()[0]
    pg_origin = s["pg"].origin if pg_down is None else pg_down.server.split()[0]
    console.print(f"durability {_durability_line(settings, nats_origin)}")
    if "embedded" in (nats_origin, pg_origin):
        console.print(f"state      {escape(str(settings.state_dir))}")
    _print_leases(settings, embedded="embedded" in (nats_origin, pg_origin))
    stream = f"{s['stream'][0]} events" if s["stream"] is not None else "missing"
    if nats_down is not None:
        stream = f"unknown: NATS is {_nats_state(nats_down)}"
    console.print(
        f"namespace  {settings.namespace}  [dim]stream {settings.stream_name} ({stream}), "
        f"schema {settings.pg_schema}[/dim]"
    )


LEASE_HOLDERS = {
    "Trainer": "a trainer's run",
    "eventlight runner": "`eventlight runner`",
    "eventlight serve": "`eventlight serve`",
    "use_services": "a program's use_services block",
}
"""How the ``what`` of a lease file reads in ``status``; another is shown as it is."""


def _print_leases(settings: Settings, *, embedded: bool) -> None:
    """The processes holding a lease on the state folder's servers (``leases.lease_holders``), one
    row each, however many leases it holds; ``none`` when embedded servers are in use and no one
    holds one, nothing when neither."""
    from eventlight.ops.leases import by_process, lease_holders
    from eventlight.ops.state import existing_state_dir

    state = existing_state_dir(settings)
    processes = by_process(lease_holders(state)) if state is not None else []
    if not processes:
        if embedded:
            console.print("leases     none [dim](no process holds a lease on the embedded servers)[/dim]")
        return
    console.print(f"leases     {len(processes)} process(es) use the embedded servers")
    console.print(_leases_table(processes, time.time()))


def _leases_table(processes: list[list[Any]], now: float) -> Table:
    """One row a process (``leases.by_process``): its pid, what holds each of its leases, since its first."""
    from eventlight.cli_output import age

    table = Table("pid", "holder", "since", box=None, pad_edge=False, header_style="dim")
    for leases in processes:
        first = leases[0].since
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(first))
        holders = ", ".join(LEASE_HOLDERS.get(h.what, h.what) for h in leases)
        table.add_row(str(leases[0].pid), escape(holders), f"{since} ({age(now - first)})")
    return table


def _print_from_postgres(s: dict[str, Any]) -> None:
    """The projection, rollouts, queue, spans and workers (the read models), and the no-runner warning."""
    console.print(f"projection {_projection_line(s['stream'], s['projected'], s.get('nats_down'))}")
    console.print("rollouts   " + (", ".join(f"{st}={n}" for st, n in s["by_status"]) or "none"))
    by_status = {st: int(n) for st, n in s["by_status"]}
    console.print(f"queue      {_queue_line(by_status)}")
    console.print(f"spans      {s['spans']}")
    now = time.time()
    console.print(f"workers    {_workers_line(s['workers'], now)}")
    if s["workers"]:
        console.print(_workers_table(s["workers"], now))
    _warn_if_nobody_runs(by_status, s["workers"], now)


def _warn_if_nobody_runs(by_status: dict[str, int], rows: list[Any], now: float) -> None:
    from eventlight.store.liveness import QUEUED_STATUSES, no_live_worker

    message = no_live_worker(sum(by_status.get(st, 0) for st in QUEUED_STATUSES), _as_workers(rows), now)
    if message is not None:
        console.print(f"[yellow]warning[/yellow]    {escape(message)}")
