"""End-to-end: an application service (a bridge) against the real `spindle` binary.

The application service is a small HTTP server in this module, speaking the
Application Service API the way bridges do (spec v1.19): the homeserver pushes
transactions to it with its `hs_token`, asks it about unknown users and aliases in its
namespaces, and it calls the Client-Server API with its `as_token`. Ordinary users are
unmodified matrix-nio clients.

    1. a normal client cannot register a name in the exclusive namespace (M_EXCLUSIVE)
    2. the application service registers a namespaced user (m.login.application_service)
    3. it receives exactly its room's events in transactions, in order (exact event ids),
       and nothing of a room it is not in
    4. an alias query makes it create a room; the client resolves the alias and joins
    5. a user query makes it register the user an invite names
    6. /appservice/{id}/ping reaches its /_matrix/app/v1/ping
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import pytest_asyncio
from nio import (
    AsyncClient,
    ErrorResponse,
    JoinResponse,
    RegisterResponse,
    RoomCreateResponse,
    RoomPreset,
    RoomResolveAliasResponse,
    RoomSendResponse,
)

from conftest import free_loopback_port

pytestmark = pytest.mark.asyncio(loop_scope="module")

AS_TOKEN = "as-" + uuid.uuid4().hex
HS_TOKEN = "hs-" + uuid.uuid4().hex
AS_ID = "testbridge"
WAIT_S = 10.0

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def call(base: str, method: str, path: str, token: str | None = None, body: Any = None,
         query: dict[str, str] | None = None) -> tuple[int, Any]:
    """One Client-Server request; returns (status, JSON body)."""
    url = base + path
    if query:
        url += "?" + urllib.parse.urlencode(query)
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with _OPENER.open(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


class Bridge:
    """The application service: records what the homeserver sends and answers queries
    by creating what they ask about, through the Client-Server API."""

    def __init__(self, server_name: str):
        self.server_name = server_name
        self.port = free_loopback_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.hs_base = ""  # set once the homeserver runs
        self.lock = threading.Lock()
        self.transactions: list[tuple[str, dict]] = []
        self.bad_auth = 0
        self.queries: list[str] = []
        self.pings: list[dict] = []
        bridge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _answer(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                if self.headers.get("Authorization") != f"Bearer {HS_TOKEN}":
                    with bridge.lock:
                        bridge.bad_auth += 1
                    self._answer(403, {"errcode": "M_FORBIDDEN"})
                    return False
                return True

            def _body(self) -> Any:
                n = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(n) or b"{}")

            def do_PUT(self):
                path = urllib.parse.urlparse(self.path).path
                prefix = "/_matrix/app/v1/transactions/"
                if not path.startswith(prefix):
                    return self._answer(404, {"errcode": "M_UNRECOGNIZED"})
                if not self._authorized():
                    return
                txn = urllib.parse.unquote(path[len(prefix):])
                body = self._body()
                with bridge.lock:
                    bridge.transactions.append((txn, body))
                self._answer(200, {})

            def do_POST(self):
                if urllib.parse.urlparse(self.path).path != "/_matrix/app/v1/ping":
                    return self._answer(404, {"errcode": "M_UNRECOGNIZED"})
                if not self._authorized():
                    return
                with bridge.lock:
                    bridge.pings.append(self._body())
                self._answer(200, {})

            def do_GET(self):
                path = urllib.parse.urlparse(self.path).path
                if not self._authorized():
                    return
                if path.startswith("/_matrix/app/v1/users/"):
                    user = urllib.parse.unquote(path.rsplit("/", 1)[1])
                    with bridge.lock:
                        bridge.queries.append(user)
                    local = user[1:].split(":", 1)[0]
                    if not local.startswith("bridge_ghost"):
                        return self._answer(404, {"errcode": "M_NOT_FOUND"})
                    status, _ = bridge.as_call("POST", "/_matrix/client/v3/register", body={
                        "type": "m.login.application_service", "username": local,
                        "inhibit_login": True,
                    })
                    return self._answer(200 if status == 200 else 404, {})
                if path.startswith("/_matrix/app/v1/rooms/"):
                    alias = urllib.parse.unquote(path.rsplit("/", 1)[1])
                    with bridge.lock:
                        bridge.queries.append(alias)
                    local = alias[1:].split(":", 1)[0]
                    if not local.startswith("bridge_portal"):
                        return self._answer(404, {"errcode": "M_NOT_FOUND"})
                    # A bridge creates the portal room with the alias before answering.
                    status, _ = bridge.as_call("POST", "/_matrix/client/v3/createRoom", body={
                        "room_alias_name": local, "preset": "public_chat",
                        "name": "Portal",
                    })
                    return self._answer(200 if status == 200 else 404, {})
                self._answer(404, {"errcode": "M_UNRECOGNIZED"})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def as_call(self, method: str, path: str, body: Any = None, user_id: str | None = None):
        query = {"user_id": user_id} if user_id else None
        return call(self.hs_base, method, path, AS_TOKEN, body, query)

    def registration(self) -> str:
        server = self.server_name.replace(".", "\\\\.")
        return (
            f"id: {AS_ID}\n"
            f'url: "{self.url}"\n'
            f'as_token: "{AS_TOKEN}"\n'
            f'hs_token: "{HS_TOKEN}"\n'
            "sender_localpart: bridgebot\n"
            "rate_limited: false\n"
            "namespaces:\n"
            "  users:\n"
            "    - exclusive: true\n"
            f"      regex: \"@bridge_.*:{server}\"\n"
            "  aliases:\n"
            "    - exclusive: true\n"
            f"      regex: \"#bridge_.*:{server}\"\n"
            "  rooms: []\n"
        )

    def room_events(self, room_id: str) -> list[str]:
        with self.lock:
            return [
                e["event_id"]
                for _, body in self.transactions
                for e in body.get("events", [])
                if e.get("room_id") == room_id
            ]

    def all_rooms(self) -> set[str]:
        with self.lock:
            return {e.get("room_id") for _, b in self.transactions for e in b.get("events", [])}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


async def wait_for(what: str, pred) -> None:
    deadline = time.monotonic() + WAIT_S
    while not pred():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def bridge(spindle):
    b = Bridge(spindle.server_name)
    reg = spindle.root / "bridge-registration.yaml"
    reg.write_text(b.registration())
    spindle.extra_config = (
        "\n[appservices]\n"
        f'registration_files = ["{reg}"]\n'
        'ip_range_allowlist = ["127.0.0.1/32"]\n'
        "retry_initial_ms = 100\n"
    )
    spindle.write_config()
    spindle.restart()
    b.hs_base = spindle.base_url
    yield b
    b.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def alice(spindle, bridge):
    c = AsyncClient(spindle.base_url, f"alice{uuid.uuid4().hex[:6]}")
    resp = await c.register(c.user, "alice-password-1", "nio")
    assert isinstance(resp, RegisterResponse), resp
    yield c
    await c.close()


async def test_a_normal_client_cannot_take_a_name_in_the_exclusive_namespace(spindle, bridge):
    c = AsyncClient(spindle.base_url, "bridge_mallory")
    try:
        resp = await c.register("bridge_mallory", "mallory-password-1", "nio")
        assert isinstance(resp, ErrorResponse), resp
        assert resp.status_code == "M_EXCLUSIVE", resp
    finally:
        await c.close()
    # Nor the bridge's own sender.
    status, body = call(spindle.base_url, "GET", "/_matrix/client/v3/register/available",
                        query={"username": "bridgebot"})
    assert (status, body["errcode"]) == (400, "M_EXCLUSIVE")


async def test_the_bridge_registers_a_user_and_receives_its_rooms_events(spindle, bridge, alice):
    server = spindle.server_name
    puppet = f"@bridge_alice:{server}"
    status, body = bridge.as_call("POST", "/_matrix/client/v3/register", body={
        "type": "m.login.application_service", "username": "bridge_alice",
    })
    assert status == 200, body
    assert body["user_id"] == puppet
    status, body = bridge.as_call("GET", "/_matrix/client/v3/account/whoami", user_id=puppet)
    assert (status, body["user_id"]) == (200, puppet)

    # A room the bridge's users are not in: nothing of it may reach the bridge.
    other = await alice.room_create(name="not bridged")
    assert isinstance(other, RoomCreateResponse), other
    hidden = await alice.room_send(other.room_id, "m.room.message",
                                   {"msgtype": "m.text", "body": "private"})
    assert isinstance(hidden, RoomSendResponse), hidden

    room = await alice.room_create(name="bridged", preset=RoomPreset.private_chat)
    assert isinstance(room, RoomCreateResponse), room
    before = await alice.room_send(room.room_id, "m.room.message",
                                   {"msgtype": "m.text", "body": "before the bridge"})
    assert isinstance(before, RoomSendResponse), before
    await alice.room_invite(room.room_id, puppet)
    status, body = bridge.as_call(
        "POST", f"/_matrix/client/v3/rooms/{urllib.parse.quote(room.room_id)}/join",
        body={}, user_id=puppet)
    assert status == 200, body
    sent = []
    for text in ("one", "two", "three"):
        r = await alice.room_send(room.room_id, "m.room.message",
                                  {"msgtype": "m.text", "body": text})
        assert isinstance(r, RoomSendResponse), r
        sent.append(r.event_id)
    # The bridge's user answers; its own event comes back to it too.
    status, body = bridge.as_call(
        "PUT",
        f"/_matrix/client/v3/rooms/{urllib.parse.quote(room.room_id)}/send/m.room.message/t1",
        body={"msgtype": "m.text", "body": "from the other network"}, user_id=puppet)
    assert status == 200, body
    sent.append(body["event_id"])

    await wait_for("the bridge's transactions to reach the last event",
                   lambda: sent[-1] in bridge.room_events(room.room_id))
    # What alice's /messages shows of the room from the invite on, in order.
    status, page = call(spindle.base_url, "GET",
                        f"/_matrix/client/v3/rooms/{urllib.parse.quote(room.room_id)}/messages",
                        alice.access_token, query={"dir": "f", "limit": "100"})
    assert status == 200, page
    ids = [e["event_id"] for e in page["chunk"]]
    members = [e["event_id"] for e in page["chunk"]
               if e["type"] == "m.room.member" and e.get("state_key") == puppet]
    assert len(members) == 2, page["chunk"]  # the invite and the join
    expected = ids[ids.index(members[0]):]
    assert expected == members + sent
    assert bridge.room_events(room.room_id) == expected
    assert before.event_id not in bridge.room_events(room.room_id)
    assert other.room_id not in bridge.all_rooms()
    assert bridge.bad_auth == 0
    with bridge.lock:
        ids_seen = [t for t, _ in bridge.transactions]
    assert len(ids_seen) == len(set(ids_seen)), "every transaction has its own id"


async def test_an_alias_query_creates_the_room_and_the_client_joins_it(spindle, bridge, alice):
    alias = f"#bridge_portal_{uuid.uuid4().hex[:6]}:{spindle.server_name}"
    resolved = await alice.room_resolve_alias(alias)
    assert isinstance(resolved, RoomResolveAliasResponse), resolved
    assert bridge.queries.count(alias) == 1
    joined = await alice.join(alias)
    assert isinstance(joined, JoinResponse), joined
    assert joined.room_id == resolved.room_id
    # Known now: no second query.
    status, body = call(spindle.base_url, "GET",
                        f"/_matrix/client/v3/directory/room/{urllib.parse.quote(alias)}")
    assert (status, body["room_id"]) == (200, resolved.room_id)
    assert bridge.queries.count(alias) == 1
    # An alias the bridge does not know stays unknown.
    missing = f"#bridge_nothing:{spindle.server_name}"
    status, body = call(spindle.base_url, "GET",
                        f"/_matrix/client/v3/directory/room/{urllib.parse.quote(missing)}")
    assert (status, body["errcode"]) == (404, "M_NOT_FOUND")
    assert missing in bridge.queries


async def test_a_user_query_lets_an_invite_name_a_user_the_bridge_creates(spindle, bridge, alice):
    ghost = f"@bridge_ghost_{uuid.uuid4().hex[:6]}:{spindle.server_name}"
    room = await alice.room_create(name="invite a ghost")
    assert isinstance(room, RoomCreateResponse), room
    status, body = call(spindle.base_url, "POST",
                        f"/_matrix/client/v3/rooms/{urllib.parse.quote(room.room_id)}/invite",
                        alice.access_token, body={"user_id": ghost})
    assert status == 200, body
    assert ghost in bridge.queries
    await wait_for("the invite to reach the bridge",
                   lambda: len(bridge.room_events(room.room_id)) == 1)


async def test_ping_reaches_the_bridge(spindle, bridge, alice):
    status, body = bridge.as_call("POST", f"/_matrix/client/v1/appservice/{AS_ID}/ping",
                                  body={"transaction_id": "ping-e2e"})
    assert status == 200, body
    assert isinstance(body["duration_ms"], int)
    assert {"transaction_id": "ping-e2e"} in bridge.pings
    status, body = call(spindle.base_url, "POST", f"/_matrix/client/v1/appservice/{AS_ID}/ping",
                        alice.access_token, body={})
    assert (status, body["errcode"]) == (403, "M_FORBIDDEN")
