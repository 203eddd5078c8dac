#!/usr/bin/env python3
"""Big-room joins and time to decrypt across servers (issue 13, "Measure").

Joins. A Synapse (the resident, R) hosts public rooms of N members (default 100, 1,000
and 5,000; built through Synapse's admin API). Each round starts two fresh joining
servers, one Spindle (P) and one Synapse (S), so every join is a first join into a
room the joiner has never seen (both join with partial state: Spindle by MSC3902,
Synapse by its own faster joins); the order of the two alternates by round. For each
join it times, from the start of POST /join:
  joined    POST /join returning;
  sent      the first PUT /send after it returning (the user can talk);
  members   GET /members returning the full list (N + 1 joined, or N + 2 for the
            second joiner; both servers wait for the resync), polled until it has
            everyone.
At the end of a round the joiners leave every room (each round joins rooms of N) and
keep running to the end of the sitting: later joiners verify their events, and with
no notary configured a stopped server's key could not be fetched.
RSS of the joiners is read after their joins, and of R idle and after the rooms exist.

Decrypt. One matrix-nio client with encryption on each side of an encrypted room; the
sender's room_send returning until the receiver's long-polling sync has the event
decrypted: the first message of a sender (a new Megolm session: the room key crosses
as an Olm to-device message) and the next ones (the session is known). Pairs:
Spindle -> Synapse, Synapse -> Spindle and, as the reference, Synapse -> Synapse.

Usage: SPINDLE_BIN=target/release/spindle SYNAPSE_PYTHON=... \\
       scripts/bench/federation_join.py [--rounds 3] [--members 100,1000,5000]
       [--decrypt-samples 10] [--out FILE.json]
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent / "tests" / "e2e"))

import conftest  # noqa: E402
from test_federation_synapse import (  # noqa: E402
    Client, Synapse, SynapseAdmin, _nio_decrypts, _nio_settle, make_cert, q,
    spindle_for_synapse, wait_until,
)


def rss_mb(pid: int) -> float:
    """Resident set size of a process in MiB (VmRSS of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def new_synapse(root: Path, cert: Path, key: Path) -> Synapse:
    root.mkdir(parents=True)
    s = Synapse(root, conftest.free_loopback_port(), conftest.free_loopback_port(), cert, key)
    s.start()
    return s


def timed_join(joiner: Client, alias: str, room: str, expect: int) -> dict[str, float]:
    """ms from the start of POST /join to: it returning, the first send returning, and
    /members listing `expect` joined members."""
    t0 = time.monotonic()
    got = joiner.call("POST", f"/_matrix/client/v3/join/{q(alias)}", {}, timeout=600)
    assert got["room_id"] == room, got
    joined = time.monotonic()
    joiner.send(room, "first words")
    sent = time.monotonic()
    deadline = t0 + 600
    while True:
        chunk = joiner.call("GET", f"/_matrix/client/v3/rooms/{q(room)}/members?membership=join", timeout=600)["chunk"]
        if len(chunk) >= expect or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    members = time.monotonic()
    assert len(chunk) == expect, f"{len(chunk)} members listed, wanted {expect}"
    ms = lambda t: round((t - t0) * 1000, 1)  # noqa: E731
    return {"joined": ms(joined), "sent": ms(sent), "members": ms(members)}


def bench_joins(args, root: Path, cert: Path, key: Path, results: dict) -> None:
    sizes = [int(x) for x in args.members.split(",") if x]
    resident = new_synapse(root / "resident", cert, key)
    done: list = []
    try:
        results["rss_mb"]["resident idle"] = rss_mb(resident.proc.pid)
        admin = SynapseAdmin.register_on(resident)
        rooms = {}
        for n in sizes:
            t = time.monotonic()
            room = admin.call("POST", "/_matrix/client/v3/createRoom", {
                "preset": "public_chat", "room_alias_name": f"big{n}", "name": f"{n} members",
            })["room_id"]
            admin.add_members(room, resident.server_name, f"m{n}", n - 1)
            rooms[n] = room
            print(f"built a room of {n} members on Synapse in {time.monotonic() - t:.0f} s", flush=True)
        results["rss_mb"]["resident with rooms"] = rss_mb(resident.proc.pid)
        for rnd in range(args.rounds):
            spindle = spindle_for_synapse(os.environ["SPINDLE_BIN"], root / f"p{rnd}", cert, key)
            spindle.start(timeout=60)
            synapse = new_synapse(root / f"s{rnd}", cert, key)
            done.extend([synapse, spindle])
            joiners = {"spindle": (spindle, Client(spindle.base_url)), "synapse": (synapse, Client(synapse.base_url))}
            for name, (_, c) in joiners.items():
                c.register(f"joiner{rnd}")
            results["rss_mb"].setdefault("spindle joiner before", []).append(rss_mb(spindle.proc.pid))
            results["rss_mb"].setdefault("synapse joiner before", []).append(rss_mb(synapse.proc.pid))
            for n in sizes:
                order = ["spindle", "synapse"] if rnd % 2 == 0 else ["synapse", "spindle"]
                for i, name in enumerate(order):
                    _, c = joiners[name]
                    # The first joiner of the round is member N + 1; the second N + 2.
                    got = timed_join(c, f"#big{n}:{resident.server_name}", rooms[n], n + 1 + i)
                    results["joins"].setdefault(f"{name} {n}", []).append(got)
                    print(f"round {rnd} {name:8s} {n:5d} members: {got}", flush=True)
            results["rss_mb"].setdefault("spindle joiner after", []).append(rss_mb(spindle.proc.pid))
            results["rss_mb"].setdefault("synapse joiner after", []).append(rss_mb(synapse.proc.pid))
            # Leave, so every round joins a room of N; the joiners keep running
            # until the end: the next rounds' joiners verify their events (with no
            # notary configured, a stopped server's key cannot be fetched and a
            # resync could not complete).
            for name, (_, c) in joiners.items():
                for n in sizes:
                    c.call("POST", f"/_matrix/client/v3/rooms/{q(rooms[n])}/leave", {})
            for n in sizes:
                wait_until(f"the joiners gone from the room of {n}",
                           lambda: len(admin.call("GET", f"/_matrix/client/v3/rooms/{q(rooms[n])}/joined_members")["joined"]) == n,
                           timeout=120)
    finally:
        for server in done:
            server.stop()
        resident.stop()


async def _decrypt_pair(a_url: str, b_url: str, store: Path, tag: str, samples: int) -> dict[str, list[float]]:
    """A (on a_url) creates an encrypted room, invites B (on b_url); then A sends
    `samples` messages, each timed until B holds it decrypted."""
    from nio import AsyncClient, AsyncClientConfig, RoomSendResponse

    cfg = AsyncClientConfig(encryption_enabled=True, store_sync_tokens=False, max_timeouts=2, request_timeout=60)
    clients = []
    try:
        for side, url in (("a", a_url), ("b", b_url)):
            (store / f"{tag}{side}").mkdir(parents=True)
            c = AsyncClient(url, store_path=str(store / f"{tag}{side}"), config=cfg)
            await c.register(f"{tag}{side}", f"pw-{tag}{side}", device_name=f"{tag}{side}")
            await _nio_settle(c, "settle", full_state=False)
            await _nio_settle(c, "settle", full_state=False)
            clients.append(c)
        a, b = clients
        created = await a.room_create(
            name=tag, invite=[b.user_id],
            initial_state=[{"type": "m.room.encryption", "state_key": "", "content": {"algorithm": "m.megolm.v1.aes-sha2"}}],
        )
        room = created.room_id
        for _ in range(120):
            resp = await _nio_settle(b, "invite", full_state=False)
            if room in resp.rooms.invite:
                break
            await asyncio.sleep(0.25)
        await b.join(room)
        for _ in range(120):
            await _nio_settle(a, "settle", full_state=False)
            if room in a.rooms and b.user_id in a.rooms[room].users:
                break
            await asyncio.sleep(0.25)
        for _ in range(3):
            await _nio_settle(a, "settle", full_state=False)
            await _nio_settle(b, "settle", full_state=False)
        out: dict[str, list[float]] = {"first": [], "next": []}
        for i in range(samples):
            sent = await a.room_send(room, "m.room.message", {"msgtype": "m.text", "body": f"{tag} {i}"},
                                     ignore_unverified_devices=True)
            assert isinstance(sent, RoomSendResponse), sent
            t0 = time.monotonic()
            await _nio_decrypts(b, room, sent.event_id, f"{tag} {i}", rounds=12, timeout_ms=5000, pause=0)
            out["first" if i == 0 else "next"].append(round((time.monotonic() - t0) * 1000, 1))
        return out
    finally:
        for c in clients:
            await c.close()


def bench_decrypt(args, root: Path, cert: Path, key: Path, results: dict) -> None:
    spindle = spindle_for_synapse(os.environ["SPINDLE_BIN"], root / "dp", cert, key)
    spindle.start(timeout=60)
    syn_a = new_synapse(root / "da", cert, key)
    syn_b = new_synapse(root / "db", cert, key)
    try:
        pairs = [
            ("spindle->synapse", spindle.base_url, syn_a.base_url),
            ("synapse->spindle", syn_a.base_url, spindle.base_url),
            ("synapse->synapse", syn_b.base_url, syn_a.base_url),
        ]
        for rnd in range(args.rounds):
            for name, a_url, b_url in (pairs if rnd % 2 == 0 else list(reversed(pairs))):
                got = asyncio.run(_decrypt_pair(a_url, b_url, root / "nio", f"d{rnd}{name[:2]}{name[-2:]}", args.decrypt_samples))
                for k, v in got.items():
                    results["decrypt_ms"].setdefault(f"{name} {k}", []).extend(v)
                print(f"round {rnd} {name}: {got}", flush=True)
    finally:
        syn_b.stop()
        syn_a.stop()
        spindle.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--members", default="100,1000,5000")
    ap.add_argument("--decrypt-samples", type=int, default=10, help="messages per pair and round (0: skip)")
    ap.add_argument("--skip-joins", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="spindle-joinbench-"))
    cert, key = make_cert(root)
    results: dict = {"joins": {}, "decrypt_ms": {}, "rss_mb": {}, "rounds": args.rounds, "members": args.members}
    if not args.skip_joins:
        bench_joins(args, root, cert, key, results)
    if args.decrypt_samples:
        bench_decrypt(args, root, cert, key, results)

    def med(xs):
        return statistics.median(xs) if xs else float("nan")

    print("\njoin into a Synapse room, ms from POST /join (median of rounds):")
    print(f"  {'joiner':9s} {'members':>7s} {'joined':>9s} {'sent':>9s} {'members':>9s}")
    for k, v in results["joins"].items():
        name, n = k.split()
        print(f"  {name:9s} {n:>7s} {med([x['joined'] for x in v]):9.0f} {med([x['sent'] for x in v]):9.0f} {med([x['members'] for x in v]):9.0f}")
    print("time to decrypt on the other server, ms (median, n):")
    for k, v in results["decrypt_ms"].items():
        print(f"  {k:28s} {med(v):8.0f}  n={len(v)}")
    print("RSS (MiB):")
    for k, v in results["rss_mb"].items():
        print(f"  {k:28s} {v if isinstance(v, float) else [round(x) for x in v]}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
