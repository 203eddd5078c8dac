"""Conformance: the real binary's answers validated against the Matrix spec's own
OpenAPI definitions (v1.19), and the list of spec endpoints not yet served.

How it works (docs/conformance.md says the same for people adding endpoints):

1. Realistic flows (register, log in, create rooms, talk, sync, ...) run against one
   server through a recording client. Every JSON answer whose status the spec
   documents is validated against the spec's schema for that status; a 2xx the spec
   does not document is a finding.
2. `test_every_served_endpoint_is_exercised` probes every spec endpoint of the
   Client-Server and Server-Server APIs without credentials: an answer other than
   404/405 `M_UNRECOGNIZED` means the router serves it. Every served endpoint must
   have at least one validated 2xx answer from the flows.
3. `test_conformance_doc_is_current` renders docs/conformance.md (served/total and
   what is missing) and fails if the committed file differs. Regenerate with
   `SPINDLE_CONFORMANCE_WRITE=1 scripts/test --e2e-only -- -k conformance`.
"""

from __future__ import annotations

import json
import os
import socketserver
import threading
import time
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conformance.client import Answer, Client, Recorder, seg
from conformance.spec import APIS, SPEC_VERSION, Spec, find_spec_dir

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "conformance.md"
C3 = "/_matrix/client/v3"


# -- fixtures ---------------------------------------------------------------------


# Sections this module's server runs with, so the endpoints they turn on answer 200.
EXTRA_CONFIG = """
[voip]
turn_uris = ["turn:turn.example.org:3478?transport=udp", "turns:turn.example.org:5349?transport=tcp"]
turn_shared_secret = "conformance-secret"

[support]
support_page = "https://example.org/help"
contacts = [{ role = "m.role.admin", matrix_id = "@admin:example.org", email_address = "admin@example.org" }]
"""


AS_TOKEN = "conformance-as-token"
HS_TOKEN = "conformance-hs-token"


class _AppService(BaseHTTPRequestHandler):
    """The smallest application service: acknowledges transactions and pings."""

    def log_message(self, *args):
        pass

    def _ok(self):
        n = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(n)
        ok = self.headers.get("Authorization") == f"Bearer {HS_TOKEN}"
        self.send_response(200 if ok else 403)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    do_PUT = _ok
    do_POST = _ok


MAILS: list[str] = []


class _SmtpSink(socketserver.StreamRequestHandler):
    """A minimal SMTP server: accepts every message and keeps it in MAILS."""

    def handle(self):
        self.wfile.write(b"220 sink ESMTP\r\n")
        while True:
            line = self.rfile.readline()
            if not line:
                return
            verb = line[:4].upper()
            if verb == b"EHLO":
                self.wfile.write(b"250-sink\r\n250 8BITMIME\r\n")
            elif verb == b"DATA":
                self.wfile.write(b"354 go on\r\n")
                data = []
                while (chunk := self.rfile.readline()) not in (b".\r\n", b""):
                    data.append(chunk.decode())
                MAILS.append("".join(data))
                self.wfile.write(b"250 queued\r\n")
            elif verb == b"QUIT":
                self.wfile.write(b"221 bye\r\n")
                return
            else:
                self.wfile.write(b"250 ok\r\n")


class _IdentityServer(BaseHTTPRequestHandler):
    """Binds session `good` to whoever asks, and unbinds anything."""

    def log_message(self, *args):
        pass

    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n) or b"{}")
        if self.path.endswith("/3pid/bind"):
            out = {"address": "conformance@example.org", "medium": "email", "mxid": body.get("mxid"),
                   "not_before": 0, "not_after": 4000000000000, "ts": 1, "signatures": {}}
        else:
            out = {}
        raw = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


@pytest.fixture(scope="module")
def identity_server() -> str:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _IdentityServer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def spindle(spindle):
    """The module's server, restarted with EXTRA_CONFIG, an application service, an
    SMTP sink for validation emails and loopback identity servers allowed."""
    smtp = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _SmtpSink)
    smtp.daemon_threads = True
    threading.Thread(target=smtp.serve_forever, daemon=True).start()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _AppService)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    reg = spindle.root / "conformance-appservice.yaml"
    reg.write_text(
        "id: conformance\n"
        f"url: http://127.0.0.1:{httpd.server_address[1]}\n"
        f"as_token: {AS_TOKEN}\n"
        f"hs_token: {HS_TOKEN}\n"
        "sender_localpart: conformancebot\n"
        "namespaces:\n"
        "  users:\n"
        "    - exclusive: true\n"
        "      regex: '@conformance_.*'\n"
    )
    spindle.extra_config = EXTRA_CONFIG + (
        "\n[appservices]\n"
        f'registration_files = ["{reg}"]\n'
        'ip_range_allowlist = ["127.0.0.1/32"]\n'
        "\n[email]\nenabled = true\n"
        f'smtp_host = "127.0.0.1"\nsmtp_port = {smtp.server_address[1]}\ntls = "none"\n'
        'notif_from = "Conformance <noreply@example.org>"\n'
        "\n[identity_servers]\n"
        'ip_range_allowlist = ["127.0.0.1/32"]\ndangerous_plain_http_for_tests = true\n'
    )
    spindle.write_config()
    spindle.restart()
    yield spindle
    httpd.shutdown()
    smtp.shutdown()


@pytest.fixture(scope="module")
def spec() -> Spec:
    return Spec(find_spec_dir(REPO))


@pytest.fixture(scope="module")
def recorder(spec) -> Recorder:
    return Recorder(spec)


@pytest.fixture(scope="module")
def anon(spindle, recorder) -> Client:
    return Client(spindle.base_url, recorder)


@pytest.fixture(scope="module")
def world() -> dict:
    """What earlier flows established (users, rooms, events) for later ones."""
    return {}


@pytest.fixture(autouse=True)
def no_new_findings(recorder):
    """Each flow must leave no spec violation behind (reported where it happened)."""
    before = len(recorder.problems)
    yield
    new = recorder.problems[before:]
    assert not new, "answers that break the spec:\n  " + "\n  ".join(new)


def register(anon: Client, name: str, password: str = "correct horse battery") -> Client:
    """Registers like a client does: the UIA 401 first, then the dummy stage."""
    first = anon.post(f"{C3}/register", {"username": name, "password": password}, expect=401)
    session = first["session"]
    assert {"stages": ["m.login.dummy"]} in first["flows"]
    ok = anon.post(
        f"{C3}/register",
        {
            "username": name,
            "password": password,
            "initial_device_display_name": f"{name}'s laptop",
            "auth": {"type": "m.login.dummy", "session": session},
        },
    )
    client = Client(anon.base_url, anon.recorder, ok["access_token"])
    client.user_id = ok["user_id"]
    client.device_id = ok["device_id"]
    return client


