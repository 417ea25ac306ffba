//! `kvserve._core`: the thin PyO3 binding of kvserve-core. One file per core module; every core
//! error becomes a typed Python exception (see `errors.rs`); compute runs without the GIL.

use pyo3::prelude::*;

mod buffer;
mod errors;
mod model;
mod quant;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("ModelError", py.get_type::<errors::ModelError>())?;
    m.add("KvCacheFull", py.get_type::<errors::KvCacheFull>())?;
    m.add("EngineError", py.get_type::<errors::EngineError>())?;
    m.add("Logits", buffer::logits_type(py)?)?;
    m.add_class::<model::Model>()?;
    m.add_class::<model::Context>()?;
    m.add_class::<model::KvStaged>()?;
    m.add_function(wrap_pyfunction!(model::bench, m)?)?;
    m.add_function(wrap_pyfunction!(model::bench_batched, m)?)?;
    m.add_function(wrap_pyfunction!(quant::dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(quant::simd_level, m)?)?;
    Ok(())
}
