//! What a backend that serves its own listener keeps, written once: the listener bound at
//! construction (so a bad address fails there), the engine host `start` hands over, the tasks it
//! runs (accept loop, served connections) and whether it was shut down; and the connections it
//! holds weakly, to fail or notify them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use tensorwire_proto::admission::{Admission, Limits, Pending};

use crate::backend::BackendHost;
use crate::error::{Error, Result};
use crate::sync::lock;
use crate::tasks::TaskSet;

/// The serving state of a backend with listener type `L`.
#[derive(Debug)]
pub struct Serving<L> {
    name: &'static str,
    listener: Mutex<Option<L>>,
    host: OnceLock<Arc<dyn BackendHost>>,
    closed: AtomicBool,
    tasks: Arc<TaskSet>,
    /// Connections accepted and not yet through their handshake (see [`Serving::admit`]).
    admission: Admission,
}

impl<L> Serving<L> {
    /// Serving state for backend `name` around a bound (not yet served) listener.
    pub fn new(name: &'static str, listener: L) -> Self {
        Serving {
            name,
            listener: Mutex::new(Some(listener)),
            host: OnceLock::new(),
            closed: AtomicBool::new(false),
            tasks: TaskSet::new(),
            admission: Admission::new(name, Limits::handshake(Duration::from_secs(10))),
        }
    }

    /// Admits a connection accepted from `source` as pending until it proved itself (its
    /// handshake; see `tensorwire_proto::admission`): at most 256 per listener and 64 per
    /// source, for at most 10 s, the oldest closed when a bound is reached.
    pub fn admit(&self, source: std::net::IpAddr) -> Pending {
        self.admission.admit(source)
    }

    /// For `Backend::start`: records the engine `host` and hands over the listener, converted by
    /// `into_tokio` (a tokio listener's `from_std`, which fails outside a runtime).
    pub fn start<T>(
        &self,
        host: Arc<dyn BackendHost>,
        into_tokio: impl FnOnce(L) -> std::io::Result<T>,
    ) -> Result<T> {
        let name = self.name;
        if self.host.set(host).is_err() {
            return Err(Error::InvalidArgument(format!("{name}: backend started twice")));
        }
        let listener = lock(&self.listener).take().ok_or_else(|| {
            Error::Internal(format!("{name}: the listener was taken before start"))
        })?;
        into_tokio(listener).map_err(|e| Error::Unsupported {
            backend: name,
            what: format!("serving outside a tokio runtime: {e}"),
        })
    }

    /// The engine host, once started.
    pub fn host(&self) -> Option<Arc<dyn BackendHost>> {
        self.host.get().cloned()
    }

    /// Runs `fut` as one of the backend's tasks (aborted at shutdown).
    pub fn spawn(&self, fut: impl std::future::Future<Output = ()> + Send + 'static) {
        self.tasks.spawn(fut);
    }

    /// Whether the backend was shut down.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// The error of an op on a backend that was shut down.
    pub fn closed_error(&self) -> Error {
        Error::PeerClosed(format!("local {} backend shut down", self.name))
    }

    /// Fails with [`Serving::closed_error`] once shut down.
    pub fn ensure_open(&self) -> Result<()> {
        if self.is_closed() { Err(self.closed_error()) } else { Ok(()) }
    }

    /// Shuts down: no more serving, every task aborted.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.tasks.abort_all();
    }
}

impl Serving<std::net::TcpListener> {
    /// [`Serving::start`] for a TCP control listener: the tokio listener, refused (see
    /// [`crate::auth::check_listener`], named `what`) when other hosts can reach it and the
    /// engine has no cluster secret, unless `insecure`.
    pub fn start_tcp(
        &self,
        host: Arc<dyn BackendHost>,
        what: &str,
        insecure: bool,
    ) -> Result<tokio::net::TcpListener> {
        let secret = host.cluster_secret();
        let listener = self.start(host, tokio::net::TcpListener::from_std)?;
        crate::auth::check_listener(what, listener.local_addr()?, secret.as_ref(), insecure)?;
        Ok(listener)
    }
}

/// Connections held weakly: they live as long as their users, and the backend reaches the live
/// ones (to fail them at shutdown, or tell them of a deregistration).
#[derive(Debug)]
pub struct WeakList<T>(Mutex<Vec<Weak<T>>>);

impl<T> Default for WeakList<T> {
    fn default() -> Self {
        WeakList(Mutex::new(Vec::new()))
    }
}

impl<T> WeakList<T> {
    /// Adds `c` (and forgets the ones already gone).
    pub fn push(&self, c: &Arc<T>) {
        let mut v = lock(&self.0);
        v.retain(|w| w.strong_count() > 0);
        v.push(Arc::downgrade(c));
    }

    /// The live ones.
    pub fn live(&self) -> Vec<Arc<T>> {
        lock(&self.0).iter().filter_map(Weak::upgrade).collect()
    }

    /// Takes every live one out of the list.
    pub fn take(&self) -> Vec<Arc<T>> {
        lock(&self.0).drain(..).filter_map(|w| w.upgrade()).collect()
    }
}
