"""Lazy-loaded members with an unmodified matrix-nio client (issue 15 item 4): the
client syncs with `lazy_load_members` and a small timeline limit, as Element does, and
must still know every sender it is shown.

    1. A, B, C and D register; A creates a public room, B, C and D join, B speaks;
       A's lazy initial sync holds B's member event, not C's or D's
    2. C speaks: A's plain incremental sync carries C's member event in `state` (C
       joined before the token, but this device was never sent it), and nio shows
       C's display name
    3. D sends more messages than the timeline limit: the sync is `limited` (a gap)
       and still carries D's member event
    4. C speaks again: C's member event is not sent a second time (the device has it)
"""

from __future__ import annotations

import asyncio
import json
import uuid

import aiohttp
import pytest
from nio import (
    AsyncClient,
    AsyncClientConfig,
    JoinResponse,
    RegisterResponse,
    RoomCreateResponse,
    RoomPreset,
    SyncResponse,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

CALL_TIMEOUT = 30.0
RUN = uuid.uuid4().hex[:8]
LIMIT = 5
LAZY = {"room": {"timeline": {"limit": LIMIT}, "state": {"lazy_load_members": True}}}


def ok(resp, cls, what: str):
    if not isinstance(resp, cls):
        pytest.fail(f"{what}: expected {cls.__name__}, got {type(resp).__name__}: {resp}")
    return resp


async def send(server, c: AsyncClient, room: str, body: str) -> str:
    """A message sent over plain HTTP (nio's room_send needs a synced room)."""
    txn = uuid.uuid4().hex
    async with aiohttp.ClientSession() as s:
        async with s.put(
            f"{server.base_url}/_matrix/client/v3/rooms/{room}/send/m.room.message/{txn}",
            json={"msgtype": "m.text", "body": body},
            headers={"Authorization": f"Bearer {c.access_token}"},
            timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT),
        ) as r:
            assert r.status == 200, await r.text()
            return json.loads(await r.text())["event_id"]


def members_in(resp: SyncResponse, room: str) -> list[str]:
    """The user ids of the `m.room.member` events in the room's `state` section."""
    joined = resp.rooms.join.get(room)
    if joined is None:
        return []
    return sorted(getattr(e, "state_key", None) for e in joined.state if type(e).__name__ == "RoomMemberEvent")


async def test_lazy_loaded_members_reach_nio_after_a_gap_and_without_one(spindle):
    clients: list[AsyncClient] = []

    def client() -> AsyncClient:
        cfg = AsyncClientConfig(store_sync_tokens=False, max_timeouts=2, request_timeout=CALL_TIMEOUT)
        c = AsyncClient(spindle.base_url, config=cfg)
        clients.append(c)
        return c

    try:
        a, b, c, d = client(), client(), client(), client()
        for cl, name in ((a, "a"), (b, "b"), (c, "c"), (d, "d")):
            local = f"lazy{name}{RUN}"
            ok(await cl.register(local, "pw-" + local), RegisterResponse, f"register {local}")
            cl.display = local
        # 1. B, C and D join; only B speaks before A's lazy initial sync, so the
        #    initial sync leaves C's and D's member events out.
        room = ok(
            await a.room_create(name="lazy", preset=RoomPreset.public_chat), RoomCreateResponse, "room_create"
        ).room_id
        for cl in (b, c, d):
            ok(await cl.join(room), JoinResponse, "join")
        for i in range(LIMIT + 2):
            await send(spindle, b, room, f"b {i}")
        first = ok(await a.sync(timeout=0, sync_filter=LAZY), SyncResponse, "A initial sync")
        assert {e.sender for e in first.rooms.join[room].timeline.events} == {b.user_id}
        initial_members = members_in(first, room)
        assert b.user_id in initial_members and c.user_id not in initial_members and d.user_id not in initial_members, (
            initial_members
        )
        assert c.user_id not in a.rooms[room].users

        # 2. C speaks, no gap: C's membership is older than the token, yet the sync's
        #    state carries it because this device was never sent it.
        c_msg = await send(spindle, c, room, "c speaks")
        plain = ok(await a.sync(timeout=0, sync_filter=LAZY, since=first.next_batch), SyncResponse, "A plain sync")
        pj = plain.rooms.join[room]
        assert pj.timeline.limited is False
        assert [e.event_id for e in pj.timeline.events] == [c_msg]
        assert members_in(plain, room) == [c.user_id]
        assert a.rooms[room].user_name(c.user_id) == c.display

        # 3. D sends more than the timeline limit: a gap, and D's membership with it.
        sent = [await send(spindle, d, room, f"d {i}") for i in range(LIMIT + 3)]
        gap = ok(await a.sync(timeout=0, sync_filter=LAZY, since=plain.next_batch), SyncResponse, "A after the gap")
        gj = gap.rooms.join[room]
        assert gj.timeline.limited is True
        assert [e.event_id for e in gj.timeline.events] == sent[-LIMIT:]
        assert members_in(gap, room) == [d.user_id]
        assert a.rooms[room].user_name(d.user_id) == d.display

        # 4. C again: already sent to this device, so not repeated.
        c_again = await send(spindle, c, room, "c again")
        again = ok(await a.sync(timeout=0, sync_filter=LAZY, since=gap.next_batch), SyncResponse, "A sync 4")
        assert [e.event_id for e in again.rooms.join[room].timeline.events] == [c_again]
        assert members_in(again, room) == []
    finally:
        for cl in clients:
            await cl.close()
