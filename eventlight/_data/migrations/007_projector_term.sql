-- The projector's fence (issue 12): each leader takes the next term when it acquires the advisory
-- lock, and every batch it commits moves the checkpoint only `WHERE term = <its term> AND last_seq =
-- <the checkpoint it applied from>`. A deposed projector (its lock connection lost while another
-- took over) updates no row, so its transaction is rolled back: two projectors never both commit.
ALTER TABLE projector_checkpoint ADD COLUMN IF NOT EXISTS term bigint NOT NULL DEFAULT 0;
