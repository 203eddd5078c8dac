"""End-to-end: the real `spindle` binary driven by an unmodified matrix-nio client.

One scenario, in steps that run in file order against one server (module fixture
`spindle` from conftest.py). Each step records what it established in `World`; a step
whose prerequisite failed fails at once with a message naming that prerequisite.

    1. two users register (nio's own dummy-auth call, and the full UIA 401/session dance)
    2. A creates a private room inviting B; B sees it under rooms.invite, joins;
       both do a full-state initial sync
    3. each sends 60 messages (alternating); both sync incrementally until caught up
       and see all 120 exactly once, in send order; fresh initial syncs agree
    4. B paginates /messages backwards (limit 25) to m.room.create: no gap, no duplicate
    5. a long-polling /sync wakes within 1 s of a send, and honours its timeout when idle
    6. B leaves: the room shows under rooms.leave once, and B never sees A's next 3
       messages (sync, /messages, /event)
    7. the server restarts on the same data directory: accounts, tokens and history kept
    8. SIGKILL right after acknowledged sends loses none of them
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
import uuid
import warnings
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from nio import (
    AsyncClient,
    AsyncClientConfig,
    DevicesResponse,
    JoinedMembersResponse,
    JoinResponse,
    LoginResponse,
    MessageDirection,
    RegisterResponse,
    RoomCreateResponse,
    RoomGetEventResponse,
    RoomLeaveResponse,
    RoomMessagesResponse,
    RoomPreset,
    RoomSendResponse,
    SyncResponse,
    UploadFilterResponse,
    WhoamiResponse,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

PER_USER = 60  # messages each user sends
TOTAL = 2 * PER_USER
PAGE = 25  # /messages page size
AFTER_LEAVE = 3  # messages A sends after B left
CALL_TIMEOUT = 30.0  # seconds for any single client call
TIMELINE_LIMIT = 1000  # large enough that no sync in this test should be `limited`
ROOM_FILTER = {"room": {"timeline": {"limit": TIMELINE_LIMIT}}}
LONG_POLL_MS = 10_000
WAKE_LIMIT_S = 1.0

RUN = uuid.uuid4().hex[:8]


# -- helpers --------------------------------------------------------------------------


class World:
    """What the steps established, shared between them."""

    def __init__(self, server):
        self.server = server
        self.clients: list[AsyncClient] = []
        self.done: set[str] = set()
        self.users: dict[str, dict[str, str]] = {}  # "A"/"B" -> localpart, password, user_id
        self.c: dict[str, AsyncClient] = {}  # "A"/"B" -> logged-in client
        self.filt: dict[str, Any] = {}  # "A"/"B" -> filter id or inline filter
        self.tok: dict[str, str] = {}  # "A"/"B" -> latest next_batch
        self.room_id: str = ""
        self.sent: list[tuple[str, str, str]] = []  # (event_id, sender user_id, body)
        self.after_leave: list[str] = []  # event ids A sent after B left
        self.leave_event_id: str | None = None
        self.history_before_restart: list[str] = []

    def client(self) -> AsyncClient:
        cfg = AsyncClientConfig(
            max_limit_exceeded=0,
            max_timeouts=2,
            request_timeout=CALL_TIMEOUT,
            backoff_factor=0.1,
            store_sync_tokens=False,
            encryption_enabled=False,
        )
        c = AsyncClient(self.server.base_url, config=cfg)
        self.clients.append(c)
        return c

    def require(self, *steps: str) -> None:
        missing = [s for s in steps if s not in self.done]
        if missing:
            pytest.fail(f"prerequisite step(s) {missing} did not complete (see the earlier failure)")

    @property
    def sent_ids(self) -> list[str]:
        return [e for e, _, _ in self.sent]


def src(ev: Any) -> dict:
    """The event as the server sent it (nio keeps it in `.source`)."""
    s = getattr(ev, "source", None)
    if not isinstance(s, dict):
        return {}
    content = getattr(ev, "content", None)
    if "content" not in s and isinstance(content, dict):
        # nio pops `content` out of the source of stripped (invite) member events.
        s = {**s, "content": content}
    return s


def status_of(resp: Any) -> Any:
    tr = getattr(resp, "transport_response", None)
    return getattr(tr, "status", None)


def ok(resp: Any, cls: type, what: str):
    if not isinstance(resp, cls):
        pytest.fail(
            f"{what}: expected {cls.__name__}, got {type(resp).__name__} "
            f"(HTTP {status_of(resp)}): {resp}"
        )
    return resp


async def bounded(coro, what: str, timeout: float = CALL_TIMEOUT):
    try:
        return await asyncio.wait_for(coro, timeout)
    except asyncio.TimeoutError:
        pytest.fail(f"{what}: no answer within {timeout:.0f}s")


async def raw(server, method: str, path: str, token: str | None = None, body: Any = None):
    """A raw HTTP call (for what nio hides: the UIA 401, and diagnostics)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as s:
        async with s.request(
            method,
            server.base_url + path,
            json=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT),
        ) as r:
            text = await r.text()
            try:
                data = json.loads(text)
            except ValueError:
                data = None
            return r.status, data, text


