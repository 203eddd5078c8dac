#!/usr/bin/env python3
"""Memory soak (issue 17 item 4): drive a spindle binary with many users, messages and
sliding-sync connections, sample its RSS over time, and print a summary.

Usage (the e2e venv has aiohttp):
    /root/.cache/spindle-venv-e2e/bin/python scripts/bench/soak.py BINARY \
        [--users 10000] [--rooms 1000] [--messages 200000] [--sliding 1000] \
        [--out FILE.json] [--extra-toml TEXT]

Phases, each sampled (RSS from /proc/PID/status every 0.5 s):
  idle        the fresh server, 5 s
  register    --users accounts (m.login.dummy), then one password login each (a second
              device and token per user)
  rooms       --rooms rooms, each created by one user; every user joins one room
              (user i joins room i % rooms)
  messages    --messages m.room.message sends with txn ids over the rooms, each by a
              member; 1 in 50 is retried with the same txn id (idempotency checked)
  sliding     --sliding simplified sliding-sync connections (one per user device),
              each an initial request and one incremental request with its pos; typing
              and presence set by the same users
  after       30 s idle, then the final RSS

At each mark the server's own memory figures are scraped from its metrics listener
(spindle_storage_memory_bytes per database and kind, spindle_cache_entries per map), so
the growth can be attributed and not only observed.

Rate limits are lifted and argon2 runs with cheap parameters (m_cost 1024 KiB, t 1):
the soak measures the maps that grow with users and traffic, not hashing, whose memory
is bounded by the pool (docs/benchmarks.md "Login memory"). Talks to 127.0.0.1 only and
stops the server it started.
"""

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import aiohttp

SLIDING = "/_matrix/client/unstable/org.matrix.simplified_msc3575/sync"


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        return None
    return None


def rss_parts(pid):
    """RssAnon (heap and other anonymous memory) and RssFile (mapped files, e.g. the
    search index's segments) in MiB, from /proc/PID/status."""
    parts = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssFile:")):
                    parts[line.split(":")[0]] = round(int(line.split()[1]) / 1024, 1)
    except FileNotFoundError:
        pass
    return parts


