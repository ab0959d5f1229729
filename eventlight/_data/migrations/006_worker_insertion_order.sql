-- query_workers() without sort_by returns workers in insertion order (Agent-lightning's spec), as the
-- in-memory backend does: created_seq is the stream position of the event that first recorded the
-- worker (the same on a rebuild). Rows from before this migration keep NULL and come first.
ALTER TABLE workers ADD COLUMN IF NOT EXISTS created_seq bigint;
CREATE INDEX IF NOT EXISTS workers_created_seq_idx ON workers (created_seq NULLS FIRST, worker_id);
