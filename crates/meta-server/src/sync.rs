//! The one way this crate takes its mutexes.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, ignoring poison.
///
/// A panic while holding a lock leaves the state as consistent as sled left it; the server
/// keeps serving rather than poisoning every later request.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
