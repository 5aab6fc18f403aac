//! Verbs, batches of verbs, and their completions.
//!
//! A [`Batch`] is what one round trip carries: verbs in posting order, plus the payload bytes of
//! its writes. Posting a verb returns a typed handle; after the batch has executed on an
//! [`Endpoint`](crate::Endpoint), the handle reads the verb's result out of the [`Completions`].
//! Both are plain buffers meant to be cleared and reused, so the hot path allocates nothing.

use crate::addr::RemoteAddr;
use crate::error::BatchError;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::time::{Duration, Instant};

/// A batch's expiry in serde's encoding of it: the instant in this process's count of
/// microseconds ([`crate::clock`]), for a peer that is this very process. The tcp fabric's
/// client encodes it in its server's count instead (`tcp::wire::encode_batch_for`), and the
/// server reads it back in its own.
mod expiry_on_the_wire {
    use super::*;
    use crate::clock::{instant_of, PeerClock};

    pub fn serialize<S: Serializer>(expires: &Option<Instant>, s: S) -> Result<S::Ok, S::Error> {
        expires
            .map(|t| PeerClock::SAME_PROCESS.to_peer(t))
            .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Instant>, D::Error> {
        Ok(Option::<u64>::deserialize(d)?.map(instant_of))
    }
}

/// Most verbs one batch may carry.
pub const MAX_BATCH_VERBS: usize = 4096;
/// Most bytes one read or write verb may move.
pub const MAX_IO_BYTES: usize = 16 << 20;
/// Most bytes one batch may move in each direction (write payload; read results).
pub const MAX_BATCH_BYTES: usize = 64 << 20;

/// One one-sided verb. Atomic verbs act on the aligned 8-byte word at `addr` and return the
/// word's old value; their exact semantics are in [`crate::atomic_ops`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Verb {
    /// Read `len` bytes.
    Read {
        /// Where to read.
        addr: RemoteAddr,
        /// How many bytes.
        len: u32,
    },
    /// Write `len` bytes, taken in order from the batch's payload.
    Write {
        /// Where to write.
        addr: RemoteAddr,
        /// How many bytes.
        len: u32,
    },
    /// Compare-and-swap: store `swap` if the word equals `expect`.
    Cas {
        /// The word.
        addr: RemoteAddr,
        /// The value the word must hold.
        expect: u64,
        /// The value to store.
        swap: u64,
    },
    /// Fetch-and-add (wrapping).
    Faa {
        /// The word.
        addr: RemoteAddr,
        /// The addend.
        add: u64,
    },
    /// Masked compare-and-swap: succeeds when `old & cmp_mask == cmp & cmp_mask`, then stores
    /// `(old & !swap_mask) | (swap & swap_mask)`.
    MaskedCas {
        /// The word.
        addr: RemoteAddr,
        /// The bits to compare against.
        cmp: u64,
        /// Which bits are compared.
        cmp_mask: u64,
        /// The bits to store.
        swap: u64,
        /// Which bits are stored.
        swap_mask: u64,
    },
    /// Masked fetch-and-add: `add` is added per field; each set bit of `boundary_mask` is the
    /// most significant bit of a field and no carry crosses it.
    MaskedFaa {
        /// The word.
        addr: RemoteAddr,
        /// The addend, laid out field by field.
        add: u64,
        /// The most significant bit of every field.
        boundary_mask: u64,
    },
    /// Flush: make `len` bytes at `addr` durable in the region's backing store (like the
    /// InfiniBand FLUSH verb for persistent memory): `msync` on a file-backed region, nothing on
    /// plain memory. Moves no data; it runs after the verbs posted before it.
    Flush {
        /// Where the range starts.
        addr: RemoteAddr,
        /// How many bytes.
        len: u64,
    },
}

impl Verb {
    /// The address the verb acts on.
    pub fn addr(&self) -> RemoteAddr {
        match *self {
            Verb::Read { addr, .. }
            | Verb::Write { addr, .. }
            | Verb::Cas { addr, .. }
            | Verb::Faa { addr, .. }
            | Verb::MaskedCas { addr, .. }
            | Verb::Flush { addr, .. }
            | Verb::MaskedFaa { addr, .. } => addr,
        }
    }

