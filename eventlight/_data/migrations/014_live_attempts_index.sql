-- Attempts still live ('preparing'/'running'), by rollout: what a projector reads when it becomes
-- leader (`Projector._load_in_flight`: rollouts in flight, or finished with a superseded attempt
-- still live) and what retirement checks a rollout has none of. Without it both scanned every
-- attempt ever projected (100k attempts: 13-26 ms a new leader, growing with the history); this
-- index holds only the live ones, so the reload costs the same on 10^4 or 10^6 attempts
-- (figures in bench/README.md, "The leader's reload of rollouts in flight").
-- Its predicate is on `status`, which the projector updates: an attempt's status change is no
-- longer a HOT update (its heartbeats, which leave the status as it is, still are).
CREATE INDEX IF NOT EXISTS attempts_live_idx ON attempts (rollout_id, attempt_id)
    WHERE status IN ('preparing', 'running');
