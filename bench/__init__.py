"""eventlight's benchmark suite: eventlight against Agent-lightning 0.3.0 on the same machine.

Modules (see ``bench/README.md``): ``workload`` (scenarios, task plans, checks; standard library
only), ``driver`` (one scenario on one stack, run in that stack's venv), ``stack_eventlight`` /
``stack_agl`` (each imports only its own stack), ``procs`` (RSS and CPU sampling), ``micro`` (store
operations per second), ``ceiling`` (raw JetStream + Postgres COPY probe), ``peer`` (the peer's
venv), ``suite`` (runs everything, one subprocess per stack and scenario) and ``report`` (table,
JSON, chart). Nothing here imports a stack at import time.
"""
