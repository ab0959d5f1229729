-- Why an attempt or rollout ended badly (issue 15: nothing lost without a mark): the one-line
-- `eventlight.status_reason` the watchdog (timeout / unresponsive) or the runner (the agent's
-- exception, spans it could not deliver) writes into the attempt's metadata. A rollout that ran
-- out of attempts shows its last attempt's reason. Columns are appended, so CREATE OR REPLACE keeps
-- the views' earlier columns as they were.
CREATE OR REPLACE VIEW v_rollouts AS
SELECT r.rollout_id, r.mode, r.status, r.start_time, r.end_time,
       r.end_time - r.start_time AS duration_s,
       r.num_attempts, r.latest_attempt_id, a.status AS latest_attempt_status, a.worker_id,
       r.resources_id, res.version AS resources_version,
       rr.final_reward, r.input, r.metadata,
       a.metadata ->> 'eventlight.status_reason' AS status_reason
  FROM rollouts r
  LEFT JOIN attempts a ON a.rollout_id = r.rollout_id AND a.attempt_id = r.latest_attempt_id
  LEFT JOIN resources res ON res.resources_id = r.resources_id
  LEFT JOIN rollout_rewards rr ON rr.rollout_id = r.rollout_id;
COMMENT ON VIEW v_rollouts IS
  'One row per rollout: latest attempt and its status, duration_s, final_reward (last reward span of the latest attempt), resources_id and its version, status_reason (why the latest attempt failed, timed out or went silent).';

CREATE OR REPLACE VIEW v_attempts AS
SELECT a.rollout_id, a.attempt_id, a.sequence_id, a.status, a.worker_id,
       a.start_time, a.end_time, a.end_time - a.start_time AS duration_s, a.last_heartbeat_time,
       (SELECT count(*) FROM spans s WHERE s.rollout_id = a.rollout_id AND s.attempt_id = a.attempt_id) AS spans,
       (SELECT (s.attributes ->> 'agentlightning.reward.0.value')::double precision
          FROM spans s
         WHERE s.rollout_id = a.rollout_id AND s.attempt_id = a.attempt_id
           AND s.attributes ? 'agentlightning.reward.0.value'
         ORDER BY s.sequence_id DESC, s.stream_seq DESC LIMIT 1) AS final_reward,
       a.metadata,
       a.metadata ->> 'eventlight.status_reason' AS status_reason
  FROM attempts a;
COMMENT ON VIEW v_attempts IS
  'One row per attempt: status, worker, duration_s, number of spans, final_reward (its last reward span), status_reason (why it failed, timed out or went silent).';