async def sync(
    w: World,
    who: str | AsyncClient,
    since: str | None,
    *,
    timeout_ms: int = 0,
    full_state: bool | None = None,
    filt: Any = None,
    what: str = "sync",
) -> SyncResponse:
    client = w.c[who] if isinstance(who, str) else who
    if filt is None:
        filt = w.filt.get(who, ROOM_FILTER) if isinstance(who, str) else ROOM_FILTER
    # nio substitutes its own last token when `since` is falsy: make it use ours.
    client.next_batch = since or ""
    client_timeout = timeout_ms / 1000 + 15 if timeout_ms else CALL_TIMEOUT
    resp = await bounded(
        client.sync(timeout=timeout_ms, sync_filter=filt, since=since, full_state=full_state),
        what,
        client_timeout,
    )
    if not isinstance(resp, SyncResponse):
        q = {"timeout": "0"}
        if since:
            q["since"] = since
        if filt is not None:
            q["filter"] = filt if isinstance(filt, str) else json.dumps(filt)
        st, _, text = await raw(
            w.server, "GET", "/_matrix/client/v3/sync?" + urllib.parse.urlencode(q), client.access_token
        )
        pytest.fail(
            f"{what}: nio could not take the /sync answer: {type(resp).__name__} "
            f"(HTTP {status_of(resp)}) {resp}\nraw re-request: HTTP {st} {text[:3000]}"
        )
    assert isinstance(resp.next_batch, str) and resp.next_batch, f"{what}: empty next_batch"
    return resp


def room_sections(resp: SyncResponse, room_id: str) -> list[str]:
    return [s for s in ("join", "invite", "leave") if room_id in getattr(resp.rooms, s)]


def timeline(resp: SyncResponse, room_id: str, section: str = "join") -> list[dict]:
    info = getattr(resp.rooms, section).get(room_id)
    return [src(e) for e in info.timeline.events] if info else []


def state_events(resp: SyncResponse, room_id: str, section: str = "join") -> list[dict]:
    info = getattr(resp.rooms, section).get(room_id)
    return [src(e) for e in info.state] if info else []


def all_event_ids(resp: SyncResponse) -> set[str]:
    ids = set()
    for section in ("join", "leave"):
        for info in getattr(resp.rooms, section).values():
            for e in list(info.timeline.events) + list(info.state):
                if src(e).get("event_id"):
                    ids.add(src(e)["event_id"])
    for info in resp.rooms.invite.values():
        for e in info.invite_state:
            if src(e).get("event_id"):
                ids.add(src(e)["event_id"])
    return ids


def messages(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("type") == "m.room.message"]


def member(events: list[dict], user_id: str, membership: str) -> list[dict]:
    return [
        e
        for e in events
        if e.get("type") == "m.room.member"
        and e.get("state_key") == user_id
        and (e.get("content") or {}).get("membership") == membership
    ]


def dupes(ids: list[str]) -> list[str]:
    seen, out = set(), []
    for i in ids:
        if i in seen:
            out.append(i)
        seen.add(i)
    return out


async def catch_up(w: World, who: str, since: str, want: set[str], what: str, events: list[dict] | None = None):
    """Incremental syncs from `since` until every id in `want` was seen and a further
    sync brings no new message event; gives up after three empty 2-second long-polls
    while something is still missing (the caller's assertions then say what).
    Returns (timeline events in order, last token, numbers of the syncs that were `limited`)."""
    room = w.room_id
    events = [] if events is None else events
    limited: list[int] = []
    token = since
    empty_polls = 0
    for n in range(1, 200):
        have = {e.get("event_id") for e in events}
        caught = want <= have
        resp = await sync(w, who, token, timeout_ms=0 if caught else 2000, what=f"{what} #{n}")
        info = resp.rooms.join.get(room)
        new = timeline(resp, room)
        if info is not None and info.timeline.limited:
            limited.append(n)
        events.extend(new)
        token = resp.next_batch
        if messages(new):
            empty_polls = 0
        elif caught:
            return events, token, limited
        else:
            empty_polls += 1
            if empty_polls >= 3:
                return events, token, limited
    pytest.fail(f"{what}: still receiving new messages after 200 syncs")


