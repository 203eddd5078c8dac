"""Federation against a real Synapse (issue 12): two servers on loopback, each named
`localhost:PORT` with a TLS federation listener on that port (self-signed certificates
made here), talking the unmodified Server-Server API.

Synapse comes from its own venv: SYNAPSE_PYTHON names its interpreter (scripts/test
creates `.venv-synapse` with matrix-synapse pinned). Without it the module is skipped
with the reason printed, never passed silently.

Covered here: a Synapse user joins a Spindle room by alias (query/directory, make_join,
send_join), a Spindle user joins a Synapse room with 100 earlier messages and pages back
to m.room.create (backfill), 60 messages each way arrive with the same event ids on both sides, a power
level given to the remote user lets them change the topic, kick and ban of the remote
user hold on both sides, Synapse stopped while Spindle sends 5 messages has them all
after it restarts, both servers sending at once converge on the same events and state,
both setting the topic at once converge on one topic (state resolution), a remote
leave, device keys queried and one-time keys claimed across the servers both ways,
typing, receipts, presence and to-device messages both ways, and a matrix-nio client
with encryption on each server decrypting the other's messages in one encrypted room
(also on a second device added later on Synapse), remote presence read through
`GET /presence`, and a Spindle user joining a Synapse room of 500 members with partial
state (sending before the member list is complete; `/members` then lists all 501, and
the remote members are in the user directory).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import SpindleServer, _SERVERS, _tail, free_loopback_port

SYNAPSE_PYTHON = os.environ.get("SYNAPSE_PYTHON", "")
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))

pytestmark = pytest.mark.skipif(
    not SYNAPSE_PYTHON or not os.access(SYNAPSE_PYTHON, os.X_OK),
    reason="SYNAPSE_PYTHON is not set to an interpreter with matrix-synapse installed",
)


# -- a minimal Client-Server client (both servers speak the same API) -------------


class Client:
    def __init__(self, base_url: str):
        self.base_url = base_url
        self.token: str | None = None
        self.user_id: str | None = None
        self.txn = 0

    def call(self, method: str, path: str, body=None, expect=200, timeout=30.0):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with _OPENER.open(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        out = json.loads(raw) if raw else {}
        if expect is not None and status != expect:
            raise AssertionError(f"{method} {path} -> {status} {out} (wanted {expect})")
        return out

    def register(self, name: str) -> str:
        body = {"username": name, "password": "correct horse battery", "auth": {"type": "m.login.dummy"}}
        out = self.call("POST", "/_matrix/client/v3/register", body)
        self.token, self.user_id = out["access_token"], out["user_id"]
        return self.user_id

    def send(self, room_id: str, text: str) -> str:
        self.txn += 1
        path = f"/_matrix/client/v3/rooms/{q(room_id)}/send/m.room.message/t{self.txn}-{time.time_ns()}"
        return self.call("PUT", path, {"msgtype": "m.text", "body": text})["event_id"]

    def state(self, room_id: str, kind: str, key: str = "", content=None, expect=200):
        path = f"/_matrix/client/v3/rooms/{q(room_id)}/state/{kind}/{q(key)}"
        if content is None:
            return self.call("GET", path, expect=expect)
        return self.call("PUT", path, content, expect=expect)

    def messages(self, room_id: str, limit: int = 500) -> list[dict]:
        """Every timeline event, oldest first (pages backwards from the end)."""
        out: list[dict] = []
        token = None
        for _ in range(limit // 100 + 10):
            path = f"/_matrix/client/v3/rooms/{q(room_id)}/messages?dir=b&limit=100"
            if token:
                path += f"&from={q(token)}"
            page = self.call("GET", path)
            out.extend(page.get("chunk", []))
            token = page.get("end")
            if not token or not page.get("chunk") or len(out) >= limit:
                break
        return list(reversed(out))

    def membership(self, room_id: str, user_id: str) -> str | None:
        out = self.state(room_id, "m.room.member", user_id, expect=None)
        return out.get("membership")


def q(s: str) -> str:
    return urllib.parse.quote(s, safe="")


def wait_until(what: str, check, timeout: float = 30.0, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (AssertionError, OSError) as e:
            last = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


# -- the two servers --------------------------------------------------------------


def make_cert(dir: Path) -> tuple[Path, Path]:
    cert, key = dir / "tls.crt", dir / "tls.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    return cert, key


class Synapse:
    def __init__(self, root: Path, fed_port: int, client_port: int, cert: Path, key: Path):
        self.root = root
        self.fed_port = fed_port
        self.client_port = client_port
        self.server_name = f"localhost:{fed_port}"
        self.base_url = f"http://127.0.0.1:{client_port}"
        self.config = root / "homeserver.yaml"
        self.log = root / "synapse.log"
        self.proc: subprocess.Popen | None = None
        log_config = root / "log.yaml"
        log_config.write_text(
            "version: 1\n"
            "formatters: {precise: {format: '%(asctime)s %(name)s %(levelname)s %(message)s'}}\n"
            f"handlers: {{file: {{class: logging.FileHandler, formatter: precise, filename: '{self.log}'}}}}\n"
            "root: {level: INFO, handlers: [file]}\n"
            "disable_existing_loggers: false\n"
        )
        self.config.write_text(
            f"server_name: '{self.server_name}'\n"
            f"pid_file: '{root}/homeserver.pid'\n"
            f"signing_key_path: '{root}/signing.key'\n"
            f"media_store_path: '{root}/media'\n"
            f"log_config: '{log_config}'\n"
            f"tls_certificate_path: '{cert}'\n"
            f"tls_private_key_path: '{key}'\n"
            "report_stats: false\n"
            "suppress_key_server_warning: true\n"
            "trusted_key_servers: []\n"
            "federation_verify_certificates: false\n"
            "allow_public_rooms_over_federation: true\n"
            "room_list_publication_rules: [{action: allow}]\n"
            "federation_ip_range_blacklist: []\n"
            "ip_range_blacklist: []\n"
            "enable_registration: true\n"
            "enable_registration_without_verification: true\n"
            "registration_shared_secret: 'not-a-secret'\n"
            "macaroon_secret_key: 'not-a-secret-either'\n"
            "form_secret: 'nor-this'\n"
            "federation:\n"
            "  destination_min_retry_interval: 200\n"
            "  destination_retry_multiplier: 1.5\n"
            "  destination_max_retry_interval: 2000\n"
            "rc_message: {per_second: 1000, burst_count: 1000}\n"
            "rc_registration: {per_second: 1000, burst_count: 1000}\n"
            "rc_login: {address: {per_second: 1000, burst_count: 1000}, account: {per_second: 1000, burst_count: 1000}, failed_attempts: {per_second: 1000, burst_count: 1000}}\n"
            "rc_joins: {local: {per_second: 1000, burst_count: 1000}, remote: {per_second: 1000, burst_count: 1000}}\n"
            "rc_joins_per_room: {per_second: 1000, burst_count: 1000}\n"
            "rc_federation: {window_size: 1000, sleep_limit: 1000, sleep_delay: 1, reject_limit: 1000, concurrent: 100}\n"
            "database: {name: sqlite3, args: {database: '" + str(root / "homeserver.db") + "'}}\n"
            "listeners:\n"
            f"  - {{port: {fed_port}, tls: true, type: http, bind_addresses: ['127.0.0.1'], resources: [{{names: [federation, keys]}}]}}\n"
            f"  - {{port: {client_port}, tls: false, type: http, x_forwarded: false, bind_addresses: ['127.0.0.1'], resources: [{{names: [client]}}]}}\n"
        )
        subprocess.run(
            [SYNAPSE_PYTHON, "-m", "synapse.app.homeserver", "-c", str(self.config), "--generate-keys"],
            check=True, capture_output=True, cwd=str(root),
        )

    def start(self):
        self.proc = subprocess.Popen(
            [SYNAPSE_PYTHON, "-m", "synapse.app.homeserver", "-c", str(self.config)],
            stdin=subprocess.DEVNULL, stdout=open(self.root / "stdout.log", "ab"),
            stderr=subprocess.STDOUT, cwd=str(self.root), start_new_session=True,
        )
        c = Client(self.base_url)

        def up():
            if self.proc.poll() is not None:
                pytest.fail(f"synapse exited with {self.proc.returncode}\n{self.logs()}\n{_tail(self.root / 'stdout.log')}", pytrace=False)
            return c.call("GET", "/_matrix/client/versions", expect=None).get("versions")

        wait_until("synapse to answer /versions", up, timeout=120)
        return
        wait_until("synapse to answer /versions", lambda: c.call("GET", "/_matrix/client/versions", expect=None).get("versions"), timeout=120)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def logs(self) -> str:
        return f"--- {self.log} ---\n{_tail(self.log, 80)}"


def spindle_for_synapse(binary: str, root: Path, cert: Path, key: Path, extra: str = "") -> SpindleServer:
    """A Spindle configured to federate with the Synapses of this module (not started):
    named `localhost:FED_PORT` with a TLS federation listener on that port, loopback
    allowed, short retries, metrics on (`metrics_url`). `extra` is appended to the
    `[federation]` section."""
    fed, client, metrics = free_loopback_port(), free_loopback_port(), free_loopback_port()
    spindle = SpindleServer(binary, root, client)
    spindle.server_name = f"localhost:{fed}"
    spindle.extra_config = (
        "\n[federation]\n"
        f'tls_bind = "127.0.0.1:{fed}"\n'
        f'tls_certificate_path = "{cert}"\n'
        f'tls_private_key_path = "{key}"\n'
        "dangerous_skip_tls_verification_for_tests = true\n"
        'ip_range_allowlist = ["127.0.0.0/8", "::1/128"]\n'
        "retry_initial_ms = 200\n"
        "retry_max_ms = 2000\n"
        + extra +
        "\n[metrics]\n"
        "enabled = true\n"
        f'bind = "127.0.0.1:{metrics}"\n'
    )
    spindle.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
    spindle.write_config()
    return spindle


def metric(spindle: SpindleServer, name: str) -> float:
    """One unlabelled sample of Spindle's /metrics (0 when absent)."""
    with _OPENER.open(spindle.metrics_url, timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


@pytest.fixture(scope="module")
def servers(spindle_bin, tmp_path_factory):
    root = tmp_path_factory.mktemp("federation")
    cert, key = make_cert(root)
    spindle = spindle_for_synapse(spindle_bin, root / "spindle", cert, key)
    _SERVERS.append(spindle)
    (root / "synapse").mkdir()
    synapse = Synapse(root / "synapse", free_loopback_port(), free_loopback_port(), cert, key)
    synapse.cert, synapse.key = cert, key
    try:
        spindle.start()
        synapse.start()
        yield spindle, synapse
    finally:
        synapse.stop()
        spindle.stop()
        _SERVERS.remove(spindle)


@pytest.fixture(scope="module")
def world(servers):
    """alice on Spindle with a public room `#fed:<spindle>`, bob on Synapse."""
    spindle, synapse = servers
    alice = Client(spindle.base_url)
    alice.register("alice")
    bob = Client(synapse.base_url)
    bob.register("bob")
    room = alice.call("POST", "/_matrix/client/v3/createRoom", {
        "preset": "public_chat", "room_alias_name": "fed", "name": "Federated",
    })["room_id"]
    return {"spindle": spindle, "synapse": synapse, "alice": alice, "bob": bob, "room": room}


def ids(events, kind="m.room.message"):
    return [e["event_id"] for e in events if e["type"] == kind]


def test_synapse_user_joins_a_spindle_room_by_alias(world):
    alice, bob, room, spindle = world["alice"], world["bob"], world["room"], world["spindle"]
    alias = f"#fed:{spindle.server_name}"
    joined = bob.call("POST", f"/_matrix/client/v3/join/{q(alias)}", {})
    assert joined["room_id"] == room
    wait_until("bob's join on Spindle", lambda: alice.membership(room, bob.user_id) == "join")
    # Both sides agree on the join event and the room's name.
    bob_join = [e for e in alice.messages(room) if e["type"] == "m.room.member" and e["state_key"] == bob.user_id]
    assert len(bob_join) == 1
    theirs = [e for e in bob.messages(room) if e["type"] == "m.room.member" and e["state_key"] == bob.user_id]
    assert [e["event_id"] for e in theirs] == [bob_join[0]["event_id"]]
    assert bob.state(room, "m.room.name")["name"] == "Federated"
    assert bob.membership(room, alice.user_id) == "join"
    # Profiles across servers, both ways.
    bob.call("PUT", f"/_matrix/client/v3/profile/{q(bob.user_id)}/displayname", {"displayname": "Bob on Synapse"})
    assert alice.call("GET", f"/_matrix/client/v3/profile/{q(bob.user_id)}")["displayname"] == "Bob on Synapse"
    assert alice.call("GET", f"/_matrix/client/v3/profile/{q(bob.user_id)}/displayname") == {"displayname": "Bob on Synapse"}
    alice.call("PUT", f"/_matrix/client/v3/profile/{q(alice.user_id)}/displayname", {"displayname": "Alice on Spindle"})
    assert bob.call("GET", f"/_matrix/client/v3/profile/{q(alice.user_id)}")["displayname"] == "Alice on Spindle"


def test_sixty_messages_each_way_arrive_with_the_same_event_ids(world):
    alice, bob, room = world["alice"], world["bob"], world["room"]
    sent_a = [alice.send(room, f"from spindle {i}") for i in range(60)]
    sent_b = [bob.send(room, f"from synapse {i}") for i in range(60)]
    want = set(sent_a) | set(sent_b)
    wait_until("all 120 messages on Synapse", lambda: want <= set(ids(bob.messages(room))), timeout=60)
    wait_until("all 120 messages on Spindle", lambda: want <= set(ids(alice.messages(room))), timeout=60)
    on_spindle, on_synapse = ids(alice.messages(room)), ids(bob.messages(room))
    # Each side's own messages keep their order on the other side.
    assert [e for e in on_synapse if e in set(sent_a)] == sent_a
    assert [e for e in on_spindle if e in set(sent_b)] == sent_b
    assert set(on_spindle) == set(on_synapse)


def test_remote_user_with_power_changes_topic_and_kick_and_ban_hold(world):
    alice, bob, room, spindle = world["alice"], world["bob"], world["room"], world["spindle"]
    bob.state(room, "m.room.topic", "", {"topic": "not yet"}, expect=403)
    pl = alice.state(room, "m.room.power_levels")
    pl["users"][bob.user_id] = 50
    pl.setdefault("events", {})["m.room.topic"] = 50
    alice.state(room, "m.room.power_levels", "", pl)
    wait_until("bob's power on Synapse", lambda: bob.state(room, "m.room.power_levels")["users"].get(bob.user_id) == 50)
    topic_id = bob.state(room, "m.room.topic", "", {"topic": "set from Synapse"})["event_id"]
    wait_until("the topic on Spindle", lambda: alice.state(room, "m.room.topic", expect=None).get("topic") == "set from Synapse")
    assert topic_id in [e["event_id"] for e in alice.messages(room) if e["type"] == "m.room.topic"]
    # Kick: both sides see bob leave.
    alice.call("POST", f"/_matrix/client/v3/rooms/{q(room)}/kick", {"user_id": bob.user_id, "reason": "test"})
    wait_until("the kick on Synapse", lambda: bob.membership(room, bob.user_id) == "leave")
    assert alice.membership(room, bob.user_id) == "leave"
    # Bob joins again over federation, then a ban holds on both sides.
    bob.call("POST", f"/_matrix/client/v3/join/{q('#fed:' + spindle.server_name)}", {})
    wait_until("bob back on Spindle", lambda: alice.membership(room, bob.user_id) == "join")
    alice.call("POST", f"/_matrix/client/v3/rooms/{q(room)}/ban", {"user_id": bob.user_id, "reason": "test"})
    wait_until("the ban on Spindle", lambda: alice.membership(room, bob.user_id) == "ban")
    # Once Synapse has the ban, bob's join goes to Spindle's make_join and is refused
    # (before that, Synapse still thinks he is in and answers the join itself).
    join_path = f"/_matrix/client/v3/join/{q('#fed:' + spindle.server_name)}"
    out = wait_until("the ban refusing bob's join", lambda: bob.call("POST", join_path, {}, expect=None).get("errcode"))
    assert out == "M_FORBIDDEN"
    assert alice.membership(room, bob.user_id) == "ban"
    alice.call("POST", f"/_matrix/client/v3/rooms/{q(room)}/unban", {"user_id": bob.user_id})


def test_synapse_down_while_spindle_sends_catches_up_after_restart(world):
    alice, bob, room, spindle, synapse = world["alice"], world["bob"], world["room"], world["spindle"], world["synapse"]
    bob.call("POST", f"/_matrix/client/v3/join/{q('#fed:' + spindle.server_name)}", {})
    wait_until("bob joined again", lambda: alice.membership(room, bob.user_id) == "join")
    synapse.stop()
    sent = [alice.send(room, f"while synapse was down {i}") for i in range(5)]
    synapse.start()
    wait_until("the 5 messages on Synapse", lambda: set(sent) <= set(ids(bob.messages(room))), timeout=60)
    assert [e for e in ids(bob.messages(room)) if e in set(sent)] == sent


def test_spindle_user_joins_a_synapse_room_by_alias_and_both_sides_agree(world):
    alice, bob, synapse = world["alice"], world["bob"], world["synapse"]
    room = bob.call("POST", "/_matrix/client/v3/createRoom", {
        "preset": "public_chat", "room_alias_name": "syn", "name": "Hosted on Synapse",
        "topic": "a Synapse room",
    })["room_id"]
    # 100 messages before alice joins (the public_chat preset's visibility: shared).
    before = [bob.send(room, f"before alice {i}") for i in range(100)]
    alias = f"#syn:{synapse.server_name}"
    joined = alice.call("POST", f"/_matrix/client/v3/join/{q(alias)}", {})
    assert joined["room_id"] == room
    wait_until("alice's join on Synapse", lambda: bob.membership(room, alice.user_id) == "join")
    # The imported state is Spindle's current state; the join is the first timeline event.
    assert alice.state(room, "m.room.name")["name"] == "Hosted on Synapse"
    assert alice.state(room, "m.room.topic")["topic"] == "a Synapse room"
    assert alice.membership(room, bob.user_id) == "join"
    members = alice.call("GET", f"/_matrix/client/v3/rooms/{q(room)}/joined_members")["joined"]
    assert sorted(members) == sorted([alice.user_id, bob.user_id])
    # Paging back past the join backfills the room's history from Synapse, down to
    # m.room.create: the same events in the same order as Synapse's own timeline.
    timeline = alice.messages(room, limit=1000)
    join = [e for e in timeline if e["type"] == "m.room.member" and e["state_key"] == alice.user_id]
    assert len(join) == 1
    assert timeline[0]["type"] == "m.room.create"
    assert [e for e in ids(timeline) if e in set(before)] == before
    theirs = bob.messages(room, limit=1000)
    assert [e["event_id"] for e in timeline] == [e["event_id"] for e in theirs]
    # Forward from a backfill token gives the events right after it, none skipped.
    all_ids = [e["event_id"] for e in timeline]
    page = alice.call("GET", f"/_matrix/client/v3/rooms/{q(room)}/messages?dir=b&limit=50")
    assert page["end"].startswith("b")
    forward = alice.call("GET", f"/_matrix/client/v3/rooms/{q(room)}/messages?dir=f&limit=5&from={q(page['end'])}")
    i = all_ids.index(page["chunk"][-1]["event_id"])
    assert [e["event_id"] for e in forward["chunk"]] == all_ids[i:i + 5]
    back = alice.call("GET", f"/_matrix/client/v3/rooms/{q(room)}/messages?dir=b&limit=3&from={q(forward['end'])}")
    assert [e["event_id"] for e in back["chunk"]] == list(reversed(all_ids[i + 2:i + 5]))
    # A backfill token is a valid `to` both ways: exactly the five events between.
    between = alice.call("GET", f"/_matrix/client/v3/rooms/{q(room)}/messages?dir=b&limit=50&from={q(forward['end'])}&to={q(page['end'])}")
    assert [e["event_id"] for e in between["chunk"]] == list(reversed(all_ids[i:i + 5]))
    between = alice.call("GET", f"/_matrix/client/v3/rooms/{q(room)}/messages?dir=f&limit=50&from={q(page['end'])}&to={q(forward['end'])}")
    assert [e["event_id"] for e in between["chunk"]] == all_ids[i:i + 5]
    # Backfilled events render like live ones (content and sender as sent).
    first = next(e for e in timeline if e["event_id"] == before[0])
    assert (first["sender"], first["content"]["body"]) == (bob.user_id, "before alice 0")
    sent_a = [alice.send(room, f"spindle into synapse's room {i}") for i in range(10)]
    sent_b = [bob.send(room, f"synapse into its own room {i}") for i in range(10)]
    wait_until("alice's messages on Synapse", lambda: set(sent_a) <= set(ids(bob.messages(room))))
    wait_until("bob's messages on Spindle", lambda: set(sent_b) <= set(ids(alice.messages(room))))
    assert [e for e in ids(bob.messages(room)) if e in set(sent_a)] == sent_a
    assert [e for e in ids(alice.messages(room)) if e in set(sent_b)] == sent_b
    world["synapse_room"] = room


def state_ids(client: Client, room_id: str) -> set[tuple[str, str, str]]:
    events = client.call("GET", f"/_matrix/client/v3/rooms/{q(room_id)}/state")
    return {(e["type"], e["state_key"], e["event_id"]) for e in events}


def topics_at_once(room_id: str, a: Client, b: Client, text: str) -> dict[str, str]:
    """`a` and `b` set the room's topic at the same moment (`text` with "a" or "b"
    filled in); returns who -> topic event id."""
    topics: dict[str, str] = {}
    start = threading.Barrier(2)

    def set_topic(who: str, client: Client):
        start.wait()
        topics[who] = client.state(room_id, "m.room.topic", "", {"topic": text.format(who)})["event_id"]

    threads = [threading.Thread(target=set_topic, args=("a", a)), threading.Thread(target=set_topic, args=("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(topics) == 2
    return topics


def one_topic_on_both(room_id: str, a: Client, b: Client, text: str) -> str:
    """Waits until both servers show the same one of the two topics
    [`topics_at_once`] set; returns it."""
    candidates = {text.format("a"), text.format("b")}

    def converged():
        ta = a.state(room_id, "m.room.topic", expect=None).get("topic")
        tb = b.state(room_id, "m.room.topic", expect=None).get("topic")
        return ta == tb and ta in candidates and ta

    return wait_until(f"one topic of {sorted(candidates)} on both sides", converged)


def test_concurrent_sends_from_both_servers_converge(world):
    alice, bob, room = world["alice"], world["bob"], world["room"]
    assert alice.membership(room, bob.user_id) == "join"
    sent: dict[str, list[str]] = {"a": [], "b": []}
    start = threading.Barrier(2)

    def burst(who: str, client: Client):
        start.wait()
        for i in range(20):
            sent[who].append(client.send(room, f"{who} at the same moment {i}"))

    threads = [threading.Thread(target=burst, args=("a", alice)), threading.Thread(target=burst, args=("b", bob))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    want = set(sent["a"]) | set(sent["b"])
    assert len(want) == 40
    wait_until("all 40 on Spindle", lambda: want <= set(ids(alice.messages(room))), timeout=60)
    wait_until("all 40 on Synapse", lambda: want <= set(ids(bob.messages(room))), timeout=60)
    # One more message from each side merges the forks; then both hold the same state.
    alice.send(room, "after the burst (spindle)")
    bob.send(room, "after the burst (synapse)")
    wait_until("the same current state on both sides", lambda: state_ids(alice, room) == state_ids(bob, room))
    assert [e for e in ids(bob.messages(room)) if e in set(sent["a"])] == sent["a"]
    assert [e for e in ids(alice.messages(room)) if e in set(sent["b"])] == sent["b"]
    # Then both set the topic at the same moment (bob has the power for it since the
    # power levels test): a fork on one state slot. State resolution v2 on both sides
    # picks the same one of the two, with no further event needed.
    topics = topics_at_once(room, alice, bob, "set by {} at once")

    def topic_events(client: Client) -> set[str]:
        return {e["event_id"] for e in client.messages(room) if e["type"] == "m.room.topic"}

    wait_until("both topic events on both sides",
               lambda: set(topics.values()) <= topic_events(alice) and set(topics.values()) <= topic_events(bob))

    winner = one_topic_on_both(room, alice, bob, "set by {} at once")
    # And the whole state agrees, event id for event id.
    wait_until("the same state after the topic fork", lambda: state_ids(alice, room) == state_ids(bob, room))
    with _OPENER.open(world["spindle"].metrics_url, timeout=10) as resp:
        forks = [l for l in resp.read().decode().splitlines() if l.startswith("spindle_journal_forks")]
    print(f"concurrent topics: {topics}; both sides chose {winner!r}; on Spindle: {forks}")


def sync_rooms(client: Client, section: str) -> dict:
    return client.call("GET", "/_matrix/client/v3/sync?timeout=0")["rooms"].get(section, {})


def test_invites_both_ways_accept_one_reject_one(world):
    alice, bob = world["alice"], world["bob"]
    # Spindle invites a Synapse user; the invite reaches Synapse and is accepted.
    room = alice.call("POST", "/_matrix/client/v3/createRoom", {"name": "Private on Spindle"})["room_id"]
    alice.call("POST", f"/_matrix/client/v3/rooms/{q(room)}/invite", {"user_id": bob.user_id})
    assert alice.membership(room, bob.user_id) == "invite"
    invite = wait_until("the invite on Synapse", lambda: sync_rooms(bob, "invite").get(room))
    names = [e["content"].get("name") for e in invite["invite_state"]["events"] if e["type"] == "m.room.name"]
    assert names == ["Private on Spindle"]
    bob.call("POST", f"/_matrix/client/v3/join/{q(room)}", {})
    wait_until("bob joined the private room on Spindle", lambda: alice.membership(room, bob.user_id) == "join")
    hello = bob.send(room, "thanks for the invite")
    wait_until("bob's message on Spindle", lambda: hello in ids(alice.messages(room)))
    # Synapse invites a Spindle user: the invite shows in Spindle's /sync with the
    # inviter's stripped state, and joining it joins through Synapse.
    theirs = bob.call("POST", "/_matrix/client/v3/createRoom", {"name": "Private on Synapse"})["room_id"]
    bob.call("POST", f"/_matrix/client/v3/rooms/{q(theirs)}/invite", {"user_id": alice.user_id})
    invite = wait_until("the invite on Spindle", lambda: sync_rooms(alice, "invite").get(theirs))
    state = invite["invite_state"]["events"]
    assert [e["content"].get("name") for e in state if e["type"] == "m.room.name"] == ["Private on Synapse"]
    assert [e["sender"] for e in state if e["type"] == "m.room.member" and e["state_key"] == alice.user_id] == [bob.user_id]
    alice.call("POST", f"/_matrix/client/v3/rooms/{q(theirs)}/join", {})
    wait_until("alice joined on Synapse", lambda: bob.membership(theirs, alice.user_id) == "join")
    assert theirs in sync_rooms(alice, "join")
    # A second invite from Synapse, rejected: both sides record the leave.
    other = bob.call("POST", "/_matrix/client/v3/createRoom", {"name": "Not for alice"})["room_id"]
    bob.call("POST", f"/_matrix/client/v3/rooms/{q(other)}/invite", {"user_id": alice.user_id})
    wait_until("the second invite on Spindle", lambda: sync_rooms(alice, "invite").get(other))
    alice.call("POST", f"/_matrix/client/v3/rooms/{q(other)}/leave", {})
    wait_until("the rejection on Synapse", lambda: bob.membership(other, alice.user_id) == "leave")
    assert other not in sync_rooms(alice, "invite")


def test_public_room_directories_across_servers_both_ways(world):
    alice, bob, spindle, synapse = world["alice"], world["bob"], world["spindle"], world["synapse"]
    # A room Spindle lists: a Synapse user reads Spindle's directory through Synapse
    # (Synapse asks Spindle's /_matrix/federation/v1/publicRooms).
    ours = alice.call("POST", "/_matrix/client/v3/createRoom", {"preset": "public_chat", "name": "Listed on Spindle"})["room_id"]
    alice.call("PUT", f"/_matrix/client/v3/directory/list/room/{q(ours)}", {"visibility": "public"})
    seen = bob.call("GET", f"/_matrix/client/v3/publicRooms?server={q(spindle.server_name)}&limit=50")
    chunk = {c["room_id"]: c for c in seen["chunk"]}
    assert chunk[ours]["name"] == "Listed on Spindle"
    assert chunk[ours]["num_joined_members"] == 1
    found = bob.call("POST", f"/_matrix/client/v3/publicRooms?server={q(spindle.server_name)}",
                     {"limit": 10, "filter": {"generic_search_term": "listed on spindle"}})
    assert [c["room_id"] for c in found["chunk"]] == [ours]
    # A room Synapse lists: a Spindle user reads Synapse's directory through Spindle.
    theirs = bob.call("POST", "/_matrix/client/v3/createRoom", {
        "preset": "public_chat", "name": "Listed on Synapse", "visibility": "public",
    })["room_id"]
    out = alice.call("GET", f"/_matrix/client/v3/publicRooms?server={q(synapse.server_name)}&limit=50")
    assert "Listed on Synapse" in [c.get("name") for c in out["chunk"] if c["room_id"] == theirs]
    out = alice.call("POST", f"/_matrix/client/v3/publicRooms?server={q(synapse.server_name)}",
                     {"limit": 10, "filter": {"generic_search_term": "Listed on Synapse"}})
    assert [c["room_id"] for c in out["chunk"]] == [theirs]


def test_room_versions_1_and_2_federate_both_ways(world):
    """Room versions 1 and 2: event ids are `$opaque:server` and carried in the PDU,
    references pair each id with its hash, and v1 forks resolve with state resolution
    v1. A Spindle user joins a v1 room on Synapse (history, messages both ways, then a
    topic fork that both sides must resolve the same way); a Synapse user joins a v2
    room on Spindle."""
    alice, bob, spindle, synapse = world["alice"], world["bob"], world["spindle"], world["synapse"]
    v1 = bob.call("POST", "/_matrix/client/v3/createRoom", {
        "preset": "public_chat", "room_alias_name": "old1", "room_version": "1", "name": "Version 1",
    })["room_id"]
    before = [bob.send(v1, f"v1 before alice {i}") for i in range(5)]
    assert alice.call("POST", f"/_matrix/client/v3/join/{q('#old1:' + synapse.server_name)}", {})["room_id"] == v1
    wait_until("alice's v1 join on Synapse", lambda: bob.membership(v1, alice.user_id) == "join")
    timeline = alice.messages(v1)
    assert timeline[0]["type"] == "m.room.create"
    assert [e for e in ids(timeline) if e in set(before)] == before
    assert [e["event_id"] for e in timeline] == [e["event_id"] for e in bob.messages(v1)]
    sent_a = [alice.send(v1, f"v1 from spindle {i}") for i in range(5)]
    assert all(e.endswith(":" + spindle.server_name) for e in sent_a), sent_a
    sent_b = [bob.send(v1, f"v1 from synapse {i}") for i in range(5)]
    wait_until("alice's v1 messages on Synapse", lambda: set(sent_a) <= set(ids(bob.messages(v1))))
    wait_until("bob's v1 messages on Spindle", lambda: set(sent_b) <= set(ids(alice.messages(v1))))
    assert [e for e in ids(bob.messages(v1)) if e in set(sent_a)] == sent_a
    # Bob gives alice the power to set the topic; then both set it at once: a fork on
    # one slot of a v1 room, which both servers settle with state resolution v1.
    levels = bob.state(v1, "m.room.power_levels")
    levels["users"][alice.user_id] = 50
    bob.state(v1, "m.room.power_levels", "", levels)
    wait_until("alice's power on Spindle",
               lambda: alice.state(v1, "m.room.power_levels")["users"].get(alice.user_id) == 50)
    topics = topics_at_once(v1, alice, bob, "v1 topic by {}")
    alice.send(v1, "after the v1 topics (spindle)")
    bob.send(v1, "after the v1 topics (synapse)")

    winner = one_topic_on_both(v1, alice, bob, "v1 topic by {}")
    wait_until("the same v1 state on both sides", lambda: state_ids(alice, v1) == state_ids(bob, v1))
    print(f"v1 concurrent topics: {topics}; both sides chose {winner!r}")
    # A v2 room hosted on Spindle, joined from Synapse.
    v2 = alice.call("POST", "/_matrix/client/v3/createRoom", {
        "preset": "public_chat", "room_alias_name": "old2", "room_version": "2",
    })["room_id"]
    first = alice.send(v2, "v2 before bob")
    assert bob.call("POST", f"/_matrix/client/v3/join/{q('#old2:' + spindle.server_name)}", {})["room_id"] == v2
    wait_until("bob's v2 join on Spindle", lambda: alice.membership(v2, bob.user_id) == "join")
    from_bob = bob.send(v2, "v2 from synapse")
    assert from_bob.endswith(":" + synapse.server_name)
    wait_until("bob's v2 message on Spindle", lambda: from_bob in ids(alice.messages(v2)))
    from_alice = alice.send(v2, "v2 from spindle")
    wait_until("alice's v2 message on Synapse", lambda: from_alice in ids(bob.messages(v2)))
    assert [e["event_id"] for e in alice.messages(v2)] == [e["event_id"] for e in bob.messages(v2)]
    assert first in ids(bob.messages(v2))


@pytest.mark.parametrize("value", [2**60, 1.5], ids=["bigint", "float"])
def test_a_pdu_strict_canonical_json_refuses_does_not_block_the_transaction(world, value):
    """Room versions 1 to 5 allow integers beyond 2^53 and floats in content; Synapse
    sends such a PDU on. Spindle keeps only strict canonical JSON, so it refuses that
    PDU, but the request signature must still verify and the rest of the transaction
    (and every later one) must go through: a message in another room arrives. (Found
    by a fresh-eyes probe: the whole /send answered 400 and Synapse retried it
    forever.)"""
    alice, bob, spindle = world["alice"], world["bob"], world["spindle"]
    old = alice.call("POST", "/_matrix/client/v3/createRoom", {"preset": "public_chat", "room_version": "1"})["room_id"]
    other = alice.call("POST", "/_matrix/client/v3/createRoom", {"preset": "public_chat", "room_version": "10"})["room_id"]
    for r in (old, other):
        bob.call("POST", f"/_matrix/client/v3/join/{q(r)}?server_name={q(spindle.server_name)}", {})
        wait_until("bob joined", lambda: alice.membership(r, bob.user_id) == "join", timeout=60)
    path = f"/_matrix/client/v3/rooms/{q(old)}/send/m.room.message/n{time.time_ns()}"
    odd = bob.call("PUT", path, {"msgtype": "m.text", "body": "odd number", "n": value})["event_id"]
    after = bob.send(other, "after the odd number, another room")
    wait_until("the next message from Synapse on Spindle", lambda: after in ids(alice.messages(other)), timeout=60)
    assert odd not in ids(alice.messages(old))


def restricted_room(client: Client, space: str, name: str) -> str:
    """A v10 room whose join rule lets in members of `space` (spec: "Restricted rooms")."""
    return client.call("POST", "/_matrix/client/v3/createRoom", {
        "room_version": "10", "name": name,
        "initial_state": [{"type": "m.room.join_rules", "state_key": "", "content": {
            "join_rule": "restricted", "allow": [{"type": "m.room_membership", "room_id": space}],
        }}],
    })["room_id"]


def test_restricted_joins_through_a_space_both_ways(world):
    """A member of a space joins a room restricted to that space, hosted on the other
    server: the resident names one of its users in `join_authorised_via_users_server`
    and countersigns the join; both sides then hold the same join event. Outside the
    space the join is refused with 403 on both servers."""
    alice, bob, spindle, synapse = world["alice"], world["bob"], world["spindle"], world["synapse"]
    space_body = {"preset": "public_chat", "creation_content": {"type": "m.space"}, "room_version": "10"}
    # Hosted on Spindle, joined from Synapse.
    space = alice.call("POST", "/_matrix/client/v3/createRoom", {**space_body, "name": "Spindle space"})["room_id"]
    room = restricted_room(alice, space, "Spindle members only")
    via = f"?server_name={q(spindle.server_name)}"
    out = bob.call("POST", f"/_matrix/client/v3/join/{q(room)}{via}", {}, expect=403)
    assert out["errcode"] == "M_FORBIDDEN"
    bob.call("POST", f"/_matrix/client/v3/join/{q(space)}{via}", {})
    wait_until("bob in the Spindle space", lambda: alice.membership(space, bob.user_id) == "join")
    bob.call("POST", f"/_matrix/client/v3/join/{q(room)}{via}", {})
    wait_until("bob in the restricted Spindle room", lambda: alice.membership(room, bob.user_id) == "join")
    ours = alice.state(room, "m.room.member", bob.user_id)
    assert ours["join_authorised_via_users_server"] == alice.user_id
    mine = [e["event_id"] for e in alice.messages(room) if e["type"] == "m.room.member" and e["state_key"] == bob.user_id]
    theirs = [e["event_id"] for e in bob.messages(room) if e["type"] == "m.room.member" and e["state_key"] == bob.user_id]
    assert len(mine) == 1 and mine == theirs
    # Hosted on Synapse, joined from Spindle.
    space = bob.call("POST", "/_matrix/client/v3/createRoom", {**space_body, "name": "Synapse space"})["room_id"]
    room = restricted_room(bob, space, "Synapse members only")
    via = f"?server_name={q(synapse.server_name)}"
    out = alice.call("POST", f"/_matrix/client/v3/join/{q(room)}{via}", {}, expect=403)
    assert out["errcode"] == "M_FORBIDDEN"
    alice.call("POST", f"/_matrix/client/v3/join/{q(space)}{via}", {})
    wait_until("alice in the Synapse space", lambda: bob.membership(space, alice.user_id) == "join")
    alice.call("POST", f"/_matrix/client/v3/join/{q(room)}{via}", {})
    wait_until("alice in the restricted Synapse room", lambda: bob.membership(room, alice.user_id) == "join")
    assert bob.state(room, "m.room.member", alice.user_id)["join_authorised_via_users_server"] == bob.user_id
    assert alice.state(room, "m.room.member", alice.user_id)["join_authorised_via_users_server"] == bob.user_id
    mine = [e["event_id"] for e in alice.messages(room) if e["type"] == "m.room.member" and e["state_key"] == alice.user_id]
    theirs = [e["event_id"] for e in bob.messages(room) if e["type"] == "m.room.member" and e["state_key"] == alice.user_id]
    assert len(mine) == 1 and mine == theirs
    hello = alice.send(room, "hello from a Spindle member of the space")
    wait_until("alice's message on Synapse", lambda: hello in ids(bob.messages(room)))


class Syncer:
    """Incremental /sync for one client, from the moment it is made."""

    def __init__(self, client: Client):
        self.client = client
        self.since = client.call("GET", "/_matrix/client/v3/sync?timeout=0")["next_batch"]

    def until(self, what: str, pick, timeout: float = 30.0):
        """Syncs until `pick(answer)` returns something, and returns that."""
        def step():
            out = self.client.call("GET", f"/_matrix/client/v3/sync?timeout=1000&since={q(self.since)}")
            self.since = out["next_batch"]
            return pick(out)
        return wait_until(what, step, timeout=timeout, interval=0.05)


def room_ephemeral(room: str, kind: str):
    def pick(sync: dict):
        events = sync.get("rooms", {}).get("join", {}).get(room, {}).get("ephemeral", {}).get("events", [])
        return next((e["content"] for e in events if e["type"] == kind), None)
    return pick


def presence_of(user: str, status: str):
    def pick(sync: dict):
        return next((e["content"] for e in sync.get("presence", {}).get("events", [])
                     if e["sender"] == user and e["content"].get("status_msg") == status), None)
    return pick


def to_device(kind: str):
    def pick(sync: dict):
        return [e for e in sync.get("to_device", {}).get("events", []) if e["type"] == kind] or None
    return pick


def test_typing_receipts_presence_and_to_device_both_ways(world):
    """The EDUs that make a chat feel alive cross both ways within seconds: typing
    (start and stop), public read receipts (a private one stays home), presence with a
    status message, and to-device messages to one device."""
    alice, bob, spindle = world["alice"], world["bob"], world["spindle"]
    room = alice.call("POST", "/_matrix/client/v3/createRoom", {"preset": "public_chat", "name": "Alive"})["room_id"]
    bob.call("POST", f"/_matrix/client/v3/join/{q(room)}?server_name={q(spindle.server_name)}", {})
    wait_until("bob in the room on Spindle", lambda: alice.membership(room, bob.user_id) == "join")
    first, second = alice.send(room, "one"), alice.send(room, "two")
    wait_until("alice's messages on Synapse", lambda: {first, second} <= set(ids(bob.messages(room))))
    on_spindle, on_synapse = Syncer(alice), Syncer(bob)

    def typing(client: Client, on: bool):
        client.call("PUT", f"/_matrix/client/v3/rooms/{q(room)}/typing/{q(client.user_id)}",
                    {"typing": on, "timeout": 30000})

    # Typing, Spindle -> Synapse and back, then stopping.
    typing(alice, True)
    assert on_synapse.until("alice typing on Synapse", room_ephemeral(room, "m.typing"))["user_ids"] == [alice.user_id]
    typing(alice, False)
    on_synapse.until("alice stopped typing on Synapse",
                     lambda s: (c := room_ephemeral(room, "m.typing")(s)) is not None and c["user_ids"] == [])
    typing(bob, True)
    on_spindle.until("bob typing on Spindle",
                     lambda s: (c := room_ephemeral(room, "m.typing")(s)) is not None and c["user_ids"] == [bob.user_id])
    typing(bob, False)
    on_spindle.until("bob stopped typing on Spindle",
                     lambda s: (c := room_ephemeral(room, "m.typing")(s)) is not None and c["user_ids"] == [])

    # Read receipts: Synapse -> Spindle and Spindle -> Synapse; private ones stay home.
    bob.call("POST", f"/_matrix/client/v3/rooms/{q(room)}/receipt/m.read.private/{q(first)}", {})
    bob.call("POST", f"/_matrix/client/v3/rooms/{q(room)}/receipt/m.read/{q(second)}", {})
    got = on_spindle.until("bob's receipt on Spindle",
                           lambda s: (c := room_ephemeral(room, "m.receipt")(s)) and c.get(second) and c)
    assert bob.user_id in got[second]["m.read"]
    assert first not in got
    reply = bob.send(room, "three")
    wait_until("bob's message on Spindle", lambda: reply in ids(alice.messages(room)))
    alice.call("POST", f"/_matrix/client/v3/rooms/{q(room)}/receipt/m.read/{q(reply)}", {})
    got = on_synapse.until("alice's receipt on Synapse",
                           lambda s: (c := room_ephemeral(room, "m.receipt")(s)) and c.get(reply) and c)
    assert alice.user_id in got[reply]["m.read"]

    # Presence with a status message, both ways.
    alice.call("PUT", f"/_matrix/client/v3/presence/{q(alice.user_id)}/status",
               {"presence": "online", "status_msg": "from spindle"})
    assert on_synapse.until("alice's presence on Synapse", presence_of(alice.user_id, "from spindle"))["presence"] == "online"
    bob.call("PUT", f"/_matrix/client/v3/presence/{q(bob.user_id)}/status",
             {"presence": "unavailable", "status_msg": "from synapse"})
    assert on_spindle.until("bob's presence on Spindle", presence_of(bob.user_id, "from synapse"))["presence"] == "unavailable"
    # ... and Spindle answers for the remote user as for a local one (they share a room).
    got = alice.call("GET", f"/_matrix/client/v3/presence/{q(bob.user_id)}/status")
    assert (got["presence"], got["status_msg"]) == ("unavailable", "from synapse")

    # To-device messages to one named device, both ways.
    bob_device = bob.call("GET", "/_matrix/client/v3/account/whoami")["device_id"]
    alice_device = alice.call("GET", "/_matrix/client/v3/account/whoami")["device_id"]
    alice.call("PUT", f"/_matrix/client/v3/sendToDevice/org.example.ping/p{time.time_ns()}",
               {"messages": {bob.user_id: {bob_device: {"n": 1}}}})
    got = on_synapse.until("alice's to-device message on Synapse", to_device("org.example.ping"))
    assert [(e["sender"], e["content"]) for e in got] == [(alice.user_id, {"n": 1})]
    bob.call("PUT", f"/_matrix/client/v3/sendToDevice/org.example.pong/p{time.time_ns()}",
             {"messages": {alice.user_id: {alice_device: {"n": 2}}}})
    got = on_spindle.until("bob's to-device message on Spindle", to_device("org.example.pong"))
    assert [(e["sender"], e["content"]) for e in got] == [(bob.user_id, {"n": 2})]


def test_remote_leave_reaches_spindle(world):
    alice, bob, room = world["alice"], world["bob"], world["room"]
    bob.call("POST", f"/_matrix/client/v3/rooms/{q(room)}/leave", {})
    wait_until("bob's leave on Spindle", lambda: alice.membership(room, bob.user_id) == "leave")
    # Spindle stops sending to a server with nobody left in the room: a message now is
    # not an error anywhere.
    alice.send(room, "after bob left")


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def upload_olm_keys(client: Client, otks: int) -> tuple[str, dict, dict, dict]:
    """Uploads real olm device keys, `otks` signed one-time keys and a signed fallback key
    for `client`'s device; returns the device id, the device keys, the one-time keys and
    the fallback key (each as uploaded)."""
    import olm

    device = client.call("GET", "/_matrix/client/v3/account/whoami")["device_id"]
    account = olm.Account()

    def signed(obj):
        sig = account.sign(canonical(obj))
        return {**obj, "signatures": {client.user_id: {f"ed25519:{device}": sig}}}

    identity = account.identity_keys
    device_keys = signed({
        "user_id": client.user_id, "device_id": device,
        "algorithms": ["m.olm.v1.curve25519-aes-sha2", "m.megolm.v1.aes-sha2"],
        "keys": {f"curve25519:{device}": identity["curve25519"], f"ed25519:{device}": identity["ed25519"]},
    })
    account.generate_one_time_keys(otks)
    one_time = {f"signed_curve25519:{kid}": signed({"key": k}) for kid, k in account.one_time_keys["curve25519"].items()}
    account.generate_fallback_key()
    fb_id, fb_key = next(iter(account.fallback_key["curve25519"].items()))
    fallback = {f"signed_curve25519:{fb_id}": signed({"key": fb_key, "fallback": True})}
    out = client.call("POST", "/_matrix/client/v3/keys/upload", {
        "device_keys": device_keys, "one_time_keys": one_time, "fallback_keys": fallback,
    })
    assert out["one_time_key_counts"]["signed_curve25519"] == otks
    return device, device_keys, one_time, fallback


def test_device_keys_are_queried_and_claimed_across_servers_both_ways(world):
    """A Spindle user asks for a Synapse user's device keys and claims their one-time
    keys (Spindle's /keys/query and /keys/claim fan out to Synapse's user/keys/query and
    user/keys/claim), and the other way round (Synapse asks Spindle's). Each one-time key
    comes out once, then the fallback key."""
    spindle, synapse = world["spindle"], world["synapse"]
    carol = Client(spindle.base_url)
    carol.register("carol")
    dave = Client(synapse.base_url)
    dave.register("dave")
    carol_dev, carol_keys, carol_otks, carol_fb = upload_olm_keys(carol, 2)
    dave_dev, dave_keys, dave_otks, dave_fb = upload_olm_keys(dave, 2)

    for asker, owner, dev, keys in ((carol, dave, dave_dev, dave_keys), (dave, carol, carol_dev, carol_keys)):
        got = asker.call("POST", "/_matrix/client/v3/keys/query", {"device_keys": {owner.user_id: []}})
        assert got["failures"] == {}, got
        assert list(got["device_keys"][owner.user_id]) == [dev], got
        served = got["device_keys"][owner.user_id][dev]
        for field in ("user_id", "device_id", "algorithms", "keys", "signatures"):
            assert served[field] == keys[field], (field, served)

    for asker, owner, dev, otks, fb in ((carol, dave, dave_dev, dave_otks, dave_fb), (dave, carol, carol_dev, carol_otks, carol_fb)):
        claimed = []
        for _ in range(4):
            out = asker.call("POST", "/_matrix/client/v3/keys/claim", {
                "one_time_keys": {owner.user_id: {dev: "signed_curve25519"}},
            })
            assert out["failures"] == {}, out
            [(key_id, key)] = out["one_time_keys"][owner.user_id][dev].items()
            claimed.append((key_id, key))
        # Both one-time keys once each (in any order), then the fallback key, twice.
        assert sorted(claimed[:2]) == sorted(otks.items()), claimed
        assert claimed[2:] == list(fb.items()) * 2, claimed
# -- end-to-end encryption across the two servers (issue 13) ------------------------


async def _nio_settle(c, what: str, timeout_ms: int = 0, full_state: bool = True):
    """One sync (a long-poll of `timeout_ms`), then what nio's sync_forever does after
    each: upload, query and claim keys, and send the queued to-device messages."""
    from nio import KeysQueryResponse, KeysUploadResponse, SyncResponse

    resp = await asyncio.wait_for(c.sync(timeout=timeout_ms, full_state=full_state), 30 + timeout_ms / 1000)
    assert isinstance(resp, SyncResponse), f"{what}: {resp}"
    if c.should_upload_keys:
        up = await c.keys_upload()
        assert isinstance(up, KeysUploadResponse), f"{what}: keys_upload {up}"
    if c.should_query_keys:
        kq = await c.keys_query()
        assert isinstance(kq, KeysQueryResponse), f"{what}: keys_query {kq}"
    if c.should_claim_keys:
        await c.keys_claim(c.get_users_for_key_claiming())
    await c.send_to_device_messages()
    return resp


async def _nio_decrypts(c, room: str, event_id: str, what: str, rounds: int = 60,
                        timeout_ms: int = 0, pause: float = 0.25):
    """Syncs `c` (long-polls of `timeout_ms`, `pause` s apart) until it holds `event_id`
    decrypted; returns its body."""
    from nio import MegolmEvent, RoomMessageText

    seen = None
    for _ in range(rounds):
        resp = await _nio_settle(c, what, timeout_ms=timeout_ms, full_state=timeout_ms == 0)
        joined = resp.rooms.join.get(room)
        for e in joined.timeline.events if joined else []:
            if e.event_id == event_id:
                seen = e
        if isinstance(seen, MegolmEvent):
            try:
                seen = c.decrypt_event(seen)
            except Exception:  # the room key has not arrived yet
                pass
        if isinstance(seen, RoomMessageText):
            return seen.body
        await asyncio.sleep(pause)
    raise AssertionError(f"{what}: not decrypted (last seen: {seen!r})")


def test_encrypted_room_across_servers_decrypts_both_ways_and_on_a_new_device(world, tmp_path):
    """A matrix-nio client with encryption on each server, in one encrypted room: each
    decrypts the other's messages (keys queried and one-time keys claimed over
    federation, room keys sent as Olm-encrypted to-device messages across servers), and
    after the Synapse user logs in on a second device, the Spindle user's next message
    decrypts there too (the new device reached Spindle as a device list update)."""
    asyncio.run(_encrypted_across_servers(world, tmp_path))


async def _encrypted_across_servers(world, tmp_path):
    from nio import AsyncClient, AsyncClientConfig, JoinResponse, LoginResponse, RegisterResponse, RoomCreateResponse, RoomSendResponse

    spindle, synapse = world["spindle"], world["synapse"]
    run = f"{time.time_ns() % 10**8}"
    clients = []

    def client(base_url: str, name: str, user: str = "") -> AsyncClient:
        store = tmp_path / name
        store.mkdir()
        cfg = AsyncClientConfig(encryption_enabled=True, store_sync_tokens=False, max_timeouts=2, request_timeout=30)
        c = AsyncClient(base_url, user=user, store_path=str(store), config=cfg)
        clients.append(c)
        return c

    try:
        a = client(spindle.base_url, "a")
        b = client(synapse.base_url, "b")
        for c, name in ((a, f"enca{run}"), (b, f"encb{run}")):
            reg = await c.register(name, "pw-" + name, device_name=f"{name} nio")
            assert isinstance(reg, RegisterResponse), f"register {name}: {reg}"
            await _nio_settle(c, f"{name} first sync")
            await _nio_settle(c, f"{name} second sync")
        created = await a.room_create(
            name="secret across servers", invite=[b.user_id],
            initial_state=[{"type": "m.room.encryption", "state_key": "", "content": {"algorithm": "m.megolm.v1.aes-sha2"}}],
        )
        assert isinstance(created, RoomCreateResponse), created
        room = created.room_id
        bob = Client(synapse.base_url)
        bob.token = b.access_token
        wait_until("the invite on Synapse",
                   lambda: room in bob.call("GET", "/_matrix/client/v3/sync?timeout=0").get("rooms", {}).get("invite", {}))
        joined = await b.join(room)
        assert isinstance(joined, JoinResponse), joined
        alice = Client(spindle.base_url)
        alice.token = a.access_token
        wait_until("bob's join on Spindle", lambda: alice.membership(room, b.user_id) == "join")
        # Synapse joined with partial state (its faster joins) and leaves the room out of
        # a /sync without lazy-loading until its state resync ends: before then B's
        # client has no member list to query keys for.
        # (B's own incremental syncs: Synapse caches a repeated identical initial sync.)
        deadline = time.monotonic() + 30
        while room not in b.rooms:
            assert time.monotonic() < deadline, "the room never reached B's /sync on Synapse"
            await _nio_settle(b, "B waits for the room", timeout_ms=500, full_state=False)
        for _ in range(3):
            await _nio_settle(a, "A learns B's devices")
            await _nio_settle(b, "B learns A's devices")
        assert b.device_id in a.device_store[b.user_id], "A has B's device from Synapse"
        assert a.device_id in b.device_store[a.user_id], "B has A's device from Spindle"

        # Spindle -> Synapse.
        sent = await a.room_send(room, "m.room.message", {"msgtype": "m.text", "body": f"to synapse {run}"}, ignore_unverified_devices=True)
        assert isinstance(sent, RoomSendResponse), sent
        assert await _nio_decrypts(b, room, sent.event_id, "B decrypts A") == f"to synapse {run}"
        # Synapse -> Spindle.
        sent = await b.room_send(room, "m.room.message", {"msgtype": "m.text", "body": f"to spindle {run}"}, ignore_unverified_devices=True)
        assert isinstance(sent, RoomSendResponse), sent
        assert await _nio_decrypts(a, room, sent.event_id, "A decrypts B") == f"to spindle {run}"

        # B logs in on a second device; Spindle hears of it and A's next message reaches it.
        b2 = client(synapse.base_url, "b2", user=b.user_id)
        login = await b2.login(f"pw-encb{run}", device_name="b2 nio")
        assert isinstance(login, LoginResponse), login
        await _nio_settle(b2, "B2 first sync")
        await _nio_settle(b2, "B2 second sync")
        for _ in range(60):
            await _nio_settle(a, "A learns of B2")
            if b2.device_id in a.device_store[b.user_id]:
                break
            await asyncio.sleep(0.25)
        assert b2.device_id in a.device_store[b.user_id], "B's new device reached Spindle"
        sent = await a.room_send(room, "m.room.message", {"msgtype": "m.text", "body": f"to both devices {run}"}, ignore_unverified_devices=True)
        assert isinstance(sent, RoomSendResponse), sent
        assert await _nio_decrypts(b2, room, sent.event_id, "B2 decrypts A") == f"to both devices {run}"
        assert await _nio_decrypts(b, room, sent.event_id, "B decrypts A again") == f"to both devices {run}"
    finally:
        for c in clients:
            await c.close()


# -- a big room on Synapse, joined with partial state (issue 13, MSC3706/MSC3902) ---


class SynapseAdmin(Client):
    """A Synapse server admin (registered through the shared-secret admin API) who
    makes users and puts them in rooms without UIA, password hashing or rate limits:
    how a room of thousands of members is built in minutes."""

    @classmethod
    def register_on(cls, synapse: "Synapse", name: str = "admin") -> "SynapseAdmin":
        import hashlib
        import hmac

        admin = cls(synapse.base_url)
        nonce = admin.call("GET", "/_synapse/admin/v1/register")["nonce"]
        password = "admin password"
        mac = hmac.new(b"not-a-secret", b"\x00".join(
            [nonce.encode(), name.encode(), password.encode(), b"admin"]), hashlib.sha1).hexdigest()
        out = admin.call("POST", "/_synapse/admin/v1/register", {
            "nonce": nonce, "username": name, "password": password, "admin": True, "mac": mac,
        })
        admin.token, admin.user_id = out["access_token"], out["user_id"]
        return admin

    def add_members(self, room_id: str, server_name: str, tag: str, n: int, threads: int = 4) -> list[str]:
        """Creates `n` users `@{tag}-{i}:server` (display name `Member {tag} {i}`) and
        joins each to `room_id` (public, or the admin is in it). Returns their ids."""
        from concurrent.futures import ThreadPoolExecutor

        def one(i: int) -> str:
            user = f"@{tag}-{i}:{server_name}"
            c = Client(self.base_url)
            c.token = self.token
            c.call("PUT", f"/_synapse/admin/v2/users/{q(user)}", {"displayname": f"Member {tag} {i}"}, expect=201)
            c.call("POST", f"/_synapse/admin/v1/join/{q(room_id)}", {"user_id": user})
            return user

        with ThreadPoolExecutor(threads) as pool:
            return list(pool.map(one, range(n)))


def joined_user_ids(client: Client, room_id: str) -> list[str]:
    chunk = client.call("GET", f"/_matrix/client/v3/rooms/{q(room_id)}/members", timeout=120)["chunk"]
    return sorted(e["state_key"] for e in chunk if e["content"].get("membership") == "join")


PARTIAL = ("joins", "completed", "sends")


def partial_counts(spindle: SpindleServer) -> dict[str, int]:
    return {k: int(metric(spindle, f"spindle_federation_partial_state_{k}_total")) for k in PARTIAL}


@pytest.fixture(scope="module")
def partial_spindle(spindle_bin, servers, tmp_path_factory):
    """A second, empty Spindle whose partial-state resync waits 5 s after a join, so a
    test can act inside the partial window without racing the resync."""
    _, synapse = servers
    root = tmp_path_factory.mktemp("partial")
    spindle = spindle_for_synapse(spindle_bin, root, synapse.cert, synapse.key,
                                  extra="partial_state_resync_delay_ms = 5000\n")
    _SERVERS.append(spindle)
    try:
        spindle.start()
        yield spindle
    finally:
        spindle.stop()
        _SERVERS.remove(spindle)


def test_spindle_user_joins_a_500_member_synapse_room_with_partial_state(servers, partial_spindle):
    """A Spindle user joins a Synapse room of 500 members: the join asks `omit_members`
    and the room is partial; the user reads the room and sends at once, the message
    reaches Synapse with its event id, and `/members` (which waits for the resync)
    then lists the same 501 joined users as Synapse does."""
    _, synapse = servers
    spindle = partial_spindle
    admin = SynapseAdmin.register_on(synapse)
    room = admin.call("POST", "/_matrix/client/v3/createRoom", {
        "preset": "public_chat", "room_alias_name": "big500", "name": "Five hundred",
    })["room_id"]
    members = admin.add_members(room, synapse.server_name, "big", 499)
    assert len(joined_user_ids(admin, room)) == 500
    assert partial_counts(spindle) == {"joins": 0, "completed": 0, "sends": 0}

    carol = Client(spindle.base_url)
    carol.register("carol")
    joined = carol.call("POST", f"/_matrix/client/v3/join/{q('#big500:' + synapse.server_name)}", {}, timeout=120)
    assert joined["room_id"] == room
    assert partial_counts(spindle) == {"joins": 1, "completed": 0, "sends": 0}
    # Inside the partial window: the room's non-member state is whole, and a message
    # goes out at once (counted as a send from partial state).
    assert carol.state(room, "m.room.name")["name"] == "Five hundred"
    sent = carol.send(room, "sent before the member list is complete")
    assert partial_counts(spindle) == {"joins": 1, "completed": 0, "sends": 1}
    wait_until("carol's message on Synapse", lambda: sent in ids(admin.messages(room, limit=50)), timeout=60)
    # `/members` waits for the resync and then has every member, as Synapse does.
    ours = joined_user_ids(carol, room)
    assert partial_counts(spindle) == {"joins": 1, "completed": 1, "sends": 1}
    theirs = joined_user_ids(admin, room)
    assert len(ours) == 501
    assert ours == theirs == sorted([admin.user_id, carol.user_id, *members])
    listed = carol.call("GET", f"/_matrix/client/v3/rooms/{q(room)}/joined_members")["joined"]
    assert sorted(listed) == ours
    assert listed[members[7]] == {"display_name": "Member big 7"}
    # The remote members are in Spindle's user directory, named as their member events say.
    found = carol.call("POST", "/_matrix/client/v3/user_directory/search", {"search_term": "big 123"})
    assert found == {"results": [{"user_id": members[123], "display_name": "Member big 123"}], "limited": False}
    # After completion a member of Synapse's sends, and carol sees it.
    reply = Client(synapse.base_url)
    reply.token = admin.token
    answer = reply.send(room, "welcome, carol")
    wait_until("the admin's reply on Spindle", lambda: answer in ids(carol.messages(room, limit=50)), timeout=60)
