//! The server's side of the directory-entry table ([`proto::dentries`]): a copy of every slot
//! in this process, the one that changes are applied to, and its publication in the meta
//! region.
//!
//! Invariant (with the service's state lock held around every call): the copy holds or counts
//! every entry of the database exactly once, once the changes the store queued
//! ([`crate::store::Store::take_entry_changes`]) are applied; a slot is written to the region
//! whenever its copy changes, before the change that caused it is answered.

use crate::store::EntryChange;
use fabric::{Endpoint, EndpointExt};
use proto::dentries::{DentrySlot, DentryTableRef, HeldEntry};
use proto::Ino;

/// The table and this process's copy of it.
pub(crate) struct DentryTable {
    /// Where it lives (what clients are told).
    pub table: DentryTableRef,
    slots: Vec<DentrySlot>,
}

impl DentryTable {
    /// A table at `table` holding `entries` (the whole database's), every slot written.
    pub fn new(
        table: DentryTableRef,
        entries: impl IntoIterator<Item = (Ino, String, Ino)>,
        endpoint: &mut dyn Endpoint,
    ) -> Result<DentryTable, fabric::FabricError> {
        let mut t = DentryTable {
            table,
            slots: vec![DentrySlot::default(); table.slots as usize],
        };
        for (parent, name, ino) in entries {
            t.add(parent, name, ino);
        }
        for slot in 0..table.slots {
            t.write(slot, endpoint)?;
        }
        Ok(t)
    }

    /// Puts an entry into its slot's copy: held if it fits, else counted. Returns its slot.
    fn add(&mut self, parent: Ino, name: String, ino: Ino) -> u64 {
        let index = self.table.slot_of(parent, &name);
        let slot = &mut self.slots[index as usize];
        if let Some(i) = slot.position(parent, &name) {
            // Not expected (an entry is added only where none is), but the held entry must be
            // the database's.
            slot.held[i].ino = ino;
            return index;
        }
        slot.held.push(HeldEntry { parent, name, ino });
        if proto::dentries::encode(slot).is_none() {
            slot.held.pop();
            slot.others += 1;
        }
        index
    }

    /// Applies committed changes, in commit order, and publishes the slots they changed.
    pub fn apply(&mut self, changes: Vec<EntryChange>, endpoint: &mut dyn Endpoint) {
        let mut changed = Vec::with_capacity(changes.len());
        for c in changes {
            match c.ino {
                Some(ino) => changed.push(self.add(c.parent, c.name, ino)),
                None => {
                    let index = self.table.slot_of(c.parent, &c.name);
                    let slot = &mut self.slots[index as usize];
                    match slot.position(c.parent, &c.name) {
                        Some(i) => {
                            slot.held.swap_remove(i);
                        }
                        None if slot.others > 0 => slot.others -= 1,
                        None => tracing::error!(
                            parent = c.parent,
                            name = %c.name,
                            "removed entry was neither held nor counted in the entry table"
                        ),
                    }
                    changed.push(index);
                }
            }
        }
        changed.sort_unstable();
        changed.dedup();
        for index in changed {
            if let Err(error) = self.write(index, endpoint) {
                tracing::warn!(slot = index, %error, "cannot publish directory entries");
            }
        }
    }

    /// Holds the existing entry `(parent, name) → ino`, counted in its slot until now, if it
    /// fits there now (a lookup by RPC found it: the next one is one-sided). The caller has
    /// applied every committed change and checked the entry against the database.
    pub fn fill(&mut self, parent: Ino, name: &str, ino: Ino, endpoint: &mut dyn Endpoint) {
        let index = self.table.slot_of(parent, name);
        let slot = &mut self.slots[index as usize];
        if slot.others == 0 || slot.position(parent, name).is_some() {
            return;
        }
        slot.held.push(HeldEntry {
            parent,
            name: name.to_owned(),
            ino,
        });
        if proto::dentries::encode(slot).is_none() {
            slot.held.pop();
            return;
        }
        slot.others -= 1;
        if let Err(error) = self.write(index, endpoint) {
            tracing::warn!(slot = index, %error, "cannot publish directory entries");
        }
    }

    /// Writes slot `index`'s copy to the region.
    fn write(&self, index: u64, endpoint: &mut dyn Endpoint) -> Result<(), fabric::FabricError> {
        let bytes = proto::dentries::encode(&self.slots[index as usize])
            .expect("slots are kept small enough to encode");
        endpoint.write(self.table.slot_addr(index), &bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta_region::OwnRegion;
    use fabric::{Region, RegionId, RemoteAddr};
    use proto::dentries::Answer;
    use std::sync::Arc;

    fn read(t: &DentryTable, ep: &mut dyn Endpoint, parent: Ino, name: &str) -> Answer {
        let at = t.table.slot_addr(t.table.slot_of(parent, name));
        let bytes = ep
            .read(at, proto::dentries::SLOT_BYTES as usize)
            .expect("read");
        proto::dentries::decode(&bytes)
            .expect("sealed")
            .answer(parent, name)
    }

    fn change(parent: Ino, name: &str, ino: Option<Ino>) -> EntryChange {
        EntryChange {
            parent,
            name: name.into(),
            ino,
        }
    }

    /// With two slots, hundreds of names overflow: the region must still answer every name
    /// rightly (found, absent) or not at all (unknown), through adds, removes and fills.
    #[test]
    fn the_region_never_answers_wrongly_through_overflow_and_churn() {
        let region = Arc::new(Region::anonymous(RegionId(0), 4096));
        let mut ep = fabric::local::LocalEndpoint::new(Arc::new(OwnRegion(region)));
        let table = DentryTableRef {
            base: RemoteAddr::new(RegionId(0), 0),
            slots: 2,
        };
        let mut t = DentryTable::new(table, [(1, "seed".to_string(), 5)], &mut ep).unwrap();
        let mut truth = std::collections::HashMap::from([("seed".to_string(), 5)]);
        for round in 0..3u64 {
            let adds: Vec<_> = (0..60)
                .map(|i| change(1, &format!("n{i}"), Some(100 + i + round)))
                .collect();
            for c in &adds {
                truth.insert(c.name.clone(), c.ino.unwrap());
            }
            t.apply(adds, &mut ep);
            let removes: Vec<_> = (0..60)
                .filter(|i| i % 3 == round)
                .map(|i| change(1, &format!("n{i}"), None))
                .collect();
            for c in &removes {
                truth.remove(&c.name);
            }
            t.apply(removes, &mut ep);
            // Fill what fits of what is still there.
            for (name, &ino) in &truth {
                t.fill(1, name, ino, &mut ep);
            }
            for i in 0..70 {
                let name = format!("n{i}");
                match (read(&t, &mut ep, 1, &name), truth.get(&name)) {
                    (Answer::Found(ino), Some(&want)) => assert_eq!(ino, want, "{name}"),
                    (Answer::Absent, None) | (Answer::Unknown, _) => {}
                    (got, want) => panic!("{name}: the table says {got:?}, truth {want:?}"),
                }
            }
            // Take everything out again: every slot ends empty and counting nothing.
            let all: Vec<_> = truth.keys().map(|n| change(1, n, None)).collect();
            truth.clear();
            t.apply(all, &mut ep);
            for slot in &t.slots {
                assert_eq!(slot, &DentrySlot::default());
            }
        }
        assert_eq!(read(&t, &mut ep, 1, "n0"), Answer::Absent);
    }
}
