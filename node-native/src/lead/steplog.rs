//! The instruction-stream log (`--trace-steps FILE`): one JSON line per member per coded step,
//! with when it ended, the request(s) it served, the step, the member, its bytes and how long it
//! took, so a user can see where a slow request spent its time.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use serde::Serialize;

/// One member's part of one coded step.
#[derive(Debug, Serialize)]
pub struct StepRecord<'a> {
    /// When the answer came (or the round ended), milliseconds since the Unix epoch.
    pub unix_ms: f64,
    /// The requests the step served (`req 3,4,9`), or what the leader was doing.
    pub context: &'a str,
    /// The step: the stage and direction (`Qkv(3)`, `LmHead`, `Down(2) backward`, `embedding`).
    pub step: &'a str,
    /// The leader's round counter.
    pub round: u64,
    /// The member's row.
    pub member: usize,
    /// The member's peer id.
    pub peer: String,
    /// Whether the member was the leader's own node (computed without a network hop).
    pub local: bool,
    /// Bytes sent to the member.
    pub bytes_sent: usize,
    /// Bytes of its answer.
    pub bytes_received: usize,
    /// Milliseconds from sending to its answer (or to the end of the round).
    pub ms: f64,
    /// Milliseconds the member reported computing.
    pub compute_ms: f64,
    /// `ok`, the error, or `not needed (outrun)` when the round finished without it.
    pub outcome: &'a str,
}

/// A step trace file shared by a node's leaders.
#[derive(Debug, Clone)]
pub struct StepLog {
    out: Arc<Mutex<BufWriter<File>>>,
}

impl StepLog {
    /// Creates (truncating) the trace file.
    pub fn create(path: &Path) -> Result<Self> {
        let file = File::create(path)
            .with_context(|| format!("creating step trace {}", path.display()))?;
        Ok(Self {
            out: Arc::new(Mutex::new(BufWriter::new(file))),
        })
    }

    /// Appends one record (written out at the latest by the next [`StepLog::flush`]). A
    /// line goes to the buffer in one piece, so a reader never sees half of one.
    pub fn record(&self, rec: &StepRecord<'_>) {
        let mut line = match serde_json::to_vec(rec) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!("encoding a step record: {e}");
                return;
            }
        };
        line.push(b'\n');
        let mut out = self
            .out
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Err(e) = out.write_all(&line) {
            tracing::warn!("writing the step trace: {e}");
        }
    }

    /// Writes out what is buffered (after each forward step, so the file follows the requests).
    pub fn flush(&self) {
        let mut out = self
            .out
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Err(e) = out.flush() {
            tracing::warn!("writing the step trace: {e}");
        }
    }
}

/// Milliseconds since the Unix epoch, now.
pub fn unix_ms() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1e3)
}
