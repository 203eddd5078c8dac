#!/usr/bin/env python3
"""Send latency and write throughput of Spindle's journal backends (issue 14).

One sitting, on this machine: the embedded journal (fjall, fsync per group commit),
the JetStream journal with one Spindle process on an R1 stream and on an R3 stream
(three nats-server nodes on loopback), and two Spindle processes on one R1 stream
(clients split over both, so half the sends are forwarded to the writer).

For each: sequential single sends through one client (median and p95 latency, ms),
then 1, 4 and 8 clients each sending into its own room for a fixed time (sends/s),
and the writer's RSS (MiB) idle and after. Writes JSON to --out and prints a table.

    scripts/bench/scale_out.py --bin target/release/spindle --out result.json
"""

import argparse
import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_port(port, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"port {port} never opened")


class Conn:
    def __init__(self, port, token=None):
        self.c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        self.token = token

    def req(self, method, path, body=None):
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        self.c.request(method, path, json.dumps(body) if body is not None else None, headers)
        r = self.c.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"{method} {path}: {r.status} {data[:200]!r}")
        return json.loads(data) if data else {}


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def free_ports(k):
    """k distinct free ports (all held at once while chosen, so none repeats)."""
    socks = []
    for _ in range(k):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def start_nats(root, n):
    ports = free_ports(2 * n)
    routes, clients = ports[:n], ports[n:]
    nodes = []
    for i in range(n):
        port = clients[i]
        args = ["nats-server", "-js", "-a", "127.0.0.1", "-p", str(port), "-n", f"n{i}",
                "-sd", os.path.join(root, f"nats{i}")]
        if n > 1:
            args += ["--cluster_name", "bench", "--cluster", f"nats://127.0.0.1:{routes[i]}",
                     "--routes", ",".join(f"nats://127.0.0.1:{p}" for j, p in enumerate(routes) if j != i)]
        log = open(os.path.join(root, f"nats{i}.log"), "w")
        nodes.append((subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT), port))
    for _, port in nodes:
        wait_port(port)
    if n > 1:
        time.sleep(5)  # JetStream meta leader election
    return nodes


