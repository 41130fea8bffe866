-- GET /v1/nodes names each node's newest drain operation (drain_operation_id): found by this index rather than
-- by a scan of every operation.
CREATE INDEX operations_node_drain ON operations (node_id, created_at DESC) WHERE kind = 'drain';
