//! The allreduce as a chain through a ring of half slots, for hosts whose ranks outnumber their
//! cores: no barrier, each rank waits only for the one step it needs next.

use super::*;

impl LocalGroup {
    /// [`Self::reduce`] as a chain through a ring of `2n` half slots: for each piece, local rank
    /// 0 copies its values into the piece's place in the ring, rank 1 adds its own, and so on;
    /// the last rank's addition is the sum, which it keeps and every other rank copies out.
    /// Rank 0 reuses a place once every rank is finished with the piece it held.
    ///
    /// No barrier: each rank waits only for the one step it needs next (its predecessor's
    /// addition, the last rank's, or a free place) and meanwhile does whatever else is ready,
    /// so a rank that holds a core goes through every piece it can before it sleeps. Each rank
    /// reads its buffer once and writes it once, as in the barrier path; every value is summed
    /// in rank order, `((x0 + x1) + x2) + ...`, by one chain, so every rank ends with identical
    /// values.
    pub(super) fn reduce_chain(
        &self,
        buf: &mut [f32],
        everyone: bool,
        watch: &mut Watch,
        deadline: Instant,
    ) -> Result<()> {
        let (me, last) = (self.me, self.members.len() - 1);
        let (_, piece_len) = self.seg.slot(0, 0);
        let count = buf.len().div_ceil(piece_len) as u64;
        let mut pos = ChainPos {
            // The pieces of earlier calls, the same on every member (they agreed on the length).
            base: self.chained.fetch_add(count, Ordering::Relaxed),
            count,
            added: 0,
            done: 0,
            piece_len,
            total: buf.len(),
            // Ranks that need only their own addition: the last (its addition is the sum)
            // and, when only the leader needs the sum, every rank but the leader.
            done_at_add: me == last || !(everyone || me == 0),
        };
        let header = self.seg.header();
        let started = Instant::now();
        let mut idle_since = Instant::now();
        let mut last_check = Instant::now();
        let mut spins = 0u32;
        while pos.done < pos.count {
            let seen = header.chain_word.load(Ordering::SeqCst);
            let added = self.chain_add(&mut pos, buf);
            let copied = self.chain_copy_out(&mut pos, buf);
            if pos.done >= pos.count {
                break;
            }
            if added || copied {
                idle_since = Instant::now();
                spins = 0;
                continue;
            }
            // Nothing ready: spin briefly (yielding the core when the ranks outnumber the
            // cores), then sleep on the chain word. Sleeping at once instead was 1.5-2x slower
            // with 4 ranks on 2 cores: a futex wake costs more than a yield.
            if self.spin(&mut spins, idle_since) {
                continue;
            }
            let awaited = self.chain_awaited(&pos);
            if last_check.elapsed() >= Duration::from_millis(100) {
                last_check = Instant::now();
                // The awaited rank first: of several gone, it is the likelier cause.
                self.check_alive(awaited, watch, "allreduce")?;
                for k in (0..=last).filter(|&k| k != me && k != awaited) {
                    self.check_alive(k, watch, "allreduce")?;
                }
            }
            if Instant::now() >= deadline {
                self.give_up_on(awaited);
                return Err(DistError::Timeout {
                    op: "shared-memory allreduce".into(),
                    rank: self.members[awaited],
                    after: started.elapsed(),
                });
            }
            header.chain_sleepers.fetch_add(1, Ordering::SeqCst);
            futex_wait(&header.chain_word, seen, Duration::from_millis(20));
            header.chain_sleepers.fetch_sub(1, Ordering::SeqCst);
        }
        Ok(())
    }

    /// The place of chain piece `g` in the ring of `2n` half slots.
    fn chain_place(&self, g: u64, piece_len: usize) -> *mut f32 {
        let k = (g % (2 * self.members.len() as u64)) as usize;
        // SAFETY: piece k of the slots, which lie back to back.
        unsafe { self.seg.slot(0, 0).0.add(k * piece_len) }
    }

