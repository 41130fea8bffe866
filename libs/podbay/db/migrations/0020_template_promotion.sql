-- Built templates promoted to object storage through the chunk store (libs/podbay/promotion.py), so a node
-- that did not build one fetches it on its first create there. root/root_digest: the built-in template the
-- build was made on, whose chunks are neither uploaded nor referenced (every node builds that one itself).
CREATE TABLE template_promotions (
    name            text NOT NULL,
    digest          text NOT NULL,
    root            text NOT NULL,
    root_digest     text NOT NULL,
    state           text NOT NULL CHECK (state IN ('promoting', 'promoted')),
    manifest        jsonb NOT NULL,
    total_bytes     bigint NOT NULL,
    uploaded_bytes  bigint,
    stored_bytes    bigint,
    created_at      timestamptz NOT NULL DEFAULT now(),
    promoted_at     timestamptz,
    PRIMARY KEY (name, digest)
);

-- The chunks a template build references; garbage collection keeps them.
CREATE TABLE template_chunks (
    name    text NOT NULL,
    digest  text NOT NULL,
    hash    text NOT NULL,
    PRIMARY KEY (name, digest, hash),
    FOREIGN KEY (name, digest) REFERENCES template_promotions (name, digest) ON DELETE CASCADE
);
CREATE INDEX template_chunks_hash ON template_chunks (hash);
