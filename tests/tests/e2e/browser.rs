//! The dashboard in headless Chromium: a native mesh on 127.0.0.1 serves the page, the page's
//! own browser node dials the mesh over WebSocket, follows its heartbeats, and shows every row
//! healthy. Then the page contributes on a mesh whose every row is held: the mesh grows a row,
//! the page's node encodes it from k live rows, serves it on WebGPU, and a native leader's
//! request is computed partly by it, through a relay. When a node stops, its row turns Dead on
//! the page without a reload. Last, the page leads the same request
//! from its prompt box and gets the native leader's completion. So does a second browser, on a
//! page of its own that embeds the browser node's package (`/embed.html`) and dials WebRTC-direct:
//! its group holds the first browser's row, reached browser to browser through the relay.
//!
//! Needs Debian's `chromium` and `chromium-driver`, the dashboard and the
//! package built (`scripts/build-web.sh`; `scripts/test.sh` does all); `$CHROMEDRIVER` and `$CHROMIUM` override where they are.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use fantoccini::{Client, ClientBuilder, Locator};
use tests::procs::{Mesh, free_port, tiny_model};

/// An executable named by `$var`, else found on `PATH`.
fn tool(var: &str, name: &str) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(var) {
        return Ok(PathBuf::from(p));
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .with_context(|| {
            format!(
                "{name} not found: install Debian's chromium and chromium-driver (bash scripts/test.sh does), or set {var}"
            )
        })
}

/// chromedriver on a free port of 127.0.0.1, killed when dropped.
pub(crate) struct Driver {
    child: Child,
    url: String,
    /// Where each browser gets a fresh profile: the mesh's scratch directory (removed with it).
    profiles: PathBuf,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_driver(dir: &Path) -> Result<Driver> {
    start_driver_in(dir, None)
}

/// chromedriver, and the browsers it starts, in network namespace `ns` (a lab node's; its
/// 127.0.0.1 is the namespace's own) or in this one.
pub(crate) fn start_driver_in(dir: &Path, ns: Option<&str>) -> Result<Driver> {
    let driver = tool("CHROMEDRIVER", "chromedriver")?;
    // A lab node's namespace is empty: any port is free there.
    let port = if ns.is_some() { 9515 } else { free_port()? };
    let log = std::fs::File::create(dir.join("chromedriver.log"))?;
    let mut cmd = match ns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(&driver);
            c
        }
        None => Command::new(&driver),
    };
    let child = cmd
        .arg(format!("--port={port}"))
        .arg("--enable-chrome-logs")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .with_context(|| format!("starting {}", driver.display()))?;
    let url = format!("http://127.0.0.1:{port}");
    let start = Instant::now();
    let listening = || {
        let dial = || std::net::TcpStream::connect(("127.0.0.1", port)).map(drop);
        match ns {
            Some(ns) => tests::lab::link::in_namespace(ns, dial).is_ok(),
            None => dial().is_ok(),
        }
    };
    while !listening() {
        if start.elapsed() > Duration::from_secs(20) {
            bail!("chromedriver did not listen on {url}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(Driver {
        child,
        url,
        profiles: dir.to_path_buf(),
    })
}

/// A headless Chromium with a fresh profile of its own (`name`), so two browsers are two
/// nodes with two identities.
async fn open_browser(driver: &Driver, name: &str) -> Result<Client> {
    open_browser_with(driver, name, &[]).await
}

/// [`open_browser`] with more command-line arguments for Chromium.
pub(crate) async fn open_browser_with(
    driver: &Driver,
    name: &str,
    extra: &[String],
) -> Result<Client> {
    let chromium = tool("CHROMIUM", "chromium")?;
    let profile = driver.profiles.join(format!("chromium-{name}"));
    std::fs::create_dir_all(&profile)?;
    let profile = profile.display().to_string();
    let caps = serde_json::json!({
        "goog:chromeOptions": {
            "binary": chromium.display().to_string(),
            "args": [
                "--headless", "--no-sandbox", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--enable-unsafe-webgpu", "--use-webgpu-adapter=swiftshader",
                "--enable-logging=stderr", "--v=0",
                format!("--user-data-dir={profile}"), "--window-size=1200,900",
            ]
        }
    });
    let mut caps = caps;
    if let Some(args) = caps["goog:chromeOptions"]["args"].as_array_mut() {
        args.extend(extra.iter().map(|a| serde_json::Value::from(a.as_str())));
    }
    let serde_json::Value::Object(caps) = caps else {
        bail!("capabilities are not an object");
    };
    ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(&driver.url)
        .await
        .context("connecting to chromedriver")
}

