-- Template names are per tenant (issue 37, docs/SECURITY.md "tenant vs tenant"): tenant A's `web` and tenant
-- B's `web` are two templates. `templates.alias` is the name its owner gave (what every API shows and takes);
-- `templates.name` stays the row's key and becomes an internal storage key: node template and layer
-- directories, warm slots and pools, object-store keys, sandboxes.template, NATS payloads use it. Existing
-- rows keep their key (their nodes' stores stay valid) with alias = key; new tenant templates get a
-- `tpl-<hex>` key (services/api/services/template_access.py), shared ones keep their name as key when it is free.
ALTER TABLE templates ADD COLUMN alias text;
UPDATE templates SET alias = name;
ALTER TABLE templates ALTER COLUMN alias SET NOT NULL;

-- Rows a node inserts on its own (base, an image's root template) name no alias: their key is their name
-- (also the trigger of template_builds below).
CREATE FUNCTION templates_alias_default() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.alias := coalesce(NEW.alias, NEW.name);
    RETURN NEW;
END $$;
CREATE TRIGGER templates_alias_default BEFORE INSERT ON templates
    FOR EACH ROW EXECUTE FUNCTION templates_alias_default();

-- One live template per owner and name (NULL owner: the shared namespace); the lookup of a name by a tenant
-- (its own, else the shared one) uses the second index.
CREATE UNIQUE INDEX templates_owner_alias ON templates (coalesce(owner_tenant, ''), alias) WHERE deleted_at IS NULL;
CREATE INDEX templates_alias ON templates (alias) WHERE deleted_at IS NULL;

-- The name the tenant gave a build (template_builds.name is the template's key); as for templates, a row
-- written without one is named by its key.
ALTER TABLE template_builds ADD COLUMN alias text;
UPDATE template_builds SET alias = name;
ALTER TABLE template_builds ALTER COLUMN alias SET NOT NULL;
CREATE TRIGGER template_builds_alias_default BEFORE INSERT ON template_builds
    FOR EACH ROW EXECUTE FUNCTION templates_alias_default();
CREATE INDEX template_builds_tenant_alias ON template_builds (tenant_id, alias);
