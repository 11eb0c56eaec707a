//! The KV-cache budget in pages: the scheduler admits a sequence only when the pages its
//! reservation needs are free, and frees them when the sequence leaves.
//!
//! A page holds `page_tokens` positions of every attention layer's K and V. Each admitted
//! sequence reserves the pages for its prompt plus its token budget (capped at the context), as
//! TGI does with `max_total_tokens`: a running sequence never runs out of cache mid-answer, so
//! nothing has to be preempted; a request whose reservation exceeds the whole budget is refused
//! at once with the numbers, and one that does not fit now waits in the queue.

use anyhow::{bail, Result};

pub struct KvPages {
    page_tokens: usize,
    total: usize,
    used: usize,
    /// Pages held per slot.
    held: Vec<usize>,
}

impl KvPages {
    pub fn new(page_tokens: usize, total_pages: usize, slots: usize) -> KvPages {
        KvPages { page_tokens: page_tokens.max(1), total: total_pages, used: 0, held: vec![0; slots] }
    }

    /// Pages that `tokens` cached positions take.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_tokens)
    }

    /// Whether `tokens` positions could ever be reserved (an error naming the numbers if not).
    pub fn check_fits(&self, tokens: usize) -> Result<()> {
        let need = self.pages_for(tokens);
        if need > self.total {
            bail!(
                "the request needs {tokens} tokens of KV cache (prompt + max_tokens), more than the server's whole budget of {} tokens; lower max_tokens or raise --kv-budget-tokens",
                self.total * self.page_tokens
            );
        }
        Ok(())
    }

    /// Reserves the pages for `tokens` positions in `slot` (which must hold none); false when
    /// not enough are free now.
    pub fn reserve(&mut self, slot: usize, tokens: usize) -> bool {
        debug_assert_eq!(self.held[slot], 0, "slot {slot} already holds pages");
        let need = self.pages_for(tokens);
        if self.used + need > self.total {
            return false;
        }
        self.used += need;
        self.held[slot] = need;
        true
    }

    pub fn release(&mut self, slot: usize) {
        self.used -= std::mem::take(&mut self.held[slot]);
    }

    pub fn used(&self) -> usize {
        self.used
    }

    pub fn total(&self) -> usize {
        self.total
    }

    pub fn page_tokens(&self) -> usize {
        self.page_tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_and_release() {
        let mut p = KvPages::new(16, 10, 3);
        assert_eq!(p.pages_for(0), 0);
        assert_eq!(p.pages_for(16), 1);
        assert_eq!(p.pages_for(17), 2);
        assert!(p.reserve(0, 100)); // 7 pages
        assert!(!p.reserve(1, 64)); // 4 more do not fit
        assert!(p.reserve(1, 48)); // 3 do
        assert_eq!(p.used(), 10);
        p.release(0);
        assert_eq!(p.used(), 3);
        assert!(p.reserve(2, 112));
        assert!(p.check_fits(160).is_ok());
        let e = p.check_fits(161).unwrap_err().to_string();
        assert!(e.contains("161 tokens") && e.contains("160 tokens"), "{e}");
    }
}
