#!/usr/bin/env python3
"""Federation benchmark (issue 12, "Measure"): Spindle and two Synapses on loopback.

Measures, in one sitting, with rounds alternating the order of the two pairs:
- federated send latency: a PUT /send on one server until the event is in the other
  server's user's /sync (a long-poll already waiting), Spindle -> Synapse against
  Synapse B -> Synapse A;
- join time: a Synapse A user joins a room of N members hosted on Spindle, against the
  same on Synapse B (POST /join returning).

Usage: SPINDLE_BIN=... SYNAPSE_PYTHON=... scripts/bench/federation.py [--rounds 3]
       [--samples 20] [--members 10,100] [--out FILE.json]
Prints a table (with the RSS of Spindle and of the hosting Synapse: idle, after the
rooms are built, after the rounds) and writes the raw samples as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent / "tests" / "e2e"))

import conftest  # noqa: E402
from test_federation_synapse import Client, Synapse, make_cert, q, spindle_for_synapse  # noqa: E402


def spindle_server(root: Path, cert: Path, key: Path):
    s = spindle_for_synapse(os.environ["SPINDLE_BIN"], root, cert, key)
    s.start(timeout=60)
    return s


def send_latency(sender: Client, receiver: Client, room: str, samples: int) -> list[float]:
    """ms from the sender's PUT returning until the event is in the receiver's /sync."""
    out = []
    since = receiver.call("GET", "/_matrix/client/v3/sync?timeout=0")["next_batch"]
    for i in range(samples):
        seen = {}
        done = threading.Event()

        def poll():
            nonlocal since
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not done.is_set():
                r = receiver.call("GET", f"/_matrix/client/v3/sync?timeout=10000&since={q(since)}", timeout=40)
                since = r["next_batch"]
                for ev in r.get("rooms", {}).get("join", {}).get(room, {}).get("timeline", {}).get("events", []):
                    seen[ev["event_id"]] = time.monotonic()
                if "want" in seen and seen["want"] in seen:
                    done.set()

        t = threading.Thread(target=poll)
        t.start()
        time.sleep(0.05)
        eid = sender.send(room, f"latency {i}")
        t0 = time.monotonic()
        seen["want"] = eid
        t.join(35)
        if eid in seen:
            out.append((seen[eid] - t0) * 1000)
        time.sleep(0.05)
    return out


def rss_mb(pid: int) -> float:
    """Resident set size of a process in MiB (VmRSS of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def room_with_members(host: Client, base_url: str, n: int, tag: str) -> tuple[str, str]:
    alias_local = f"bench{tag}{n}"
    room = host.call("POST", "/_matrix/client/v3/createRoom", {"preset": "public_chat", "room_alias_name": alias_local})["room_id"]
    for i in range(n - 1):
        c = Client(base_url)
        c.register(f"m{tag}{n}x{i}")
        c.call("POST", f"/_matrix/client/v3/rooms/{q(room)}/join", {})
    return room, alias_local


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--members", default="10,100")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    sizes = [int(x) for x in args.members.split(",") if x]
    root = Path(tempfile.mkdtemp(prefix="spindle-fedbench-"))
    cert, key = make_cert(root)
    spindle = spindle_server(root / "spindle", cert, key)
    (root / "syn_a").mkdir()
    (root / "syn_b").mkdir()
    syn_a = Synapse(root / "syn_a", conftest.free_loopback_port(), conftest.free_loopback_port(), cert, key)
    syn_b = Synapse(root / "syn_b", conftest.free_loopback_port(), conftest.free_loopback_port(), cert, key)
    syn_a.start()
    syn_b.start()
    results: dict = {"send_ms": {"spindle->synapse": [], "synapse->synapse": []}, "join_ms": {}, "rss_mb": {}}

    def rss(when: str) -> None:
        results["rss_mb"][when] = {"spindle": rss_mb(spindle.proc.pid), "synapse_b": rss_mb(syn_b.proc.pid)}

    try:
        rss("idle")
        alice = Client(spindle.base_url)
        alice.register("alice")
        bob = Client(syn_a.base_url)
        bob.register("bob")
        carol = Client(syn_b.base_url)
        carol.register("carol")
        r1 = alice.call("POST", "/_matrix/client/v3/createRoom", {"preset": "public_chat", "room_alias_name": "lat"})["room_id"]
        bob.call("POST", f"/_matrix/client/v3/join/{q('#lat:' + spindle.server_name)}", {})
        r2 = carol.call("POST", "/_matrix/client/v3/createRoom", {"preset": "public_chat", "room_alias_name": "lat"})["room_id"]
        bob.call("POST", f"/_matrix/client/v3/join/{q('#lat:' + syn_b.server_name)}", {})
        rooms = {}
        for n in sizes:
            rooms[("spindle", n)] = room_with_members(alice, spindle.base_url, n, "s")
            rooms[("synapse", n)] = room_with_members(carol, syn_b.base_url, n, "b")
        rss("rooms built")
        for rnd in range(args.rounds):
            pairs = [("spindle->synapse", alice, r1), ("synapse->synapse", carol, r2)]
            if rnd % 2:
                pairs.reverse()
            for name, sender, room in pairs:
                results["send_ms"][name].extend(send_latency(sender, bob, room, args.samples))
            for n in sizes:
                order = ["spindle", "synapse"] if rnd % 2 == 0 else ["synapse", "spindle"]
                for host in order:
                    room, alias_local = rooms[(host, n)]
                    server = spindle.server_name if host == "spindle" else syn_b.server_name
                    joiner = Client(syn_a.base_url)
                    joiner.register(f"j{host}{n}r{rnd}")
                    t0 = time.monotonic()
                    joiner.call("POST", f"/_matrix/client/v3/join/{q('#' + alias_local + ':' + server)}", {}, timeout=120)
                    results["join_ms"].setdefault(f"{host} {n}", []).append((time.monotonic() - t0) * 1000)
        rss("after rounds")
    finally:
        syn_a.stop()
        syn_b.stop()
        spindle.stop()

    def row(name, xs):
        if not xs:
            return f"  {name:28s} no samples"
        xs = sorted(xs)
        p95 = xs[min(len(xs) - 1, int(len(xs) * 0.95))]
        return f"  {name:28s} n={len(xs):3d}  median {statistics.median(xs):8.1f} ms  p95 {p95:8.1f} ms"

    print("federated send (PUT returned -> in the other server's /sync):")
    for k, v in results["send_ms"].items():
        print(row(k, v))
    print("join of a Synapse user (POST /join):")
    for k, v in results["join_ms"].items():
        print(row(f"room on {k} members", v))
    print("RSS (MiB): spindle / hosting synapse")
    for when, v in results["rss_mb"].items():
        print(f"  {when:28s} {v['spindle']:8.1f} / {v['synapse_b']:8.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
