//! The device: driver loading, one context and ONE stream per [`Gpu`], device
//! buffers, pinned host buffers, copies and stream capture into graphs.
//!
//! Everything runs on the `Gpu`'s stream, in issue order, except the copies a caller
//! puts on the *copier* stream (`Lane::Copier`: pinned copies that overlap the kernels,
//! ordered against the stream by explicit waits both ways); launches and copies are
//! asynchronous unless their docs say otherwise. Buffers are plain allocations
//! (never managed memory). The driver is loaded at run time (cudarc's dynamic
//! loading), so a CUDA build starts on a machine without it and [`Gpu::open`] says so.

use crate::error::{gib, CudaError};
use crate::kernels::{Functions, K};
use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{result, DeviceRepr, ValidAsZeroBits};
use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A retained primary context. Buffers and graphs hold it, so it outlives them.
pub(crate) struct Ctx {
    dev: sys::CUdevice,
    raw: sys::CUcontext,
    ordinal: usize,
}

// SAFETY: a CUDA context may be made current on any thread; the driver API is
// thread-safe.
unsafe impl Send for Ctx {}
unsafe impl Sync for Ctx {}

impl Ctx {
    /// Makes the context current on the calling thread (cheap: a thread-local store).
    pub(crate) fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: `raw` is a retained primary context, alive while self is.
        unsafe { result::ctx::set_current(self.raw) }
            .map_err(|e| CudaError::driver("cuCtxSetCurrent", e))
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        // SAFETY: `dev` is the device whose primary context this retained once.
        unsafe {
            let _ = result::primary_ctx::release(self.dev);
        }
    }
}

/// Loads the driver library and initialises it; `Ok(false)` when the driver is there
/// but the machine has no CUDA device.
fn init_driver() -> Result<bool, CudaError> {
    // SAFETY: only tries to open the library by its usual names.
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaError::NoDriver);
    }
    let mut version = 0i32;
    // SAFETY: a plain out-parameter; valid before cuInit.
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| CudaError::driver("cuDriverGetVersion", e))?;
    if version < 13000 {
        return Err(CudaError::DriverTooOld {
            major: version / 1000,
            minor: (version % 1000) / 10,
        });
    }
    match result::init() {
        Ok(()) => Ok(true),
        Err(e) if e.0 == CUresult::CUDA_ERROR_NO_DEVICE => Ok(false),
        Err(e) => Err(CudaError::driver("cuInit", e)),
    }
}

/// Which of a [`Gpu`]'s two streams a pinned copy goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// The stream every kernel runs on: in issue order with them.
    Stream,
    /// The copier: after its earlier copies and what [`Gpu::copier_waits`] or
    /// [`Gpu::wait_event`] made it wait for, and before the stream's work only
    /// through an event ([`Gpu::stream_waits`], or [`Gpu::record`] on the copier and
    /// [`Gpu::wait_event`] on the stream). Not during capture.
    Copier,
}

/// One GPU: its primary context, the one stream every kernel and copy runs on, and
/// the loaded kernels.
pub struct Gpu {
    pub(crate) ctx: Arc<Ctx>,
    pub(crate) stream: sys::CUstream,
    /// The second stream, for copies that overlap the stream's kernels, and the
    /// events [`Gpu::copier_waits`] and [`Gpu::stream_waits`] order one stream after
    /// the other with.
    copier: sys::CUstream,
    stream_event: sys::CUevent,
    copier_event: sys::CUevent,
    /// Work was issued on the copier since it was last waited for (`sync` waits
    /// for the copier only then: a decode step syncs once a layer when tiered).
    copier_busy: AtomicBool,
    modules: Vec<sys::CUmodule>,
    pub(crate) funcs: Functions,
    name: String,
    cc: (i32, i32),
    pub(crate) sm_count: u32,
    capturing: AtomicBool,
    /// See [`Gpu::set_skip`].
    skipping: AtomicBool,
    /// Synchronise after every launch (outside capture) so that an asynchronous fault
    /// names the kernel that caused it ([`Gpu::set_diagnostics`]). For debugging.
    debug_sync: bool,
    /// Launch with programmatic stream serialization (sm_90 and later, unless
    /// [`Gpu::set_diagnostics`] turns it off): the next kernel is scheduled while the one before it runs
    /// and waits in `sc_pdl_enter` (kernels/sc_common.cuh) for it to finish, which
    /// hides the gap between the kernels of a step. The order of every memory access
    /// is unchanged.
    pdl: bool,
}

// SAFETY: the stream, modules and functions are driver handles usable from any thread
// once the context is current (every method binds it first). Launches from several
// threads at once interleave on the one stream in an unspecified order.
unsafe impl Send for Gpu {}
unsafe impl Sync for Gpu {}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Gpu({} {}, cc {}.{})",
            self.ctx.ordinal, self.name, self.cc.0, self.cc.1
        )
    }
}

