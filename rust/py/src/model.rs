//! Binding of `kvserve_core::model`: `Model` (load, tokenizer, metadata) and `Context` (decode).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use kvserve_core::gguf::Value;
use kvserve_core::kv::disk::{DEFAULT_MIN_TOKENS, DEFAULT_QUEUE_BYTES};
use kvserve_core::kv::remote::{RemoteOptions, Staged};
use kvserve_core::kv::storage::KvType;
use kvserve_core::kv::{
    block_key, salt_root, DiskOptions, KvEvent, LayerGroups, Memory, PagedCache, SharedKv,
};
use kvserve_core::model::{
    self as core_model, Context as CoreContext, KvOptions, LayerKind, Model as CoreModel,
};
use kvserve_core::Batch;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::buffer::new_logits;
use crate::errors::{to_py, EngineError};

#[pyclass(frozen, module = "kvserve._core")]
pub struct Model {
    inner: Arc<CoreModel>,
}

fn check_token(m: &CoreModel, t: i64) -> PyResult<u32> {
    check_vocab(m.n_vocab(), t)
}

fn check_vocab(n_vocab: usize, t: i64) -> PyResult<u32> {
    if t < 0 || t as usize >= n_vocab {
        return Err(PyValueError::new_err(format!(
            "token {t} is out of range (vocabulary has {n_vocab})"
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

    /// Bytes of the weights' one-token decode copies, beyond the GGUF mapping.
    #[getter]
    fn repacked_bytes(&self) -> usize {
        self.inner.repacked_bytes()
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

    /// The weights' identity (`model_identity`: a 128-bit hash of the GGUF header, file size and
    /// sampled tensor data) as 32 hex digits; part of every prefix key and of saved sessions.
    #[getter]
    fn identity(&self) -> String {
        format!("{:032x}", self.inner.id())
    }

    /// A decoding context over the model's shared K/V memory for `kv_type` ("f16" default,
    /// "q8_0" or "f32"): at most `n_ctx` tokens. With `kv_memory` bytes or `memory_tokens`
    /// tokens, the memory (when this call makes it) is sized by them and the context may use
    /// all of it. `prefix_cache=False`: the blocks it fills are not indexed. `n_seq_max`
    /// sequences decoded at once and `n_batch`, the most tokens in one `decode` call, size the
    /// memory of sliding-window layers (llama.cpp's parameters of those names); on a model with
    /// such layers a larger batch raises `ValueError`.
    #[pyo3(signature = (n_ctx=4096, kv_type="f16", block_size=16, kv_memory=None, prefix_cache=true, memory_tokens=None, n_seq_max=1, n_batch=2048))]
    #[allow(clippy::too_many_arguments)]
    fn new_context(
        &self,
        py: Python<'_>,
        n_ctx: usize,
        kv_type: &str,
        block_size: usize,
        kv_memory: Option<usize>,
        prefix_cache: bool,
        memory_tokens: Option<usize>,
        n_seq_max: usize,
        n_batch: usize,
    ) -> PyResult<Context> {
        let o = KvOptions {
            n_ctx,
            kv_memory,
            memory_tokens,
            kv_type: KvType::from_name(kv_type).map_err(to_py)?,
            block_size,
            prefix_cache,
            n_seq_max,
            n_batch,
        };
        let m = Arc::clone(&self.inner);
        let ctx = py
            .detach(move || CoreContext::with_options(m, &o))
            .map_err(to_py)?;
        Ok(Context::new(ctx))
    }

    /// Tasks of redoable matmul steps that a waiting worker computed again and published (its
    /// partner was taking too long: usually descheduled by the OS) since the model was loaded;
    /// a diagnostic of thread contention.
    #[getter]
    fn redone_tasks(&self) -> u64 {
        self.inner.redone_tasks()
    }

    /// Testing hook: the next decode on this model panics in one worker thread at `layer`
    /// (once); `None` disarms it. The decode then raises `kvserve.EngineError` and rolls back.
    #[pyo3(signature = (layer))]
    fn _inject_worker_panic(&self, layer: Option<usize>) {
        self.inner.inject_worker_panic(layer);
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

/// Counters of one context, published after every operation so that `stats()` and `n_cells`
/// answer from any thread at once, even while a decode holds the context.
#[derive(Default)]
struct Published {
    sequences: AtomicUsize,
    tokens: AtomicUsize,
    held_blocks: AtomicUsize,
    unused_slots: AtomicUsize,
    lookups: AtomicU64,
    hit_tokens: AtomicU64,
    /// Per layer group: (tokens stored, blocks held) by this context.
    groups: Vec<(AtomicUsize, AtomicUsize)>,
    /// Sequences holding a recurrent state (hybrid models).
    recurrent_states: AtomicUsize,
}

impl Published {
    fn new(ctx: &CoreContext) -> Published {
        let p = Published {
            groups: ctx
                .memory()
                .groups()
                .iter()
                .map(|_| (AtomicUsize::new(0), AtomicUsize::new(0)))
                .collect(),
            ..Published::default()
        };
        p.update_all(ctx);
        p
    }

    fn update_all(&self, ctx: &CoreContext) {
        self.update(ctx.cache());
        for (g, (tokens, held)) in ctx.memory().groups().iter().zip(&self.groups) {
            let t = g.cache.stats();
            tokens.store(t.live_cells, Ordering::Relaxed);
            held.store(t.held_blocks, Ordering::Relaxed);
        }
        if let Some(r) = ctx.memory().recurrent() {
            self.recurrent_states.store(r.n_states(), Ordering::Relaxed);
        }
    }

    /// A closed context holds nothing: its current counts are 0 (prefix counters stay).
    fn clear(&self) {
        for a in [
            &self.sequences,
            &self.tokens,
            &self.held_blocks,
            &self.unused_slots,
            &self.recurrent_states,
        ] {
            a.store(0, Ordering::Relaxed);
        }
        for (tokens, held) in &self.groups {
            tokens.store(0, Ordering::Relaxed);
            held.store(0, Ordering::Relaxed);
        }
    }

    fn update(&self, c: &PagedCache) {
        let t = c.stats();
        let p = c.prefix_stats();
        self.sequences.store(t.sequences, Ordering::Relaxed);
        self.tokens.store(t.live_cells, Ordering::Relaxed);
        self.held_blocks.store(t.held_blocks, Ordering::Relaxed);
        self.unused_slots.store(t.unused_slots, Ordering::Relaxed);
        self.lookups.store(p.lookups, Ordering::Relaxed);
        self.hit_tokens.store(p.hit_tokens, Ordering::Relaxed);
    }
}

/// A decoding context. Thread-safe: calls from several Python threads are serialized on the
/// context (without the GIL), while `n_cells`, `n_ctx` and `stats()` never wait.
#[pyclass(frozen, module = "kvserve._core")]
pub struct Context {
    inner: Mutex<Option<CoreContext>>,
    shared: Arc<SharedKv>,
    /// Per layer group: its kind and layer count, and its K/V memory.
    groups: Vec<(LayerKind, usize, Arc<SharedKv>)>,
    /// The recurrent group of a hybrid model: (layers, pool blocks one state takes); its states
    /// take blocks of the primary pool (`shared`).
    recurrent: Option<(usize, usize)>,
    /// Whether the recurrent group keeps state checkpoints (the shared tier fetches them).
    checkpoints: bool,
    n_ctx: usize,
    n_vocab: usize,
    published: Published,
    /// Test hook: the next call through [`Context::with`] panics (`_inject_panic`).
    panic_next: AtomicBool,
}

impl Context {
    fn new(ctx: CoreContext) -> Context {
        let published = Published::new(&ctx);
        Context {
            shared: Arc::clone(ctx.cache().shared()),
            groups: ctx
                .memory()
                .groups()
                .iter()
                .map(|g| (g.kind, g.layers.len(), Arc::clone(g.cache.shared())))
                .collect(),
            recurrent: ctx
                .memory()
                .recurrent()
                .map(|r| (ctx.memory().n_recurrent_layers(), r.blocks_per_state())),
            checkpoints: ctx.memory().keeps_checkpoints(),
            n_ctx: ctx.n_ctx(),
            n_vocab: ctx.model().n_vocab(),
            inner: Mutex::new(Some(ctx)),
            published,
            panic_next: AtomicBool::new(false),
        }
    }

    /// Runs `f` on the context with the GIL released, then publishes its counters. A Rust panic
    /// in `f` (a bug: the core catches panics of the forward pass and rolls the batch back)
    /// closes the context: this and every later call raise `kvserve.EngineError`.
    ///
    /// Closing drops the core context at once, which gives every block its sequences held back
    /// to the model's shared pools (keyed blocks stay cached and indexed for the next context;
    /// a batch the panic interrupted gives back its pinned copy sources and fresh state blocks
    /// as its transactions drop during the unwind). What a panic cannot break: the pools
    /// themselves (every state change of a block is one atomic step, and the cached list's
    /// critical sections cannot panic midway) and the ownership of blocks (the tables take a
    /// pool reference before they record it and forget a record before they release it, so
    /// a table broken midway by a panic releases at worst fewer references than it took:
    /// such blocks stay referenced, lost to the pool until the process ends, never handed to
    /// two owners). A drop that panics in turn is caught here too.
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut CoreContext) -> kvserve_core::Result<T> + Send,
    ) -> PyResult<T> {
        py.detach(|| {
            let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            let Some(ctx) = guard.as_mut() else {
                return Err(EngineError::new_err(
                    "this context was closed after an internal error; create a new one",
                ));
            };
            let inject = self.panic_next.swap(false, Ordering::Relaxed);
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                if inject {
                    panic!("panic injected by Context._inject_panic");
                }
                f(ctx)
            }));
            match run {
                Ok(r) => {
                    self.published.update_all(ctx);
                    r.map_err(to_py)
                }
                Err(_) => {
                    let dead = guard.take();
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(dead)));
                    self.published.clear();
                    Err(EngineError::new_err(
                        "internal error in the KV cache; the context was closed",
                    ))
                }
            }
        })
    }
}

