-- Projection by partition (issue 17): a namespace's rollouts are split into `partitions` partitions
-- (a stable hash of the rollout id; events of no rollout are partition 0's), each projected by the
-- holder of its own advisory lock with its own term and checkpoint. The checkpoint row that was
-- always there becomes partition 0's; the first projector records the count and adds the others.
ALTER TABLE projector_checkpoint DROP CONSTRAINT IF EXISTS projector_checkpoint_id_check;
UPDATE projector_checkpoint SET id = 0 WHERE id = 1;
ALTER TABLE projector_checkpoint ALTER COLUMN id SET DEFAULT 0;
ALTER TABLE projector_checkpoint ADD CONSTRAINT projector_checkpoint_id_check CHECK (id >= 0 AND id < 64);
COMMENT ON COLUMN projector_checkpoint.id IS
    'the partition of rollouts this row is the position of (0 to partitions - 1); every partition '
    'reads the whole stream, so each last_seq is a stream sequence and min(last_seq) is the projection''s';

-- The partition count, recorded once by the first projector of the namespace (no row: not yet).
CREATE TABLE IF NOT EXISTS projector_partitions (
    id          smallint PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    partitions  smallint NOT NULL CHECK (partitions BETWEEN 1 AND 64),
    recorded_at timestamptz NOT NULL DEFAULT now()
);

-- Partitioned projections only: what partition 0 (which projects the workers) knows of every
-- attempt for the worker records: its worker and status, written in partition 0's transactions,
-- so a worker's record follows the log order even when the attempt's rollout is another partition's.
CREATE TABLE IF NOT EXISTS projector_attempt_workers (
    attempt_id text PRIMARY KEY,
    worker_id  text,
    status     text NOT NULL
);