def unique(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


# -- flows --------------------------------------------------------------------------


def test_discovery(anon, spindle):
    versions = anon.get("/_matrix/client/versions")
    assert "v1.11" in versions["versions"] or versions["versions"], versions.body
    anon.get("/.well-known/matrix/client", expect=(200, 404))
    anon.get(f"{C3}/login")
    anon.get("/_matrix/key/v2/server")


def test_account_lifecycle(anon, world, spindle):
    name = unique("alice")
    anon.get(f"{C3}/register/available", query={"username": name})
    alice = register(anon, name)
    assert alice.user_id == f"@{name}:{spindle.server_name}"
    available = anon.get(f"{C3}/register/available", query={"username": name}, expect=400)
    assert available["errcode"] == "M_USER_IN_USE"

    who = alice.get(f"{C3}/account/whoami")
    assert who["user_id"] == alice.user_id and who["device_id"] == alice.device_id
    alice.get(f"{C3}/capabilities")

    # A second device by password login, then log it out.
    login = anon.post(
        f"{C3}/login",
        {
            "type": "m.login.password",
            "identifier": {"type": "m.id.user", "user": name},
            "password": "correct horse battery",
            "initial_device_display_name": "phone",
        },
    )
    phone = Client(anon.base_url, anon.recorder, login["access_token"])
    assert login["user_id"] == alice.user_id
    phone.post(f"{C3}/logout")
    gone = phone.get(f"{C3}/account/whoami", expect=401)
    assert gone["errcode"] == "M_UNKNOWN_TOKEN"

    # Profile.
    me = seg(alice.user_id)
    alice.put(f"{C3}/profile/{me}/displayname", {"displayname": "Alice"})
    alice.put(f"{C3}/profile/{me}/avatar_url", {"avatar_url": "mxc://example.org/abc"})
    assert alice.get(f"{C3}/profile/{me}/displayname")["displayname"] == "Alice"
    profile = anon.get(f"{C3}/profile/{me}")
    assert profile.body == {"displayname": "Alice", "avatar_url": "mxc://example.org/abc"}

    # Filters.
    made = alice.post(
        f"{C3}/user/{me}/filter",
        {"room": {"timeline": {"limit": 10}}, "presence": {"not_types": ["*"]}},
    )
    got = alice.get(f"{C3}/user/{me}/filter/{seg(made['filter_id'])}")
    assert got["room"]["timeline"]["limit"] == 10

    # Global account data, push rules.
    alice.put(f"{C3}/user/{me}/account_data/org.example.settings", {"theme": "dark"})
    assert alice.get(f"{C3}/user/{me}/account_data/org.example.settings").body == {"theme": "dark"}
    rules = alice.get(f"{C3}/pushrules/")
    assert "global" in rules.body
    alice.get(f"{C3}/pushrules/global/")

    world["alice"] = alice
    world["alice_name"] = name


def test_room_lifecycle(anon, world, spindle):
    alice: Client = world["alice"]
    bob = register(anon, unique("bob"))
    carol = register(anon, unique("carol"))
    world["bob"] = bob
    alias_local = unique("lobby")
    alias = f"#{alias_local}:{spindle.server_name}"

    created = alice.post(
        f"{C3}/createRoom",
        {
            "preset": "public_chat",
            "name": "Lobby",
            "topic": "Conformance",
            "room_alias_name": alias_local,
            "invite": [bob.user_id],
        },
    )
    room = created["room_id"]
    r = seg(room)
    world["room"] = room

    assert anon.get(f"{C3}/directory/room/{seg(alias)}")["room_id"] == room
    assert alias in alice.get(f"{C3}/rooms/{r}/aliases")["aliases"]
    alice.get(f"{C3}/directory/list/room/{r}")
    second = f"#{unique('alt')}:{spindle.server_name}"
    alice.put(f"{C3}/directory/room/{seg(second)}", {"room_id": room})
    alice.delete(f"{C3}/directory/room/{seg(second)}")

    bob.post(f"{C3}/rooms/{r}/join", {})
    carol.post(f"{C3}/join/{seg(alias)}", {})
    joined = alice.get(f"{C3}/rooms/{r}/joined_members")["joined"]
    assert set(joined) == {alice.user_id, bob.user_id, carol.user_id}
    assert room in bob.get(f"{C3}/joined_rooms")["joined_rooms"]

    # Messages, state, redaction.
    sent = [
        alice.put(f"{C3}/rooms/{r}/send/m.room.message/{unique('t')}", {"msgtype": "m.text", "body": f"hello {i}"})["event_id"]
        for i in range(3)
    ]
    alice.put(f"{C3}/rooms/{r}/state/m.room.topic", {"topic": "Changed"})
    alice.put(f"{C3}/rooms/{r}/state/m.room.topic/", {"topic": "Changed again"})
    alice.put(f"{C3}/rooms/{r}/state/org.example.widget/w1", {"url": "https://example.org"})
    assert bob.get(f"{C3}/rooms/{r}/state/m.room.topic")["topic"] == "Changed again"
    assert bob.get(f"{C3}/rooms/{r}/state/org.example.widget/w1")["url"] == "https://example.org"
    state = bob.get(f"{C3}/rooms/{r}/state").body
    assert {(e["type"], e["state_key"]) for e in state} >= {("m.room.create", ""), ("m.room.topic", "")}
    redaction = alice.put(f"{C3}/rooms/{r}/redact/{seg(sent[0])}/{unique('t')}", {"reason": "oops"})
    assert redaction["event_id"].startswith("$")

    event = bob.get(f"{C3}/rooms/{r}/event/{seg(sent[1])}")
    assert event["content"]["body"] == "hello 1"
    page = bob.get(f"{C3}/rooms/{r}/messages", query={"dir": "b", "limit": 5})
    assert len(page["chunk"]) == 5
    ctx = bob.get(f"{C3}/rooms/{r}/context/{seg(sent[1])}", query={"limit": 2})
    assert ctx["event"]["event_id"] == sent[1]
    members = bob.get(f"{C3}/rooms/{r}/members")["chunk"]
    assert len([m for m in members if m["content"]["membership"] == "join"]) == 3

    # Ephemeral: typing, receipts, read markers; room account data and tags.
    b = seg(bob.user_id)
    bob.put(f"{C3}/rooms/{r}/typing/{b}", {"typing": True, "timeout": 5000})
    bob.post(f"{C3}/rooms/{r}/receipt/m.read/{seg(sent[2])}", {})
    bob.post(f"{C3}/rooms/{r}/read_markers", {"m.fully_read": sent[2], "m.read": sent[2]})
    bob.put(f"{C3}/user/{b}/rooms/{r}/account_data/org.example.note", {"n": 1})
    assert bob.get(f"{C3}/user/{b}/rooms/{r}/account_data/org.example.note").body == {"n": 1}
    bob.put(f"{C3}/user/{b}/rooms/{r}/tags/m.favourite", {"order": 0.5})
    assert bob.get(f"{C3}/user/{b}/rooms/{r}/tags")["tags"] == {"m.favourite": {"order": 0.5}}
    bob.delete(f"{C3}/user/{b}/rooms/{r}/tags/m.favourite")

    # Membership changes.
    alice.post(f"{C3}/rooms/{r}/kick", {"user_id": carol.user_id, "reason": "test"})
    alice.post(f"{C3}/rooms/{r}/ban", {"user_id": carol.user_id})
    alice.post(f"{C3}/rooms/{r}/unban", {"user_id": carol.user_id})
    alice.post(f"{C3}/rooms/{r}/invite", {"user_id": carol.user_id})
    carol.post(f"{C3}/rooms/{r}/leave", {})
    carol.post(f"{C3}/rooms/{r}/forget", {})
    world["events"] = sent


def test_sync(world):
    bob: Client = world["bob"]
    room = world["room"]
    first = bob.get(f"{C3}/sync", query={"timeout": 0})
    assert room in first["rooms"]["join"]
    alice: Client = world["alice"]
    alice.put(f"{C3}/rooms/{seg(room)}/send/m.room.message/{unique('t')}", {"msgtype": "m.text", "body": "news"})
    later = bob.get(f"{C3}/sync", query={"since": first["next_batch"], "timeout": 0})
    bodies = [e["content"].get("body") for e in later["rooms"]["join"][room]["timeline"]["events"]]
    assert bodies == ["news"]
    bob.get(f"{C3}/sync", query={"full_state": "true", "timeout": 0, "filter": {"room": {"timeline": {"limit": 2}}}})
    # The legacy endpoints (deprecated, still used by bots) and room peeking.
    r = seg(room)
    init = bob.get(f"{C3}/initialSync", query={"limit": 2})
    assert room in [i["room_id"] for i in init["rooms"]]
    news = alice.put(f"{C3}/rooms/{r}/send/m.room.message/{unique('t')}", {"msgtype": "m.text", "body": "stream"})["event_id"]
    stream = bob.get(f"{C3}/events", query={"from": init["end"], "timeout": 0})
    assert news in [e["event_id"] for e in stream["chunk"]]
    peek = bob.get(f"{C3}/events", query={"from": stream["end"], "timeout": 0, "room_id": room})
    assert peek["chunk"] == []
    snapshot = bob.get(f"{C3}/rooms/{r}/initialSync")
    assert snapshot["messages"]["chunk"][-1]["event_id"] == news
    assert bob.get(f"{C3}/events/{seg(news)}")["content"]["body"] == "stream"


def canonical(obj) -> str:
    """Canonical JSON of a signed object (spec appendix), without signatures/unsigned."""
    obj = {k: v for k, v in obj.items() if k not in ("signatures", "unsigned")}
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def test_end_to_end_encryption(anon, world):
    """Device keys, one-time and fallback keys, claims, changes, to-device, signed with
    real Olm keys (python-olm) the way clients do."""
    import olm

    alice: Client = world["alice"]
    bob: Client = world["bob"]
    since = bob.get(f"{C3}/sync", query={"timeout": 0})["next_batch"]
    account = olm.Account()
    device_keys = {
        "user_id": alice.user_id,
        "device_id": alice.device_id,
        "algorithms": ["m.olm.v1.curve25519-aes-sha2", "m.megolm.v1.aes-sha2"],
        "keys": {
            f"curve25519:{alice.device_id}": account.identity_keys["curve25519"],
            f"ed25519:{alice.device_id}": account.identity_keys["ed25519"],
        },
    }
    device_keys["signatures"] = {alice.user_id: {f"ed25519:{alice.device_id}": account.sign(canonical(device_keys))}}
    account.generate_one_time_keys(3)
    one_time = {}
    for key_id, key in account.one_time_keys["curve25519"].items():
        signed = {"key": key}
        signed["signatures"] = {alice.user_id: {f"ed25519:{alice.device_id}": account.sign(canonical(signed))}}
        one_time[f"signed_curve25519:{key_id}"] = signed
    account.generate_fallback_key()
    (fb_id, fb_key), = account.fallback_key["curve25519"].items()
    fallback = {"key": fb_key, "fallback": True}
    fallback["signatures"] = {alice.user_id: {f"ed25519:{alice.device_id}": account.sign(canonical(fallback))}}
    counts = alice.post(
        f"{C3}/keys/upload",
        {"device_keys": device_keys, "one_time_keys": one_time, "fallback_keys": {f"signed_curve25519:{fb_id}": fallback}},
    )["one_time_key_counts"]
    assert counts == {"signed_curve25519": 3}, counts
    queried = bob.post(f"{C3}/keys/query", {"device_keys": {alice.user_id: []}})
    assert queried["device_keys"][alice.user_id][alice.device_id]["keys"] == device_keys["keys"]
    claimed = bob.post(f"{C3}/keys/claim", {"one_time_keys": {alice.user_id: {alice.device_id: "signed_curve25519"}}})
    assert list(claimed["one_time_keys"][alice.user_id][alice.device_id])[0] in one_time
    later = bob.get(f"{C3}/sync", query={"since": since, "timeout": 0})["next_batch"]
    changes = bob.get(f"{C3}/keys/changes", query={"from": since, "to": later})
    assert alice.user_id in changes["changed"], changes.body
    bob.put(
        f"{C3}/sendToDevice/m.test/{unique('t')}",
        {"messages": {alice.user_id: {alice.device_id: {"hello": "alice"}}}},
    )
    delivered = alice.get(f"{C3}/sync", query={"timeout": 0})
    assert {"sender": bob.user_id, "type": "m.test", "content": {"hello": "alice"}} in delivered["to_device"]["events"]
    assert delivered["device_one_time_keys_count"] == {"signed_curve25519": 2}


def test_cross_signing(world):
    """Master, self-signing and user-signing keys, and a signature on a device."""
    import olm

    alice: Client = world["alice"]

    def key(usage, signer=None):
        pk = olm.PkSigning(olm.PkSigning.generate_seed())
        obj = {"user_id": alice.user_id, "usage": [usage], "keys": {f"ed25519:{pk.public_key}": pk.public_key}}
        if signer is not None:
            obj["signatures"] = {alice.user_id: {f"ed25519:{signer.public_key}": signer.sign(canonical(obj))}}
        return pk, obj

    master, master_obj = key("master")
    ssk, ssk_obj = key("self_signing", master)
    _, usk_obj = key("user_signing", master)
    alice.post(
        f"{C3}/keys/device_signing/upload",
        {"master_key": master_obj, "self_signing_key": ssk_obj, "user_signing_key": usk_obj},
    )
    mine = alice.post(f"{C3}/keys/query", {"device_keys": {alice.user_id: []}})
    assert mine["master_keys"][alice.user_id] == master_obj
    assert mine["user_signing_keys"][alice.user_id] == usk_obj
    device = mine["device_keys"][alice.user_id][alice.device_id]
    device.pop("unsigned", None)
    device["signatures"][alice.user_id][f"ed25519:{ssk.public_key}"] = ssk.sign(canonical(device))
    done = alice.post(f"{C3}/keys/signatures/upload", {alice.user_id: {alice.device_id: device}})
    assert done["failures"] == {}, done.body


def test_key_backup(world):
    alice: Client = world["alice"]
    alg = "m.megolm_backup.v1.curve25519-aes-sha2"
    version = alice.post(f"{C3}/room_keys/version", {"algorithm": alg, "auth_data": {"public_key": "abc"}})["version"]
    assert alice.get(f"{C3}/room_keys/version")["version"] == version
    alice.put(f"{C3}/room_keys/version/{version}", {"algorithm": alg, "auth_data": {"public_key": "def"}, "version": version})
    assert alice.get(f"{C3}/room_keys/version/{version}")["auth_data"] == {"public_key": "def"}
    session = {"first_message_index": 0, "forwarded_count": 0, "is_verified": False, "session_data": {"ciphertext": "c", "ephemeral": "e", "mac": "m"}}
    r = seg(world["room"])
    q = {"version": version}
    assert alice.put(f"{C3}/room_keys/keys", {"rooms": {world["room"]: {"sessions": {"s1": session}}}}, query=q)["count"] == 1
    alice.put(f"{C3}/room_keys/keys/{r}", {"sessions": {"s2": session}}, query=q)
    alice.put(f"{C3}/room_keys/keys/{r}/s3", session, query=q)
    assert set(alice.get(f"{C3}/room_keys/keys", query=q)["rooms"][world["room"]]["sessions"]) == {"s1", "s2", "s3"}
    assert set(alice.get(f"{C3}/room_keys/keys/{r}", query=q)["sessions"]) == {"s1", "s2", "s3"}
    assert alice.get(f"{C3}/room_keys/keys/{r}/s1", query=q)["first_message_index"] == 0
    assert alice.delete(f"{C3}/room_keys/keys/{r}/s1", query=q)["count"] == 2
    assert alice.delete(f"{C3}/room_keys/keys/{r}", query=q)["count"] == 0
    alice.delete(f"{C3}/room_keys/keys", query=q)
    alice.delete(f"{C3}/room_keys/version/{version}")
    alice.get(f"{C3}/room_keys/version", expect=404)


def test_media(anon, world):
    """Upload (direct and asynchronous), download, thumbnail, config; legacy too."""
    import struct
    import zlib

    alice: Client = world["alice"]
    # A 4x4 red PNG, built by hand.
    raw = b"".join(b"\x00" + b"\xff\x00\x00" * 4 for _ in range(4))
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 4, 4, 8, 2, 0, 0, 0)) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
    uri = alice.post("/_matrix/media/v3/upload", raw_body=png, content_type="image/png", query={"filename": "red.png"})["content_uri"]
    server_and_id = uri.removeprefix("mxc://")
    V1 = "/_matrix/client/v1/media"
    assert alice.get(f"{V1}/download/{server_and_id}").body == png
    assert alice.get(f"{V1}/download/{server_and_id}/other.png").body == png
    thumb = alice.get(f"{V1}/thumbnail/{server_and_id}", query={"width": 2, "height": 2, "method": "crop"})
    assert thumb.content_type == "image/png" and thumb.body.startswith(b"\x89PNG")
    assert alice.get(f"{V1}/config")["m.upload.size"] > 0
    created = alice.post("/_matrix/media/v1/create")
    later = created["content_uri"].removeprefix("mxc://")
    alice.put(f"/_matrix/media/v3/upload/{later}", raw_body=b"hello", content_type="text/plain")
    assert anon.get(f"/_matrix/media/v3/download/{later}").body == b"hello"
    assert anon.get(f"/_matrix/media/v3/download/{later}/hello.txt").body == b"hello"
    anon.get(f"/_matrix/media/v3/thumbnail/{server_and_id}", query={"width": 2, "height": 2})
    anon.get("/_matrix/media/v3/config")