def first_diff(xs: list, ys: list) -> str:
    for i, (x, y) in enumerate(zip(xs, ys)):
        if x != y:
            return f"first difference at index {i}: {x} vs {y}"
    return f"lengths {len(xs)} vs {len(ys)}"


async def paginate_back(client: AsyncClient, room_id: str, start: str | None, what: str, limit: int = PAGE):
    """GET /messages dir=b from `start`, `end` as the next `from`, until the chunk is empty
    or `end` is missing. Returns (events newest first, number of pages)."""
    events: list[dict] = []
    token = start
    for page in range(1, 200):
        resp = await bounded(
            client.room_messages(room_id, start=token, direction=MessageDirection.back, limit=limit),
            f"{what} page {page}",
        )
        ok(resp, RoomMessagesResponse, f"{what} page {page} (from={token!r})")
        assert len(resp.chunk) <= limit, f"{what} page {page}: {len(resp.chunk)} events for limit={limit}"
        events.extend(src(e) for e in resp.chunk)
        if not resp.chunk or not resp.end:
            return events, page
        assert resp.end != token, f"{what} page {page}: `end` equals `from` ({token!r}) with a non-empty chunk"
        token = resp.end
    pytest.fail(f"{what}: more than 200 pages")


def describe(events: list[dict], n: int = 8) -> str:
    def one(e):
        c = e.get("content") or {}
        extra = c.get("membership") or c.get("body") or ""
        return f"{e.get('type')}[{e.get('state_key', '')}] {extra} {e.get('event_id')}"

    head = [one(e) for e in events[:n]]
    more = f" ... (+{len(events) - n})" if len(events) > n else ""
    return "; ".join(head) + more


# -- the scenario -----------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def world(spindle):
    w = World(spindle)
    yield w
    for c in w.clients:
        try:
            await c.close()
        except Exception:  # noqa: BLE001 - closing only
            pass


async def test_01_register_two_users(world: World):
    w = world
    server_name = w.server.server_name

    # A: nio's own register(), which posts auth {"type": "m.login.dummy"} directly.
    a_name, a_pw = f"alice{RUN}", f"pw-a-{uuid.uuid4().hex}"
    a = w.client()
    r = await bounded(a.register(a_name, a_pw, device_name="e2e A"), "register A")
    ok(r, RegisterResponse, "register A (nio register, m.login.dummy)")
    assert r.user_id == f"@{a_name}:{server_name}"
    assert r.access_token and r.device_id

    # B: the full user-interactive dance: 401 with flows + session, then dummy + session.
    b_name, b_pw = f"bob{RUN}", f"pw-b-{uuid.uuid4().hex}"
    st, body, text = await raw(
        w.server, "POST", "/_matrix/client/v3/register", body={"username": b_name, "password": b_pw}
    )
    assert st == 401, f"register without auth: expected 401 (UIA), got {st}: {text[:500]}"
    assert isinstance(body, dict) and isinstance(body.get("session"), str) and body["session"], text[:500]
    stages = [f.get("stages") for f in body.get("flows", [])]
    assert ["m.login.dummy"] in stages, f"no flow with stages ['m.login.dummy']: {stages}"
    b = w.client()
    r = await bounded(b.register(b_name, b_pw, device_name="e2e B", session_token=body["session"]), "register B")
    ok(r, RegisterResponse, "register B (m.login.dummy with session)")
    assert r.user_id == f"@{b_name}:{server_name}"
    assert r.access_token and r.device_id
    assert a.access_token != b.access_token

    for key, c, name, pw in (("A", a, a_name, a_pw), ("B", b, b_name, b_pw)):
        who = ok(await bounded(c.whoami(), f"whoami {key}"), WhoamiResponse, f"whoami {key}")
        assert who.user_id == c.user_id
        assert who.device_id == c.device_id
        w.users[key] = {"localpart": name, "password": pw, "user_id": c.user_id}
        w.c[key] = c

    # A syncs with an uploaded filter (by id), B with an inline JSON filter.
    f = await bounded(a.upload_filter(room=ROOM_FILTER["room"]), "upload filter A")
    ok(f, UploadFilterResponse, "POST /user/{userId}/filter")
    assert f.filter_id
    w.filt["A"] = f.filter_id
    w.filt["B"] = ROOM_FILTER
    w.done.add("registered")


