-- A sandbox's credential fills are re-armed on whichever node serves it (services/nodeagent/fill_memory.py):
-- the node reads the 'credential.fill' 'allow' audit rows of the sandbox and its ancestors
-- (sandboxes.parent_sandbox_id, followed by primary key) at the first CDP connection or screenshot of each stay;
-- this index finds the rows without a scan of the whole log.
CREATE INDEX audit_log_credential_fill ON audit_log (sandbox_id) WHERE action = 'credential.fill' AND decision = 'allow';
