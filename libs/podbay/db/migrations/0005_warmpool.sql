-- Warm pools (docs/DESIGN.md §5, issue "warm pools"): per template and node, prepared sandboxes restored from the
-- template snapshot and paused, so a create claims one instead of restoring.

-- Operator bounds per template: the pool keeps at least min_size slots and grows with demand up to max_size.
CREATE TABLE warm_pools (
    template    text PRIMARY KEY REFERENCES templates(name),
    min_size    integer NOT NULL CHECK (min_size >= 0),
    max_size    integer NOT NULL CHECK (max_size >= min_size),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- What each node should keep ready, written by the warm-pool service from the bounds and recent demand.
CREATE TABLE warm_targets (
    template    text NOT NULL REFERENCES templates(name),
    node_id     text NOT NULL REFERENCES nodes(id),
    target      integer NOT NULL CHECK (target >= 0),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (template, node_id)
);

-- One row per slot. The slot id is also the id of the sandbox it becomes. A create claims a ready slot with
-- SELECT ... FOR UPDATE SKIP LOCKED in the transaction that inserts the sandbox, so a slot goes out once.
CREATE TABLE warm_slots (
    id               text PRIMARY KEY,
    node_id          text NOT NULL REFERENCES nodes(id),
    template         text NOT NULL,
    template_digest  text NOT NULL,
    memory_mib       integer NOT NULL,
    vcpus            integer NOT NULL,
    state            text NOT NULL CHECK (state IN ('preparing', 'ready', 'claimed', 'failed')),
    reason           text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    ready_at         timestamptz,
    claimed_at       timestamptz,
    failed_at        timestamptz
);
CREATE INDEX warm_slots_ready ON warm_slots (template, template_digest, created_at) WHERE state = 'ready';
CREATE INDEX warm_slots_node ON warm_slots (node_id, state);
