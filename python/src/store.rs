//! `hatrain._native.AgentStore`: a connection to the job's rendezvous store
//! (the agent's, [`hatrain_shared::store`]), for a framework's process
//! group to meet in across hosts. `hatrain.torch` wraps it in a
//! `torch.distributed.Store`.
//!
//! The store's values are text: the Python side passes bytes as hex. Every
//! call lets go of the interpreter while it waits for the store.

use super::err;
use hatrain_shared::auth::{ENV_SECRET_FILE, Secret};
use hatrain_shared::rendezvous::ENV_AGENT_STORE;
use hatrain_shared::store::{RendezvousError, StoreClient};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Mutex;
use std::time::Duration;

/// One authenticated connection to the job's store. Calls from several
/// threads take turns.
#[pyclass(module = "hatrain._native", name = "AgentStore", frozen)]
pub(crate) struct AgentStore {
    client: Mutex<StoreClient>,
    addr: SocketAddr,
}

impl AgentStore {
    fn call<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut StoreClient) -> Result<T, RendezvousError> + Send,
    ) -> PyResult<T> {
        py.detach(|| {
            let mut c = self.client.lock().unwrap_or_else(|e| e.into_inner());
            f(&mut c)
        })
        .map_err(err)
    }
}

fn seconds(what: &str, s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s).map_err(|_| {
        PyValueError::new_err(format!(
            "{what} {s}: expected a finite, non-negative number of seconds"
        ))
    })
}

#[pymethods]
impl AgentStore {
    /// Connects to the store at `address` (`HOST:PORT`; default: the
    /// agent's, `HATRAIN_AGENT_STORE`), retrying for up to `timeout`
    /// seconds, under the job's secret (`HATRAIN_SECRET_FILE`, when set).
    #[new]
    #[pyo3(signature = (address = None, timeout = 60.0))]
    fn new(py: Python<'_>, address: Option<String>, timeout: f64) -> PyResult<Self> {
        let timeout = seconds("timeout", timeout)?;
        let address = match address.or_else(|| std::env::var(ENV_AGENT_STORE).ok()) {
            Some(a) => a,
            None => {
                return Err(PyValueError::new_err(format!(
                    "no store address given and {ENV_AGENT_STORE} is not set: run under hatrain-agent"
                )));
            }
        };
        let addr = address
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| {
                PyValueError::new_err(format!(
                    "store address {address:?} is not a HOST:PORT that resolves"
                ))
            })?;
        let secret = match std::env::var_os(ENV_SECRET_FILE) {
            Some(path) => Some(Secret::load(std::path::Path::new(&path)).map_err(err)?),
            None => None,
        };
        let client = py
            .detach(|| StoreClient::connect(addr, timeout, secret))
            .map_err(err)?;
        Ok(Self {
            client: Mutex::new(client),
            addr,
        })
    }

    /// The store's address.
    #[getter]
    fn address(&self) -> String {
        self.addr.to_string()
    }

    /// Stores `value` under `key`.
    fn set(&self, py: Python<'_>, key: String, value: String) -> PyResult<()> {
        self.call(py, move |c| c.set(&key, &value))
    }

    /// The value of `key`, waiting up to `timeout` seconds for it to
    /// appear; `None` if it did not.
    #[pyo3(signature = (key, timeout = 0.0))]
    fn get(&self, py: Python<'_>, key: String, timeout: f64) -> PyResult<Option<String>> {
        let wait = seconds("timeout", timeout)?;
        self.call(py, move |c| match c.get(&key, wait) {
            Ok(v) => Ok(Some(v)),
            Err(RendezvousError::Timeout { .. }) => Ok(None),
            Err(e) => Err(e),
        })
    }

    /// Adds `delta` to the counter `key` (0 when absent); returns the sum.
    fn add(&self, py: Python<'_>, key: String, delta: i64) -> PyResult<i64> {
        self.call(py, move |c| c.add(&key, delta))
    }
}
