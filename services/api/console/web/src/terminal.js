// The terminal: xterm.js over the WebSocket /v1/sandboxes/{id}/pty (services/api/console/pty.py).
import { FitAddon } from "@xterm/addon-fit";
import { Terminal } from "@xterm/xterm";
import { session } from "./api.js";
import { h } from "./ui.js";

export function terminalView(id, panel) {
  const box = h("div.term", { "aria-label": "Terminal" });
  const status = h("p.muted", { text: "connecting…" });
  panel.append(status, box);
  const term = new Terminal({ cursorBlink: true, fontSize: 14, convertEol: false, scrollback: 5000,
    theme: { background: "#111418", foreground: "#e6e6e6" } });
  const fit = new FitAddon();
  term.loadAddon(fit);
  term.open(box);
  fit.fit();
  window.__term = term;
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  const q = new URLSearchParams({ cols: term.cols, rows: term.rows, csrf: session.csrf_token });
  const ws = new WebSocket(`${proto}//${location.host}/v1/sandboxes/${encodeURIComponent(id)}/pty?${q}`);
  ws.binaryType = "arraybuffer";
  const enc = new TextEncoder();
  ws.onopen = () => { status.textContent = "connected"; term.focus(); };
  ws.onmessage = (ev) => term.write(new Uint8Array(ev.data));
  ws.onclose = (ev) => { status.textContent = `disconnected (${ev.code}${ev.reason ? " " + ev.reason : ""})`; };
  const d1 = term.onData((data) => ws.readyState === 1 && ws.send(enc.encode(data)));
  const d2 = term.onResize(({ cols, rows }) => ws.readyState === 1 && ws.send(JSON.stringify({ type: "resize", cols, rows })));
  const onWin = () => fit.fit();
  window.addEventListener("resize", onWin);
  return () => { window.removeEventListener("resize", onWin); d1.dispose(); d2.dispose(); ws.close(); term.dispose(); };
}

