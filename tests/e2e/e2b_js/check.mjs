// E2B's JavaScript SDK (the `e2b` npm package, unmodified) against podbay, as a Node program would use it.
// Run by tests/e2e/test_e2b_js.py with E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY pointing at the stack
// (docs/e2b.md). Each step prints one JSON line {"step": ..., "value": ...} (or {"step", "error"}); the
// assertions live in the Python test, so this script only reports what the SDK returned.
import { Sandbox } from 'e2b'

const steps = (process.env.E2B_JS_STEPS || 'run,files,pty,pause,fork,snapshot').split(',')
const made = []

function report(step, value) {
  console.log(JSON.stringify({ step, value }))
}

async function attempt(step, fn) {
  if (!steps.includes(step)) return
  try {
    report(step, await fn())
  } catch (err) {
    console.log(JSON.stringify({ step, error: `${err?.name}: ${err?.message}` }))
  }
}

const sbx = await Sandbox.create('base', { timeoutMs: 600_000 })
made.push(sbx)
try {
  await attempt('run', async () => {
    const r = await sbx.commands.run('echo hi; whoami; echo err >&2')
    return { stdout: r.stdout, stderr: r.stderr, exitCode: r.exitCode }
  })
  await attempt('files', async () => {
    await sbx.files.write('/tmp/js/note.txt', 'from js')
    const text = await sbx.files.read('/tmp/js/note.txt')
    const names = (await sbx.files.list('/tmp/js')).map((e) => e.name)
    return { text, names }
  })
  await attempt('pty', async () => {
    let out = ''
    const decoder = new TextDecoder()
    const pty = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => { out += decoder.decode(d) } })
    await sbx.pty.sendInput(pty.pid, new TextEncoder().encode('echo pty-$((6*7))\nexit\n'))
    const end = await pty.wait().catch((e) => e)
    return { output: out, exitCode: end?.exitCode ?? null }
  })
  await attempt('pause', async () => {
    await sbx.files.write('/tmp/js/before-pause.txt', 'kept')
    const paused = await sbx.pause()
    const again = await Sandbox.connect(sbx.sandboxId)
    const r = await again.commands.run('cat /tmp/js/before-pause.txt')
    return { paused, stdout: r.stdout }
  })
  await attempt('fork', async () => {
    const children = await Sandbox.fork(sbx.sandboxId, { count: 2, timeoutMs: 300_000 })
    const out = []
    for (const child of children) {
      if (child instanceof Error) { out.push({ error: `${child.name}: ${child.message}` }); continue }
      made.push(child)
      const r = await child.commands.run('cat /tmp/js/note.txt')
      out.push({ id: child.sandboxId, stdout: r.stdout })
    }
    return { parent: sbx.sandboxId, children: out }
  })
  await attempt('snapshot', async () => {
    const snap = await sbx.createSnapshot()
    const fromSnap = await Sandbox.create(snap.snapshotId, { timeoutMs: 300_000 })
    made.push(fromSnap)
    const r = await fromSnap.commands.run('cat /tmp/js/note.txt')
    const listed = []
    for (const p = Sandbox.listSnapshots(); p.hasNext;) listed.push(...(await p.nextItems()).map((s) => s.snapshotId))
    const deleted = await Sandbox.deleteSnapshot(snap.snapshotId)
    return { snapshotId: snap.snapshotId, stdout: r.stdout, listed: listed.includes(snap.snapshotId), deleted }
  })
  // Not among the default steps: run with the exports of `podbay env --e2b` (E2B_DOMAIN, NODE_EXTRA_CA_CERTS).
  await attempt('host', async () => {
    await sbx.commands.run('mkdir -p /tmp/jsweb && echo js-tls > /tmp/jsweb/index.html && (setsid python3 -m ' +
      'http.server 8001 --bind 0.0.0.0 --directory /tmp/jsweb >/dev/null 2>&1 </dev/null &)')
    const host = sbx.getHost(8001)
    let last = null
    for (let i = 0; i < 120; i++) {
      try {
        const r = await fetch(`https://${host}/index.html`)
        if (r.ok) return { host, status: r.status, text: await r.text() }
        last = r.status
      } catch (err) {
        last = `${err?.name}: ${err?.cause?.code ?? err?.message}`
      }
      await new Promise((resolve) => setTimeout(resolve, 500))
    }
    return { host, status: last }
  })
} finally {
  for (const s of made) await s.kill().catch(() => {})
}
report('done', true)