async def test_02_private_room_invite_join(world: World):
    w = world
    w.require("registered")
    a, b = w.c["A"], w.c["B"]
    a_id, b_id = a.user_id, b.user_id

    r = await bounded(
        a.room_create(name=f"e2e {RUN}", preset=RoomPreset.private_chat, invite=[b_id]), "createRoom"
    )
    ok(r, RoomCreateResponse, "createRoom (private_chat, invite B)")
    assert r.room_id.startswith("!")
    room = w.room_id = r.room_id

    # B sees the invite in /sync before joining (initial sync, then long-polls if needed).
    resp = await sync(w, "B", None, full_state=True, what="B initial sync (invited)")
    deadline = time.monotonic() + 10
    while room not in resp.rooms.invite and time.monotonic() < deadline:
        assert room not in resp.rooms.join, "B is listed as joined before joining"
        resp = await sync(w, "B", resp.next_batch, timeout_ms=2000, what="B sync waiting for invite")
    assert room in resp.rooms.invite, f"room never appeared under rooms.invite for B; sections: {room_sections(resp, room)}"
    assert room not in resp.rooms.join
    invite_state = [src(e) for e in resp.rooms.invite[room].invite_state]
    assert invite_state, "invite_state is empty"
    mine = member(invite_state, b_id, "invite")
    assert mine, f"invite_state has no m.room.member invite for B: {describe(invite_state, 20)}"
    assert mine[0].get("sender") == a_id

    j = await bounded(b.join(room), "B join")
    ok(j, JoinResponse, "B join")
    assert j.room_id == room

    jm = ok(await bounded(a.joined_members(room), "joined_members"), JoinedMembersResponse, "joined_members")
    assert sorted(m.user_id for m in jm.members) == sorted([a_id, b_id])

    # Full-state initial syncs: both see the room as joined with both members joined.
    for key in ("A", "B"):
        s = await sync(w, key, None, full_state=True, what=f"{key} initial full-state sync")
        assert room in s.rooms.join, f"{key}: room not under rooms.join: {room_sections(s, room)}"
        assert room not in s.rooms.invite, f"{key}: room still under rooms.invite after join"
        evs = state_events(s, room) + timeline(s, room)
        assert [e for e in evs if e.get("type") == "m.room.create"], f"{key}: no m.room.create in state+timeline"
        for uid in (a_id, b_id):
            assert member(evs, uid, "join"), f"{key}: no join member event for {uid}: {describe(evs, 30)}"
        jr = [e for e in evs if e.get("type") == "m.room.join_rules"]
        assert jr and jr[-1]["content"].get("join_rule") == "invite", f"{key}: join_rules {jr}"
        w.tok[key] = s.next_batch
    w.done.add("room")


