//! The meta region as the meta server itself uses it: its allocator and the server's own
//! endpoint on it (file control blocks, lock state, the published tables all live there).

use crate::alloc::RegionAlloc;
use fabric::local::{LocalEndpoint, RegionSource};
use fabric::{Endpoint, EndpointExt, Region, RegionId, RemoteAddr};
use lockmgr::schemes::{self, CreateOptions, LockMemory};
use lockmgr::{LockError, LockScheme};
use proto::FsError;
use std::sync::Arc;

/// The meta region's id on the meta server.
pub const META_REGION: RegionId = RegionId(0);

/// Bytes at the start of the meta region never handed out (a null address stays invalid).
const RESERVED: u64 = 64;

/// The address of byte `offset` of the meta region.
pub(crate) fn meta_addr(offset: u64) -> RemoteAddr {
    RemoteAddr::new(META_REGION, offset)
}

/// The meta server's own access to its region, without going through any fabric.
pub(crate) struct OwnRegion(pub Arc<Region>);

impl RegionSource for OwnRegion {
    fn resolve(&self, id: RegionId) -> Option<Arc<Region>> {
        (id == self.0.id()).then(|| self.0.clone())
    }
    fn generation(&self) -> u64 {
        0
    }
    fn backend(&self) -> &'static str {
        "meta-local"
    }
}

/// One allocation in the meta region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RegionSpan {
    /// Its first byte.
    pub offset: u64,
    /// Its length as it was asked for (0: nothing allocated).
    pub bytes: u64,
}

/// A lock made in the meta region by [`MetaRegion::create_lock`].
pub(crate) struct CreatedLock {
    /// What clients open.
    pub lock: lockmgr::LockRef,
    /// Bytes of the region it holds from `lock.base` (0: none, e.g. a lock at a lock service).
    pub bytes: u64,
}

/// The meta region's allocator and the server's endpoint on it.
///
/// Invariant: every byte handed out by [`MetaRegion::alloc`] is given back at most once, by
/// whoever took it ([`MetaRegion::free`]); the first [`RESERVED`] bytes are never handed out.
pub(crate) struct MetaRegion {
    alloc: RegionAlloc,
    endpoint: LocalEndpoint<OwnRegion>,
    len: u64,
}

impl MetaRegion {
    /// Serves `region` (too small a region, without room for a few file control blocks, is
    /// an error).
    pub fn new(region: Arc<Region>) -> anyhow::Result<MetaRegion> {
        let len = region.len();
        anyhow::ensure!(
            len >= RESERVED + 4 * proto::fcb::FCB_BYTES,
            "meta region of {len} bytes is too small"
        );
        Ok(MetaRegion {
            alloc: RegionAlloc::new(RESERVED, len),
            endpoint: LocalEndpoint::new(Arc::new(OwnRegion(region))),
            len,
        })
    }

    /// Places a table of `slot_bytes`-byte slots: as many slots as an eighth of the region
    /// holds, at most `max_slots`; its address and slot count, or `None` without room.
    pub fn place_table(&mut self, slot_bytes: u64, max_slots: u64) -> Option<(RemoteAddr, u64)> {
        let slots = (self.len / 8 / slot_bytes).min(max_slots);
        (slots > 0)
            .then(|| self.alloc.alloc(slots * slot_bytes))
            .flatten()
            .map(|offset| (meta_addr(offset), slots))
    }

    /// Allocates `bytes`; its offset, or `None` when no free extent is large enough.
    pub fn alloc(&mut self, bytes: u64) -> Option<u64> {
        self.alloc.alloc(bytes)
    }

    /// Gives back an allocation (`bytes` as it was asked for).
    pub fn free(&mut self, offset: u64, bytes: u64) {
        self.alloc.free(offset, bytes)
    }

    /// Bytes not allocated.
    pub fn free_bytes(&self) -> u64 {
        self.alloc.free_bytes()
    }

    /// The server's endpoint on the region.
    pub fn endpoint(&mut self) -> &mut LocalEndpoint<OwnRegion> {
        &mut self.endpoint
    }

    /// Reads the word at `offset`.
    pub fn read_u64(&mut self, offset: u64) -> Result<u64, FsError> {
        Ok(self.endpoint.read_u64(meta_addr(offset))?)
    }

