//! CitronFS's file-system tests, in `tests/`: each starts an in-process cluster with the one
//! harness, the `testkit` crate, and drives real FUSE mounts of it with `std::fs` and ordinary
//! tools.
//!
//! - `posix_model`: random operation sequences against a model of POSIX semantics;
//! - `tools`: cp -a, diff -r, tar, find, mv, ln, dd, rm -r through a mount, on shm and tcp;
//! - `coherence`: two client *processes* see one coherent file, under every lock scheme;
//! - `atomic_io`: reads and writes up to the mount's atomic bound are never torn;
//! - `growth`: a file grows past its lock tree while writers run;
//! - `pause`: a client stopped past its lease neither blocks others nor lands a late write;
//! - `faults`: restarts keep namespace and data, a full data server gives ENOSPC, refusals.
//!
//! Tests skip, saying why, where FUSE is missing (`testkit::skip_without_fuse!`). This library
//! is empty: a package needs a target, and the tests need nothing shared beyond the kit.
