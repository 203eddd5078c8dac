#!/usr/bin/env python3
"""Password-login throughput and memory, Spindle against Synapse (issue 17, "Measure").

Each round starts a fresh Spindle (its default hashing pool: one thread per core,
argon2id at its default cost) and a fresh Synapse (bcrypt at its default 12 rounds),
both with rate limits lifted, registers one account on each, then fires --logins
password logins (--concurrency at once) at each server in turn, the order alternated by
round. For each server it reports logins per second, the latency median and p95, and
the RSS idle, after the registration and after the logins (VmRSS of the process).

Usage: SPINDLE_BIN=target/release/spindle SYNAPSE_PYTHON=... \\
       /root/.cache/spindle-venv-e2e/bin/python scripts/bench/login_throughput.py \\
       [--rounds 3] [--logins 1000] [--concurrency 16] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent / "tests" / "e2e"))

import conftest  # noqa: E402
from test_federation_synapse import Synapse, make_cert, spindle_for_synapse  # noqa: E402


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def logins(base: str, user: str, n: int, concurrency: int) -> tuple[float, list[float], dict]:
    """Fires n password logins for `user`, `concurrency` at once. Returns the wall time
    (s), each login's latency (s) and the count of answers per status."""
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    body = {"type": "m.login.password", "identifier": {"type": "m.id.user", "user": user},
            "password": "bench-password-1"}
    todo = iter(range(n))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        async def worker():
            for _ in todo:
                t = time.perf_counter()
                async with http.post(base + "/_matrix/client/v3/login", json=body) as r:
                    await r.read()
                    statuses[r.status] = statuses.get(r.status, 0) + 1
                latencies.append(time.perf_counter() - t)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started, latencies, statuses


async def register(base: str, user: str) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(base + "/_matrix/client/v3/register", json={
            "username": user, "password": "bench-password-1", "auth": {"type": "m.login.dummy"},
            "inhibit_login": True,
        }) as r:
            if r.status != 200:
                raise SystemExit(f"registration on {base} failed: {r.status} {await r.text()}")


def measure(name: str, base: str, pid: int, args) -> dict:
    idle = rss_mib(pid)
    asyncio.run(register(base, "bench"))
    registered = rss_mib(pid)
    wall, lat, statuses = asyncio.run(logins(base, "bench", args.logins, args.concurrency))
    time.sleep(2)
    lat.sort()
    row = {
        "server": name,
        "logins_per_s": round(args.logins / wall, 1),
        "p50_ms": round(1000 * statistics.median(lat), 1),
        "p95_ms": round(1000 * lat[int(0.95 * (len(lat) - 1))], 1),
        "statuses": statuses,
        "rss_idle_mib": round(idle, 1),
        "rss_after_register_mib": round(registered, 1),
        "rss_after_logins_mib": round(rss_mib(pid), 1),
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--logins", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--out")
    args = p.parse_args()
    binary = os.environ["SPINDLE_BIN"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="spindle-login-bench-") as tmp:
        root = Path(tmp)
        cert, key = make_cert(root)
        for r in range(args.rounds):
            spindle = spindle_for_synapse(binary, root / f"spindle{r}", cert, key)
            spindle.start()
            (root / f"synapse{r}").mkdir()
            synapse = Synapse(root / f"synapse{r}", conftest.free_loopback_port(),
                              conftest.free_loopback_port(), cert, key)
            synapse.start()
            try:
                time.sleep(3)
                order = [("spindle", spindle.base_url, spindle.proc.pid),
                         ("synapse", synapse.base_url, synapse.proc.pid)]
                if r % 2:
                    order.reverse()
                for name, base, pid in order:
                    row = measure(name, base, pid, args)
                    row["round"] = r
                    rows.append(row)
            finally:
                spindle.stop()
                synapse.stop()
    for name in ("spindle", "synapse"):
        mine = [x for x in rows if x["server"] == name]
        print(name, "logins/s", [x["logins_per_s"] for x in mine],
              "p50 ms", [x["p50_ms"] for x in mine],
              "RSS after MiB", [x["rss_after_logins_mib"] for x in mine])
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
