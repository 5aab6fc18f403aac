//! Namespace calls: lookups, attributes, creation and removal of names, links, directories,
//! extended attributes and file-system totals, each one RPC to the meta server (the namespace
//! lives there, in sled; every mutation is one transaction) — except `getattr` and `lookup`,
//! which read the meta server's attribute and directory-entry tables one-sidedly and fall back
//! to the RPC.
//!
//! This module owns no state. Two rules it keeps:
//! - names are checked here (`check_name_for`) before they travel, with the same rules and
//!   errnos as the meta server, so a bad name costs no round trip — except `.` and `..`,
//!   whose answer depends on the parent (Linux checks the parent first), which the meta
//!   server checks;
//! - the size in an attribute of a file open on this client comes from its file control block
//!   (`fcb`'s `fresh_size`), not from the meta server, whose copy lags behind one-sided writes.

use crate::client::CitronFs;
use crate::dentries::{lookup_one_sided, OneSided};
use crate::error::Error;
use crate::fcb::{attr_one_sided, read_fcb};
use crate::handles::{FileHandle, FirstOpen};
use crate::meta::unexpected;
use proto::rpc::{check_name_for, is_dot, NameOp, Request, Response, XattrMode};
use proto::{Attr, Caller, DirEntry, FileKind, FsError, FsStats, Ino, SetAttr};
use std::time::Instant;

/// Checks a name given to `op` before it travels (see the module docs); `.` and `..` travel.
fn check(op: NameOp, name: &str) -> Result<(), Error> {
    if is_dot(name) {
        return Ok(());
    }
    Ok(check_name_for(op, name)?)
}

/// A one-sided read's outcome, or `fallback` (ask by RPC) when it failed below the file system:
/// the meta region's fabric broke (a restarted meta server, whose region a stale view still
/// names), and the RPC, which reconnects and so catches up with the cluster, answers instead
/// of the error. Any other failure stands.
fn or_rpc<T>(read: Result<T, Error>, fallback: T) -> Result<T, Error> {
    match read {
        // Fenced (the meta region's fabric refuses the session): the data path's reads and
        // writes find it too and join again; the RPC answers now.
        Err(e) if e.is_fenced() => {
            tracing::debug!(error = %crate::error::Chain(&e), "one-sided read refused; asking by RPC");
            Ok(fallback)
        }
        Err(e) if e.is_transient() => {
            tracing::debug!(error = %crate::error::Chain(&e), "one-sided read failed; asking by RPC");
            Ok(fallback)
        }
        other => other,
    }
}

impl CitronFs {
    /// The entry `name` in directory `parent`: resolved one-sidedly in the meta server's
    /// directory-entry and attribute tables (`dentries`: found, or absent, with no RPC) in the
    /// common cases; else by RPC.
    pub fn lookup(&self, parent: Ino, name: &str) -> Result<Attr, Error> {
        // Any call's rules: they differ only for `.` and `..`, which the server resolves.
        check(NameOp::Create, name)?;
        let one_sided = match is_dot(name) {
            // Not in the table: the meta server answers.
            true => Ok(OneSided::Unknown),
            false => self
                .inner
                .checkout()
                .and_then(|mut w| lookup_one_sided(&mut w, parent, name)),
        };
        match or_rpc(one_sided, OneSided::Unknown)? {
            OneSided::Found(attr) => return self.fresh_size(attr),
            OneSided::Absent => return Err(FsError::NotFound.into()),
            OneSided::Unknown => {}
        }
        let attr = self.inner.meta.attr_call(
            "Lookup",
            Request::Lookup {
                parent,
                name: name.into(),
            },
        )?;
        self.fresh_size(attr)
    }

    /// An inode's attributes; for a file open on this client the size comes one-sidedly from
    /// its file control block.
    ///
    /// Read one-sidedly from the meta server's attribute table when it holds the inode
    /// (`proto::attrs`: no RPC, no meta-server CPU); else, or when the read tore, by RPC.
    pub fn getattr(&self, ino: Ino) -> Result<Attr, Error> {
        let one_sided = self
            .inner
            .checkout()
            .and_then(|mut w| attr_one_sided(&mut w, ino));
        let attr = match or_rpc(one_sided, None)? {
            Some(attr) => attr,
            None => self
                .inner
                .meta
                .attr_call("GetAttr", Request::GetAttr { ino })?,
        };
        self.fresh_size(attr)
    }

