//! Core errors -> Python exceptions: `ModelError(ValueError)` for malformed or unsupported
//! models, `KvCacheFull(RuntimeError)`, `EngineError(RuntimeError)` for a failure inside the
//! engine (the batch was rolled back), `ValueError` for bad arguments, `MemoryError` when a
//! buffer cannot be allocated, `OSError` for I/O.

use kvserve_core::Error;
use pyo3::create_exception;
use pyo3::exceptions::{PyMemoryError, PyOSError, PyRuntimeError, PyValueError};
use pyo3::PyErr;

create_exception!(
    kvserve,
    ModelError,
    PyValueError,
    "A model file is malformed or unsupported."
);
create_exception!(
    kvserve,
    KvCacheFull,
    PyRuntimeError,
    "The KV cache has no room for a batch."
);

create_exception!(
    kvserve,
    EngineError,
    PyRuntimeError,
    "A failure inside the engine (e.g. a worker thread panicked); the batch was rolled back."
);

pub fn to_py(e: Error) -> PyErr {
    match e {
        Error::Model(m) | Error::Unsupported(m) => ModelError::new_err(m),
        Error::InvalidInput(m) => PyValueError::new_err(m),
        Error::KvCacheFull(m) => KvCacheFull::new_err(m),
        Error::Io(m) => PyOSError::new_err(m),
        Error::OutOfMemory(m) => PyMemoryError::new_err(m),
        Error::Internal(m) => EngineError::new_err(m),
    }
}
