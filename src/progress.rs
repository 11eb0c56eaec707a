//! A one-line progress bar on stderr, drawn only when stderr is a terminal.

use std::io::{IsTerminal, Write};
use std::time::Instant;

pub struct Progress {
    label: &'static str,
    total: usize,
    done: usize,
    start: Instant,
    enabled: bool,
}

impl Progress {
    pub fn new(label: &'static str, total: usize) -> Progress {
        let enabled = std::io::stderr().is_terminal() && std::env::var_os("LILY_NO_PROGRESS").is_none();
        Progress { label, total, done: 0, start: Instant::now(), enabled }
    }

    pub fn tick(&mut self) {
        self.done += 1;
        if self.enabled {
            let width = 30;
            let filled = width * self.done / self.total.max(1);
            eprint!(
                "\r{} [{}{}] {}/{} {:.1}s",
                self.label,
                "#".repeat(filled),
                " ".repeat(width - filled),
                self.done,
                self.total,
                self.start.elapsed().as_secs_f32()
            );
            let _ = std::io::stderr().flush();
        }
    }

    pub fn finish(&mut self) {
        if self.enabled {
            eprintln!();
        }
    }
}
