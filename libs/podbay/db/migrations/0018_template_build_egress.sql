-- A build's RUN steps reach the network through the gateway like a sandbox's: under this policy (the build
-- request's, else the FROM template's at the time the build started). The gateway reads it for the
-- builder VM's binding (sandbox id "build-<build id>") while the build runs.
ALTER TABLE template_builds ADD COLUMN parent text;
ALTER TABLE template_builds ADD COLUMN egress_policy jsonb;
