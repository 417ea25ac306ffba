//! Core errors -> Python exceptions: `ModelError(ValueError)` for malformed or unsupported
//! models, `KvCacheFull(RuntimeError)`, `ValueError` for bad arguments, `OSError` for I/O.

use kvserve_core::Error;
use pyo3::create_exception;
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
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

pub fn to_py(e: Error) -> PyErr {
    match e {
        Error::Model(m) | Error::Unsupported(m) => ModelError::new_err(m),
        Error::InvalidInput(m) => PyValueError::new_err(m),
        Error::KvCacheFull(m) => KvCacheFull::new_err(m),
        Error::Io(m) => PyOSError::new_err(m),
    }
}