#[pymethods]
impl Context {
    #[getter]
    fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// Cells in use across all sequences (never waits for a running decode).
    #[getter]
    fn n_cells(&self) -> usize {
        self.published.tokens.load(Ordering::Relaxed)
    }

    /// Runs one batch (parallel lists); returns logits of the tokens whose `logits` flag is set.
    fn decode(
        &self,
        py: Python<'_>,
        tokens: Vec<i64>,
        positions: Vec<i32>,
        seq_ids: Vec<i32>,
        logits: Vec<bool>,
    ) -> PyResult<Py<PyAny>> {
        let tokens = tokens
            .into_iter()
            .map(|t| check_vocab(self.n_vocab, t))
            .collect::<PyResult<Vec<u32>>>()?;
        let batch = Batch {
            tokens,
            positions,
            seq_ids,
            logits,
        };
        let out = self.with(py, |c| c.decode(&batch))?;
        new_logits(py, out.data, out.n_rows, out.n_vocab)
    }

    /// Asks before decoding: whether a batch of these positions and sequence ids (the
    /// `positions` and `seq_ids` that `decode` would get) fits the K/V memory now, counting
    /// every layer group: 0 when it fits (then `decode` of it does not raise `KvCacheFull`,
    /// unless another context of the model takes blocks in between), else the largest number
    /// of blocks missing in any group's pool (then `decode` raises `KvCacheFull`). Changes
    /// nothing. `ValueError` for a batch `decode` rejects as malformed.
    fn blocks_short(
        &self,
        py: Python<'_>,
        positions: Vec<i32>,
        seq_ids: Vec<i32>,
    ) -> PyResult<usize> {
        let n = positions.len();
        // The tokens do not matter to what a batch needs; token 0 stands for each (always in
        // the vocabulary), so that the batch is checked exactly as `decode` checks it.
        let batch = Batch {
            tokens: vec![0; n],
            positions,
            seq_ids,
            logits: vec![false; n],
        };
        self.with(py, |c| c.blocks_short(&batch))
    }

