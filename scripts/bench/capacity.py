#!/usr/bin/env python3
"""Send capacity with a native load generator: wrk, one connection per client, each
client its own user in its own room (the driver's concurrency dimension, without a
Python client sharing the two cores under test).

The driver's `concurrency` dimension runs its clients as Python threads: at about
2,000 sends/s they take half a core and hold the GIL, so it measures the client as
much as the server. This script registers N users, gives each a room, and runs
`wrk -t N -c N` with scripts/bench/wrk_send.lua for each client count; it prints and
writes sends/s, wrk's latency percentiles, non-2xx answers, and the server's CPU share
and RSS over the run (from /proc, when --pid is given).

Usage: capacity.py --base http://127.0.0.1:8008 [--clients 1,2,4,8] [--duration 10]
                   [--pid PID] [--out FILE]
Needs: wrk (Debian: apt-get install wrk).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid


def call(base, method, path, body=None, token=None):
    """(status, JSON body) of one request; HTTP errors are answers, not exceptions."""
    req = urllib.request.Request(base + path, method=method,
                                 data=json.dumps(body).encode() if body is not None else None)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", "Bearer " + token)
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def register(base):
    """An account by the UIA dance a client does (ask, read the session, answer the
    dummy stage), as the driver registers: Synapse and Tuwunel want the session."""
    body = {"username": f"cap{uuid.uuid4().hex[:8]}", "password": "capacity-pw-123"}
    status, v = call(base, "POST", "/_matrix/client/v3/register", body)
    if status == 401 and "session" in v:
        body["auth"] = {"type": "m.login.dummy", "session": v["session"]}
        status, v = call(base, "POST", "/_matrix/client/v3/register", body)
    if status != 200:
        sys.exit(f"register -> {status}: {v}")
    return v["access_token"]


def proc_cpu_s(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_mib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


def ms(value, unit):
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def parse_wrk(out):
    res = {}
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    res["per_s"] = float(m.group(1)) if m else None
    m = re.search(r"(\d+) requests in", out)
    res["requests"] = int(m.group(1)) if m else None
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    res["non_2xx"] = int(m.group(1)) if m else 0
    m = re.search(r"Socket errors: (.*)", out)
    res["socket_errors"] = m.group(1).strip() if m else ""
    for p in ("50", "75", "90", "99"):
        m = re.search(rf"^\s+{p}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        res[f"p{p}_ms"] = ms(m.group(1), m.group(2)) if m else None
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="http://127.0.0.1:8008")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--duration", type=int, default=10, help="seconds per client count")
    ap.add_argument("--pid", type=int, help="server pid, for CPU share and RSS")
    ap.add_argument("--label", default="server")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    pairs = []
    for _ in range(max(levels)):
        tok = register(args.base)
        status, v = call(args.base, "POST", "/_matrix/client/v3/createRoom",
                         {"preset": "private_chat"}, tok)
        if status != 200:
            sys.exit(f"createRoom -> {status}: {v}")
        pairs.append((tok, v["room_id"]))
    rooms = tempfile.NamedTemporaryFile("w", suffix=".rooms", delete=False)
    rooms.write("".join(f"{t} {r}\n" for t, r in pairs))
    rooms.close()
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wrk_send.lua")
    results = {"label": args.label, "base": args.base, "duration_s": args.duration,
               "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "load_before": list(os.getloadavg()), "levels": []}
    for c in levels:
        before = (proc_cpu_s(args.pid), time.time()) if args.pid else None
        out = subprocess.run(
            ["wrk", f"-t{c}", f"-c{c}", f"-d{args.duration}s", "--latency", "-s", script,
             args.base],
            env={**os.environ, "WRK_ROOMS": rooms.name},
            capture_output=True, text=True, check=True).stdout
        r = {"clients": c, **parse_wrk(out)}
        if args.pid:
            cpu, t = proc_cpu_s(args.pid), time.time()
            r["server_cpu_share"] = round((cpu - before[0]) / (t - before[1]), 3)
            r["server_rss_mib"] = proc_rss_mib(args.pid)
        results["levels"].append(r)
        print(f"{c} clients: {r['per_s']:.0f} sends/s, p50 {r['p50_ms']:.2f} ms, "
              f"p99 {r['p99_ms']:.2f} ms, non-2xx {r['non_2xx']}"
              + (f", server CPU {r['server_cpu_share']:.2f} cores, RSS {r['server_rss_mib']:.0f} MiB"
                 if args.pid else ""), flush=True)
    os.unlink(rooms.name)
    results["load_after"] = list(os.getloadavg())
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
