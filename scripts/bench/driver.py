#!/usr/bin/env python3
"""Client-Server API benchmark driver: one round against one homeserver.

It talks to the server the way a client does (UIA registration with the dummy stage,
password login for new devices, ordinary Client-Server requests over keep-alive HTTP/1.1),
builds the rooms it needs, and times each operation with warm-ups and N samples per
cell. It knows nothing about which server it talks to: the same workload goes through
every front door. Standard library only, so the client's own cost is as small and as
equal as it can be (the trivial-request floor, `/versions`, is measured and reported).

Dimensions (each cell is one operation at one size):

  events       rooms of 200/800/3200 messages: send, join (a fresh user into the public
               room), state, members, messages_page (20 backwards from the end),
               context_deep (the oldest visible event), sync_initial (no filter; each
               sample on a fresh device, because Synapse caches a repeated initial sync
               per device), sync_initial_lazy (lazy_load_members), sync_incremental (after
               one new message), sync_poll (nothing new, timeout=0) and sliding_window
               (the 11-room MSC4186 window Element X asks for; skipped when not served).
  members      rooms of 50/200/800 joined members, the same operations.
  concurrency  1/2/4/8 clients, each sending to its own room for a fixed time:
               sends/s, mean and p95 latency.
  tenants      one user's incremental sync after 0/50/200/800 events were sent in
               rooms they are not in (and one in theirs).
  rooms        one user in 50/200/500 rooms (5 messages and a name each, created by that
               user): sync_initial (a fresh device per sample), sliding_window (the same
               11-room window), sync_incremental with one active room (another user sends
               one message into one of the N rooms) and sync_poll (nothing new). Not in
               the default --dimensions (seeding 750 rooms costs minutes on Synapse);
               --quick (3 and 6 rooms) and --big run it.

Rooms are seeded one request at a time per room (concurrent sends would fork a DAG
server's room); different rooms are seeded in parallel.

Presets (an option given explicitly wins over its preset):
  --quick  smoke sizes, every dimension: events 50,200; members 10,40; concurrency 1,4
           for 2 s; tenants 0,50; rooms 3,6; 5 samples after 1 warm-up.
  --big    issue 18's bigger shapes, every dimension: events 200,3200,50000; members
           50,800,5000; rooms 50,200,500 (seeding alone is many minutes on Synapse:
           50,000 sends one at a time into one room, 5,000 registrations and joins).

Usage:
  driver.py --base http://127.0.0.1:8008 --label spindle --out round.json [--quick|--big]
  driver.py ... --dimensions rooms --rooms 5,20     (one dimension, sizes of your own)
  driver.py ... --dimensions events,members --ops sliding_window   (one operation only)
  driver.py --help      (every size, sample count and duration is an option)

The output is one JSON document: metadata (label, base, sizes, load average before and
after), the floor, and a list of cells, each with every sample in milliseconds (or the
rate, for throughput) plus its median. scripts/bench/compare.py reads these files.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import platform
import queue
import random
import socket
import statistics
import string
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

PASSWORD = "bench-password-1"
SLIDING_PATH = "/_matrix/client/unstable/org.matrix.simplified_msc3575/sync"
# The shape of Element X's room-list request (MSC4186): an 11-room window, the state a
# room list renders, and a short timeline for the preview.
SLIDING_BODY = {
    "lists": {
        "all": {
            "ranges": [[0, 10]],
            "timeline_limit": 3,
            "required_state": [
                ["m.room.name", ""],
                ["m.room.avatar", ""],
                ["m.room.topic", ""],
                ["m.room.canonical_alias", ""],
                ["m.room.encryption", ""],
                ["m.room.join_rules", ""],
                ["m.room.power_levels", ""],
                ["m.room.create", ""],
                ["m.room.history_visibility", ""],
                ["m.room.member", "$ME"],
                ["m.room.member", "$LAZY"],
            ],
        }
    }
}
LAZY_FILTER = json.dumps({"room": {"state": {"lazy_load_members": True}}}, separators=(",", ":"))


class BenchError(Exception):
    """A request answered something the workload cannot continue from."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def loadavg() -> list[float]:
    try:
        with open("/proc/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except OSError:
        return []


def q(s: str) -> str:
    return urllib.parse.quote(s, safe="")


class Conn:
    """One keep-alive HTTP/1.1 connection (not thread-safe: one per thread)."""

    def __init__(self, base: str, token: str | None = None):
        u = urllib.parse.urlsplit(base)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.token = token
        self.c: http.client.HTTPConnection | None = None

    def _connect(self) -> http.client.HTTPConnection:
        c = http.client.HTTPConnection(self.host, self.port, timeout=120)
        c.connect()
        c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return c

    def with_token(self, token: str) -> "Conn":
        return Conn(f"http://{self.host}:{self.port}", token)

    def request(self, method: str, path: str, body=None, token: str | None = None):
        """Returns (status, parsed JSON or None). Reconnects once on a dropped connection."""
        headers = {}
        tok = token or self.token
        if tok:
            headers["Authorization"] = f"Bearer {tok}"
        data = None
        if body is not None:
            data = json.dumps(body, separators=(",", ":")).encode()
            headers["Content-Type"] = "application/json"
        for attempt in (0, 1):
            if self.c is None:
                self.c = self._connect()
            try:
                self.c.request(method, path, body=data, headers=headers)
                r = self.c.getresponse()
                raw = r.read()
                if r.will_close:
                    self.c.close()
                    self.c = None
                break
            except (http.client.RemoteDisconnected, ConnectionError, BrokenPipeError):
                if self.c is not None:
                    self.c.close()
                self.c = None
                if attempt == 1:
                    raise
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = None
        return r.status, parsed

    def ok(self, method: str, path: str, body=None, token: str | None = None):
        status, v = self.request(method, path, body, token)
        if status != 200:
            raise BenchError(f"{method} {path} -> {status}: {v}")
        return v

    def timed(self, method: str, path: str, body=None, token: str | None = None):
        """Times one request (send, server work, full body read, JSON parse)."""
        t0 = time.perf_counter_ns()
        status, v = self.request(method, path, body, token)
        ms = (time.perf_counter_ns() - t0) / 1e6
        return ms, status, v


class User:
    """A registered account; `conn` is a connection of the calling thread's own."""

    def __init__(self, base: str, user_id: str, localpart: str, token: str, device: str):
        self.base = base
        self.user_id = user_id
        self.localpart = localpart
        self.token = token
        self.device = device
        self._local = threading.local()

    @property
    def conn(self) -> Conn:
        c = getattr(self._local, "conn", None)
        if c is None:
            c = self._local.conn = Conn(self.base, self.token)
        return c


class Bench:
    def __init__(self, args):
        self.args = args
        self.base = args.base.rstrip("/")
        self.conn = Conn(self.base)
        self.run_id = "".join(random.choices(string.ascii_lowercase, k=6))
        self.counter = 0
        self.lock = threading.Lock()
        self.cells: list[dict] = []
        self.skipped: dict[str, str] = {}
        self.txn = 0
        self.floor_samples: list[float] = []
        self._tl = threading.local()

    # ---------------------------------------------------------------- helpers
    def next_name(self, prefix: str) -> str:
        with self.lock:
            self.counter += 1
            return f"b{self.run_id}{prefix}{self.counter}"

    def next_txn(self) -> str:
        with self.lock:
            self.txn += 1
            return f"t{self.run_id}{self.txn}"

    def anon_conn(self) -> Conn:
        """A keep-alive connection without a token, one per thread (for registration)."""
        c = getattr(self._tl, "conn", None)
        if c is None:
            c = self._tl.conn = Conn(self.base)
        return c

    def register(self, prefix: str = "u") -> User:
        """The UIA dance a real client does: ask, read the session, answer the dummy stage."""
        name = self.next_name(prefix)
        conn = self.anon_conn()
        body = {"username": name, "password": PASSWORD, "initial_device_display_name": "bench"}
        status, v = conn.request("POST", "/_matrix/client/v3/register", body)
        if status == 401 and v and "session" in v:
            flows = [f.get("stages", []) for f in v.get("flows", [])]
            if not any(stages == ["m.login.dummy"] for stages in flows):
                raise BenchError(f"no dummy-only registration flow offered: {flows}")
            body["auth"] = {"type": "m.login.dummy", "session": v["session"]}
            status, v = conn.request("POST", "/_matrix/client/v3/register", body)
        if status != 200:
            raise BenchError(f"register {name} -> {status}: {v}")
        return User(self.base, v["user_id"], name, v["access_token"], v["device_id"])

    def register_many(self, n: int, prefix: str = "u") -> list[User]:
        """n accounts, registered by 4 threads (each on its own keep-alive connection)."""
        done = [0]

        def one(_):
            u = self.register(prefix)
            if n >= 2000:
                with self.lock:
                    done[0] += 1
                    if done[0] % 1000 == 0:
                        log(f"  registered {done[0]} of {n}")
            return u

        with ThreadPoolExecutor(max_workers=4) as ex:
            return list(ex.map(one, range(n)))

    def login_device(self, user: User) -> str:
        """A new device for `user` (password login); returns its access token."""
        v = self.conn.ok(
            "POST",
            "/_matrix/client/v3/login",
            {
                "type": "m.login.password",
                "identifier": {"type": "m.id.user", "user": user.localpart},
                "password": PASSWORD,
                "initial_device_display_name": "bench",
            },
        )
        return v["access_token"]

    def create_room(self, user: User, name: str, preset: str = "public_chat") -> str:
        v = user.conn.ok(
            "POST", "/_matrix/client/v3/createRoom", {"preset": preset, "name": name}
        )
        return v["room_id"]

    def send(self, user: User, room: str, body: str, conn: Conn | None = None) -> str:
        c = conn or user.conn
        v = c.ok(
            "PUT",
            f"/_matrix/client/v3/rooms/{q(room)}/send/m.room.message/{self.next_txn()}",
            {"msgtype": "m.text", "body": body},
            token=user.token,
        )
        return v["event_id"]

    def join(self, user: User, room: str) -> None:
        user.conn.ok("POST", f"/_matrix/client/v3/rooms/{q(room)}/join", {})

    def seed_messages(self, user: User, room: str, n: int, tag: str) -> None:
        """n messages, one request at a time (a room is seeded sequentially)."""
        conn = Conn(self.base, user.token)
        t0 = time.time()
        for i in range(n):
            self.send(user, room, f"{tag} message {i} " + "lorem ipsum " * 4, conn=conn)
            if n >= 10000 and (i + 1) % 5000 == 0:
                log(f"  {tag}: sent {i + 1} of {n} ({time.time() - t0:.0f} s)")

    def parallel(self, jobs) -> None:
        """Runs callables in parallel threads (one per room) and re-raises failures."""
        if not jobs:
            return
        with ThreadPoolExecutor(max_workers=min(8, len(jobs))) as ex:
            for f in [ex.submit(j) for j in jobs]:
                f.result()

    def sync_token(self, user: User, token: str | None = None) -> str:
        """The current next_batch for `user`, from an initial sync with a one-event timeline.

        The filter carries a nonce: Synapse caches an initial sync response per (user,
        device, filter) for minutes, and a cached answer would hand out a stale token."""
        nonce = self.next_txn()
        flt = {"room": {"timeline": {"limit": 1}}, "account_data": {"not_types": [f"bench.nonce.{nonce}"]}}
        v = user.conn.ok("GET", "/_matrix/client/v3/sync?timeout=0&filter=" + q(json.dumps(flt)), token=token)
        return v["next_batch"]

    # ---------------------------------------------------------------- measuring
    def cell(self, dimension: str, op: str, size, sample, checker=None, unit="ms") -> dict:
        """Runs `sample(i)` warm-up + N times; each returns (ms, status, body). An
        operation left out by `--ops` is not run and records nothing."""
        if self.args.ops and op not in self.args.ops and dimension != "floor":
            return {}
        warm, n = self.args.warmup, self.args.samples
        samples: list[float] = []
        errors: list[str] = []
        for i in range(warm + n):
            ms, status, body = sample(i)
            bad = None
            if status != 200:
                bad = f"status {status}: {str(body)[:200]}"
            elif checker is not None:
                bad = checker(body)
            if bad:
                errors.append(bad)
                if len(errors) > 3:
                    break
                continue
            if i >= warm:
                samples.append(ms)
        rec = summarize(dimension, op, size, samples, unit)
        if errors:
            rec["errors"] = errors[:4]
        self.cells.append(rec)
        tag = f"{dimension}/{op}/{size}"
        if samples:
            log(f"  {tag:<38} median {rec['median']:8.3f} {unit}  (n={len(samples)}, errors={len(errors)})")
        else:
            log(f"  {tag:<38} NO SAMPLES: {errors[:1]}")
        return rec

    def devices(self, user: User, n: int) -> list[str]:
        return [self.login_device(user) for _ in range(n)]

    def sliding_served(self, user: User) -> bool:
        if "sliding" in self.skipped:
            return False
        status, v = user.conn.request("POST", SLIDING_PATH + "?timeout=0", SLIDING_BODY)
        if status == 200 and isinstance(v, dict) and "lists" in v:
            return True
        self.skipped["sliding_window"] = f"not served: {status} {str(v)[:120]}"
        self.skipped["sliding"] = "probe failed"
        log(f"  sliding_window skipped: {self.skipped['sliding_window']}")
        return False

    # ---------------------------------------------------------------- the read/write set
    def room_ops(self, dim: str, size, room: str, writer: User, observer: User, slider: User | None,
                 joiners: list[User]) -> None:
        """Every per-room operation against one prepared room."""
        a = self.args
        nsamp = a.warmup + a.samples
        obs = observer.conn
        r = q(room)

        def expect_chunk(v):
            return None if v and len(v.get("chunk", [])) == 20 else f"chunk {len((v or {}).get('chunk', []))} != 20"

        self.cell(dim, "state", size, lambda i: obs.timed("GET", f"/_matrix/client/v3/rooms/{r}/state"),
                  lambda v: None if isinstance(v, list) and len(v) >= 5 else "short state")
        self.cell(dim, "members", size, lambda i: obs.timed("GET", f"/_matrix/client/v3/rooms/{r}/members"),
                  lambda v: None if v and len(v.get("chunk", [])) >= 2 else "short members")
        self.cell(dim, "messages_page", size,
                  lambda i: obs.timed("GET", f"/_matrix/client/v3/rooms/{r}/messages?dir=b&limit=20"),
                  expect_chunk)
        first = obs.ok("GET", f"/_matrix/client/v3/rooms/{r}/messages?dir=f&limit=1")["chunk"][0]["event_id"]
        self.cell(dim, "context_deep", size,
                  lambda i: obs.timed("GET", f"/_matrix/client/v3/rooms/{r}/context/{q(first)}?limit=10"),
                  lambda v: None if v and v.get("event", {}).get("event_id") == first else "wrong context")

        def in_room(v):
            return None if v and room in v.get("rooms", {}).get("join", {}) else "room missing from sync"

        toks = self.devices(observer, nsamp)
        self.cell(dim, "sync_initial", size,
                  lambda i: obs.timed("GET", "/_matrix/client/v3/sync?timeout=0", token=toks[i]), in_room)
        toks = self.devices(observer, nsamp)
        self.cell(dim, "sync_initial_lazy", size,
                  lambda i: obs.timed("GET", "/_matrix/client/v3/sync?timeout=0&filter=" + q(LAZY_FILTER),
                                      token=toks[i]), in_room)

        # sync_incremental: one new message since the last token, every sample.
        state = {"since": self.sync_token(observer)}

        def incremental(i):
            eid = self.send(writer, room, f"incremental {i}")
            ms, status, v = obs.timed("GET", f"/_matrix/client/v3/sync?timeout=0&since={q(state['since'])}")
            if status == 200:
                state["since"] = v["next_batch"]
                evs = v.get("rooms", {}).get("join", {}).get(room, {}).get("timeline", {}).get("events", [])
                if not any(e.get("event_id") == eid for e in evs):
                    return ms, 200, {"_bad": f"new event {eid} missing"}
            return ms, status, v

        self.cell(dim, "sync_incremental", size, incremental, lambda v: v.get("_bad") if v else "empty")

        # sync_poll: nothing new since the token; a different device per sample so a
        # per-device response cache cannot answer it.
        toks = self.devices(observer, nsamp)
        since = self.sync_token(observer)
        self.cell(dim, "sync_poll", size,
                  lambda i: obs.timed("GET", f"/_matrix/client/v3/sync?timeout=0&since={q(since)}", token=toks[i]),
                  lambda v: None if v and room not in v.get("rooms", {}).get("join", {})
                  else f"poll not empty: {json.dumps(v.get('rooms', {}).get('join', {}).get(room))[:300]}")

        if slider is not None and self.sliding_served(slider):
            self.cell(dim, "sliding_window", size,
                      lambda i: slider.conn.timed("POST", SLIDING_PATH + "?timeout=0", SLIDING_BODY),
                      lambda v: None if v and room in v.get("rooms", {}) else "room missing from window")

        self.cell(dim, "send", size,
                  lambda i: writer.conn.timed(
                      "PUT", f"/_matrix/client/v3/rooms/{r}/send/m.room.message/{self.next_txn()}",
                      {"msgtype": "m.text", "body": f"timed send {i}"}),
                  lambda v: None if v and "event_id" in v else "no event_id")
        self.cell(dim, "join", size,
                  lambda i: joiners[i].conn.timed("POST", f"/_matrix/client/v3/rooms/{r}/join", {}),
                  lambda v: None if v and v.get("room_id") == room else "join answer")

    def slider_for(self, room: str, size) -> User | None:
        """A user in the measured room plus 10 small rooms: an 11-room window."""
        if self.args.no_sliding:
            return None
        u = self.register("s")
        if not self.sliding_served(u):
            return None
        for k in range(10):
            rid = self.create_room(u, f"side room {k} of {size}", preset="private_chat")
            for m in range(3):
                self.send(u, rid, f"side {k}/{m}")
        self.join(u, room)
        return u

    # ---------------------------------------------------------------- dimensions
    def dim_events(self) -> None:
        sizes = self.args.events
        log(f"events dimension: {sizes}")
        nsamp = self.args.warmup + self.args.samples
        rooms = {}
        for n in sizes:
            a, b = self.register("a"), self.register("o")
            room = self.create_room(a, f"events {n}")
            self.join(b, room)
            rooms[n] = (a, b, room)
        t0 = time.time()
        self.parallel([lambda a=a, room=room, n=n: self.seed_messages(a, room, n, f"e{n}")
                       for n, (a, _, room) in rooms.items()])
        log(f"  seeded {sum(sizes)} messages in {time.time() - t0:.1f} s")
        for n in sizes:
            a, b, room = rooms[n]
            slider = self.slider_for(room, n)
            joiners = self.register_many(nsamp, "j")
            self.room_ops("events", n, room, a, b, slider, joiners)

    def dim_members(self) -> None:
        sizes = self.args.members
        log(f"members dimension: {sizes}")
        nsamp = self.args.warmup + self.args.samples
        pool = self.register_many(max(sizes) - 1, "m")
        log(f"  registered {len(pool)} members")
        rooms = {}
        for n in sizes:
            a = self.register("a")
            rooms[n] = (a, self.create_room(a, f"members {n}"))

        def fill(n, a, room):
            # One keep-alive connection per room, each join with its member's token; the
            # joins into one room stay sequential (concurrent joins would fork a DAG room).
            conn = Conn(self.base)
            t0 = time.time()
            for k, u in enumerate(pool[: n - 1], 1):
                conn.ok("POST", f"/_matrix/client/v3/rooms/{q(room)}/join", {}, token=u.token)
                if n >= 2000 and k % 1000 == 0:
                    log(f"  members {n}: joined {k} of {n - 1} ({time.time() - t0:.0f} s)")
            self.seed_messages(a, room, self.args.members_messages, f"m{n}")

        t0 = time.time()
        self.parallel([lambda n=n, a=a, room=room: fill(n, a, room) for n, (a, room) in rooms.items()])
        log(f"  joined {sum(s - 1 for s in sizes)} memberships in {time.time() - t0:.1f} s")
        for n in sizes:
            a, room = rooms[n]
            # The pool's users are in several of these rooms; the observer of this size
            # is a user of its own, so its initial sync holds exactly one room.
            observer = self.register("o")
            self.join(observer, room)
            slider = self.slider_for(room, n)
            joiners = self.register_many(nsamp, "j")
            self.room_ops("members", n, room, a, observer, slider, joiners)

    def dim_concurrency(self) -> None:
        levels, duration = self.args.concurrency, self.args.duration
        procs = self.args.clients_as == "processes"
        log(f"concurrency dimension: {levels} clients ({self.args.clients_as}), {duration} s each")
        for c in levels:
            users = self.register_many(c, "c")
            rooms = [self.create_room(u, f"concurrency {c}/{k}") for k, u in enumerate(users)]
            # Processes by default: threads of one Python process share its GIL, which
            # capped the 8-client figure near 3,900 sends/s whatever the server (the
            # client, not the server, was measured); a process per client is what
            # `wrk`'s separate connections are.
            ctx = multiprocessing.get_context("fork")
            barrier = ctx.Barrier(c + 1) if procs else threading.Barrier(c + 1)
            stop_at = ctx.Value("d", float("inf"), lock=False)
            results = ctx.Queue() if procs else queue.SimpleQueue()

            def worker(k):
                u, room = users[k], rooms[k]
                lat: list[float] = []
                errs = 0
                try:
                    conn = Conn(self.base, u.token)
                    txn = f"t{self.run_id}c{c}w{k}n"
                    for w in range(3):  # warm-up
                        conn.ok("PUT", f"/_matrix/client/v3/rooms/{q(room)}/send/m.room.message/{txn}w{w}",
                                {"msgtype": "m.text", "body": f"warm {w}"})
                    barrier.wait(timeout=120)
                    n = 0
                    while time.perf_counter() < stop_at.value:
                        n += 1
                        ms, status, _ = conn.timed(
                            "PUT", f"/_matrix/client/v3/rooms/{q(room)}/send/m.room.message/{txn}{n}",
                            {"msgtype": "m.text", "body": "throughput"})
                        if status == 200:
                            lat.append(ms)
                        else:
                            errs += 1
                except Exception as e:  # reported, not lost in a child process
                    log(f"  concurrency client {k} failed: {e!r}")
                    errs += 1
                    # The others (and the driver) must not wait for this client.
                    barrier.abort()
                results.put((k, lat, errs, time.perf_counter()))

            if procs:
                workers = [ctx.Process(target=worker, args=(k,)) for k in range(c)]
            else:
                workers = [threading.Thread(target=worker, args=(k,)) for k in range(c)]
            for w in workers:
                w.start()
            try:
                barrier.wait(timeout=120)
            except threading.BrokenBarrierError:
                pass  # a client failed while warming up: the level is recorded as failed below
            start = time.perf_counter()
            stop_at.value = start + duration
            got = {}
            try:
                for _ in range(c):
                    k, lat_k, e, end = results.get(timeout=duration + 120)
                    got[k] = (lat_k, e, end)
            except queue.Empty:
                log(f"  concurrency {c}: {c - len(got)} clients never answered")
            for w in workers:
                w.join(timeout=5)
                if procs and w.is_alive():
                    w.terminate()
            if len(got) < c or any(not lat_k for lat_k, _, _ in got.values()):
                rec = summarize("concurrency", "send_throughput", c, [], "per_s")
                rec["errors"] = sum(e for _, e, _ in got.values()) + c - len(got)
                self.cells.append(rec)
                log(f"  concurrency {c}: NO SAMPLES (a client failed; see above)")
                continue
            lat = [got[k][0] for k in range(c)]
            errs = [got[k][1] for k in range(c)]
            # Until the last client's last answer (CLOCK_MONOTONIC: one clock for all
            # processes), not until the processes were reaped.
            wall = max(got[k][2] for k in range(c)) - start
            all_lat = [x for xs in lat for x in xs]
            rate = len(all_lat) / wall
            rec = {
                "dimension": "concurrency", "op": "send_throughput", "size": c, "unit": "per_s",
                "samples": [rate], "median": rate, "sends": len(all_lat), "wall_s": round(wall, 3),
                "errors": sum(errs),
                "per_client": [len(x) for x in lat],
            }
            self.cells.append(rec)
            self.cells.append(summarize("concurrency", "send_latency_mean", c,
                                        [statistics.fmean(all_lat)] if all_lat else [], "ms"))
            self.cells.append(summarize("concurrency", "send_latency_p95", c,
                                        [percentile(all_lat, 95)] if all_lat else [], "ms"))
            log(f"  concurrency {c}: {rate:8.1f} sends/s, mean {statistics.fmean(all_lat) if all_lat else 0:.2f} ms, "
                f"p95 {percentile(all_lat, 95) if all_lat else 0:.2f} ms, errors {sum(errs)}")

    def dim_tenants(self) -> None:
        sizes = self.args.tenants
        log(f"tenants dimension: {sizes} strangers' events")
        nsamp = self.args.warmup + self.args.samples
        stranger = self.register("x")
        strooms = [self.create_room(stranger, f"strangers {k}") for k in range(4)]
        for k in sizes:
            t = self.register("t")
            mine = self.create_room(t, f"tenant {k}")
            self.send(t, mine, "hello")
            toks = self.devices(t, nsamp)
            since = self.sync_token(t)
            per = [k // 4 + (1 if j < k % 4 else 0) for j in range(4)]
            self.parallel([lambda j=j: self.seed_messages(stranger, strooms[j], per[j], f"x{k}") for j in range(4)])
            eid = self.send(t, mine, f"news after {k}")

            def check(v, eid=eid, mine=mine):
                if not v:
                    return "empty"
                joined = v.get("rooms", {}).get("join", {})
                if set(joined) != {mine}:
                    return f"rooms {sorted(joined)}"
                evs = joined[mine].get("timeline", {}).get("events", [])
                return None if [e.get("event_id") for e in evs] == [eid] else f"timeline {len(evs)} events"

            self.cell("tenants", "sync_incremental", k,
                      lambda i, since=since, toks=toks: t.conn.timed(
                          "GET", f"/_matrix/client/v3/sync?timeout=0&since={q(since)}", token=toks[i]),
                      check)

    def dim_rooms(self) -> None:
        """One user in N rooms: what a client with many rooms pays per request."""
        sizes, per = self.args.rooms, self.args.rooms_messages
        log(f"rooms dimension: {sizes} rooms per user, {per} messages each")
        nsamp = self.args.warmup + self.args.samples
        users = {n: self.register("r") for n in sizes}
        made: dict[int, list[str]] = {n: [] for n in sizes}
        total, done = sum(sizes), [0]

        def seed(n, k):
            # The user's thread-local connection: each seeding thread keeps one keep-alive
            # connection per user instead of one per room.
            u = users[n]
            rid = self.create_room(u, f"rooms {n}/{k}")
            for i in range(per):
                self.send(u, rid, f"r{n}/{k} message {i} " + "lorem ipsum " * 4)
            with self.lock:
                made[n].append(rid)
                done[0] += 1
                if done[0] % 100 == 0:
                    log(f"  created {done[0]} of {total} rooms")

        t0 = time.time()
        self.parallel([lambda n=n, k=k: seed(n, k) for n in sizes for k in range(n)])
        log(f"  seeded {total} rooms with {total * per} messages in {time.time() - t0:.1f} s")

        for n in sizes:
            u, rooms = users[n], sorted(made[n])
            want = set(rooms)
            # The active room: another user joins it and, for sync_incremental, sends one
            # message into it per sample.
            active = rooms[len(rooms) // 2]
            writer = self.register("w")
            self.join(writer, active)

            def all_rooms(v, want=want, n=n):
                joined = set((v or {}).get("rooms", {}).get("join", {}))
                return None if joined == want else f"join map has {len(joined)} rooms, {len(joined & want)} of {n} expected"

            toks = self.devices(u, nsamp)
            self.cell("rooms", "sync_initial", n,
                      lambda i, u=u, toks=toks: u.conn.timed("GET", "/_matrix/client/v3/sync?timeout=0", token=toks[i]),
                      all_rooms)

            if not self.args.no_sliding and self.sliding_served(u):
                def window(v, want=want, n=n):
                    count = (v or {}).get("lists", {}).get("all", {}).get("count")
                    got = set((v or {}).get("rooms", {}))
                    if count != n:
                        return f"list count {count} != {n}"
                    if len(got) != min(11, n) or not got <= want:
                        return f"window has {len(got)} rooms ({len(got & want)} of the user's), not {min(11, n)}"
                    return None

                self.cell("rooms", "sliding_window", n,
                          lambda i, u=u: u.conn.timed("POST", SLIDING_PATH + "?timeout=0", SLIDING_BODY), window)

            # sync_incremental: one new message in one of the N rooms since the last token;
            # the answer holds that room alone, with the message.
            state = {"since": self.sync_token(u)}

            def incremental(i, u=u, writer=writer, active=active, state=state):
                eid = self.send(writer, active, f"active {i}")
                ms, status, v = u.conn.timed("GET", f"/_matrix/client/v3/sync?timeout=0&since={q(state['since'])}")
                if status == 200:
                    state["since"] = v["next_batch"]
                    joined = v.get("rooms", {}).get("join", {})
                    evs = joined.get(active, {}).get("timeline", {}).get("events", [])
                    if not any(e.get("event_id") == eid for e in evs):
                        return ms, 200, {"_bad": f"new event {eid} missing"}
                    if len(joined) != 1:
                        return ms, 200, {"_bad": f"{len(joined)} rooms in the answer, not the active one alone"}
                return ms, status, v

            self.cell("rooms", "sync_incremental", n, incremental, lambda v: v.get("_bad") if v else "empty")

            # sync_poll: nothing new in any room; a different device per sample.
            toks = self.devices(u, nsamp)
            since = self.sync_token(u)
            self.cell("rooms", "sync_poll", n,
                      lambda i, u=u, toks=toks, since=since: u.conn.timed(
                          "GET", f"/_matrix/client/v3/sync?timeout=0&since={q(since)}", token=toks[i]),
                      lambda v: None if v is not None and not v.get("rooms", {}).get("join")
                      else f"poll not empty: {sorted((v or {}).get('rooms', {}).get('join', {}))[:3]}")

    def floor(self, when: str) -> None:
        """The trivial request (/versions): what the client and HTTP stack alone cost.

        Measured before every dimension and at the end, so it sees the same machine the
        cells around it saw; the `all` cell pools every floor sample of the round."""
        rec = self.cell("floor", "versions", when, lambda i: self.conn.timed("GET", "/_matrix/client/versions"),
                        lambda v: None if v and "versions" in v else "no versions")
        self.floor_samples.extend(rec["samples"])

    def run(self) -> dict:
        started = time.time()
        load_before = loadavg()
        log(f"{self.args.label}: {self.base}, dimensions {self.args.dimensions}, load {load_before}")
        for d in self.args.dimensions:
            self.floor(d)
            getattr(self, f"dim_{d}")()
        self.floor("end")
        self.cells.append(summarize("floor", "versions", "all", self.floor_samples, "ms"))
        a = self.args
        return {
            "format": 1,
            "label": a.label,
            "base": self.base,
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "duration_s": round(time.time() - started, 1),
            "load_before": load_before,
            "load_after": loadavg(),
            "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
            "params": {
                "dimensions": a.dimensions, "events": a.events, "members": a.members,
                "members_messages": a.members_messages, "concurrency": a.concurrency,
                "duration_s": a.duration, "tenants": a.tenants, "rooms": a.rooms,
                "rooms_messages": a.rooms_messages, "samples": a.samples, "warmup": a.warmup,
                "preset": a.preset, "clients_as": a.clients_as,
            },
            "meta": dict(kv.split("=", 1) for kv in a.meta),
            "skipped": {k: v for k, v in self.skipped.items() if k != "sliding"},
            "cells": self.cells,
        }


def percentile(xs: list[float], p: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(dimension, op, size, samples, unit) -> dict:
    rec = {"dimension": dimension, "op": op, "size": size, "unit": unit,
           "samples": [round(x, 4) for x in samples]}
    if samples:
        rec.update(median=round(statistics.median(samples), 4), mean=round(statistics.fmean(samples), 4),
                   p95=round(percentile(samples, 95), 4), min=round(min(samples), 4))
    return rec


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


DIMENSIONS = ("events", "members", "concurrency", "tenants", "rooms")
DEFAULT_DIMENSIONS = ("events", "members", "concurrency", "tenants")
QUICK = {"dimensions": ",".join(DIMENSIONS), "events": "50,200", "members": "10,40", "concurrency": "1,4",
         "tenants": "0,50", "rooms": "3,6", "duration": 2.0, "samples": 5, "warmup": 1, "members_messages": 5}
# Issue 18 item 6: members up to 5,000, events up to 50,000 per room, a user in 500 rooms.
BIG = {"dimensions": ",".join(DIMENSIONS), "events": "200,3200,50000", "members": "50,800,5000",
       "rooms": "50,200,500"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="http://127.0.0.1:8008", help="server base URL")
    p.add_argument("--label", default="server", help="name written into the results")
    p.add_argument("--out", help="write the JSON results here (default: stdout)")
    p.add_argument("--dimensions", default=",".join(DEFAULT_DIMENSIONS),
                   help="comma list of: " + ", ".join(DIMENSIONS) + " (default: all but rooms)")
    p.add_argument("--events", default="200,800,3200", help="messages per room (events dimension)")
    p.add_argument("--members", default="50,200,800", help="joined members per room (members dimension)")
    p.add_argument("--members-messages", type=int, default=20, help="messages in each members room")
    p.add_argument("--concurrency", default="1,2,4,8", help="client counts (concurrency dimension)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per concurrency level")
    p.add_argument("--clients-as", choices=("processes", "threads"), default="processes",
                   help="concurrency clients as one process each (default) or threads of the driver "
                        "(the sittings before 2026-12-06c: their GIL capped the 8-client figure)")
    p.add_argument("--tenants", default="0,50,200,800", help="strangers' events (tenants dimension)")
    p.add_argument("--rooms", default="50,200,500", help="rooms one user is in (rooms dimension)")
    p.add_argument("--rooms-messages", type=int, default=5, help="messages in each of those rooms")
    p.add_argument("--samples", type=int, default=10, help="timed samples per cell")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up requests per cell")
    p.add_argument("--no-sliding", action="store_true", help="do not probe or time sliding_window")
    p.add_argument("--ops", default="",
                   help="comma list of per-room operations to time (default: all), e.g. "
                        "sliding_window; the rooms are seeded the same either way")
    p.add_argument("--meta", action="append", default=[], help="KEY=VALUE recorded in the results")
    preset = p.add_mutually_exclusive_group()
    preset.add_argument("--quick", action="store_true",
                        help="smoke sizes, every dimension: events 50,200; members 10,40; concurrency 1,4 "
                             "for 2 s; tenants 0,50; rooms 3,6; 5 samples, 1 warm-up")
    preset.add_argument("--big", action="store_true",
                        help="issue 18's bigger shapes, every dimension: events 200,3200,50000; "
                             "members 50,800,5000; rooms 50,200,500 (long to seed on Synapse)")
    a = p.parse_args()
    # A preset changes the defaults only: an option given explicitly still wins.
    if a.quick or a.big:
        p.set_defaults(**(QUICK if a.quick else BIG))
        a = p.parse_args()
    a.preset = "quick" if a.quick else "big" if a.big else ""
    a.dimensions = [d.strip() for d in a.dimensions.split(",") if d.strip()]
    a.ops = {o.strip() for o in a.ops.split(",") if o.strip()}
    for d in a.dimensions:
        if d not in DIMENSIONS:
            p.error(f"unknown dimension {d}")
    a.events, a.members, a.concurrency, a.tenants, a.rooms = map(
        ints, (a.events, a.members, a.concurrency, a.tenants, a.rooms))
    if any(r < 1 for r in a.rooms):
        p.error("rooms sizes must be >= 1")
    if any(m < 2 for m in a.members):
        p.error("members sizes must be >= 2")
    result = Bench(a).run()
    text = json.dumps(result, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
        log(f"wrote {a.out}")
    else:
        print(text)


if __name__ == "__main__":
    main()