fn attr(dev: sys::CUdevice, a: sys::CUdevice_attribute) -> Result<i32, CudaError> {
    // SAFETY: `dev` came from cuDeviceGet.
    unsafe { result::device::get_attribute(dev, a) }
        .map_err(|e| CudaError::driver(format!("cuDeviceGetAttribute({a:?})"), e))
}

impl Gpu {
    /// Number of CUDA devices (0 when the driver is installed but sees no GPU).
    pub fn device_count() -> Result<usize, CudaError> {
        if !init_driver()? {
            return Ok(0);
        }
        let n =
            result::device::get_count().map_err(|e| CudaError::driver("cuDeviceGetCount", e))?;
        Ok(n.max(0) as usize)
    }

    /// For diagnosis (the engine's environment switches `SCORIA_CUDA_SYNC` and
    /// `SCORIA_NO_PDL`): `sync` synchronises after every launch outside capture, so an
    /// asynchronous fault names its kernel; `no_pdl` launches without programmatic
    /// dependent launch. Call before any launch or capture.
    pub fn set_diagnostics(&mut self, sync: bool, no_pdl: bool) {
        self.debug_sync = sync;
        self.pdl = self.pdl && !no_pdl;
    }

    /// Opens device `ordinal`: retains its primary context, creates the stream and
    /// loads the kernels.
    pub fn open(ordinal: usize) -> Result<Gpu, CudaError> {
        let count = Gpu::device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoSuchDevice { ordinal, count });
        }
        let dev = result::device::get(ordinal as i32)
            .map_err(|e| CudaError::driver(format!("cuDeviceGet({ordinal})"), e))?;
        // SAFETY: `dev` came from cuDeviceGet.
        let raw = unsafe { result::primary_ctx::retain(dev) }
            .map_err(|e| CudaError::driver("cuDevicePrimaryCtxRetain", e))?;
        let ctx = Arc::new(Ctx { dev, raw, ordinal });
        ctx.bind()?;
        let name =
            result::device::get_name(dev).map_err(|e| CudaError::driver("cuDeviceGetName", e))?;
        use sys::CUdevice_attribute as A;
        let cc = (
            attr(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        );
        if cc.0 < 8 {
            return Err(CudaError::DeviceTooOld {
                device: name,
                cc_major: cc.0,
                cc_minor: cc.1,
            });
        }
        let sm_count = attr(dev, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as u32;
        let smem_optin = attr(
            dev,
            A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| CudaError::driver("cuStreamCreate", e))?;
        let copier = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| CudaError::driver("cuStreamCreate", e))?;
        let event = || {
            result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(|e| CudaError::driver("cuEventCreate", e))
        };
        let stream_event = event()?;
        let copier_event = event()?;
        let mut gpu = Gpu {
            ctx,
            stream,
            copier,
            stream_event,
            copier_event,
            copier_busy: AtomicBool::new(false),
            modules: Vec::new(),
            funcs: Functions::empty(),
            name,
            cc,
            sm_count,
            capturing: AtomicBool::new(false),
            skipping: AtomicBool::new(false),
            debug_sync: false,
            pdl: cc.0 >= 9,
        };
        for (stem, image) in crate::kernels::MODULES {
            // The driver reads the image in place; give it 8-byte alignment.
            let mut aligned = vec![0u64; image.len().div_ceil(8) + 1];
            // SAFETY: `aligned` holds at least image.len() bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    image.as_ptr(),
                    aligned.as_mut_ptr() as *mut u8,
                    image.len(),
                );
            }
            // SAFETY: a fat binary built by build.rs, alive for the call.
            let m = unsafe { result::module::load_data(aligned.as_ptr() as *const c_void) }
                .map_err(|e| CudaError::ModuleLoad {
                    module: stem.to_string(),
                    device: gpu.name.clone(),
                    cc_major: cc.0,
                    cc_minor: cc.1,
                    archs: crate::kernels::ARCHS
                        .iter()
                        .map(|a| a.to_string())
                        .collect::<Vec<_>>()
                        .join(", sm_"),
                    code: crate::error::describe(e.0),
                })?;
            gpu.modules.push(m);
        }
        gpu.funcs = Functions::load(&gpu.modules, smem_optin)?;
        Ok(gpu)
    }

    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal
    }

    /// The device's name, e.g. "NVIDIA H200".
    pub fn name(&self) -> String {
        self.name.clone()
    }

    /// Compute capability (major, minor).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.cc
    }

    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(u64, u64), CudaError> {
        self.ctx.bind()?;
        let (free, total) =
            result::mem_get_info().map_err(|e| CudaError::driver("cuMemGetInfo", e))?;
        Ok((free as u64, total as u64))
    }

    fn refuse_in_capture(&self, what: &str) -> Result<(), CudaError> {
        if self.capturing.load(Ordering::Relaxed) {
            return Err(CudaError::Capture(format!(
                "{what} cannot run while the stream is being captured into a graph \
                 (do it before begin_capture or after end_capture)"
            )));
        }
        Ok(())
    }

    fn raw_alloc(&self, bytes: u64, what: &str) -> Result<u64, CudaError> {
        self.refuse_in_capture(&format!("allocating {what}"))?;
        self.ctx.bind()?;
        if bytes == 0 {
            return Ok(0);
        }
        // SAFETY: a plain allocation in the current context.
        match unsafe { result::malloc_sync(bytes as usize) } {
            Ok(p) => Ok(p),
            Err(e) if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                let (free, total) = self.mem_info().unwrap_or((0, 0));
                Err(CudaError::OutOfMemory {
                    bytes,
                    what: what.to_string(),
                    free,
                    total,
                })
            }
            Err(e) => Err(CudaError::driver(
                format!("cuMemAlloc({}, {what})", gib(bytes)),
                e,
            )),
        }
    }

    /// `n` zeroed elements of device memory. Synchronous: not allowed during capture.
    pub fn alloc<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        n: usize,
        what: &str,
    ) -> Result<DevBuf<T>, CudaError> {
        let bytes = (n as u64)
            .checked_mul(std::mem::size_of::<T>() as u64)
            .ok_or_else(|| CudaError::bad("alloc", format!("{n} elements of {what} overflow")))?;
        let ptr = self.raw_alloc(bytes, what)?;
        let buf = DevBuf {
            ptr,
            len: n,
            ctx: self.ctx.clone(),
            _t: PhantomData,
        };
        if bytes > 0 {
            // Zeroed on the stream (ordered before any later work on it), then waited for.
            // SAFETY: `ptr` holds `bytes` bytes.
            unsafe { result::memset_d8_async(ptr, 0, bytes as usize, self.stream) }
                .map_err(|e| CudaError::driver(format!("cuMemsetD8Async({what})"), e))?;
            self.sync()?;
        }
        Ok(buf)
    }

    /// A device copy of `host`. Synchronous: not allowed during capture.
    pub fn upload<T: DeviceRepr>(&self, host: &[T], what: &str) -> Result<DevBuf<T>, CudaError> {
        let bytes = std::mem::size_of_val(host) as u64;
        let ptr = self.raw_alloc(bytes, what)?;
        let buf = DevBuf {
            ptr,
            len: host.len(),
            ctx: self.ctx.clone(),
            _t: PhantomData,
        };
        if bytes > 0 {
            // SAFETY: `ptr` holds `bytes` bytes; `host` stays alive until the sync below.
            unsafe { result::memcpy_htod_async(ptr, host, self.stream) }
                .map_err(|e| CudaError::driver(format!("cuMemcpyHtoDAsync({what})"), e))?;
            self.sync()?;
        }
        Ok(buf)
    }

    /// Copies `host` to device address `dst`, ordered on the stream (small inputs such
    /// as token ids and positions before a graph launch). The host data is staged
    /// before this returns, so `host` may be reused at once. Not allowed during
    /// capture: a captured host copy would read `host` again at every replay.
    pub fn copy_to_device<T: DeviceRepr>(&self, host: &[T], dst: u64) -> Result<(), CudaError> {
        self.refuse_in_capture("copy_to_device")?;
        if host.is_empty() {
            return Ok(());
        }
        self.ctx.bind()?;
        // SAFETY: the caller gives a device address with room for `host`; pageable
        // memory is staged synchronously by the driver.
        unsafe { result::memcpy_htod_async(dst, host, self.stream) }
            .map_err(|e| CudaError::driver("cuMemcpyHtoDAsync(copy_to_device)", e))
    }

    /// `n` elements at device address `src`, after everything issued before it on the
    /// stream has finished (synchronises the stream). Not allowed during capture.
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        src: u64,
        n: usize,
    ) -> Result<Vec<T>, CudaError> {
        self.refuse_in_capture("download")?;
        let mut out = vec![T::default(); n];
        if n == 0 {
            return Ok(out);
        }
        self.ctx.bind()?;
        // SAFETY: the caller gives a device address holding `n` elements of T; `out`
        // stays alive until the sync below.
        unsafe { result::memcpy_dtoh_async(&mut out, src, self.stream) }
            .map_err(|e| CudaError::driver("cuMemcpyDtoHAsync(download)", e))?;
        self.sync()?;
        Ok(out)
    }

    /// While `on`, kernel launches, device-to-device copies and memsets are not
    /// issued (they return `Ok` at once): the caller replays the work they belong to
    /// from a graph captured when the same sequence of operations ran before.
    /// Host copies, downloads and pinned copies still run. For a step whose host
    /// decisions split it into captured segments (tiered experts).
    pub fn set_skip(&self, on: bool) {
        self.skipping.store(on, Ordering::Relaxed);
    }

    fn skipping(&self) -> bool {
        self.skipping.load(Ordering::Relaxed)
    }

    /// Device-to-device copy of `bytes` bytes, ordered on the stream (capture-safe).
    pub fn copy_device(&self, src: u64, dst: u64, bytes: u64) -> Result<(), CudaError> {
        if bytes == 0 || self.skipping() {
            return Ok(());
        }
        self.ctx.bind()?;
        // SAFETY: the caller gives two device ranges of `bytes` bytes.
        unsafe { result::memcpy_dtod_async(dst, src, bytes as usize, self.stream) }
            .map_err(|e| CudaError::driver("cuMemcpyDtoDAsync(copy_device)", e))
    }

    /// `rows` rows of `width` bytes from `src` (rows `src_pitch` bytes apart) to `dst`
    /// (rows `dst_pitch` apart), device to device in one copy, ordered on the stream
    /// (capture-safe): interleaves row blocks, e.g. two matrices' rows side by side.
    pub fn copy_device_2d(
        &self,
        (src, src_pitch): (u64, u64),
        (dst, dst_pitch): (u64, u64),
        width: u64,
        rows: usize,
    ) -> Result<(), CudaError> {
        if width == 0 || rows == 0 || self.skipping() {
            return Ok(());
        }
        self.ctx.bind()?;
        let copy = sys::CUDA_MEMCPY2D_st {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: src,
            srcArray: std::ptr::null_mut(),
            srcPitch: src_pitch as usize,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst,
            dstArray: std::ptr::null_mut(),
            dstPitch: dst_pitch as usize,
            WidthInBytes: width as usize,
            Height: rows,
        };
        // SAFETY: the caller gives two device ranges holding `rows` rows of `width`
        // bytes at their pitches; the descriptor is read during the call.
        unsafe { sys::cuMemcpy2DAsync_v2(&copy, self.stream) }
            .result()
            .map_err(|e| CudaError::driver("cuMemcpy2DAsync(copy_device_2d)", e))
    }

    /// Sets `bytes` bytes at `dst` to `byte`, ordered on the stream (capture-safe).
    /// `memset(p, 0, n)` clears state; `0xff` poisons f32 outputs to NaN in tests.
    pub fn memset(&self, dst: u64, byte: u8, bytes: u64) -> Result<(), CudaError> {
        if bytes == 0 || self.skipping() {
            return Ok(());
        }
        self.ctx.bind()?;
        // SAFETY: the caller gives a device range of `bytes` bytes.
        unsafe { result::memset_d8_async(dst, byte, bytes as usize, self.stream) }
            .map_err(|e| CudaError::driver("cuMemsetD8Async(memset)", e))
    }

    /// Waits until everything issued on the stream and the copier has finished. An
    /// asynchronous kernel fault is reported here (set `SCORIA_CUDA_SYNC=1` to find
    /// which kernel).
    pub fn sync(&self) -> Result<(), CudaError> {
        self.ctx.bind()?;
        if self.copier_busy.load(Ordering::Relaxed) {
            self.sync_copier()?;
        }
        self.sync_stream()
    }

    /// Waits until the stream's work has finished (not the copier's).
    fn sync_stream(&self) -> Result<(), CudaError> {
        self.ctx.bind()?;
        // SAFETY: the stream is alive while self is.
        unsafe { result::stream::synchronize(self.stream) }
            .map_err(|e| CudaError::driver("cuStreamSynchronize", e))
    }

    /// Waits until a kernel on the stream sets word `i` of `buf` (non-zero) and
    /// returns it, spinning: the host sees the word within a microsecond or so of
    /// its landing, where an event or a stream synchronisation takes several. Every
    /// few thousand spins the stream is asked whether it failed, or finished without
    /// setting the word (an error naming `what`).
    pub fn wait_word(&self, buf: &PinnedBuf, i: usize, what: &str) -> Result<u32, CudaError> {
        loop {
            for _ in 0..4096 {
                let w = buf.load_word(i);
                if w != 0 {
                    return Ok(w);
                }
                std::hint::spin_loop();
            }
            self.ctx.bind()?;
            // SAFETY: the stream is alive while self is.
            match unsafe { sys::cuStreamQuery(self.stream) } {
                CUresult::CUDA_ERROR_NOT_READY => {}
                CUresult::CUDA_SUCCESS => {
                    let w = buf.load_word(i);
                    return if w != 0 {
                        Ok(w)
                    } else {
                        Err(CudaError::bad(
                            "wait_word",
                            format!("the stream finished without {what}"),
                        ))
                    };
                }
                e => {
                    return Err(CudaError::driver(
                        "cuStreamQuery(wait_word)",
                        result::DriverError(e),
                    ))
                }
            }
        }
    }

    /// Waits until every copy issued on the copier has finished (not the stream's
    /// work).
    pub fn sync_copier(&self) -> Result<(), CudaError> {
        self.ctx.bind()?;
        // SAFETY: the copier is alive while self is.
        unsafe { result::stream::synchronize(self.copier) }
            .map_err(|e| CudaError::driver("cuStreamSynchronize(copier)", e))?;
        self.copier_busy.store(false, Ordering::Relaxed);
        Ok(())
    }

    /// Makes the copier's later copies wait for everything issued on the stream so
    /// far (not during capture: the copier is not captured).
    pub fn copier_waits(&self) -> Result<(), CudaError> {
        self.copier_busy.store(true, Ordering::Relaxed);
        self.order("copier_waits", self.stream, self.stream_event, self.copier)
    }

    /// Makes the stream's later work wait for everything issued on the copier so
    /// far (not during capture).
    pub fn stream_waits(&self) -> Result<(), CudaError> {
        self.order("stream_waits", self.copier, self.copier_event, self.stream)
    }

    /// A point in a lane's work for another lane to wait for, recorded with
    /// [`Gpu::record`] (until then, waiting for it waits for nothing).
    pub fn new_event(&self) -> Result<Event, CudaError> {
        self.event_of(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
    }

    fn event_of(&self, flags: sys::CUevent_flags) -> Result<Event, CudaError> {
        self.ctx.bind()?;
        let ev = result::event::create(flags).map_err(|e| CudaError::driver("cuEventCreate", e))?;
        Ok(Event {
            ev,
            ctx: Arc::clone(&self.ctx),
        })
    }

    fn lane(&self, lane: Lane, what: &str) -> Result<sys::CUstream, CudaError> {
        self.refuse_in_capture(what)?;
        Ok(match lane {
            Lane::Stream => self.stream,
            Lane::Copier => {
                self.copier_busy.store(true, Ordering::Relaxed);
                self.copier
            }
        })
    }

    /// Records `event` after everything issued on `lane` so far (again, if it was
    /// recorded before: later waits take this record). Not during capture.
    pub fn record(&self, lane: Lane, event: &Event) -> Result<(), CudaError> {
        let s = self.lane(lane, "record")?;
        self.ctx.bind()?;
        // SAFETY: the event and the stream are alive while `event` and self are.
        unsafe { result::event::record(event.ev, s) }
            .map_err(|e| CudaError::driver("cuEventRecord(record)", e))
    }

    /// Makes `lane`'s later work wait for `event`'s latest record at the time of
    /// this call (nothing, if it was never recorded). Not during capture.
    pub fn wait_event(&self, lane: Lane, event: &Event) -> Result<(), CudaError> {
        let s = self.lane(lane, "wait_event")?;
        self.ctx.bind()?;
        // SAFETY: as in `record`.
        unsafe {
            result::stream::wait_event(s, event.ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
        }
        .map_err(|e| CudaError::driver("cuStreamWaitEvent(wait_event)", e))
    }

    /// An event that also takes the time the device reaches it (for
    /// [`Gpu::elapsed_us`]; a little slower to record than [`Gpu::new_event`]'s).
    pub fn new_timed_event(&self) -> Result<Event, CudaError> {
        self.event_of(sys::CUevent_flags::CU_EVENT_DEFAULT)
    }

    /// Microseconds from `a`'s latest record to `b`'s, both timed events the device
    /// has reached (after a synchronisation that covers them).
    pub fn elapsed_us(&self, a: &Event, b: &Event) -> Result<f64, CudaError> {
        self.ctx.bind()?;
        // SAFETY: both events are alive and belong to this context.
        unsafe { result::event::elapsed(a.ev, b.ev) }
            .map(|ms| f64::from(ms) * 1e3)
            .map_err(|e| CudaError::driver("cuEventElapsedTime", e))
    }

    /// Makes `waiter`'s later work wait for what `first` has been given so far,
    /// through `event` (an event of this pair's direction).
    fn order(
        &self,
        what: &str,
        first: sys::CUstream,
        event: sys::CUevent,
        waiter: sys::CUstream,
    ) -> Result<(), CudaError> {
        self.refuse_in_capture(what)?;
        self.ctx.bind()?;
        // SAFETY: the events and streams are alive while self is; a wait takes the
        // event's latest record at the time of the call, so the event may be
        // recorded again afterwards.
        unsafe {
            result::event::record(event, first).and_then(|()| {
                result::stream::wait_event(
                    waiter,
                    event,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            })
        }
        .map_err(|e| CudaError::driver(format!("cuStreamWaitEvent({what})"), e))
    }

    /// Starts capturing the stream (thread-local mode: this thread may not allocate,
    /// synchronise or copy from pageable memory until `end_capture`).
    pub fn begin_capture(&self) -> Result<(), CudaError> {
        self.ctx.bind()?;
        if self.capturing.swap(true, Ordering::Relaxed) {
            return Err(CudaError::Capture(
                "begin_capture: the stream is already being captured".into(),
            ));
        }
        // SAFETY: the stream is alive while self is.
        unsafe {
            result::stream::begin_capture(
                self.stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .map_err(|e| {
            self.capturing.store(false, Ordering::Relaxed);
            CudaError::driver("cuStreamBeginCapture", e)
        })
    }

    /// Ends the capture and instantiates the captured work as a graph.
    pub fn end_capture(&self) -> Result<Graph, CudaError> {
        self.ctx.bind()?;
        if !self.capturing.load(Ordering::Relaxed) {
            return Err(CudaError::Capture(
                "end_capture without begin_capture".into(),
            ));
        }
        // SAFETY: the stream is alive and capturing.
        let graph = unsafe { result::stream::end_capture(self.stream) };
        self.capturing.store(false, Ordering::Relaxed);
        let graph = graph.map_err(|e| {
            CudaError::Capture(format!(
                "cuStreamEndCapture: {} (an operation that cannot be captured ran on the \
                 stream during capture: an allocation, a synchronisation or a host copy)",
                crate::error::describe(e.0)
            ))
        })?;
        // SAFETY: `graph` was just captured.
        let exec =
            match unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) } {
                Ok(x) => x,
                Err(e) => {
                    // SAFETY: `graph` is ours and not used again.
                    unsafe {
                        let _ = result::graph::destroy(graph);
                    }
                    return Err(CudaError::driver("cuGraphInstantiate", e));
                }
            };
        Ok(Graph {
            graph,
            exec,
            ctx: self.ctx.clone(),
        })
    }

    /// Whether the stream is being captured (between `begin_capture` and `end_capture`).
    pub fn is_capturing(&self) -> bool {
        self.capturing.load(Ordering::Relaxed)
    }

    /// `bytes` bytes of page-locked host memory (for DMA at full PCIe speed: the
    /// expert store's RAM tier). Synchronous: not allowed during capture.
    pub fn alloc_pinned(&self, bytes: usize) -> Result<PinnedBuf, CudaError> {
        self.refuse_in_capture("alloc_pinned")?;
        self.pinned_alloc().alloc(bytes)
    }

    /// What allocates pinned host memory in this GPU's context without the `Gpu`
    /// (see [`PinnedAlloc`]).
    pub fn pinned_alloc(&self) -> PinnedAlloc {
        PinnedAlloc {
            ctx: self.ctx.clone(),
        }
    }

    /// Copies `bytes` bytes of `src` from `offset` to device address `dst`,
    /// asynchronously on `lane` (on the stream, capture-safe: pinned memory). `src`
    /// must not be written or dropped until the copy is known to be done (a later
    /// `sync`).
    pub fn copy_pinned_to_device(
        &self,
        lane: Lane,
        src: &PinnedBuf,
        offset: usize,
        bytes: usize,
        dst: u64,
    ) -> Result<(), CudaError> {
        let stream = match lane {
            Lane::Stream => self.stream,
            Lane::Copier => {
                self.refuse_in_capture("copy_pinned_to_device on the copier")?;
                self.copier_busy.store(true, Ordering::Relaxed);
                self.copier
            }
        };
        if offset.checked_add(bytes).is_none_or(|end| end > src.len) {
            return Err(CudaError::bad(
                "copy_pinned_to_device",
                format!("{offset}+{bytes} is past the {}-byte buffer", src.len),
            ));
        }
        if bytes == 0 {
            return Ok(());
        }
        self.ctx.bind()?;
        // SAFETY: the range is inside `src` (checked); the caller keeps it alive.
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src.ptr.add(offset) as *const c_void, bytes, stream)
        }
        .result()
        .map_err(|e| CudaError::driver("cuMemcpyHtoDAsync(copy_pinned_to_device)", e))
    }

    /// Reads the device ranges `srcs` ((address, bytes)) into `dst`, one after
    /// another from offset 0, after everything issued before them on the stream, and
    /// waits for them: one synchronisation for all, of the stream alone (copies on
    /// the copier that the stream does not wait for may still be running). With
    /// `stamp`, records that event right after the copies (a timed event says when
    /// they landed). Not allowed during capture.
    pub fn download_pinned(
        &self,
        srcs: &[(u64, usize)],
        dst: &mut PinnedBuf,
        stamp: Option<&Event>,
    ) -> Result<(), CudaError> {
        self.refuse_in_capture("download_pinned")?;
        let total: usize = srcs.iter().map(|&(_, n)| n).sum();
        if total > dst.len {
            return Err(CudaError::bad(
                "download_pinned",
                format!("{total} bytes do not fit the {}-byte buffer", dst.len),
            ));
        }
        self.ctx.bind()?;
        let mut at = 0;
        for &(src, n) in srcs {
            if n == 0 {
                continue;
            }
            // SAFETY: the ranges fit `dst` (checked), which `&mut` keeps alive and
            // unshared until the sync below.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(dst.ptr.add(at) as *mut c_void, src, n, self.stream)
            }
            .result()
            .map_err(|e| CudaError::driver("cuMemcpyDtoHAsync(download_pinned)", e))?;
            at += n;
        }
        if let Some(m) = stamp {
            self.record(Lane::Stream, m)?;
        }
        self.sync_stream()
    }

    /// Launches kernel `k` on the stream. `args` are the kernel's parameters in order.
    pub(crate) fn launch(
        &self,
        k: K,
        grid: [u32; 3],
        block: u32,
        smem: u32,
        args: &[Arg],
    ) -> Result<(), CudaError> {
        const MAX: usize = 32;
        assert!(args.len() <= MAX, "{}: too many kernel arguments", k.name());
        if grid.contains(&0) || self.skipping() {
            return Ok(());
        }
        // Every parameter gets an 8-byte slot; 4-byte parameters are read from the
        // slot's first (little-endian low) bytes.
        let mut slots = [0u64; MAX];
        for (s, a) in slots.iter_mut().zip(args) {
            *s = match *a {
                Arg::P(v) => v,
                Arg::U64(v) => v,
                Arg::I64(v) => v as u64,
                Arg::I32(v) => v as u32 as u64,
                Arg::F32(v) => v.to_bits() as u64,
            };
        }
        let mut ptrs = [std::ptr::null_mut::<c_void>(); MAX];
        for (p, s) in ptrs.iter_mut().zip(slots.iter_mut()) {
            *p = s as *mut u64 as *mut c_void;
        }
        self.ctx.bind()?;
        // SAFETY: the function belongs to this context; `ptrs[..n]` point at live
        // slots holding the parameters in the kernel's order and widths (each
        // wrapper in kernels/ matches its kernel's signature).
        unsafe {
            if self.pdl {
                // SAFETY (union): the attribute's value is the int field its id names.
                let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
                attr.id =
                    sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
                attr.value.programmaticStreamSerializationAllowed = 1;
                let cfg = sys::CUlaunchConfig {
                    gridDimX: grid[0],
                    gridDimY: grid[1],
                    gridDimZ: grid[2],
                    blockDimX: block,
                    blockDimY: 1,
                    blockDimZ: 1,
                    sharedMemBytes: smem,
                    hStream: self.stream,
                    attrs: &mut attr,
                    numAttrs: 1,
                };
                sys::cuLaunchKernelEx(
                    &cfg,
                    self.funcs.get(k),
                    ptrs.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
                .result()
            } else {
                result::launch_kernel(
                    self.funcs.get(k),
                    (grid[0], grid[1], grid[2]),
                    (block, 1, 1),
                    smem,
                    self.stream,
                    &mut ptrs[..args.len()],
                )
            }
        }
        .map_err(|e| CudaError::driver(format!("cuLaunchKernel({})", k.name()), e))?;
        if self.debug_sync && !self.is_capturing() {
            // SAFETY: the stream is alive.
            unsafe { result::stream::synchronize(self.stream) }
                .map_err(|e| CudaError::driver(format!("{} (SCORIA_CUDA_SYNC)", k.name()), e))?;
        }
        Ok(())
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        if self.ctx.bind().is_err() {
            return;
        }
        // SAFETY: handles created by this Gpu, not used after this.
        unsafe {
            if self.capturing.load(Ordering::Relaxed) {
                if let Ok(g) = result::stream::end_capture(self.stream) {
                    let _ = result::graph::destroy(g);
                }
            }
            let _ = result::stream::synchronize(self.copier);
            let _ = result::stream::synchronize(self.stream);
            let _ = result::stream::destroy(self.copier);
            let _ = result::stream::destroy(self.stream);
            let _ = result::event::destroy(self.stream_event);
            let _ = result::event::destroy(self.copier_event);
            for m in self.modules.drain(..) {
                let _ = result::module::unload(m);
            }
        }
    }
}

