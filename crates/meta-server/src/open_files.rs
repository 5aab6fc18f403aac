//! Open files: each open file's control block (FCB) and lock in the meta region, which
//! sessions have it open, and the lock requests about it that came as RPCs.

use crate::meta_region::{meta_addr, CreatedLock, MetaRegion, RegionSpan};
use crate::status::OpenFacts;
use crate::sync::lock;
use fabric::EndpointExt;
use lockmgr::schemes::{CreateOptions, LockDefaults, LockServer, LockServerAt};
use lockmgr::{LockError, LockRef, LockScheme};
use proto::{fcb, Attr, FsError, Ino, OpenFile, SetAttr};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A lock tree covers at least this many bytes of a file when it is created (it scales up).
const MIN_LOCK_COVER: u64 = 1 << 20;

/// What the meta server decides for the locks of the files it opens.
pub(crate) struct LockPolicy {
    /// Bytes of a file one lock unit covers.
    pub lock_unit: u64,
    /// `T_lease` of the CITRON lock of every file.
    pub lock_lease: Duration,
    /// `T_wait` for CITRON trees.
    pub t_wait: Duration,
    /// Clients keep `2·fence_after` of every lease as a guard before posting data verbs.
    pub fence_after: Duration,
    /// The lock server for schemes that keep their locks at a lock service, if it runs.
    pub lock_server: Option<Arc<LockServer>>,
}

impl LockPolicy {
    /// The lock server's address, for the cluster's description.
    pub fn lock_server_addr(&self) -> Option<String> {
        self.lock_server.as_ref().map(|s| s.addr().to_string())
    }

    /// Refuses a scheme this server cannot make: one at a lock service without a lock server.
    pub fn check_available(&self, scheme: &LockScheme) -> Result<(), FsError> {
        if scheme.uses_service() && self.lock_server.is_none() {
            return Err(FsError::NotSupported);
        }
        Ok(())
    }

    /// What the meta server decides for a file's lock where the opener's description leaves
    /// it open (each scheme takes what it uses, [`CreateOptions::from_defaults`]): covering the
    /// file (at least [`MIN_LOCK_COVER`]), growing from memory this server hands out
    /// (`AllocateLockWords`), with the cluster's lock lease and wait; a scheme that keeps its
    /// locks at a lock service on this server's lock server.
    fn options(&self, size: u64) -> CreateOptions {
        CreateOptions::from_defaults(&LockDefaults {
            units: size.max(MIN_LOCK_COVER).div_ceil(self.lock_unit),
            lease: self.lock_lease,
            wait: self.t_wait,
            allocates_growth: true,
            lock_server: self.lock_server.as_ref().map(|server| LockServerAt {
                addr: server.addr(),
                credentials: server.credentials().clone(),
            }),
        })
    }

    /// Creates the lock of `scheme` for a file of `size` bytes in `region`.
    fn create(
        &self,
        region: &mut MetaRegion,
        scheme: &LockScheme,
        size: u64,
    ) -> Result<CreatedLock, FsError> {
        // Clients keep 2 × fence_after of every lease as a guard before posting data verbs
        // (`MetaConfig::validate` holds our own lease to the same bound).
        if scheme
            .lease()
            .is_some_and(|lease| lease <= 4 * self.fence_after)
        {
            return Err(FsError::Invalid(format!(
                "lock scheme {scheme}: the lease must exceed 4 × fence_after ({:?})",
                self.fence_after
            )));
        }
        region
            .create_lock(scheme, &self.options(size))
            .map_err(|e| match e {
                LockError::NoSpace { .. } => FsError::NoSpace,
                LockError::Fabric(e) => FsError::Io(format!("cannot create {scheme} lock: {e}")),
                e => FsError::Invalid(format!("lock scheme {scheme}: {e}")),
            })
    }
}

struct OpenState {
    /// The FCB's offset in the meta region.
    fcb: u64,
    /// The file's lock, made by its first open.
    lock: LockRef,
    /// Bytes of the region the lock holds from `lock.base` (0: none).
    lock_bytes: u64,
    /// Memory handed out for CITRON scale-ups.
    extra: Vec<RegionSpan>,
    /// Sessions that have it open.
    sessions: HashSet<u64>,
}

