// One sandbox: its state and actions, a terminal, files, ports, snapshots as a tree, events.
import { call, followNdjson, get, post } from "./api.js";
import { act, bytes, field, h, table, toast, when } from "./ui.js";
import { desktopView, NOVNC_PORT, networkView, processesView, resourcesView, schedulesView } from "./detail.js";

const TABS = [["terminal", "Terminal"], ["files", "Files"], ["processes", "Processes"], ["ports", "Ports"],
  ["snapshots", "Snapshots"], ["resources", "Resources"], ["network", "Egress"], ["schedules", "Schedules"], ["events", "Events"]];

export async function sandboxPage(id, { page, onLeave, lifecycleButtons }) {
  const sb = await get(`/v1/sandboxes/${encodeURIComponent(id)}`);
  const head = h("div.bar");
  const refreshHead = async () => {
    const now = await get(`/v1/sandboxes/${encodeURIComponent(id)}`);
    head.replaceChildren(h("span.state", { "data-state": now.state, text: now.state }),
      h("span.muted", { text: `${now.template} · ${now.vcpus} vCPU · ${now.memory_mib} MiB · node ${now.node_id || "-"}` }),
      // (replaceChildren would write a null as the text "null")
      ...(now.parent_id ? [h("span", { id: "parent-link" }, "forked from ",
        h("a", { href: `#/sandboxes/${now.parent_id}`, text: now.parent_id, "aria-label": `Parent sandbox ${now.parent_id}` }))] : []),
      lifecycleButtons(now, refreshHead));
  };
  const panel = h("section.panel", { id: "panel", role: "tabpanel" });
  const tabs = h("div.tabs", { role: "tablist", "aria-label": "Sandbox views" });
  let stop = () => {};
  const show = async (name) => {
    stop();
    stop = () => {};
    for (const b of tabs.children) b.setAttribute("aria-selected", String(b.dataset.tab === name));
    panel.replaceChildren();
    panel.setAttribute("aria-label", name);
    try {
      stop = (await VIEWS[name](id, panel, refreshHead)) || (() => {});
    } catch (e) {
      panel.replaceChildren(h("p.card", { role: "alert", text: `${e.code || "error"}: ${e.message}` }));
    }
  };
  const addTab = (name, label) => tabs.append(h("button.tab", { type: "button", role: "tab", "data-tab": name, text: label,
    "aria-controls": "panel", on: { click: () => show(name) } }));
  for (const [name, label] of TABS) addTab(name, label);
  // The desktop, when the sandbox serves noVNC (the desktop template does, on its port 6080).
  if (sb.state === "running") {
    get(`/v1/sandboxes/${encodeURIComponent(id)}/ports`).then((r) => {
      if (r.ports.some((p) => p.port === NOVNC_PORT && p.listening && p.reachable)) addTab("desktop", "Desktop");
    }).catch(() => {});
  }
  tabs.addEventListener("keydown", (ev) => {
    const all = [...tabs.children];
    const i = all.indexOf(document.activeElement);
    if (i < 0 || (ev.key !== "ArrowRight" && ev.key !== "ArrowLeft")) return;
    const next = all[(i + (ev.key === "ArrowRight" ? 1 : all.length - 1)) % all.length];
    next.focus();
    next.click();
  });
  onLeave(() => stop());
  page(`Sandbox ${sb.id}`, head, tabs, panel);
  await refreshHead();
  await show(location.hash.includes("?tab=") ? location.hash.split("?tab=")[1] : "terminal");
}

// --- files -----------------------------------------------------------------------------------------------------

