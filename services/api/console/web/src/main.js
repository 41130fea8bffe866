// The console: a single-page app over the public API, with hash routes (#/sandboxes, #/sandboxes/<id>, ...).
import "@xterm/xterm/css/xterm.css";
import "./app.css";
import { call, del, followNdjson, get, post, session, setSession } from "./api.js";
import { act, bytes, field, firstArray, h, table, toast, when } from "./ui.js";

const main = document.getElementById("main");
// The sandbox list is the first page: its data is asked for while the session is still being looked up (a GET
// needs no CSRF token). A 401 here sends the browser to the sign-in page, as any other call would.
let early = /^(#\/?(sandboxes\/?)?)?$/.test(location.hash) ? get("/v1/sandboxes") : null;
early?.catch(() => {});
let cleanup = [];
export const onLeave = (fn) => cleanup.push(fn);

const SECTIONS = [
  ["sandboxes", "Sandboxes"], ["templates", "Templates"], ["volumes", "Volumes"], ["credentials", "Credentials"],
  ["webhooks", "Webhooks"], ["keys", "API keys"], ["audit", "Audit"], ["nodes", "Nodes", true],
];

function renderNav(active) {
  const nav = document.getElementById("nav");
  nav.replaceChildren(...(session ? SECTIONS.filter(([, , op]) => !op || session.operator).map(([id, label]) =>
    h("a", { href: `#/${id}`, text: label, "aria-current": active === id ? "page" : null })) : []));
  const who = document.getElementById("who");
  who.replaceChildren(...(session ? [
    h("span", { text: `${session.tenant}${session.operator ? " (operator)" : ""}` }),
    h("button.link", { type: "button", text: "Sign out", on: { click: signOut } }),
  ] : []));
}

async function signOut() {
  await act(null, () => call("DELETE", "/console/session"));
  setSession(null);
  location.hash = "#/signin";
}

function page(title, ...body) {
  document.title = `${title} · podbay`;
  main.replaceChildren(h("h1", { text: title }), ...body);
  main.focus({ preventScroll: true });
}

// --- sign-in -----------------------------------------------------------------------------------------------

function signInPage() {
  const key = h("input", { type: "password", name: "key", autocomplete: "current-password", required: true,
    placeholder: "pb_…", spellcheck: "false" });
  const form = h("form.card.narrow", {
    on: {
      submit: async (ev) => {
        ev.preventDefault();
        const info = await act(form.querySelector("button"), () => post("/console/session", { key: key.value }));
        if (info) {
          setSession(info);
          early = null; // asked before sign-in, it was refused: the list asks again now
          location.hash = "#/sandboxes";
        }
      },
    },
  }, h("p", { text: "Sign in with an API key. The key stays here: the browser keeps a session cookie instead." }),
  field("API key", key), h("button.primary", { type: "submit", text: "Sign in" }));
  page("Sign in", form);
  key.focus();
}

// --- sandboxes ----------------------------------------------------------------------------------------------

const STATES = ["", "pending", "starting", "running", "pausing", "paused", "suspending", "suspended", "resuming",
  "stopping", "deleted", "failed"];

export function lifecycleButtons(sb, refresh) {
  const b = (label, fn, ok, cls = "") => h("button" + cls, {
    type: "button", text: label, "aria-label": `${label} ${sb.id}`,
    on: { click: (ev) => act(ev.currentTarget, fn, ok).then(refresh) },
  });
  const s = sb.state;
  return h("span.actions", {},
    s === "running" && b("Pause", () => post(`/v1/sandboxes/${sb.id}/pause`, undefined, { wait: false }), "pausing"),
    s === "running" && b("Suspend", () => post(`/v1/sandboxes/${sb.id}/suspend`, undefined, { wait: false }), "suspending"),
    (s === "paused" || s === "suspended") && b("Resume", () => post(`/v1/sandboxes/${sb.id}/resume`, undefined, { wait: false }), "resuming"),
    s !== "deleted" && b("Kill", () => confirm(`Kill ${sb.id}?`) && del(`/v1/sandboxes/${sb.id}`, { wait: false }), "killing", ".danger"));
}

async function sandboxesPage(params) {
  const stateSel = h("select", { name: "state" }, STATES.map((s) => h("option", { value: s, text: s || "any state" })));
  const tplSel = h("select", { name: "template" }, h("option", { value: "", text: "any template" }));
  const newTpl = h("select", { name: "new-template", required: true });
  stateSel.value = params.get("state") || "";
  const tbody = h("div", { id: "sandbox-list", "aria-live": "polite" });
  const rows = new Map();
  let list = [];

  const render = () => {
    const st = stateSel.value;
    const tp = tplSel.value;
    const shown = list.filter((s) => (!st || s.state === st) && (!tp || s.template === tp));
    tbody.replaceChildren(table(`${shown.length} sandboxes`, [
      ["Sandbox", (s) => h("a", { href: `#/sandboxes/${s.id}`, text: s.id })],
      ["Template", (s) => s.template],
      ["State", (s) => h("span.state", { "data-state": s.state, text: s.state })],
      ["Node", (s) => s.node_id || ""],
      ["Size", (s) => `${s.vcpus} vCPU · ${s.memory_mib} MiB`],
      ["Created", (s) => when(s.created_at)],
      ["Actions", (s) => lifecycleButtons(s, refresh)],
    ], shown, (s) => ({ "data-sandbox": s.id })));
  };
  const refresh = async () => {
    const r = await (early || get("/v1/sandboxes"));
    early = null;
    list = r.sandboxes;
    rows.clear();
    for (const s of list) rows.set(s.id, s);
    const names = [...new Set(list.map((s) => s.template))].sort();
    const keep = tplSel.value;
    tplSel.replaceChildren(h("option", { value: "", text: "any template" }), ...names.map((n) => h("option", { value: n, text: n })));
    tplSel.value = names.includes(keep) ? keep : "";
    render();
  };
  stateSel.addEventListener("change", render);
  tplSel.addEventListener("change", render);

  const create = h("form.inline", {
    on: {
      submit: async (ev) => {
        ev.preventDefault();
        const sb = await act(create.querySelector("button"), () => post("/v1/sandboxes", { template: newTpl.value }, { wait: false }),
          "creating sandbox");
        if (sb) refresh();
      },
    },
  }, field("New sandbox from template", newTpl), h("button.primary", { type: "submit", text: "Create sandbox" }));

  page("Sandboxes", h("div.bar", {}, create, h("div.inline", {}, field("State", stateSel), field("Template", tplSel))), tbody);
  get("/v1/templates").then((r) => newTpl.replaceChildren(...r.templates.filter((t) => !t.state || t.state === "ready")
    .map((t) => h("option", { value: t.name, text: t.name })))).catch(() => {});
  await refresh();
  window.__consoleReady = performance.now();

  // Live: follow the event stream from now; a state change updates its row at once, then the list is reloaded.
  const abort = new AbortController();
  onLeave(() => abort.abort());
  let pending = null;
  const follow = async () => {
    const { last_seq: after } = await get("/console/events/position");
    await followNdjson("/v1/events", { follow: true, after }, (ev) => {
      const row = rows.get(ev.sandbox_id);
      if (row && ev.state) {
        row.state = ev.state;
        render();
      }
      clearTimeout(pending);
      pending = setTimeout(refresh, 250);
    }, abort.signal);
  };
  follow().catch((e) => { if (!abort.signal.aborted) toast(`live updates stopped: ${e.message}`, true); });
}

// --- templates, volumes, credentials, webhooks, keys ----------------------------------------------------------

async function templatesPage() {
  const [t, pools] = await Promise.all([get("/v1/templates"), get("/v1/pools").catch(() => ({}))]);
  const poolOf = new Map(firstArray(pools).map((p) => [p.template, p]));
  const name = h("input", { name: "name", required: true, pattern: "[a-z0-9-]+(:[a-z0-9][a-z0-9._-]*)?", placeholder: "my-template" });
  const dockerfile = h("textarea.code", { name: "dockerfile", rows: 6, required: true, value: "FROM base\nRUN echo hello\n" });
  const log = h("pre.log", { id: "build-log", "aria-live": "polite", "aria-label": "Build log", hidden: true });
  const form = h("form.card", { on: { submit: async (ev) => {
    ev.preventDefault();
    const body = new FormData();
    body.append("name", name.value);
    body.append("dockerfile", dockerfile.value);
    log.hidden = false;
    log.textContent = "";
    const line = (text) => { log.textContent += text + "\n"; log.scrollTop = log.scrollHeight; };
    await act(ev.submitter, async () => {
      // The build's NDJSON stream (BuildEvent per line), shown as it arrives.
      const r = await call("POST", "/v1/templates", { body, raw: true });
      const reader = r.body.getReader();
      const dec = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += dec.decode(value, { stream: true });
        let i;
        while ((i = buf.indexOf("\n")) >= 0) {
          const raw = buf.slice(0, i).trim();
          buf = buf.slice(i + 1);
          if (!raw) continue;
          const e = JSON.parse(raw);
          if (e.type === "step") line(`── step ${e.step}/${e.total ?? "?"}${e.cached ? " (cached)" : ""}${e.text ? ": " + e.text : ""}`);
          else if (e.type === "log") line((e.text || "").replace(/\n$/, ""));
          else if (e.type === "done") line(`✔ built ${e.template ? e.template.name : ""}`);
          else if (e.type === "failed") line(`✘ failed: ${e.code || ""} ${e.message || ""}\n${e.output_tail || ""}`);
        }
      }
    });
  } } }, h("h2", { text: "Build from a Dockerfile" }), h("div.inline", {}, field("Name (name or name:tag)", name)),
  field("Dockerfile", dockerfile), h("button.primary", { type: "submit", text: "Build" }), log);
  page("Templates", table("Templates", [
    ["Name", (x) => x.name], ["State", (x) => x.state || "ready"], ["Tags", (x) => (x.tags || []).map((g) => g.tag || g).join(", ")],
    ["Size", (x) => `${x.vcpus} vCPU · ${x.memory_mib} MiB`], ["Image", (x) => bytes(x.size_bytes)],
    ["Warm pool (ready / size)", (x) => { const p = poolOf.get(x.name); return p ? h("span", { "data-pool": x.name,
      text: `${p.ready} / ${p.size}${p.max_size > p.size ? "–" + p.max_size : ""}` }) : "none"; }],
    ["Warm hits (last hour)", (x) => { const p = poolOf.get(x.name); return p ? h("span", { "data-hit-rate": x.name,
      text: p.hit_rate === null ? `no creates` : `${Math.round(p.hit_rate * 100)}% · ${p.hits} of ${p.hits + p.misses}` }) : ""; }],
    ["Digest", (x) => h("code", { text: (x.digest || "").slice(0, 19) })], ["Created", (x) => when(x.created_at)],
  ], t.templates), form);
}

