-- E2B's template build API (services/api/e2b/templates.py, docs/e2b.md): a build is requested
-- (POST /v3/templates: state 'waiting'), its files are uploaded, then it is started with its steps
-- (state 'building', the podbay build it runs as in podbay_build_id) and ends 'ready' or 'error' (reason:
-- {message, step}). origins maps podbay's step n (1-based) to E2B's step origins[n-1]. Its log entries are
-- kept for the SDK's polling (GET .../status?logsOffset=N): the id orders them.
CREATE TABLE e2b_template_builds (
    id              text PRIMARY KEY,
    template        text NOT NULL,
    tenant_id       text NOT NULL,
    state           text NOT NULL DEFAULT 'waiting',
    podbay_build_id text,
    origins         integer[] NOT NULL DEFAULT '{}',
    reason          jsonb,
    created_at      timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz
);
CREATE INDEX e2b_template_builds_tenant ON e2b_template_builds (tenant_id, template);
CREATE TABLE e2b_template_build_logs (
    id        bigserial PRIMARY KEY,
    build_id  text NOT NULL REFERENCES e2b_template_builds (id) ON DELETE CASCADE,
    at        timestamptz NOT NULL DEFAULT now(),
    level     text NOT NULL,
    message   text NOT NULL,
    step      text
);
CREATE INDEX e2b_template_build_logs_build ON e2b_template_build_logs (build_id, id);
