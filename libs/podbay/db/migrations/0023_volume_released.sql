-- When a volume was last unbound from its node (a suspend released it, or its node was lost): a file of it
-- still on a node and older than this is stale (the volume's truth is its promoted snapshot), so a node that
-- gets the volume back fetches it instead of using that file (services/nodeagent/volumes.py).
ALTER TABLE volumes ADD COLUMN released_at timestamptz;