    /// Writes the word at `offset`.
    pub fn write_u64(&mut self, offset: u64, value: u64) -> Result<(), FsError> {
        Ok(self.endpoint.write_u64(meta_addr(offset), value)?)
    }

    /// Allocates `bytes` and zeroes them; nothing stays allocated when a write fails.
    pub fn alloc_zeroed(&mut self, bytes: u64) -> Result<u64, FsError> {
        let offset = self.alloc(bytes).ok_or(FsError::NoSpace)?;
        let zeros = vec![0u8; bytes.min(1 << 20) as usize];
        let mut at = 0;
        while at < bytes {
            let n = (bytes - at).min(zeros.len() as u64);
            if let Err(e) = self
                .endpoint
                .write(meta_addr(offset + at), &zeros[..n as usize])
            {
                self.free(offset, bytes);
                return Err(e.into());
            }
            at += n;
        }
        Ok(offset)
    }

    /// Creates the lock of `scheme` with `options` in the region; the memory a failed
    /// creation took is given back.
    pub fn create_lock(
        &mut self,
        scheme: &LockScheme,
        options: &CreateOptions,
    ) -> Result<CreatedLock, LockError> {
        let mut memory = RegionLockMemory {
            region: self,
            taken: None,
        };
        match schemes::create(scheme, options, &mut memory) {
            Ok(created) => Ok(CreatedLock {
                lock: created.lock,
                bytes: created.bytes,
            }),
            Err(e) => {
                if let Some(taken) = memory.taken {
                    memory.region.free(taken.offset, taken.bytes);
                }
                Err(e)
            }
        }
    }
}

/// The meta region as memory for a lock's state: allocations come from the region's allocator
/// and are remembered, so that a creation that fails gives them back.
struct RegionLockMemory<'a> {
    region: &'a mut MetaRegion,
    taken: Option<RegionSpan>,
}

impl LockMemory for RegionLockMemory<'_> {
    fn endpoint(&mut self) -> &mut dyn Endpoint {
        &mut self.region.endpoint
    }

    fn allocate(&mut self, bytes: u64) -> Result<RemoteAddr, LockError> {
        let offset = self
            .region
            .alloc(bytes)
            .ok_or(LockError::NoSpace { bytes })?;
        self.taken = Some(RegionSpan { offset, bytes });
        Ok(meta_addr(offset))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(bytes: u64) -> MetaRegion {
        MetaRegion::new(Arc::new(Region::anonymous(META_REGION, bytes))).unwrap()
    }

    #[test]
    fn a_region_without_room_for_a_few_fcbs_is_refused() {
        let tiny = Arc::new(Region::anonymous(META_REGION, 128));
        assert!(MetaRegion::new(tiny).is_err());
    }

    #[test]
    fn nothing_is_handed_out_below_the_reserved_bytes() {
        let mut r = region(1 << 16);
        let first = r.alloc(8).unwrap();
        assert!(first >= RESERVED);
        assert_eq!(meta_addr(first).offset, first);
    }

    #[test]
    fn a_table_takes_at_most_an_eighth_of_the_region() {
        let mut r = region(1 << 16);
        let (at, slots) = r.place_table(64, u64::MAX).unwrap();
        assert_eq!(slots, (1 << 16) / 8 / 64);
        assert!(at.offset >= RESERVED);
        let (_, capped) = r.place_table(64, 3).unwrap();
        assert_eq!(capped, 3);
    }

    #[test]
    fn zeroed_allocations_read_zero_and_go_back_whole() {
        let mut r = region(1 << 16);
        let before = r.free_bytes();
        let off = r.alloc(64).unwrap();
        r.write_u64(off, 7).unwrap();
        r.free(off, 64);
        let off = r.alloc_zeroed(64).unwrap();
        assert_eq!(r.read_u64(off).unwrap(), 0);
        r.free(off, 64);
        assert_eq!(r.free_bytes(), before);
        assert!(matches!(r.alloc_zeroed(1 << 20), Err(FsError::NoSpace)));
        assert_eq!(r.free_bytes(), before);
    }
}