    /// Changes attributes (chmod, chown, utimens, truncate). A size change takes the whole-file
    /// range lock around the `SetAttr` call, so no read or write of any client overlaps it.
    pub fn setattr(&self, caller: Caller, ino: Ino, set: SetAttr) -> Result<Attr, Error> {
        let attr = match set.size {
            None => self
                .inner
                .meta
                .attr_call("SetAttr", Request::SetAttr { ino, set, caller })?,
            Some(size) => {
                if size > self.inner.geometry.max_file_size() {
                    return Err(
                        FsError::Invalid(format!("size {size} exceeds the largest file")).into(),
                    );
                }
                let inode = self.inner.files.open_inode(&self.inner.meta, ino)?;
                let result = self
                    .truncate(&inode, caller, set)
                    .and_then(|attr| self.fresh_size(attr));
                self.inner.files.close_inode(&self.inner.meta, ino);
                return result;
            }
        };
        self.fresh_size(attr)
    }

    /// Creates a new regular file and opens it: one `Create` call (the name checked here
    /// first). `Exists` when the name is taken.
    fn create_new(
        &self,
        caller: Caller,
        parent: Ino,
        name: &str,
        perm: u16,
        flags: i32,
    ) -> Result<(Attr, FileHandle), Error> {
        check(NameOp::Create, name)?;
        let session = self.inner.meta.session();
        let creating = self.inner.files.creating();
        let opened = match self.inner.meta.call(Request::Create {
            parent,
            name: name.into(),
            perm,
            caller,
            scheme: self.inner.scheme,
        })? {
            Response::Open(opened) => opened,
            other => return Err(unexpected("Create", other)),
        };
        let attr = opened.attr.clone();
        let inode =
            self.inner
                .files
                .adopt_open(&self.inner.meta, creating, attr.ino, session, opened)?;
        Ok((attr, self.inner.files.new_handle(inode, caller, flags)))
    }

    /// Creates a file, device node, fifo or socket.
    pub fn mknod(
        &self,
        caller: Caller,
        parent: Ino,
        name: &str,
        kind: FileKind,
        perm: u16,
        rdev: u32,
    ) -> Result<Attr, Error> {
        check(NameOp::Create, name)?;
        if matches!(kind, FileKind::Dir | FileKind::Symlink) {
            return Err(FsError::Invalid(format!("mknod cannot create a {kind:?}")).into());
        }
        self.inner.meta.attr_call(
            "Mknod",
            Request::Mknod {
                parent,
                name: name.into(),
                kind,
                perm,
                rdev,
                caller,
            },
        )
    }

    /// Creates a regular file and opens it (`flags` as for [`CitronFs::open`]).
    ///
    /// Without `O_EXCL` this is `open(O_CREAT)`: when the name exists — another client created
    /// it after the kernel's lookup missed — the existing file is opened instead (POSIX), after
    /// the permission check the kernel could not make (it checked only the directory). With
    /// `O_EXCL` an existing name is `EEXIST`.
    pub fn create(
        &self,
        caller: Caller,
        parent: Ino,
        name: &str,
        perm: u16,
        flags: i32,
    ) -> Result<(Attr, FileHandle), Error> {
        // A name can flicker between existing and missing while other clients create and
        // unlink it; each round trip either creates it or finds it, so a few rounds suffice
        // unless someone loops create/unlink on exactly this name.
        const ROUNDS: usize = 8;
        for _ in 0..ROUNDS {
            match self.create_new(caller, parent, name, perm, flags & !libc::O_TRUNC) {
                Ok(created) => return Ok(created),
                Err(Error::Fs(FsError::Exists)) if flags & libc::O_EXCL == 0 => {}
                Err(e) => return Err(e),
            }
            let attr = match self.lookup(parent, name) {
                Ok(attr) => attr,
                Err(Error::Fs(FsError::NotFound)) => continue,
                Err(e) => return Err(e),
            };
            match attr.kind {
                FileKind::File => {}
                FileKind::Dir => return Err(FsError::IsDir.into()),
                // A device, fifo, socket or symlink created by another client under this name:
                // the kernel would have resolved it itself, had it seen it; let it retry.
                _ => return Err(FsError::Exists.into()),
            }
            may_open(&attr, caller, flags)?;
            let fh = self.open(caller, attr.ino, flags)?;
            return match self.fresh_size(attr) {
                Ok(attr) => Ok((attr, fh)),
                Err(e) => {
                    let _ = self.release(fh);
                    Err(e)
                }
            };
        }
        Err(FsError::Exists.into())
    }

