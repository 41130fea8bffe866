-- podbay schema v1 (docs/DESIGN.md §4). Applied once, in order, at start-up by podbay.db.migrate.

CREATE TABLE tenants (
    id          text PRIMARY KEY,
    name        text NOT NULL UNIQUE,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE api_keys (
    id          text PRIMARY KEY,
    tenant_id   text NOT NULL REFERENCES tenants(id),
    name        text NOT NULL,
    prefix      text NOT NULL UNIQUE,         -- shown to users; looked up on each request
    key_hash    bytea NOT NULL,               -- sha256(secret); the secret is never stored
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz
);

CREATE TABLE templates (
    name        text PRIMARY KEY,
    digest      text NOT NULL,
    memory_mib  integer NOT NULL,
    vcpus       integer NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE nodes (
    id             text PRIMARY KEY,
    dataplane_url  text NOT NULL,
    memory_mib     integer NOT NULL,
    vcpus          integer NOT NULL,
    accel          text NOT NULL,
    state          text NOT NULL DEFAULT 'ready',
    started_at     timestamptz NOT NULL DEFAULT now(),
    seen_at        timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE node_templates (
    node_id     text NOT NULL REFERENCES nodes(id),
    template    text NOT NULL REFERENCES templates(name),
    digest      text NOT NULL,
    PRIMARY KEY (node_id, template)
);

CREATE TABLE sandboxes (
    id              text PRIMARY KEY,
    tenant_id       text NOT NULL REFERENCES tenants(id),
    template        text NOT NULL REFERENCES templates(name),
    template_digest text NOT NULL,
    state           text NOT NULL,
    desired_state   text NOT NULL,
    node_id         text REFERENCES nodes(id),
    generation      bigint NOT NULL DEFAULT 0,
    memory_mib      integer NOT NULL,
    vcpus           integer NOT NULL,
    hostname        text NOT NULL,
    metadata        jsonb NOT NULL DEFAULT '{}',
    failure_reason  text,
    event_seq       bigint NOT NULL DEFAULT 0,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    deleted_at      timestamptz
);
CREATE INDEX sandboxes_tenant ON sandboxes (tenant_id, created_at DESC);
CREATE INDEX sandboxes_node ON sandboxes (node_id) WHERE state <> 'deleted';

CREATE TABLE operations (
    id           text PRIMARY KEY,
    tenant_id    text NOT NULL REFERENCES tenants(id),
    sandbox_id   text REFERENCES sandboxes(id),
    kind         text NOT NULL,
    state        text NOT NULL,
    error_code   text,
    error_message text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    finished_at  timestamptz
);
CREATE INDEX operations_sandbox ON operations (sandbox_id, created_at DESC);

-- Transactional outbox: an event row commits with its state change and is relayed to JetStream afterwards.
CREATE TABLE outbox (
    id            bigserial PRIMARY KEY,
    event_id      text NOT NULL UNIQUE,
    subject       text NOT NULL,
    payload       jsonb NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    published_at  timestamptz
);
CREATE INDEX outbox_unpublished ON outbox (id) WHERE published_at IS NULL;

-- Append-only: the application never updates or deletes rows here.
CREATE TABLE audit_log (
    id          bigserial PRIMARY KEY,
    tenant_id   text,
    actor       text NOT NULL,
    action      text NOT NULL,
    target      text,
    detail      jsonb NOT NULL DEFAULT '{}',
    at          timestamptz NOT NULL DEFAULT now()
);