function crudPage({ title, path, columns, form, idOf, revokeLabel = "Delete", after }) {
  return async () => {
    const load = async () => {
      const items = firstArray(await get(path));
      list.replaceChildren(table(title, [...columns, ["", (x) => h("button.danger", {
        type: "button", text: revokeLabel, "aria-label": `${revokeLabel} ${idOf(x)}`,
        on: { click: (ev) => confirm(`${revokeLabel} ${idOf(x)}?`) && act(ev.currentTarget, () => del(`${path}/${encodeURIComponent(idOf(x))}`), "done").then(load) },
      })]], items));
    };
    const list = h("div");
    const shown = h("div", { "aria-live": "polite" });
    const f = form();
    f.el.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const r = await act(f.el.querySelector("button[type=submit]"), () => post(path, f.body()), "created");
      if (r) {
        f.el.reset();
        shown.replaceChildren(...(after ? [after(r)] : []));
        load();
      }
    });
    page(title, f.el, shown, list);
    await load();
  };
}

const input = (name, attrs = {}) => h("input", { name, ...attrs });

const volumesPage = crudPage({
  title: "Volumes", path: "/v1/volumes", idOf: (v) => v.name,
  columns: [["Name", (v) => v.name], ["Size", (v) => bytes(v.size_bytes)], ["Created", (v) => when(v.created_at)]],
  form: () => {
    const name = input("name", { required: true, pattern: "[a-z0-9][a-z0-9-]{0,62}" });
    const size = input("size", { type: "number", min: 1, value: 1024, required: true });
    return { el: h("form.inline.card", {}, field("Name", name), field("Size (MiB)", size), h("button.primary", { type: "submit", text: "Create volume" })),
      body: () => ({ name: name.value, size_bytes: Number(size.value) * 1048576 }) };
  },
});

