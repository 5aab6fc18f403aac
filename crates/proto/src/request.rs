//! The class of each of the meta server's requests, in one table: `rpc`'s `requests!`
//! invocation makes the [`Request`] enum (the wire type, in the table's order) and, for every
//! kind of request ([`RequestKind`]), its row: its name, the group of requests the meta server handles it with, what
//! serving it costs, and what it changes ([`RequestClass`]). A new request is one row, and
//! whoever classifies requests (the meta server's dispatch, its metrics and its worker choice,
//! the client's retry and sync rules) reads that row.

use crate::rpc::{Request, RequestKind};

/// The group of requests that the meta server handles together ([`RequestClass::group`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Group {
    /// About the cluster and the session itself.
    Cluster,
    /// Reads of the namespace.
    Read,
    /// Changes of the namespace (entries and extended attributes).
    Change,
    /// About one file: its attributes, opening and releasing it, its lock state and record
    /// locks.
    File,
    /// About a file's chunks.
    Chunks,
}

/// What serving a request costs the meta server ([`RequestClass::cost`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Cost {
    /// Tens of microseconds in memory: it only touches the namespace in memory (the staged
    /// image, the attribute table, the open files).
    Quick,
    /// It may take long: it waits for the database's flush (fsync, a truncate's tail), for
    /// other clients (revocations, fences), for a data server (allocations that zero chunks),
    /// or works through many entries (a directory page, a whole check).
    Slow,
    /// Quick or slow by its arguments ([`Request::is_quick`]).
    Depends,
}

/// A kind of request's row in the table: how it is handled and what it does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestClass {
    /// Its name: the `kind` label of the meta server's request metrics.
    pub name: &'static str,
    /// The group the meta server handles it with.
    pub group: Group,
    /// What serving it costs.
    pub cost: Cost,
    /// It may change an inode's attributes or whether it is open, and so its slot in the
    /// attribute table: the meta server publishes the slots it touched before the answer, so
    /// that a client that saw the answer reads the change one-sidedly.
    pub changes_inodes: bool,
    /// [`Effects::changes_namespace`].
    pub changes_namespace: bool,
    /// [`Effects::may_repeat`].
    pub may_repeat: bool,
}

/// A row that changes nothing and may be repeated (a read): the table's starting point.
pub(crate) const fn class(name: &'static str, group: Group, cost: Cost) -> RequestClass {
    RequestClass {
        name,
        group,
        cost,
        changes_inodes: false,
        changes_namespace: false,
        may_repeat: true,
    }
}

impl RequestClass {
    /// The row, changing inodes' attributes or openness.
    pub(crate) const fn changes_inodes(self) -> Self {
        Self {
            changes_inodes: true,
            ..self
        }
    }

    /// The row, changing the namespace: not to be repeated (a second try would fail with
    /// EEXIST or ENOENT, or act twice).
    pub(crate) const fn changes_namespace(self) -> Self {
        Self {
            changes_namespace: true,
            may_repeat: false,
            ..self
        }
    }

    /// The row, not to be repeated.
    pub(crate) const fn once(self) -> Self {
        Self {
            may_repeat: false,
            ..self
        }
    }
}

/// What a [`Request`] does, as a client must know it ([`Request::effects`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Effects {
    /// It changes what the meta server keeps in its database, so that its effect is durable
    /// only after the database's next flush (which an `Fsync` waits for): a client counts such
    /// calls as not yet synced.
    pub changes_namespace: bool,
    /// It may be made a second time when the first try's outcome is unknown (its connection
    /// broke after it was sent): on a new connection, in a new session, the second try does
    /// not do what the first may have done already, or does no harm doing it again.
    pub may_repeat: bool,
}

