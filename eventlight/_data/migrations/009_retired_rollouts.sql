-- Rollouts retired from the hot stream to the archive stream (issue 14, Settings.retention_s):
-- terminal rollouts that ended more than the retention window ago, whose events `retire` purged
-- from the hot stream below log position `purged_below_seq` once the archive and the projector
-- had both passed it. Not a projection of the log: a rebuilt schema starts without rows (a later
-- `retire` lists them again; purging twice removes nothing more).
CREATE TABLE IF NOT EXISTS retired_rollouts (
    rollout_id       text PRIMARY KEY,
    retired_at       double precision NOT NULL,
    purged_below_seq bigint NOT NULL
);
COMMENT ON TABLE retired_rollouts IS 'Rollouts whose events left the hot stream for the archive stream (eventlight retire).';