/// One kernel parameter (see `Gpu::launch`).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Arg {
    /// A device pointer.
    P(u64),
    U64(u64),
    I64(i64),
    I32(i32),
    F32(f32),
}

/// Device memory of `len` elements of T, freed on drop. Kernels take its address
/// ([`DevBuf::ptr`]), so one buffer can serve as an arena of many tensors.
pub struct DevBuf<T> {
    ptr: u64,
    len: usize,
    ctx: Arc<Ctx>,
    _t: PhantomData<T>,
}

// SAFETY: a device address; the memory is only touched through the driver.
unsafe impl<T> Send for DevBuf<T> {}
unsafe impl<T> Sync for DevBuf<T> {}

impl<T> DevBuf<T> {
    /// The device address of element 0 (0 for an empty buffer).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// The device address of element `i` (may be one past the end).
    pub fn ptr_at(&self, i: usize) -> u64 {
        debug_assert!(i <= self.len);
        self.ptr + (i * std::mem::size_of::<T>()) as u64
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn bytes(&self) -> u64 {
        (self.len * std::mem::size_of::<T>()) as u64
    }
}

impl<T> std::fmt::Debug for DevBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DevBuf({:#x}, {} × {} B)",
            self.ptr,
            self.len,
            std::mem::size_of::<T>()
        )
    }
}