async def test_03_exchange_and_sync_120_messages(world: World):
    w = world
    w.require("room")
    room = w.room_id
    since = dict(w.tok)

    # Clients sync while the messages are sent (A every 10 sends, B every 7), as real
    # clients do: many incremental syncs, so many token boundaries to get right.
    streams: dict[str, list[dict]] = {"A": [], "B": []}
    limited: dict[str, list[str]] = {"A": [], "B": []}
    tokens = dict(since)
    for i in range(TOTAL):
        key = "A" if i % 2 == 0 else "B"
        c = w.c[key]
        body = f"e2e {RUN} #{i:03d} from {key}"
        txn = f"e2e-{RUN}-{i}"
        content = {"msgtype": "m.text", "body": body}
        r = await bounded(c.room_send(room, "m.room.message", content, tx_id=txn), f"send #{i}")
        ok(r, RoomSendResponse, f"send #{i} by {key}")
        assert isinstance(r.event_id, str) and r.event_id.startswith("$"), r.event_id
        if i == 0:
            # Same transaction id from the same device: same event, no second message.
            again = await bounded(c.room_send(room, "m.room.message", content, tx_id=txn), "resend #0")
            ok(again, RoomSendResponse, "resend #0 with the same txn id")
            assert again.event_id == r.event_id, "same txn id gave a different event id"
        w.sent.append((r.event_id, c.user_id, body))
        for k, every in (("A", 10), ("B", 7)):
            if (i + 1) % every == 0:
                s = await sync(w, k, tokens[k], what=f"{k} sync after send #{i}")
                tokens[k] = s.next_batch
                streams[k].extend(timeline(s, room))
                info = s.rooms.join.get(room)
                if info is not None and info.timeline.limited:
                    limited[k].append(f"after send #{i}")

    ids = w.sent_ids
    assert not dupes(ids), f"send returned duplicate event ids: {dupes(ids)[:5]}"
    by_id = {e: (s, body) for e, s, body in w.sent}

    seen: dict[str, list[dict]] = {}
    for key in ("A", "B"):
        events, token, lim = await catch_up(w, key, tokens[key], set(ids), f"{key} incremental sync", streams[key])
        w.tok[key] = token
        limited[key] += [f"catch-up #{n}" for n in lim]
        assert not limited[key], f"{key}: syncs {limited[key]} were `limited` despite timeline limit {TIMELINE_LIMIT}"
        msgs = messages(events)
        got = [e["event_id"] for e in msgs]
        assert not dupes(got), f"{key}: messages delivered more than once: {dupes(got)[:5]}"
        assert len(got) == TOTAL, f"{key}: {len(got)} messages seen by sync, expected {TOTAL}"
        assert got == ids, f"{key}: sync order differs from send order; {first_diff(got, ids)}"
        for e in msgs:
            sender, body = by_id[e["event_id"]]
            assert e.get("sender") == sender, f"{key}: {e['event_id']} sender {e.get('sender')} != {sender}"
            assert (e.get("content") or {}).get("body") == body, f"{key}: {e['event_id']} body differs"
            assert e.get("room_id") in (None, room)
        seen[key] = msgs
    assert [e["event_id"] for e in seen["A"]] == [e["event_id"] for e in seen["B"]]

    # A fresh full-state initial sync (no `since`) agrees. A server may cap the timeline
    # (then `limited` is set): the rest must come from /messages at `prev_batch`, as a
    # client would fetch it, with no gap or overlap at the seam.
    for key in ("A", "B"):
        s = await sync(w, key, None, full_state=True, what=f"{key} fresh initial sync")
        info = s.rooms.join.get(room)
        assert info is not None, f"{key}: room missing from fresh initial sync"
        got = [e["event_id"] for e in messages(timeline(s, room))]
        if info.timeline.limited:
            assert got, f"{key}: fresh initial sync is `limited` with no message in its timeline"
            assert info.timeline.prev_batch, f"{key}: `limited` timeline without prev_batch"
            older, _ = await paginate_back(w.c[key], room, info.timeline.prev_batch, f"{key} /messages from prev_batch")
            got = list(reversed([e["event_id"] for e in messages(older)])) + got
        assert got == ids, f"{key}: fresh initial sync (+ prev_batch): {len(got)} messages; {first_diff(got, ids)}"
    w.done.add("messages")


async def test_04_paginate_back_to_create(world: World):
    w = world
    w.require("messages")
    room = w.room_id
    a_id, b_id = w.c["A"].user_id, w.c["B"].user_id
    events, pages = await paginate_back(w.c["B"], room, w.tok["B"], "B /messages dir=b")
    ids = [e.get("event_id") for e in events]
    assert all(ids), "an event without event_id in /messages"
    assert not dupes(ids), f"/messages returned duplicates: {dupes(ids)[:5]}"
    assert events, "/messages returned nothing"
    assert events[-1].get("type") == "m.room.create", (
        f"last event of backward pagination is {events[-1].get('type')}, not m.room.create; "
        f"{len(events)} events in {pages} pages"
    )
    msg_ids = [e["event_id"] for e in messages(events)]
    assert len(msg_ids) == TOTAL, f"{len(msg_ids)} messages in pagination, expected {TOTAL}"
    assert list(reversed(msg_ids)) == w.sent_ids, "pagination order differs from send order"
    assert pages >= TOTAL // PAGE, f"only {pages} pages for {len(events)} events at limit {PAGE}"

    # Spec order of createRoom's events, oldest first.
    oldest = list(reversed(events))
    assert oldest[0]["type"] == "m.room.create" and oldest[0].get("sender") == a_id
    assert oldest[1]["type"] == "m.room.member" and oldest[1].get("state_key") == a_id, describe(oldest, 10)
    assert (oldest[1].get("content") or {}).get("membership") == "join"
    assert oldest[2]["type"] == "m.room.power_levels", describe(oldest, 10)
    jr = [e for e in oldest if e["type"] == "m.room.join_rules"]
    assert [e["content"].get("join_rule") for e in jr] == ["invite"], jr
    hv = [e for e in oldest if e["type"] == "m.room.history_visibility"]
    assert [e["content"].get("history_visibility") for e in hv] == ["shared"], hv
    pos = {e["event_id"]: i for i, e in enumerate(oldest)}
    inv = member(oldest, b_id, "invite")
    joined = member(oldest, b_id, "join")
    assert len(inv) == 1 and len(joined) == 1, f"B invite {len(inv)}, B join {len(joined)}"
    assert inv[0].get("sender") == a_id
    first_msg = pos[w.sent_ids[0]]
    assert pos[inv[0]["event_id"]] < pos[joined[0]["event_id"]] < first_msg
    # Everything between the create event and the last message is accounted for:
    # no message event that we did not send.
    assert set(msg_ids) == set(w.sent_ids)

    # /messages without `from` (optional since spec v1.3) starts at the newest event.
    r = await bounded(w.c["B"].room_messages(room, start=None, direction=MessageDirection.back, limit=PAGE), "messages no from")
    ok(r, RoomMessagesResponse, "/messages dir=b without from")
    assert [src(e).get("event_id") for e in r.chunk] == ids[:PAGE]
    w.done.add("paginated")