    fn clear(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |c| {
            c.clear();
            Ok(())
        })
    }

    /// Lowest position stored for `seq` (all sequences if `seq < 0`), or -1.
    fn seq_pos_min(&self, py: Python<'_>, seq: i32) -> PyResult<i32> {
        self.with(py, |c| Ok(c.memory().seq_pos_min(seq)))
    }

    /// Highest position stored for `seq` (all sequences if `seq < 0`), or -1.
    fn seq_pos_max(&self, py: Python<'_>, seq: i32) -> PyResult<i32> {
        self.with(py, |c| Ok(c.memory().seq_pos_max(seq)))
    }

    /// Drops positions [p0, p1) of `seq` (negative bounds: open ends; seq < 0: all).
    #[pyo3(signature = (seq, p0=-1, p1=-1))]
    fn seq_rm(&self, py: Python<'_>, seq: i32, p0: i32, p1: i32) -> PyResult<()> {
        self.with(py, |c| c.memory_mut().seq_rm(seq, p0, p1))
    }

    /// `dst` also holds `src`'s positions in [p0, p1): blocks are shared, not copied.
    #[pyo3(signature = (src, dst, p0=-1, p1=-1))]
    fn seq_cp(&self, py: Python<'_>, src: i32, dst: i32, p0: i32, p1: i32) -> PyResult<()> {
        self.with(py, |c| c.memory_mut().seq_cp(src, dst, p0, p1))
    }

    /// Drops every sequence but `seq`.
    fn seq_keep(&self, py: Python<'_>, seq: i32) -> PyResult<()> {
        self.with(py, |c| c.memory_mut().seq_keep(seq))
    }

    /// Adds `delta` to positions in [p0, p1) of `seq`; keys are re-rotated before the next
    /// attention.
    fn seq_add(&self, py: Python<'_>, seq: i32, p0: i32, p1: i32, delta: i32) -> PyResult<()> {
        self.with(py, |c| c.memory_mut().seq_add(seq, p0, p1, delta))
    }

    /// Divides positions in [p0, p1) of `seq` by `d` (integer division).
    fn seq_div(&self, py: Python<'_>, seq: i32, p0: i32, p1: i32, d: i32) -> PyResult<()> {
        self.with(py, |c| c.memory_mut().seq_div(seq, p0, p1, d))
    }

    /// For a new (empty) sequence `seq`: maps the longest cached prefix of `tokens` (whole
    /// blocks, at most `len(tokens) - 1` tokens), computed by any context of this model, onto
    /// cached blocks and returns its length `n`; decode `tokens[n:]` at positions `n..` next.
    ///
    /// `staged`: blocks `kv_remote_fetch` brought from the shared tier for these tokens and
    /// this sequence's salt; a block neither RAM nor disk holds is copied from them.
    #[pyo3(signature = (seq, tokens, staged = None))]
    fn match_prefix(
        &self,
        py: Python<'_>,
        seq: i32,
        tokens: Vec<i64>,
        staged: Option<PyRef<'_, KvStaged>>,
    ) -> PyResult<usize> {
        let tokens = tokens
            .into_iter()
            .map(|t| check_vocab(self.n_vocab, t))
            .collect::<PyResult<Vec<u32>>>()?;
        let staged = staged.and_then(|s| s.take());
        self.with(py, move |c| {
            c.match_prefix_staged(seq, &tokens, staged.as_deref().map_or(&[], Vec::as_slice))
        })
    }

    /// Fetches from the shared tier (if one is attached) the blocks a match of `tokens` in a
    /// sequence salted with `salt` would need beyond what RAM and disk hold (the leading run
    /// the store has, verified; with sliding-window layers also the window group's blocks
    /// before the point the full group reaches; for a hybrid model the state checkpoint at
    /// the end of that run, or one a little below it), for `match_prefix(..., staged=)`. Never
    /// waits for the context
    /// (runs on any thread while decodes go on, without the GIL); never fails: a store that
    /// is down or slow gives fewer blocks (counted in `stats()`).
    #[pyo3(signature = (tokens, salt = b"".as_slice()))]
    fn kv_remote_fetch(&self, py: Python<'_>, tokens: Vec<i64>, salt: &[u8]) -> PyResult<KvStaged> {
        let tokens = tokens
            .into_iter()
            .map(|t| check_vocab(self.n_vocab, t))
            .collect::<PyResult<Vec<u32>>>()?;
        let root = salt_root(salt);
        let checkpoints = self.checkpoints;
        let groups: Vec<(LayerKind, Arc<SharedKv>)> = self
            .groups
            .iter()
            .map(|(k, _, s)| (*k, Arc::clone(s)))
            .collect();
        let staged = py.detach(move || {
            let g: Vec<_> = groups.iter().map(|(k, s)| (*k, s.as_ref())).collect();
            LayerGroups::fetch_remote(&g, &tokens, root, checkpoints)
        });
        Ok(KvStaged::new(staged))
    }

    /// The shared tier's store keys (`kvs:v1:<model id>:<block key>`) of the whole blocks of
    /// `tokens` in a sequence salted with `salt`, in order (tools and tests): the primary
    /// (full-attention) group's; another group's carry its own model id.
    #[pyo3(signature = (tokens, salt = b"".as_slice()))]
    fn kv_remote_keys(&self, tokens: Vec<i64>, salt: &[u8]) -> PyResult<Vec<String>> {
        let tokens = tokens
            .into_iter()
            .map(|t| check_vocab(self.n_vocab, t))
            .collect::<PyResult<Vec<u32>>>()?;
        let id = self.shared.model_id();
        let mut parent = salt_root(salt);
        let bs = self.shared.layout().block_size;
        Ok(tokens
            .chunks_exact(bs)
            .map(|chunk| {
                parent = block_key(id, parent, chunk);
                format!("kvs:v1:{id:032x}:{parent:032x}")
            })
            .collect())
    }

    /// How many tokens `match_prefix` would map for `tokens` now in a sequence salted with
    /// `salt` (empty: unsalted), without mapping anything or touching the pool (an estimate
    /// for scheduling: blocks may be evicted before a match).
    #[pyo3(signature = (tokens, salt = b"".as_slice()))]
    fn peek_prefix(&self, py: Python<'_>, tokens: Vec<i64>, salt: &[u8]) -> PyResult<usize> {
        let tokens = tokens
            .into_iter()
            .map(|t| check_vocab(self.n_vocab, t))
            .collect::<PyResult<Vec<u32>>>()?;
        self.with(py, |c| Ok(c.peek_prefix(&tokens, salt)))
    }

    /// Salts the empty sequence `seq`: its K/V blocks' content keys depend on `salt`, so it
    /// reuses cached prefixes only of sequences with the same salt (empty: unsalted). Kept
    /// for the id until set again; `seq_cp` into an empty sequence copies it.
    fn seq_set_salt(&self, py: Python<'_>, seq: i32, salt: &[u8]) -> PyResult<()> {
        self.with(py, |c| c.seq_set_salt(seq, salt))
    }

    /// The state of sequence `seq` as bytes: its positions, token ids and K/V rows exactly as
    /// stored, plus the weights identity and K/V format; for a model with several layer groups
    /// (sliding-window layers) what each group holds (see `kv::state` in the core).
    fn seq_state_read<'py>(&self, py: Python<'py>, seq: i32) -> PyResult<Bound<'py, PyBytes>> {
        let data = self.with(py, |c| c.seq_state_read(seq))?;
        Ok(PyBytes::new(py, &data))
    }

    /// Writes a state from `seq_state_read` (this model and K/V format, any context or process)
    /// into the empty sequence `seq` without recomputing it; returns its token count. All or
    /// nothing: `ValueError` for a bad state or a non-empty `seq`, `KvCacheFull` without room.
    fn seq_state_write(&self, py: Python<'_>, seq: i32, data: &[u8]) -> PyResult<usize> {
        let data = data.to_vec();
        self.with(py, move |c| c.seq_state_write(seq, &data))
    }

    /// Checks, writing nothing, that `data` (from `seq_state_read`) is a state of this model,
    /// K/V format and layer groups holding exactly `tokens` at positions `0..n` (a saved
    /// session's state); returns `n`. Everything `seq_state_write` validates, and the tokens:
    /// `ValueError` saying what differs.
    fn seq_state_check(&self, py: Python<'_>, data: &[u8], tokens: Vec<i64>) -> PyResult<usize> {
        let tokens = tokens
            .into_iter()
            .map(|t| check_vocab(self.n_vocab, t))
            .collect::<PyResult<Vec<u32>>>()?;
        let data = data.to_vec();
        self.with(py, move |c| c.seq_state_check(&data, &tokens))
    }

    /// Attaches the K/V disk tier under `path` to the model's K/V memory (every context of it
    /// then writes the blocks its decodes key through to disk and continues prefix matches
    /// there), at most `max_bytes` of entries; prompts shorter than `min_tokens` (default: the
    /// measured break-even) skip it. `path=None` detaches it. With sliding-window layers each
    /// K/V group gets a tier under `path/<its model id>/`; a hybrid model's state checkpoints
    /// go to the full-attention group's tier. `OSError` when the directory cannot be used or
    /// another process holds it, `ValueError` when `max_bytes` holds no block.
    #[pyo3(signature = (path, max_bytes, min_tokens=None))]
    fn set_kv_disk(
        &self,
        py: Python<'_>,
        path: Option<std::path::PathBuf>,
        max_bytes: u64,
        min_tokens: Option<usize>,
    ) -> PyResult<()> {
        let o = DiskOptions {
            max_bytes,
            min_tokens: min_tokens.unwrap_or(DEFAULT_MIN_TOKENS),
            queue_bytes: DEFAULT_QUEUE_BYTES,
        };
        self.with(py, move |c| c.set_kv_disk(path.as_deref(), o))
    }

    /// Attaches the shared K/V tier on the Redis / Valkey store at `url` to the model's K/V
    /// memory (every context of it then writes the blocks its decodes key through to the
    /// store; `kv_remote_fetch` stages blocks from it). `ttl_s`: time to live of written blocks;
    /// prompts shorter than `min_tokens` (default: the measured break-even) skip it;
    /// `timeout_s` bounds each command; at most `max_fetch_blocks` blocks a fetch and
    /// `max_staged_bytes` staged at once over all fetches awaiting admission (0: no limit).
    /// `url=None` detaches it. Does not connect. A tier per K/V layer group (a hybrid model's
    /// state checkpoints in the full-attention group's). `ModelError` for a TLS URL,
    /// `ValueError` for a bad URL or option.
    #[pyo3(signature = (
        url, ttl_s=None, min_tokens=None, timeout_s=None, max_fetch_blocks=0, max_staged_bytes=0
    ))]
    #[allow(clippy::too_many_arguments)]
    fn set_kv_remote(
        &self,
        py: Python<'_>,
        url: Option<String>,
        ttl_s: Option<f64>,
        min_tokens: Option<usize>,
        timeout_s: Option<f64>,
        max_fetch_blocks: usize,
        max_staged_bytes: u64,
    ) -> PyResult<()> {
        let secs = |v: Option<f64>, name: &str, d: std::time::Duration| match v {
            None => Ok(d),
            Some(x) if x.is_finite() && x > 0.0 && x < 1e9 => {
                Ok(std::time::Duration::from_secs_f64(x))
            }
            Some(x) => Err(PyValueError::new_err(format!(
                "{name} must be a positive number of seconds, got {x}"
            ))),
        };
        let d = RemoteOptions::default();
        let o = RemoteOptions {
            ttl: secs(ttl_s, "ttl_s", d.ttl)?,
            min_tokens: min_tokens.unwrap_or(d.min_tokens),
            timeout: secs(timeout_s, "timeout_s", d.timeout)?,
            max_fetch_blocks,
            max_staged_bytes,
            ..d
        };
        self.with(py, move |c| c.set_kv_remote(url.as_deref(), o))
    }

    /// Waits until the shared tier (if any) has sent every block handed to it so far (or
    /// dropped it); never waits for the context.
    fn kv_remote_flush(&self, py: Python<'_>) {
        for (_, _, s) in &self.groups {
            if let Some(r) = s.remote() {
                py.detach(|| r.flush());
            }
        }
    }

    /// None when the shared tier's store answers `PING` now (or there is no tier), else why
    /// not. Never waits for the context.
    fn kv_remote_ping(&self, py: Python<'_>) -> Option<String> {
        let r = self.shared.remote()?;
        py.detach(|| r.ping().err())
    }

    /// Waits until the disk tier (if any) has written every block handed to it so far (or
    /// dropped it); never waits for the context.
    fn kv_disk_flush(&self, py: Python<'_>) {
        for (_, _, s) in &self.groups {
            if let Some(d) = s.disk() {
                py.detach(|| d.flush());
            }
        }
    }

    /// Starts recording the model's KV events for this K/V memory (every context of it feeds
    /// them), at most `capacity` waiting between drains; `None` stops. Off by default.
    #[pyo3(signature = (capacity))]
    fn kv_events_enable(&self, capacity: Option<usize>) -> PyResult<()> {
        if capacity == Some(0) {
            return Err(PyValueError::new_err("capacity must be >= 1 or None"));
        }
        self.shared.kv_events_enable(capacity);
        Ok(())
    }

    /// `(events, dropped)`: the KV events since the last drain, each a tuple
    /// `("BlockStored", key, parent, tokens, medium)`, `("BlockRemoved", key, medium)` or
    /// `("AllBlocksCleared",)` (keys: 128-bit ints); after drops, or first after enabling, a
    /// snapshot (`AllBlocksCleared`, then every key held). Never waits for a decode.
    fn kv_events_drain<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyList>, u64)> {
        let d = py.detach(|| self.shared.kv_events_drain());
        let out = PyList::empty(py);
        for e in d.events {
            let item = match e {
                KvEvent::BlockStored {
                    key,
                    parent,
                    tokens,
                    medium,
                } => ("BlockStored", key, parent, tokens, medium.as_str()).into_pyobject(py)?,
                KvEvent::BlockRemoved { key, medium } => {
                    ("BlockRemoved", key, medium.as_str()).into_pyobject(py)?
                }
                KvEvent::AllBlocksCleared => ("AllBlocksCleared",).into_pyobject(py)?,
            };
            out.append(item)?;
        }
        Ok((out, d.dropped))
    }

    /// The content keys (128-bit ints) this memory gives the whole blocks of `tokens` in a
    /// sequence salted with `salt` (empty: unsalted), in order: the keys its KV events name
    /// and its prefix matches look up.
    #[pyo3(signature = (tokens, salt = b"".as_slice()))]
    fn block_keys(&self, tokens: Vec<i64>, salt: &[u8]) -> PyResult<Vec<u128>> {
        let tokens = tokens
            .into_iter()
            .map(|t| check_vocab(self.n_vocab, t))
            .collect::<PyResult<Vec<u32>>>()?;
        Ok(self.shared.block_keys(&tokens, salt))
    }

    /// Cache statistics (never waits for a running decode): the model's block pool for this
    /// K/V format (shared by all its contexts) by state, and this context's sequences, tokens,
    /// unused slots, prefix lookups and the tokens they mapped. `disk_*`: the model's disk
    /// tier (zeros and `disk_enabled=False` without one): blocks and tokens read back,
    /// misses, bytes read and written, entries written and writes dropped (queue full),
    /// entries removed as invalid and evicted by the size limit, lookups that skipped the
    /// tier (prompt under `disk_min_tokens`), entries and bytes held, the size limit, entries
    /// found at open, blocks queued, and the seconds the reads that hit took.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let p = self.shared.pool_stats();
        let layout = self.shared.layout();
        let pb = &self.published;
        let d = PyDict::new(py);
        d.set_item("blocks_total", p.total)?;
        d.set_item("blocks_free", p.free)?;
        d.set_item("blocks_cached", p.cached)?;
        d.set_item("blocks_referenced", p.referenced)?;
        d.set_item("blocks_shared", p.shared)?;
        d.set_item("blocks_evicted", p.evicted)?;
        d.set_item("block_size", layout.block_size)?;
        let block_bytes = layout.bytes_per_block();
        d.set_item("bytes_per_block", block_bytes)?;
        d.set_item("bytes_referenced", p.referenced * block_bytes)?;
        d.set_item("kv_type", layout.ty.name())?;
        d.set_item("sequences", pb.sequences.load(Ordering::Relaxed))?;
        d.set_item("tokens_stored", pb.tokens.load(Ordering::Relaxed))?;
        d.set_item("blocks_held", pb.held_blocks.load(Ordering::Relaxed))?;
        d.set_item("unused_slots", pb.unused_slots.load(Ordering::Relaxed))?;
        d.set_item("prefix_lookups", pb.lookups.load(Ordering::Relaxed))?;
        d.set_item("prefix_hit_tokens", pb.hit_tokens.load(Ordering::Relaxed))?;
        d.set_item("prefix_indexed", self.shared.index().len())?;
        // A model with several K/V groups (Gemma 3) has a tier per group: counts are summed.
        let disk = self.shared.disk();
        let mut ds = kvserve_core::kv::disk::DiskStats::default();
        for (_, _, s) in &self.groups {
            if let Some(t) = s.disk() {
                ds.merge(&t.stats());
            }
        }
        d.set_item("disk_enabled", disk.is_some())?;
        d.set_item(
            "disk_dir",
            disk.as_ref().map(|t| t.dir().display().to_string()),
        )?;
        for (k, v) in [
            ("disk_hit_blocks", ds.hit_blocks),
            ("disk_hit_tokens", ds.hit_tokens),
            ("disk_misses", ds.misses),
            ("disk_bytes_read", ds.bytes_read),
            ("disk_bytes_written", ds.bytes_written),
            ("disk_writes", ds.writes),
            ("disk_writes_dropped", ds.writes_dropped),
            ("disk_removed", ds.removed),
            ("disk_evicted", ds.evicted),
            ("disk_skipped", ds.skipped),
            ("disk_entries", ds.entries),
            ("disk_bytes_held", ds.bytes_held),
            ("disk_bytes_max", ds.max_bytes),
            ("disk_loaded", ds.loaded),
            ("disk_queued", ds.queued),
        ] {
            d.set_item(k, v)?;
        }
        d.set_item("disk_read_seconds", ds.read_seconds)?;
        d.set_item("disk_min_tokens", ds.min_tokens)?;
        let remote = self.shared.remote();
        let mut rs = kvserve_core::kv::remote::RemoteStats::default();
        for (_, _, s) in &self.groups {
            if let Some(t) = s.remote() {
                rs.merge(&t.stats());
            }
        }
        d.set_item("remote_enabled", remote.is_some())?;
        d.set_item(
            "remote_url",
            remote.as_ref().map(|t| format!("{:?}", t.addr())),
        )?;
        for (k, v) in [
            ("remote_fetches", rs.fetches),
            ("remote_fetched_blocks", rs.fetched_blocks),
            ("remote_hit_blocks", rs.hit_blocks),
            ("remote_hit_tokens", rs.hit_tokens),
            ("remote_misses", rs.misses),
            ("remote_invalid", rs.invalid),
            ("remote_lost", rs.lost),
            ("remote_bytes_read", rs.bytes_read),
            ("remote_bytes_written", rs.bytes_written),
            ("remote_writes", rs.writes),
            ("remote_writes_existing", rs.writes_existing),
            ("remote_writes_dropped", rs.writes_dropped),
            ("remote_errors", rs.errors),
            ("remote_skipped_short", rs.skipped_short),
            ("remote_skipped_down", rs.skipped_down),
            ("remote_skipped_full", rs.skipped_full),
            ("remote_staged_bytes", rs.staged_bytes),
            ("remote_queued", rs.queued),
        ] {
            d.set_item(k, v)?;
        }
        d.set_item("remote_fetch_seconds", rs.fetch_seconds)?;
        d.set_item("remote_min_tokens", rs.min_tokens)?;
        d.set_item("remote_down", rs.down)?;
        // Per layer group (one for most models; full and window groups for Gemma 3): the
        // group's pool and what this context holds in it.
        let groups = PyList::empty(py);
        for ((kind, n_layers, sh), (tokens, held)) in self.groups.iter().zip(&pb.groups) {
            let g = PyDict::new(py);
            let (name, window) = match kind {
                LayerKind::Full => ("full", None),
                LayerKind::Window(w) => ("window", Some(*w)),
                LayerKind::Recurrent => ("recurrent", None),
            };
            let p = sh.pool_stats();
            let bpb = sh.layout().bytes_per_block();
            g.set_item("kind", name)?;
            g.set_item("window", window)?;
            g.set_item("layers", *n_layers)?;
            g.set_item("blocks_total", p.total)?;
            g.set_item("blocks_free", p.free)?;
            g.set_item("blocks_cached", p.cached)?;
            g.set_item("blocks_referenced", p.referenced)?;
            g.set_item("blocks_evicted", p.evicted)?;
            // This group's tiers (the top-level `disk_*` / `remote_*` sum every group's).
            let ds = sh.disk().map(|t| t.stats()).unwrap_or_default();
            g.set_item("disk_hit_blocks", ds.hit_blocks)?;
            g.set_item("disk_entries", ds.entries)?;
            let rs = sh.remote().map(|t| t.stats()).unwrap_or_default();
            g.set_item("remote_hit_blocks", rs.hit_blocks)?;
            g.set_item("remote_fetched_blocks", rs.fetched_blocks)?;
            g.set_item("bytes_per_block", bpb)?;
            g.set_item("bytes_total", p.total * bpb)?;
            g.set_item("bytes_referenced", p.referenced * bpb)?;
            g.set_item("tokens_stored", tokens.load(Ordering::Relaxed))?;
            g.set_item("blocks_held", held.load(Ordering::Relaxed))?;
            groups.append(g)?;
        }
        // A hybrid model's recurrent group: one state per sequence, in blocks of the primary
        // pool (its usage: the blocks this context's states take of that pool).
        if let Some((n_layers, per_state)) = self.recurrent {
            let g = PyDict::new(py);
            let p = self.shared.pool_stats();
            let bpb = self.shared.layout().bytes_per_block();
            let states = pb.recurrent_states.load(Ordering::Relaxed);
            g.set_item("kind", "recurrent")?;
            g.set_item("window", None::<usize>)?;
            g.set_item("layers", n_layers)?;
            g.set_item("states", states)?;
            g.set_item("blocks_total", p.total)?;
            g.set_item("blocks_free", p.free)?;
            g.set_item("blocks_cached", 0)?;
            g.set_item("blocks_referenced", states * per_state)?;
            g.set_item("bytes_per_block", bpb)?;
            g.set_item("bytes_total", p.total * bpb)?;
            g.set_item("bytes_referenced", states * per_state * bpb)?;
            g.set_item("tokens_stored", states)?;
            g.set_item("blocks_held", states * per_state)?;
            groups.append(g)?;
        }
        d.set_item("groups", groups)?;
        Ok(d)
    }

    /// Testing hook: the next call on this context that runs on it (every method but `n_ctx`,
    /// `n_cells` and `stats`) panics inside the engine before doing anything, so the context
    /// closes as after a real internal error: that call raises `EngineError`, the context's
    /// blocks go back to the model's shared pools at once, and every later call raises
    /// `EngineError`.
    fn _inject_panic(&self) {
        self.panic_next.store(true, Ordering::Relaxed);
    }

    /// Checks every invariant of this context's tables and of the model's pool (for tests; run
    /// it while no other context of the model is working). Raises `RuntimeError` on a violation.
    fn audit(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |c| {
            for g in c.memory().groups() {
                g.cache
                    .table()
                    .check()
                    .map_err(|e| kvserve_core::Error::Internal(format!("KV audit failed: {e}")))?;
            }
            if let Some(r) = c.memory().recurrent() {
                r.check().map_err(|e| {
                    kvserve_core::Error::Internal(format!("recurrent audit failed: {e}"))
                })?;
            }
            Ok(())
        })
    }
}

