//! Binding of `kvserve_core::model`: `Model` (load, tokenizer, metadata) and `Context` (decode).

use std::sync::Arc;

use kvserve_core::gguf::Value;
use kvserve_core::kv::storage::KvType;
use kvserve_core::kv::Memory;
use kvserve_core::model::{
    self as core_model, Context as CoreContext, KvOptions, Model as CoreModel,
};
use kvserve_core::Batch;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::buffer::Logits;
use crate::errors::to_py;

#[pyclass(frozen, module = "kvserve._core")]
pub struct Model {
    inner: Arc<CoreModel>,
}

fn check_token(m: &CoreModel, t: i64) -> PyResult<u32> {
    if t < 0 || t as usize >= m.n_vocab() {
        return Err(PyValueError::new_err(format!(
            "token {t} is out of range (vocabulary has {})",
            m.n_vocab()
        )));
    }
    Ok(t as u32)
}

fn value_to_py<'py>(py: Python<'py>, v: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match v {
        Value::U8(x) => x.into_pyobject(py)?.into_any(),
        Value::I8(x) => x.into_pyobject(py)?.into_any(),
        Value::U16(x) => x.into_pyobject(py)?.into_any(),
        Value::I16(x) => x.into_pyobject(py)?.into_any(),
        Value::U32(x) => x.into_pyobject(py)?.into_any(),
        Value::I32(x) => x.into_pyobject(py)?.into_any(),
        Value::U64(x) => x.into_pyobject(py)?.into_any(),
        Value::I64(x) => x.into_pyobject(py)?.into_any(),
        Value::F32(x) => x.into_pyobject(py)?.into_any(),
        Value::F64(x) => x.into_pyobject(py)?.into_any(),
        Value::Bool(x) => pyo3::types::PyBool::new(py, *x).to_owned().into_any(),
        Value::String(s) => s.into_pyobject(py)?.into_any(),
        Value::Array(items) => {
            let list = PyList::empty(py);
            for it in items {
                list.append(value_to_py(py, it)?)?;
            }
            list.into_any()
        }
    })
}

#[pymethods]
impl Model {
    #[new]
    #[pyo3(signature = (path, threads=None))]
    fn new(py: Python<'_>, path: std::path::PathBuf, threads: Option<usize>) -> PyResult<Model> {
        // Every way a model path can be unusable (missing, a directory, malformed) is a
        // `ModelError`, so `except ValueError` covers loading.
        let m = py
            .detach(|| CoreModel::load(&path, threads))
            .map_err(|e| match e {
                kvserve_core::Error::Io(m) => crate::errors::ModelError::new_err(m),
                e => to_py(e),
            })?;
        Ok(Model { inner: Arc::new(m) })
    }

    #[getter]
    fn n_vocab(&self) -> usize {
        self.inner.n_vocab()
    }

    #[getter]
    fn n_ctx_train(&self) -> usize {
        self.inner.config.n_ctx_train
    }

    #[getter]
    fn n_layer(&self) -> usize {
        self.inner.config.n_layer
    }

    #[getter]
    fn n_embd(&self) -> usize {
        self.inner.config.n_embd
    }

    #[getter]
    fn threads(&self) -> usize {
        self.inner.threads()
    }

    #[getter]
    fn bos(&self) -> Option<u32> {
        self.inner.tokenizer.bos()
    }

    #[getter]
    fn eos(&self) -> Option<u32> {
        self.inner.tokenizer.eos()
    }

    #[getter]
    fn add_bos(&self) -> bool {
        self.inner.tokenizer.add_bos()
    }

