// A tiny DOM helper: h("tag.class", {attrs, on: {event: fn}}, ...children).

export function h(spec, attrs, ...children) {
  if (attrs === null || typeof attrs !== "object" || attrs instanceof Node || Array.isArray(attrs)) {
    children.unshift(attrs);
    attrs = {};
  }
  const [tag, ...classes] = spec.split(".");
  const el = document.createElement(tag || "div");
  if (classes.length) el.className = classes.join(" ");
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "on") for (const [ev, fn] of Object.entries(v)) el.addEventListener(ev, fn);
    else if (k === "text") el.textContent = v;
    else if (k in el && typeof v !== "string") el[k] = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children) {
    if (c === null || c === undefined || c === false) continue;
    if (Array.isArray(c)) append(el, c);
    else el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

export function toast(message, bad = false) {
  const t = document.getElementById("toast");
  t.textContent = message;
  t.className = bad ? "show bad" : "show";
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => (t.className = ""), 4000);
}

// Runs an action from a button: disables it meanwhile, reports errors.
export async function act(button, fn, done) {
  if (button) button.disabled = true;
  try {
    const r = await fn();
    if (done) toast(done);
    return r;
  } catch (e) {
    toast(`${e.code || "error"}: ${e.message}`, true);
    return undefined;
  } finally {
    if (button) button.disabled = false;
  }
}

export function when(iso) {
  if (!iso) return "";
  const d = new Date(iso);
  return d.toLocaleString(undefined, { dateStyle: "short", timeStyle: "medium" });
}

export function bytes(n) {
  if (n === null || n === undefined) return "";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${u[i]}`;
}

// A table with a caption (for screen readers) and one row per item.
export function table(caption, columns, rows, rowAttrs) {
  return h("table", {},
    h("caption", { text: caption }),
    h("thead", {}, h("tr", {}, columns.map(([label]) => h("th", { scope: "col", text: label })))),
    h("tbody", {}, rows.length
      ? rows.map((r) => h("tr", rowAttrs ? rowAttrs(r) : {}, columns.map(([, cell]) => h("td", {}, cell(r)))))
      : h("tr", {}, h("td.muted", { colSpan: columns.length, text: "Nothing here yet." }))));
}

export function field(label, input) {
  const id = "f-" + Math.random().toString(36).slice(2, 9);
  input.id = id;
  return h("div.field", {}, h("label", { for: id, text: label }), input);
}

export const firstArray = (obj) => Object.values(obj || {}).find(Array.isArray) || [];