/// The open files, kept under the service's state lock.
///
/// Invariants: an open file has exactly one FCB and one lock in the meta region, made by its
/// first open and freed (FCB's INO word cleared first) when its last session lets go; every
/// open of the file, by every session, is under this lock's scheme name
/// ([`OpenFiles::check_scheme`] refuses another while it is open), so that every read and
/// write of the file takes this lock: locks of two schemes would not exclude each other. By
/// name rather than by the requested description: an opener asking other parameters of the
/// same scheme gets this lock, as created.
pub(crate) struct OpenFiles {
    files: HashMap<Ino, OpenState>,
    policy: LockPolicy,
}

/// Whom a release left a file open to ([`OpenFiles::leave`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Left {
    /// The session did not have it open.
    NotOpen,
    /// Other sessions still have it open.
    Others,
    /// Nobody: the caller persists what the FCB holds, then closes it ([`OpenFiles::close`]).
    Nobody,
}

impl OpenFiles {
    /// No file open; locks made by `policy`.
    pub fn new(policy: LockPolicy) -> OpenFiles {
        OpenFiles {
            files: HashMap::new(),
            policy,
        }
    }

    /// How locks are made.
    pub fn policy(&self) -> &LockPolicy {
        &self.policy
    }

    /// Whether `ino` is open.
    pub fn is_open(&self, ino: Ino) -> bool {
        self.files.contains_key(&ino)
    }

    /// The offset of open file `ino`'s FCB.
    pub fn fcb_of(&self, ino: Ino) -> Option<u64> {
        self.files.get(&ino).map(|o| o.fcb)
    }

    /// The open files.
    pub fn inos(&self) -> Vec<Ino> {
        self.files.keys().copied().collect()
    }

    /// How many files are open.
    pub fn len(&self) -> usize {
        self.files.len()
    }

    /// The sessions that have `ino` open.
    #[cfg(feature = "test-hooks")]
    pub fn sessions_of(&self, ino: Ino) -> Vec<u64> {
        self.files
            .get(&ino)
            .map(|open| open.sessions.iter().copied().collect())
            .unwrap_or_default()
    }

    /// Every open file's lock.
    pub fn locks(&self) -> impl Iterator<Item = (Ino, &LockRef)> {
        self.files.iter().map(|(&ino, o)| (ino, &o.lock))
    }

    /// Refuses (`SchemeInUse`) to open `ino` under `scheme` while it is open under another.
    pub fn check_scheme(&self, session: u64, ino: Ino, scheme: &LockScheme) -> Result<(), FsError> {
        let Some(open) = self.files.get(&ino) else {
            return Ok(());
        };
        let open_with = open.lock.scheme.name();
        if open_with == scheme.name() {
            return Ok(());
        }
        tracing::warn!(
            session,
            ino,
            open_with,
            asked = scheme.name(),
            "open refused: the file is open under another lock scheme"
        );
        Err(FsError::SchemeInUse {
            open_with: open_with.to_string(),
            asked: scheme.name().to_string(),
        })
    }

    /// Makes `ino` (with attributes `attr`) open unless it is: writes its FCB and creates its
    /// lock of `scheme`; whether it was made now. Nothing is left behind when it fails.
    pub fn ensure_open(
        &mut self,
        region: &mut MetaRegion,
        ino: Ino,
        attr: &Attr,
        scheme: &LockScheme,
    ) -> Result<bool, FsError> {
        if self.files.contains_key(&ino) {
            return Ok(false);
        }
        let off = region.alloc(fcb::FCB_BYTES).ok_or(FsError::NoSpace)?;
        let mut block = [0u8; fcb::FCB_BYTES as usize];
        block[fcb::INO as usize..][..8].copy_from_slice(&ino.to_le_bytes());
        block[fcb::SIZE as usize..][..8].copy_from_slice(&attr.size.to_le_bytes());
        block[fcb::GENERATION as usize..][..8].copy_from_slice(&attr.generation.to_le_bytes());
        // MTIME starts at 0: the database's times are the truth until a write.
        block[fcb::MODE as usize..][..8].copy_from_slice(&u64::from(attr.perm).to_le_bytes());
        if let Err(e) = region.endpoint().write(meta_addr(off), &block) {
            region.free(off, fcb::FCB_BYTES);
            return Err(e.into());
        }
        // No FCB is left behind for a file nobody managed to open: freed as `close` frees
        // one, INO cleared.
        let created = self
            .policy
            .create(region, scheme, attr.size)
            .inspect_err(|_| {
                let _ = region.write_u64(off + fcb::INO, 0);
                region.free(off, fcb::FCB_BYTES);
            })?;
        self.files.insert(
            ino,
            OpenState {
                fcb: off,
                lock: created.lock,
                lock_bytes: created.bytes,
                extra: Vec::new(),
                sessions: HashSet::new(),
            },
        );
        Ok(true)
    }