    /// Creates a directory.
    pub fn mkdir(&self, caller: Caller, parent: Ino, name: &str, perm: u16) -> Result<Attr, Error> {
        check(NameOp::Create, name)?;
        self.inner.meta.attr_call(
            "Mkdir",
            Request::Mkdir {
                parent,
                name: name.into(),
                perm,
                caller,
            },
        )
    }

    /// Removes a non-directory entry.
    pub fn unlink(&self, parent: Ino, name: &str) -> Result<(), Error> {
        check(NameOp::Unlink, name)?;
        self.inner.meta.ok_call(
            "Unlink",
            Request::Unlink {
                parent,
                name: name.into(),
            },
        )
    }

    /// Removes an empty directory.
    pub fn rmdir(&self, parent: Ino, name: &str) -> Result<(), Error> {
        check(NameOp::Rmdir, name)?;
        self.inner.meta.ok_call(
            "Rmdir",
            Request::Rmdir {
                parent,
                name: name.into(),
            },
        )
    }

    /// Renames `parent/name` to `new_parent/new_name`, replacing a compatible target unless
    /// `no_replace`.
    pub fn rename(
        &self,
        parent: Ino,
        name: &str,
        new_parent: Ino,
        new_name: &str,
        no_replace: bool,
    ) -> Result<(), Error> {
        check(NameOp::RenameFrom, name)?;
        check(NameOp::RenameTo { no_replace }, new_name)?;
        self.inner.meta.ok_call(
            "Rename",
            Request::Rename {
                parent,
                name: name.into(),
                new_parent,
                new_name: new_name.into(),
                no_replace,
                exchange: false,
            },
        )
    }

    /// Swaps the entries `parent/name` and `new_parent/new_name`, both of which must exist
    /// (`RENAME_EXCHANGE`).
    pub fn exchange(
        &self,
        parent: Ino,
        name: &str,
        new_parent: Ino,
        new_name: &str,
    ) -> Result<(), Error> {
        check(NameOp::RenameFrom, name)?;
        check(NameOp::RenameFrom, new_name)?;
        self.inner.meta.ok_call(
            "Rename",
            Request::Rename {
                parent,
                name: name.into(),
                new_parent,
                new_name: new_name.into(),
                no_replace: false,
                exchange: true,
            },
        )
    }

    /// Adds the hard link `new_parent/new_name` to `ino`.
    pub fn link(&self, ino: Ino, new_parent: Ino, new_name: &str) -> Result<Attr, Error> {
        check(NameOp::Create, new_name)?;
        let attr = self.inner.meta.attr_call(
            "Link",
            Request::Link {
                ino,
                new_parent,
                new_name: new_name.into(),
            },
        )?;
        self.fresh_size(attr)
    }

    /// Creates the symbolic link `parent/name` pointing to `target`.
    pub fn symlink(
        &self,
        caller: Caller,
        parent: Ino,
        name: &str,
        target: &str,
    ) -> Result<Attr, Error> {
        check(NameOp::Create, name)?;
        if target.len() > proto::SYMLINK_MAX {
            return Err(FsError::NameTooLong.into());
        }
        self.inner.meta.attr_call(
            "Symlink",
            Request::Symlink {
                parent,
                name: name.into(),
                target: target.into(),
                caller,
            },
        )
    }

    /// A symbolic link's target.
    pub fn readlink(&self, ino: Ino) -> Result<Vec<u8>, Error> {
        self.inner
            .meta
            .data_call("Readlink", Request::Readlink { ino })
    }

