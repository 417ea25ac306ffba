//! kvserve-core: the engine behind the `kvserve` Python package.
//!
//! Pure Rust, no Python: GGUF loading over mmap ([`gguf`]), quantized block formats and
//! runtime-dispatched SIMD kernels ([`quant`]), tensor operations ([`ops`]), tokenizers built
//! from GGUF metadata ([`tokenizer`]) and the model forward passes ([`model`]).
//! Every fallible entry point returns [`Result`] with a typed [`Error`]; malformed input never
//! panics.

pub mod batch;
pub mod error;
pub mod gguf;
pub mod kv;
pub mod model;
pub mod ops;
pub mod quant;
pub mod shared;
#[cfg(all(test, not(loom)))]
pub(crate) mod test_rng;
pub mod threads;
pub mod tokenizer;

pub use batch::Batch;
pub use error::{Error, Result};
