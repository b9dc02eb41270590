//! ggml's RPC backend (its `ggml-rpc` module, built from the vendored
//! source): devices of other processes or machines used as if local, and
//! the server that offers this machine's devices. The protocol is ggml's
//! own and has no authentication: whoever reaches a server's port can run
//! code on its devices and read their memory.
//!
//! Both sides go through the module's registry (`ggml_backend_rpc_add_server`,
//! `ggml_backend_rpc_start_server` by name), so nothing RPC-specific is
//! linked, as for every other backend.

use super::backend::{devices, load_backends, Device};
use super::error::{GgmlError, Result};
use crate::sys;
use std::ffi::{c_char, c_void, CString};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

/// The RPC module's registry entry.
fn registry() -> Result<sys::ggml_backend_reg_t> {
    load_backends()?;
    let name = CString::new("RPC").expect("no NUL");
    // SAFETY: a query of the global registry by a NUL-terminated name.
    let reg = unsafe { sys::ggml_backend_reg_by_name(name.as_ptr()) };
    if reg.is_null() {
        return Err(GgmlError::NoDevice(
            "RPC (libggml-rpc.so is not next to the executable)",
        ));
    }
    Ok(reg)
}

/// The RPC module's function `name`.
fn proc(name: &str) -> Result<*mut c_void> {
    let reg = registry()?;
    let c = CString::new(name).expect("no NUL");
    // SAFETY: reg is the RPC registry entry; c is NUL-terminated.
    let p = unsafe { sys::ggml_backend_reg_get_proc_address(reg, c.as_ptr()) };
    if p.is_null() {
        return Err(GgmlError::Rpc(format!("the RPC module has no {name}")));
    }
    Ok(p)
}

/// `HOST:PORT` resolved, or an error naming what is wrong with it.
pub fn resolve(endpoint: &str) -> Result<SocketAddr> {
    let bad = |why: String| GgmlError::Rpc(format!("RPC endpoint {endpoint:?}: {why}"));
    let (host, port) = endpoint
        .rsplit_once(':')
        .ok_or_else(|| bad("expected HOST:PORT".into()))?;
    if host.is_empty() {
        return Err(bad("no host".into()));
    }
    port.parse::<u16>()
        .map_err(|_| bad(format!("port {port:?} is not a number from 0 to 65535")))?;
    endpoint
        .to_socket_addrs()
        .map_err(|e| bad(e.to_string()))?
        .next()
        .ok_or_else(|| bad("the host resolves to no address".into()))
}

/// Adds the devices of the RPC server at `endpoint` (`HOST:PORT`) to
/// ggml's registry and returns them. The server is reached first (ggml's
/// module aborts the process on a server it cannot reach), within
/// `timeout`.
pub fn add_server(endpoint: &str, timeout: Duration) -> Result<Vec<Device>> {
    let addr = resolve(endpoint)?;
    TcpStream::connect_timeout(&addr, timeout).map_err(|e| {
        GgmlError::Rpc(format!(
            "cannot reach the RPC server at {endpoint} ({addr}): {e} (is `strata rpc-server` running there?)"
        ))
    })?;
    let f = proc("ggml_backend_rpc_add_server")?;
    let c = CString::new(endpoint).map_err(|_| GgmlError::Rpc("NUL in endpoint".into()))?;
    // SAFETY: the registry hands out this symbol as
    // `ggml_backend_reg_t (const char *)`; it copies the endpoint. A repeated
    // endpoint returns the registry entry it made the first time.
    let reg = unsafe {
        let f: unsafe extern "C" fn(*const c_char) -> sys::ggml_backend_reg_t =
            std::mem::transmute(f);
        f(c.as_ptr())
    };
    if reg.is_null() {
        return Err(GgmlError::Rpc(format!(
            "the RPC server at {endpoint} offers no device"
        )));
    }
    // SAFETY: reg is a live registry entry the RPC module made.
    let n = unsafe { sys::ggml_backend_reg_dev_count(reg) };
    // SAFETY: plain queries of the global registry and of reg (i < n).
    let devs: Vec<sys::ggml_backend_dev_t> = (0..n)
        .map(|i| unsafe { sys::ggml_backend_reg_dev_get(reg, i) })
        .collect();
    let registered = devices()?;
    if !registered.iter().any(|d| devs.contains(&d.raw())) {
        // SAFETY: reg lives for the process (the module keeps it in a
        // static map), so the registry may keep it.
        unsafe { sys::ggml_backend_register(reg) };
    }
    Ok(devices()?
        .into_iter()
        .filter(|d| devs.contains(&d.raw()))
        .collect())
}

/// Serves `devices` on `endpoint` (`HOST:PORT`) until the process ends,
/// with `threads` CPU threads for a CPU device and `cache_dir` (if any)
/// keeping tensors clients sent before, so that a client can skip sending
/// them again. Returns only if the server could not start.
pub fn serve(
    endpoint: &str,
    devices: &[Device],
    threads: usize,
    cache_dir: Option<&std::path::Path>,
) -> Result<()> {
    let f = proc("ggml_backend_rpc_start_server")?;
    let c = CString::new(endpoint).map_err(|_| GgmlError::Rpc("NUL in endpoint".into()))?;
    let cache = cache_dir
        .map(|d| CString::new(d.to_string_lossy().as_bytes()))
        .transpose()
        .map_err(|_| GgmlError::Rpc("NUL in the cache directory".into()))?;
    let mut devs: Vec<sys::ggml_backend_dev_t> = devices.iter().map(Device::raw).collect();
    // SAFETY: the registry hands out this symbol with the signature of
    // ggml_backend_rpc_start_server; the strings and the device array
    // outlive the call (which serves until the process ends).
    unsafe {
        let f: unsafe extern "C" fn(
            *const c_char,
            *const c_char,
            usize,
            usize,
            *mut sys::ggml_backend_dev_t,
        ) = std::mem::transmute(f);
        f(
            c.as_ptr(),
            cache.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
            threads,
            devs.len(),
            devs.as_mut_ptr(),
        );
    }
    Err(GgmlError::Rpc(format!(
        "the RPC server on {endpoint} stopped (is the port free?)"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_checked_before_anything_is_reached() {
        assert!(resolve("127.0.0.1:50052").is_ok());
        for bad in ["127.0.0.1", ":50052", "127.0.0.1:port", "127.0.0.1:70000"] {
            let e = resolve(bad).unwrap_err().to_string();
            assert!(e.contains(bad), "{e}");
        }
    }
}