    /// Adds this rank's values to every piece whose turn it is (rank 0: copies them into a
    /// free place); `true` if it added any.
    fn chain_add(&self, pos: &mut ChainPos, buf: &mut [f32]) -> bool {
        let n = self.members.len();
        let (me, last) = (self.me, n - 1);
        let places = 2 * n as u64;
        let entry = |k: usize| self.seg.entry(k);
        let mut stepped = false;
        while pos.added < pos.count {
            let g = pos.base + pos.added;
            let ready = if me == 0 {
                g < places
                    || (0..n).all(|k| entry(k).chain_done.load(Ordering::Acquire) > g - places)
            } else {
                entry(me - 1).chain_added.load(Ordering::Acquire) > g
            };
            if !ready {
                break;
            }
            let piece = &mut buf[pos.range(pos.added)];
            let len = piece.len();
            // SAFETY: the place holds `piece_len >= len` values. Rank 0 writes it only once
            // every rank is finished with its previous piece; rank k > 0 only after rank
            // k - 1's addition, so one rank at a time writes it; readers copy it out only
            // after the last addition and before they mark the piece done.
            let acc =
                unsafe { std::slice::from_raw_parts_mut(self.chain_place(g, pos.piece_len), len) };
            if me == 0 {
                acc.copy_from_slice(piece);
            } else if me == last {
                for (a, m) in acc.iter_mut().zip(piece.iter_mut()) {
                    let sum = *a + *m;
                    *a = sum;
                    *m = sum;
                }
            } else {
                add(acc, piece);
            }
            pos.added += 1;
            entry(me)
                .chain_added
                .store(pos.base + pos.added, Ordering::Release);
            if pos.done_at_add {
                pos.done = pos.added;
                entry(me)
                    .chain_done
                    .store(pos.base + pos.done, Ordering::Release);
            }
            self.chain_signal();
            stepped = true;
        }
        stepped
    }

    /// Copies out every piece this rank added that the last rank has summed; `true` if any.
    fn chain_copy_out(&self, pos: &mut ChainPos, buf: &mut [f32]) -> bool {
        let last = self.members.len() - 1;
        let mut stepped = false;
        while pos.done < pos.added {
            let g = pos.base + pos.done;
            if self.seg.entry(last).chain_added.load(Ordering::Acquire) <= g {
                break;
            }
            let piece = &mut buf[pos.range(pos.done)];
            // SAFETY: the last rank has added this piece: its place holds the sum, and rank 0
            // overwrites it only after this rank marks the piece done below.
            let sum = unsafe {
                std::slice::from_raw_parts(self.chain_place(g, pos.piece_len), piece.len())
            };
            piece.copy_from_slice(sum);
            pos.done += 1;
            let mark = pos.base + pos.done;
            self.seg
                .entry(self.me)
                .chain_done
                .store(mark, Ordering::Release);
            self.chain_signal();
            stepped = true;
        }
        stepped
    }

    /// The rank a waiting chain member waits for: its predecessor, the last rank, or the
    /// slowest.
    fn chain_awaited(&self, pos: &ChainPos) -> usize {
        let (me, last) = (self.me, self.members.len() - 1);
        if pos.added < pos.count && me > 0 {
            me - 1
        } else if pos.done < pos.added {
            last
        } else {
            (0..=last)
                .filter(|&k| k != me)
                .min_by_key(|&k| self.seg.entry(k).chain_done.load(Ordering::Acquire))
                .unwrap_or(last)
        }
    }

    /// Announces a chain step: bumps the word and wakes its sleepers, if any (the word is
    /// bumped before the count is read, and a sleeper counts itself before it reads the word,
    /// so a step never goes unnoticed).
    fn chain_signal(&self) {
        let header = self.seg.header();
        header.chain_word.fetch_add(1, Ordering::SeqCst);
        if header.chain_sleepers.load(Ordering::SeqCst) > 0 {
            futex_wake(&header.chain_word);
        }
    }
}

/// Where this rank is in one chained reduction: pieces `base..base + count` of the chain (its
/// buffer's, `piece_len` values each), how many it has added to and how many it is done with.
struct ChainPos {
    base: u64,
    count: u64,
    added: u64,
    done: u64,
    piece_len: usize,
    /// The buffer's length.
    total: usize,
    /// Done with a piece once it has added to it (it needs no sum copied back).
    done_at_add: bool,
}

impl ChainPos {
    /// The values of the buffer piece `i` covers.
    fn range(&self, i: u64) -> std::ops::Range<usize> {
        let a = i as usize * self.piece_len;
        a..(a + self.piece_len).min(self.total)
    }
}
