//! Logs of the real binary (issue 17 item 5): one access line per request with its
//! secrets removed, JSON lines on request, no ANSI escape codes into a file or pipe,
//! quiet by default, and the access log switched off.

mod common;

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex, mpsc},
    time::{Duration, Instant},
};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_spindle");

/// A config in a temporary directory; `extra` is appended.
fn setup(extra: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("spindle.toml");
    std::fs::write(
        &config,
        format!(
            "server_name = \"{}\"\nbind = \"127.0.0.1:0\"\ndata_dir = \"{}\"\n{extra}",
            common::SERVER_NAME,
            dir.path().join("data").display()
        ),
    )
    .unwrap();
    (dir, config)
}

/// `spindle --config FILE` with stderr (a pipe, not a terminal) collected line by line.
struct Proc {
    child: Child,
    base: String,
    lines: Arc<Mutex<Vec<String>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Proc {
    fn start(config: &Path) -> Proc {
        let mut child = Command::new(BIN)
            .arg("--config")
            .arg(config)
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn spindle");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("spindle: serving on ") {
                    let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_owned());
                }
                sink.lock().unwrap().push(line);
            }
        });
        let base = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("spindle reports its address");
        Proc {
            child,
            base,
            lines,
            reader: Some(reader),
        }
    }

    /// SIGTERM, wait for the exit, and return every stderr line.
    fn stop(mut self) -> Vec<String> {
        let status = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(status.success());
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.child.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "spindle did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
        self.reader.take().unwrap().join().unwrap();
        self.lines.lock().unwrap().clone()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Three requests: one anonymous, one with a token in the query, one authenticated.
async fn three_requests(base: &str) -> String {
    let http = common::http();
    let v = http
        .get(format!("{base}/_matrix/client/versions"))
        .send()
        .await
        .unwrap();
    assert_eq!(v.status(), 200);
    let s = http
        .get(format!(
            "{base}/_matrix/client/v3/sync?timeout=0&access_token=not-a-real-secret-42"
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(s.status(), 401);
    let alice = common::register(base, &http, "alice").await;
    alice.get("/_matrix/client/v3/account/whoami").await.ok();
    alice.user_id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_access_log_has_one_line_per_request_without_secrets_or_colours() {
    let (_dir, config) = setup("[logging]\nformat = \"json\"\n");
    let proc = Proc::start(&config);
    let user = three_requests(&proc.base).await;
    let lines = proc.stop();
    let all = lines.join("\n");
    assert!(
        !all.contains('\u{1b}'),
        "no ANSI escape into a pipe:\n{all}"
    );
    assert!(!all.contains("not-a-real-secret-42"), "{all}");
    // The CLI's own plain lines ("spindle: serving on ...") aside, every line is JSON.
    let events: Vec<Value> = lines
        .iter()
        .filter(|l| !l.starts_with("spindle: "))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let access: Vec<&Value> = events
        .iter()
        .filter(|e| e["target"] == "spindle::access")
        .collect();
    // versions, sync, register (UIA challenge), register, whoami.
    let summary: Vec<(String, String, u64, String)> = access
        .iter()
        .map(|e| {
            assert_eq!(e["level"], "INFO");
            assert_eq!(e["message"], "request");
            assert!(e["duration_ms"].as_f64().is_some(), "{e}");
            (
                e["method"].as_str().unwrap().to_owned(),
                e["path"].as_str().unwrap().to_owned(),
                e["status"].as_u64().unwrap(),
                e["user"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let s = |m: &str, p: &str, st: u64, u: &str| (m.into(), p.into(), st, u.into());
    assert_eq!(
        summary,
        vec![
            s("GET", "/_matrix/client/versions", 200, "-"),
            s(
                "GET",
                "/_matrix/client/v3/sync?timeout=0&access_token=<redacted>",
                401,
                "-"
            ),
            s("POST", "/_matrix/client/v3/register", 401, "-"),
            s("POST", "/_matrix/client/v3/register", 200, "-"),
            s("GET", "/_matrix/client/v3/account/whoami", 200, &user),
        ]
    );
    // Quiet by default: nothing at info but the access log and the start-up line.
    let other_info: Vec<&Value> = events
        .iter()
        .filter(|e| e["level"] == "INFO" && e["target"] != "spindle::access")
        .collect();
    assert_eq!(
        other_info
            .iter()
            .map(|e| e["message"].as_str().unwrap_or(""))
            .collect::<Vec<_>>(),
        vec!["spindle is serving"],
        "{other_info:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_can_be_switched_off_and_text_has_no_colours_in_a_pipe() {
    let (_dir, config) = setup("[logging]\naccess_log = false\n");
    let proc = Proc::start(&config);
    three_requests(&proc.base).await;
    let lines = proc.stop();
    let all = lines.join("\n");
    assert!(!all.contains('\u{1b}'), "{all}");
    assert!(!all.contains("spindle::access"), "{all}");
    assert!(all.contains("spindle is serving"), "{all}");
}
