#!/usr/bin/env python3
"""A benchmark sitting: Spindle against Synapse, same machine, several rounds.

What it does, in order:
  1. builds Spindle in release mode (`cargo build --release --bin spindle`);
  2. installs Synapse (scripts/bench/requirements-synapse.txt) into a venv
     (default .bench/venv-synapse; SYNAPSE_VENV overrides);
  3. for PostgreSQL, starts a private cluster from Debian's packages (installed with
     apt-get when missing) on 127.0.0.1:15432, owned by the `postgres` user;
  4. runs ROUNDS rounds. Each round starts every server on a fresh, empty data
     directory on loopback, runs scripts/bench/driver.py against it, stops it, and
     writes the driver's JSON to OUT_DIR/<group>.<server>.r<N>.json. The server order
     is reversed on every even round, so a drift of the machine becomes spread the
     comparison can see instead of a bias on whichever server ran last;
  5. prints the comparison (scripts/bench/compare.py).

Servers:
  spindle      the release binary with its embedded defaults (bind, data_dir and rate limits off)
  synapse      Synapse on SQLite: open registration, every rate limit lifted; all dimensions
  synapse-pg   Synapse on PostgreSQL, same settings: the concurrency (throughput) dimension
  tuwunel      Tuwunel built from source (../shared/peers/README.md), its binary named by
               TUWUNEL_BIN, configured from ../shared/peers/tuwunel.toml.in (open UIA-dummy
               registration, federation off, RocksDB in the leg's directory)

Usage:
  scripts/bench/sitting.py                          the full sitting, committed data
  scripts/bench/sitting.py --quick --rounds 1       a smoke run (~3 minutes), data in /tmp
  scripts/bench/sitting.py --big --group big-...    issue 18's bigger shapes (driver.py --big:
                                                    50,000 events, 5,000 members, 500 rooms;
                                                    the Synapse legs take most of the time)
  TUWUNEL_BIN=/path/to/tuwunel scripts/bench/sitting.py --servers spindle,tuwunel,synapse
                                                    against Tuwunel too (~20 minutes idle)
  scripts/bench/sitting.py --help
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PORTS = {"spindle": 18008, "synapse": 18018, "synapse-pg": 18028, "tuwunel": 18038}
# The peer's config template and how-to live beside the project, never inside it.
PEERS = Path(os.environ.get("PEERS_DIR", ROOT.parent / "shared" / "peers"))
PG_PORT = 15432
# Rate limits Synapse applies to one busy client; the driver is one busy client.
LIFTED = {"per_second": 100000, "burst_count": 1000000}
RATE_LIMITS = {
    "rc_message": LIFTED,
    "rc_registration": LIFTED,
    "rc_login": {"address": LIFTED, "account": LIFTED, "failed_attempts": LIFTED},
    "rc_joins": {"local": LIFTED, "remote": LIFTED},
    "rc_joins_per_room": LIFTED,
    "rc_invites": {"per_room": LIFTED, "per_user": LIFTED, "per_issuer": LIFTED},
    "rc_room_creation": LIFTED,
    "rc_3pid_validation": LIFTED,
    "rc_presence": {"per_user": LIFTED},
    "rc_delayed_event_mgmt": LIFTED,
    "rc_profile": LIFTED,
    "rc_user_directory": LIFTED,
    "rc_media_create": LIFTED,
    "rc_admin_redaction": LIFTED,
    "rc_reports": LIFTED,
}


def log(msg: str) -> None:
    print(f"[sitting {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, **kw)


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return open("/proc/loadavg").read().strip()


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{url} did not answer within {timeout_s} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------------ Spindle
def build_spindle() -> Path:
    log("cargo build --release --bin spindle")
    run(["cargo", "build", "--release", "--bin", "spindle"], cwd=ROOT)
    meta = json.loads(run(["cargo", "metadata", "--format-version", "1", "--no-deps"], cwd=ROOT,
                          capture_output=True, text=True).stdout)
    exe = Path(meta["target_directory"]) / "release" / "spindle"
    if not exe.is_file():
        raise SystemExit(f"no binary at {exe}")
    return exe


def spindle_version() -> str:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return rev.strip() + ("-dirty" if dirty else "")


def start_spindle(exe: Path, work: Path, port: int) -> subprocess.Popen:
    work.mkdir(parents=True)
    cfg = work / "spindle.toml"
    # Where to listen, where to keep data, and no rate limits (Synapse's are lifted and
    # Tuwunel has none): everything else is the embedded default.
    cfg.write_text(f'bind = "127.0.0.1:{port}"\ndata_dir = "{work / "data"}"\n\n'
                   '[rate_limits]\nenabled = false\n')
    log_file = open(work / "spindle.log", "w")
    return subprocess.Popen([str(exe), "--config", str(cfg)], stdout=log_file, stderr=subprocess.STDOUT)


# ------------------------------------------------------------------------ Synapse
def synapse_venv() -> Path:
    venv = Path(os.environ.get("SYNAPSE_VENV", ROOT / ".bench" / "venv-synapse"))
    req = HERE / "requirements-synapse.txt"
    stamp = venv / ".requirements"
    if not (venv / "bin" / "python").exists():
        log(f"creating venv {venv}")
        run([sys.executable, "-m", "venv", str(venv)])
    if not stamp.exists() or stamp.read_text() != req.read_text():
        log(f"pip install -r {req}")
        run([str(venv / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check", "-r", str(req)])
        stamp.write_text(req.read_text())
    return venv


def synapse_version(venv: Path) -> str:
    return subprocess.run([str(venv / "bin" / "python"), "-c", "import synapse; print(synapse.__version__)"],
                          capture_output=True, text=True, check=True).stdout.strip()


def start_synapse(venv: Path, work: Path, port: int, database: dict) -> subprocess.Popen:
    work.mkdir(parents=True)
    (work / "media").mkdir()
    # Synapse reads YAML; JSON is YAML, so no YAML writer is needed here.
    (work / "log.yaml").write_text(json.dumps({
        "version": 1,
        "formatters": {"f": {"format": "%(asctime)s %(name)s %(levelname)s %(message)s"}},
        "handlers": {"file": {"class": "logging.FileHandler", "filename": str(work / "homeserver.log"),
                              "formatter": "f"}},
        "root": {"level": "WARNING", "handlers": ["file"]},
        "disable_existing_loggers": False,
    }))
    config = {
        "server_name": "localhost",
        "pid_file": str(work / "homeserver.pid"),
        "listeners": [{
            "port": port, "bind_addresses": ["127.0.0.1"], "type": "http", "tls": False,
            "x_forwarded": False, "resources": [{"names": ["client"], "compress": False}],
        }],
        "database": database,
        "log_config": str(work / "log.yaml"),
        "media_store_path": str(work / "media"),
        "signing_key_path": str(work / "signing.key"),
        "report_stats": False,
        "trusted_key_servers": [],
        "suppress_key_server_warning": True,
        "enable_registration": True,
        "enable_registration_without_verification": True,
        # Password hashing only costs registration and login, which are never timed.
        "bcrypt_rounds": 4,
        "macaroon_secret_key": secrets.token_hex(16),
        "form_secret": secrets.token_hex(16),
        "registration_shared_secret": secrets.token_hex(16),
        **RATE_LIMITS,
    }
    cfg = work / "homeserver.yaml"
    cfg.write_text(json.dumps(config, indent=1))
    py = str(venv / "bin" / "python")
    run([py, "-m", "synapse.app.homeserver", "--config-path", str(cfg), "--generate-keys"],
        capture_output=True)
    out = open(work / "stdout.log", "w")
    return subprocess.Popen([py, "-m", "synapse.app.homeserver", "--config-path", str(cfg)],
                            stdout=out, stderr=subprocess.STDOUT)


# ------------------------------------------------------------------------ Tuwunel
def tuwunel_bin() -> Path:
    exe = os.environ.get("TUWUNEL_BIN")
    if not exe or not os.access(exe, os.X_OK):
        raise SystemExit("the tuwunel leg needs TUWUNEL_BIN set to a built binary "
                         f"(how to build it: {PEERS / 'README.md'})")
    return Path(exe)


def tuwunel_version(exe: Path) -> str:
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True)
    return (out.stdout.strip().split() or ["?"])[-1]


def start_tuwunel(exe: Path, work: Path, port: int) -> subprocess.Popen:
    """What ../shared/peers/start_tuwunel.sh does, kept as a child so the leg can stop it."""
    (work / "db").mkdir(parents=True)
    template = (PEERS / "tuwunel.toml.in").read_text()
    cfg = work / "tuwunel.toml"
    cfg.write_text(template.replace("@DATADIR@", str(work)).replace("@PORT@", str(port)))
    # Tuwunel reads every TUWUNEL_* variable as a config key: pass only the config path.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUWUNEL_")}
    env["TUWUNEL_CONFIG"] = str(cfg)
    out = open(work / "tuwunel.log", "w")
    return subprocess.Popen([str(exe)], stdout=out, stderr=subprocess.STDOUT, env=env)


# ------------------------------------------------------------------------ PostgreSQL
class Postgres:
    """A private cluster for the sitting, from Debian's postgresql package."""

    def __init__(self, work: Path):
        self.dir = work / "pg"
        bins = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
        if not bins:
            log("PostgreSQL missing: apt-get install -y postgresql")
            run(["apt-get", "install", "-y", "-q", "postgresql"])
            bins = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
        self.bin = bins[-1].parent
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    def pg(self, *args: str, **kw):
        return run([*self.as_user, *args], **kw)

    def start(self) -> None:
        self.dir.mkdir(parents=True)
        if self.as_user:
            shutil.chown(self.dir, "postgres", "postgres")
            os.chmod(self.dir.parent, 0o755)
        self.pg(str(self.bin / "initdb"), "-D", str(self.dir / "data"), "--auth=trust", "-E", "UTF8",
                "--locale=C", "-U", "postgres", capture_output=True)
        self.pg(str(self.bin / "pg_ctl"), "-D", str(self.dir / "data"), "-l", str(self.dir / "pg.log"), "-w",
                "-o", f"-p {PG_PORT} -k {self.dir} -c listen_addresses=127.0.0.1", "start", capture_output=True)

    def fresh_db(self, name: str) -> dict:
        psql = [str(self.bin / "psql"), "-h", "127.0.0.1", "-p", str(PG_PORT), "-U", "postgres", "-q", "-c"]
        self.pg(*psql, f"DROP DATABASE IF EXISTS {name}")
        self.pg(*psql, f"CREATE DATABASE {name} ENCODING 'UTF8' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0")
        return {"name": "psycopg2", "args": {"user": "postgres", "database": name, "host": "127.0.0.1",
                                             "port": PG_PORT, "cp_min": 5, "cp_max": 10}}

    def stop(self) -> None:
        subprocess.run([*self.as_user, str(self.bin / "pg_ctl"), "-D", str(self.dir / "data"), "-m", "fast",
                        "stop"], capture_output=True)