const credentialsPage = crudPage({
  title: "Credentials", path: "/v1/credentials", idOf: (c) => c.name,
  columns: [["Name", (c) => c.name], ["Placeholder", (c) => h("code", { text: c.placeholder || "" })],
    ["Hosts", (c) => (c.hosts || []).join(", ")], ["Header", (c) => c.header || ""], ["Created", (c) => when(c.created_at)]],
  form: () => {
    const name = input("name", { required: true });
    const value = input("value", { type: "password", required: true, autocomplete: "off" });
    const hosts = input("hosts", { required: true, placeholder: "api.example.com" });
    return { el: h("form.inline.card", {}, field("Name", name), field("Value (never shown again)", value), field("Hosts (comma-separated)", hosts),
      h("button.primary", { type: "submit", text: "Add credential" })),
    body: () => ({ name: name.value, value: value.value, hosts: hosts.value.split(",").map((s) => s.trim()).filter(Boolean) }) };
  },
});

const webhooksPage = crudPage({
  title: "Webhooks", path: "/v1/webhooks", idOf: (w) => w.id,
  columns: [["URL", (w) => w.url], ["Types", (w) => (w.types || []).join(", ") || "all"], ["Created", (w) => when(w.created_at)]],
  form: () => {
    const url = input("url", { type: "url", required: true, placeholder: "https://…" });
    return { el: h("form.inline.card", {}, field("URL", url), h("button.primary", { type: "submit", text: "Add webhook" })),
      body: () => ({ url: url.value }) };
  },
  after: (r) => h("p.card", {}, "Signing secret (shown once): ", h("code", { text: r.secret || "" })),
});

