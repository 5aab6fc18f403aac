//! The tables clients read one-sidedly instead of asking by RPC: the attribute table
//! ([`proto::attrs`], for a one-sided stat) and the directory-entry table
//! ([`proto::dentries`], for a one-sided lookup), both in the meta region.
//!
//! Invariant (the contract of [`proto::attrs`]): every change committed to the database is
//! published here — with the state lock held, after the change committed and before it is
//! answered — so that a client that saw the answer reads the change one-sidedly; a slot that
//! cannot be kept right is cleared, so that readers fall back to the RPC.

use crate::dentries::DentryTable;
use crate::meta_region::MetaRegion;
use crate::open_files::OpenFiles;
use crate::store::Store;
use fabric::EndpointExt;
use proto::attrs::{AttrSlot, AttrTableRef};
use proto::dentries::DentryTableRef;
use proto::{FsError, Ino};

/// Most slots of the attribute table: 12 MiB of 192-byte slots; never more than an eighth of
/// the meta region (FCBs and lock trees need the rest).
const MAX_ATTR_SLOTS: u64 = 1 << 16;

/// Most slots of the directory-entry table: 8 MiB of 256-byte slots (about 400,000 short names
/// held); never more than an eighth of the meta region.
const MAX_DENTRY_SLOTS: u64 = 1 << 15;

/// The attribute table and the next version to publish.
struct AttrTable {
    table: AttrTableRef,
    next_version: u64,
}

/// The published tables, kept under the service's state lock. Either is absent when the
/// region had no room for it.
pub(crate) struct PublishedTables {
    attrs: Option<AttrTable>,
    /// Where the entry table goes, until it is filled ([`PublishedTables::fill_entries`]).
    dentry_at: Option<DentryTableRef>,
    dentries: Option<DentryTable>,
}

impl PublishedTables {
    /// Places both tables in `region`; versions start above every version of an earlier run,
    /// which numbered its sessions below `first_session` (see [`proto::attrs`]). Every
    /// attribute slot starts empty; the entry table is filled by
    /// [`PublishedTables::fill_entries`].
    pub fn new(region: &mut MetaRegion, first_session: u64) -> PublishedTables {
        let attrs = region
            .place_table(proto::attrs::SLOT_BYTES, MAX_ATTR_SLOTS)
            .map(|(base, slots)| AttrTable {
                table: AttrTableRef { base, slots },
                next_version: first_session.saturating_mul(1024),
            });
        let dentry_at = region
            .place_table(proto::dentries::SLOT_BYTES, MAX_DENTRY_SLOTS)
            .map(|(base, slots)| DentryTableRef { base, slots });
        PublishedTables {
            attrs,
            dentry_at,
            dentries: None,
        }
    }

    /// Where the attribute table is (what clients are told).
    pub fn attr_table(&self) -> Option<AttrTableRef> {
        self.attrs.as_ref().map(|a| a.table)
    }

    /// Where the entry table is, once filled (what clients are told).
    pub fn dentry_table(&self) -> Option<DentryTableRef> {
        self.dentries.as_ref().map(|d| d.table)
    }

    /// Fills the entry table whole from the database, forgetting the changes queued so far:
    /// at start, before any client is told where it is, and after repairs.
    pub fn fill_entries(&mut self, region: &mut MetaRegion, store: &Store) -> Result<(), FsError> {
        let Some(table) = self.dentry_at else {
            return Ok(());
        };
        store.take_entry_changes();
        let entries = store.all_entries()?;
        self.dentries = Some(DentryTable::new(table, entries, region.endpoint())?);
        Ok(())
    }

    /// Rewrites the slots of `inos` from the database (clearing those of deleted inodes), with
    /// the FCB of open files.
    pub fn publish(
        &mut self,
        region: &mut MetaRegion,
        store: &Store,
        open: &OpenFiles,
        inos: impl IntoIterator<Item = Ino>,
    ) {
        let Some(attrs) = self.attrs.as_mut() else {
            return;
        };
        let endpoint = region.endpoint();
        for ino in inos {
            let addr = attrs.table.slot_addr(ino);
            let bytes = match store.getattr(ino) {
                Ok(attr) => {
                    attrs.next_version += 1;
                    let slot = AttrSlot {
                        version: attrs.next_version,
                        fcb: open.fcb_of(ino).unwrap_or(0),
                        attr,
                    };
                    proto::attrs::encode(&slot)
                }
                Err(_) => None,
            };
            let bytes = match bytes {
                Some(bytes) => bytes,
                None => {
                    // Deleted (or unencodable): clear the slot if it is this inode's, so that
                    // readers fall back; a colliding inode's slot stays.
                    let mine = endpoint
                        .read(addr, proto::attrs::SLOT_BYTES as usize)
                        .is_ok_and(|held| proto::attrs::decode(&held, ino).is_some());
                    if !mine {
                        continue;
                    }
                    vec![0u8; proto::attrs::SLOT_BYTES as usize]
                }
            };
            if let Err(error) = endpoint.write(addr, &bytes) {
                tracing::warn!(ino, %error, "cannot publish attributes");
            }
        }
    }