# ------------------------------------------------------------------------ the sitting
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--rounds", type=int, default=3, help="rounds (at least 3 for a sitting that calls cells)")
    p.add_argument("--servers", default="spindle,synapse,synapse-pg")
    p.add_argument("--group", default=time.strftime("sitting-%Y%m%d"), help="file name prefix of the results")
    p.add_argument("--out-dir", help="default: docs/benchmarks/data (or a temp dir with --quick)")
    p.add_argument("--work", default=None, help="scratch directory for data dirs (default: a temp dir)")
    preset = p.add_mutually_exclusive_group()
    preset.add_argument("--quick", action="store_true", help="the driver's smoke sizes")
    preset.add_argument("--big", action="store_true",
                        help="the driver's bigger shapes (events 200,3200,50000; members 50,800,5000; "
                             "rooms 50,200,500)")
    p.add_argument("--no-build", action="store_true", help="use the existing release binary")
    p.add_argument("--driver-arg", action="append", default=[],
                   help="extra argument for driver.py (repeatable), e.g. --driver-arg=--samples=30")
    a = p.parse_args()
    servers = [s.strip() for s in a.servers.split(",") if s.strip()]
    for s in servers:
        if s not in PORTS:
            p.error(f"unknown server {s}")
    if a.rounds < 3 and not a.quick:
        log("warning: fewer than 3 rounds; compare.py will not call any cell")

    work = Path(a.work) if a.work else Path(os.environ.get("TMPDIR", "/tmp")) / f"spindle-bench-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    out_dir = Path(a.out_dir) if a.out_dir else (work / "results" if a.quick else ROOT / "docs" / "benchmarks" / "data")
    out_dir.mkdir(parents=True, exist_ok=True)

    exe = None
    if "spindle" in servers:
        exe = build_spindle() if not a.no_build else None
        if exe is None:
            meta = json.loads(run(["cargo", "metadata", "--format-version", "1", "--no-deps"], cwd=ROOT,
                                  capture_output=True, text=True).stdout)
            exe = Path(meta["target_directory"]) / "release" / "spindle"
    venv = synapse_venv() if any(s.startswith("synapse") for s in servers) else None
    versions = {"spindle": spindle_version()}
    tuwunel = None
    if "tuwunel" in servers:
        tuwunel = tuwunel_bin()
        versions["tuwunel"] = tuwunel_version(tuwunel)
    if venv:
        versions["synapse"] = versions["synapse-pg"] = synapse_version(venv)
    pg = None
    if "synapse-pg" in servers:
        pg = Postgres(work)
        pg.start()
        versions["postgres"] = pg.bin.parent.name

    written = []
    try:
        for r in range(1, a.rounds + 1):
            order = servers if r % 2 == 1 else list(reversed(servers))
            log(f"round {r}/{a.rounds}: {' -> '.join(order)}; {uptime()}")
            for s in order:
                leg = work / f"r{r}-{s}"
                if leg.exists():
                    shutil.rmtree(leg)
                port = PORTS[s]
                if s == "spindle":
                    proc = start_spindle(exe, leg, port)
                elif s == "tuwunel":
                    proc = start_tuwunel(tuwunel, leg, port)
                elif s == "synapse":
                    proc = start_synapse(venv, leg, port,
                                         {"name": "sqlite3", "args": {"database": str(leg / "homeserver.db")}})
                else:
                    proc = start_synapse(venv, leg, port, pg.fresh_db(f"synapse_r{r}"))
                try:
                    wait_ready(f"http://127.0.0.1:{port}/_matrix/client/versions", proc)
                    out = out_dir / f"{a.group}.{s}.r{r}.json"
                    dims = ["--dimensions", "concurrency"] if s == "synapse-pg" else []
                    cmd = [sys.executable, str(HERE / "driver.py"), "--base", f"http://127.0.0.1:{port}",
                           "--label", s, "--out", str(out), *dims, *(["--quick"] if a.quick else []),
                           *(["--big"] if a.big else []),
                           "--meta", f"round={r}", "--meta", f"order={','.join(order)}",
                           "--meta", f"version={versions.get(s, '')}", "--meta", f"uptime_before={uptime()}",
                           *a.driver_arg]
                    if s == "synapse-pg":
                        cmd += ["--meta", f"postgres={versions['postgres']}"]
                    log(f"  {s}: driver -> {out}")
                    run(cmd)
                    # The load after the leg, beside the load before it.
                    doc = json.loads(out.read_text())
                    doc["meta"]["uptime_after"] = uptime()
                    out.write_text(json.dumps(doc, indent=1) + "\n")
                    written.append(out)
                finally:
                    stop(proc)
    finally:
        if pg:
            pg.stop()
    log(f"wrote {len(written)} files to {out_dir}")
    subprocess.run([sys.executable, str(HERE / "compare.py"), str(out_dir / a.group)])
    if not a.work:
        shutil.rmtree(work / "pg", ignore_errors=True)
        for leg in work.glob("r*-*"):
            shutil.rmtree(leg, ignore_errors=True)


if __name__ == "__main__":
    main()