const keysPage = crudPage({
  title: "API keys", path: "/v1/keys", idOf: (k) => k.id, revokeLabel: "Revoke",
  columns: [["Name", (k) => k.name], ["Prefix", (k) => h("code", { text: k.prefix })], ["Created", (k) => when(k.created_at)],
    ["Revoked", (k) => when(k.revoked_at)]],
  form: () => {
    const name = input("name", { required: true });
    return { el: h("form.inline.card", {}, field("Name", name), h("button.primary", { type: "submit", text: "Create key" })),
      body: () => ({ name: name.value }) };
  },
  after: (r) => h("p.card", {}, "New key (shown once): ", h("code", { text: r.key || "" })),
});

// --- nodes (operator), audit ----------------------------------------------------------------------------------

// A drain's progress (GET /v1/operations/{id}: total, moved, failed, moves with each one's downtime).
function drainProgress(op) {
  const p = op.progress || {};
  const total = p.total ?? 0;
  const done = (p.moved ?? 0) + (p.failed || []).length;
  return h("div.drain", { "data-drain": op.id, "data-drain-state": op.state },
    h("progress", { max: Math.max(total, 1), value: total ? done : op.state === "succeeded" ? 1 : 0,
      "aria-label": `Drain of ${op.node_id}` }),
    h("span", { text: ` ${op.state}: ${p.moved ?? 0} of ${total} moved${(p.failed || []).length ? `, ${p.failed.length} failed` : ""}` }),
    (p.moves || []).length ? h("ul.moves", {}, p.moves.map((m) => h("li", { "data-moved": m.sandbox_id },
      h("a", { href: `#/sandboxes/${m.sandbox_id}`, text: m.sandbox_id }),
      ` → ${m.destination} (${m.how || "migrate"}, downtime ${m.downtime_ms ?? "?"} ms, ${m.total_ms ?? "?"} ms in all)`))) : null,
    (p.failed || []).length ? h("ul.moves", {}, p.failed.map((f) => h("li.bad", { text: `${f.sandbox_id}: ${f.reason}` }))) : null);
}

