//! Progress bars on stderr (indicatif), drawn only when stderr is a terminal and
//! `LILY_NO_PROGRESS` is unset.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;

pub struct Progress {
    bar: ProgressBar,
}

/// Whether bars are drawn: stderr is a terminal and `LILY_NO_PROGRESS` is unset.
pub fn enabled() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("LILY_NO_PROGRESS").is_none()
}

impl Progress {
    /// A bar of `total` steps labelled `label`.
    pub fn new(label: &str, total: usize) -> Progress {
        let bar = ProgressBar::with_draw_target(
            Some(total as u64),
            if enabled() { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() },
        );
        let style = ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {elapsed_precise} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("#>-");
        bar.set_style(style);
        bar.set_prefix(label.to_string());
        Progress { bar }
    }

    pub fn tick(&mut self) {
        self.bar.inc(1);
    }

    pub fn inc(&mut self, n: usize) {
        self.bar.inc(n as u64);
    }

    /// Text after the bar (a running value, say).
    pub fn message(&mut self, msg: String) {
        self.bar.set_message(msg);
    }

    /// Leaves the finished bar on its line.
    pub fn finish(&mut self) {
        self.bar.finish();
    }
}
