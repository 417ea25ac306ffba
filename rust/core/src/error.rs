//! The engine's error type. Each variant maps to one Python exception in the binding:
//! `Model` and `Unsupported` -> `kvserve.ModelError` (a `ValueError`), `InvalidInput` ->
//! `ValueError`, `KvCacheFull` -> `kvserve.KvCacheFull` (a `RuntimeError`), `Io` -> `OSError`.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// The model file is malformed: one line saying what and where (key, tensor, offset).
    Model(String),
    /// The model is well-formed but uses something we do not implement; lists what we do.
    Unsupported(String),
    /// A caller passed a bad argument (token id out of range, bad batch, ...).
    InvalidInput(String),
    /// The KV cache has no room for a batch; nothing was changed.
    KvCacheFull(String),
    /// An operating-system error (missing path, permission, ...).
    Io(String),
    /// A buffer (e.g. a KV cache sized by `--ctx-size`) could not be allocated.
    OutOfMemory(String),
    /// A failure inside the engine (a worker panicked); the batch was rolled back.
    Internal(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Model(m)
            | Error::Unsupported(m)
            | Error::InvalidInput(m)
            | Error::KvCacheFull(m)
            | Error::Io(m)
            | Error::OutOfMemory(m)
            | Error::Internal(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for Error {}

/// Shorthand constructors used across the crate.
pub fn model_err(msg: impl Into<String>) -> Error {
    Error::Model(msg.into())
}

pub fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidInput(msg.into())
}