/// llama-bench-style throughput: {"prefill_tok_s": pp, "decode_tok_s": tg}, each after
/// `depth` tokens already in the context (llama-bench's `-d`).
#[pyfunction]
#[pyo3(signature = (model, n_prompt=512, n_gen=128, reps=3, depth=0))]
pub fn bench<'py>(
    py: Python<'py>,
    model: &Model,
    n_prompt: usize,
    n_gen: usize,
    reps: usize,
    depth: usize,
) -> PyResult<Bound<'py, PyDict>> {
    let m = Arc::clone(&model.inner);
    let r = py
        .detach(move || core_model::bench(&m, n_prompt, n_gen, depth, reps))
        .map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("prefill_tok_s", r.prefill_tok_s)?;
    d.set_item("decode_tok_s", r.decode_tok_s)?;
    d.set_item("threads", model.inner.threads())?;
    d.set_item("depth", depth)?;
    // Per K/V layer group: what the benchmark's sequence held after its prompt.
    let groups = PyList::empty(py);
    for u in &r.groups {
        let g = PyDict::new(py);
        let (name, window) = match u.kind {
            LayerKind::Full => ("full", None),
            LayerKind::Window(w) => ("window", Some(w)),
            LayerKind::Recurrent => ("recurrent", None),
        };
        g.set_item("kind", name)?;
        g.set_item("window", window)?;
        g.set_item("layers", u.layers)?;
        g.set_item("blocks_total", u.blocks_total)?;
        g.set_item("blocks_held", u.blocks_held)?;
        g.set_item("bytes_per_block", u.bytes_per_block)?;
        g.set_item("block_size", u.block_size)?;
        g.set_item("bytes_held", u.blocks_held * u.bytes_per_block)?;
        g.set_item("bytes_total", u.blocks_total * u.bytes_per_block)?;
        groups.append(g)?;
    }
    d.set_item("kv_groups", groups)?;
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

/// Blocks fetched from the shared K/V tier for one prompt (`Context.kv_remote_fetch`), until
/// a `match_prefix(..., staged=)` takes them (once) or the object goes.
#[pyclass(frozen, module = "kvserve._core")]
pub struct KvStaged {
    /// One set per K/V group, in group order.
    inner: Mutex<Option<Arc<Vec<Staged>>>>,
    n_blocks: usize,
}

impl KvStaged {
    fn new(s: Vec<Staged>) -> KvStaged {
        let n_blocks = s.iter().map(Staged::len).sum();
        KvStaged {
            n_blocks,
            inner: Mutex::new((n_blocks > 0).then(|| Arc::new(s))),
        }
    }

    fn take(&self) -> Option<Arc<Vec<Staged>>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

#[pymethods]
impl KvStaged {
    /// Blocks the fetch brought (over every layer group).
    #[getter]
    fn blocks(&self) -> usize {
        self.n_blocks
    }

    /// Gives the staged bytes back now (a request that will not be matched).
    fn release(&self) {
        self.take();
    }
}