    /// The number of bytes of remote memory the verb touches.
    pub fn span(&self) -> u64 {
        match *self {
            Verb::Read { len, .. } | Verb::Write { len, .. } => u64::from(len),
            Verb::Flush { len, .. } => len,
            _ => 8,
        }
    }

    /// Whether the verb is an atomic on one aligned word.
    pub fn is_atomic(&self) -> bool {
        !matches!(
            self,
            Verb::Read { .. } | Verb::Write { .. } | Verb::Flush { .. }
        )
    }
}

/// Handle to the old value returned by an atomic verb.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AtomicHandle(u32);

/// Handle to the bytes returned by a read verb.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadHandle {
    start: u32,
    len: u32,
}

impl ReadHandle {
    /// How many bytes the read returns.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// Whether the read returns no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// How long past an expiring batch's expiry ([`Batch::expire_at`]) an endpoint still waits for
/// its reply: what a verb begun just before the expiry and the reply's way back take on a
/// healthy link. A caller that sets an expiry ahead of a deadline of its own (a lease) leaves
/// at least this much, plus what it must still do before that deadline, between the two.
pub const REPLY_AFTER_EXPIRY: Duration = Duration::from_millis(20);

/// Verbs in posting order, executed in that order as one round trip.
///
/// Invariant: `payload` is exactly the concatenation of the write verbs' data, in order, and the
/// counters below agree with `verbs`. [`Batch::check_shape`] re-establishes this for a batch that
/// arrived from the network.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    /// When the batch expires ([`Batch::expire_at`]): no verb of it executes at or after this
    /// instant. On the wire it travels first (so that the payload stays the frame's tail), as
    /// an instant in the receiver's count of microseconds ([`crate::clock`]).
    #[serde(with = "expiry_on_the_wire")]
    expires: Option<Instant>,
    verbs: Vec<Verb>,
    payload: Vec<u8>,
    #[serde(skip)]
    atomics: u32,
    #[serde(skip)]
    read_bytes: u32,
    /// A *placed* batch ([`Batch::read_to`]): where each read's bytes go in the completions'
    /// data, in posting order of the reads. Empty for a packed batch (reads concatenated).
    /// Client side only: the wire carries the verbs, not where the client wants the bytes.
    #[serde(skip)]
    places: Vec<u32>,
    /// The end of the furthest placed read.
    #[serde(skip)]
    placed_end: u32,
}

