-- Webhooks (issue "Many nodes, lost nodes, and the operator's view"): per tenant, a URL that receives a signed
-- POST for each lifecycle event of the tenant (optionally only some types). The secret signs deliveries, so
-- it is kept readable by the API (it is shown to the tenant once, at creation). The last_* columns record
-- the state of the latest delivery for `podbay webhook list`.
CREATE TABLE webhooks (
    id              text PRIMARY KEY,
    tenant_id       text NOT NULL REFERENCES tenants(id),
    url             text NOT NULL,
    types           text[] NOT NULL DEFAULT '{}',
    secret          text NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    deleted_at      timestamptz,
    deliveries      bigint NOT NULL DEFAULT 0,
    failures        bigint NOT NULL DEFAULT 0,
    last_status     integer,
    last_attempts   integer,
    last_error      text,
    last_event_seq  bigint,
    last_attempt_at timestamptz
);
CREATE INDEX webhooks_tenant ON webhooks (tenant_id) WHERE deleted_at IS NULL;
