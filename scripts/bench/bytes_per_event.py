#!/usr/bin/env python3
"""Bytes on disk per event (issue 18 item 5): Spindle beside Synapse for the same room.

Each server starts fresh with its defaults (Synapse on SQLite), one user creates one
room and sends N short text messages (a ~100-byte body) from 8 clients, then the server
is stopped and its storage measured:
- Spindle: `spindle storage` (bytes per keyspace of the journal and the projections,
  and the directories' totals, which include what fjall still holds in its write-ahead
  journal);
- Synapse: bytes per table and index of homeserver.db (SQLite's dbstat) and the file.

Prints a table of bytes per event and writes the raw numbers as JSON to --out.

    scripts/bench/bytes_per_event.py --bin target/release/spindle --events 50000 --out r.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sitting  # noqa: E402  (start_synapse, synapse_venv, wait_ready, stop)
from scale_out import Conn, free_port  # noqa: E402

CLIENTS = 8


def body_of(i: int) -> str:
    # ~100 bytes, like the short messages of issue 18's 1M-event figure.
    return f"message {i:07d}: the quick brown fox jumps over the lazy dog, then naps in the afternoon sun."


def fill(port: int, events: int) -> float:
    """Registers a user, creates a room, sends `events` messages from CLIENTS clients.
    Returns the fill's sends per second."""
    body = {"username": "filler", "password": "filler-pw-123"}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/_matrix/client/v3/register", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    first = json.loads(r.read() or b"{}")
    if r.status == 200:
        token = first["access_token"]
    else:
        # The UIA dance: answer the dummy stage in the session the server opened.
        body["auth"] = {"type": "m.login.dummy", **({"session": first["session"]} if "session" in first else {})}
        token = Conn(port).req("POST", "/_matrix/client/v3/register", body)["access_token"]
    owner = Conn(port, token)
    room = owner.req("POST", "/_matrix/client/v3/createRoom", {"preset": "private_chat"})["room_id"]
    per = events // CLIENTS
    errors: list[str] = []

    def run(k: int) -> None:
        conn = Conn(port, token)
        try:
            for i in range(per):
                n = k * per + i
                conn.req("PUT", f"/_matrix/client/v3/rooms/{room}/send/m.room.message/f{n}",
                         {"msgtype": "m.text", "body": body_of(n)})
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(str(e))

    t = time.time()
    threads = [threading.Thread(target=run, args=(k,)) for k in range(CLIENTS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise SystemExit(f"fill failed: {errors[0]}")
    return per * CLIENTS / (time.time() - t)


def spindle_storage(exe: Path, cfg: Path) -> dict:
    out = subprocess.run([str(exe), "--config", str(cfg), "storage"], check=True,
                         capture_output=True, text=True).stdout
    rows, totals, records = [], {}, 0
    for line in out.splitlines():
        f = line.split("\t")
        if f[0] in ("journal", "projections"):
            rows.append({"db": f[0], "name": f[1], "bytes": int(f[2]), "items": int(f[3])})
        elif f[0] == "total":
            totals[f[1]] = {"tables": int(f[2]), "directory": int(f[3])}
        elif f[0] == "records":
            records = int(f[1])
    return {"keyspaces": rows, "totals": totals, "records": records}


def synapse_storage(db: Path) -> dict:
    c = sqlite3.connect(db)
    try:
        rows = c.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name ORDER BY 2 DESC").fetchall()
    except sqlite3.OperationalError:
        rows = []
    files = {p.name: p.stat().st_size for p in db.parent.glob(db.name + "*")}
    return {"tables": [{"name": n, "bytes": b} for n, b in rows], "files": files}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True, help="the release spindle binary")
    ap.add_argument("--events", type=int, default=50_000)
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-synapse", action="store_true")
    args = ap.parse_args()
    exe = Path(args.bin).resolve()
    work = Path(tempfile.mkdtemp(prefix="spindle-bytes-"))
    result = {"events": args.events, "body_bytes": len(body_of(0))}
    try:
        port = free_port()
        (work / "spindle").mkdir(parents=True)
        cfg = work / "spindle" / "spindle.toml"
        # The embedded defaults, with the rate limits off (Synapse's are lifted too).
        cfg.write_text(f'bind = "127.0.0.1:{port}"\ndata_dir = "{work / "spindle" / "data"}"\n'
                       '\n[rate_limits]\nenabled = false\n')
        proc = subprocess.Popen([str(exe), "--config", str(cfg)], stdout=subprocess.DEVNULL,
                                stderr=open(work / "spindle" / "spindle.log", "w"))
        sitting.wait_ready(f"http://127.0.0.1:{port}/_matrix/client/versions", proc)
        rate = fill(port, args.events)
        sitting.stop(proc)
        result["spindle"] = {"fill_per_s": round(rate), **spindle_storage(exe, work / "spindle" / "spindle.toml")}
        if not args.no_synapse:
            venv = sitting.synapse_venv()
            port = free_port()
            db = work / "synapse" / "homeserver.db"
            proc = sitting.start_synapse(venv, work / "synapse", port, {"name": "sqlite3", "args": {"database": str(db)}})
            sitting.wait_ready(f"http://127.0.0.1:{port}/_matrix/client/versions", proc)
            rate = fill(port, args.events)
            sitting.stop(proc)
            result["synapse"] = {"version": sitting.synapse_version(venv), "fill_per_s": round(rate),
                                 **synapse_storage(db)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    n = args.events
    s = result["spindle"]
    print(f"{n} events of a {result['body_bytes']}-byte body")
    print(f"spindle: journal {s['totals']['journal']['directory'] / n:.0f} B/event on disk, projections "
          f"{s['totals']['projections']['directory'] / n:.0f} B/event; per keyspace (tables):")
    for k in s["keyspaces"]:
        if k["bytes"] >= n:  # at least a byte per event
            print(f"  {k['db']:<12} {k['name']:<40} {k['bytes'] / n:8.1f} B/event  {k['items']:>9} items")
    if "synapse" in result:
        y = result["synapse"]
        total = sum(y["files"].values())
        print(f"synapse {y['version']}: {total / n:.0f} B/event on disk (homeserver.db*); per table and index:")
        for t in y["tables"]:
            if t["bytes"] >= n:
                print(f"  {t['name']:<52} {t['bytes'] / n:8.1f} B/event")


if __name__ == "__main__":
    main()
