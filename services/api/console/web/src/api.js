// The public API (/v1/...) with the session cookie; every change carries the session's CSRF token.

let csrf = "";
export let session = null;

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export function setSession(info) {
  session = info;
  csrf = info ? info.csrf_token : "";
}

export async function call(method, path, { json, body, headers = {}, raw = false, query } = {}) {
  const h = { ...headers };
  if (method !== "GET" && method !== "HEAD") h["X-CSRF-Token"] = csrf;
  if (json !== undefined) {
    h["Content-Type"] = "application/json";
    body = JSON.stringify(json);
  }
  let url = path;
  if (query) {
    const q = new URLSearchParams();
    for (const [k, v] of Object.entries(query)) {
      if (v === undefined || v === null || v === "") continue;
      for (const one of Array.isArray(v) ? v : [v]) q.append(k, String(one));
    }
    const s = q.toString();
    if (s) url += (url.includes("?") ? "&" : "?") + s;
  }
  const r = await fetch(url, { method, headers: h, body, credentials: "same-origin" });
  if (!r.ok) {
    let code = "http_" + r.status;
    let message = r.statusText;
    try {
      const e = (await r.json()).error;
      if (e) ({ code, message } = e);
    } catch { /* not JSON */ }
    if (r.status === 401 && !path.startsWith("/console/session")) location.hash = "#/signin";
    throw new ApiError(r.status, code, message);
  }
  if (raw) return r;
  if (r.status === 204) return null;
  const type = r.headers.get("content-type") || "";
  return type.includes("json") ? r.json() : r.text();
}

export const get = (path, query) => call("GET", path, { query });
export const post = (path, json, query) => call("POST", path, { json, query });
export const del = (path, query) => call("DELETE", path, { query });

// Lines of an NDJSON stream (GET /v1/events?follow=true), until `signal` aborts it.
export async function followNdjson(path, query, onItem, signal) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(query)) for (const one of Array.isArray(v) ? v : [v]) q.append(k, String(one));
  const r = await fetch(`${path}?${q}`, { credentials: "same-origin", signal });
  if (!r.ok) throw new ApiError(r.status, "stream", r.statusText);
  const reader = r.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, i).trim();
      buf = buf.slice(i + 1);
      if (line) onItem(JSON.parse(line));
    }
  }
}