    /// Session `session` opens `ino` (made open by [`OpenFiles::ensure_open`]): what the
    /// client is told, with the size its FCB holds.
    pub fn join(
        &mut self,
        region: &mut MetaRegion,
        session: u64,
        ino: Ino,
        mut attr: Attr,
    ) -> Result<OpenFile, FsError> {
        let size = self.fcb_word(region, ino, fcb::SIZE).unwrap_or(attr.size);
        let open = self.files.get_mut(&ino).ok_or(FsError::Stale)?;
        open.sessions.insert(session);
        attr.size = size;
        Ok(OpenFile {
            attr,
            fcb: meta_addr(open.fcb),
            lock: open.lock,
        })
    }

    /// Session `session` lets go of `ino`.
    pub fn leave(&mut self, session: u64, ino: Ino) -> Left {
        let Some(open) = self.files.get_mut(&ino) else {
            return Left::NotOpen;
        };
        if !open.sessions.remove(&session) {
            Left::NotOpen
        } else if open.sessions.is_empty() {
            Left::Nobody
        } else {
            Left::Others
        }
    }

    /// Closes `ino`, which nobody has open any more: frees its FCB (clearing its INO word first,
    /// so that a client holding a stale FCB address notices) and its lock state.
    pub fn close(&mut self, region: &mut MetaRegion, ino: Ino) {
        let Some(open) = self.files.remove(&ino) else {
            return;
        };
        let _ = region.write_u64(open.fcb + fcb::INO, 0);
        region.free(open.fcb, fcb::FCB_BYTES);
        let lock = RegionSpan {
            offset: open.lock.base.offset,
            bytes: open.lock_bytes,
        };
        for span in std::iter::once(lock).chain(open.extra) {
            if span.bytes > 0 {
                region.free(span.offset, span.bytes);
            }
        }
    }

    /// Word `word` of open file `ino`'s FCB.
    pub fn fcb_word(&self, region: &mut MetaRegion, ino: Ino, word: u64) -> Option<u64> {
        region.read_u64(self.fcb_of(ino)? + word).ok()
    }

    /// Sets word `word` of open file `ino`'s FCB to `value`; its old value.
    #[cfg(feature = "test-hooks")]
    pub fn damage_fcb_word(
        &self,
        region: &mut MetaRegion,
        ino: Ino,
        word: u64,
        value: u64,
    ) -> Option<u64> {
        let at = self.fcb_of(ino)? + word;
        let old = region.read_u64(at).ok()?;
        region.write_u64(at, value).ok()?;
        Some(old)
    }

    /// SIZE and MTIME of open file `ino`'s FCB, in one read of the words from SIZE to MTIME
    /// (each word atomic; every release and live attribute reads both); `None` when it is not
    /// open here or the read failed.
    pub fn size_and_mtime(&self, region: &mut MetaRegion, ino: Ino) -> Option<(u64, u64)> {
        const _: () = assert!(fcb::MTIME > fcb::SIZE);
        let off = self.fcb_of(ino)?;
        let len = (fcb::MTIME + 8 - fcb::SIZE) as usize;
        let words = region
            .endpoint()
            .read(meta_addr(off + fcb::SIZE), len)
            .ok()?;
        let word = |at: u64| {
            let i = (at - fcb::SIZE) as usize;
            u64::from_le_bytes(words[i..i + 8].try_into().expect("8 bytes"))
        };
        Some((word(fcb::SIZE), word(fcb::MTIME)))
    }

    /// The attributes of an open file as its FCB corrects them (`fcb::live`: size, data
    /// times); others' as they are.
    pub fn live_attr(&self, region: &mut MetaRegion, attr: Attr) -> Attr {
        match self.size_and_mtime(region, attr.ino) {
            Some((size, mtime)) => fcb::live(attr, size, mtime),
            None => attr,
        }
    }

