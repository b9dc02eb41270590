//! Devices, backend instances, buffers and events.
//!
//! Backends are modules (`libggml-cpu-*.so`, `libggml-cuda.so`) loaded once by
//! [`load_backends`] from the directory of the running executable (or
//! `STRATA_BACKEND_DIR`). Two [`Backend`]s on one device have their own
//! streams; buffers of the device's type work with both.

use super::buffer::BufferType;
use super::context::Tensor;
use super::error::GgmlError;
use super::error::Result;
use super::rows::cstr_to_string;
use crate::sys;
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::OnceLock;

/// File written next to a backend module built outside cargo
/// (tools/build-cuda-module.sh): the ggml version it was built from.
pub const MODULE_STAMP_SUFFIX: &str = ".ggml-version";

/// The CUDA module's row-limit setter (vendor/patches/0001-cuda-mmq-max-rows.patch).
const GEMM_SWITCH: &str = "ggml_backend_cuda_set_mmq_max_rows";

/// The most CPU threads a backend's pool takes (ggml's pool fails to
/// start more; `--threads` refuses them).
pub const MAX_THREADS: usize = 1024;

static LOADED: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();

fn candidate_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(d) = std::env::var_os("STRATA_BACKEND_DIR") {
        dirs.push(PathBuf::from(d));
    }
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe.parent() {
            dirs.push(dir.to_path_buf());
            // test binaries live in target/<profile>/deps
            if let Some(up) = dir.parent() {
                dirs.push(up.to_path_buf());
            }
        }
    }
    dirs
}

fn has_module(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten().any(|e| {
                let n = e.file_name();
                let n = n.to_string_lossy();
                n.starts_with("libggml-cpu") && n.ends_with(".so")
            })
        })
        .unwrap_or(false)
}

/// The source identity a module's stamp must name: the archive's sha256
/// and the patches applied (`vendor/source.sh id`); for the CUDA module,
/// only the patches of files it is built from (`vendor/source.sh id
/// cuda`), so that a CPU-only patch leaves a built module valid.
fn expected_stamp(module: &str) -> String {
    let source = if module.starts_with("libggml-cuda") {
        env!("STRATA_GGML_SOURCE_CUDA")
    } else {
        env!("STRATA_GGML_SOURCE")
    };
    format!("{} {source}", super::rows::version())
}

/// Refuses a backend module whose version stamp names another ggml: the
/// stamp's first line is the ggml version, the second the identity of the
/// vendored source it was built from ([`expected_stamp`]).
fn check_module_stamps(dir: &Path) -> std::result::Result<(), GgmlError> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(module) = name.strip_suffix(MODULE_STAMP_SUFFIX) {
            let expected = expected_stamp(module);
            let text = std::fs::read_to_string(e.path()).unwrap_or_default();
            let found = text.lines().map(str::trim).collect::<Vec<_>>().join(" ");
            if found.trim() != expected {
                return Err(GgmlError::VersionMismatch {
                    module: module.to_string(),
                    found,
                    expected,
                });
            }
        }
    }
    Ok(())
}

/// Makes a fatal ggml error (its GGML_ABORT: a failed assertion, a lost
/// RPC server) end the process with `error: ggml: MESSAGE` and exit status
/// 1, instead of ggml's default of a backtrace through a debugger and a
/// core dump. For programs, not for the library's callers: the process
/// still ends.
pub fn exit_on_fatal_errors() {
    unsafe extern "C" fn on_abort(msg: *const std::os::raw::c_char) {
        let text = if msg.is_null() {
            String::new()
        } else {
            // SAFETY: ggml passes a NUL-terminated message valid for the call.
            unsafe { std::ffi::CStr::from_ptr(msg) }
                .to_string_lossy()
                .into_owned()
        };
        let hint = if text.contains("RPC") {
            " (the RPC server went away or answered garbage)"
        } else {
            ""
        };
        eprintln!("error: ggml: {}{hint}", text.trim_end());
        // SAFETY: _exit ends the process at once: no destructor of ggml's
        // static state (an RPC client's threads, a device's streams) may
        // run, and none of them could finish with the fault still there.
        unsafe { libc::_exit(1) };
    }
    // SAFETY: the callback is a plain function valid for the program's
    // lifetime and safe to call from any thread.
    unsafe { sys::ggml_set_abort_callback(Some(on_abort)) };
}