function filesView(id, panel) {
  const base = `/v1/sandboxes/${encodeURIComponent(id)}/files`;
  let cwd = "/root";
  const pathIn = h("input", { name: "path", value: cwd });
  const list = h("div");
  const viewer = h("div");
  const upload = h("input", { type: "file", name: "upload", multiple: true });
  const join = (dir, name) => (dir.endsWith("/") ? dir : dir + "/") + name;
  const load = async (dir) => {
    const r = await get(`${base}/list`, { path: dir });
    cwd = dir;
    pathIn.value = dir;
    const parent = dir.replace(/\/[^/]+\/?$/, "") || "/";
    const rows = r.entries.slice().sort((a, b) => (a.type === b.type ? a.name.localeCompare(b.name) : a.type === "dir" ? -1 : 1));
    list.replaceChildren(table(`Files in ${dir}`, [
      ["Name", (e) => (e.type === "dir"
        ? h("button.link", { type: "button", text: e.name + "/", on: { click: () => load(e.path) } })
        : h("button.link", { type: "button", text: e.name, on: { click: () => view(e) } }))],
      ["Size", (e) => (e.type === "dir" ? "" : bytes(e.size))],
      ["Modified", (e) => when(new Date(e.mtime * 1000).toISOString())],
      ["", (e) => (e.type === "dir" ? "" : h("a", { href: `${base}?${new URLSearchParams({ path: e.path })}`, download: e.name, text: "Download" }))],
    ], rows, (e) => ({ "data-file": e.name })));
    if (dir !== "/") list.prepend(h("button.link", { type: "button", text: "↑ parent", on: { click: () => load(parent) } }));
  };
  const view = async (e) => {
    if (e.size > 1048576) {
      viewer.replaceChildren(h("p.muted", { text: `${e.name} is ${bytes(e.size)}: download it instead.` }));
      return;
    }
    const text = await (await call("GET", base, { query: { path: e.path }, raw: true })).text();
    const area = h("textarea.code", { "aria-label": `Contents of ${e.path}`, value: text, rows: 16 });
    viewer.replaceChildren(h("h2", { text: e.path }), area, h("button", { type: "button", text: "Save", on: {
      click: (ev) => act(ev.currentTarget, () => call("PUT", base, { query: { path: e.path }, body: area.value }), "saved"),
    } }));
  };
  upload.addEventListener("change", async () => {
    for (const f of upload.files) {
      await act(null, () => call("PUT", base, { query: { path: join(cwd, f.name) }, body: f }), `uploaded ${f.name}`);
    }
    upload.value = "";
    load(cwd);
  });
  const go = h("form.inline", { on: { submit: (ev) => { ev.preventDefault(); act(null, () => load(pathIn.value)); } } },
    field("Path", pathIn), h("button", { type: "submit", text: "Open" }), field("Upload files", upload));
  panel.append(go, list, viewer);
  return load(cwd).then(() => undefined);
}

// --- ports ----------------------------------------------------------------------------------------------------

async function portsView(id, panel) {
  const r = await get(`/v1/sandboxes/${encodeURIComponent(id)}/ports`);
  const link = (p) => h("button.link", { type: "button", text: "Preview", on: { click: async () => {
    const u = await act(null, () => get(`/v1/sandboxes/${encodeURIComponent(id)}/ports/${p.port}/url`));
    if (u && u.url) window.open(u.url, "_blank", "noopener");
  } } });
  panel.append(table("Open ports", [["Port", (p) => p.port], ["Listening", (p) => (p.listening ? "yes" : "no")],
    ["Public", (p) => (p.public ? "yes" : "no")], ["Addresses", (p) => (p.addresses || []).join(", ")], ["", link]], r.ports));
}

// --- snapshots as a tree ------------------------------------------------------------------------------------------

const FORKS_KEY = "podbay-console-forks";
const forksOf = () => JSON.parse(sessionStorage.getItem(FORKS_KEY) || "{}");

