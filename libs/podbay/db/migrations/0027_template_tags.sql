-- Template tags (issue 17, versions): `web:v2` names one build (digest) of template `web`. A build made as
-- `podbay template build web:v2` registers itself as web's current build and tags it in the same
-- transaction; `template: "web:v2"` creates from the tagged build after later rebuilds. memory_mib/vcpus are
-- the tagged build's (a rebuild may change the template's). Nodes keep a tagged build while the tag exists.
CREATE TABLE template_tags (
    name        text NOT NULL REFERENCES templates(name),
    tag         text NOT NULL,
    digest      text NOT NULL,
    memory_mib  integer NOT NULL,
    vcpus       integer NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (name, tag)
);