async function nodesPage() {
  const out = h("div", { "aria-live": "polite" });
  const draining = (n) => n.state === "draining" || n.state === "drained";
  let live = false; // a drain runs: the table is reloaded every 1.5 s (not otherwise, so focus stays put)
  const load = async () => {
    const nodes = firstArray(await get("/v1/nodes"));
    // Each node's newest drain, followed while it runs (the page polls; a drain takes seconds to minutes).
    const ops = new Map(await Promise.all(nodes.filter((n) => n.drain_operation_id).map(async (n) =>
      [n.id, await get(`/v1/operations/${encodeURIComponent(n.drain_operation_id)}`).catch(() => null)])));
    const res = (x) => (x ? `${x.vcpus ?? ""} vCPU · ${x.memory_mib ?? ""} MiB` : "");
    out.replaceChildren(table("Nodes", [
      ["Node", (n) => n.id], ["State", (n) => h("span.state", { "data-state": n.state, text: n.state })], ["Live", (n) => (n.live ? "yes" : "no")],
      ["Capacity", (n) => res(n.capacity)], ["Free", (n) => res(n.free)], ["Sandboxes", (n) => `${n.running} running · ${n.paused} paused`],
      ["Warm", (n) => n.warm_slots],
      ["Drain", (n) => (ops.get(n.id) && (draining(n) || ops.get(n.id).state === "running") ? drainProgress(ops.get(n.id)) : "")],
      ["", (n) => h("button", { type: "button", text: draining(n) ? "Undrain" : "Drain", "aria-label": `${draining(n) ? "Undrain" : "Drain"} ${n.id}`,
        on: { click: (ev) => (draining(n) || confirm(`Drain ${n.id}? Its sandboxes move to other nodes.`)) &&
          act(ev.currentTarget, () => post(`/v1/nodes/${encodeURIComponent(n.id)}/${draining(n) ? "undrain" : "drain"}`), draining(n) ? "undrained" : "draining").then(load) } })],
    ], nodes, (n) => ({ "data-node": n.id })));
    // The node's own state follows its drain's end by a moment: followed for 10 s more.
    live = nodes.some((n) => { const o = ops.get(n.id); return o && (o.state === "running" || o.state === "pending" ||
      (n.state === "draining" && o.finished_at && Date.now() - Date.parse(o.finished_at) < 10000)); });
  };
  page("Nodes", out);
  await load();
  const t = setInterval(() => live && load().catch(() => {}), 1500);
  onLeave(() => clearInterval(t));
}

async function auditPage(params) {
  const action = h("input", { name: "action", value: params.get("action") || "", placeholder: "sandbox.*" });
  const sandbox = h("input", { name: "sandbox_id", value: params.get("sandbox_id") || "" });
  const out = h("div");
  let before = null;
  const search = async (more) => {
    const r = await get("/v1/audit", { action: action.value, sandbox_id: sandbox.value, before: more ? before : null, limit: 100 });
    before = r.next_before;
    const t = table("Audit entries", [["When", (e) => when(e.at)], ["Action", (e) => e.action], ["Actor", (e) => e.actor],
      ["Target", (e) => e.target || ""], ["Decision", (e) => e.decision || ""], ["Detail", (e) => h("code", { text: JSON.stringify(e.detail) })]], r.entries);
    if (more) out.append(t); else out.replaceChildren(t);
    moreBtn.hidden = !before;
  };
  const moreBtn = h("button", { type: "button", text: "Older", hidden: true, on: { click: () => search(true) } });
  const form = h("form.inline.card", { on: { submit: (ev) => { ev.preventDefault(); search(false); } } },
    field("Action", action), field("Sandbox", sandbox), h("button.primary", { type: "submit", text: "Search" }));
  page("Audit", form, out, moreBtn);
  await search(false);
}

// --- router ---------------------------------------------------------------------------------------------------

const ROUTES = {
  signin: signInPage, sandboxes: sandboxesPage, templates: templatesPage, volumes: volumesPage, credentials: credentialsPage,
  webhooks: webhooksPage, keys: keysPage, nodes: nodesPage, audit: auditPage,
};

async function route() {
  for (const fn of cleanup.splice(0)) fn();
  const [path, qs] = (location.hash.slice(1) || "/sandboxes").split("?");
  const parts = path.split("/").filter(Boolean);
  const params = new URLSearchParams(qs || "");
  if (!session && parts[0] !== "signin") {
    try {
      setSession(await get("/console/session"));
    } catch {
      location.hash = "#/signin";
      return;
    }
  }
  renderNav(parts[0]);
  try {
    if (parts[0] === "sandboxes" && parts[1]) {
      // An id is letters, digits, _ and -: anything else (".", "..", a slash once decoded) would be a
      // different API path after the browser normalises the URL, so it is no sandbox's page.
      const id = decodeURIComponent(parts[1]);
      if (!/^[A-Za-z0-9_-]{1,64}$/.test(id)) throw Object.assign(new Error(`no sandbox ${id}`), { status: 404, code: "not_found" });
      // The sandbox page (its tabs and views) is a chunk of its own: the list, the first page, loads without it.
      const { sandboxPage } = await import("./sandbox.js");
      await sandboxPage(id, { page, onLeave, lifecycleButtons });
    }
    else await (ROUTES[parts[0]] || sandboxesPage)(params);
  } catch (e) {
    page(e.status === 404 ? "Not found" : "Error", h("p.card", { role: "alert", text: `${e.code || "error"}: ${e.message}` }));
    main.dataset.status = String(e.status || "");
  }
}

window.addEventListener("hashchange", route);
route();