def test_push_rules_notifications_and_pushers(world):
    alice: Client = world["alice"]
    bob: Client = world["bob"]
    r = seg(world["room"])
    rules = f"{C3}/pushrules/global"
    bob.put(f"{rules}/content/cake", {"pattern": "cake*", "actions": ["notify", {"set_tweak": "highlight"}]})
    assert bob.get(f"{rules}/content/cake")["pattern"] == "cake*"
    bob.put(f"{rules}/content/cake/enabled", {"enabled": False})
    assert bob.get(f"{rules}/content/cake/enabled")["enabled"] is False
    bob.put(f"{rules}/content/cake/actions", {"actions": ["notify"]})
    assert bob.get(f"{rules}/content/cake/actions")["actions"] == ["notify"]
    bob.delete(f"{rules}/content/cake")
    bob.get(f"{rules}/content/cake", expect=404)
    mention = alice.put(
        f"{C3}/rooms/{r}/send/m.room.message/{unique('t')}",
        {"msgtype": "m.text", "body": "bob!", "m.mentions": {"user_ids": [bob.user_id]}},
    )["event_id"]
    notes = bob.get(f"{C3}/notifications", query={"limit": 5})
    assert notes["notifications"][0]["event"]["event_id"] == mention
    highlights = bob.get(f"{C3}/notifications", query={"only": "highlight"})
    assert highlights["notifications"][0]["event"]["event_id"] == mention
    pusher = {
        "pushkey": "conformance-key",
        "kind": "http",
        "app_id": "org.example.conformance",
        "app_display_name": "Conformance",
        "device_display_name": "Test device",
        "lang": "en",
        "data": {"url": "https://push.example.org/_matrix/push/v1/notify"},
    }
    bob.post(f"{C3}/pushers/set", pusher)
    assert bob.get(f"{C3}/pushers")["pushers"][0]["pushkey"] == "conformance-key"
    bob.post(f"{C3}/pushers/set", {"app_id": pusher["app_id"], "pushkey": pusher["pushkey"], "kind": None})
    assert bob.get(f"{C3}/pushers")["pushers"] == []


