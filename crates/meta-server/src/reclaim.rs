//! The reclaimer: chunks freed by unlink, truncate, release or fsck are zeroed and returned to
//! their servers' free stacks by a background thread, so that no request waits for a database
//! flush or for the zeroing.
//!
//! # Invariant: zero only after the free is durable
//! Zeroing is a data effect no crash can undo; a free that a crash rolls back (sled flushes in
//! the background) brings back a file that maps the chunk, which must still hold its data. So a
//! batch is zeroed only after one database flush that began after every free in it committed
//! (they are queued after their transaction returns): [`reclaim_batch`] flushes first and zeroes
//! nothing when the flush fails — the chunks stay in the `dirty` set, where a later free, a
//! registration of their server or a restart picks them up. One flush covers a whole batch, so
//! an unlink storm costs a flush per batch, not per unlink.

use crate::store::Block;
use proto::FsError;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// The queue of freed chunks between the requests that free them and the reclaimer thread.
#[derive(Default)]
pub(crate) struct Reclaimer {
    queue: Mutex<Queue>,
    /// Signalled when chunks are queued or the reclaimer is stopped.
    wake: Condvar,
    /// Signalled when a batch is done.
    idle: Condvar,
}

#[derive(Default)]
struct Queue {
    chunks: Vec<Block>,
    /// A batch is being reclaimed.
    busy: bool,
    stopping: bool,
}

impl Reclaimer {
    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues freed chunks (their free has committed).
    pub(crate) fn push(&self, chunks: Vec<Block>) {
        if chunks.is_empty() {
            return;
        }
        self.queue().chunks.extend(chunks);
        self.wake.notify_one();
    }

    /// The next batch: everything queued, waiting for some. `None` once stopped and empty.
    pub(crate) fn next_batch(&self) -> Option<Vec<Block>> {
        let mut q = self.queue();
        loop {
            if !q.chunks.is_empty() {
                q.busy = true;
                return Some(std::mem::take(&mut q.chunks));
            }
            if q.stopping {
                return None;
            }
            q = self.wake.wait(q).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// The batch [`Reclaimer::next_batch`] gave is done.
    pub(crate) fn done(&self) {
        self.queue().busy = false;
        self.idle.notify_all();
    }

    /// Waits until nothing is queued or being reclaimed, at most `timeout`; whether it is so.
    pub(crate) fn wait_idle(&self, timeout: Duration) -> bool {
        let q = self.queue();
        let (q, _) = self
            .idle
            .wait_timeout_while(q, timeout, |q| q.busy || !q.chunks.is_empty())
            .unwrap_or_else(PoisonError::into_inner);
        !q.busy && q.chunks.is_empty()
    }

    /// Lets the thread finish what is queued and end.
    pub(crate) fn stop(&self) {
        self.queue().stopping = true;
        self.wake.notify_all();
    }
}

/// Reclaims one batch: `flush` makes every committed free durable, then `zero_and_recycle`
/// runs for each chunk (it zeroes the chunk and moves it from the dirty set to the free stack;
/// a chunk it fails on stays dirty). Nothing is zeroed when the flush fails (see the module
/// docs). Returns how many chunks were recycled.
pub(crate) fn reclaim_batch(
    batch: &[Block],
    flush: impl FnOnce() -> Result<(), FsError>,
    mut zero_and_recycle: impl FnMut(Block) -> Result<(), FsError>,
) -> usize {
    if batch.is_empty() {
        return 0;
    }
    if let Err(error) = flush() {
        tracing::warn!(
            %error,
            chunks = batch.len(),
            "cannot make frees durable: their chunks stay dirty for now"
        );
        return 0;
    }
    let mut recycled = 0;
    for &block in batch {
        match zero_and_recycle(block) {
            Ok(()) => recycled += 1,
            Err(error) => tracing::debug!(loc = ?block.loc, %error, "chunk stays dirty for now"),
        }
    }
    recycled
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    fn loc(index: u64) -> Block {
        Block {
            loc: proto::ChunkLoc { server: 0, index },
            order: 0,
        }
    }

    #[test]
    fn a_failed_flush_zeroes_nothing() {
        let zeroed = RefCell::new(Vec::new());
        let n = reclaim_batch(
            &[loc(1), loc(2)],
            || Err(FsError::Io("disk gone".into())),
            |l| {
                zeroed.borrow_mut().push(l);
                Ok(())
            },
        );
        assert_eq!(n, 0);
        assert!(zeroed.borrow().is_empty());
    }

    #[test]
    fn one_flush_per_batch_before_any_zeroing() {
        let events = RefCell::new(Vec::new());
        let n = reclaim_batch(
            &[loc(1), loc(2), loc(3)],
            || {
                events.borrow_mut().push("flush".to_string());
                Ok(())
            },
            |l| {
                events.borrow_mut().push(format!("zero {}", l.loc.index));
                if l.loc.index == 2 {
                    Err(FsError::Io("server away".into()))
                } else {
                    Ok(())
                }
            },
        );
        assert_eq!(n, 2);
        assert_eq!(
            *events.borrow(),
            ["flush", "zero 1", "zero 2", "zero 3"].map(String::from)
        );
    }

    #[test]
    fn the_queue_hands_out_batches_and_drains_before_stopping() {
        let r = Reclaimer::default();
        r.push(vec![loc(1)]);
        r.push(vec![loc(2), loc(3)]);
        r.push(Vec::new());
        assert_eq!(r.next_batch(), Some(vec![loc(1), loc(2), loc(3)]));
        assert!(!r.wait_idle(Duration::from_millis(10)), "busy until done");
        r.done();
        assert!(r.wait_idle(Duration::from_millis(10)));
        r.push(vec![loc(4)]);
        r.stop();
        assert_eq!(r.next_batch(), Some(vec![loc(4)]));
        r.done();
        assert_eq!(r.next_batch(), None);
    }
}