impl<T> Drop for DevBuf<T> {
    fn drop(&mut self) {
        if self.ptr == 0 || self.ctx.bind().is_err() {
            return;
        }
        // cuMemFree waits for work in flight that may use the memory.
        // SAFETY: allocated by cuMemAlloc in this context, freed once.
        unsafe {
            let _ = result::free_sync(self.ptr);
        }
    }
}

/// Allocates page-locked host memory in a GPU's context on any thread, without the
/// [`Gpu`] ([`Gpu::pinned_alloc`]): for a thread of its own that owns the buffers it
/// fills, such as an expert reader's staging. Unlike [`Gpu::alloc_pinned`] it cannot
/// tell whether the GPU's stream is being captured: call it only outside a capture.
#[derive(Clone)]
pub struct PinnedAlloc {
    ctx: Arc<Ctx>,
}

impl PinnedAlloc {
    /// `bytes` bytes of pinned host memory, zeroed, mapped for kernels.
    pub fn alloc(&self, bytes: usize) -> Result<PinnedBuf, CudaError> {
        self.ctx.bind()?;
        if bytes == 0 {
            return Ok(PinnedBuf {
                ptr: std::ptr::NonNull::<u8>::dangling().as_ptr(),
                len: 0,
                dev: 0,
                ctx: self.ctx.clone(),
            });
        }
        // SAFETY: a plain pinned allocation; PORTABLE makes it pinned for every
        // context, DEVICEMAP readable and writable by kernels (`PinnedBuf::dev_ptr`).
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        let ptr = unsafe { result::malloc_host(bytes, flags) }.map_err(|e| {
            CudaError::driver(
                format!(
                    "cuMemHostAlloc({} of pinned host memory)",
                    gib(bytes as u64)
                ),
                e,
            )
        })?;
        // SAFETY: `ptr` holds `bytes` bytes; zeroing makes every byte initialised.
        unsafe { std::ptr::write_bytes(ptr as *mut u8, 0, bytes) };
        let mut buf = PinnedBuf {
            ptr: ptr as *mut u8,
            len: bytes,
            dev: 0,
            ctx: self.ctx.clone(),
        };
        // SAFETY: `ptr` was allocated mapped above; `dev` receives its device address.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut buf.dev, ptr, 0) }
            .result()
            .map_err(|e| CudaError::driver("cuMemHostGetDevicePointer", e))?;
        Ok(buf)
    }
}

