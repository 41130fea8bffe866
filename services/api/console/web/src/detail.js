// More views of one sandbox: processes, egress policy, schedules, resource graphs, the desktop (noVNC).
// Every call is the public API with the session cookie, except the resource samples (/console/.../metrics).
import { call, get, post } from "./api.js";
import { act, bytes, field, h, table, toast, when } from "./ui.js";

const enc = encodeURIComponent;

// --- processes ----------------------------------------------------------------------------------------------

// procps' ps (in every podbay guest) with fixed columns: pid, ppid, user, %cpu, rss (KiB), elapsed s, command.
const PS = "ps -eo pid=,ppid=,user=,pcpu=,rss=,etimes=,args= --sort=pid";

export function parsePs(stdout) {
  const out = [];
  for (const line of stdout.split("\n")) {
    const m = line.trim().match(/^(\d+)\s+(\d+)\s+(\S+)\s+([\d.]+)\s+(\d+)\s+(\d+)\s+(.*)$/);
    if (m) out.push({ pid: Number(m[1]), ppid: Number(m[2]), user: m[3], cpu: Number(m[4]), rss: Number(m[5]) * 1024,
      elapsed: Number(m[6]), args: m[7] });
  }
  return out;
}

const duration = (s) => (s >= 86400 ? `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`
  : s >= 3600 ? `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m` : s >= 60 ? `${Math.floor(s / 60)}m ${s % 60}s` : `${s}s`);

export async function processesView(id, panel) {
  const list = h("div", { "aria-live": "polite" });
  const exec = (body) => post(`/v1/sandboxes/${enc(id)}/exec`, { ...body, timeout_s: 20 });
  const load = async () => {
    const r = await exec({ shell: PS });
    // The listing's own shell and ps are left out: they are gone by the time the table shows.
    const procs = parsePs(r.stdout).filter((p) => !p.args.startsWith("ps -eo ") && p.args !== `/bin/sh -c ${PS}`);
    list.replaceChildren(table(`${procs.length} processes`, [
      ["PID", (p) => String(p.pid)], ["Parent", (p) => String(p.ppid)], ["User", (p) => p.user], ["CPU %", (p) => p.cpu.toFixed(1)],
      ["Memory", (p) => bytes(p.rss)], ["Running for", (p) => duration(p.elapsed)], ["Command", (p) => h("code", { text: p.args })],
      ["", (p) => (p.pid === 1 ? "" : h("button.danger", { type: "button", text: "Kill", "aria-label": `Kill process ${p.pid}`,
        on: { click: (ev) => confirm(`Kill process ${p.pid} (${p.args.slice(0, 60)})?`) && act(ev.currentTarget, async () => {
          const k = await exec({ argv: ["kill", "-KILL", String(p.pid)] });
          if (k.exit_code !== 0) throw Object.assign(new Error(k.stderr.trim() || `kill exited ${k.exit_code}`), { code: "kill_failed" });
        }, `killed ${p.pid}`).then(load) } }))],
    ], procs, (p) => ({ "data-pid": String(p.pid) })));
  };
  panel.append(h("div.inline", {}, h("button", { type: "button", text: "Refresh", on: { click: (ev) => act(ev.currentTarget, load) } })), list);
  await load();
}

// --- egress policy --------------------------------------------------------------------------------------------