/// Sends ggml's log to `tracing`: warnings and errors as warnings, the
/// rest (module loading, weight repacking) at debug level, instead of
/// ggml's default of printing everything to stderr.
fn route_logs() {
    unsafe extern "C" fn to_tracing(
        level: sys::ggml_log_level,
        text: *const std::os::raw::c_char,
        _: *mut std::ffi::c_void,
    ) {
        if text.is_null() {
            return;
        }
        // SAFETY: ggml passes a NUL-terminated message valid for the call.
        let msg = unsafe { std::ffi::CStr::from_ptr(text) }.to_string_lossy();
        let msg = msg.trim_end();
        if msg.is_empty() {
            return;
        }
        if level == sys::GGML_LOG_LEVEL_WARN || level == sys::GGML_LOG_LEVEL_ERROR {
            tracing::warn!(target: "ggml", "{msg}");
        } else {
            tracing::debug!(target: "ggml", "{msg}");
        }
    }
    // SAFETY: the callback is a plain function valid for the program's
    // lifetime and safe to call from any thread.
    unsafe { sys::ggml_log_set(Some(to_tracing), std::ptr::null_mut()) };
}

/// Loads every backend module found next to the executable, once per process.
/// Returns the directory they came from.
pub fn load_backends() -> Result<PathBuf> {
    let res = LOADED.get_or_init(|| {
        let dirs = candidate_dirs();
        let Some(dir) = dirs.iter().find(|d| has_module(d)) else {
            let searched = dirs
                .iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>();
            return Err(format!("no libggml-cpu*.so in {}", searched.join(", ")));
        };
        check_module_stamps(dir).map_err(|e| e.to_string())?;
        route_logs();
        let c = CString::new(dir.to_string_lossy().as_bytes()).map_err(|e| e.to_string())?;
        // SAFETY: c is a valid NUL-terminated path; the loader copies what it needs.
        unsafe { sys::ggml_backend_load_all_from_path(c.as_ptr()) };
        // SAFETY: plain query of the global registry.
        if unsafe { sys::ggml_backend_dev_count() } == 0 {
            return Err(format!("no device registered from {}", dir.display()));
        }
        Ok(dir.clone())
    });
    res.clone().map_err(|msg| {
        if msg.contains("was built from ggml") {
            GgmlError::ModuleRefused(msg)
        } else {
            GgmlError::NoBackends { searched: msg }
        }
    })
}

/// A device from ggml's registry. Devices live as long as the process.
#[derive(Clone, Copy, Debug)]
pub struct Device(sys::ggml_backend_dev_t);

// SAFETY: device handles are immutable registry entries, usable from any thread.
unsafe impl Send for Device {}
// SAFETY: as above: shared references only read the registry entry.
unsafe impl Sync for Device {}

/// The first CPU device (loads backends if needed).
pub fn cpu_device() -> Result<Device> {
    load_backends()?;
    // SAFETY: query of the global registry; null if there is none.
    let d = unsafe { sys::ggml_backend_dev_by_type(sys::GGML_BACKEND_DEVICE_TYPE_CPU) };
    if d.is_null() {
        return Err(GgmlError::NoDevice("CPU"));
    }
    Ok(Device(d))
}

/// The first local GPU device, if a GPU backend module is loaded (remote
/// devices, which ggml lists as GPUs, are not local).
pub fn gpu_device() -> Result<Option<Device>> {
    Ok(devices()?
        .into_iter()
        .find(|d| d.is_gpu() && !d.is_remote()))
}

/// The first remote device (an RPC server's, added by
/// [`super::rpc::add_server`]), if any.
pub fn remote_device() -> Result<Option<Device>> {
    Ok(devices()?.into_iter().find(Device::is_remote))
}

/// Every device of the loaded backends, in the registry's order.
pub fn devices() -> Result<Vec<Device>> {
    load_backends()?;
    // SAFETY: a query of the global registry.
    let n = unsafe { sys::ggml_backend_dev_count() };
    Ok((0..n)
        // SAFETY: i is below the registry's device count.
        .map(|i| unsafe { sys::ggml_backend_dev_get(i) })
        .filter(|d| !d.is_null())
        .map(Device)
        .collect())
}

