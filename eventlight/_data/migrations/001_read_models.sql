-- Read models projected from the JetStream stream (eventlight.store.projector).
-- Applied inside the namespace's schema (search_path is set by the migration runner).
-- Every table can be dropped and rebuilt by replaying the stream.

-- The projector's position: the last stream sequence whose effects are committed here.
CREATE TABLE IF NOT EXISTS projector_checkpoint (
    id        smallint PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    last_seq  bigint NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO projector_checkpoint (id, last_seq) VALUES (1, 0) ON CONFLICT DO NOTHING;

-- One row per rollout; the aggregated view of its latest attempt.
CREATE TABLE IF NOT EXISTS rollouts (
    rollout_id        text PRIMARY KEY,
    input             jsonb,
    start_time        double precision NOT NULL,
    end_time          double precision,
    mode              text,
    resources_id      text,
    status            text NOT NULL,
    config            jsonb NOT NULL,
    metadata          jsonb,
    latest_attempt_id text,
    num_attempts      integer NOT NULL DEFAULT 0,
    created_seq       bigint NOT NULL,
    last_seq          bigint NOT NULL
);
CREATE INDEX IF NOT EXISTS rollouts_status_idx ON rollouts (status);
CREATE INDEX IF NOT EXISTS rollouts_created_seq_idx ON rollouts (created_seq);

CREATE TABLE IF NOT EXISTS attempts (
    rollout_id          text NOT NULL,
    attempt_id          text NOT NULL,
    sequence_id         integer NOT NULL,
    start_time          double precision NOT NULL,
    end_time            double precision,
    status              text NOT NULL,
    worker_id           text,
    last_heartbeat_time double precision,
    metadata            jsonb,
    PRIMARY KEY (rollout_id, attempt_id)
);
CREATE INDEX IF NOT EXISTS attempts_rollout_seq_idx ON attempts (rollout_id, sequence_id);

-- Spans; (rollout_id, attempt_id, span_id) is the identity, sequence_id the order within an attempt.
CREATE TABLE IF NOT EXISTS spans (
    rollout_id   text NOT NULL,
    attempt_id   text NOT NULL,
    span_id      text NOT NULL,
    sequence_id  integer NOT NULL,
    trace_id     text NOT NULL,
    parent_id    text,
    name         text NOT NULL,
    status       jsonb NOT NULL,
    attributes   jsonb NOT NULL,
    events       jsonb NOT NULL,
    links        jsonb NOT NULL,
    start_time   double precision,
    end_time     double precision,
    context      jsonb,
    parent       jsonb,
    resource     jsonb NOT NULL,
    stream_seq   bigint NOT NULL,
    PRIMARY KEY (rollout_id, attempt_id, span_id)
);
CREATE INDEX IF NOT EXISTS spans_rollout_order_idx ON spans (rollout_id, sequence_id, stream_seq);

CREATE TABLE IF NOT EXISTS resources (
    resources_id text PRIMARY KEY,
    create_time  double precision NOT NULL,
    update_time  double precision NOT NULL,
    version      integer NOT NULL,
    resources    jsonb NOT NULL,
    created_seq  bigint NOT NULL,
    last_seq     bigint NOT NULL
);
CREATE INDEX IF NOT EXISTS resources_last_seq_idx ON resources (last_seq);

CREATE TABLE IF NOT EXISTS workers (
    worker_id           text PRIMARY KEY,
    status              text NOT NULL,
    heartbeat_stats     jsonb,
    last_heartbeat_time double precision,
    last_dequeue_time   double precision,
    last_busy_time      double precision,
    last_idle_time      double precision,
    current_rollout_id  text,
    current_attempt_id  text
);

-- Documented views for SQL users (`eventlight sql "..."`).

-- Each rollout with its latest attempt and its final reward (the last reward span of the latest attempt).
CREATE OR REPLACE VIEW rollout_rewards AS
SELECT r.rollout_id, r.mode, r.status, r.resources_id, r.start_time, r.end_time,
       r.num_attempts, a.attempt_id, a.worker_id,
       (SELECT (s.attributes ->> 'agentlightning.reward.0.value')::double precision
          FROM spans s
         WHERE s.rollout_id = r.rollout_id AND s.attempt_id = r.latest_attempt_id
           AND s.attributes ? 'agentlightning.reward.0.value'
         ORDER BY s.sequence_id DESC, s.stream_seq DESC LIMIT 1) AS final_reward
  FROM rollouts r LEFT JOIN attempts a
    ON a.rollout_id = r.rollout_id AND a.attempt_id = r.latest_attempt_id;

-- Mean final reward per resources snapshot and mode (e.g. one row per APO prompt version).
CREATE OR REPLACE VIEW reward_by_resources AS
SELECT resources_id, mode, count(*) AS rollouts,
       count(final_reward) AS rewarded, avg(coalesce(final_reward, 0)) AS mean_reward
  FROM rollout_rewards
 WHERE status IN ('succeeded', 'failed')
 GROUP BY resources_id, mode;

-- LLM calls recorded by the proxy or the tracer, one row per call.
CREATE OR REPLACE VIEW llm_calls AS
SELECT s.rollout_id, s.attempt_id, s.sequence_id, s.name,
       s.attributes ->> 'gen_ai.request.model' AS model,
       (s.attributes ->> 'gen_ai.usage.prompt_tokens')::integer AS prompt_tokens,
       (s.attributes ->> 'gen_ai.usage.completion_tokens')::integer AS completion_tokens,
       s.end_time - s.start_time AS duration_s,
       s.status ->> 'status_code' AS status_code
  FROM spans s
 WHERE s.attributes ? 'gen_ai.request.model';