    /// Up to `max` entries of directory `ino` after `cookie` (0: from the start, with `.` and
    /// `..`); continue with the last entry's cookie.
    pub fn readdir(&self, ino: Ino, cookie: u64, max: u32) -> Result<Vec<DirEntry>, Error> {
        match self
            .inner
            .meta
            .call(Request::ReadDir { ino, cookie, max })?
        {
            Response::Entries(entries) => Ok(entries),
            other => Err(unexpected("ReadDir", other)),
        }
    }

    /// Like [`CitronFs::readdir`], with each entry's attributes (the size of a file open on
    /// this client from its control block): one RPC for what `ls -l` needs of `max` entries.
    pub fn readdirplus(
        &self,
        ino: Ino,
        cookie: u64,
        max: u32,
    ) -> Result<Vec<(DirEntry, Attr)>, Error> {
        match self
            .inner
            .meta
            .call(Request::ReadDirPlus { ino, cookie, max })?
        {
            Response::EntriesPlus(entries) => entries
                .into_iter()
                .map(|(entry, attr)| Ok((entry, self.fresh_size(attr)?)))
                .collect(),
            other => Err(unexpected("ReadDirPlus", other)),
        }
    }

    /// File-system totals.
    pub fn statfs(&self) -> Result<FsStats, Error> {
        match self.inner.meta.call(Request::Statfs)? {
            Response::Stats(stats) => Ok(stats),
            other => Err(unexpected("Statfs", other)),
        }
    }

    /// Sets an extended attribute.
    pub fn setxattr(
        &self,
        ino: Ino,
        name: &str,
        value: &[u8],
        mode: XattrMode,
    ) -> Result<(), Error> {
        if name.len() > proto::XATTR_NAME_MAX || value.len() > proto::XATTR_VALUE_MAX {
            return Err(FsError::NameTooLong.into());
        }
        self.inner.meta.ok_call(
            "SetXattr",
            Request::SetXattr {
                ino,
                name: name.into(),
                value: value.to_vec(),
                mode,
            },
        )
    }

    /// An extended attribute's value.
    pub fn getxattr(&self, ino: Ino, name: &str) -> Result<Vec<u8>, Error> {
        self.inner.meta.data_call(
            "GetXattr",
            Request::GetXattr {
                ino,
                name: name.into(),
            },
        )
    }

    /// Extended attribute names.
    pub fn listxattr(&self, ino: Ino) -> Result<Vec<String>, Error> {
        match self.inner.meta.call(Request::ListXattr { ino })? {
            Response::Names(names) => Ok(names),
            other => Err(unexpected("ListXattr", other)),
        }
    }

    /// Removes an extended attribute.
    pub fn removexattr(&self, ino: Ino, name: &str) -> Result<(), Error> {
        self.inner.meta.ok_call(
            "RemoveXattr",
            Request::RemoveXattr {
                ino,
                name: name.into(),
            },
        )
    }
}

/// Opens and closes of files, and the size of an open file's attributes.
impl CitronFs {
    /// Opens regular file `ino` for I/O. `flags` are open(2) flags: `O_TRUNC` truncates (under
    /// the whole-file lock), `O_APPEND` makes every write go to the current end of the file
    /// (under the whole-file lock, so appends of all clients serialize). The first open of an
    /// inode by this client sends `Open` to the meta server; the last release sends `Release`.
    ///
    /// An open for writing (or creating) of an inode that has no name any more (unlinked, kept
    /// by opens) and on which this client holds no handle is `Stale`: no path leads to it, so
    /// the caller reached it through a name it had cached from before another client removed
    /// it — the kernel's entry cache, for the FUSE adapter, which then looks the name up again
    /// — and what it wrote would be lost with the removed file (an `O_CREAT` open, SQLite's
    /// journal, would not create the file). Such an inode lives on while this client's own
    /// release of it still waits to ride on a call (a lingering open, see the module docs). An
    /// open for reading is let through: it reads the file as it was a moment before its
    /// removal, complete, where a new lookup could lose the race again to a next removal (a
    /// file replaced by rename, over and over).
    pub fn open(&self, caller: Caller, ino: Ino, flags: i32) -> Result<FileHandle, Error> {
        let (inode, first) = self.inner.files.open_inode_first(&self.inner.meta, ino)?;
        let writes = flags & libc::O_ACCMODE != libc::O_RDONLY || flags & libc::O_CREAT != 0;
        let first = if writes { first } else { FirstOpen::No };
        let nlink = match first {
            FirstOpen::Sent(nlink) => Some(nlink),
            // Taken back without an RPC: asked now (one-sidedly where the table has it).
            FirstOpen::Lingering => match self.getattr(ino) {
                Ok(attr) => Some(attr.nlink),
                Err(e) => {
                    self.inner.files.close_inode(&self.inner.meta, ino);
                    return Err(e);
                }
            },
            FirstOpen::No => None,
        };
        if nlink == Some(0) {
            self.inner.files.close_inode(&self.inner.meta, ino);
            return Err(FsError::Stale.into());
        }
        if flags & libc::O_TRUNC != 0 && flags & libc::O_ACCMODE != libc::O_RDONLY {
            let set = SetAttr {
                size: Some(0),
                // Linux clears set-ID bits on a truncate by a caller without CAP_FSETID.
                kill_suidgid: caller.uid != 0,
                ..SetAttr::default()
            };
            if let Err(e) = self.truncate(&inode, caller, set) {
                self.inner.files.close_inode(&self.inner.meta, ino);
                return Err(e);
            }
        }
        Ok(self.inner.files.new_handle(inode, caller, flags))
    }