impl Batch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Empties the batch, keeping its buffers for reuse.
    pub fn clear(&mut self) {
        self.expires = None;
        self.verbs.clear();
        self.payload.clear();
        self.atomics = 0;
        self.read_bytes = 0;
        self.places.clear();
        self.placed_end = 0;
    }

    /// Sets when the batch expires (None: never): the executor checks the instant before each
    /// verb and stops at the first it reaches at or after it, with [`VerbError::Expired`]
    /// (the verbs before it executed, none after). A lock holder's data verbs carry the
    /// lock's lease deadline this way, so that a batch posted in time but delayed (queued at a
    /// server, its thread descheduled) cannot land after a waiter broke the lock. Over tcp the
    /// instant travels in the server's clock, as surely not later than this one
    /// ([`crate::clock`]), so no delay on the way stretches it. Cleared by [`Batch::clear`].
    ///
    /// An endpoint that waits for a server's reply waits for an expiring batch no longer than
    /// [`REPLY_AFTER_EXPIRY`] past its expiry (or its own batch bound, if that comes first):
    /// no verb of it starts later, so a reply still missing then belongs to a batch that ran
    /// out or a server that does not answer, and the caller — a lock holder — gets control back
    /// while its lease still runs and can release the lock in time. The outcome is then
    /// unknown ([`FabricError::TimedOut`]), as for any batch that timed out.
    ///
    /// [`VerbError::Expired`]: crate::VerbError::Expired
    /// [`FabricError::TimedOut`]: crate::FabricError::TimedOut
    pub fn expire_at(&mut self, expires: Option<Instant>) {
        self.expires = expires;
    }

    /// When the batch expires ([`Batch::expire_at`]).
    pub fn expires(&self) -> Option<Instant> {
        self.expires
    }

    /// The verbs, in posting order.
    pub fn verbs(&self) -> &[Verb] {
        &self.verbs
    }

    /// The write payload: the data of every write verb, concatenated in posting order.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// Number of verbs posted.
    pub fn len(&self) -> usize {
        self.verbs.len()
    }

    /// Whether no verb has been posted.
    pub fn is_empty(&self) -> bool {
        self.verbs.is_empty()
    }

    /// Number of atomic verbs posted (the length of the completions' old values).
    pub fn atomic_count(&self) -> usize {
        self.atomics as usize
    }

    /// Total bytes the batch's reads return.
    pub fn read_bytes(&self) -> usize {
        self.read_bytes as usize
    }

    /// Posts a read of `len` bytes at `addr`.
    ///
    /// # Panics
    /// If `len` exceeds [`MAX_IO_BYTES`]: a programming error, not remote input.
    pub fn read(&mut self, addr: RemoteAddr, len: usize) -> ReadHandle {
        assert!(
            self.places.is_empty(),
            "a packed read posted into a placed batch"
        );
        self.post_read(addr, len)
    }

    /// Posts a read of `len` bytes at `addr` whose bytes land at `data[at..at + len]` of the
    /// completions, where `data` is the slice the caller lent them ([`Completions::lend`]), or
    /// else their own buffer: the fabric writes them straight into the caller's buffer,
    /// with no copy through a result buffer. A batch with such reads is *placed*: all its reads
    /// are posted with this (bytes of the buffer no read covers are left as they were), and
    /// the reads of several placed batches may fill one buffer, each its own part.
    ///
    /// # Panics
    /// If `len` exceeds [`MAX_IO_BYTES`], or a read was posted with [`Batch::read`] before:
    /// programming errors, not remote input.
    pub fn read_to(&mut self, addr: RemoteAddr, len: usize, at: usize) -> ReadHandle {
        assert!(
            self.read_bytes == 0 || !self.places.is_empty(),
            "a placed read posted into a packed batch"
        );
        let end = at
            .checked_add(len)
            .filter(|&e| e <= u32::MAX as usize)
            .expect("a placed read beyond 4 GiB");
        let handle = self.post_read(addr, len);
        self.places.push(at as u32);
        self.placed_end = self.placed_end.max(end as u32);
        ReadHandle {
            start: at as u32,
            len: handle.len,
        }
    }

    /// Whether the batch's reads are placed ([`Batch::read_to`]).
    pub fn is_placed(&self) -> bool {
        !self.places.is_empty()
    }

    /// The bytes the completions' data must have for this batch: the end of the furthest
    /// placed read, or all reads' bytes of a packed batch.
    pub fn data_len(&self) -> usize {
        if self.is_placed() {
            self.placed_end as usize
        } else {
            self.read_bytes as usize
        }
    }

    fn post_read(&mut self, addr: RemoteAddr, len: usize) -> ReadHandle {
        assert!(
            len <= MAX_IO_BYTES,
            "read of {len} bytes exceeds MAX_IO_BYTES"
        );
        let len = len as u32;
        let handle = ReadHandle {
            start: self.read_bytes,
            len,
        };
        self.read_bytes = self.read_bytes.saturating_add(len);
        self.verbs.push(Verb::Read { addr, len });
        handle
    }

    /// Posts a write of `data` at `addr`.
    ///
    /// # Panics
    /// If `data` exceeds [`MAX_IO_BYTES`]: a programming error, not remote input.
    pub fn write(&mut self, addr: RemoteAddr, data: &[u8]) {
        assert!(
            data.len() <= MAX_IO_BYTES,
            "write of {} bytes exceeds MAX_IO_BYTES",
            data.len()
        );
        self.payload.extend_from_slice(data);
        self.verbs.push(Verb::Write {
            addr,
            len: data.len() as u32,
        });
    }

    /// Posts an 8-byte write of `value` at `addr` (a word store; atomic when `addr` is aligned).
    pub fn write_u64(&mut self, addr: RemoteAddr, value: u64) {
        self.write(addr, &value.to_le_bytes());
    }

    /// Posts a compare-and-swap.
    pub fn cas(&mut self, addr: RemoteAddr, expect: u64, swap: u64) -> AtomicHandle {
        self.push_atomic(Verb::Cas { addr, expect, swap })
    }

    /// Posts a fetch-and-add.
    pub fn faa(&mut self, addr: RemoteAddr, add: u64) -> AtomicHandle {
        self.push_atomic(Verb::Faa { addr, add })
    }

    /// Posts a masked compare-and-swap.
    pub fn masked_cas(
        &mut self,
        addr: RemoteAddr,
        cmp: u64,
        cmp_mask: u64,
        swap: u64,
        swap_mask: u64,
    ) -> AtomicHandle {
        self.push_atomic(Verb::MaskedCas {
            addr,
            cmp,
            cmp_mask,
            swap,
            swap_mask,
        })
    }

    /// Posts a masked fetch-and-add.
    pub fn masked_faa(&mut self, addr: RemoteAddr, add: u64, boundary_mask: u64) -> AtomicHandle {
        self.push_atomic(Verb::MaskedFaa {
            addr,
            add,
            boundary_mask,
        })
    }

    /// Posts a flush of `len` bytes at `addr` (see [`Verb::Flush`]).
    pub fn flush(&mut self, addr: RemoteAddr, len: u64) {
        self.verbs.push(Verb::Flush { addr, len });
    }

    /// Posts an already-built verb. A write's data must be supplied with it.
    ///
    /// Returns the atomic handle for atomic verbs.
    pub fn push(&mut self, verb: Verb, write_data: &[u8]) -> Option<AtomicHandle> {
        match verb {
            Verb::Read { addr, len } => {
                self.read(addr, len as usize);
                None
            }
            Verb::Write { addr, .. } => {
                self.write(addr, write_data);
                None
            }
            Verb::Flush { addr, len } => {
                self.flush(addr, len);
                None
            }
            atomic => Some(self.push_atomic(atomic)),
        }
    }

    /// Posts every verb of `other` after this batch's, in `other`'s order, with their payload.
    ///
    /// Handles `other`'s poster holds stay valid for the results of `other`'s verbs alone: the
    /// executed batch's completions, split with [`Completions::take_tail`] (or
    /// [`Completions::take_front`] when `other` went first), hold exactly those. This is how a
    /// lock scheme carries a caller's verbs in its own batches (`lockmgr`'s `acquire_with`).
    ///
    /// # Panics
    /// If either batch is placed ([`Batch::read_to`]): their reads' places would clash.
    pub fn append(&mut self, other: &Batch) {
        assert!(
            !self.is_placed() && !other.is_placed(),
            "placed batches cannot be joined"
        );
        self.verbs.extend_from_slice(&other.verbs);
        self.payload.extend_from_slice(&other.payload);
        self.atomics += other.atomics;
        self.read_bytes = self.read_bytes.saturating_add(other.read_bytes);
    }

    fn push_atomic(&mut self, verb: Verb) -> AtomicHandle {
        let handle = AtomicHandle(self.atomics);
        self.atomics += 1;
        self.verbs.push(verb);
        handle
    }

    /// Checks the invariants of a batch built elsewhere (decoded from the network) and recomputes
    /// its counters: verb count and sizes within limits, payload length equal to the writes'.
    pub fn check_shape(&mut self) -> Result<(), BatchError> {
        if self.verbs.len() > MAX_BATCH_VERBS {
            return Err(BatchError::TooManyVerbs {
                count: self.verbs.len(),
                max: MAX_BATCH_VERBS,
            });
        }
        let (mut atomics, mut reads, mut writes) = (0u64, 0u64, 0u64);
        for (index, verb) in self.verbs.iter().enumerate() {
            match *verb {
                Verb::Read { len, .. } | Verb::Write { len, .. } if len as usize > MAX_IO_BYTES => {
                    return Err(BatchError::VerbTooLarge {
                        index,
                        len: len as usize,
                        max: MAX_IO_BYTES,
                    });
                }
                Verb::Read { len, .. } => reads += u64::from(len),
                Verb::Write { len, .. } => writes += u64::from(len),
                Verb::Flush { .. } => {}
                _ => atomics += 1,
            }
        }
        if reads > MAX_BATCH_BYTES as u64 || writes > MAX_BATCH_BYTES as u64 {
            return Err(BatchError::BatchTooLarge {
                bytes: reads.max(writes),
                max: MAX_BATCH_BYTES,
            });
        }
        if writes != self.payload.len() as u64 {
            return Err(BatchError::PayloadMismatch {
                declared: writes,
                actual: self.payload.len() as u64,
            });
        }
        self.atomics = atomics as u32;
        self.read_bytes = reads as u32;
        self.places.clear();
        self.placed_end = 0;
        Ok(())
    }
}