def test_relations_and_threads(world):
    alice: Client = world["alice"]
    bob: Client = world["bob"]
    r = seg(world["room"])
    send = lambda c, kind, content: c.put(f"{C3}/rooms/{r}/send/{kind}/{unique('t')}", content)["event_id"]
    root = send(alice, "m.room.message", {"msgtype": "m.text", "body": "thread root"})
    reply = send(
        bob,
        "m.room.message",
        {"msgtype": "m.text", "body": "in thread", "m.relates_to": {"rel_type": "m.thread", "event_id": root}},
    )
    send(bob, "m.reaction", {"m.relates_to": {"rel_type": "m.annotation", "event_id": root, "key": "+1"}})
    v1 = f"/_matrix/client/v1/rooms/{r}"
    assert len(bob.get(f"{v1}/relations/{seg(root)}")["chunk"]) == 2
    assert bob.get(f"{v1}/relations/{seg(root)}/m.thread")["chunk"][0]["event_id"] == reply
    assert len(bob.get(f"{v1}/relations/{seg(root)}/m.annotation/m.reaction", query={"recurse": "true"})["chunk"]) == 1
    threads = bob.get(f"{v1}/threads", query={"include": "participated"})
    assert threads["chunk"][0]["event_id"] == root
    summary = threads["chunk"][0]["unsigned"]["m.relations"]["m.thread"]
    assert summary["count"] == 1 and summary["current_user_participated"] is True