impl Device {
    pub fn name(&self) -> String {
        // SAFETY: self.0 is a registered device; the name is a static string.
        unsafe { cstr_to_string(sys::ggml_backend_dev_name(self.0)) }
    }
    pub fn description(&self) -> String {
        // SAFETY: as above.
        unsafe { cstr_to_string(sys::ggml_backend_dev_description(self.0)) }
    }
    pub fn is_cpu(&self) -> bool {
        // SAFETY: plain query.
        unsafe { sys::ggml_backend_dev_type(self.0) == sys::GGML_BACKEND_DEVICE_TYPE_CPU }
    }
    pub fn is_gpu(&self) -> bool {
        // SAFETY: plain query.
        unsafe { sys::ggml_backend_dev_type(self.0) == sys::GGML_BACKEND_DEVICE_TYPE_GPU }
    }
    /// Whether the device is another process's, reached through ggml's RPC
    /// backend.
    pub fn is_remote(&self) -> bool {
        // SAFETY: the device's registry entry and its name are static.
        unsafe {
            let reg = sys::ggml_backend_dev_backend_reg(self.0);
            !reg.is_null() && cstr_to_string(sys::ggml_backend_reg_name(reg)) == "RPC"
        }
    }
    /// (free, total) bytes of device memory.
    pub fn memory(&self) -> (usize, usize) {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both pointers are valid for writes.
        unsafe { sys::ggml_backend_dev_memory(self.0, &mut free, &mut total) };
        (free, total)
    }
    /// Starts a new backend instance (its own stream on a GPU).
    pub fn init_backend(&self) -> Result<Backend> {
        // SAFETY: self.0 is a registered device; null params means defaults.
        let b = unsafe { sys::ggml_backend_dev_init(self.0, std::ptr::null()) };
        NonNull::new(b)
            .map(|ptr| Backend {
                ptr,
                device: *self,
                threadpool: None,
            })
            .ok_or_else(|| GgmlError::BackendInit(self.name()))
    }
    pub fn buffer_type(&self) -> BufferType {
        // SAFETY: plain query; the buffer type lives as long as the device.
        BufferType(unsafe { sys::ggml_backend_dev_buffer_type(self.0) })
    }
    /// The device's pinned host buffer type, if it has one.
    pub fn host_buffer_type(&self) -> Option<BufferType> {
        // SAFETY: plain query.
        let t = unsafe { sys::ggml_backend_dev_host_buffer_type(self.0) };
        (!t.is_null()).then_some(BufferType(t))
    }
    /// Looks up a backend-specific function by name in the device's module.
    pub fn proc_address(&self, name: &str) -> Option<*mut std::ffi::c_void> {
        let c = CString::new(name).ok()?;
        // SAFETY: reg is the device's registry entry; c is NUL-terminated.
        let p = unsafe {
            let reg = sys::ggml_backend_dev_backend_reg(self.0);
            sys::ggml_backend_reg_get_proc_address(reg, c.as_ptr())
        };
        (!p.is_null()).then_some(p)
    }
    pub fn raw(&self) -> sys::ggml_backend_dev_t {
        self.0
    }
}

impl Device {
    /// Whether this device's module can be told a row limit above which
    /// dense products of quantized weights leave ggml's quantized kernels
    /// (MMQ) for 16-bit tensor-core GEMM (cuBLAS): the CUDA module built
    /// with vendor/patches/0001-cuda-mmq-max-rows.patch.
    pub fn has_gemm_switch(&self) -> bool {
        !self.is_cpu() && self.proc_address(GEMM_SWITCH).is_some()
    }

    /// Sets that limit for the whole process: products of more than
    /// `rows` rows (activation columns) go to cuBLAS, `None` restores
    /// ggml's own choice. Returns false (and changes nothing) when the
    /// module has no such switch.
    pub fn set_mmq_max_rows(&self, rows: Option<u32>) -> bool {
        if self.is_cpu() {
            return false;
        }
        let Some(f) = self.proc_address(GEMM_SWITCH) else {
            return false;
        };
        // SAFETY: the patched CUDA registry hands out this symbol as
        // `void (int64_t)`; it stores the value in an atomic the kernels'
        // dispatch reads, so it is safe to call from any thread at any time.
        unsafe {
            let f: unsafe extern "C" fn(i64) = std::mem::transmute(f);
            f(rows.map_or(-1, i64::from));
        }
        true
    }

    /// The CPU's extra buffer types (repacked weight layouts such as
    /// CPU_REPACK or AMX), in the order llama.cpp prefers them. Empty for
    /// other devices or when the CPU module offers none.
    pub fn extra_buffer_types(&self) -> Vec<BufferType> {
        let Some(f) = self.proc_address("ggml_backend_dev_get_extra_bufts") else {
            return Vec::new();
        };
        // SAFETY: the registry hands out this symbol with the
        // ggml_backend_dev_get_extra_bufts_t signature; it returns a
        // NULL-terminated static array of buffer types.
        unsafe {
            let f: unsafe extern "C" fn(
                sys::ggml_backend_dev_t,
            ) -> *mut sys::ggml_backend_buffer_type_t = std::mem::transmute(f);
            let mut p = f(self.0);
            let mut out = Vec::new();
            while !p.is_null() && !(*p).is_null() {
                out.push(BufferType(*p));
                p = p.add(1);
            }
            out
        }
    }

