-- A template build's state is one of podbay.contracts.templates.BuildState, an E2B template build's one of
-- podbay.contracts.states.E2BBuildState (podbay.build_state moves both): a state no enum names cannot be
-- stored. No code ever wrote another value; a row that holds one anyway (written by hand) is closed as
-- failed/error first, so the constraint can be added.
UPDATE template_builds SET state = 'failed', finished_at = coalesce(finished_at, now())
    WHERE state NOT IN ('running', 'succeeded', 'failed');
ALTER TABLE template_builds ADD CONSTRAINT template_builds_state_check
    CHECK (state IN ('running', 'succeeded', 'failed'));
UPDATE e2b_template_builds SET state = 'error', finished_at = coalesce(finished_at, now())
    WHERE state NOT IN ('waiting', 'building', 'ready', 'error');
ALTER TABLE e2b_template_builds ADD CONSTRAINT e2b_template_builds_state_check
    CHECK (state IN ('waiting', 'building', 'ready', 'error'));