def test_logout_all(anon):
    dave = register(anon, unique("dave"))
    dave.post(f"{C3}/logout/all")
    dave.get(f"{C3}/account/whoami", expect=401)


def password_auth(user: str, password: str, session: str) -> dict:
    return {
        "type": "m.login.password",
        "identifier": {"type": "m.id.user", "user": user},
        "password": password,
        "session": session,
    }


def test_devices_and_account_management(anon, spindle):
    name = unique("erin")
    erin = register(anon, name)
    login = anon.post(
        f"{C3}/login",
        {
            "type": "m.login.password",
            "identifier": {"type": "m.id.user", "user": name},
            "password": "correct horse battery",
            "device_id": "ERINPHONE",
            "refresh_token": True,
        },
    )
    assert login["refresh_token"] and login["expires_in_ms"] > 0
    refreshed = anon.post(f"{C3}/refresh", {"refresh_token": login["refresh_token"]})
    assert refreshed["access_token"] != login["access_token"]

    devices = erin.get(f"{C3}/devices")["devices"]
    assert {d["device_id"] for d in devices} == {erin.device_id, "ERINPHONE"}
    erin.put(f"{C3}/devices/ERINPHONE", {"display_name": "Erin's phone"})
    assert erin.get(f"{C3}/devices/ERINPHONE")["display_name"] == "Erin's phone"
    challenge = erin.delete(f"{C3}/devices/ERINPHONE", {}, expect=401)
    erin.delete(
        f"{C3}/devices/ERINPHONE",
        {"auth": password_auth(name, "correct horse battery", challenge["session"])},
    )
    challenge = erin.post(f"{C3}/delete_devices", {"devices": ["GONE"]}, expect=401)
    erin.post(
        f"{C3}/delete_devices",
        {"devices": ["GONE"], "auth": password_auth(name, "correct horse battery", challenge["session"])},
    )
    assert erin.get(f"{C3}/account/3pid")["threepids"] == []

    challenge = erin.post(f"{C3}/account/password", {"new_password": "new horse"}, expect=401)
    erin.post(
        f"{C3}/account/password",
        {"new_password": "new horse", "logout_devices": True,
         "auth": password_auth(name, "correct horse battery", challenge["session"])},
    )
    me = seg(erin.user_id)
    erin.put(f"{C3}/presence/{me}/status", {"presence": "online", "status_msg": "here"})
    assert erin.get(f"{C3}/presence/{me}/status")["presence"] == "online"

    challenge = erin.post(f"{C3}/account/deactivate", {"erase": True}, expect=401)
    done = erin.post(
        f"{C3}/account/deactivate",
        {"erase": True, "auth": password_auth(name, "new horse", challenge["session"])},
    )
    assert done["id_server_unbind_result"] == "no-support"


def test_third_party_identifiers(anon, spindle, identity_server):
    name = unique("frank")
    frank = register(anon, name)
    caps = frank.get(f"{C3}/capabilities")["capabilities"]
    assert caps["m.3pid_changes"] == {"enabled": True}
    address = f"{name}@example.org"
    sent = anon.post(
        f"{C3}/account/3pid/email/requestToken",
        {"client_secret": "conformance-secret", "email": address, "send_attempt": 1},
    )
    link = next(l for l in MAILS[-1].splitlines() if l.startswith("http"))
    with urllib.request.urlopen(link) as page:
        assert page.status == 200
    challenge = frank.post(
        f"{C3}/account/3pid/add",
        {"sid": sent["sid"], "client_secret": "conformance-secret"},
        expect=401,
    )
    frank.post(
        f"{C3}/account/3pid/add",
        {"sid": sent["sid"], "client_secret": "conformance-secret",
         "auth": password_auth(name, "correct horse battery", challenge["session"])},
    )
    listed = frank.get(f"{C3}/account/3pid")["threepids"]
    assert [(t["medium"], t["address"]) for t in listed] == [("email", address)]
    taken = anon.post(
        f"{C3}/register/email/requestToken",
        {"client_secret": "other-secret", "email": address, "send_attempt": 1},
        expect=400,
    )
    assert taken["errcode"] == "M_THREEPID_IN_USE"
    anon.post(
        f"{C3}/register/email/requestToken",
        {"client_secret": "other-secret", "email": f"new-{address}", "send_attempt": 1},
    )
    for path in (f"{C3}/account/3pid/msisdn/requestToken", f"{C3}/register/msisdn/requestToken"):
        refused = anon.post(
            path,
            {"client_secret": "s", "country": "GB", "phone_number": "07700900000", "send_attempt": 1},
            expect=400,
        )
        assert refused["errcode"] == "M_THREEPID_MEDIUM_NOT_SUPPORTED"
    creds = {"sid": "good", "client_secret": "secret", "id_server": identity_server,
             "id_access_token": "is-token"}
    frank.post(f"{C3}/account/3pid/bind", creds)
    frank.post(f"{C3}/account/3pid", {"three_pid_creds": creds})
    unbound = frank.post(
        f"{C3}/account/3pid/unbind", {"medium": "email", "address": "conformance@example.org"}
    )
    assert unbound["id_server_unbind_result"] == "success"
    deleted = frank.post(f"{C3}/account/3pid/delete", {"medium": "email", "address": address})
    assert deleted["id_server_unbind_result"] == "no-support"
    assert frank.get(f"{C3}/account/3pid")["threepids"] == []


def test_room_discovery(anon, world, spindle):
    alice: Client = world["alice"]
    bob: Client = world["bob"]
    room = world["room"]
    r = seg(room)
    alice.put(f"{C3}/directory/list/room/{r}", {"visibility": "public"})
    assert alice.get(f"{C3}/directory/list/room/{r}")["visibility"] == "public"
    listed = anon.get(f"{C3}/publicRooms", query={"limit": 10})
    assert room in [c["room_id"] for c in listed["chunk"]]
    found = alice.post(f"{C3}/publicRooms", {"limit": 5, "filter": {"generic_search_term": "lobby"}})
    assert [c["room_id"] for c in found["chunk"]] == [room]
    users = bob.post(f"{C3}/user_directory/search", {"search_term": "alice", "limit": 5})
    assert alice.user_id in [u["user_id"] for u in users["results"]]

    # Server-side search: "hello 0" was redacted, so two pages of one result each.
    criteria = {
        "search_term": "hello", "order_by": "recent", "filter": {"limit": 1, "rooms": [room]},
        "event_context": {"before_limit": 1, "after_limit": 1, "include_profile": True},
        "groupings": {"group_by": [{"key": "room_id"}, {"key": "sender"}]},
        "include_state": True,
    }
    first = bob.post(f"{C3}/search", {"search_categories": {"room_events": criteria}})
    events = first["search_categories"]["room_events"]
    assert [x["result"]["event_id"] for x in events["results"]] == [world["events"][2]]
    assert events["count"] == 2 and events["highlights"] == ["hello"]
    second = bob.post(f"{C3}/search", {"search_categories": {"room_events": criteria}},
                      query={"next_batch": events["next_batch"]})
    events = second["search_categories"]["room_events"]
    assert [x["result"]["event_id"] for x in events["results"]] == [world["events"][1]]
    assert "next_batch" not in events

    knock_room = alice.post(f"{C3}/createRoom", {"preset": "private_chat"})["room_id"]
    alice.put(f"{C3}/rooms/{seg(knock_room)}/state/m.room.join_rules", {"join_rule": "knock"})
    knocked = bob.post(f"{C3}/knock/{seg(knock_room)}", {"reason": "hello"})
    assert knocked["room_id"] == knock_room
    synced = bob.get(f"{C3}/sync", query={"timeout": 0})
    assert knock_room in synced["rooms"]["knock"]


