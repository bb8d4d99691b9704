//! Progress bars on stderr for long work (fetching, encoding).

use indicatif::{ProgressBar, ProgressStyle};

/// A progress bar counting `total` units of `what` on stderr.
pub fn bar(total: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(total);
    let style =
        ProgressStyle::with_template("{msg:>12} [{bar:40}] {pos}/{len} ({elapsed}, eta {eta})")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
    pb.set_style(style);
    pb.set_message(what.to_string());
    pb
}

/// A progress bar counting bytes on stderr.
pub fn bytes_bar(total: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(total);
    let style = ProgressStyle::with_template(
        "{msg:>12} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta})",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ");
    pb.set_style(style);
    pb.set_message(what.to_string());
    pb
}