/// The page's text of `css`, or "" while it is not there.
pub(crate) async fn text(c: &Client, css: &str) -> String {
    match c.find(Locator::Css(css)).await {
        Ok(e) => e.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// Waits until `css`'s text satisfies `ok`; returns it.
pub(crate) async fn wait_text(
    c: &Client,
    css: &str,
    ok: impl Fn(&str) -> bool,
    what: &str,
) -> Result<String> {
    wait_text_within(c, css, ok, what, Duration::from_secs(90)).await
}

/// [`wait_text`], giving up after `timeout`.
pub(crate) async fn wait_text_within(
    c: &Client,
    css: &str,
    ok: impl Fn(&str) -> bool,
    what: &str,
    timeout: Duration,
) -> Result<String> {
    let start = Instant::now();
    loop {
        let t = text(c, css).await;
        if ok(&t) {
            return Ok(t);
        }
        if start.elapsed() > timeout {
            let page = text(c, "body").await;
            bail!("the page never showed {what}; {css} says {t:?}; the page:\n{page}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Health of every row in the table, in row order.
async fn row_health(c: &Client) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for row in c.find_all(Locator::Css("#rows tbody tr")).await? {
        let cell = row.find(Locator::Css("td.health")).await?;
        out.push(cell.text().await?);
    }
    Ok(out)
}

fn screenshot_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("target")
        .join("browser-e2e")
}

#[test]
fn the_dashboard_follows_the_mesh_live_from_its_own_browser_node() -> Result<()> {
    let dist = Path::new(env!("CARGO_MANIFEST_DIR")).join("../web-ui/dist/index.html");
    if !dist.is_file() {
        bail!(
            "{} is missing: build the dashboard first (bash scripts/build-web.sh)",
            dist.display()
        );
    }
    // Nothing else runs until this test ends (crate::machine).
    let _machine = crate::machine::alone();
    // The seed listens on WebSocket and WebRTC-direct too: the page dials it.
    let mut mesh = Mesh::start_with("browser", Some(&tiny_model()), &["--no-learning"], &[])?;
    let status = mesh.status()?;
    assert_eq!(
        status["dashboard"].as_str(),
        Some(mesh.dashboard.as_str()),
        "status --json names the seed's dashboard: {status}"
    );
    let driver = start_driver(&mesh.dir.0)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let result = rt.block_on(async {
        let c = open_browser(&driver, "dashboard").await?;
        let r = async {
            let out = drive(&c, &mut mesh).await?;
            // A second browser, a page of its own that embeds the package.
            let e = open_browser(&driver, "embedded").await?;
            let r = embedded(&e, &c, &mesh, &out).await;
            let _ = e.close().await;
            r
        }
        .await;
        let _ = c.close().await;
        r
    });
    if result.is_err() {
        eprintln!(
            "chromedriver log:\n{}",
            std::fs::read_to_string(mesh.dir.0.join("chromedriver.log")).unwrap_or_default()
        );
    }
    result
}

/// The dashboard's page through the whole story; returns the native leader's completion.
async fn drive(c: &Client, mesh: &mut Mesh) -> Result<String> {
    // Every product of the browser's row on WebGPU, however small: the WGSL kernels are what
    // this test checks (the page's default leaves the tiny model's products on the CPU).
    c.goto(&format!("{}?webgpu=all", mesh.dashboard)).await?;
    let connection = wait_text(
        c,
        "#connection",
        |t| t.contains("follows the mesh through"),
        "a connection",
    )
    .await?;
    // Errors, not panics, inside the session: the caller closes the browser either way.
    ensure!(
        connection.contains("/ws/"),
        "the page's node dials WebSocket first: {connection}"
    );
    let summary = wait_text(
        c,
        "#summary",
        |t| {
            t.starts_with(
                "model available: yes — 5 of 5 rows healthy, k = 3, tolerates 2 more failures",
            )
        },
        "five healthy rows",
    )
    .await?;
    eprintln!("the page says: {summary}");
    // Heartbeats, not the first answer, keep the page live: wait until the rows age correctly.
    let start = Instant::now();
    while row_health(c).await? != ["Healthy"; 5] {
        if start.elapsed() > Duration::from_secs(60) {
            bail!("rows never all Healthy: {:?}", row_health(c).await?);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let dir = screenshot_dir();
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("dashboard.png"), c.screenshot().await?)?;
    // "Contribute this GPU" on a mesh whose every row is held: the mesh grows a row for the
    // page's node, which encodes it from k live rows it dials itself, and serves it on WebGPU
    // (SwiftShader here).
    let new_row = 5;
    c.find(Locator::Css("#contribute")).await?.click().await?;
    let serving = wait_text(
        c,
        "#contribution",
        |t| t.starts_with(&format!("serving row {new_row} on browser")) || t.contains("could not"),
        "the browser serving a new row",
    )
    .await?;
    eprintln!("the page says: {serving}");
    ensure!(
        serving.starts_with(&format!("serving row {new_row} on browser WebGPU"))
            && serving.contains("a new row, encoded from rows")
            && serving.contains("along a chain"),
        "the browser encodes the new row {new_row} and serves it on WebGPU: {serving}"
    );
    // The page says what it keeps: the row's snapshot, in IndexedDB.
    ensure!(
        serving.contains(" MiB kept in this browser's storage"),
        "the page says how much of the row it keeps: {serving}"
    );
    // The native mesh sees the browser's row healthy, with its device.
    let status = mesh.wait_healthy(6)?;
    let holder = status["nodes"]
        .as_array()
        .and_then(|nodes| {
            nodes
                .iter()
                .find(|n| n["row"] == new_row && n["health"] == "Healthy")
        })
        .cloned()
        .unwrap_or_default();
    ensure!(
        holder["device"]
            .as_str()
            .is_some_and(|d| d.starts_with("browser WebGPU")),
        "status --json shows row {new_row} held by the browser, Healthy, with its device: {status}"
    );
    // A native leader's request on all six rows (k = 3 decoded, 3 checked): the browser's
    // answers come through its relay and must agree with the code in every round.
    let (out, err) = mesh.generate_with(
        "The history of the printing press begins",
        8,
        &["--check", "3", "--spares", "0"],
        || {},
    )?;
    eprintln!("generated through the browser's row: {out:?}\n{err}");
    let answered = wait_text(
        c,
        "#contribution",
        |t| !t.contains(": 0 coded steps"),
        "coded steps answered by the browser",
    )
    .await?;
    eprintln!("the page says: {answered}");
    ensure!(
        steps_on_webgpu(&answered) > 0,
        "the browser computes its coded steps with the WGSL kernels: {answered}"
    );
    ensure!(
        err.contains(", 0 unchecked") && !err.contains(" caught on "),
        "every round checked, nobody caught:\n{err}"
    );
    std::fs::write(dir.join("dashboard-browser-row.png"), c.screenshot().await?)?;

    // A node stops: its row turns Dead on the page, through heartbeats alone.
    let row = 2;
    let i = mesh.holder(row)?;
    mesh.nodes[i].signal("KILL");
    wait_text(
        c,
        "#summary",
        |t| {
            t.starts_with(
                "model available: yes — 5 of 6 rows healthy, k = 3, tolerates 2 more failures",
            )
        },
        "five healthy rows of six after a kill",
    )
    .await?;
    // Suspect first, Dead once silent for the health timeout.
    let start = Instant::now();
    let mut health = row_health(c).await?;
    while health[row as usize] != "Dead" {
        if start.elapsed() > Duration::from_secs(60) {
            bail!("row {row} never turned Dead after its node was killed: {health:?}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
        health = row_health(c).await?;
    }
    ensure!(
        health.iter().filter(|h| *h == "Healthy").count() == 5,
        "only row {row} is down: {health:?}"
    );
    std::fs::write(dir.join("dashboard-row-dead.png"), c.screenshot().await?)?;

    // The prompt box: the page leads the same request itself, on a group of the native rows
    // it dials over WebSocket, and the greedy completion is the native leader's.
    c.find(Locator::Css("#chat")).await?.click().await?;
    let tokens = c.find(Locator::Css("#max-tokens")).await?;
    tokens.clear().await?;
    tokens.send_keys("8").await?;
    c.find(Locator::Css("#prompt"))
        .await?
        .send_keys("The history of the printing press begins")
        .await?;
    c.find(Locator::Css("#ask")).await?.click().await?;
    let stats = wait_text(
        c,
        "#completion-stats",
        |t| t.contains("tok/s") || t.contains("failed"),
        "the page's own request done",
    )
    .await?;
    let completion = text(c, "#completion").await;
    eprintln!("the page led: {completion:?}\n{stats}");
    ensure!(
        stats.contains(" tokens (") && stats.contains("nobody caught"),
        "the page's request ran, nobody caught: {stats}"
    );
    // Its rounds went out on session streams to the members, as a native leader's do.
    let sessions: usize = stats
        .split(" session streams")
        .next()
        .and_then(|s| s.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("no session streams in {stats:?}"))?;
    ensure!(
        sessions >= 3,
        "the page asked at least its k = 3 decoding rows on session streams: {stats}"
    );
    ensure!(
        completion.trim() == out.trim(),
        "the page's greedy completion {completion:?} is the native leader's {out:?}"
    );
    // Both leaders reported their request to the seed; its heartbeats carry the mesh's usage
    // to the page's live numbers.
    wait_text(c, "#requests", |t| t == "2", "two requests served").await?;
    let latency = text(c, "#latency").await;
    ensure!(
        latency.ends_with(" ms"),
        "the page shows the requests' latency: {latency:?}"
    );
    std::fs::write(dir.join("dashboard-prompt.png"), c.screenshot().await?)?;
    Ok(out)
}

/// The steps the dashboard's row has answered, from its contribution line.
pub(crate) fn steps_answered(contribution: &str) -> usize {
    contribution
        .split_once("): ")
        .and_then(|(_, rest)| rest.split_once(" coded steps answered"))
        .and_then(|(n, _)| n.parse().ok())
        .unwrap_or(0)
}

/// Of those, the steps whose products ran on WebGPU.
pub(crate) fn steps_on_webgpu(contribution: &str) -> usize {
    contribution
        .split_once(" coded steps answered (")
        .and_then(|(_, rest)| rest.split_once(" on WebGPU"))
        .and_then(|(n, _)| n.parse().ok())
        .unwrap_or(0)
}

/// The browser node's package in a page of its own (web-ui/embed.html, a few lines of JavaScript),
/// in a second browser: it connects over WebRTC-direct, follows the mesh and leads the same
/// request on every row, the first browser's among them: browser to browser, through the
/// native relay.
async fn embedded(e: &Client, dashboard: &Client, mesh: &Mesh, out: &str) -> Result<()> {
    let before = steps_answered(&text(dashboard, "#contribution").await);
    e.goto(&format!(
        "{}embed.html?transport=webrtc-direct",
        mesh.dashboard
    ))
    .await?;
    // The five healthy rows in the embedded node's view too, the first browser's among them.
    wait_text(
        e,
        "#summary",
        |t| t.starts_with("model available: yes — 5 of 6 rows healthy") || t.starts_with("failed"),
        "the embedded node's view of the mesh",
    )
    .await?;
    let via = text(e, "#via").await;
    ensure!(
        via.contains("/webrtc-direct/certhash/"),
        "the embedded node dials WebRTC-direct when asked: {via:?}"
    );
    // One ask, no retry: the first browser heartbeats at the mesh's pace, so the seed sees its
    // row healthy whenever this page forms its group (it used to heartbeat every second against
    // the test's 0.8 s suspect timeout, and was left out of about 4 in 10 first requests).
    mesh.wait_healthy(5)?;
    e.find(Locator::Css("#ask")).await?.click().await?;
    let done = wait_text(e, "#done", |t| !t.is_empty(), "the embedded node's request").await?;
    let completion = text(e, "#out").await;
    eprintln!("the embedded node led: {completion:?}\n{done}");
    ensure!(
        done.contains(" of 5 live rows"),
        "the embedded node's group was formed from all five healthy rows: {done}"
    );
    ensure!(
        done.starts_with("8 tokens at ") && done.ends_with(", 0 rounds unchecked"),
        "the embedded node's request ran, every round checked: {done}"
    );
    let group: Vec<usize> = done
        .split_once("group [")
        .and_then(|(_, rest)| rest.split_once(']'))
        .map(|(g, _)| g.split(',').filter_map(|r| r.parse().ok()).collect())
        .unwrap_or_default();
    ensure!(
        group.contains(&5),
        "the embedded node's group holds the other browser's row 5: {done}"
    );
    ensure!(
        completion.trim() == out.trim(),
        "the embedded node's greedy completion {completion:?} is the native leader's {out:?}"
    );
    let after = wait_text(
        dashboard,
        "#contribution",
        |t| steps_answered(t) > before,
        "the dashboard's row answering the embedded node",
    )
    .await?;
    eprintln!("the first browser says: {after}");
    std::fs::write(screenshot_dir().join("embedded.png"), e.screenshot().await?)?;
    Ok(())
}