/// Page-locked host memory, freed on drop.
pub struct PinnedBuf {
    ptr: *mut u8,
    len: usize,
    /// The same bytes' address for kernels (mapped memory: every access crosses PCIe).
    dev: u64,
    ctx: Arc<Ctx>,
}

// SAFETY: plain host memory owned by this value.
unsafe impl Send for PinnedBuf {}
unsafe impl Sync for PinnedBuf {}

impl PinnedBuf {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` holds `len` initialised bytes (zeroed at allocation).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above; &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// The buffer's address for kernels. A kernel reading bytes the host rewrites
    /// between launches must bypass the caches (`__ldcv`); one writing bytes the host
    /// polls fences them (`__threadfence_system`) before the word the host polls.
    pub fn dev_ptr(&self) -> u64 {
        self.dev
    }

    /// Word `i` (4 bytes at `4·i`), read afresh: a kernel may write it at any time.
    pub fn load_word(&self, i: usize) -> u32 {
        assert!(4 * i + 4 <= self.len, "word {i} is past the buffer");
        // SAFETY: in bounds (checked), 4-aligned (the allocation is page-aligned).
        let w = unsafe { std::ptr::read_volatile((self.ptr as *const u32).add(i)) };
        // The words after it are read after it (the kernel wrote them before it).
        std::sync::atomic::fence(Ordering::Acquire);
        w
    }

    /// Sets word `i` (see [`Self::load_word`]).
    pub fn store_word(&mut self, i: usize, v: u32) {
        assert!(4 * i + 4 <= self.len, "word {i} is past the buffer");
        // SAFETY: in bounds, 4-aligned, and &mut self.
        unsafe { std::ptr::write_volatile((self.ptr as *mut u32).add(i), v) };
    }
}

/// A recorded point in one lane's work, a CUDA event ([`Gpu::new_event`]).
pub struct Event {
    ev: sys::CUevent,
    ctx: Arc<Ctx>,
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.ctx.bind().is_err() {
            return;
        }
        // SAFETY: created by new_event, destroyed once; a pending record completes
        // on its own (the driver defers the release).
        unsafe {
            let _ = result::event::destroy(self.ev);
        }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        if self.len == 0 || self.ctx.bind().is_err() {
            return;
        }
        // SAFETY: allocated by cuMemHostAlloc, freed once.
        unsafe {
            let _ = result::free_host(self.ptr as *mut c_void);
        }
    }
}

/// An instantiated graph of captured work, replayed with [`Graph::launch`].
pub struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    ctx: Arc<Ctx>,
}

// SAFETY: driver handles; a graph may be launched from any thread (not from two at
// once: `launch` takes &self, so wrap it in a Mutex to share it between threads).
unsafe impl Send for Graph {}

impl Graph {
    /// Replays the graph on `gpu`'s stream (asynchronous).
    pub fn launch(&self, gpu: &Gpu) -> Result<(), CudaError> {
        if !Arc::ptr_eq(&self.ctx, &gpu.ctx) {
            return Err(CudaError::bad(
                "Graph::launch",
                "the graph was captured on another Gpu",
            ));
        }
        gpu.ctx.bind()?;
        // SAFETY: the exec graph and stream belong to this context.
        unsafe { result::graph::launch(self.exec, gpu.stream) }
            .map_err(|e| CudaError::driver("cuGraphLaunch", e))
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        if self.ctx.bind().is_err() {
            return;
        }
        // SAFETY: created by end_capture, destroyed once.
        unsafe {
            let _ = result::graph::exec_destroy(self.exec);
            let _ = result::graph::destroy(self.graph);
        }
    }
}
