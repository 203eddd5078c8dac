"""End-to-end encryption with real client crypto: two matrix-nio clients with
end-to-end support (python-olm) against the real `spindle` binary.

    1. A and B register; each uploads its device keys and one-time keys (nio's
       keys_upload), and the server reports the counts back in /sync
    2. A creates an encrypted room (m.room.encryption in initial_state) and invites B;
       B joins; A queries B's device keys (nio's keys_query after device_lists)
    3. A sends a text: nio claims one of B's one-time keys, sends the Megolm room key
       to B's device as an Olm-encrypted to-device message, and sends m.room.encrypted
    4. the server only ever holds ciphertext; B syncs, receives the room key over
       to-device and decrypts A's message (nio's RoomMessageText, body intact)
    5. the to-device message is acknowledged by B's next sync and never delivered again
    6. B logs in on a new device B2 after the message was sent. B2 cannot decrypt it;
       B and B2 verify each other (locally, as a user would), B2 sends a room key
       request over to-device, B answers it with an Olm-encrypted forwarded room key
       (claiming one of B2's one-time keys first), and B2 decrypts A's message
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
    LoginResponse,
    KeysQueryResponse,
    KeysUploadResponse,
    MegolmEvent,
    RegisterResponse,
    RoomCreateResponse,
    RoomMessageText,
    RoomSendResponse,
    SyncResponse,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

CALL_TIMEOUT = 30.0
RUN = uuid.uuid4().hex[:8]
SECRET = f"the secret of run {RUN}"


async def raw(server, method: str, path: str, token: str, body=None):
    async with aiohttp.ClientSession() as s:
        async with s.request(
            method,
            server.base_url + path,
            json=body,
            headers={"Authorization": f"Bearer {token}"},
            timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT),
        ) as r:
            return r.status, json.loads(await r.text())


def ok(resp, cls, what: str):
    if not isinstance(resp, cls):
        pytest.fail(f"{what}: expected {cls.__name__}, got {type(resp).__name__}: {resp}")
    return resp


async def settle(c: AsyncClient, what: str) -> SyncResponse:
    """One sync, then what nio's sync_forever does after each: upload and query keys."""
    resp = ok(await asyncio.wait_for(c.sync(timeout=0, full_state=True), CALL_TIMEOUT), SyncResponse, what)
    if c.should_upload_keys:
        ok(await c.keys_upload(), KeysUploadResponse, f"{what}: keys_upload")
    if c.should_query_keys:
        ok(await c.keys_query(), KeysQueryResponse, f"{what}: keys_query")
    if c.should_claim_keys:
        await c.keys_claim(c.get_users_for_key_claiming())
    await c.send_to_device_messages()
    return resp


