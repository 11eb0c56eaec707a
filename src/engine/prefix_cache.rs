//! Prefix cache for the hybrid model. Full-attention KV could be truncated, but the Gated DeltaNet
//! conv and recurrent state cannot, so the cache keeps whole-session snapshots at reusable points
//! (the end of the conversation before the generation prompt, the end of each prompt, the end of
//! each generation) keyed by the exact token sequence that produced them. A new prompt resumes
//! from the longest saved sequence that is a prefix of it: a proper prefix, or the whole prompt
//! when the entry also kept the logits after its last token (then no token is recomputed).
//! Memory is bounded by a byte budget (`Snapshot::nbytes` + logits) with least-recently-used
//! eviction.

use crate::generate::Snapshot;

struct Entry {
    tokens: Vec<u32>,
    snap: Snapshot,
    /// The logits after the last token, when kept.
    logits: Option<Vec<f32>>,
    nbytes: usize,
    last_used: u64,
}

/// A cache hit: the number of prompt tokens covered, the state after them and, for a hit on the
/// whole prompt, the logits after its last token.
pub struct Hit<'a> {
    pub len: usize,
    pub snap: &'a Snapshot,
    pub logits: Option<&'a [f32]>,
}

pub struct PrefixCache {
    entries: Vec<Entry>,
    budget: usize,
    bytes: usize,
    clock: u64,
}

impl PrefixCache {
    /// `budget` bytes of snapshots at most; 0 disables the cache.
    pub fn new(budget: usize) -> PrefixCache {
        PrefixCache { entries: Vec::new(), budget, bytes: 0, clock: 0 }
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The longest saved sequence that is a prefix of `prompt`: a proper prefix (at least one
    /// prompt token is left to compute the next logits from) or, if its logits were kept, the
    /// whole prompt. Marked as recently used.
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<Hit<'_>> {
        self.clock += 1;
        let usable = |e: &Entry| {
            (e.tokens.len() < prompt.len() || (e.tokens.len() == prompt.len() && e.logits.is_some()))
                && prompt.starts_with(&e.tokens)
        };
        let best = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| usable(e))
            .max_by_key(|(_, e)| e.tokens.len())
            .map(|(i, _)| i)?;
        let e = &mut self.entries[best];
        e.last_used = self.clock;
        let logits = if e.tokens.len() == prompt.len() { e.logits.as_deref() } else { None };
        Some(Hit { len: e.tokens.len(), snap: &e.snap, logits })
    }

    /// Whether `tokens` is already saved, with logits if `with_logits` (then `insert` would only
    /// refresh it).
    pub fn contains(&self, tokens: &[u32], with_logits: bool) -> bool {
        self.entries.iter().any(|e| e.tokens == tokens && (e.logits.is_some() || !with_logits))
    }

    /// Saves the state after `tokens` (and optionally the logits after them), evicting least
    /// recently used entries to stay in budget.
    pub fn insert(&mut self, tokens: Vec<u32>, snap: Snapshot, logits: Option<Vec<f32>>) {
        self.clock += 1;
        if let Some(i) = self.entries.iter().position(|e| e.tokens == tokens) {
            if self.entries[i].logits.is_some() || logits.is_none() {
                self.entries[i].last_used = self.clock;
                return;
            }
            let e = self.entries.swap_remove(i); // replaced below by the entry with logits
            self.bytes -= e.nbytes;
        }
        let nbytes = snap.nbytes + logits.as_ref().map_or(0, |l| 4 * l.len());
        if tokens.is_empty() || nbytes > self.budget {
            return;
        }
        while self.bytes + nbytes > self.budget {
            let Some(lru) = self.entries.iter().enumerate().min_by_key(|(_, e)| e.last_used).map(|(i, _)| i) else {
                break;
            };
            let e = self.entries.swap_remove(lru);
            self.bytes -= e.nbytes;
        }
        self.bytes += nbytes;
        self.entries.push(Entry { tokens, snap, logits, nbytes, last_used: self.clock });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(pos: usize, nbytes: usize) -> Snapshot {
        Snapshot { pos, nbytes, data: Box::new(pos) }
    }

    #[test]
    fn longest_proper_prefix_wins() {
        let mut c = PrefixCache::new(1000);
        c.insert(vec![1, 2], snap(2, 10), None);
        c.insert(vec![1, 2, 3, 4], snap(4, 10), None);
        c.insert(vec![9], snap(1, 10), None);
        assert_eq!(c.lookup(&[1, 2, 3, 4, 5]).map(|h| h.len), Some(4));
        // An exact match without logits leaves no token to compute logits from.
        assert_eq!(c.lookup(&[1, 2, 3, 4]).map(|h| h.len), Some(2));
        assert_eq!(c.lookup(&[1, 3]).map(|h| h.len), None);
        // With logits kept, the whole prompt is a hit and the logits come back.
        c.insert(vec![1, 2, 3, 4], snap(4, 10), Some(vec![0.5; 3]));
        let h = c.lookup(&[1, 2, 3, 4]).unwrap();
        assert_eq!((h.len, h.logits), (4, Some(&[0.5f32; 3][..])));
        assert!(c.lookup(&[1, 2, 3, 4, 5]).unwrap().logits.is_none());
        assert_eq!(c.len(), 3);
        assert_eq!(c.bytes(), 42);
    }

    #[test]
    fn evicts_least_recently_used_within_budget() {
        let mut c = PrefixCache::new(25);
        c.insert(vec![1], snap(1, 10), None);
        c.insert(vec![2], snap(1, 10), None);
        assert!(c.lookup(&[1, 0]).is_some()); // [1] is now the most recent
        c.insert(vec![3], snap(1, 10), None);
        assert_eq!(c.len(), 2);
        assert!(c.contains(&[1], false) && c.contains(&[3], false) && !c.contains(&[2], false));
        assert!(c.bytes() <= 25);
        c.insert(vec![4], snap(1, 100), None); // larger than the whole budget: not kept
        assert!(!c.contains(&[4], false));
    }

    #[test]
    fn zero_budget_disables() {
        let mut c = PrefixCache::new(0);
        c.insert(vec![1], snap(1, 1), None);
        assert!(c.is_empty());
    }
}