/// Makes [`Request`] (the variants as given, in order: the wire's variant numbers),
/// [`RequestKind`] (one per variant) and the table [`RequestKind::class`] from one row per
/// request: `Variant { fields } => class;` (or a unit or tuple variant).
macro_rules! requests {
    ($(
        $(#[$meta:meta])*
        $variant:ident $({ $($fields:tt)* })? $(( $($tuple:tt)* ))? => $class:expr;
    )*) => {
        /// A call to the meta server.
        #[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
        pub enum Request {
            $(
                $(#[$meta])*
                $variant $({ $($fields)* })? $(( $($tuple)* ))?,
            )*
        }

        /// The kind of a [`Request`], without its arguments.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum RequestKind {
            $(
                #[doc = concat!("[`Request::", stringify!($variant), "`].")]
                $variant,
            )*
        }

        impl RequestKind {
            /// Every kind, in the table's order ([`RequestKind::index`]).
            pub const ALL: &'static [RequestKind] = &[$(RequestKind::$variant),*];

            /// The kind's row in the table.
            pub const fn class(self) -> RequestClass {
                match self {
                    $(RequestKind::$variant => $class,)*
                }
            }
        }

        impl Request {
            /// The request's kind.
            pub const fn kind(&self) -> RequestKind {
                match self {
                    $(Request::$variant { .. } => RequestKind::$variant,)*
                }
            }
        }
    };
}
pub(crate) use requests;

impl RequestKind {
    /// The kind's place in [`RequestKind::ALL`].
    pub const fn index(self) -> usize {
        self as usize
    }

    /// The kind's name ([`RequestClass::name`]).
    pub const fn name(self) -> &'static str {
        self.class().name
    }
}

impl Request {
    /// The row of the request's kind ([`RequestKind::class`]).
    pub const fn class(&self) -> RequestClass {
        self.kind().class()
    }

    /// Whether serving it is quick ([`Cost::Quick`]), deciding by its arguments where its
    /// kind's cost depends on them.
    pub fn is_quick(&self) -> bool {
        match self.class().cost {
            Cost::Quick => true,
            Cost::Slow => false,
            Cost::Depends => match self {
                // A size change may zero a tail after a flush.
                Request::SetAttr { set, .. } => set.size.is_none(),
                // May wait (up to a second) for another owner's record lock to go.
                Request::SetLk { wait_ms, .. } => *wait_ms == 0,
                _ => false,
            },
        }
    }

    /// What the request does, as a client must know it (its kind's row).
    pub fn effects(&self) -> Effects {
        let class = self.class();
        Effects {
            changes_namespace: class.changes_namespace,
            may_repeat: class.may_repeat,
        }
    }

    /// [`Effects::changes_namespace`] of the request.
    pub fn changes_namespace(&self) -> bool {
        self.class().changes_namespace
    }

    /// [`Effects::may_repeat`] of the request.
    pub fn may_repeat(&self) -> bool {
        self.class().may_repeat
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_its_own_name_and_place() {
        let mut names: Vec<&str> = RequestKind::ALL.iter().map(|k| k.name()).collect();
        for (i, kind) in RequestKind::ALL.iter().enumerate() {
            assert_eq!(kind.index(), i);
        }
        assert_eq!(Request::Statfs.kind(), RequestKind::Statfs);
        assert_eq!(Request::Statfs.kind().name(), "statfs");
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), RequestKind::ALL.len());
    }

    #[test]
    fn a_change_of_the_namespace_is_never_repeated() {
        for kind in RequestKind::ALL {
            let class = kind.class();
            assert!(
                !(class.changes_namespace && class.may_repeat),
                "{}",
                class.name
            );
        }
        assert!(!Request::Fsync { ino: 2 }.is_quick());
        assert!(Request::Fsync { ino: 2 }.may_repeat());
        assert!(Request::Cluster.may_repeat());
        assert!(!Request::Fence.changes_namespace());
        assert!(!Request::Statfs.class().changes_inodes);
    }

    /// The fuzzers' seed requests hold one of every kind, so that a new row gets a seed.
    #[test]
    fn the_samples_hold_every_kind() {
        let samples = crate::fuzz::sample_requests();
        for kind in RequestKind::ALL {
            assert!(
                samples.iter().any(|r| r.kind() == *kind),
                "no sample request of kind {}",
                kind.name()
            );
        }
    }
}
