//! The `citronfs` binary: the command is the `tools` library's ([`tools::main`]); the binary
//! adds the allocator.

/// mimalloc instead of glibc's malloc. The servers and the client allocate and free small
/// buffers on every request from many threads (RPC frames, batches, encoded attributes); glibc's
/// per-thread arenas spent a sixth of the meta server's create handler in `malloc`, `free` and
/// `malloc_consolidate` on the 2-core VM (`perf`, `bench meta --fs library`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    tools::main()
}