    /// Whether a weight of type `ty` and shape `ne` may live in `buft` when
    /// this device computes `mul_mat(weight, f32 activations)` (for stacked
    /// experts, [k, m, n_expert], `mul_mat_id`): the test
    /// llama.cpp makes before putting a weight into an extra buffer type
    /// (a dummy op whose weight sits in an empty buffer of that type).
    pub fn supports_weight(
        &self,
        buft: BufferType,
        ty: crate::dtype::GgmlType,
        ne: &[i64],
    ) -> bool {
        let Ok(ctx) = super::context::Context::new(4, 0) else {
            return false;
        };
        let w = ctx.new_tensor(ty, ne);
        // stacked experts ([k, m, n_expert]) are multiplied by expert ids
        let op = if ne.len() >= 3 && ne[2] > 1 {
            let used = ne[2].min(8);
            let x = ctx.new_tensor(crate::dtype::GgmlType::F32, &[ne[0], used, 512]);
            let ids = ctx.new_tensor(crate::dtype::GgmlType::I32, &[used, 512]);
            ctx.mul_mat_id(w, x, ids)
        } else {
            let x = ctx.new_tensor(crate::dtype::GgmlType::F32, &[ne[0], 512]);
            ctx.mul_mat(w, x)
        };
        // SAFETY: a zero-sized buffer of `buft` only serves as the weight's
        // buffer tag for the query; it is freed below and the tensors are
        // never computed.
        unsafe {
            let buf = sys::ggml_backend_buft_alloc_buffer(buft.0, 0);
            if buf.is_null() {
                return false;
            }
            (*w.raw()).buffer = buf;
            let ok = sys::ggml_backend_dev_supports_op(self.0, op.raw());
            (*w.raw()).buffer = std::ptr::null_mut();
            sys::ggml_backend_buffer_free(buf);
            ok
        }
    }
}

/// An owned backend instance.
pub struct Backend {
    ptr: NonNull<sys::ggml_backend>,
    device: Device,
    /// A CPU thread pool this backend uses (freed after the backend).
    threadpool: Option<sys::ggml_threadpool_t>,
}

// SAFETY: a backend is used by one thread at a time (we never share &Backend
// across threads for computing); ggml backends may be moved between threads.
unsafe impl Send for Backend {}

impl Backend {
    pub fn device(&self) -> Device {
        self.device
    }
    pub fn raw(&self) -> sys::ggml_backend_t {
        self.ptr.as_ptr()
    }
    /// Sets the CPU thread count (no-op on backends without that function).
    pub fn set_n_threads(&self, n: usize) {
        if self.device.is_cpu() {
            // SAFETY: self is a live CPU backend; the shim calls the module's
            // function with the signature ggml-cpu.h declares.
            unsafe { sys::strata_cpu_set_n_threads(self.raw(), n.min(i32::MAX as usize) as i32) };
        }
    }
    /// Makes a CPU backend use ggml's reference kernels: one query row at a
    /// time through attention (no tiled or split-KV flash attention), no
    /// sgemm tiles, no fused ops. Each row's arithmetic then no longer
    /// depends on how many other rows share the step (batch invariance), at
    /// a cost in speed. Returns false on backends without the switch.
    pub fn set_use_ref(&self, on: bool) -> bool {
        // SAFETY: as set_n_threads.
        self.device.is_cpu() && unsafe { sys::strata_cpu_set_use_ref(self.raw(), on) }
    }
    /// Gives a CPU backend a persistent thread pool of `n` threads, so each
    /// graph computation does not start and join its own threads (strata
    /// computes one small graph per layer group). No-op on other backends.
    /// `poll`: ggml's polling level, 0 (workers sleep between graphs) to 100
    /// (they spin longest); llama.cpp's `--poll`, default 50.
    pub fn attach_cpu_threadpool(&mut self, n: usize, poll: u32) -> Result<()> {
        if !self.device.is_cpu() {
            return Ok(());
        }
        if n == 0 || n > MAX_THREADS {
            return Err(GgmlError::BackendInit(format!(
                "a thread pool of {n} threads (1 to {MAX_THREADS})"
            )));
        }
        // SAFETY: self is a live CPU backend without a pool (a second call
        // would leak the first: see below); the shim makes the pool with
        // ggml's default parameters and hands it to the backend.
        let tp = unsafe {
            sys::strata_cpu_attach_threadpool(self.raw(), n as i32, poll.min(100) as i32)
        };
        if tp.is_null() {
            return Err(GgmlError::BackendInit(format!(
                "thread pool of {n} threads"
            )));
        }
        if let Some(old) = self.threadpool.replace(tp) {
            // SAFETY: the backend now uses the new pool (set_threadpool
            // paused the old one); the old one has no other user.
            unsafe { sys::strata_cpu_threadpool_free(self.reg(), old) };
        }
        Ok(())
    }

