//! Cooperative cancellation: SIGINT/SIGTERM set a flag that the output
//! writer checks on every write, so an interrupted conversion fails like
//! any other error and its temporary file is removed.
//!
//! A second signal while the first is being handled is left to the default
//! action (the handler resets itself), so a stuck process can still be
//! killed; even then the temporary file has no "GGUF" magic and a name that
//! is not the output's (see `output`).

use std::sync::atomic::{AtomicBool, Ordering};

static CANCELLED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(sig: libc::c_int) {
    CANCELLED.store(true, Ordering::SeqCst);
    // SAFETY: signal() is async-signal-safe; restoring the default action
    // lets a second signal terminate the process.
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
    }
}

/// Installs the SIGINT and SIGTERM handlers (call once, from a binary).
pub fn install_signal_handlers() {
    let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic and calls signal(),
        // both async-signal-safe; it lives for the whole program.
        unsafe {
            libc::signal(sig, handler);
        }
    }
}

/// Whether a cancellation was requested.
pub fn is_cancelled() -> bool {
    CANCELLED.load(Ordering::Relaxed)
}
