//! `hatrain._native`: the worker runtime for Python.
//!
//! The Python package `hatrain` (next to this crate) wraps this module; see
//! its docstrings for the training loop's side. Memory that Python owns
//! (numpy arrays, torch tensors through `.numpy()`) is registered through
//! the buffer protocol without a copy: the runtime reads it on a commit
//! and writes it on a restore, under the update fences
//! ([`hatrain_worker::buffer::Borrowed`]). Every call that may wait (the
//! fences, a restore, a directive) lets go of the interpreter meanwhile.

use hatrain_shared::shm::Directive;
use hatrain_shared::statemap::{Dtype, StateMap};
use hatrain_worker::comm::{Abort, Communicator, Hooks};
use hatrain_worker::runtime::{Borrowed, Buffer, CommitOf, Runtime as Rt, Start, UceInjector};
use pyo3::buffer::PyBuffer;
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::ptr::NonNull;
use std::sync::Arc;

mod store;

create_exception!(
    _native,
    HatrainError,
    PyRuntimeError,
    "An error of the hatrain runtime or agent; the message says what."
);

fn err(e: impl std::error::Error) -> PyErr {
    // The whole chain: the runtime's errors name the cause in their source.
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    HatrainError::new_err(msg)
}

fn dtype(name: &str) -> PyResult<Dtype> {
    serde_json::from_value(serde_json::Value::String(name.to_uppercase())).map_err(|_| {
        PyValueError::new_err(format!(
            "dtype {name:?} is not one of U8, I8, U16, I16, F16, BF16, U32, I32, F32, U64, I64, F64"
        ))
    })
}