    /// Closes a handle, giving back the record locks taken through it (`records`); the last
    /// handle of an inode on this client releases the inode.
    pub fn release(&self, fh: FileHandle) -> Result<(), Error> {
        let handle = self.inner.files.remove_handle(fh)?;
        // Before the inode's release, which may ride on a later call.
        self.inner.records.release_handle(&self.inner.meta, fh);
        self.inner
            .files
            .close_inode(&self.inner.meta, handle.inode.ino);
        Ok(())
    }

    /// The inode a handle is open on.
    pub fn handle_ino(&self, fh: FileHandle) -> Result<Ino, Error> {
        Ok(self.inner.files.handle(fh)?.inode.ino)
    }

    /// For a file open here, corrects the attributes with the FCB (`proto::fcb::live`: its
    /// SIZE and MTIME are the truth, updated one-sidedly by writers of every client). Read as
    /// the data path reads ([`Inner::retry`](crate::client::Inner::retry)): a client behind a meta server restart catches up
    /// and reads again, rather than failing a stat.
    fn fresh_size(&self, attr: Attr) -> Result<Attr, Error> {
        let started = Instant::now();
        if attr.kind != FileKind::File {
            return Ok(attr);
        }
        // Pinned: a release of the open cannot ride on another thread's call while the FCB
        // is read (the meta server would free the block, and another file take it).
        let inner = &*self.inner;
        let Some(open) = inner.files.pin_open(attr.ino) else {
            return Ok(attr);
        };
        let found = inner.retry(started, true, || {
            let mut w = inner.checkout()?;
            let inode = match inner.live_inode(&open, &w.view) {
                // Closed here meanwhile (a lingering open that a new session ended):
                // the attributes as read are the file's.
                Err(Error::Fs(FsError::Stale)) => return Ok(None),
                inode => inode?,
            };
            read_fcb(&mut w, &inode).map(Some)
        });
        inner.files.unpin_open(attr.ino);
        Ok(match found? {
            Some(found) => proto::fcb::live(attr, found.size, found.mtime),
            None => attr,
        })
    }
}

/// Whether `caller` may open `attr` with open(2) `flags`, by its mode bits (what the kernel's
/// `default_permissions` check would say; root may do anything). Used where the kernel could
/// not check: a file that appeared under a name between the kernel's lookup and its create.
fn may_open(attr: &Attr, caller: Caller, flags: i32) -> Result<(), FsError> {
    if caller.uid == 0 {
        return Ok(());
    }
    let mode = u32::from(attr.perm);
    let bits = if caller.uid == attr.uid {
        mode >> 6
    } else if caller.gid == attr.gid {
        mode >> 3
    } else {
        mode
    } & 0o7;
    let access = flags & libc::O_ACCMODE;
    let want_read = access != libc::O_WRONLY;
    let want_write = access != libc::O_RDONLY || flags & libc::O_TRUNC != 0;
    if (want_read && bits & 0o4 == 0) || (want_write && bits & 0o2 == 0) {
        return Err(FsError::Access);
    }
    Ok(())
}