async function snapshotsView(id, panel, refreshHead) {
  const enc = encodeURIComponent(id);
  const tree = h("div.tree", { id: "snapshot-tree" });
  const diffOut = h("div", { id: "snapshot-diff", "aria-live": "polite" });
  const selected = new Set();
  let known = [];
  const compare = async () => {
    const two = known.filter((s) => selected.has(s.id)).sort((x, y) => x.created_at.localeCompare(y.created_at));
    if (two.length !== 2) {
      toast("choose two snapshots to compare", true);
      return;
    }
    const d = await act(null, () => get(`/v1/sandboxes/${enc}/snapshots/${two[0].id}/diff/${two[1].id}`));
    if (!d) return;
    diffOut.replaceChildren(h("h2", { text: `${two[0].id} → ${two[1].id}` }),
      h("p.muted", { text: `${d.added} added · ${d.changed} changed · ${d.removed ?? 0} removed${d.truncated ? " (list truncated)" : ""}` }),
      table("Changed paths", [["Path", (e) => h("code", { text: e.path })], ["Change", (e) => e.change], ["Kind", (e) => e.kind],
        ["Size", (e) => bytes(e.size)]], d.entries, (e) => ({ "data-path": e.path })));
  };
  const load = async () => {
    const { snapshots } = await get(`/v1/sandboxes/${enc}/snapshots`);
    known = snapshots;
    const forks = forksOf();
    const byParent = new Map();
    const ids = new Set(snapshots.map((s) => s.id));
    for (const s of snapshots) {
      const p = s.parent_id && ids.has(s.parent_id) ? s.parent_id : "";
      if (!byParent.has(p)) byParent.set(p, []);
      byParent.get(p).push(s);
    }
    const node = (s) => h("li", { "data-snapshot": s.id },
      h("div.node", {},
        h("input", { type: "checkbox", "aria-label": `Compare ${s.id}`, checked: selected.has(s.id), disabled: s.state !== "ready",
          on: { change: (ev) => (ev.currentTarget.checked ? selected.add(s.id) : selected.delete(s.id)) } }),
        h("code", { text: s.id }), h("span.state", { "data-state": s.state, text: s.state }),
        h("span.muted", { text: `${s.kind} · ${when(s.created_at)}${s.size_bytes ? " · " + bytes(s.size_bytes) : ""}` }),
        h("button", { type: "button", text: "Roll back", "aria-label": `Roll back to ${s.id}`, disabled: s.state !== "ready",
          on: { click: (ev) => confirm(`Roll ${id} back to ${s.id}?`) && act(ev.currentTarget,
            () => post(`/v1/sandboxes/${enc}/restore`, { snapshot_id: s.id }, { wait: false }), "rolling back").then(refreshHead) } }),
        h("button", { type: "button", text: "Fork", "aria-label": `Fork from ${s.id}`, disabled: s.state !== "ready",
          on: { click: async (ev) => {
            const r = await act(ev.currentTarget, () => post(`/v1/sandboxes/${enc}/fork`, { snapshot_id: s.id, count: 1 }, { wait: false }), "forking");
            if (r) {
              const all = forksOf();
              all[s.id] = [...(all[s.id] || []), ...r.children.map((c) => c.id || c.sandbox_id)];
              sessionStorage.setItem(FORKS_KEY, JSON.stringify(all));
              load();
            }
          } } })),
      (forks[s.id] || []).length ? h("ul.forks", {}, forks[s.id].map((c) => h("li", { "data-child": c }, "fork → ", h("a", { href: `#/sandboxes/${c}`, text: c })))) : null,
      byParent.has(s.id) ? h("ul", {}, byParent.get(s.id).map(node)) : null);
    tree.replaceChildren(snapshots.length ? h("ul", { role: "tree" }, (byParent.get("") || []).map(node)) : h("p.muted", { text: "No snapshots yet." }));
  };
  const kind = h("select", { name: "kind" }, h("option", { value: "full", text: "full (memory + disk)" }), h("option", { value: "disk", text: "disk only" }));
  panel.append(h("form.inline", { on: { submit: async (ev) => {
    ev.preventDefault();
    await act(ev.submitter, () => post(`/v1/sandboxes/${enc}/snapshots`, { kind: kind.value }, { wait: true }), "snapshot taken");
    load();
  } } }, field("Kind", kind), h("button.primary", { type: "submit", text: "Snapshot now" }),
  h("button", { type: "button", text: "Compare selected", on: { click: compare } })), tree, diffOut);
  await load();
  const t = setInterval(() => load().catch(() => {}), 5000);
  return () => clearInterval(t);
}

// --- events -----------------------------------------------------------------------------------------------------

async function eventsView(id, panel) {
  const list = h("ol.events", { "aria-live": "polite" });
  panel.append(h("p", {}, h("a", { href: `#/audit?sandbox_id=${encodeURIComponent(id)}`, text: "Audit log of this sandbox" })), list);
  const abort = new AbortController();
  const add = (e) => list.prepend(h("li", {}, h("span.muted", { text: when(e.at) + " " }), h("strong", { text: e.type }),
    e.state ? ` → ${e.state}` : ""));
  followNdjson("/v1/events", { sandbox: id, follow: true }, add, abort.signal)
    .catch((e) => { if (!abort.signal.aborted) toast(`events: ${e.message}`, true); });
  return () => abort.abort();
}

// xterm.js is most of the shipped script: loaded only when a terminal opens.
const terminalView = async (id, panel) => (await import("./terminal.js")).terminalView(id, panel);

const VIEWS = { terminal: terminalView, files: filesView, processes: processesView, ports: portsView, snapshots: snapshotsView,
  resources: resourcesView, network: networkView, schedules: schedulesView, events: eventsView, desktop: desktopView };
