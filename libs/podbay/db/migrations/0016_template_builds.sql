-- Templates built from Dockerfiles (services/nodeagent/build/): the template they were built FROM, their
-- config (the defaults of exec), their disk's size, and a soft delete (sandboxes keep referencing a
-- removed template's row). One row per build; at most one running build per name.
ALTER TABLE templates ADD COLUMN parent text;
ALTER TABLE templates ADD COLUMN config jsonb;
ALTER TABLE templates ADD COLUMN size_bytes bigint;
ALTER TABLE templates ADD COLUMN deleted_at timestamptz;

CREATE TABLE template_builds (
    id           text PRIMARY KEY,
    name         text NOT NULL,
    tenant_id    text NOT NULL,
    node_id      text NOT NULL,
    state        text NOT NULL DEFAULT 'running',
    digest       text,
    error        jsonb,
    dockerfile   text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    finished_at  timestamptz
);
CREATE UNIQUE INDEX template_builds_one_running ON template_builds (name) WHERE state = 'running';
