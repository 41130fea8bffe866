-- Node states and node loss (issue 8).
--
-- nodes.state: ready (placements allowed), draining / drained (an operator is emptying it; no new
-- placements), lost (its heartbeat expired and stayed absent past PODBAY_NODE_LOST_GRACE_S; its sandboxes
-- were fenced and rescheduled; it becomes ready again only after its agent reconciled).
-- A node row that predates this migration keeps its state when it is one of these; anything else is ready.
UPDATE nodes SET state = 'ready' WHERE state NOT IN ('ready', 'draining', 'drained', 'lost');
ALTER TABLE nodes ADD CONSTRAINT nodes_state_check CHECK (state IN ('ready', 'draining', 'drained', 'lost'));
ALTER TABLE nodes ADD COLUMN lost_at timestamptz;
ALTER TABLE nodes ADD COLUMN state_changed_at timestamptz NOT NULL DEFAULT now();