/// A registered buffer: keeps the exporter's buffer (and so its memory)
/// alive for as long as the runtime holds it.
struct Held(#[allow(dead_code)] PyBuffer<u8>);

/// The state map (JSON) and the buffers of a registration.
fn registration(
    state_map: &str,
    buffers: &[(Bound<'_, PyAny>, String)],
) -> PyResult<(StateMap, Vec<Buffer>)> {
    let map: StateMap = serde_json::from_str(state_map)
        .map_err(|e| PyValueError::new_err(format!("state map: {e}")))?;
    let bufs = buffers
        .iter()
        .enumerate()
        .map(|(i, (o, d))| borrow(i, o, d))
        .collect::<PyResult<Vec<_>>>()?;
    Ok((map, bufs))
}

fn borrow(index: usize, obj: &Bound<'_, PyAny>, dtype_name: &str) -> PyResult<Buffer> {
    let dt = dtype(dtype_name)?;
    let buf = PyBuffer::<u8>::get(obj).map_err(|e| {
        PyValueError::new_err(format!(
            "buffer {index}: not a byte buffer ({e}); pass a numpy array viewed as uint8"
        ))
    })?;
    if buf.readonly() {
        return Err(PyValueError::new_err(format!(
            "buffer {index} is read-only: a restore writes it"
        )));
    }
    if !buf.is_c_contiguous() {
        return Err(PyValueError::new_err(format!(
            "buffer {index} is not C-contiguous"
        )));
    }
    let len = buf.len_bytes();
    if len % dt.size() != 0 {
        return Err(PyValueError::new_err(format!(
            "buffer {index}: {len} bytes is not a whole number of {dt:?} elements"
        )));
    }
    let ptr = NonNull::new(buf.buf_ptr().cast::<u8>()).unwrap_or(NonNull::dangling());
    // SAFETY: the exporter keeps the memory at this address while `Held`
    // holds its buffer (the buffer protocol's contract); the Python side
    // (`hatrain.Runtime`) writes it only inside the update fences and not
    // during a restore, which it calls and waits for.
    let b = unsafe { Borrowed::new(ptr, len, dt, Box::new(Held(buf))) };
    Ok(Buffer::Borrowed(Arc::new(b)))
}

/// The abort handle of a Python communicator: calls its `abort` callable
/// (with the interpreter held) from the runtime's watcher thread.
#[derive(Debug)]
struct PyAbort(Option<Py<PyAny>>);

impl Abort for PyAbort {
    fn abort(&self) {
        if let Some(f) = &self.0 {
            Python::attach(|py| {
                if let Err(e) = f.call0(py) {
                    eprintln!("hatrain: the communicator's abort raised: {e}");
                }
            });
        }
    }
}

/// Python's hooks into the runtime's background work, called (with the
/// interpreter held) from the commit thread: `before_copy` before a
/// snapshot is copied (a staged device copy is waited for there), and a
/// drill's `commit_halfway` when half of one is copied.
#[derive(Debug)]
struct PyHooks {
    before_copy: Option<Py<PyAny>>,
    commit_halfway: Option<Py<PyAny>>,
}

impl Hooks for PyHooks {
    fn before_copy(&self, step: u64) {
        if let Some(f) = &self.before_copy {
            Python::attach(|py| {
                if let Err(e) = f.call1(py, (step,)) {
                    eprintln!("hatrain: the before_copy hook raised: {e}");
                }
            });
        }
    }

    fn commit_halfway(&self, step: u64) {
        if let Some(f) = &self.commit_halfway {
            Python::attach(|py| {
                if let Err(e) = f.call1(py, (step,)) {
                    eprintln!("hatrain: the commit_halfway hook raised: {e}");
                }
            });
        }
    }
}

#[derive(Debug)]
struct PyComm {
    epoch: u64,
    abort: Arc<PyAbort>,
}

impl Communicator for PyComm {
    fn epoch(&self) -> u64 {
        self.epoch
    }
    fn abort_handle(&self) -> Arc<dyn Abort> {
        Arc::clone(&self.abort) as Arc<dyn Abort>
    }
}

/// One rank's runtime (see `hatrain.Runtime`).
#[pyclass(module = "hatrain._native", name = "Runtime")]
struct PyRuntime {
    /// Taken only by `drop`.
    rt: Option<Rt>,
    start: Start,
    /// The place the last reshape directive gave, `(rank, world)`.
    place: Option<(u64, u64)>,
}

/// A lost rank's state a reshape brings: `(rank, state map JSON, metadata
/// block, per buffer (start, end, bytes))`.
type Donation<'py> = (
    usize,
    String,
    Bound<'py, PyBytes>,
    Vec<(usize, usize, Bound<'py, PyBytes>)>,
);

impl PyRuntime {
    fn rt(&self) -> &Rt {
        self.rt.as_ref().expect("dropped only once")
    }

    fn rt_mut(&mut self) -> &mut Rt {
        self.rt.as_mut().expect("dropped only once")
    }
}

impl Drop for PyRuntime {
    /// Stops the runtime's threads with the interpreter let go of: the
    /// commit thread may be waiting for it (a `commit_halfway` hook).
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            Python::attach(|py| py.detach(move || drop(rt)));
        }
    }
}

#[pymethods]
impl PyRuntime {
    /// Registers `rank` with the agent named by `HATRAIN_AGENT_SOCKET`
    /// (inert without one). `state_map` is the JSON of the state map; its
    /// part 0 is the metadata block given to each commit, parts 1.. are
    /// `buffers`, a list of `(buffer, dtype)` in order. `slots` (0: the
    /// agent's choice) is the fewest snapshot slots the loop needs.
    /// `before_copy`, if given, is called with the step before a snapshot
    /// is copied out of the buffers, and returns once they hold that step
    /// (a staged device copy); `commit_halfway`, if given, with the step
    /// when half of one is copied (a drill's hook: a fault in the middle of
    /// a commit). Both run on the commit thread.
    #[staticmethod]
    #[pyo3(signature = (rank, state_map, buffers, snapshot_interval = 1, slots = 0, commit_halfway = None, before_copy = None))]
    #[allow(clippy::too_many_arguments)]
    fn connect(
        py: Python<'_>,
        rank: usize,
        state_map: &str,
        buffers: Vec<(Bound<'_, PyAny>, String)>,
        snapshot_interval: u64,
        slots: usize,
        commit_halfway: Option<Py<PyAny>>,
        before_copy: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let (map, bufs) = registration(state_map, &buffers)?;
        let (rt, start) = py
            .detach(|| {
                let hooks = Arc::new(PyHooks {
                    before_copy,
                    commit_halfway,
                });
                Rt::connect_buffers(rank, map, bufs, snapshot_interval, slots, hooks)
            })
            .map_err(err)?;
        Ok(Self {
            rt: Some(rt),
            start,
            place: None,
        })
    }

    /// What the start-update fence does with a snapshot copy still
    /// running: `"wait"`, `"skip"` or `"skip:N"` (see the trainer's
    /// `--snapshot-window`).
    fn set_snapshot_window(&mut self, window: &str) -> PyResult<()> {
        let w: hatrain_worker::runtime::Window = window
            .parse()
            .map_err(|e| PyValueError::new_err(format!("{e}")))?;
        self.rt_mut().set_snapshot_window(w);
        Ok(())
    }

    /// How to start: `("standalone", None)`, `("fresh", epoch)` or
    /// `("await", None)` (a replacement process: await the directive).
    #[getter]
    fn start(&self) -> (&'static str, Option<u64>) {
        match self.start {
            Start::Standalone => ("standalone", None),
            Start::Fresh { epoch } => ("fresh", Some(epoch)),
            Start::AwaitDirective => ("await", None),
        }
    }

    #[getter]
    fn rank(&self) -> usize {
        self.rt().rank()
    }

    /// Whether a failed collective should wait for the agent's recovery.
    #[getter]
    fn recovers(&self) -> bool {
        self.rt().recovers()
    }

    #[getter]
    fn sliced(&self) -> bool {
        self.rt().sliced()
    }

    #[getter]
    fn agent_saves(&self) -> bool {
        self.rt().agent_saves()
    }

    #[getter]
    fn snapshot_bytes(&self) -> u64 {
        self.rt().snapshot_bytes()
    }

    fn has_snapshots(&self) -> bool {
        self.rt().has_snapshots()
    }

    /// Per buffer, the elements `(start, end)` a restore fills.
    fn held(&self) -> Vec<(usize, usize)> {
        self.rt()
            .held()
            .into_iter()
            .map(|r| (r.start, r.end))
            .collect()
    }

    fn directive_pending(&self) -> bool {
        self.rt().directive_pending()
    }

    fn begin_step(&self, step: u64) {
        self.rt().begin_step(step);
    }

    /// This step's batch is loaded: the time since `begin_step` was data
    /// loading, what follows is compute.
    fn batch_ready(&self) {
        self.rt().batch_ready();
    }

    /// A garbage collection took `ns` in `step` (the job's `gc.callbacks`).
    fn gc_collected(&self, ns: u64, step: u64) {
        self.rt().gc_collected(ns, step);
    }

    /// This step's compute waited `ns` on collectives that ran beside it
    /// (DDP's all-reduce of the gradient buckets, inside the backward
    /// pass): counted as collective time.
    fn collective_overlapped(&self, ns: u64) {
        self.rt().collective_overlapped(ns);
    }

    /// `(part, byte offset)` of a memory error repaired since the last
    /// check: the step must be thrown away and recomputed.
    fn check_uce(&self) -> Option<(usize, usize)> {
        self.rt().check_uce().map(|u| (u.part, u.offset))
    }

    /// An uncorrectable memory error the device reported (torch_npu's `UCE
    /// ERROR`): the step is torn and must be recomputed; the agent is told.
    #[pyo3(signature = (why, part=None))]
    fn report_device_uce(&self, why: &str, part: Option<usize>) {
        self.rt().report_device_uce(part, why);
    }

    fn start_update(&self, py: Python<'_>) {
        py.detach(|| self.rt().start_update());
    }

    fn end_update(&self, step: u64) {
        self.rt().end_update(step);
    }

    /// Snapshots the state of `step`: `meta` (exactly the metadata block's
    /// length) now, the buffers in the background. `of` is `"start"`,
    /// `"step"` or `"last"`.
    #[pyo3(signature = (step, epoch, meta, of = "step"))]
    fn commit(&mut self, step: u64, epoch: u64, meta: &[u8], of: &str) -> PyResult<()> {
        let of = commit_of(of)?;
        let want = self.rt().map().parts.first().map_or(0, |p| p.len as usize);
        if meta.len() != want {
            return Err(PyValueError::new_err(format!(
                "metadata block of {} bytes; the state map says {want}",
                meta.len()
            )));
        }
        self.rt_mut().commit(step, epoch, meta.to_vec(), of);
        Ok(())
    }

    /// Whether `commit(step, of=of)` takes a snapshot: a state staged out
    /// of device memory for the copy need be staged only then.
    #[pyo3(signature = (step, of = "step"))]
    fn snapshots(&self, step: u64, of: &str) -> PyResult<bool> {
        Ok(self.rt().snapshots(step, commit_of(of)?))
    }

    fn wait_commit(&self, py: Python<'_>) {
        py.detach(|| self.rt().wait_commit());
    }

    /// Parks until the agent says how to go on: `("resume", step, epoch)`,
    /// `("reshape", step, epoch)` or `("stop", None, None)`.
    fn await_directive(&mut self, py: Python<'_>) -> (&'static str, Option<u64>, Option<u64>) {
        let rt = self.rt_mut();
        match py.detach(|| rt.await_directive()) {
            Directive::Resume { step, epoch } => ("resume", Some(step), Some(epoch)),
            Directive::Reshape {
                step,
                epoch,
                rank,
                world,
            } => {
                self.place = Some((rank, world));
                ("reshape", Some(step), Some(epoch))
            }
            Directive::Stop | Directive::None | Directive::Pause { .. } => ("stop", None, None),
        }
    }

    /// `(rank, world)`: the place the last `"reshape"` directive gave.
    #[getter]
    fn reshape_place(&self) -> Option<(u64, u64)> {
        self.place
    }

    /// The lost ranks' state at `step` the agent says this rank brings to a
    /// reshape, read from their replicas: `[(rank, state_map_json, meta,
    /// [(start, end, bytes)])]`, one `(start, end, bytes)` per buffer (in
    /// elements).
    fn donations<'py>(&self, py: Python<'py>, step: u64) -> PyResult<Vec<Donation<'py>>> {
        let got = py.detach(|| self.rt().donations(step)).map_err(err)?;
        got.into_iter()
            .map(|d| {
                let map = serde_json::to_string(&d.map)
                    .map_err(|e| PyValueError::new_err(format!("state map: {e}")))?;
                let parts = d
                    .parts
                    .iter()
                    .map(|(r, b)| (r.start, r.end, PyBytes::new(py, b)))
                    .collect();
                Ok((d.rank, map, PyBytes::new(py, &d.meta), parts))
            })
            .collect()
    }

    /// Takes the new place `state_map` describes (as `connect`'s), under
    /// the reshape directive of `epoch` to `step`: `buffers` replace the
    /// registered ones, and the agent makes the rank's store anew for the
    /// new layout. The buffers hold the state of `step`; commit it next.
    fn reshape(
        &mut self,
        py: Python<'_>,
        epoch: u64,
        step: u64,
        state_map: &str,
        buffers: Vec<(Bound<'_, PyAny>, String)>,
    ) -> PyResult<()> {
        let (map, bufs) = registration(state_map, &buffers)?;
        let rt = self.rt_mut();
        py.detach(|| rt.reshape(epoch, step, map, bufs))
            .map_err(err)
    }

    /// Copies the sealed snapshot of `step` into the buffers and returns
    /// its metadata block.
    fn restore<'py>(&self, py: Python<'py>, step: u64) -> PyResult<Bound<'py, PyBytes>> {
        let meta = py.detach(|| self.rt().restore(step)).map_err(err)?;
        Ok(PyBytes::new(py, &meta))
    }

    /// Sliced snapshots of ranks on one host: copies the slices sibling
    /// `rank` (number `index` in the replication groups) holds in its
    /// snapshot of `step` from its store into the buffers.
    fn restore_sibling(
        &self,
        py: Python<'_>,
        step: u64,
        rank: usize,
        index: usize,
    ) -> PyResult<()> {
        py.detach(|| self.rt().restore_sibling(step, rank, index))
            .map_err(err)
    }

    /// The communicator of `epoch` is built; `abort`, if given, is called
    /// (from another thread) when the agent pauses the job.
    #[pyo3(signature = (epoch, abort = None))]
    fn set_communicator(&self, epoch: u64, abort: Option<Py<PyAny>>) {
        self.rt().set_communicator(&PyComm {
            epoch,
            abort: Arc::new(PyAbort(abort)),
        });
    }

    #[pyo3(signature = (epoch, peer = None))]
    fn rebuild_failed(&self, epoch: u64, peer: Option<usize>) {
        self.rt().rebuild_failed(epoch, peer);
    }

    /// The loop has finished at `step`: whether its snapshot is sealed.
    fn finish(&self, py: Python<'_>, step: u64) -> bool {
        py.detach(|| self.rt().finish(step))
    }

    /// Injects an uncorrectable memory error at byte `offset` of state part
    /// `part` (a test's and a drill's tool).
    fn inject_uce(&self, py: Python<'_>, part: usize, offset: usize) {
        py.detach(|| UceInjector.inject(part, offset));
    }
}

