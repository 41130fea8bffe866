-- Drain (issue 8): a node's drain is an operation with progress (moved/total, the sandboxes that could not
-- move, each move's downtime); a per-sandbox migration operation keeps its figures in data.
ALTER TABLE operations ADD COLUMN IF NOT EXISTS node_id text;
ALTER TABLE operations ADD COLUMN IF NOT EXISTS progress jsonb;
ALTER TABLE operations ADD COLUMN IF NOT EXISTS data jsonb;
