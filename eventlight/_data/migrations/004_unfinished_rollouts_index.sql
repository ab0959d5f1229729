-- Rollouts not yet finished, in creation order: what an algorithm or a dashboard pages through
-- (query_rollouts(status_in=["queuing"], limit=100)). With 100k finished rollouts created before
-- the queued ones, the planner walked the created_seq index and filtered out every finished row
-- (17 ms for a page of 100); this index holds only rollouts in flight, so the page costs the same
-- on 10^2 or 10^6 finished rollouts (bench: python -m bench.growth).
CREATE INDEX IF NOT EXISTS rollouts_unfinished_idx ON rollouts (created_seq)
    WHERE status NOT IN ('succeeded', 'failed', 'cancelled');