def test_room_features(anon, world, spindle):
    alice: Client = world["alice"]
    bob: Client = world["bob"]
    room = world["room"]
    r = seg(room)
    event = world["events"][1]

    space = alice.post(f"{C3}/createRoom", {"preset": "public_chat", "name": "Space",
                                            "creation_content": {"type": "m.space"}})["room_id"]
    alice.put(f"{C3}/rooms/{seg(space)}/state/m.space.child/{r}", {"via": [spindle.server_name]})
    tree = bob.get(f"/_matrix/client/v1/rooms/{seg(space)}/hierarchy", query={"limit": 10})
    assert [room_["room_id"] for room_ in tree["rooms"]] == [space, room]

    summary = anon.get(f"/_matrix/client/v1/room_summary/{seg(space)}")
    assert summary["room_type"] == "m.space"

    found = bob.get(f"/_matrix/client/v1/rooms/{r}/timestamp_to_event",
                    query={"ts": int(time.time() * 1000) + 60_000, "dir": "b"})
    assert found["event_id"].startswith("$")

    bob.post(f"{C3}/rooms/{r}/report/{seg(event)}", {"reason": "conformance"})
    bob.post(f"{C3}/rooms/{r}/report", {"reason": "conformance"})

    old = alice.post(f"{C3}/createRoom", {"preset": "private_chat", "name": "Old"})["room_id"]
    upgraded = alice.post(f"{C3}/rooms/{seg(old)}/upgrade", {"new_version": "11"})
    assert upgraded["replacement_room"] != old


def test_everyday_endpoints(anon, world, spindle):
    """TURN, third-party lookups, OpenID, registration tokens, support, user reports,
    extended profiles and mutual rooms."""
    alice: Client = world["alice"]
    bob: Client = world["bob"]
    turn = alice.get(f"{C3}/voip/turnServer")
    assert turn["username"].endswith(":" + alice.user_id) and turn["ttl"] == 86400

    assert alice.get(f"{C3}/thirdparty/protocols").body == {}
    for path in ("protocol", "location", "user"):
        assert alice.get(f"{C3}/thirdparty/{path}/irc", expect=404)["errcode"] == "M_NOT_FOUND"
    assert alice.get(f"{C3}/thirdparty/user", query={"userid": bob.user_id}).body == []
    lobby = alice.get(f"{C3}/rooms/{seg(world['room'])}/aliases")["aliases"][0]
    assert alice.get(f"{C3}/thirdparty/location", query={"alias": lobby}).body == []

    me = seg(alice.user_id)
    token = alice.post(f"{C3}/user/{me}/openid/request_token", {})
    assert token["matrix_server_name"] == spindle.server_name and token["expires_in"] == 3600
    info = anon.get("/_matrix/federation/v1/openid/userinfo", query={"access_token": token["access_token"]})
    assert info.body == {"sub": alice.user_id}

    validity = anon.get("/_matrix/client/v1/register/m.login.registration_token/validity", query={"token": "nope"})
    assert validity.body == {"valid": False}
    support = anon.get("/.well-known/matrix/support")
    assert support["support_page"] == "https://example.org/help"

    assert bob.post(f"{C3}/users/{me}/report", {"reason": "conformance"}).body == {}

    alice.put(f"{C3}/profile/{me}/m.tz", {"m.tz": "Europe/London"})
    alice.put(f"{C3}/profile/{me}/org.example.status", {"org.example.status": {"busy": True}})
    assert alice.get(f"{C3}/profile/{me}/org.example.status").body == {"org.example.status": {"busy": True}}
    assert anon.get(f"{C3}/profile/{me}")["m.tz"] == "Europe/London"
    alice.delete(f"{C3}/profile/{me}/org.example.status")
    alice.get(f"{C3}/profile/{me}/org.example.status", expect=404)

    whois = alice.get(f"{C3}/admin/whois/{me}")
    assert alice.device_id in whois["devices"]

    mutual = alice.get("/_matrix/client/v1/mutual_rooms", query={"user_id": bob.user_id})
    assert world["room"] in mutual["joined"] and mutual["count"] == len(mutual["joined"])


# -- coverage and the generated document --------------------------------------------


def probe_served(anon: Client, spec: Spec) -> dict[str, bool]:
    """For every spec operation: does the router serve it? (Asked without credentials.)"""
    served = {}
    for op in spec.operations:
        body = b"{}" if op.method in ("POST", "PUT") else None
        answer: Answer = anon.request(op.method, op.probe_path(), raw_body=body, expect=None, auth=False)
        unrecognized = answer.status in (404, 405) and answer.get("errcode") == "M_UNRECOGNIZED"
        served[op.key] = not unrecognized
    return served


@pytest.fixture(scope="module")
def served(spindle, spec) -> dict[str, bool]:
    # Probes record into their own recorder: an endpoint counts as exercised only
    # through a flow, never through its probe.
    return probe_served(Client(spindle.base_url, Recorder(spec)), spec)


# Served endpoints that cannot answer 2xx on this server, and why. Each must still have
# been called by a flow and answered with a status the spec documents for it.
NO_SUCCESS_HERE = {
    "POST /_matrix/client/v3/account/3pid/msisdn/requestToken": "no SMS is sent: 400 M_THREEPID_MEDIUM_NOT_SUPPORTED",
    "POST /_matrix/client/v3/register/msisdn/requestToken": "no SMS is sent: 400 M_THREEPID_MEDIUM_NOT_SUPPORTED",
    "GET /_matrix/client/v3/thirdparty/protocol/{protocol}": "no registration here declares protocols: every protocol is unknown (404)",
    "GET /_matrix/client/v3/thirdparty/location/{protocol}": "no registration here declares protocols: every protocol is unknown (404)",
    "GET /_matrix/client/v3/thirdparty/user/{protocol}": "no registration here declares protocols: every protocol is unknown (404)",
}


