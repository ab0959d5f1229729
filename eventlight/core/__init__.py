"""The pure core of eventlight: types, events, commands, the decider, the fold and errors.

No module here does I/O or imports nats or asyncpg; the clock is always an argument.

* ``types``: the API structs (rollouts, attempts, spans, resources, workers);
* ``events``: the facts written to the log, their encoding and upcasters;
* ``commands``: what callers ask of one rollout, ``UNSET`` and ``RolloutState``;
* ``decider``: ``decide(state, command, now) -> events``, every status rule;
* ``evolve``: ``evolve(state, event) -> state``, the fold every reader uses;
* ``errors``: the one error tree.
"""