    #[getter]
    fn arch(&self) -> &'static str {
        self.inner.config.arch.name()
    }

    #[getter]
    fn name(&self) -> PyResult<String> {
        Ok(self
            .inner
            .gguf()
            .get_str("general.name")
            .map_err(to_py)?
            .unwrap_or("")
            .to_string())
    }

    #[pyo3(signature = (text, add_special=true, parse_special=false))]
    fn tokenize(
        &self,
        py: Python<'_>,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Vec<u32> {
        let text = text.to_string();
        let m = Arc::clone(&self.inner);
        py.detach(move || m.tokenizer.encode(&text, add_special, parse_special))
    }

    fn detokenize(&self, tokens: Vec<i64>) -> PyResult<String> {
        let ids = tokens
            .into_iter()
            .map(|t| check_token(&self.inner, t))
            .collect::<PyResult<Vec<u32>>>()?;
        Ok(String::from_utf8_lossy(&self.inner.tokenizer.decode(&ids)).into_owned())
    }

    #[pyo3(signature = (token, special=false))]
    fn token_to_piece<'py>(
        &self,
        py: Python<'py>,
        token: i64,
        special: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let t = check_token(&self.inner, token)?;
        Ok(PyBytes::new(
            py,
            &self.inner.tokenizer.token_to_piece(t, special),
        ))
    }

    fn is_eog(&self, token: i64) -> PyResult<bool> {
        Ok(self
            .inner
            .tokenizer
            .is_eog(check_token(&self.inner, token)?))
    }

    /// A decoding context. The KV cache holds `n_ctx` tokens, or as many blocks as fit in
    /// `kv_memory` bytes when given; `kv_type` is "f16" (default), "q8_0" or "f32".
    #[pyo3(signature = (n_ctx=4096, kv_type="f16", block_size=16, kv_memory=None))]
    fn new_context(
        &self,
        n_ctx: usize,
        kv_type: &str,
        block_size: usize,
        kv_memory: Option<usize>,
    ) -> PyResult<Context> {
        let o = KvOptions {
            n_ctx,
            kv_memory,
            kv_type: KvType::from_name(kv_type).map_err(to_py)?,
            block_size,
        };
        let ctx = CoreContext::with_options(Arc::clone(&self.inner), &o).map_err(to_py)?;
        Ok(Context { inner: ctx })
    }

    /// GGUF metadata as a dict; arrays longer than 64 items are summarized by their length.
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, v) in self.inner.gguf().metadata() {
            match v {
                Value::Array(items) if items.len() > 64 => {
                    d.set_item(k, format!("<array of {}>", items.len()))?
                }
                _ => d.set_item(k, value_to_py(py, v)?)?,
            }
        }
        Ok(d)
    }
}

#[pyclass(module = "kvserve._core")]
pub struct Context {
    inner: CoreContext,
}

#[pymethods]
impl Context {
    #[getter]
    fn n_ctx(&self) -> usize {
        self.inner.n_ctx()
    }

    /// Cells in use across all sequences.
    #[getter]
    fn n_cells(&self) -> usize {
        self.inner.cache().n_cells()
    }

    fn pos_max(&self, seq: i32) -> i32 {
        self.inner.cache().pos_max(seq)
    }

    /// Runs one batch (parallel lists); returns logits of the tokens whose `logits` flag is set.
    fn decode(
        &mut self,
        py: Python<'_>,
        tokens: Vec<i64>,
        positions: Vec<i32>,
        seq_ids: Vec<i32>,
        logits: Vec<bool>,
    ) -> PyResult<Logits> {
        let model = Arc::clone(self.inner.model());
        let tokens = tokens
            .into_iter()
            .map(|t| check_token(&model, t))
            .collect::<PyResult<Vec<u32>>>()?;
        let batch = Batch {
            tokens,
            positions,
            seq_ids,
            logits,
        };
        let out = py.detach(|| self.inner.decode(&batch)).map_err(to_py)?;
        Ok(Logits::new(out.data, out.n_rows, out.n_vocab))
    }

    fn clear(&mut self) {
        self.inner.clear()
    }

    /// Lowest position stored for `seq`, or -1.
    fn seq_pos_min(&self, seq: i32) -> i32 {
        self.inner.cache().seq_pos_min(seq)
    }

    /// Highest position stored for `seq`, or -1.
    fn seq_pos_max(&self, seq: i32) -> i32 {
        self.inner.cache().seq_pos_max(seq)
    }

    /// Drops positions [p0, p1) of `seq` (negative bounds: open ends; seq < 0: all).
    #[pyo3(signature = (seq, p0=-1, p1=-1))]
    fn seq_rm(&mut self, seq: i32, p0: i32, p1: i32) -> PyResult<()> {
        self.inner.cache_mut().seq_rm(seq, p0, p1).map_err(to_py)
    }

    /// `dst` also holds `src`'s positions in [p0, p1): blocks are shared, not copied.
    #[pyo3(signature = (src, dst, p0=-1, p1=-1))]
    fn seq_cp(&mut self, src: i32, dst: i32, p0: i32, p1: i32) -> PyResult<()> {
        self.inner
            .cache_mut()
            .table_mut()
            .seq_cp(src, dst, p0, p1)
            .map_err(to_py)
    }

    /// Drops every sequence but `seq`.
    fn seq_keep(&mut self, seq: i32) -> PyResult<()> {
        self.inner
            .cache_mut()
            .table_mut()
            .seq_keep(seq)
            .map_err(to_py)
    }

