-- Every rollout status has its row in rollout_status_counts from the start (n = 0 until a rollout
-- has it). A partitioned projector locks the rows in status order before it writes rollouts; a
-- status whose row did not exist yet was inserted by the trigger outside that order, and the first
-- batches of two partitions on a fresh schema could deadlock (DeadlockDetectedError, the batch
-- retried 1 s later; seen by bench.projector_rate in 2 of 22 runs).
INSERT INTO rollout_status_counts (status, n)
    SELECT s, 0 FROM unnest(ARRAY['queuing', 'preparing', 'running', 'failed', 'succeeded', 'cancelled',
                                  'requeuing']) AS s
    ON CONFLICT (status) DO NOTHING;