export async function networkView(id, panel) {
  const url = `/v1/sandboxes/${enc(id)}/network`;
  const source = h("p.muted", { id: "egress-source" });
  const rules = h("div");
  const area = h("textarea.code", { rows: 10, name: "policy", spellcheck: "false" });
  const show = (info) => {
    source.textContent = {
      sandbox: "This sandbox's own policy.", template: "The template's default policy (saving here gives the sandbox its own).",
      default: "No policy: nothing is allowed out (saving here gives the sandbox its own).",
    }[info.source] || info.source;
    area.value = JSON.stringify(info.policy, null, 2);
    const row = (kind) => (r) => ({ kind, what: r.domain || r.cidr || "", ports: (r.ports || []).join(", ") || "any" });
    rules.replaceChildren(table("Egress rules", [["Rule", (r) => r.kind], ["Domain or network", (r) => h("code", { text: r.what })],
      ["Ports", (r) => r.ports]], [...(info.policy.allow || []).map(row("allow")), ...(info.policy.deny || []).map(row("deny"))],
    (r) => ({ "data-rule": `${r.kind} ${r.what}` })));
  };
  const save = (policy) => call("PUT", url, { json: policy }).then(show);
  const domain = h("input", { name: "domain", placeholder: "api.example.com or *.example.com" });
  const port = h("input", { name: "port", type: "number", min: 1, max: 65535, placeholder: "any" });
  const addForm = h("form.inline", { on: { submit: async (ev) => {
    ev.preventDefault();
    const policy = JSON.parse(area.value);
    policy.allow = [...(policy.allow || []), { domain: domain.value.trim(), ...(port.value ? { ports: [Number(port.value)] } : {}) }];
    if (await act(ev.submitter, () => save(policy), "egress policy saved") !== undefined) addForm.reset();
  } } }, field("Allow domain", domain), field("Port", port), h("button.primary", { type: "submit", text: "Allow" }));
  const editForm = h("form", { on: { submit: async (ev) => {
    ev.preventDefault();
    let policy;
    try {
      policy = JSON.parse(area.value);
    } catch (e) {
      toast(`not JSON: ${e.message}`, true);
      return;
    }
    await act(ev.submitter, () => save(policy), "egress policy saved");
  } } }, field("Policy (JSON: allow, deny, transforms)", area), h("button.primary", { type: "submit", text: "Save policy" }));
  panel.append(source, rules, addForm, editForm);
  show(await get(url));
}

// --- schedules --------------------------------------------------------------------------------------------------

export async function schedulesView(id, panel) {
  const base = `/v1/sandboxes/${enc(id)}/schedules`;
  const list = h("div", { "aria-live": "polite" });
  const load = async () => {
    const { schedules } = await get(base);
    list.replaceChildren(table("Schedules", [
      ["When", (s) => (s.cron ? h("code", { text: `${s.cron} (${s.tz})` }) : `once at ${when(s.at)}`)],
      ["Command", (s) => (s.command ? h("code", { text: s.command.argv.join(" ") }) : "wake only")],
      ["Awake after", (s) => `${s.awake_s} s`], ["Next", (s) => when(s.next_fire_at) || "—"],
      ["Last run", (s) => (s.last_run ? h("span.state", { "data-state": s.last_run.state, text: `${s.last_run.state} ${when(s.last_run.fire_at)}` }) : "—")],
      ["", (s) => h("button.danger", { type: "button", text: "Delete", "aria-label": `Delete schedule ${s.id}`,
        on: { click: (ev) => confirm(`Delete schedule ${s.id}?`) && act(ev.currentTarget, () => call("DELETE", `${base}/${enc(s.id)}`), "deleted").then(load) } })],
    ], schedules, (s) => ({ "data-schedule": s.id })));
  };
  const cron = h("input", { name: "cron", required: true, placeholder: "*/15 * * * *", spellcheck: "false" });
  const tz = h("input", { name: "tz", value: "UTC" });
  const cmd = h("input", { name: "command", placeholder: "a shell command; empty: only wake the sandbox", spellcheck: "false" });
  const form = h("form.inline.card", { on: { submit: async (ev) => {
    ev.preventDefault();
    const body = { cron: cron.value.trim(), tz: tz.value.trim() || "UTC",
      ...(cmd.value.trim() ? { command: { argv: ["/bin/sh", "-c", cmd.value] } } : {}) };
    if (await act(ev.submitter, () => post(base, body), "schedule added") !== undefined) {
      cron.value = "";
      cmd.value = "";
      load();
    }
  } } }, field("Cron (minute hour day month weekday)", cron), field("Time zone", tz), field("Command", cmd),
  h("button.primary", { type: "submit", text: "Add schedule" }));
  panel.append(form, list);
  await load();
}

