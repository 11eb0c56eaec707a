//! Prefix cache for the hybrid model. Full-attention KV could be truncated, but the Gated DeltaNet
//! conv and recurrent state cannot, so the cache keeps whole-session snapshots at reusable points
//! (the end of the conversation before the generation prompt, the end of each prompt, the end of
//! each generation) keyed by the exact token sequence that produced them. A new prompt resumes
//! from the longest saved sequence that is a proper prefix of it. Memory is bounded by a byte
//! budget (`Snapshot::nbytes`) with least-recently-used eviction.

use crate::generate::Snapshot;

struct Entry {
    tokens: Vec<u32>,
    snap: Snapshot,
    last_used: u64,
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

    /// The snapshot of the longest saved sequence that is a proper prefix of `prompt` (at least
    /// one prompt token is left to compute the next logits from), marked as recently used.
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<(usize, &Snapshot)> {
        self.clock += 1;
        let best = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.tokens.len() < prompt.len() && prompt.starts_with(&e.tokens))
            .max_by_key(|(_, e)| e.tokens.len())
            .map(|(i, _)| i)?;
        let e = &mut self.entries[best];
        e.last_used = self.clock;
        Some((e.tokens.len(), &e.snap))
    }

    /// Whether `tokens` is already saved (then `insert` only refreshes it).
    pub fn contains(&self, tokens: &[u32]) -> bool {
        self.entries.iter().any(|e| e.tokens == tokens)
    }

    /// Saves the state after `tokens`, evicting least recently used entries to stay in budget.
    pub fn insert(&mut self, tokens: Vec<u32>, snap: Snapshot) {
        self.clock += 1;
        if let Some(e) = self.entries.iter_mut().find(|e| e.tokens == tokens) {
            e.last_used = self.clock;
            return;
        }
        if tokens.is_empty() || snap.nbytes > self.budget {
            return;
        }
        while self.bytes + snap.nbytes > self.budget {
            let Some(lru) = self.entries.iter().enumerate().min_by_key(|(_, e)| e.last_used).map(|(i, _)| i) else {
                break;
            };
            let e = self.entries.swap_remove(lru);
            self.bytes -= e.snap.nbytes;
        }
        self.bytes += snap.nbytes;
        self.entries.push(Entry { tokens, snap, last_used: self.clock });
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
        c.insert(vec![1, 2], snap(2, 10));
        c.insert(vec![1, 2, 3, 4], snap(4, 10));
        c.insert(vec![9], snap(1, 10));
        assert_eq!(c.lookup(&[1, 2, 3, 4, 5]).map(|(n, _)| n), Some(4));
        // An exact match leaves no token to compute logits from: the shorter prefix is used.
        assert_eq!(c.lookup(&[1, 2, 3, 4]).map(|(n, _)| n), Some(2));
        assert_eq!(c.lookup(&[1, 3]).map(|(n, _)| n), None);
    }

    #[test]
    fn evicts_least_recently_used_within_budget() {
        let mut c = PrefixCache::new(25);
        c.insert(vec![1], snap(1, 10));
        c.insert(vec![2], snap(1, 10));
        assert!(c.lookup(&[1, 0]).is_some()); // [1] is now the most recent
        c.insert(vec![3], snap(1, 10));
        assert_eq!(c.len(), 2);
        assert!(c.contains(&[1]) && c.contains(&[3]) && !c.contains(&[2]));
        assert!(c.bytes() <= 25);
        c.insert(vec![4], snap(1, 100)); // larger than the whole budget: not kept
        assert!(!c.contains(&[4]));
    }

    #[test]
    fn zero_budget_disables() {
        let mut c = PrefixCache::new(0);
        c.insert(vec![1], snap(1, 1));
        assert!(c.is_empty());
    }
}