/// The results of one executed batch: the old value of every atomic verb, and the bytes of every
/// read, each in posting order.
///
/// The bytes of placed reads ([`Batch::read_to`]) land in the completions' own buffer, or in a
/// caller's slice lent for the length of one call ([`Completions::lend`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Completions {
    olds: Vec<u64>,
    data: Vec<u8>,
    /// For a placed batch: how many of its reads executors have filled so far.
    #[serde(skip)]
    next_read: usize,
    /// The caller's buffer during [`Completions::lend`]: it stands in for `data`.
    #[serde(skip)]
    loan: Loan,
}

/// A caller's slice lent to [`Completions`] (pointer and length), set only inside
/// [`Completions::lend`], which holds the slice's mutable borrow for as long.
///
/// Invariant: `Some` only while that call runs; it is cleared on the way out, also by unwinding.
/// A copy of the completions never carries the loan (`Clone` gives `None`), and two
/// completions compare equal whatever their loans.
#[derive(Default)]
struct Loan(Option<(std::ptr::NonNull<u8>, usize)>);

impl Clone for Loan {
    fn clone(&self) -> Self {
        Loan(None)
    }
}

impl PartialEq for Loan {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for Loan {}

impl std::fmt::Debug for Loan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some((_, len)) => write!(f, "lent {len} bytes"),
            None => f.write_str("none"),
        }
    }
}