    /// Adds `delta` to positions in [p0, p1) of `seq`; keys are re-rotated before the next
    /// attention.
    fn seq_add(&mut self, seq: i32, p0: i32, p1: i32, delta: i32) -> PyResult<()> {
        self.inner
            .cache_mut()
            .table_mut()
            .seq_add(seq, p0, p1, delta)
            .map_err(to_py)
    }

    /// Divides positions in [p0, p1) of `seq` by `d` (integer division).
    fn seq_div(&mut self, seq: i32, p0: i32, p1: i32, d: i32) -> PyResult<()> {
        self.inner
            .cache_mut()
            .table_mut()
            .seq_div(seq, p0, p1, d)
            .map_err(to_py)
    }

    /// For a new (empty) sequence `seq`: maps the longest cached prefix of `tokens` (whole
    /// blocks, at most `len(tokens) - 1` tokens) onto cached blocks and returns its length `n`;
    /// decode `tokens[n:]` at positions `n..` next.
    fn match_prefix(&mut self, seq: i32, tokens: Vec<i64>) -> PyResult<usize> {
        let model = Arc::clone(self.inner.model());
        let tokens = tokens
            .into_iter()
            .map(|t| check_token(&model, t))
            .collect::<PyResult<Vec<u32>>>()?;
        self.inner
            .cache_mut()
            .match_prefix(seq, &tokens)
            .map_err(to_py)
    }

    /// Cache statistics: blocks by state, tokens stored, unused slots in held blocks, prefix
    /// lookups and the tokens they mapped.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let cache = self.inner.cache();
        let p = cache.table().pool().stats();
        let t = cache.stats();
        let d = PyDict::new(py);
        d.set_item("blocks_total", p.total)?;
        d.set_item("blocks_free", p.free)?;
        d.set_item("blocks_cached", p.cached)?;
        d.set_item("blocks_referenced", p.referenced)?;
        d.set_item("blocks_shared", p.shared)?;
        d.set_item("block_size", cache.table().block_size())?;
        let block_bytes = cache.storage().layout().bytes_per_block();
        d.set_item("bytes_per_block", block_bytes)?;
        d.set_item("bytes_referenced", p.referenced * block_bytes)?;
        d.set_item("kv_type", cache.storage().kv_type().name())?;
        d.set_item("sequences", t.sequences)?;
        d.set_item("tokens_stored", t.live_cells)?;
        d.set_item("unused_slots", t.unused_slots)?;
        let ps = cache.prefix_stats();
        d.set_item("prefix_lookups", ps.lookups)?;
        d.set_item("prefix_hit_tokens", ps.hit_tokens)?;
        Ok(d)
    }
}

/// llama-bench-style throughput: {"prefill_tok_s": pp, "decode_tok_s": tg}.
#[pyfunction]
#[pyo3(signature = (model, n_prompt=512, n_gen=128, reps=3))]
pub fn bench<'py>(
    py: Python<'py>,
    model: &Model,
    n_prompt: usize,
    n_gen: usize,
    reps: usize,
) -> PyResult<Bound<'py, PyDict>> {
    let m = Arc::clone(&model.inner);
    let r = py
        .detach(move || core_model::bench(&m, n_prompt, n_gen, reps))
        .map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("prefill_tok_s", r.prefill_tok_s)?;
    d.set_item("decode_tok_s", r.decode_tok_s)?;
    d.set_item("threads", model.inner.threads())?;
    Ok(d)
}

/// llama-batched-bench-style throughput for each batch size: a list of
/// {"batch": B, "prefill_tok_s": pp, "decode_tok_s": tg}.
#[pyfunction]
#[pyo3(signature = (model, batches, n_prompt=128, n_gen=64))]
pub fn bench_batched<'py>(
    py: Python<'py>,
    model: &Model,
    batches: Vec<usize>,
    n_prompt: usize,
    n_gen: usize,
) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    for b in batches {
        let m = Arc::clone(&model.inner);
        let r = py
            .detach(move || core_model::bench_batched(&m, b, n_prompt, n_gen))
            .map_err(to_py)?;
        let d = PyDict::new(py);
        d.set_item("batch", r.batch)?;
        d.set_item("prefill_tok_s", r.prefill_tok_s)?;
        d.set_item("decode_tok_s", r.decode_tok_s)?;
        out.append(d)?;
    }
    Ok(out)
}
