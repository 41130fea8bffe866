-- An operation's state is one of podbay.contracts.states.OperationState (podbay.operation_state moves it):
-- a state no enum names cannot be stored.
ALTER TABLE operations ADD CONSTRAINT operations_state_check
    CHECK (state IN ('pending', 'running', 'succeeded', 'failed'));
