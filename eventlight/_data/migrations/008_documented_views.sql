-- Documented views: what a SQL user needs without knowing the event model (`eventlight sql`).
-- Each is a plain view over the projected tables, so a rebuild (`eventlight replay --rebuild`)
-- gives the same answers. Example queries are in the README ("Querying with SQL").

-- One row per rollout: its latest attempt, status, duration, final reward and resources version.
CREATE OR REPLACE VIEW v_rollouts AS
SELECT r.rollout_id, r.mode, r.status, r.start_time, r.end_time,
       r.end_time - r.start_time AS duration_s,
       r.num_attempts, r.latest_attempt_id, a.status AS latest_attempt_status, a.worker_id,
       r.resources_id, res.version AS resources_version,
       rr.final_reward, r.input, r.metadata
  FROM rollouts r
  LEFT JOIN attempts a ON a.rollout_id = r.rollout_id AND a.attempt_id = r.latest_attempt_id
  LEFT JOIN resources res ON res.resources_id = r.resources_id
  LEFT JOIN rollout_rewards rr ON rr.rollout_id = r.rollout_id;
COMMENT ON VIEW v_rollouts IS
  'One row per rollout: latest attempt and its status, duration_s, final_reward (last reward span of the latest attempt), resources_id and its version.';

-- One row per attempt, with its duration, span count and final reward.
CREATE OR REPLACE VIEW v_attempts AS
SELECT a.rollout_id, a.attempt_id, a.sequence_id, a.status, a.worker_id,
       a.start_time, a.end_time, a.end_time - a.start_time AS duration_s, a.last_heartbeat_time,
       (SELECT count(*) FROM spans s WHERE s.rollout_id = a.rollout_id AND s.attempt_id = a.attempt_id) AS spans,
       (SELECT (s.attributes ->> 'agentlightning.reward.0.value')::double precision
          FROM spans s
         WHERE s.rollout_id = a.rollout_id AND s.attempt_id = a.attempt_id
           AND s.attributes ? 'agentlightning.reward.0.value'
         ORDER BY s.sequence_id DESC, s.stream_seq DESC LIMIT 1) AS final_reward,
       a.metadata
  FROM attempts a;
COMMENT ON VIEW v_attempts IS
  'One row per attempt: status, worker, duration_s, number of spans, final_reward (its last reward span).';

-- One row per span; attributes stay jsonb (flat dotted OpenTelemetry keys: attributes ->> ''gen_ai.request.model'').
CREATE OR REPLACE VIEW v_spans AS
SELECT s.rollout_id, s.attempt_id, s.sequence_id, s.span_id, s.parent_id, s.trace_id, s.name,
       s.start_time, s.end_time, s.end_time - s.start_time AS duration_s,
       s.status ->> 'status_code' AS status_code, s.attributes, s.stream_seq
  FROM spans s;
COMMENT ON VIEW v_spans IS
  'One row per span, in (rollout_id, attempt_id, sequence_id) order of the attempt; attributes as jsonb with flat dotted keys; stream_seq is the log position it came from.';

-- One row per reward (emit_reward / a rollout returning a float): its value and dimension name.
CREATE OR REPLACE VIEW v_rewards AS
SELECT s.rollout_id, s.attempt_id, s.sequence_id, s.span_id,
       (s.attributes ->> 'agentlightning.reward.0.value')::double precision AS reward,
       s.attributes ->> 'agentlightning.reward.0.name' AS dimension,
       s.start_time AS time, s.stream_seq
  FROM spans s
 WHERE s.attributes ? 'agentlightning.reward.0.value';
COMMENT ON VIEW v_rewards IS
  'One row per reward span (Agent-lightning v0.3 format agentlightning.reward.0.*): reward, dimension name, time.';

-- LLM calls: tokens from either GenAI convention (prompt/completion or input/output), latency.
CREATE OR REPLACE VIEW llm_calls AS
SELECT s.rollout_id, s.attempt_id, s.sequence_id, s.name,
       coalesce(s.attributes ->> 'gen_ai.request.model', s.attributes ->> 'gen_ai.response.model') AS model,
       coalesce(s.attributes ->> 'gen_ai.usage.prompt_tokens',
                s.attributes ->> 'gen_ai.usage.input_tokens')::integer AS prompt_tokens,
       coalesce(s.attributes ->> 'gen_ai.usage.completion_tokens',
                s.attributes ->> 'gen_ai.usage.output_tokens')::integer AS completion_tokens,
       s.end_time - s.start_time AS duration_s,
       s.status ->> 'status_code' AS status_code,
       s.end_time - s.start_time AS latency_s,
       s.span_id, s.stream_seq
  FROM spans s
 WHERE s.attributes ? 'gen_ai.request.model' OR s.attributes ? 'gen_ai.response.model';
COMMENT ON VIEW llm_calls IS
  'One row per LLM call span (LLM proxy or tracer): model, prompt_tokens, completion_tokens, latency_s, rollout and attempt.';

-- Mean final reward per resources snapshot, its version and mode (e.g. one row per APO prompt version).
CREATE OR REPLACE VIEW reward_by_resources AS
SELECT rr.resources_id, rr.mode, count(*) AS rollouts,
       count(rr.final_reward) AS rewarded, avg(coalesce(rr.final_reward, 0)) AS mean_reward,
       max(res.version) AS resources_version
  FROM rollout_rewards rr LEFT JOIN resources res ON res.resources_id = rr.resources_id
 WHERE rr.status IN ('succeeded', 'failed')
 GROUP BY rr.resources_id, rr.mode;
COMMENT ON VIEW reward_by_resources IS
  'Per resources_id (and its current version) and mode: rollouts finished, how many had a reward, mean final reward (missing = 0).';
COMMENT ON VIEW rollout_rewards IS
  'Each rollout with its latest attempt and final_reward (the last reward span of the latest attempt); v_rollouts has more columns.';
