//! What the matrix-rust-sdk tests share: the real `spindle` binary started on a free
//! port with open registration (from `SPINDLE_BIN`, which `scripts/test` builds and
//! sets), and clients registered and logged in against it.

#![allow(dead_code)]

use std::{
    net::TcpListener,
    path::PathBuf,
    process::Stdio,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use matrix_sdk::{
    Client,
    ruma::api::client::{
        account::register::v3::Request as RegisterRequest,
        uiaa::{AuthData, Dummy},
    },
};

/// How long any one expectation may take before the test fails.
pub const WAIT: Duration = Duration::from_secs(30);

pub struct Server {
    pub child: tokio::process::Child,
    pub base_url: String,
    _dir: tempfile::TempDir,
    stderr: PathBuf,
}

impl Server {
    pub async fn start() -> Result<Server> {
        let bin = std::env::var("SPINDLE_BIN")
            .context("SPINDLE_BIN must name the spindle binary (scripts/test sets it)")?;
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let dir = tempfile::tempdir()?;
        let config = dir.path().join("spindle.toml");
        std::fs::write(
            &config,
            format!(
                "server_name = \"localhost:{port}\"\nbind = \"127.0.0.1:{port}\"\n\
                 data_dir = \"{}\"\n\n[registration]\nmode = \"open\"\n\n\
                 [rate_limits]\nenabled = false\n",
                dir.path().join("data").display()
            ),
        )?;
        let stderr = dir.path().join("spindle.stderr.log");
        let child = tokio::process::Command::new(bin)
            .arg("--config")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr)?)
            .kill_on_drop(true)
            .spawn()
            .context("starting spindle")?;
        let deadline = Instant::now() + WAIT;
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            if Instant::now() > deadline {
                bail!("spindle did not listen on port {port}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(Server {
            child,
            base_url: format!("http://127.0.0.1:{port}"),
            _dir: dir,
            stderr,
        })
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    pub async fn client(&self) -> Result<Client> {
        Ok(Client::builder()
            .homeserver_url(&self.base_url)
            .build()
            .await?)
    }

    /// Registers `name` (open registration, `m.login.dummy`).
    pub async fn register(&self, name: &str) -> Result<()> {
        let client = self.client().await?;
        let mut req = RegisterRequest::new();
        req.username = Some(name.to_owned());
        req.password = Some(format!("password-{name}"));
        req.auth = Some(AuthData::Dummy(Dummy::new()));
        client.matrix_auth().register(req).await?;
        Ok(())
    }

    /// A client logged in as `name` on a new device.
    pub async fn login(&self, name: &str) -> Result<Client> {
        let client = self.client().await?;
        client
            .matrix_auth()
            .login_username(name, &format!("password-{name}"))
            .initial_device_display_name("spindle sdk e2e")
            .send()
            .await?;
        Ok(client)
    }
}