    /// Publishes every inode and directory entry committed transactions touched since the
    /// last call.
    pub fn publish_touched(&mut self, region: &mut MetaRegion, store: &Store, open: &OpenFiles) {
        let touched = store.take_touched();
        self.publish(region, store, open, touched);
        let changes = store.take_entry_changes();
        if let Some(table) = self.dentries.as_mut() {
            if !changes.is_empty() {
                table.apply(changes, region.endpoint());
            }
        }
    }

    /// Holds `parent/name` in the entry table if it was only counted there (a lookup by RPC
    /// found it, so that the next one is one-sided); checked against the database after every
    /// committed change is published.
    pub fn fill_entry(
        &mut self,
        region: &mut MetaRegion,
        store: &Store,
        open: &OpenFiles,
        parent: Ino,
        name: &str,
    ) {
        if self.dentries.is_none() || proto::rpc::is_dot(name) {
            return;
        }
        self.publish_touched(region, store, open);
        if let Ok(Some(ino)) = store.entry_ino(parent, name) {
            if let Some(table) = self.dentries.as_mut() {
                table.fill(parent, name, ino, region.endpoint());
            }
        }
    }

    /// Publishes `ino` unless its slot holds it already (a stat or lookup by RPC fills the
    /// table, so the next one is one-sided).
    pub fn fill(&mut self, region: &mut MetaRegion, store: &Store, open: &OpenFiles, ino: Ino) {
        let Some(attrs) = self.attrs.as_ref() else {
            return;
        };
        let addr = attrs.table.slot_addr(ino);
        if region
            .endpoint()
            .read(addr, proto::attrs::SLOT_BYTES as usize)
            .is_ok_and(|held| proto::attrs::decode(&held, ino).is_some())
        {
            return;
        }
        self.publish(region, store, open, [ino]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta_region::META_REGION;
    use crate::open_files::LockPolicy;
    use proto::dentries::Answer;
    use proto::{Caller, FileKind, ROOT_INO};
    use std::sync::Arc;
    use std::time::Duration;

    const ROOT: Caller = Caller { uid: 0, gid: 0 };

    fn setup() -> (tempfile::TempDir, Store, MetaRegion, OpenFiles) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 1 << 16, ROOT).unwrap();
        let region = fabric::Region::anonymous(META_REGION, 1 << 20);
        let region = MetaRegion::new(Arc::new(region)).unwrap();
        let open = OpenFiles::new(LockPolicy {
            lock_unit: 4096,
            lock_lease: Duration::from_secs(1),
            t_wait: Duration::from_micros(10),
            fence_after: Duration::from_millis(100),
            lock_server: None,
        });
        (dir, store, region, open)
    }

    fn slot(t: &PublishedTables, region: &mut MetaRegion, ino: Ino) -> Option<AttrSlot> {
        let addr = t.attr_table()?.slot_addr(ino);
        let bytes = region
            .endpoint()
            .read(addr, proto::attrs::SLOT_BYTES as usize)
            .ok()?;
        proto::attrs::decode(&bytes, ino)
    }

    fn entry(t: &PublishedTables, region: &mut MetaRegion, parent: Ino, name: &str) -> Answer {
        let table = t.dentry_table().unwrap();
        let at = table.slot_addr(table.slot_of(parent, name));
        let bytes = region
            .endpoint()
            .read(at, proto::dentries::SLOT_BYTES as usize)
            .unwrap();
        proto::dentries::decode(&bytes)
            .unwrap()
            .answer(parent, name)
    }

    #[test]
    fn committed_changes_are_published_and_deletions_cleared() {
        let (_dir, store, mut region, open) = setup();
        let mut t = PublishedTables::new(&mut region, 1);
        t.fill_entries(&mut region, &store).unwrap();
        let attr = store
            .mknod(ROOT_INO, "f", FileKind::File, 0o644, 0, ROOT)
            .unwrap();
        assert!(
            slot(&t, &mut region, attr.ino).is_none(),
            "not published yet"
        );
        t.publish_touched(&mut region, &store, &open);
        let first = slot(&t, &mut region, attr.ino).expect("published");
        assert_eq!(first.attr, attr);
        assert_eq!(first.fcb, 0, "not open");
        assert!(
            first.version > 1024,
            "above every version of an earlier run"
        );
        assert_eq!(
            entry(&t, &mut region, ROOT_INO, "f"),
            Answer::Found(attr.ino)
        );
        store.unlink(ROOT_INO, "f", |_| false).unwrap();
        t.publish_touched(&mut region, &store, &open);
        assert!(slot(&t, &mut region, attr.ino).is_none(), "cleared");
        assert_eq!(entry(&t, &mut region, ROOT_INO, "f"), Answer::Absent);
    }

    #[test]
    fn a_fill_publishes_only_what_the_slot_lacks() {
        let (_dir, store, mut region, open) = setup();
        let mut t = PublishedTables::new(&mut region, 1);
        t.fill(&mut region, &store, &open, ROOT_INO);
        let first = slot(&t, &mut region, ROOT_INO).expect("filled");
        t.fill(&mut region, &store, &open, ROOT_INO);
        let again = slot(&t, &mut region, ROOT_INO).unwrap();
        assert_eq!(first.version, again.version, "held already: not rewritten");
    }
}