// SAFETY: the pointer is dereferenced only through the completions during `lend`, which holds
// the lent slice's exclusive borrow; through `&Completions` only for reading, as a `&[u8]`
// would be shared.
unsafe impl Send for Loan {}
// SAFETY: as for `Send`.
unsafe impl Sync for Loan {}

impl Completions {
    /// Empty completions, to be filled by an endpoint.
    pub fn new() -> Self {
        Self::default()
    }

    /// The old value of the word an atomic verb acted on.
    pub fn old(&self, handle: AtomicHandle) -> u64 {
        self.olds[handle.0 as usize]
    }

    /// The bytes a read verb returned.
    pub fn bytes(&self, handle: ReadHandle) -> &[u8] {
        &self.buf()[handle.start as usize..(handle.start + handle.len) as usize]
    }

    /// Where read bytes are: the lent slice during [`Completions::lend`], else the
    /// completions' own buffer.
    fn buf(&self) -> &[u8] {
        match self.loan.0 {
            // SAFETY: `Loan`'s invariant: the slice is alive and borrowed for this loan.
            Some((ptr, len)) => unsafe { std::slice::from_raw_parts(ptr.as_ptr(), len) },
            None => &self.data,
        }
    }

    /// [`Completions::buf`], to fill.
    fn buf_mut(&mut self) -> &mut [u8] {
        match self.loan.0 {
            // SAFETY: `Loan`'s invariant, and `&mut self` makes this the only view of it.
            Some((ptr, len)) => unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), len) },
            None => &mut self.data,
        }
    }

    /// The `i`-th little-endian word of a read's bytes.
    pub fn word(&self, handle: ReadHandle, i: usize) -> u64 {
        let b = self.bytes(handle);
        u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"))
    }

    /// All old values, in posting order of the atomic verbs.
    pub fn olds(&self) -> &[u64] {
        &self.olds
    }

    /// All read bytes, concatenated in posting order of the read verbs (the lent slice, during
    /// [`Completions::lend`]).
    pub fn data(&self) -> &[u8] {
        self.buf()
    }

    /// Empties the completions and sizes them for `batch`; executors then fill them in order
    /// ([`Completions::push_old`], [`Completions::next_read`]). For a placed batch the data
    /// buffer is kept (during [`Completions::lend`] it is the caller's) and, when it is the
    /// completions' own, only extended with zeros when shorter than the batch's places need.
    ///
    /// # Panics
    /// During [`Completions::lend`], for a packed batch or a placed one whose places do not
    /// fit the lent slice (programming errors: a lent slice cannot grow).
    pub fn reset_for(&mut self, batch: &Batch) {
        self.olds.clear();
        self.olds.reserve(batch.atomic_count());
        self.next_read = 0;
        if let Some((_, len)) = self.loan.0 {
            assert!(
                batch.is_placed() && batch.data_len() <= len,
                "a batch whose reads need {} bytes executed into a lent slice of {len}",
                batch.data_len()
            );
        } else if batch.is_placed() {
            if self.data.len() < batch.data_len() {
                self.data.resize(batch.data_len(), 0);
            }
        } else {
            self.data.clear();
            self.data.reserve(batch.read_bytes());
        }
    }

    /// Runs `f` with `buf` lent to these completions: the placed reads ([`Batch::read_to`])
    /// of the batches executed (posted and completed) inside `f` land in `buf` at their
    /// places, with no copy, and [`Completions::data`] and [`Completions::bytes`] read it.
    /// Inside `f` only placed batches whose places fit `buf` may be executed
    /// ([`Completions::reset_for`]). The loan ends when `f` returns (or unwinds); a batch
    /// posted inside and completed after it has nowhere to put its reads.
    ///
    /// This is how a caller reads into its own memory with no copy: a `Vec` of its own, or
    /// memory it cannot give away as one (the FUSE adapter: the kernel's answer buffer).
    /// Completions are encoded for the wire only by servers, which lend nothing:
    /// serde sees the completions' own buffer, not a loan.
    ///
    /// # Panics
    /// If the completions already hold a loan.
    ///
    /// # Aborts
    /// If `f` moved the loan out of these completions (`mem::take` or `mem::swap` of them):
    /// the completions it went to would outlive the slice it points into, and nothing may read
    /// them then (a panic would still let them be read, by a `catch_unwind`'s caller).
    pub fn lend<R>(&mut self, buf: &mut [u8], f: impl FnOnce(&mut Completions) -> R) -> R {
        /// Ends the loan when dropped, on return or unwinding.
        struct EndLoan<'c> {
            out: &'c mut Completions,
            lent: (std::ptr::NonNull<u8>, usize),
        }
        impl Drop for EndLoan<'_> {
            fn drop(&mut self) {
                // Loans are unique (`Clone` gives none), so ours still here is ours nowhere
                // else.
                if self.out.loan.0 != Some(self.lent) {
                    eprintln!("fabric: a loan of Completions::lend was moved out of its call");
                    std::process::abort();
                }
                self.out.loan = Loan(None);
            }
        }
        assert!(self.loan.0.is_none(), "completions lent a second slice");
        let len = buf.len();
        let lent = (std::ptr::NonNull::from(buf).cast(), len);
        self.loan = Loan(Some(lent));
        let end = EndLoan { out: self, lent };
        f(end.out)
    }

    /// The bytes where the next read verb of `batch`, of `len` bytes, puts its result, to be
    /// filled (executors only): its place in a placed batch, else `len` zero bytes appended.
    pub fn next_read(&mut self, batch: &Batch, len: usize) -> &mut [u8] {
        if !batch.is_placed() {
            return self.push_read(len);
        }
        let at = batch.places[self.next_read] as usize;
        self.next_read += 1;
        &mut self.buf_mut()[at..at + len]
    }

    /// Fills the reads of `batch` from `data`, every read's bytes concatenated in posting
    /// order (a reply off the wire; executors only). `data` must be `batch.read_bytes()` long.
    pub fn fill_reads(&mut self, batch: &Batch, data: &[u8]) {
        if !batch.is_placed() {
            self.push_read(data.len()).copy_from_slice(data);
            return;
        }
        let mut rest = data;
        for verb in batch.verbs() {
            if let Verb::Read { len, .. } = *verb {
                let (bytes, after) = rest.split_at(len as usize);
                self.next_read(batch, bytes.len()).copy_from_slice(bytes);
                rest = after;
            }
        }
    }

    /// Appends the old value of the next atomic verb (executors only).
    pub fn push_old(&mut self, old: u64) {
        self.olds.push(old);
    }

    /// Appends `len` zero bytes for the next read verb and returns them to be filled
    /// (executors only).
    ///
    /// # Panics
    /// During [`Completions::lend`] (a packed batch's reads have no place in a lent slice;
    /// [`Completions::reset_for`] refuses such a batch first).
    pub fn push_read(&mut self, len: usize) -> &mut [u8] {
        assert!(self.loan.0.is_none(), "a packed read into a lent slice");
        let start = self.data.len();
        self.data.resize(start + len, 0);
        &mut self.data[start..]
    }

    /// Moves the results after the first `olds` old values and `bytes` read bytes into `into`
    /// (replacing what it held), leaving the first ones here: after executing `a` followed by
    /// [`Batch::append`]ed `b`, `take_tail(a.atomic_count(), a.read_bytes(), into)` leaves `a`'s
    /// results here and puts `b`'s into `into`, where `b`'s handles read them.
    ///
    /// # Panics
    /// If these completions hold fewer results than that (a programming error).
    pub fn take_tail(&mut self, olds: usize, bytes: usize, into: &mut Completions) {
        into.olds.clear();
        into.olds.extend_from_slice(&self.olds[olds..]);
        self.olds.truncate(olds);
        into.data.clear();
        into.data.extend_from_slice(&self.data[bytes..]);
        self.data.truncate(bytes);
    }

    /// Moves the first `olds` old values and `bytes` read bytes into `into` (replacing what it
    /// held) and keeps the rest here, from the start: after executing `a` followed by
    /// [`Batch::append`]ed `b`, `take_front(a.atomic_count(), a.read_bytes(), into)` puts `a`'s
    /// results into `into` and leaves `b`'s here, where `b`'s handles read them.
    ///
    /// # Panics
    /// If these completions hold fewer results than that (a programming error).
    pub fn take_front(&mut self, olds: usize, bytes: usize, into: &mut Completions) {
        into.olds.clear();
        into.olds.extend(self.olds.drain(..olds));
        into.data.clear();
        into.data.extend(self.data.drain(..bytes));
    }

    /// Checks that these completions (decoded from the network) answer `batch`.
    pub fn matches(&self, batch: &Batch) -> bool {
        self.olds.len() == batch.atomic_count()
            && if batch.is_placed() {
                self.next_read == batch.places.len() && self.buf().len() >= batch.data_len()
            } else {
                self.data.len() == batch.read_bytes()
            }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A packed batch's reads need a buffer that grows: refused during a loan.
    #[test]
    #[should_panic(expected = "executed into a lent slice")]
    fn a_packed_batch_cannot_read_into_a_loan() {
        let mut packed = Batch::new();
        packed.read(RemoteAddr::new(crate::RegionId(1), 0), 8);
        let mut buf = [0u8; 64];
        Completions::new().lend(&mut buf, |out| out.reset_for(&packed));
    }

    /// A placed batch whose places reach past the lent slice is refused, not written past it.
    #[test]
    #[should_panic(expected = "executed into a lent slice of 16")]
    fn a_loan_too_short_for_the_places_is_refused() {
        let mut placed = Batch::new();
        placed.read_to(RemoteAddr::new(crate::RegionId(1), 0), 8, 12);
        let mut buf = [0u8; 16];
        Completions::new().lend(&mut buf, |out| out.reset_for(&placed));
    }

    /// A loan moved out of its completions inside the call (`mem::take`) would outlive the
    /// slice it points into: the process aborts before anything can read it. (Before, the
    /// taken completions came back from the call still reading the dead slice.)
    #[test]
    fn a_loan_moved_out_of_its_completions_aborts() {
        use std::os::unix::process::ExitStatusExt;
        const CHILD: &str = "CITRONFS_TEST_LOAN_MOVED_OUT";
        if std::env::var_os(CHILD).is_some() {
            let mut buf = [5u8; 8];
            let taken = Completions::new().lend(&mut buf, std::mem::take);
            println!("survived, the taken completions reading {:?}", taken.data());
            return;
        }
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "batch::tests::a_loan_moved_out_of_its_completions_aborts",
                "--nocapture",
            ])
            .env(CHILD, "1")
            .output()
            .unwrap();
        assert_eq!(
            child.status.signal(),
            Some(libc::SIGABRT),
            "{:?}: {}",
            child.status,
            String::from_utf8_lossy(&child.stdout)
        );
    }

    /// The loan ends with its call, also when the call unwinds: the completions read their own
    /// buffer again and can be lent again.
    #[test]
    fn a_loan_ends_when_its_call_unwinds() {
        let mut out = Completions::new();
        let mut buf = [7u8; 32];
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            out.lend(&mut buf, |out| {
                assert_eq!(out.data(), &[7u8; 32]);
                panic!("in the loan")
            })
        }));
        assert!(unwound.is_err());
        assert!(out.data().is_empty(), "the loan outlived its call");
        let mut other = [1u8; 4];
        assert_eq!(out.lend(&mut other, |out| out.data().len()), 4);
        // A copy never carries a loan.
        let copied = out.lend(&mut other, |out| out.clone());
        assert!(copied.data().is_empty());
    }
}
