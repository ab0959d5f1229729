-- Rollout counts per status, kept by a trigger in the projector's own transactions, so that
-- query_rollouts' `total` for "all rollouts" or a status filter costs the same on 100 or 10^6 rows.
CREATE TABLE IF NOT EXISTS rollout_status_counts (
    status text PRIMARY KEY,
    n      bigint NOT NULL
);
INSERT INTO rollout_status_counts (status, n)
    SELECT status, count(*) FROM rollouts GROUP BY status
    ON CONFLICT (status) DO UPDATE SET n = EXCLUDED.n;

CREATE OR REPLACE FUNCTION rollout_status_counts_track() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        UPDATE rollout_status_counts SET n = n - 1 WHERE status = OLD.status;
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        INSERT INTO rollout_status_counts AS c (status, n) VALUES (NEW.status, 1)
            ON CONFLICT (status) DO UPDATE SET n = c.n + 1;
    END IF;
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS rollouts_count_insert ON rollouts;
CREATE TRIGGER rollouts_count_insert AFTER INSERT ON rollouts
    FOR EACH ROW EXECUTE FUNCTION rollout_status_counts_track();
DROP TRIGGER IF EXISTS rollouts_count_update ON rollouts;
CREATE TRIGGER rollouts_count_update AFTER UPDATE OF status ON rollouts
    FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status) EXECUTE FUNCTION rollout_status_counts_track();
DROP TRIGGER IF EXISTS rollouts_count_delete ON rollouts;
CREATE TRIGGER rollouts_count_delete AFTER DELETE ON rollouts
    FOR EACH ROW EXECUTE FUNCTION rollout_status_counts_track();

-- An algorithm's page of queued (or running) rollouts walks this index in order instead of
-- skipping every finished rollout created before them.
CREATE INDEX IF NOT EXISTS rollouts_status_created_idx ON rollouts (status, created_seq);
DROP INDEX IF EXISTS rollouts_status_idx;

-- Events the projector could not store (Postgres refused their data, e.g. an invalid value):
-- recorded here and skipped, so one bad event cannot stop the projection. The event itself stays
-- in the stream at `stream_seq`.
CREATE TABLE IF NOT EXISTS projector_dead_letters (
    stream_seq  bigint PRIMARY KEY,
    subject     text NOT NULL,
    error       text NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now()
);
