-- Terminal rollouts not yet retired, by last log position: what the leader's retirement round reads
-- (`eventlight.store.jetstream.retire`, at least once a minute). It read every terminal rollout,
-- those retired long ago included (they stay in `rollouts`; only `retired_rollouts` told them apart),
-- and sorted them all before its LIMIT: 7.4 s a round on 800k rollouts all retired. `retired` is set
-- by `retire` in the transaction that lists the rollout in `retired_rollouts`, so this index holds
-- the rollouts finished within the retention window and those due, not the history (figures in
-- bench/README.md, "Retirement's selection of what is due").
-- `retired` is not a fold of the log, as `retired_rollouts` is not: a rebuilt schema has it false
-- everywhere and `retired_rollouts` empty (a later `retire` lists them again; purging twice removes
-- nothing more), and the rebuild's comparison leaves it out (`eventlight.logreplay.rebuild.NOT_FOLDED`).
-- The projector's upsert never writes it.
ALTER TABLE rollouts ADD COLUMN IF NOT EXISTS retired boolean NOT NULL DEFAULT false;
UPDATE rollouts r SET retired = true FROM retired_rollouts x WHERE x.rollout_id = r.rollout_id AND NOT r.retired;
CREATE INDEX IF NOT EXISTS rollouts_retirable_idx ON rollouts (last_seq)
    WHERE status IN ('succeeded', 'failed', 'cancelled') AND NOT retired;
COMMENT ON COLUMN rollouts.retired IS 'Listed in retired_rollouts (set by eventlight retire; not a fold of the log).';
