// Builds the console into ../static: one bundled, minified script and stylesheet with content-hashed names,
// and index.html that names them. Run by scripts/setup.sh (`npm run build`) when the sources change.
import { build } from "esbuild";
import { mkdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { basename, dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const out = join(here, "..", "static");
rmSync(out, { recursive: true, force: true });
mkdirSync(join(out, "assets"), { recursive: true });

const result = await build({
  entryPoints: [join(here, "src", "main.js")],
  bundle: true,
  minify: true,
  format: "esm",
  splitting: true,
  target: ["chrome110", "firefox110", "safari16"],
  outdir: join(out, "assets"),
  entryNames: "[name]-[hash]",
  chunkNames: "[name]-[hash]",
  assetNames: "[name]-[hash]",
  metafile: true,
  legalComments: "none",
  logLevel: "warning",
});

const files = Object.keys(result.metafile.outputs).map((p) => basename(p));
const entry = Object.entries(result.metafile.outputs).find(([, o]) => o.entryPoint);
const js = basename(entry[0]);
const css = basename(entry[1].cssBundle);
const page = readFileSync(join(here, "index.html"), "utf8")
  .replace("%JS%", `/console/assets/${js}`)
  .replace("%CSS%", `/console/assets/${css}`);
writeFileSync(join(out, "index.html"), page);
console.log(`console built: ${files.join(", ")}`);