    /// Allocates `words` zeroed lock words for the lock tree of open file `ino` (a CITRON
    /// scale-up), freed with the file's other lock state when it is closed.
    pub fn add_lock_words(
        &mut self,
        region: &mut MetaRegion,
        ino: Ino,
        words: u64,
    ) -> Result<fabric::RemoteAddr, FsError> {
        let open = self.files.get_mut(&ino).ok_or(FsError::Stale)?;
        let bytes = words
            .checked_mul(8)
            .filter(|&b| b > 0)
            .ok_or_else(|| FsError::Invalid(format!("{words} lock words")))?;
        let offset = region.alloc_zeroed(bytes)?;
        open.extra.push(RegionSpan { offset, bytes });
        Ok(meta_addr(offset))
    }

    /// After a `SetAttr` of an open file: publishes its permission bits in the FCB (writers
    /// read them to decide whether to clear set-ID bits), and, when the caller set mtime,
    /// clears the FCB's MTIME (so that the time set is not hidden by an earlier write's);
    /// returns the attributes as the FCB corrects them.
    pub fn publish_setattr(
        &self,
        region: &mut MetaRegion,
        attr: Attr,
        set: &SetAttr,
    ) -> Result<Attr, FsError> {
        let Some(base) = self.fcb_of(attr.ino) else {
            return Ok(attr);
        };
        region.write_u64(base + fcb::MODE, u64::from(attr.perm))?;
        if set.mtime.is_some() {
            region.write_u64(base + fcb::MTIME, 0)?;
        }
        Ok(self.live_attr(region, attr))
    }

    /// Writes `attr`'s generation into its file's FCB, if the file is open (returning the
    /// FCB's offset): a client's next I/O reads it in its lock's batch and drops the chunk
    /// locations it cached under an older one. Called before the change that bumped it is
    /// answered, so while its caller still holds the lock that covers the change.
    pub fn publish_generation(
        &self,
        region: &mut MetaRegion,
        attr: &Attr,
    ) -> Result<Option<u64>, FsError> {
        let Some(base) = self.fcb_of(attr.ino) else {
            return Ok(None);
        };
        region.write_u64(base + fcb::GENERATION, attr.generation)?;
        Ok(Some(base))
    }

    /// After a size change to `size`: publishes it in the FCB, generation first, so a client
    /// that sees the smaller size also sees that its chunk map is stale.
    pub fn publish_size(
        &self,
        region: &mut MetaRegion,
        attr: &Attr,
        size: u64,
    ) -> Result<(), FsError> {
        if let Some(base) = self.publish_generation(region, attr)? {
            region.write_u64(base + fcb::SIZE, size)?;
        }
        Ok(())
    }

    /// Every open file as a status report shows it, with its counted lock calls.
    pub fn facts(&self, calls: &LockCalls) -> Vec<OpenFacts> {
        let calls = lock(&calls.calls);
        self.files
            .iter()
            .map(|(&ino, o)| OpenFacts {
                ino,
                sessions: o.sessions.len(),
                scheme: o.lock.scheme.to_string(),
                lock_calls: calls.get(&ino).copied().unwrap_or(0),
            })
            .collect()
    }
}

/// Per open file, the lock requests about it that came as RPCs (`GetLk`, `SetLk`,
/// `AllocateLockWords`, hosted scale-ups), for a status report.
///
/// Invariant: an entry is made when the file is first opened and goes when it is closed (both
/// under the state lock), so a file is counted only while open. Under a mutex of its own, so
/// that counting takes no state lock; taken after the state lock where both are held.
#[derive(Default)]
pub(crate) struct LockCalls {
    calls: Mutex<HashMap<Ino, u64>>,
}

impl LockCalls {
    /// `ino` was opened: counted from now on, from 0.
    pub fn opened(&self, ino: Ino) {
        lock(&self.calls).insert(ino, 0);
    }

    /// `ino` was closed: no longer counted.
    pub fn closed(&self, ino: Ino) {
        lock(&self.calls).remove(&ino);
    }