/// What a standby is given: `((rank, local_rank, restarts), variables to
/// set, variable to remove)`.
type Place = (
    (usize, usize, u32),
    Vec<(&'static str, String)>,
    &'static str,
);

/// For a warm standby (started by the agent with `HATRAIN_STANDBY=1`):
/// parks until the agent gives it a failed rank's place, and returns it.
/// `None` at once for any other process.
#[pyfunction]
fn standby(py: Python<'_>) -> PyResult<Option<Place>> {
    let a = py.detach(hatrain_worker::standby::standby).map_err(err)?;
    Ok(a.map(|a| {
        let env = a.env();
        (
            (a.rank, a.local_rank, a.restarts),
            env,
            hatrain_worker::standby::Assigned::CLEARED,
        )
    }))
}

/// How hatrain's fault table classifies a torch_npu error text: `(action,
/// the words that decided)`, the action one of `uce`, `crash`, `hang`,
/// `ignore`; `None` when the text is not an NPU fault.
#[pyfunction]
fn classify_npu_text(text: &str) -> Option<(&'static str, &'static str)> {
    let (action, words) = hatrain_shared::npu::classify_text(text)?;
    Some((action.name(), words))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyRuntime>()?;
    m.add_class::<store::AgentStore>()?;
    m.add_function(wrap_pyfunction!(standby, m)?)?;
    m.add_function(wrap_pyfunction!(classify_npu_text, m)?)?;
    m.add("HatrainError", m.py().get_type::<HatrainError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

/// A commit's `of` argument.
fn commit_of(of: &str) -> PyResult<CommitOf> {
    match of {
        "start" => Ok(CommitOf::Start),
        "step" => Ok(CommitOf::Step),
        "last" => Ok(CommitOf::Last),
        other => Err(PyValueError::new_err(format!(
            "commit of {other:?}: expected \"start\", \"step\" or \"last\""
        ))),
    }
}
