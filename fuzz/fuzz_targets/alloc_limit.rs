//! The targets' global allocator: the system allocator, except that a single allocation (or
//! reallocation) above [`LIMIT`] aborts the process, which libFuzzer reports as a crash with
//! its input. libFuzzer's own `-malloc_limit_mb` needs a sanitizer's malloc hooks, which a
//! `--sanitizer none` build does not have; this is its replacement (`-rss_limit_mb` still
//! works: it samples the resident size).

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;

/// The largest single allocation a target may make: 1 GiB (scripts/fuzz.sh's
/// `-malloc_limit_mb=1024`).
pub const LIMIT: usize = 1 << 30;

pub struct Limited;

fn over() -> ! {
    // Writes to stderr without allocating (the message is static), then aborts.
    let _ = std::io::stderr().write_all(b"\n==alloc_limit== single allocation above 1 GiB\n");
    std::process::abort()
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged (so it
// upholds `GlobalAlloc`'s contract exactly as `System` does) or aborts before allocating.
unsafe impl GlobalAlloc for Limited {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > LIMIT {
            over();
        }
        // SAFETY: forwarded unchanged; the caller upholds `alloc`'s contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() > LIMIT {
            over();
        }
        // SAFETY: forwarded unchanged; the caller upholds `alloc_zeroed`'s contract.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged; `ptr` was allocated by `System` through this type.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > LIMIT {
            over();
        }
        // SAFETY: forwarded unchanged; the caller upholds `realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}