async def test_05_long_poll_wakes_within_a_second(world: World):
    w = world
    w.require("messages")
    room = w.room_id
    a = w.c["A"]

    # Make sure B's token is current (nothing pending).
    _, token, _ = await catch_up(w, "B", w.tok["B"], set(), "B catch-up before long-poll")

    task = None
    for attempt in range(3):
        started = time.monotonic()
        task = asyncio.create_task(sync(w, "B", token, timeout_ms=LONG_POLL_MS, what="B long-poll"))
        await asyncio.sleep(0.5)
        if not task.done():
            break
        early = task.result()
        took = time.monotonic() - started
        assert all_event_ids(early) or early.rooms.join or early.rooms.leave, (
            f"long-poll with timeout={LONG_POLL_MS} returned after {took:.2f}s with nothing in it"
        )
        token = early.next_batch
    assert task is not None and not task.done(), "long-poll kept returning early"

    body = f"e2e {RUN} wake-up"
    r = await bounded(a.room_send(room, "m.room.message", {"msgtype": "m.text", "body": body}, tx_id=f"wake-{RUN}"), "wake send")
    ok(r, RoomSendResponse, "wake-up send")
    sent_at = time.monotonic()
    resp = await task
    got = [e["event_id"] for e in messages(timeline(resp, room))]
    token = resp.next_batch
    while r.event_id not in got and time.monotonic() - sent_at < 5:
        resp = await sync(w, "B", token, timeout_ms=LONG_POLL_MS, what="B long-poll (again)")
        got += [e["event_id"] for e in messages(timeline(resp, room))]
        token = resp.next_batch
    woke = time.monotonic() - sent_at
    assert r.event_id in got, f"long-poll never delivered the message (waited {woke:.2f}s)"
    assert got.count(r.event_id) == 1
    print(f"long-poll delivered the message {woke * 1000:.1f} ms after the send returned")
    assert woke < WAKE_LIMIT_S, f"long-poll returned the message {woke:.3f}s after the send returned (limit {WAKE_LIMIT_S}s)"
    w.sent.append((r.event_id, a.user_id, body))

    # Idle: a long-poll with nothing to say waits (about) its timeout and returns empty.
    started = time.monotonic()
    idle = await sync(w, "B", token, timeout_ms=1500, what="B idle long-poll")
    took = time.monotonic() - started
    assert not messages(timeline(idle, room)), "idle long-poll returned messages"
    assert 1.2 <= took <= 6.0, f"idle long-poll with timeout=1500 returned after {took:.2f}s"
    w.tok["B"] = idle.next_batch
    _, w.tok["A"], _ = await catch_up(w, "A", w.tok["A"], {r.event_id}, "A catch-up after wake-up")
    w.done.add("long-poll")