    /// Counts a lock request about `ino`, if it is open.
    pub fn count(&self, ino: Ino) {
        if let Some(calls) = lock(&self.calls).get_mut(&ino) {
            *calls += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta_region::META_REGION;
    use fabric::Region;
    use proto::FileKind;

    fn region() -> MetaRegion {
        MetaRegion::new(Arc::new(Region::anonymous(META_REGION, 1 << 20))).unwrap()
    }

    fn files() -> OpenFiles {
        OpenFiles::new(LockPolicy {
            lock_unit: 4096,
            lock_lease: Duration::from_secs(1),
            t_wait: Duration::from_micros(10),
            fence_after: Duration::from_millis(100),
            lock_server: None,
        })
    }

    fn attr(ino: Ino, size: u64) -> Attr {
        let t = proto::Timestamp::default();
        Attr {
            ino,
            kind: FileKind::File,
            perm: 0o644,
            nlink: 1,
            uid: 0,
            gid: 0,
            rdev: 0,
            size,
            atime: t,
            mtime: t,
            ctime: t,
            crtime: t,
            generation: 1,
            allocated: 0,
        }
    }

    #[test]
    fn the_last_session_to_leave_frees_everything_the_file_took() {
        let mut region = region();
        let mut files = files();
        let before = region.free_bytes();
        let mutex: LockScheme = "mutex".parse().unwrap();
        assert!(files
            .ensure_open(&mut region, 5, &attr(5, 100), &mutex)
            .unwrap());
        assert!(!files
            .ensure_open(&mut region, 5, &attr(5, 100), &mutex)
            .unwrap());
        let opened = files.join(&mut region, 1, 5, attr(5, 100)).unwrap();
        files.join(&mut region, 2, 5, attr(5, 100)).unwrap();
        assert_eq!(opened.attr.size, 100);
        assert_eq!(files.fcb_word(&mut region, 5, fcb::INO), Some(5));
        files.add_lock_words(&mut region, 5, 16).unwrap();
        assert_eq!(files.leave(3, 5), Left::NotOpen);
        assert_eq!(files.leave(1, 5), Left::Others);
        assert_eq!(files.leave(2, 5), Left::Nobody);
        let fcb = files.fcb_of(5).unwrap();
        files.close(&mut region, 5);
        assert!(!files.is_open(5));
        assert_eq!(region.read_u64(fcb + fcb::INO).unwrap(), 0, "INO cleared");
        assert_eq!(region.free_bytes(), before);
    }

    #[test]
    fn a_file_is_open_under_one_scheme_at_a_time() {
        let mut region = region();
        let mut files = files();
        let mutex: LockScheme = "mutex".parse().unwrap();
        files
            .ensure_open(&mut region, 5, &attr(5, 0), &mutex)
            .unwrap();
        files.check_scheme(1, 5, &mutex).unwrap();
        let other: LockScheme = "citron".parse().unwrap();
        assert!(matches!(
            files.check_scheme(1, 5, &other),
            Err(FsError::SchemeInUse { .. })
        ));
        files.check_scheme(1, 6, &other).unwrap();
    }

    #[test]
    fn the_fcb_publishes_size_generation_and_corrects_attributes() {
        let mut region = region();
        let mut files = files();
        let mutex: LockScheme = "mutex".parse().unwrap();
        files
            .ensure_open(&mut region, 5, &attr(5, 10), &mutex)
            .unwrap();
        let mut grown = attr(5, 10);
        grown.generation = 9;
        files.publish_size(&mut region, &grown, 4096).unwrap();
        assert_eq!(files.fcb_word(&mut region, 5, fcb::GENERATION), Some(9));
        assert_eq!(files.size_and_mtime(&mut region, 5), Some((4096, 0)));
        assert_eq!(files.live_attr(&mut region, attr(5, 10)).size, 4096);
        // Not open: as it is.
        assert_eq!(files.live_attr(&mut region, attr(6, 10)).size, 10);
        assert_eq!(
            files.publish_generation(&mut region, &attr(6, 1)).unwrap(),
            None
        );
    }

    #[test]
    fn lock_calls_are_counted_only_while_open() {
        let calls = LockCalls::default();
        calls.count(5);
        calls.opened(5);
        calls.count(5);
        calls.count(5);
        assert_eq!(lock(&calls.calls).get(&5), Some(&2));
        calls.closed(5);
        calls.count(5);
        assert!(lock(&calls.calls).is_empty());
    }
}
