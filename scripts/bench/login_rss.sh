#!/usr/bin/env bash
# RSS of a spindle process before and after N concurrent logins (issue 17 item 1).
#
# Usage: scripts/bench/login_rss.sh BINARY [N] [EXTRA_TOML]
#   BINARY      the spindle executable to measure
#   N           concurrent logins (default 200; half with a wrong password)
#   EXTRA_TOML  appended to the generated config (e.g. "[password_hashing]\npool_size = 4")
# Prints one line per phase: phase, RSS in MiB, and the statuses of the logins.
# Talks to 127.0.0.1 only; stops the server it started.
set -euo pipefail
BIN="$1"; N="${2:-200}"; EXTRA="${3:-}"
WORK="$(mktemp -d)"
trap 'kill "$PID" 2>/dev/null || true; rm -rf "$WORK"' EXIT
PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
printf 'server_name = "localhost:%s"\nbind = "127.0.0.1:%s"\ndata_dir = "%s/data"\nlog = "warn"\n[registration]\nmode = "open"\n%b\n' \
    "$PORT" "$PORT" "$WORK" "$EXTRA" > "$WORK/spindle.toml"
# The old binary (before [rate_limits]) refuses unknown sections; only append when asked.
"$BIN" --config "$WORK/spindle.toml" 2>"$WORK/stderr" &
PID=$!
BASE="http://127.0.0.1:$PORT"
for _ in $(seq 100); do curl -s "$BASE/_matrix/client/versions" >/dev/null && break; sleep 0.1; done
rss() { awk '/VmRSS/ {printf "%.1f", $2/1024}' "/proc/$PID/status"; }
echo "idle: $(rss) MiB"
curl -s -X POST "$BASE/_matrix/client/v3/register" -H 'content-type: application/json' \
    -d '{"username":"bench","password":"bench-password","auth":{"type":"m.login.dummy"}}' >/dev/null
echo "after 1 registration: $(rss) MiB"
for i in $(seq "$N"); do
    if [ $((i % 2)) = 0 ]; then PW=bench-password; else PW=wrong; fi
    curl -s -o /dev/null -w '%{http_code}\n' -X POST "$BASE/_matrix/client/v3/login" \
        -H 'content-type: application/json' \
        -d "{\"type\":\"m.login.password\",\"identifier\":{\"type\":\"m.id.user\",\"user\":\"bench\"},\"password\":\"$PW\"}" \
        >> "$WORK/codes" &
done
wait $(jobs -p | grep -v "^$PID$") 2>/dev/null || true
echo "after $N concurrent logins: $(rss) MiB; statuses: $(sort "$WORK/codes" | uniq -c | tr '\n' ' ')"
sleep 5
echo "5 s later: $(rss) MiB"