async def test_06_after_leave_nothing_new(world: World):
    w = world
    w.require("messages")
    room = w.room_id
    a, b = w.c["A"], w.c["B"]
    b_id = b.user_id

    # B is caught up first, so everything after this token is the leave and beyond.
    _, token, _ = await catch_up(w, "B", w.tok["B"], set(), "B catch-up before leave")
    ok(await bounded(b.room_leave(room), "B leave"), RoomLeaveResponse, "B leave")

    leave_hits: list[int] = []
    b_ids: set[str] = set()
    leave_tl: list[dict] = []
    for n in range(1, 8):
        s = await sync(w, "B", token, timeout_ms=0 if n == 1 else 1000, what=f"B sync after leave #{n}")
        token = s.next_batch
        assert room not in s.rooms.join, f"B sync #{n} after leave lists the room under rooms.join"
        assert room not in s.rooms.invite
        b_ids |= all_event_ids(s)
        if room in s.rooms.leave:
            leave_hits.append(n)
            leave_tl += timeline(s, room, "leave") + state_events(s, room, "leave")
        elif leave_hits:
            break
    assert leave_hits, "the room never appeared under rooms.leave for B"
    assert len(leave_hits) == 1, f"rooms.leave listed the room in {len(leave_hits)} syncs: {leave_hits}"
    mine = member(leave_tl, b_id, "leave")
    assert mine, f"B's leave event is not in rooms.leave: {describe(leave_tl, 20)}"
    w.leave_event_id = mine[-1]["event_id"]
    stray = [e for e in messages(leave_tl) if e.get("event_id") not in set(w.sent_ids)]
    assert not stray, f"rooms.leave timeline has messages that were never sent: {describe(stray)}"

    # A sends 3 more; A sees them (after B's leave).
    for i in range(AFTER_LEAVE):
        r = await bounded(
            a.room_send(room, "m.room.message", {"msgtype": "m.text", "body": f"e2e {RUN} after leave {i}"}, tx_id=f"after-{RUN}-{i}"),
            f"send after leave {i}",
        )
        ok(r, RoomSendResponse, f"A send after leave #{i}")
        w.after_leave.append(r.event_id)
    events, w.tok["A"], _ = await catch_up(w, "A", w.tok["A"], set(w.after_leave) | {w.leave_event_id}, "A sync after B left")
    a_order = [e.get("event_id") for e in events]
    missing = [e for e in [w.leave_event_id] + w.after_leave if e not in a_order]
    assert not missing, f"A's sync did not deliver {missing} (B's leave and A's 3 messages)"
    assert a_order.index(w.leave_event_id) < min(a_order.index(e) for e in w.after_leave)

    # B: nothing new, by sync (immediate, long-poll, immediate).
    for n, t in enumerate((0, 1500, 0), start=1):
        s = await sync(w, "B", token, timeout_ms=t, what=f"B sync after A's 3 messages #{n}")
        token = s.next_batch
        b_ids |= all_event_ids(s)
        assert room not in s.rooms.join and room not in s.rooms.invite
        if room in s.rooms.leave:
            leave_hits.append(100 + n)
    leaked = [e for e in w.after_leave if e in b_ids]
    assert not leaked, f"B received {len(leaked)} of A's post-leave messages through /sync"
    assert len(leave_hits) == 1, f"rooms.leave listed the room again: {leave_hits}"
    # A fresh initial sync of B does not show them either.
    s = await sync(w, "B", None, full_state=True, what="B fresh initial sync after leave")
    assert not [e for e in w.after_leave if e in all_event_ids(s)], "fresh initial sync leaks post-leave messages"
    assert room not in s.rooms.join
    w.tok["B"] = token

    # B's /messages: 403, or only events up to the leave.
    for label, frm in (("B's own latest token", token), ("A's latest token", w.tok["A"])):
        r = await bounded(b.room_messages(room, start=frm, direction=MessageDirection.back, limit=50), f"B /messages from {label}")
        if isinstance(r, RoomMessagesResponse):
            got = {src(e).get("event_id") for e in r.chunk}
            leaked = [e for e in w.after_leave if e in got]
            assert not leaked, f"B /messages from {label} returned {len(leaked)} post-leave messages"
        else:
            allowed = (403,) if label.startswith("B") else (400, 403, 404)
            assert status_of(r) in allowed, f"B /messages from {label}: HTTP {status_of(r)} {r}"
    for eid in w.after_leave:
        r = await bounded(b.room_get_event(room, eid), "B get post-leave event")
        assert not isinstance(r, RoomGetEventResponse), f"B fetched post-leave event {eid} through /event"
        assert status_of(r) in (403, 404), f"GET /event for a post-leave event: HTTP {status_of(r)} {r}"
    w.done.add("left")