// --- resource graphs ------------------------------------------------------------------------------------------

// One small line chart (inline SVG): values 0..max over the samples' times, with the newest value as text.
function chart(name, label, samples, value, max, fmt) {
  const W = 360, H = 90;
  const pts = samples.map((s) => [s.timestampUnix, Math.max(0, Math.min(1, value(s) / (max(s) || 1)))]);
  const t0 = pts.length ? pts[0][0] : 0;
  const span = Math.max(1, (pts.length ? pts[pts.length - 1][0] : 0) - t0);
  const poly = pts.map(([t, v]) => `${(((t - t0) / span) * W).toFixed(1)},${(H - v * H).toFixed(1)}`).join(" ");
  const last = samples[samples.length - 1];
  const now = last ? fmt(last) : "no samples yet";
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", `${label}: ${now}`);
  svg.setAttribute("data-metric", name);
  svg.setAttribute("data-points", String(pts.length));
  const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
  line.setAttribute("points", poly);
  svg.append(line);
  return h("figure.chart", {}, svg, h("figcaption", {}, h("strong", { text: label }), ` ${now}`));
}

export async function resourcesView(id, panel) {
  const out = h("div.charts");
  const note = h("p.muted", { text: "Sampled every 2 s while this view is open (the newest 360 samples are kept)." });
  panel.append(note, out);
  let samples = [];
  const pct = (n) => `${n.toFixed(1)}%`;
  const draw = () => out.replaceChildren(
    chart("cpu", "CPU", samples, (s) => s.cpuUsedPct, () => 100, (s) => `${pct(s.cpuUsedPct)} of ${s.cpuCount} vCPU`),
    chart("memory", "Memory", samples, (s) => s.memUsed, (s) => s.memTotal, (s) => `${bytes(s.memUsed)} of ${bytes(s.memTotal)}`),
    chart("disk", "Disk", samples, (s) => s.diskUsed, (s) => s.diskTotal, (s) => `${bytes(s.diskUsed)} of ${bytes(s.diskTotal)}`));
  const load = async () => {
    samples = await get(`/console/sandboxes/${enc(id)}/metrics`);
    draw();
  };
  await load().catch((e) => { draw(); note.textContent = `${e.code || "error"}: ${e.message}`; });
  const t = setInterval(() => load().catch(() => {}), 2000);
  return () => clearInterval(t);
}

// --- desktop ---------------------------------------------------------------------------------------------------

// The desktop template's noVNC port (templates/desktop/start-desktop.sh: websockify --web /usr/share/novnc 6080).
export const NOVNC_PORT = 6080;

export async function desktopView(id, panel) {
  // The guest's own noVNC page on the port's host form ({port}-{id}.{ports_domain}): an origin of its own, so
  // nothing the guest serves runs beside this console's session (the path form is on the API's own origin, where
  // a guest page's scripts could call the API with the session; a sandboxed frame cannot keep the port's
  // cookie). Its traffic token is exchanged once for that host's cookie; noVNC's WebSocket goes to websockify.
  const u = await get(`/v1/sandboxes/${enc(id)}/ports/${NOVNC_PORT}/url`);
  const q = new URLSearchParams({ autoconnect: "1", resize: "scale", reconnect: "1", podbay_token: u.token });
  const href = `${u.url.replace(/\/$/, "")}/vnc.html?${q}`;
  panel.append(h("p", {}, "The sandbox's screen through noVNC (served by the sandbox), in a tab of its own: ",
    h("a.button", { id: "desktop-link", href, target: "_blank", rel: "noopener noreferrer", text: "Open the desktop" })),
  h("p.muted", { text: `Host: ${new URL(u.url).host}. It needs a name that resolves to the API (the ports domain, ` +
    "*.localhost with the dev stack)." }));
}