def test_application_services(anon, spindle):
    bot = Client(anon.base_url, anon.recorder, AS_TOKEN)
    name = unique("conformance_")
    user = bot.post(
        f"{C3}/register",
        {"type": "m.login.application_service", "username": name, "inhibit_login": True},
    )
    assert user["user_id"] == f"@{name}:{spindle.server_name}"
    login = bot.post(
        f"{C3}/login",
        {"type": "m.login.application_service", "identifier": {"type": "m.id.user", "user": name}},
    )
    assert login["user_id"] == user["user_id"]
    pong = bot.post("/_matrix/client/v1/appservice/conformance/ping", {"transaction_id": "conf-1"})
    assert isinstance(pong["duration_ms"], int)
    room = bot.post(f"{C3}/createRoom", {"name": "bridged network room"})["room_id"]
    bot.put(f"{C3}/directory/list/appservice/conformance-net/{seg(room)}", {"visibility": "public"})
    listed = anon.get(f"{C3}/publicRooms", query={"third_party_instance_id": "conformance|conformance-net"})
    assert [c["room_id"] for c in listed["chunk"]] == [room]
    taken = anon.get(f"{C3}/register/available", query={"username": unique("conformance_")}, expect=400)
    assert taken["errcode"] == "M_EXCLUSIVE"


def test_every_served_endpoint_is_exercised(spec, recorder, served):
    ops = {op.key: op for op in spec.operations}
    missing = [
        key
        for key, ok in served.items()
        if ok
        and recorder.exercised.get(key, 0) == 0
        # Server-Server endpoints need X-Matrix-signed requests from another server:
        # they are exercised by tests/e2e/test_federation_synapse.py (real Synapse) and
        # tests/federation.rs (signed requests, route walk), not by these client flows.
        and not key.split(" ", 1)[-1].startswith(("/_matrix/federation/", "/_matrix/key/"))
        and not (
            key in NO_SUCCESS_HERE
            and any(ops[key].documents_status(st) for st in recorder.seen.get(key, ()))
        )
    ]
    assert not missing, (
        "served endpoints with no validated 2xx answer from a conformance flow; add a flow "
        "step in tests/e2e/test_conformance.py (see docs/conformance.md):\n  "
        + "\n  ".join(sorted(missing))
    )


# Behaviour the endpoint table cannot show, kept here so the generated page carries it
# (issue 15). Each line names where Spindle now matches Synapse and the spec, or where
# it deliberately differs.
BEHAVIOUR_NOTES = [
    "What issue 15 changed (tests: `tests/room_versions.rs`, `tests/client_details.rs`,",
    "`tests/legacy.rs`, `journal/tests/room_versions.rs`):",
    "",
    "- Room versions 1 to 12 are created, joined and upgraded (`/capabilities` lists all as",
    "  stable, default 10). v1/v2 event ids are `$opaque:server` and carried in the PDU;",
    "  string power levels are accepted before v10 and written as integers on upgrade.",
    "  Differs: event content with floats or integers beyond 2^53 is refused in every",
    "  version (ruma's canonical JSON), not only from v6; a fork in a v1 room would need",
    "  state resolution v1, which is not implemented (SPEC.md, \"Room versions\").",
    "- Registration sets the display name to the localpart, as Synapse.",
    "- Timeline events rendered for a user carry `unsigned.membership` (spec v1.11, MSC4115);",
    "  state events in `/state`, `/members` and `/sync`'s `state` carry neither it nor bundled",
    "  aggregations, as Synapse (the spec lets a server omit it where it is expensive).",
    "  `prev_content` is redacted when the event it comes from was, and is served as",
    "  Synapse serves it (in `/state`, `/sync`'s `state` and sliding sync's non-member",
    "  `required_state`), whether or not history visibility let the reader see the event it",
    "  comes from (the spec's \"if the client has permission\"). `/sync` and sliding sync",
    "  write events as `ClientEventWithoutRoomID` (no `room_id`, in `redacted_because` too),",
    "  the room endpoints as `ClientEvent`. Differs: v1.19's",
    "  `unsigned.replaces_state` is not served (it would name events history visibility",
    "  hides, which the spec allows and `tests/invariants.rs` holds Spindle to).",
    "- Sending state identical to the current event (same sender) returns its event id.",
    "- `/messages` without `dir` is 400 `M_MISSING_PARAM`.",
    "- `/joined_members` and `/members` are readable for world-readable rooms, as `/state`.",
    "- `/versions` advertises `org.matrix.e2e_cross_signing`; the unstable",
    "  `/keys/device_signing/upload` path is served.",
    "- A device added, renamed or removed puts its user in `device_lists.changed` for",
    "  room-mates; a signature on another user's key lists that user for the signer.",
    "- Legacy `GET /events` carries timeline events only (no presence, typing, receipts or",
    "  invites, which `/sync` has); `presence` in the initial syncs is empty.",
    "- Guest access (`tests/guest_access.rs`), off unless `[registration]",
    "  allow_guest_access` (as Synapse): `POST /register?kind=guest` gives a numeric user id",
    "  (one past the largest numeric localpart, as Synapse); a guest's token answers 403",
    "  `M_GUEST_ACCESS_FORBIDDEN` outside the spec's guest endpoints (plus `POST",
    "  /join/{roomIdOrAlias}` and the legacy media download paths, as Synapse); a guest joins",
    "  (any endpoint, `PUT /state/m.room.member` too) only a room whose `m.room.guest_access`",
    "  is `can_join`, else 403 `M_FORBIDDEN`; when it stops being `can_join` each joined local",
    "  guest leaves (its own `leave`, as Synapse); the upgrade is the spec's form",
    "  (`guest_access_token` with `username` the guest's localpart, or the guest's token as",
    "  `Authorization`) and keeps the user id, devices and memberships. Beyond the spec's",
    "  list a guest may call what Synapse allows (`/capabilities`, `/joined_rooms`,",
    "  `/publicRooms`, `/keys/changes`, `/keys/signatures/upload`, `/relations`,",
    "  `/hierarchy`, the room summary, sliding sync); typing, receipts, filters and account",
    "  data stay closed, as in Synapse.",
    "- Sync details (`tests/sync_details.rs`): with `lazy_load_members` an incremental sync",
    "  carries the member event of every timeline sender the device was not sent yet",
    "  (remembered per device in memory, as Synapse's cache; anything forgotten is sent",
    "  again); a leave and rejoin since the token sends the room whole with the state",
    "  changed while away; a join and leave in one batch gives the `leave` entry with its",
    "  state; `limited` is true whenever events were skipped; `event_format: federation`",
    "  is honoured on `/sync`, `/messages` and `/context`; ignored users' non-state events,",
    "  invites, typing and receipts are left out, and their events are not found by",
    "  `/search` (nor counted); an inline filter that is not JSON is 400",
    "  `M_NOT_JSON`, a wrong shape 400 `M_BAD_JSON` (Synapse: `M_UNKNOWN`; the spec's code",
    "  kept), an unknown filter id 400 `M_INVALID_PARAM`. The heroes' member events go",
    "  with the summary of a room without a name or canonical alias only, as Synapse.",
    "  `tests/e2e/test_nio_lazy_members.py` drives this with matrix-nio.",
    "- Redacted relations leave `/relations` and the bundles (`tests/relations.rs`): a",
    "  redacted latest edit gives way to the edit before it, a thread's count and latest",
    "  event move back, a redacted reference leaves the chunk (as Synapse).",
    "- Deleting an alias takes it out of `m.room.canonical_alias` (`alias` and",
    "  `alt_aliases`), sent by the deleting user, best effort (as Synapse).",
    "- `GET /user/{userId}/account_data/m.push_rules` reads back the ruleset; writing it",
    "  stays refused. The sliding-sync `account_data` extension carries `m.push_rules` and",
    "  a change wakes a waiting request.",
    "- `/keys/upload` stores device keys whose signatures the server cannot check (clients",
    "  verify them, as Synapse); only another user's or device's keys are refused.",
    "  `tests/sdk/tests/verification.rs`: two users verify each other with SAS over an",
    "  encrypted DM, driven by matrix-rust-sdk, and each then sees the other verified.",
    "- Push rules API (`tests/push.rs`): `GET /pushrules/global/{kind}/` lists a kind;",
    "  `dont_notify` and `coalesce` read back as sent; every malformed path below",
    "  `/pushrules/` is 400 `M_UNRECOGNIZED`; a password change with `logout_devices` removes",
    "  the pushers of the other devices. Differs: unknown actions are 400 `M_BAD_JSON`",
    "  (Synapse: `M_UNKNOWN`).",
    "- User-interactive auth (`tests/uia.rs`): a session is bound to the operation that",
    "  opened it (endpoint, user and the parameters that decide it: device ids, a digest",
    "  of the new password, `erase`, the keys); using it for another is 403 `M_UNKNOWN`",
    "  (Synapse's message). Differs: Synapse only compares method and path and logs a body",
    "  change; sessions are kept in memory and do not survive a restart. A registration",
    "  session remembers its first request's parameters.",
    "- Presence reaches users who newly share a room; the user directory never returns",
    "  the searcher; OpenID userinfo without a token is 401 `M_MISSING_TOKEN`.",
    "- Third-party identifiers (`tests/threepid.rs`, with an SMTP sink and an identity",
    "  server written in the test), off unless `[email] enabled` (as Synapse without an",
    "  email config: `requestToken` is 400 `M_THREEPID_MEDIUM_NOT_SUPPORTED`, MSC4178):",
    "  the homeserver mails a link to its own `submit_url`",
    "  (`/_matrix/client/unstable/add_threepid/email/submit_token`, Synapse's path; `GET`",
    "  the link, `POST` the spec's `submitToken` contract); `/account/3pid/add` (UIA bound",
    "  to `sid`), `GET /account/3pid`, `/delete`, `/bind` (proxied with `id_access_token`),",
    "  `/unbind` (signed by the homeserver, X-Matrix; without `id_server`, the identity",
    "  servers the bind went through). Third-party invites: `/invite` and `invite_3pid`",
    "  look the address up (`sha256` hashing) and invite its user, or store the invite and",
    "  send `m.room.third_party_invite`; `3pid/onbind` turns it into the invite with",
    "  `third_party_invite.signed` (checked against the invite's keys). Differs: an",
    "  unknown, unvalidated or registration session on `/3pid/add` is 400",
    "  `M_THREEPID_AUTH_FAILED` (Synapse's answer); an identity server that cannot be",
    "  reached is 502 on `/bind` (Synapse: 500). Registration may prove an email",
    "  (`m.login.email.identity`, open registration only) and log in with it",
    "  (`m.id.thirdparty`). Partial: password reset by email and SMS are not implemented.",
    "- Not done yet from issue 15: `/r0/` paths are not served (the conformance suite's",
    "  `TestChangePasswordPushers` uses one).",
]