async def test_07_restart_keeps_everything(world: World):
    w = world
    w.require("messages")
    room = w.room_id
    a = w.c["A"]
    before, _ = await paginate_back(a, room, w.tok["A"], "A /messages before restart")
    before_ids = [e["event_id"] for e in before]
    w.history_before_restart = before_ids
    old_token = w.tok["A"]

    code = await asyncio.to_thread(w.server.stop)
    if code != 0:
        # Not a contract (a crash must lose nothing anyway: test_08), but worth seeing.
        warnings.warn(f"spindle exited with code {code} on SIGTERM (no graceful shutdown?)")
    await asyncio.to_thread(w.server.start)

    # The old access token still works.
    old = w.client()
    old.restore_login(a.user_id, a.device_id, a.access_token)
    who = await bounded(old.whoami(), "whoami with pre-restart token")
    ok(who, WhoamiResponse, "whoami with the pre-restart access token")
    assert who.user_id == a.user_id

    # Password login works for both users.
    fresh: dict[str, AsyncClient] = {}
    for key in ("A", "B"):
        c = w.client()
        c.user = w.users[key]["localpart"]
        r = await bounded(c.login(w.users[key]["password"], device_name=f"e2e {key} after restart"), f"login {key}")
        ok(r, LoginResponse, f"password login {key} after restart")
        assert r.user_id == w.users[key]["user_id"]
        fresh[key] = c

    # nio's device list parses (it needs last_seen_ip on every device), and the
    # devices used before the restart still have their address: it was journaled.
    d = ok(await bounded(fresh["A"].devices(), "devices A"), DevicesResponse, "GET /devices (nio)")
    ids = {dev.id for dev in d.devices}
    assert {a.device_id, fresh["A"].device_id} <= ids, f"devices: {ids}"
    for dev in d.devices:
        assert dev.last_seen_ip == "127.0.0.1", f"{dev.id}: last_seen_ip {dev.last_seen_ip!r}"

    # Same history, same order.
    s = await sync(w, fresh["A"], None, what="A2 initial sync after restart")
    assert room in s.rooms.join
    after, _ = await paginate_back(fresh["A"], room, s.next_batch, "A /messages after restart")
    after_ids = [e["event_id"] for e in after]
    assert after_ids == before_ids, f"history differs after restart: {len(after_ids)} vs {len(before_ids)} events"
    expected_msgs = [e for e, _, _ in w.sent] + w.after_leave
    assert list(reversed([e["event_id"] for e in messages(after)])) == expected_msgs

    # Sync tokens survive: the pre-restart token yields exactly what is new since.
    r = await bounded(
        fresh["A"].room_send(room, "m.room.message", {"msgtype": "m.text", "body": f"e2e {RUN} after restart"}, tx_id=f"restart-{RUN}"),
        "send after restart",
    )
    ok(r, RoomSendResponse, "send after restart")
    w.after_leave.append(r.event_id)
    s = await sync(w, old, old_token, timeout_ms=2000, what="sync with pre-restart token")
    got = [e["event_id"] for e in messages(timeline(s, room))]
    assert got == [r.event_id], f"sync from the pre-restart token gave {len(got)} messages, expected only the new one"
    w.tok["A"] = s.next_batch
    w.c["A"] = old
    w.done.add("restarted")


async def test_08_kill9_loses_nothing_acknowledged(world: World):
    w = world
    w.require("restarted")
    room = w.room_id
    a = w.c["A"]
    acked = []
    for i in range(5):
        r = await bounded(
            a.room_send(room, "m.room.message", {"msgtype": "m.text", "body": f"e2e {RUN} before crash {i}"}, tx_id=f"crash-{RUN}-{i}"),
            f"send before crash {i}",
        )
        ok(r, RoomSendResponse, f"send before crash {i}")
        acked.append(r.event_id)
    await asyncio.to_thread(w.server.kill)
    await asyncio.to_thread(w.server.start)

    c = w.client()
    c.user = w.users["A"]["localpart"]
    ok(await bounded(c.login(w.users["A"]["password"]), "login after crash"), LoginResponse, "login after crash")
    s = await sync(w, c, None, what="sync after crash")
    events, _ = await paginate_back(c, room, s.next_batch, "A /messages after crash")
    msg_ids = list(reversed([e["event_id"] for e in messages(events)]))
    assert msg_ids[-5:] == acked, "acknowledged sends are missing or reordered after SIGKILL"
    assert not dupes([e["event_id"] for e in events])
    w.done.add("crash")