    /// Puts a CPU backend's pool threads to sleep now instead of letting
    /// them poll for the next graph (ggml's hybrid polling spins for a few
    /// milliseconds after each graph). Call it before another engine
    /// computes on the same cores (a draft model and its target take
    /// turns); the next computation wakes the pool. No-op elsewhere.
    pub fn park_threads(&self) {
        if let Some(tp) = self.threadpool {
            // SAFETY: tp is the live pool this backend owns. Every
            // computation is synchronous on the CPU backend, so none is in
            // flight; ggml_graph_compute resumes a paused pool.
            unsafe { sys::strata_cpu_threadpool_pause(self.raw(), tp) };
        }
    }

    fn reg(&self) -> sys::ggml_backend_reg_t {
        // SAFETY: plain query of a static registry entry.
        unsafe { sys::ggml_backend_dev_backend_reg(self.device.raw()) }
    }

    /// Computes `graph` and waits for it.
    pub fn compute(&self, graph: &super::graph::Graph<'_>) -> Result<()> {
        // SAFETY: the graph's tensors are allocated (caller ran the allocator)
        // and outlive the call, which is synchronous.
        let st = unsafe { sys::ggml_backend_graph_compute(self.raw(), graph.raw()) };
        if st != sys::GGML_STATUS_SUCCESS {
            return Err(GgmlError::Compute(st));
        }
        Ok(())
    }
    /// Enqueues `graph` on this backend's stream.
    pub fn compute_async(&self, graph: &super::graph::Graph<'_>) -> Result<()> {
        // SAFETY: as compute; the caller keeps the graph and its buffers alive
        // until the backend is synchronized.
        let st = unsafe { sys::ggml_backend_graph_compute_async(self.raw(), graph.raw()) };
        if st != sys::GGML_STATUS_SUCCESS {
            return Err(GgmlError::Compute(st));
        }
        Ok(())
    }
    pub fn synchronize(&self) {
        // SAFETY: self owns a live backend.
        unsafe { sys::ggml_backend_synchronize(self.raw()) }
    }
    /// Enqueues a host-to-device copy on this backend's stream.
    ///
    /// # Safety
    /// `src` must stay valid and unmodified until the backend is synchronized
    /// (or an event recorded after this call completed); it is only truly
    /// asynchronous when `src` is pinned memory.
    pub unsafe fn tensor_set_async(&self, t: Tensor<'_>, src: &[u8], offset: usize) {
        sys::ggml_backend_tensor_set_async(
            self.raw(),
            t.raw(),
            src.as_ptr().cast(),
            offset,
            src.len(),
        );
    }
    /// Enqueues a copy of `src` (on this backend's device) into `dst` (on
    /// `dst_backend`'s device, maybe another GPU: a peer copy) on this
    /// backend's stream, and makes `dst_backend`'s stream wait for it. Where
    /// the backends cannot copy asynchronously, ggml drains both streams and
    /// copies synchronously.
    ///
    /// # Safety
    /// `src` and `dst` have the same size; neither is written (nor `dst`
    /// read) by anyone else until the copy completed.
    pub unsafe fn copy_tensor_async(
        &self,
        dst_backend: &Backend,
        src: Tensor<'_>,
        dst: Tensor<'_>,
    ) {
        sys::ggml_backend_tensor_copy_async(self.raw(), dst_backend.raw(), src.raw(), dst.raw());
    }
    /// Enqueues a device-to-host copy on this backend's stream.
    ///
    /// # Safety
    /// `dst` must stay valid and must not be read or written by anyone else
    /// until the backend is synchronized (or an event recorded after this
    /// call completed); `offset + dst.len()` must lie inside `t`.
    pub unsafe fn tensor_get_async(&self, t: Tensor<'_>, dst: &mut [u8], offset: usize) {
        sys::ggml_backend_tensor_get_async(
            self.raw(),
            t.raw(),
            dst.as_mut_ptr().cast(),
            offset,
            dst.len(),
        );
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        // SAFETY: we own the backend; nothing uses it after drop.
        unsafe { sys::ggml_backend_free(self.ptr.as_ptr()) }
        if let Some(tp) = self.threadpool.take() {
            // SAFETY: the pool was made by this device's module and its only
            // user (the backend) is gone.
            unsafe { sys::strata_cpu_threadpool_free(self.reg(), tp) };
        }
    }
}