async def test_b_decrypts_a_message_sent_in_an_encrypted_room(spindle, tmp_path):
    clients = []

    def client(name: str) -> AsyncClient:
        store = tmp_path / name
        store.mkdir()
        cfg = AsyncClientConfig(
            encryption_enabled=True,
            store_sync_tokens=False,
            max_timeouts=2,
            request_timeout=CALL_TIMEOUT,
        )
        c = AsyncClient(spindle.base_url, store_path=str(store), config=cfg)
        clients.append(c)
        return c

    try:
        a, b = client("a"), client("b")
        for c, name in ((a, f"a{RUN}"), (b, f"b{RUN}")):
            ok(await c.register(name, "pw-" + name, device_name=f"{name} nio"), RegisterResponse, f"register {name}")
            assert c.olm is not None, "nio loaded its Olm account"
        # 1. keys uploaded; the server counts them.
        for c in (a, b):
            await settle(c, "first sync")
            resp = await settle(c, "second sync")
            assert resp.device_key_count.signed_curve25519 and resp.device_key_count.signed_curve25519 > 0, (
                f"one-time key count after upload: {resp.device_key_count}"
            )
        st, q = await raw(spindle, "POST", "/_matrix/client/v3/keys/query", a.access_token,
                          {"device_keys": {b.user_id: []}})
        assert st == 200, q
        assert list(q["device_keys"][b.user_id]) == [b.device_id]
        assert q["device_keys"][b.user_id][b.device_id]["keys"][f"ed25519:{b.device_id}"] == b.olm.account.identity_keys["ed25519"]

        # 2. encrypted room, B joins, A learns B's devices.
        room = ok(
            await a.room_create(
                name="secret",
                invite=[b.user_id],
                initial_state=[{"type": "m.room.encryption", "state_key": "", "content": {"algorithm": "m.megolm.v1.aes-sha2"}}],
            ),
            RoomCreateResponse,
            "room_create",
        ).room_id
        await settle(b, "B sees the invite")
        ok(await b.join(room), JoinResponse, "B joins")
        await settle(b, "B after join")
        await settle(a, "A sees B join")
        assert a.rooms[room].encrypted
        assert b.device_id in a.device_store[b.user_id], "A knows B's device from /keys/query"

        # 3. A sends: claim + to-device room key + m.room.encrypted.
        sent = ok(
            await a.room_send(room, "m.room.message", {"msgtype": "m.text", "body": SECRET}, ignore_unverified_devices=True),
            RoomSendResponse,
            "A sends",
        )
        # 4. the server holds ciphertext only.
        st, ev = await raw(spindle, "GET", f"/_matrix/client/v3/rooms/{room}/event/{sent.event_id}", b.access_token)
        assert st == 200 and ev["type"] == "m.room.encrypted", ev
        assert SECRET not in json.dumps(ev)
        # B decrypts.
        decrypted = None
        undecryptable = []
        for _ in range(5):
            resp = await settle(b, "B receives")
            joined = resp.rooms.join.get(room)
            for e in joined.timeline.events if joined else []:
                if isinstance(e, RoomMessageText) and e.event_id == sent.event_id:
                    decrypted = e
                elif isinstance(e, MegolmEvent):
                    undecryptable.append(e)
            if decrypted:
                break
            await asyncio.sleep(0.2)
        assert decrypted is not None, f"B could not decrypt A's message (undecrypted: {undecryptable})"
        assert decrypted.body == SECRET
        assert decrypted.sender == a.user_id
        assert decrypted.decrypted

        # 5. B's next sync acknowledges the room key's to-device message: never again.
        await settle(b, "B acknowledges")
        st, s = await raw(spindle, "GET", "/_matrix/client/v3/sync?timeout=0", b.access_token)
        assert st == 200
        assert s["to_device"]["events"] == [], s["to_device"]

        # 6. A third device of B's, added later, gets the room key by a key request.
        b2 = client("b2")
        ok(await b2.login_raw({
            "type": "m.login.password",
            "identifier": {"type": "m.id.user", "user": b.user_id},
            "password": f"pw-b{RUN}",
            "initial_device_display_name": "b2 nio",
        }), LoginResponse, "B2 logs in")
        assert b2.device_id != b.device_id
        undecrypted = None
        for _ in range(3):
            resp = await settle(b2, "B2 syncs")
            joined = resp.rooms.join.get(room)
            for e in joined.timeline.events if joined else []:
                if isinstance(e, MegolmEvent) and e.event_id == sent.event_id:
                    undecrypted = e
        assert undecrypted is not None, "B2 sees A's message, still encrypted"
        for _ in range(3):
            await settle(b, "B learns of B2")
            if b2.device_id in b.device_store[b.user_id]:
                break
        assert b2.device_id in b.device_store[b.user_id], "B's device list changed: B2 is there"
        assert b.device_id in b2.device_store[b.user_id]
        b.verify_device(b.device_store[b.user_id][b2.device_id])
        b2.verify_device(b2.device_store[b.user_id][b.device_id])
        await b2.request_room_key(undecrypted)
        recovered = None
        for _ in range(8):
            await settle(b, "B answers the key request")
            await settle(b2, "B2 receives the forwarded key")
            try:
                recovered = b2.decrypt_event(undecrypted)
            except Exception:  # not yet: the key has not arrived
                recovered = None
            if isinstance(recovered, RoomMessageText):
                break
            await asyncio.sleep(0.2)
        assert isinstance(recovered, RoomMessageText), f"B2 could not decrypt after the key request: {recovered}"
        assert recovered.body == SECRET
    finally:
        for c in clients:
            await c.close()