def render_doc(spec: Spec, served: dict[str, bool]) -> str:
    lines = [
        "# Conformance with the Matrix specification",
        "",
        "<!-- Generated by tests/e2e/test_conformance.py; do not edit by hand. Regenerate with",
        "     SPINDLE_CONFORMANCE_WRITE=1 scripts/test --e2e-only -- -k conformance -->",
        "",
        f"Checked against the spec's own OpenAPI definitions, Matrix {SPEC_VERSION}. An endpoint",
        "counts as served when the router answers it (probed without credentials: anything",
        "but 404/405 `M_UNRECOGNIZED`); every served endpoint is exercised by a flow in",
        "`tests/e2e/test_conformance.py` whose answers validate against the spec's response",
        "schemas. The Application Service, Identity and Push Gateway APIs are served by other",
        "parties and are not counted. How to extend the harness: see the end of this page.",
        "",
        "| API | served | in the spec | not deprecated: served / total |",
        "|---|---|---|---|",
    ]
    for api, title in APIS.items():
        ops = [op for op in spec.operations if op.api == api]
        live = [op for op in ops if not op.deprecated]
        n_served = sum(served[op.key] for op in ops)
        n_live = sum(served[op.key] for op in live)
        lines.append(f"| {title} | {n_served} | {len(ops)} | {n_live} / {len(live)} |")
    for api, title in APIS.items():
        ops = sorted(
            (op for op in spec.operations if op.api == api), key=lambda o: (o.file, o.template, o.method)
        )
        lines += ["", f"## {title}", "", "| spec file | endpoint | served |", "|---|---|---|"]
        for op in ops:
            mark = "yes" if served[op.key] else "no"
            if op.deprecated:
                mark += " (deprecated)"
            lines.append(f"| {op.file} | `{op.method} {op.template}` | {mark} |")
    lines += ["", "## Behaviour beyond the endpoint list", ""] + BEHAVIOUR_NOTES
    lines += [
        "",
        "## Extending the harness",
        "",
        "When you add an endpoint, add a step to a flow in `tests/e2e/test_conformance.py`",
        "that calls it the way a client would (through `Client.get/put/post/delete`) and",
        "asserts what it returns. The recording client validates the answer against the",
        "spec; `test_every_served_endpoint_is_exercised` fails until a served endpoint has a",
        "validated 2xx answer, and this page must be regenerated (command above).",
        "",
    ]
    return "\n".join(lines)


def test_conformance_doc_is_current(spec, served):
    text = render_doc(spec, served)
    if os.environ.get("SPINDLE_CONFORMANCE_WRITE") == "1":
        DOC.write_text(text)
    current = DOC.read_text() if DOC.exists() else ""
    assert current == text, (
        "docs/conformance.md is out of date with what the router serves; regenerate with "
        "SPINDLE_CONFORMANCE_WRITE=1 scripts/test --e2e-only -- -k conformance"
    )