class Soak:
    def __init__(self, args):
        self.args = args
        self.marks, self.memory = {}, {}
        self.samples = []  # (seconds since start, phase, MiB)
        self.phase = "start"
        self.t0 = time.monotonic()
        self.errors = {}
        self.duplicates = 0

    def note_error(self, what, status):
        k = f"{what} {status}"
        self.errors[k] = self.errors.get(k, 0) + 1

    async def sampler(self, pid):
        while True:
            r = rss_mib(pid)
            if r is not None:
                self.samples.append((round(time.monotonic() - self.t0, 1), self.phase, round(r, 1)))
            await asyncio.sleep(0.5)

    async def req(self, http, method, path, token=None, body=None, what=""):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        for attempt in range(5):
            async with http.request(method, self.base + path, json=body, headers=headers) as r:
                data = await r.json(content_type=None)
                if r.status == 200:
                    return data
                if r.status in (429, 503) and attempt < 4:
                    await asyncio.sleep(0.2 * (attempt + 1))
                    continue
                self.note_error(what or path.split("/")[4], r.status)
                return None

    async def pool(self, jobs, concurrency):
        """Runs the coroutine factories in `jobs` with at most `concurrency` at once."""
        it = iter(jobs)

        async def worker():
            for job in it:
                await job()

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    async def run(self):
        a = self.args
        work = tempfile.mkdtemp(prefix="spindle-soak-")
        port = free_port()
        self.metrics_url = f"http://127.0.0.1:{free_port()}/metrics"
        self.base = f"http://127.0.0.1:{port}"
        cfg = os.path.join(work, "spindle.toml")
        with open(cfg, "w") as f:
            f.write(
                f'server_name = "localhost:{port}"\nbind = "127.0.0.1:{port}"\n'
                f'data_dir = "{work}/data"\nlog = "warn"\n'
                '[registration]\nmode = "open"\n'
                "[rate_limits]\nenabled = false\n"
                "[password_hashing]\nm_cost_kib = 1024\nt_cost = 1\n"
                f'[metrics]\nenabled = true\nbind = "{self.metrics_url.split("/")[2]}"\n'
                f"{a.extra_toml}\n"
            )
        env = dict(os.environ)
        proc = subprocess.Popen([a.binary, "--config", cfg], stderr=open(os.path.join(work, "stderr"), "w"), env=env)
        try:
            async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=256), timeout=aiohttp.ClientTimeout(total=120)
            ) as http:
                for _ in range(200):
                    try:
                        async with http.get(self.base + "/_matrix/client/versions") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.1)
                self.pid = proc.pid
                sampler = asyncio.create_task(self.sampler(proc.pid))
                await self.phases(http)
                sampler.cancel()
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
            shutil.rmtree(work, ignore_errors=True)
        return self.report()

    async def mark(self, http, name):
        """Records the RSS now and the server's own memory metrics under `name`."""
        self.marks[name] = rss_now(self)
        figures = rss_parts(self.pid)
        try:
            async with http.get(self.metrics_url) as r:
                text = await r.text()
            for line in text.splitlines():
                if line.startswith(("spindle_storage_memory_bytes{", "spindle_cache_entries{")):
                    key, value = line.rsplit(" ", 1)
                    figures[key] = float(value)
        except aiohttp.ClientError as e:
            figures["error"] = str(e)
        self.memory[name] = figures

    async def phases(self, http):
        a = self.args
        self.phase = "idle"
        await asyncio.sleep(5)
        self.marks, self.memory = {}, {}
        await self.mark(http, "idle")

        self.phase = "register"
        tokens = [None] * a.users

        def register(i):
            async def job():
                await self.req(http, "POST", "/_matrix/client/v3/register", body={
                    "username": f"soak{i}", "password": "soak-password",
                    "auth": {"type": "m.login.dummy"}, "inhibit_login": True,
                }, what="register")
                r = await self.req(http, "POST", "/_matrix/client/v3/login", body={
                    "type": "m.login.password",
                    "identifier": {"type": "m.id.user", "user": f"soak{i}"},
                    "password": "soak-password",
                }, what="login")
                if r:
                    tokens[i] = r["access_token"]
            return job

        await self.pool([register(i) for i in range(a.users)], 16)
        await self.mark(http, "after register+login")

        self.phase = "rooms"
        rooms = [None] * a.rooms

        def create(k):
            async def job():
                r = await self.req(http, "POST", "/_matrix/client/v3/createRoom", tokens[k],
                                   {"preset": "public_chat", "name": f"soak room {k}"}, what="createRoom")
                if r:
                    rooms[k] = r["room_id"]
            return job

        await self.pool([create(k) for k in range(a.rooms)], 16)

        def join(i):
            async def job():
                await self.req(http, "POST", f"/_matrix/client/v3/join/{rooms[i % a.rooms]}", tokens[i], {}, what="join")
            return job

        await self.pool([join(i) for i in range(a.rooms, a.users)], 16)
        await self.mark(http, "after rooms+joins")

        self.phase = "messages"
        rng = random.Random(7)

        def send(n):
            async def job():
                i = rng.randrange(a.users)
                room = rooms[i % a.rooms]
                path = f"/_matrix/client/v3/rooms/{room}/send/m.room.message/m{n}"
                body = {"msgtype": "m.text", "body": f"soak message {n}"}
                r = await self.req(http, "PUT", path, tokens[i], body, what="send")
                if r and n % 50 == 0:
                    again = await self.req(http, "PUT", path, tokens[i], body, what="send-retry")
                    if again and again["event_id"] != r["event_id"]:
                        self.duplicates += 1
            return job

        await self.pool([send(n) for n in range(a.messages)], 32)
        await self.mark(http, "after messages")

        self.phase = "sliding"

        def sliding(i):
            async def job():
                body = {"lists": {"all": {"ranges": [[0, 19]], "timeline_limit": 5,
                                          "required_state": [["m.room.name", ""]]}},
                        "extensions": {"typing": {"enabled": True}, "receipts": {"enabled": True}}}
                r = await self.req(http, "POST", SLIDING, tokens[i], body, what="sliding")
                if not r:
                    return
                await self.req(http, "PUT", f"/_matrix/client/v3/rooms/{rooms[i % a.rooms]}/typing/@soak{i}:localhost:{self.base.rsplit(':', 1)[1]}",
                               tokens[i], {"typing": True, "timeout": 30000}, what="typing")
                await self.req(http, "POST", f"{SLIDING}?pos={r['pos']}&timeout=0", tokens[i], body, what="sliding-pos")
            return job

        await self.pool([sliding(i) for i in range(min(a.sliding, a.users))], 32)
        await self.mark(http, "after sliding")

        self.phase = "after"
        await asyncio.sleep(30)
        await self.mark(http, "30 s after")

    def report(self):
        peak = {}
        for _, phase, mib in self.samples:
            peak[phase] = max(peak.get(phase, 0), mib)
        out = {
            "args": {k: v for k, v in vars(self.args).items() if k != "out"},
            "marks_mib": self.marks,
            "memory_metrics": self.memory,
            "peak_mib_by_phase": peak,
            "peak_mib": max((m for _, _, m in self.samples), default=None),
            "errors": self.errors,
            "duplicate_sends": self.duplicates,
            "seconds": round(time.monotonic() - self.t0, 1),
            "samples": self.samples,
        }
        return out


def rss_now(soak):
    return soak.samples[-1][2] if soak.samples else None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("binary")
    p.add_argument("--users", type=int, default=10_000)
    p.add_argument("--rooms", type=int, default=1_000)
    p.add_argument("--messages", type=int, default=200_000)
    p.add_argument("--sliding", type=int, default=1_000)
    p.add_argument("--extra-toml", default="")
    p.add_argument("--out")
    args = p.parse_args()
    out = asyncio.run(Soak(args).run())
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    summary = {k: v for k, v in out.items() if k != "samples"}
    json.dump(summary, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