/// An owned backend event.
pub struct Event {
    ptr: NonNull<sys::ggml_backend_event>,
}

// SAFETY: events are plain CUDA/CPU sync objects usable from any thread.
unsafe impl Send for Event {}

impl Event {
    pub fn new(device: Device) -> Result<Event> {
        // SAFETY: device is registered; null means the device has no events.
        let e = unsafe { sys::ggml_backend_event_new(device.raw()) };
        NonNull::new(e)
            .map(|ptr| Event { ptr })
            .ok_or_else(|| GgmlError::EventInit(device.name()))
    }
    /// Records the event at the current end of `backend`'s stream.
    pub fn record(&self, backend: &Backend) {
        // SAFETY: both handles are live.
        unsafe { sys::ggml_backend_event_record(self.ptr.as_ptr(), backend.raw()) }
    }
    /// Makes `backend`'s stream wait for this event.
    pub fn wait_on(&self, backend: &Backend) {
        // SAFETY: both handles are live.
        unsafe { sys::ggml_backend_event_wait(backend.raw(), self.ptr.as_ptr()) }
    }
    /// Blocks the host until the event completed.
    pub fn synchronize(&self) {
        // SAFETY: live event.
        unsafe { sys::ggml_backend_event_synchronize(self.ptr.as_ptr()) }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: we own the event.
        unsafe { sys::ggml_backend_event_free(self.ptr.as_ptr()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamp(dir: &Path, module: &str, source: &str) {
        let text = format!("{}\n{source}\n", super::super::rows::version());
        std::fs::write(dir.join(format!("{module}{MODULE_STAMP_SUFFIX}")), text).unwrap();
    }

    #[test]
    fn the_cuda_module_names_its_own_patches_and_others_every_patch() {
        let d = tempfile::tempdir().unwrap();
        stamp(d.path(), "libggml-cuda.so", env!("STRATA_GGML_SOURCE_CUDA"));
        stamp(d.path(), "libggml-rpc.so", env!("STRATA_GGML_SOURCE"));
        assert!(check_module_stamps(d.path()).is_ok());
        // a module stamped with another source is refused, naming it
        stamp(d.path(), "libggml-cuda.so", "0000+0001-other:000000000000");
        match check_module_stamps(d.path()) {
            Err(GgmlError::VersionMismatch { module, found, .. }) => {
                assert_eq!(module, "libggml-cuda.so");
                assert!(found.contains("0001-other"), "{found}");
            }
            other => panic!("expected a mismatch, got {other:?}"),
        }
    }

    #[test]
    fn the_cuda_identity_is_the_full_one_less_cpu_and_libllama_patches() {
        let full = env!("STRATA_GGML_SOURCE");
        let cuda = env!("STRATA_GGML_SOURCE_CUDA");
        let archive = |id: &str| id.split('+').next().unwrap().to_string();
        assert_eq!(archive(full), archive(cuda));
        let patches = |id: &str| id.split('+').skip(1).map(String::from).collect::<Vec<_>>();
        let (f, c) = (patches(full), patches(cuda));
        // every patch the module names is one of the source's, in order
        assert!(c.iter().all(|p| f.contains(p)), "{cuda} vs {full}");
        // and the ones it leaves out touch only the CPU backend or libllama
        for p in f.iter().filter(|p| !c.contains(p)) {
            let name = p.split(':').next().unwrap();
            let text = std::fs::read_to_string(format!(
                "{}/vendor/patches/{name}.patch",
                env!("CARGO_MANIFEST_DIR")
            ))
            .unwrap();
            for path in text.lines().filter_map(|l| l.strip_prefix("+++ ")) {
                let path = path.split_whitespace().next().unwrap();
                assert!(
                    path.starts_with("b/ggml/src/ggml-cpu/") || path.starts_with("b/src/"),
                    "{name} touches {path}, yet the CUDA module's identity leaves it out"
                );
            }
        }
    }
}
