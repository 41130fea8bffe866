#!/usr/bin/env bash
# Prepare this checkout for development: Debian packages, then .venv with podbay installed editable: the client
# package (libs/pyproject.toml: SDK and CLI) and the server package (pyproject.toml: services, dev stack).
# Idempotent and quiet: it only installs what is missing, says in one line when it starts a step that
# installs something (they take minutes on a fresh checkout), and prints a step's output only when it fails.
# Run as root (or with sudo available) when Debian packages are missing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

DEB_PACKAGES=(
  qemu-system-x86 qemu-utils debootstrap btrfs-progs busybox-static e2fsprogs nftables iproute2
  libbtrfsutil-dev cpio zstd kmod bubblewrap ca-certificates
  skopeo umoci  # FROM an OCI image (services/nodeagent/build/oci.py reads with skopeo); umoci: tests make images
  prometheus  # only for promtool, which checks deploy/prometheus rules in the tests
  chromium  # the console's Playwright tests drive Debian's Chromium (never `playwright install`)
  libnss-myhostname  # *.localhost -> loopback for every program: the dev stack's E2B domain (e2b.localhost)
)

log="$(mktemp -t podbay-setup.XXXXXX)"
trap 'rm -f "$log"' EXIT

# run DESCRIPTION CMD...: say what starts, run CMD with its output in the log; on failure show the log and stop.
run() {
  local what="$1"; shift
  echo "setup: $what ..." >&2
  if ! "$@" >>"$log" 2>&1; then
    echo "setup: $what failed:" >&2
    tail -n 60 "$log" >&2
    exit 1
  fi
}

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    echo "setup: needs root to run: $*" >&2; return 1; fi
}

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

pick_python() {
  local candidate
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null &&
       "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
      command -v "$candidate"; return 0
    fi
  done
  return 1
}

missing=()
for pkg in "${DEB_PACKAGES[@]}"; do
  installed "$pkg" || missing+=("$pkg")
done
# The web console (services/api/console/web) is built with npm: Debian's nodejs and npm unless a Node.js with
# npm is already there (e.g. NodeSource's, whose nodejs package conflicts with Debian's npm).
if ! command -v npm >/dev/null || ! command -v node >/dev/null; then
  missing+=(nodejs npm)
fi
python="$(pick_python || true)"
if [ -z "$python" ]; then
  missing+=(python3.11 python3.11-venv)
elif ! "$python" -c 'import ensurepip, venv' 2>/dev/null; then
  # Debian splits venv/ensurepip out of its python3.11 package.
  missing+=(python3.11-venv)
fi
if [ "${#missing[@]}" -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  # A fresh machine's own package timers (unattended-upgrades, apt-daily) may hold dpkg's lock for a while:
  # wait for it rather than fail.
  apt_wait=(-o DPkg::Lock::Timeout=600)
  run "apt-get update" as_root apt-get "${apt_wait[@]}" update
  run "apt-get install ${missing[*]}" as_root apt-get "${apt_wait[@]}" install -y --no-install-recommends "${missing[@]}"
  # The prometheus package is here for promtool only: do not leave a server it just installed running.
  if [[ " ${missing[*]} " == *" prometheus "* ]] && [ -d /run/systemd/system ]; then
    as_root systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
  python="$(pick_python)"
fi

# The package adds `myhostname` to the hosts line of /etc/nsswitch.conf when it is installed; put it back where
# that line lost it, so that E2B's https://{port}-{sandboxID}.e2b.localhost names resolve (docs/operations.md).
if [ -f /etc/nsswitch.conf ] && ! grep -Eq '^hosts:.*[[:space:]]myhostname([[:space:]]|$)' /etc/nsswitch.conf; then
  run "adding myhostname to the hosts line of /etc/nsswitch.conf" \
    as_root sed -i -E '/^hosts:/ s/([[:space:]])files([[:space:]]|$)/\1files myhostname\2/' /etc/nsswitch.conf
fi

if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  rm -rf .venv
  run "creating .venv with $python" "$python" -m venv .venv
fi

# Reinstall only when the project metadata of either package changed since the last successful install.
stamp=.venv/.podbay-installed
want="$(cat pyproject.toml setup.py libs/pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! .venv/bin/python -c 'import podbay.config' 2>/dev/null; then
  run "pip install -e ./libs -e '.[test]'" \
    .venv/bin/python -m pip install --disable-pip-version-check -q -e ./libs -e '.[test]'
  echo "$want" >"$stamp"
fi

# The egress gateway runs from its own virtualenv: mitmproxy 11.0 (the last release for Python 3.11) pins
# h2<=4.1 while the test extra's e2b needs h2>=4.4.1, so the two cannot share .venv.
if [ ! -x .venv-gateway/bin/python ] ||
   ! .venv-gateway/bin/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  rm -rf .venv-gateway
  run "creating .venv-gateway with $python" "$python" -m venv .venv-gateway
fi
gstamp=.venv-gateway/.podbay-installed
if [ "$(cat "$gstamp" 2>/dev/null)" != "$want" ] || ! .venv-gateway/bin/python -c 'import podbay_gateway, mitmproxy' 2>/dev/null; then
  run "pip install -e ./libs -e '.[gateway]' into .venv-gateway" \
    .venv-gateway/bin/python -m pip install --disable-pip-version-check -q -e ./libs -e '.[gateway]'
  echo "$want" >"$gstamp"
fi

# The web console (services/api/console/web -> static/, served at /console): rebuilt only when its sources or
# package-lock.json changed since the last successful build. `npm ci` installs exactly the locked versions.
console_dir=services/api/console
cstamp=$console_dir/static/.built
cwant="$(cd "$console_dir/web" && cat package.json package-lock.json build.mjs index.html $(find src -type f | sort) \
  | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$cstamp" 2>/dev/null)" != "$cwant" ]; then
  if [ ! -d "$console_dir/web/node_modules" ] || [ "$console_dir/web/package-lock.json" -nt "$console_dir/web/node_modules" ]; then
    run "npm ci (web console)" npm --prefix "$console_dir/web" ci --no-audit --no-fund
    touch "$console_dir/web/node_modules"
  fi
  run "building the web console" npm --prefix "$console_dir/web" run build
  echo "$cwant" >"$cstamp"
fi