def start_spindle(binary, root, name, nats_urls=None, replicas=1, key_from=None):
    port = free_port()
    data = os.path.join(root, name)
    os.makedirs(data, exist_ok=True)
    if key_from:
        shutil.copy(os.path.join(key_from, "signing.key"), os.path.join(data, "signing.key"))
    cfg = f'server_name = "localhost:8008"\nbind = "127.0.0.1:{port}"\ndata_dir = "{data}"\nlog = "warn"\n\n[rate_limits]\nenabled = false\n'
    if nats_urls:
        servers = ", ".join(f'"{u}"' for u in nats_urls)
        cfg += f'\n[journal]\nbackend = "nats"\n\n[journal.nats]\nservers = [{servers}]\nstream = "bench"\nreplicas = {replicas}\n'
    path = os.path.join(root, f"{name}.toml")
    with open(path, "w") as f:
        f.write(cfg)
    p = subprocess.Popen([binary, "--config", path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while True:
        try:
            Conn(port).req("GET", "/_matrix/client/versions")
            break
        except Exception:
            if time.time() > deadline:
                raise
            time.sleep(0.1)
    return p, port, data


def register(port, user):
    body = {"username": user, "password": "bench-password", "auth": {"type": "m.login.dummy"}}
    return Conn(port).req("POST", "/_matrix/client/v3/register", body)["access_token"]


def login(port, user):
    body = {"type": "m.login.password", "identifier": {"type": "m.id.user", "user": user},
            "password": "bench-password"}
    return Conn(port).req("POST", "/_matrix/client/v3/login", body)["access_token"]


def sends(conn, room, n, tag):
    out = []
    for i in range(n):
        t = time.perf_counter()
        conn.req("PUT", f"/_matrix/client/v3/rooms/{room}/send/m.room.message/{tag}-{i}",
                 {"msgtype": "m.text", "body": f"message {i}"})
        out.append((time.perf_counter() - t) * 1000)
    return out


def throughput(ports, clients, seconds, tag):
    """Each client registers, makes its own room, then sends for `seconds`."""
    setups = []
    for i in range(clients):
        port = ports[i % len(ports)]
        token = register(ports[0], f"{tag}-c{i}")
        if port != ports[0]:
            token = login(port, f"{tag}-c{i}")
        conn = Conn(port, token)
        room = conn.req("POST", "/_matrix/client/v3/createRoom", {})["room_id"]
        setups.append((conn, room))
    counts = [0] * clients
    stop = time.time() + seconds
    barrier = threading.Barrier(clients)

    def run(i):
        conn, room = setups[i]
        barrier.wait()
        n = 0
        while time.time() < stop:
            conn.req("PUT", f"/_matrix/client/v3/rooms/{room}/send/m.room.message/t{n}",
                     {"msgtype": "m.text", "body": "x"})
            n += 1
        counts[i] = n

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / seconds


def measure(name, binary, mode, samples, seconds):
    root = tempfile.mkdtemp(prefix=f"spindle-scale-{name}-")
    nats, procs = [], []
    try:
        urls = None
        replicas = 1
        if mode in ("r1", "r1x2"):
            nats = start_nats(root, 1)
        elif mode == "r3":
            nats = start_nats(root, 3)
            replicas = 3
        if nats:
            urls = [f"nats://127.0.0.1:{p}" for _, p in nats]
        p, port, data = start_spindle(binary, root, "a", urls, replicas)
        procs.append(p)
        ports = [port]
        if mode == "r1x2":
            time.sleep(1)
            p2, port2, _ = start_spindle(binary, root, "b", urls, replicas, key_from=data)
            procs.append(p2)
            ports.append(port2)
        time.sleep(1)
        idle = rss_mib(procs[0].pid)
        token = register(ports[0], "lat")
        send_port = ports[-1]  # with two processes: through the follower
        if send_port != ports[0]:
            token = login(send_port, "lat")
        conn = Conn(send_port, token)
        room = conn.req("POST", "/_matrix/client/v3/createRoom", {})["room_id"]
        sends(conn, room, 50, "warm")
        lat = sends(conn, room, samples, "lat")
        q = statistics.quantiles(lat, n=20)
        result = {"backend": name, "send_median_ms": round(statistics.median(lat), 3),
                  "send_p95_ms": round(q[18], 3), "rss_idle_mib": round(idle, 1)}
        for clients in (1, 4, 8):
            result[f"sends_per_s_{clients}"] = round(throughput(ports, clients, seconds, f"{name}{clients}"), 1)
        result["rss_after_mib"] = round(rss_mib(procs[0].pid), 1)
        return result
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        for p, _ in nats:
            p.kill()
            p.wait()
        shutil.rmtree(root, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    if not shutil.which("nats-server"):
        sys.exit("nats-server is not installed (apt-get install nats-server)")
    modes = [("embedded", "embedded"), ("jetstream-r1", "r1"), ("jetstream-r3", "r3"), ("two-processes-r1", "r1x2")]
    results = []
    for r in range(args.rounds):
        order = modes if r % 2 == 0 else list(reversed(modes))
        for name, mode in order:
            res = measure(name, args.bin, mode, args.samples, args.seconds)
            res["round"] = r + 1
            results.append(res)
            print(json.dumps(res), flush=True)
    with open(args.out, "w") as f:
        json.dump({"machine": os.uname().nodename, "cores": os.cpu_count(), "results": results}, f, indent=1)
    print(f"{'backend':<20} {'median':>8} {'p95':>8} {'1c/s':>8} {'4c/s':>8} {'8c/s':>8} {'rss idle':>9} {'rss after':>9}")
    for r in results:
        print(f"{r['backend']:<20} {r['send_median_ms']:>8} {r['send_p95_ms']:>8} {r['sends_per_s_1']:>8} "
              f"{r['sends_per_s_4']:>8} {r['sends_per_s_8']:>8} {r['rss_idle_mib']:>9} {r['rss_after_mib']:>9}")


if __name__ == "__main__":
    main()
