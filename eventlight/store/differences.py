"""How eventlight's ``LightningStore`` behaves where Agent-lightning 0.3.0's code and docs differ.

A documentation module (no code): the deliberate choices of ``eventlight.store.base.LightningStore``
on every backend, item by item.

Choices where Agent-lightning 0.3.0's code and its docs differ, item by item against
``spec/seed_store_types.md`` §7 (status transitions are listed in ``eventlight.core.decider``):
    1. unknown ids raise (docs), including ``query_spans``, ``query_attempts``, ``get_latest_attempt``,
       ``wait_for_rollouts``, ``get_next_span_sequence_id`` and an unknown ``resources_id`` on
       enqueue/start; but ``update_resources`` on an unknown id creates it (version 1), as 0.3.0 does
       and its users rely on to publish named resources;
    2. ``enqueue_rollout``/``enqueue_many_rollouts``/``start_rollout`` with ``resources_id=None`` take
       the latest resources (added or updated) at that moment (0.3.0's behaviour, which runners rely on);
    3. span sequence ids are counted per attempt (the docs allow it; 0.3.0 counts per rollout) and start
       at 1; a span with its own ``sequence_id`` raises the counter; ``query_spans`` over several attempts
       sorts by ``sequence_id`` attempt by attempt (0.3.0's order); out-of-order ids are accepted, and
       a duplicate is the same ``(rollout_id, attempt_id, span_id)`` (0.3.0), dropped with 0.3.0's log
       line (``Duplicated span added for rollout=…, attempt=…, span=…. Skipping.``, at WARNING where
       0.3.0 logs ERROR) when this store object or the stream's duplicate window sees it; ids run
       up to ``MAX_SPAN_SEQUENCE_ID`` (2**31 - 1, the read model's Postgres ``integer``): a larger
       one, or numbering past it, raises ``InvalidInputError``;
    4. ``wait_for_rollouts`` is keyword-only, ``timeout<=0`` only checks, ``requeuing`` is not finished,
       results keep ``rollout_ids`` order, and it listens to events instead of polling;
    5. filters: an empty ``*_in`` list matches nothing, ``None`` is no filter, all conditions of a query
       join one pool combined by ``filter_logic``; ``query_spans(filter_logic="or")`` without filters
       matches everything (0.3.0 returns nothing); ``status=``/``rollout_ids=`` are deprecated aliases;
    6. ``limit=-1`` is unlimited, ``limit=0`` an empty page, ``total`` counts before paging; a negative
       offset or ``limit < -1`` raises ``InvalidInputError`` (0.3.0 accepts them); an argument of the
       wrong type (``offset="1"``, ``limit=None``, ``heartbeat_stats=None``, a ``dict`` for a span, an
       int id to write under) raises ``InvalidTypeError``, which is an ``InvalidInputError``, a ``ValueError``
       and a ``TypeError``, so code catching 0.3.0's ``TypeError`` or pydantic's ``ValueError`` still works;
       an id to read or change that is not a string names nothing: ``get_*_by_id`` answers ``None``, the
       others raise ``RolloutNotFoundError`` (also over HTTP, where an empty id does the same);
    7. ``sort_by`` must name a field (``InvalidInputError``, a ``ValueError``); ``None`` values sort
       last ascending and first descending on both backends; no ``sort_by`` is insertion order;
    8. ``update_attempt(attempt_id="latest")`` and rollout propagation only from the latest attempt;
    9. attempts get ``end_time`` on every terminal status, ``timeout``/``unresponsive`` included (docs);
    10. finished rollouts are sticky: a late update of the latest attempt is recorded on the attempt
        but never moves a ``succeeded``, ``failed`` or ``cancelled`` rollout (0.3.0 lets it overwrite
        any of them). So a rollout ``failed`` because its latest attempt went ``unresponsive`` with
        no retry left stays ``failed`` when that runner reports ``succeeded`` later (0.3.0 flips it
        to ``succeeded`` after ``wait_for_rollouts`` and the algorithm took it as failed), and one
        marked ``succeeded`` by ``update_rollout`` is not requeued when its attempt fails later;
        ``update_rollout(status="queuing")`` and ``start_attempt`` still retry a finished rollout;
        a cancel (``update_rollout(status="cancelled")``) records every attempt not yet finished
        ``failed``, with ``CANCELLED_REASON`` (``"the rollout was cancelled while the attempt
        ran"``) as its ``eventlight.status_reason``, in the same append (0.3.0 marks no attempt);
        a runner running it stops its agent at its next heartbeat (``rollout_cancelled(rollout_id,
        attempt_id)``, answered from the log: the rollout is cancelled or the attempt was ended by
        a cancel) and records its reason on the attempt (0.3.0's runner is never told and runs the
        agent to its end); so a rollout cancelled and then requeued before that heartbeat is run
        by a fresh attempt, and the old runner stops (0.3.0: the old runner's next heartbeat takes
        the requeued rollout back, un-cancelling it, and runs on); a rollout back in the queue
        (``queuing``/``requeuing``) is not failed by its latest attempt either: one requeued under
        its runner waits for its next run (0.3.0 fails it: the requeue lost), a late ``running``
        or ``succeeded`` of an attempt not ended by a cancel still takes it back;
    11. a requeued rollout goes to the queue's tail once; ``max_attempts`` counts ``start_attempt``'s
        attempts too, and ``start_attempt`` itself ignores the budget (0.3.0);
    12. the watchdog is a running component (in the projector's process, every second by default), not
        a check run lazily before store calls, so nothing needs a debounce setting; the in-memory
        store starts it on its first call from a running loop, so it runs without ``async with`` too;
        besides the latest attempt of a rollout in flight (0.3.0), it checks every other attempt
        still ``preparing``/``running``, whatever its rollout's status: a superseded one or the
        latest one of a finished rollout that a late span revived, one running under a rollout
        sent back to the queue; 0.3.0 leaves those ``running`` for ever once their runner vanished;
        here they go ``unresponsive``/``timeout`` by the ``RolloutConfig`` and move nothing else (a
        finished rollout keeps its status and ``end_time``, item 10); with the default
        ``RolloutConfig()`` (no limits) it checks nothing, so a vanished runner's rollout stays
        ``preparing``/``running`` (0.3.0);
    13. a span revives ``unresponsive`` but never ``timeout``/``failed``; queue entries of rollouts that
        left ``queuing``/``requeuing`` are skipped;
    14. workers are derived from events: claim → busy, empty poll → idle, ``timeout``/``unresponsive`` →
        unknown; ``update_worker`` only stamps heartbeats; an empty poll records ``idle`` and
        ``last_dequeue_time`` at once after the worker was busy, else at most once a second (each is
        an fsynced event), so ``last_dequeue_time`` is the last poll to within 1 s; ``query_workers``
        without ``sort_by`` is insertion order; ``worker_id`` must be a token (no dots, spaces or
        wildcards: ``InvalidInputError``) on every backend; ``add_many_spans`` returns the spans it
        recorded in the order given;
    15.-17. ``eventlight serve`` / ``LightningStoreServer`` serve 0.3.0's ``/v1/agl`` routes and OTLP
        ``/v1/traces`` (``capabilities["otlp_traces"]`` is ``True`` on the server and the client, ``False``
        on the stores themselves); the server answers errors of the ``EventlightError`` tree with 4xx/5xx
        and a one-line ``detail`` (0.3.0: 500 with a traceback), a missing entity with ``null``;
        ``/waits/rollouts`` waits at most 25 s per request; ``LightningStoreClient`` raises the
        server's errors as the tree (0.3.0's returns ``None`` on any error for ``dequeue``/``get_*``)
        and accepts long ``wait_for_rollouts`` timeouts (0.3.0's refuses above 0.1 s);
    18. ``Span``'s nullable fields are required keys as in 0.3.0; ``NamedResources`` is tagged by
        ``resource_type``;
    20. every method appears atomic: writes are per-rollout optimistic appends (``command_loop``).

Other behaviours to know:
    * ``start_attempt`` is an explicit retry: it moves even a finished or cancelled rollout back to
      ``preparing`` (0.3.0); only late *attempt updates* cannot move a finished rollout (item 10);
    * ids that could never have been issued (with dots, spaces, wildcards) are simply not found;
    * Postgres text cannot hold NUL (U+0000): on JetStream the read model keeps U+FFFD in its place
      (the stream keeps the NUL, so a rebuild or ``eventlight replay`` sees it), and query arguments
      holding NUL are read the same way, so a filter finds what was written with it;
    * a span is validated before anything is written (ids, name, JSON-encodable attributes);
      NUL characters are kept in the stream and stored as U+FFFD in Postgres, which cannot hold NUL;
      JSON numbers are Postgres ``numeric`` there: ``-0.0`` reads back as ``0.0`` and a float written
      in exponent form with an integral value (``1e16``) as an ``int`` (the stream keeps the original);
    * on JetStream, reads see the caller's own writes (``sync``); another process's writes appear
      once the projector has committed them (usually milliseconds); ``wait_for_rollouts`` follows
      the stream itself; a non-blocking ``dequeue_rollout`` sees every enqueue acknowledged before
      it, from any process (within 10 ms of any write to the namespace's stream it waits out those
      10 ms for the queue's consumer to count recent enqueues);
    * an update decides on the whole rollout, spans included: after an attempt's first span,
      ``update_attempt`` without a status returns and keeps ``running``; events carry only the
      fields they change, so a writer that decided on an older state never overwrites newer ones;
    * ``dequeue_rollout(wait_s=...)`` (an eventlight extension) long-polls on both backends;
    * ``statistics()`` has 0.3.0's ``name``, ``total_*`` counts and ``uptime`` (seconds since the store
      object was made), not the in-memory store's byte budgets (eventlight's memory store has none);
    * every public name and submodule of ``agentlightning`` 0.3.0 exists under ``eventlight``
      (``tests/test_port_names.py``); those that cannot apply raise ``NotImplementedError`` on use,
      naming what to use instead: ``CollectionBasedLightningStore``, ``AgentOpsTracer``,
      the 0.1 client/server names (``AgentLightningClient``/``Server``, ``DevTaskLoader``,
      ``Task``, ``LegacyAgentRunner``), ``lightning_cli``, ``utils.otlp`` (the server's
      ``/v1/traces`` ingests OTLP), and ``ExecutionStrategy.execute`` (``Trainer(strategy=...)``
      takes the strategies and places runners as queue consumers: ``eventlight.trainer_strategies``);
      ``LightningStoreThreaded`` runs its store on a loop thread of its own, so any thread or event
      loop may call it (a store already open on a running loop is called there, and left open);
    * ``Trainer``'s ``"cs"`` strategy starts no store server (``eventlight serve`` is one, for
      other processes and languages): ``server_host``/``server_port``
      (``AGL_SERVER_HOST``/``AGL_SERVER_PORT``, ``port=``) are read and kept but unused; the sides
      meet through ``EVENTLIGHT_NATS_URL``, ``EVENTLIGHT_PG_DSN`` and ``EVENTLIGHT_NAMESPACE``;
      ``main_process``/``main_thread`` are validated as in 0.3.0, but the algorithm always runs on
      the main thread (runners in processes for ``"cs"``, in threads for ``"shm"``);
    * a JetStream store called from another event loop than its own raises ``WrongEventLoopError``;
    * a closed JetStream store raises ``InvalidInputError``; the in-memory store keeps its data and
      only stops its watchdog.
"""
