#!/bin/sh
# The `desktop` template's start command: Xvfb on :0 (1280x720), matchbox (every window full screen), Chromium on the display with CDP
# (9223 on loopback, relayed on every guest address at 9222 as in `browser`), x11vnc on loopback 5900, and
# last websockify serving noVNC's page and the VNC WebSocket on 6080. 6080 listens only once the rest
# answers, so a readiness check on it (the template build's --ready-port) means the whole desktop is up.
# Everything runs as the `browser` user; the guest is the isolation boundary (templates/browser/Dockerfile).
set -u
GEOMETRY=1280x720
export DISPLAY=:0
as_browser() { runuser -u browser -- env DISPLAY=:0 HOME=/home/browser "$@"; }
wait_port() {  # wait_port PORT: until something accepts on 127.0.0.1:PORT (300 s at most)
    python3 -c 'import socket, sys, time
for _ in range(1500):
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[1])), 1).close(); sys.exit(0)
    except OSError:
        time.sleep(0.2)
sys.exit(1)' "$1"
}

swapon /swapfile 2>/dev/null
mkdir -p /tmp/.X11-unix && chmod 1777 /tmp/.X11-unix  # root-owned, as the X server expects
# -ac: no X access control, so that root's commands (exec: xdotool, screenshots) reach the display too;
# -nolisten tcp keeps it to the guest's local socket.
as_browser Xvfb :0 -screen 0 "${GEOMETRY}x24" -nolisten tcp -ac >/tmp/xvfb.log 2>&1 &
for _ in $(seq 300); do [ -S /tmp/.X11-unix/X0 ] && break; sleep 0.1; done
as_browser matchbox-window-manager -use_titlebar no >/tmp/wm.log 2>&1 &
as_browser python3 /usr/local/lib/podbay/cdp-forward.py 9222 9223 &
# --kiosk: one full-screen window without browser frame, so the page's viewport is the whole screen (the API's
# screenshot is the desktop's size); --test-type drops the "unsupported flag" bar that --no-sandbox brings.
as_browser chromium --kiosk --test-type --no-sandbox --no-zygote --disable-gpu --disable-dev-shm-usage \
    --no-first-run --no-default-browser-check --disable-extensions --disable-background-networking \
    --disable-component-update --disable-sync --mute-audio --renderer-process-limit=2 \
    --window-position=0,0 --window-size=1280,720 --user-data-dir=/home/browser/.chromium \
    --remote-debugging-port=9223 about:blank >/tmp/chromium.log 2>&1 &
as_browser x11vnc -display :0 -rfbport 5900 -localhost -forever -shared -nopw -quiet >/tmp/x11vnc.log 2>&1 &
wait_port 9223 && wait_port 5900
exec runuser -u browser -- websockify --web /usr/share/novnc 6080 127.0.0.1:5900
