//! Models: loading a GGUF file into a runnable [`Model`] (weights stay in the mapping), and a
//! [`Context`] that runs batches through it and keeps their keys and values.

pub mod config;
pub mod gemma3;
pub mod lfm2;
pub mod llama;

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::batch::Batch;
use crate::error::{invalid, Error, Result};
use crate::gguf::GgufFile;
use crate::kv::memory::{Group, LayerGroups, Memory, PlannedBatch, RecurrentLayers};
use crate::kv::recurrent::{RecurrentGroup, StateLayout};
use crate::kv::storage::KvStorage;
use crate::kv::storage::{KvLayout, KvType};
use crate::kv::{
    blocks_for_tokens, BlockId, DiskOptions, DiskTier, Key, KeyHasher, PagedCache, Pos,
    RemoteOptions, RemoteTier, SeqId, SeqView, SharedKv, Staged, DEFAULT_BLOCK_SIZE,
};
use crate::tokenizer::{Tokenizer, VocabData};

pub use config::{Arch, Config, LayerKind};

/// The weights of one architecture family (each family's file loads and runs its own).
enum Weights {
    Llama(llama::Weights),
    Gemma3(gemma3::Weights),
    Lfm2(lfm2::Weights),
}

impl Weights {
    fn matmul_weights_mut(&mut self) -> Vec<&mut llama::WeightRef> {
        match self {
            Weights::Llama(w) => w.matmul_weights_mut(),
            Weights::Gemma3(w) => w.matmul_weights_mut(),
            Weights::Lfm2(w) => w.matmul_weights_mut(),
        }
    }
}

/// `MemAvailable` of /proc/meminfo in bytes (None where it cannot be read).
fn available_memory() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// Whether the model copies its Q4_0, Q4_1, Q5_0 and Q8_0 matrices into the one-token decode layout
/// ([`crate::quant::x16`]): `KVSERVE_REPACK` unset, blank or `1`; `0` keeps only the GGUF
/// mapping (less memory, slower decode of one sequence). Any other value is an error.
fn repack_enabled() -> Result<bool> {
    match std::env::var("KVSERVE_REPACK").as_deref().map(str::trim) {
        Err(_) | Ok("") | Ok("1") => Ok(true),
        Ok("0") => Ok(false),
        Ok(other) => Err(crate::Error::InvalidInput(format!(
            "KVSERVE_REPACK={other:?} is not valid; use 1 (repack weights for decode, the \
             default) or 0 (keep only the GGUF layout)"
        ))),
    }
}

/// The recurrent part of a hybrid model's sequence state (see [`Context::seq_state_read`]).
const REC_MAGIC: &[u8; 4] = b"KVRS";
const REC_VERSION: u32 = 1;
const REC_FOOTER: usize = 20;

/// A hybrid batch's recurrent side: the group's transaction, the states the pass advances and
/// the checkpoint snapshots it takes.
struct RecBatch {
    tx: crate::kv::recurrent::StateTx,
    states: Vec<f32>,
    state_of: Vec<usize>,
    ckpts: Vec<f32>,
    ckpt_of: Vec<usize>,
}

/// A loaded model: configuration, weight locations in the mmapped file, tokenizer, thread pool.
pub struct Model {
    pub config: Config,
    pub tokenizer: Tokenizer,
    weights: Weights,
    gguf: GgufFile,
    team: crate::threads::Team,
    /// Stable identity of the weights, part of every prefix-cache block key.
    id: Key,
    /// Bytes of the weights' decode copies (`quant::x16`), on top of the GGUF mapping.
    repacked_bytes: usize,
    /// The K/V memory of each K/V format in use, shared by every context of this model.
    kv: Mutex<Vec<Vec<Arc<SharedKv>>>>,
    /// The K/V layer groups ([`Config::layer_groups`] but the recurrent one) and each
    /// attention layer's (group, index in group).
    groups: Vec<(LayerKind, Vec<usize>)>,
    slots: Vec<(usize, usize)>,
    /// The layers of the recurrent group (LFM2's short convolutions), in order.
    recurrent_layers: Vec<usize>,
    /// Test hook: a decode panics in one worker at this layer (-1: never). See
    /// [`Model::inject_worker_panic`].
    fault_layer: AtomicI64,
    /// Test hook: the first run of task 0 of this projection (`project` call of a pass, -1:
    /// none) sleeps `stall_us` first. See [`Model::inject_task_stall`].
    stall_call: AtomicI64,
    stall_us: std::sync::atomic::AtomicU64,
    /// Activation buffers of the forward pass, kept between passes so that a decode step does
    /// not allocate one per projection (`llama::PassBuffers`).
    pub(crate) acts_pool: Mutex<Vec<llama::Acts>>,
}

/// Logits of the batch tokens that asked for them: `n_rows` rows of `n_vocab` floats.
#[derive(Debug, Clone, Default)]
pub struct Logits {
    pub data: Vec<f32>,
    pub n_rows: usize,
    pub n_vocab: usize,
}

impl Logits {
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.n_vocab..(i + 1) * self.n_vocab]
    }
}

impl Model {
    /// Opens and validates a GGUF model. `threads`: compute threads (default: physical cores or
    /// `KVSERVE_THREADS`).
    /// Memory the weights take beyond the GGUF mapping: the Q4_0, Q4_1, Q5_0 and Q8_0 matrices' copies in
    /// the one-token decode layout (`quant::x16`; 0 with `KVSERVE_REPACK=0`, on CPUs without
    /// AVX2, or for other weight types).
    pub fn repacked_bytes(&self) -> usize {
        self.repacked_bytes
    }

    pub fn load(path: impl AsRef<Path>, threads: Option<usize>) -> Result<Model> {
        Model::from_gguf(GgufFile::open(path)?, threads)
    }

    /// The model of `gguf` on `threads` members (default: the physical cores), with the decode
    /// copies of its weights ([`Model::repacked_bytes`]) unless `KVSERVE_REPACK=0`: as many as
    /// fit in half the memory the OS reports available (`MemAvailable`; no bound where there
    /// is no /proc/meminfo), so a model near the machine's memory still loads, its remaining
    /// matrices decoding from the GGUF layout.
    pub fn from_gguf(gguf: GgufFile, threads: Option<usize>) -> Result<Model> {
        let budget = repack_enabled()?.then(|| available_memory().map_or(usize::MAX, |a| a / 2));
        Model::from_gguf_with(gguf, threads, budget)
    }

    /// [`Model::from_gguf`] with decode copies of at most `repack_budget` bytes in all (`None`:
    /// none), whatever the environment says. The logits are the same bits either way.
    pub fn from_gguf_with(
        gguf: GgufFile,
        threads: Option<usize>,
        repack_budget: Option<usize>,
    ) -> Result<Model> {
        let mut config = Config::from_gguf(&gguf)?;
        let weights = match config.arch {
            Arch::Gemma3 => Weights::Gemma3(gemma3::Weights::load(&gguf, &config)?),
            Arch::Lfm2 => Weights::Lfm2(lfm2::Weights::load(&gguf, &config)?),
            _ => Weights::Llama(llama::Weights::load(&gguf, &mut config)?),
        };
        let mut weights = weights;
        let mut repacked_bytes = 0usize;
        if let Some(budget) = repack_budget {
            for w in weights.matmul_weights_mut() {
                let need = w.decode_copy_bytes();
                if need > 0 && repacked_bytes + need <= budget && w.repack(&gguf) {
                    repacked_bytes += need;
                }
            }
        }
        let tokenizer = Tokenizer::new(vocab_from_gguf(&gguf)?)?;
        if tokenizer.n_vocab() != config.n_vocab {
            return Err(crate::error::model_err(format!(
                "GGUF: tokenizer has {} tokens but token_embd.weight has {} rows",
                tokenizer.n_vocab(),
                config.n_vocab
            )));
        }
        let team = crate::threads::Team::new(threads);
        let id = model_identity(&gguf);
        let (recurrent, groups): (Vec<_>, Vec<_>) = config
            .layer_groups()
            .into_iter()
            .partition(|(k, _)| *k == LayerKind::Recurrent);
        let recurrent_layers = recurrent.into_iter().flat_map(|(_, l)| l).collect();
        let mut slots = vec![(usize::MAX, 0); config.n_layer];
        for (gi, (_, layers)) in groups.iter().enumerate() {
            for (i, &l) in layers.iter().enumerate() {
                slots[l] = (gi, i);
            }
        }
        Ok(Model {
            repacked_bytes,
            groups,
            slots,
            recurrent_layers,
            config,
            tokenizer,
            weights,
            gguf,
            team,
            id,
            kv: Mutex::new(Vec::new()),
            fault_layer: AtomicI64::new(-1),
            stall_call: AtomicI64::new(-1),
            stall_us: std::sync::atomic::AtomicU64::new(0),
            acts_pool: Mutex::new(Vec::new()),
        })
    }

    /// The model's K/V memory for the format in `o`: one `SharedKv` per layer group
    /// ([`Config::layer_groups`], in that order), created on first use and shared by every
    /// context of that format. Full-attention groups are sized by `o.kv_memory` (bytes, split
    /// between the groups) or else for `max(o.memory_tokens or o.n_ctx, 4096)` tokens; a window
    /// group by its window, not the context ([`window_blocks`]: the windows of `o.n_seq_max`
    /// sequences, one batch of `o.n_batch` tokens and the windows before a few cached resume
    /// points), and never more blocks than a full group of the same memory. A later request
    /// for more than the memory holds replaces it when no context uses it (its cached prefixes
    /// are dropped); while contexts use it, the request shares it as it is (the context's
    /// token limit is then what the memory holds).
    pub fn kv_memory(&self, o: &KvOptions) -> Result<Vec<Arc<SharedKv>>> {
        let c = &self.config;
        let groups = &self.groups;
        let layout = |layers: usize| KvLayout {
            ty: o.kv_type,
            n_layers: layers,
            kv_dim: c.kv_dim(),
            block_size: o.block_size,
        };
        for (_, layers) in groups {
            layout(layers.len()).validate()?;
        }
        let bs = o.block_size;
        // Blocks of each group.
        let want: Vec<usize> = match o.kv_memory {
            Some(bytes) => {
                let bpb: Vec<usize> = groups
                    .iter()
                    .map(|(_, l)| layout(l.len()).bytes_per_block())
                    .collect();
                let win: Vec<usize> = groups
                    .iter()
                    .map(|(k, _)| match k {
                        LayerKind::Window(w) => window_blocks(*w, o),
                        LayerKind::Full | LayerKind::Recurrent => 0,
                    })
                    .collect();
                let win_bytes: usize = win.iter().zip(&bpb).map(|(n, b)| n * b).sum();
                let full_bpb: usize = groups
                    .iter()
                    .zip(&bpb)
                    .filter(|((k, _), _)| *k == LayerKind::Full)
                    .map(|(_, b)| b)
                    .sum();
                if win_bytes == 0 || (full_bpb > 0 && win_bytes <= bytes / 2) {
                    // Window groups take what they cap at; full groups share the rest.
                    let n_full = bytes.saturating_sub(win_bytes) / full_bpb.max(1);
                    groups
                        .iter()
                        .zip(&win)
                        .map(|((k, _), &w)| if *k == LayerKind::Full { n_full } else { w })
                        .collect()
                } else {
                    // Too small to cap the windows: the same number of blocks in every group.
                    let n = bytes / bpb.iter().sum::<usize>();
                    vec![n; groups.len()]
                }
            }
            None => {
                let t = o.memory_tokens.unwrap_or(o.n_ctx).max(MIN_POOL_TOKENS);
                groups
                    .iter()
                    .map(|(k, _)| match k {
                        LayerKind::Window(w) => blocks_for_tokens(t, bs).min(window_blocks(*w, o)),
                        LayerKind::Full | LayerKind::Recurrent => blocks_for_tokens(t, bs),
                    })
                    .collect()
            }
        };
        if let (Some(bytes), true) = (o.kv_memory, want.contains(&0)) {
            let per: usize = groups
                .iter()
                .map(|(_, l)| layout(l.len()).bytes_per_block())
                .sum();
            return Err(invalid(format!(
                "KV memory of {bytes} bytes holds no block (one block takes {per} bytes)"
            )));
        }
        let mut pools = self.kv.lock().unwrap_or_else(|e| e.into_inner());
        let same = |m: &Vec<Arc<SharedKv>>| {
            let l = m[0].layout();
            (l.ty, l.block_size) == (o.kv_type, o.block_size)
        };
        if let Some(i) = pools.iter().position(same) {
            if pools[i].iter().zip(&want).all(|(m, &w)| m.n_blocks() >= w) {
                return Ok(pools[i].clone());
            }
            if pools[i].iter().any(|m| Arc::strong_count(m) > 1) {
                // In use: share it as it is (the new context's limit is what it holds).
                return Ok(pools[i].clone());
            }
            // Free the old memory before allocating the new one.
            pools.swap_remove(i);
        }
        let mut made = Vec::with_capacity(groups.len());
        for (gi, ((kind, layers), &n)) in groups.iter().zip(&want).enumerate() {
            // Each group's keys are its own: the group's kind and layers join the weights id.
            let mut h = KeyHasher::new(0x6b76_7365_7276_6547); // "kvserveG"
            h.write_u128(self.id);
            h.write_u64(gi as u64);
            h.write_u64(match kind {
                LayerKind::Full => 0,
                LayerKind::Window(w) => 1 + *w as u64,
                LayerKind::Recurrent => u64::MAX,
            });
            for &l in layers {
                h.write_u64(l as u64);
            }
            let id = if groups.len() == 1 {
                self.id
            } else {
                h.finish()
            };
            let rope = c.rope_for(layers[0]).clone();
            made.push(Arc::new(SharedKv::new(
                layout(layers.len()),
                c.head_dim,
                rope,
                n,
                id,
            )?));
        }
        pools.push(made.clone());
        Ok(made)
    }

    /// The layers grouped by memory kind (one K/V memory per group), from the config; the
    /// recurrent layers are not among them ([`Model::recurrent_layers`]).
    pub fn layer_groups(&self) -> &[(LayerKind, Vec<usize>)] {
        &self.groups
    }

    /// The layers whose memory is a recurrent state (LFM2's short convolutions).
    pub fn recurrent_layers(&self) -> &[usize] {
        &self.recurrent_layers
    }

    /// (group, layer within the group's storage) of model layer `layer`.
    pub(crate) fn kv_slot(&self, layer: usize) -> (usize, usize) {
        self.slots[layer]
    }

    /// Testing hook: the next decode panics in one worker at layer `layer` (once), to exercise
    /// the rollback path. `None` disarms it.
    pub fn inject_worker_panic(&self, layer: Option<usize>) {
        let v = layer.map_or(-1, |l| l as i64);
        self.fault_layer.store(v, Ordering::Relaxed);
    }

    /// Testing hook: in the next pass that makes projection `call` (the `call`-th matmul step of
    /// the pass) a redoable step, the first run of its task 0 sleeps `stall` first, as if its
    /// member had lost its core mid-task (once). `None` disarms it.
    pub fn inject_task_stall(&self, at: Option<(usize, std::time::Duration)>) {
        if let Some((_, d)) = at {
            self.stall_us.store(d.as_micros() as u64, Ordering::Relaxed);
        }
        self.stall_call
            .store(at.map_or(-1, |(c, _)| c as i64), Ordering::Relaxed);
    }

    /// Sleeps if the armed stall is for projection `call` (then it is disarmed).
    pub(crate) fn stall_at(&self, call: usize) {
        if self.stall_call.load(Ordering::Relaxed) == call as i64
            && self
                .stall_call
                .compare_exchange(call as i64, -1, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            let us = self.stall_us.load(Ordering::Relaxed);
            std::thread::sleep(std::time::Duration::from_micros(us));
        }
    }

    /// Tasks of redoable matmul steps that a waiting member computed again and published
    /// (its partner was taking too long: descheduled, usually), since the model was loaded.
    pub fn redone_tasks(&self) -> u64 {
        self.team.redone()
    }

    /// Whether the armed fault fires at `layer` (then it is disarmed).
    pub(crate) fn fault_at(&self, layer: usize) -> bool {
        self.fault_layer.load(Ordering::Relaxed) == layer as i64
            && self
                .fault_layer
                .compare_exchange(layer as i64, -1, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    pub fn gguf(&self) -> &GgufFile {
        &self.gguf
    }

    pub fn n_vocab(&self) -> usize {
        self.config.n_vocab
    }

    pub fn threads(&self) -> usize {
        self.team.threads()
    }

    /// Stable identity of the weights (see [`model_identity`]).
    pub fn id(&self) -> Key {
        self.id
    }
}

/// Smallest K/V memory a model creates (tokens), so that short requests share one pool.
const MIN_POOL_TOKENS: usize = 4096;

/// Bytes of each tensor's data that [`model_identity`] reads: `ID_STRIPES` stripes of
/// `ID_STRIPE` bytes spread evenly over the tensor (all of it when smaller).
const ID_STRIPES: usize = 16;
const ID_STRIPE: usize = 4096;

/// A stable 128-bit identity of a model file, part of every prefix-cache key, so that K/V
/// computed by one model is never served for another. It hashes:
/// - the whole GGUF header: every metadata key and value and the tensor table (names, types,
///   shapes, offsets) as stored, so any change of architecture, tokenizer, chat template or
///   layout changes it;
/// - the file size;
/// - 16 evenly spread 4 KiB stripes of every tensor's data (the whole tensor when smaller).
///   Fine-tuning changes (nearly) every element of each tensor it touches, so two fine-tunes
///   of one base differ in the stripes of every changed tensor, even when only one layer was
///   trained; a difference confined to bytes between the stripes of every changed tensor
///   would go unseen (the price of not reading the whole file).
///
/// Cost at load: at most 64 KiB per tensor (~17 MiB for the 272 tensors of SmolLM2, whatever
/// the model's size), read through the mapping: a few milliseconds.
pub fn model_identity(g: &GgufFile) -> Key {
    let mut h = KeyHasher::new(0x6b76_7365_7276_654d); // "kvserveM"
    h.write_u64(g.file_size());
    h.write_bytes(g.header_bytes());
    for t in g.tensors() {
        let data = g.tensor_data(t);
        if data.len() <= ID_STRIPES * ID_STRIPE {
            h.write_bytes(data);
            continue;
        }
        let step = (data.len() - ID_STRIPE) / (ID_STRIPES - 1);
        for k in 0..ID_STRIPES {
            let at = k * step;
            h.write_bytes(&data[at..at + ID_STRIPE]);
        }
    }
    h.finish()
}

/// Reads the tokenizer description from GGUF metadata.
pub fn vocab_from_gguf(g: &GgufFile) -> Result<VocabData> {
    let model = g
        .get_str("tokenizer.ggml.model")?
        .ok_or_else(|| crate::error::model_err("GGUF: missing key 'tokenizer.ggml.model'"))?
        .to_string();
    let tokens: Vec<String> = g
        .get_str_array("tokenizer.ggml.tokens")?
        .ok_or_else(|| crate::error::model_err("GGUF: missing key 'tokenizer.ggml.tokens'"))?
        .into_iter()
        .map(str::to_string)
        .collect();
    let id = |key: &str| -> Result<Option<u32>> { g.get_u32(key) };
    Ok(VocabData {
        model,
        pre: g.get_str("tokenizer.ggml.pre")?.map(str::to_string),
        tokens,
        token_types: g.get_i32_array("tokenizer.ggml.token_type")?,
        scores: g.get_f32_array("tokenizer.ggml.scores")?,
        merges: g
            .get_str_array("tokenizer.ggml.merges")?
            .map(|m| m.into_iter().map(str::to_string).collect()),
        bos: id("tokenizer.ggml.bos_token_id")?,
        eos: id("tokenizer.ggml.eos_token_id")?,
        eot: id("tokenizer.ggml.eot_token_id")?,
        eom: id("tokenizer.ggml.eom_token_id")?,
        unk: id("tokenizer.ggml.unknown_token_id")?,
        pad: id("tokenizer.ggml.padding_token_id")?,
        add_bos: g.get_bool("tokenizer.ggml.add_bos_token")?,
        add_eos: g.get_bool("tokenizer.ggml.add_eos_token")?,
        add_space_prefix: g.get_bool("tokenizer.ggml.add_space_prefix")?,
    })
}

/// Blocks of a sliding-window group of `window` positions for `o`: each of `o.n_seq_max`
/// sequences holds at most `⌈window / b⌉ + 1` blocks between batches plus a partly filled one
/// during a batch, a batch adds at most `⌈n_batch / b⌉`, and the windows before up to four
/// cached resume points (`⌈window / b⌉ + 1` each) stay for prefix reuse.
pub fn window_blocks(window: usize, o: &KvOptions) -> usize {
    let bs = o.block_size.max(1);
    let per = window.div_ceil(bs) + 1;
    let seqs = o.n_seq_max.max(1);
    seqs.saturating_mul(per + 1)
        .saturating_add(o.n_batch.max(1).div_ceil(bs))
        .saturating_add(per.saturating_mul(seqs.min(4)))
}

/// How a context's KV cache is sized and stored.
#[derive(Debug, Clone, Copy)]
pub struct KvOptions {
    /// Token limit across all sequences (ignored when `kv_memory` or `memory_tokens` is set).
    pub n_ctx: usize,
    /// Size the cache by bytes of K/V storage instead (`--kv-memory`); the context may then use
    /// all of the model's memory.
    pub kv_memory: Option<usize>,
    /// Size the cache for this many tokens (when `kv_memory` is not set) and let the context use
    /// all of the model's memory: its token limit is what the memory holds, not `n_ctx`. A
    /// serving engine that keeps idle sequences beside the running ones wants this.
    pub memory_tokens: Option<usize>,
    pub kv_type: KvType,
    pub block_size: usize,
    /// Key the blocks this context fills so that later prompts can reuse them (prefix cache).
    pub prefix_cache: bool,
    /// Sequences decoded at once (llama.cpp's `n_seq_max`): sizes sliding-window groups.
    pub n_seq_max: usize,
    /// Most tokens in one batch (llama.cpp's `n_batch`) for models with sliding-window
    /// layers, whose memory is sized for it; a larger batch is refused with `InvalidInput`.
    pub n_batch: usize,
}

impl Default for KvOptions {
    fn default() -> KvOptions {
        KvOptions {
            n_ctx: 4096,
            kv_memory: None,
            memory_tokens: None,
            kv_type: KvType::F16,
            block_size: DEFAULT_BLOCK_SIZE,
            prefix_cache: true,
            n_seq_max: 1,
            n_batch: DEFAULT_N_BATCH,
        }
    }
}

/// Default [`KvOptions::n_batch`] (llama.cpp's default `n_batch`).
pub const DEFAULT_N_BATCH: usize = 2048;

/// A running context: the model plus the block tables of its sequences, over the model's shared
/// K/V memory ([`Model::kv_memory`]): one cache per layer group ([`LayerGroups`]).
pub struct Context {
    model: Arc<Model>,
    memory: LayerGroups,
    /// Largest batch a model with window groups takes (`KvOptions::n_batch`).
    n_batch: usize,
}

/// One layer group's part of a forward pass: its storage (locked), the batch's planned cells
/// in it and each batch sequence's view of its blocks.
pub(crate) struct KvIo<'a> {
    pub storage: &'a mut KvStorage,
    pub cells: Vec<(BlockId, u16)>,
    pub views: HashMap<SeqId, SeqView>,
}

impl Context {
    /// A context holding at most `n_ctx` tokens across all sequences, f16 K/V in blocks of
    /// [`DEFAULT_BLOCK_SIZE`] tokens.
    pub fn new(model: Arc<Model>, n_ctx: usize) -> Result<Context> {
        Context::with_options(
            model,
            &KvOptions {
                n_ctx,
                ..KvOptions::default()
            },
        )
    }

    /// A context over the model's K/V memory for `o`'s format. Its token limit is `o.n_ctx`,
    /// or what the memory holds when `o.kv_memory` or `o.memory_tokens` is given (window
    /// groups are limited by their pool only: they hold windows, not contexts).
    pub fn with_options(model: Arc<Model>, o: &KvOptions) -> Result<Context> {
        if o.memory_tokens == Some(0) {
            return Err(invalid("memory_tokens must be positive"));
        }
        if o.n_ctx == 0 && o.kv_memory.is_none() && o.memory_tokens.is_none() {
            return Err(invalid("n_ctx must be positive"));
        }
        let shared = model.kv_memory(o)?;
        let mut groups = Vec::with_capacity(shared.len());
        for ((kind, layers), sh) in model.groups.iter().zip(shared) {
            let whole = o.kv_memory.is_some() || o.memory_tokens.is_some();
            let n_ctx = match kind {
                LayerKind::Full if !whole => o.n_ctx,
                _ => sh.capacity_tokens(),
            };
            let mut cache = PagedCache::new(sh, n_ctx)?;
            cache.set_prefix_cache(o.prefix_cache);
            groups.push(Group {
                kind: *kind,
                layers: layers.clone(),
                cache,
            });
        }
        let recurrent = match &model.config.shortconv {
            Some(sc) if !model.recurrent_layers.is_empty() => {
                // States and their checkpoints take blocks of the primary group's pool.
                let pi = groups
                    .iter()
                    .position(|g| g.kind == LayerKind::Full)
                    .unwrap_or(0);
                let sh = groups[pi].cache.shared();
                let state = RecurrentGroup::new(
                    Arc::clone(sh.pool()),
                    Some(Arc::clone(sh.index())),
                    StateLayout {
                        n_layers: sc.n_conv_layers(),
                        per_layer: lfm2::state_floats_per_layer(&model.config),
                    },
                    sh.layout().bytes_per_block(),
                )?;
                Some(RecurrentLayers {
                    layers: model.recurrent_layers.clone(),
                    state,
                })
            }
            _ => None,
        };
        Ok(Context {
            model,
            memory: LayerGroups::new(groups, recurrent)?,
            n_batch: o.n_batch.max(1),
        })
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    pub fn n_ctx(&self) -> usize {
        self.memory.primary().n_ctx()
    }

    /// The primary group's cache (the full-attention group; for a one-group model the whole
    /// memory): its table answers position and token queries.
    pub fn cache(&self) -> &PagedCache {
        self.memory.primary()
    }

    pub fn cache_mut(&mut self) -> &mut PagedCache {
        self.memory.primary_mut()
    }

    /// Every layer group; sequence operations go through this ([`Memory`]).
    pub fn memory(&self) -> &LayerGroups {
        &self.memory
    }

    pub fn memory_mut(&mut self) -> &mut LayerGroups {
        &mut self.memory
    }

    /// Maps the longest cached prefix of `tokens` that every layer group can resume from onto
    /// the empty sequence `seq` (see [`LayerGroups::match_prefix`]).
    pub fn match_prefix(&mut self, seq: SeqId, tokens: &[u32]) -> Result<usize> {
        self.memory.match_prefix(seq, tokens)
    }

    /// How many tokens [`Context::match_prefix`] would map for `tokens` now in a sequence
    /// salted with `salt` (empty: unsalted), changing nothing ([`LayerGroups::peek_prefix`];
    /// an estimate: blocks may be evicted before the match).
    pub fn peek_prefix(&self, tokens: &[u32], salt: &[u8]) -> usize {
        self.memory.peek_prefix(tokens, crate::kv::salt_root(salt))
    }

    /// Salts the empty sequence `seq`: it shares cached prefixes only with sequences of the
    /// same salt, in any context of the model ([`LayerGroups::seq_set_salt`]).
    pub fn seq_set_salt(&mut self, seq: SeqId, salt: &[u8]) -> Result<()> {
        self.memory.seq_set_salt(seq, salt)
    }

    /// Attaches the disk tier under `dir` (docs/KV_SEMANTICS.md, "Disk tier"; `kv::disk`) to
    /// the model's K/V memory, so every context of it writes the blocks its decodes key
    /// through to disk and continues prefix matches there; `None` detaches it (the tier
    /// closes once nothing holds it: queued writes are written first). `Io` when the
    /// directory cannot be used or another process holds it; `InvalidInput`
    /// when `o.max_bytes` holds no block.
    ///
    /// A model with several K/V groups (sliding-window layers) gets one tier per group, under
    /// `dir/<that group's model id>/`, and `o.max_bytes` is split between them in proportion
    /// to their bytes per block (so each holds about as many blocks); all or nothing. A
    /// hybrid model's state checkpoints go to the primary (full-attention) group's tier, keyed
    /// in their own hash domain (docs/KV_SEMANTICS.md, "Recurrent state").
    pub fn set_kv_disk(&mut self, dir: Option<&Path>, o: DiskOptions) -> Result<()> {
        let shared = self.kv_memories();
        let Some(dir) = dir else {
            for sh in &shared {
                sh.set_disk(None)?;
            }
            return Ok(());
        };
        let per_block: u64 = shared
            .iter()
            .map(|s| s.layout().bytes_per_block() as u64)
            .sum();
        let mut tiers = Vec::with_capacity(shared.len());
        for sh in &shared {
            let l = sh.layout();
            let bpb = l.bytes_per_block() as u64;
            let share = (o.max_bytes as u128 * bpb as u128 / per_block.max(1) as u128) as u64;
            let o = DiskOptions {
                max_bytes: share,
                ..o
            };
            tiers.push(DiskTier::open(
                dir,
                sh.model_id(),
                l.block_size,
                l.bytes_per_block(),
                o,
            )?);
        }
        for (sh, t) in shared.iter().zip(tiers) {
            sh.set_disk(Some(t))?;
        }
        Ok(())
    }

    /// The K/V memory of every K/V group, in group order.
    fn kv_memories(&self) -> Vec<Arc<SharedKv>> {
        self.memory
            .groups()
            .iter()
            .map(|g| Arc::clone(g.cache.shared()))
            .collect()
    }

    /// The disk tier of the model's (primary) K/V memory, if one is attached.
    pub fn kv_disk(&self) -> Option<Arc<DiskTier>> {
        self.memory.primary().shared().disk()
    }

    /// The disk tier of each K/V group's memory (group order), those attached.
    pub fn kv_disks(&self) -> Vec<Arc<DiskTier>> {
        self.kv_memories().iter().filter_map(|s| s.disk()).collect()
    }

    /// Attaches the shared tier on the Redis / Valkey store at `url` (docs/KV_SEMANTICS.md,
    /// "Shared tier"; `kv::remote`) to the model's K/V memory: every context of it writes the
    /// blocks its decodes key through to the store, and `SharedKv::fetch_remote` stages
    /// blocks from it for `match_prefix_staged`. `None` detaches it. Does not connect (a store
    /// that is down is a tier that is off until it answers). `Unsupported` for a TLS URL;
    /// `InvalidInput` for a bad URL.
    ///
    /// A model with several K/V groups gets one tier per group (each with its own connection
    /// and writer; a group's keys carry its own model id); all or nothing. A hybrid model's
    /// state checkpoints go to the primary group's tier, as for the disk tier.
    pub fn set_kv_remote(&mut self, url: Option<&str>, o: RemoteOptions) -> Result<()> {
        let shared = self.kv_memories();
        let Some(url) = url else {
            for sh in &shared {
                sh.set_remote(None)?;
            }
            return Ok(());
        };
        let mut tiers = Vec::with_capacity(shared.len());
        for sh in &shared {
            let l = sh.layout();
            tiers.push(RemoteTier::open(
                url,
                sh.model_id(),
                l.block_size,
                l.bytes_per_block(),
                o,
            )?);
        }
        for (sh, t) in shared.iter().zip(tiers) {
            sh.set_remote(Some(t))?;
        }
        Ok(())
    }

    /// The shared tier of the model's (primary) K/V memory, if one is attached.
    pub fn kv_remote(&self) -> Option<Arc<RemoteTier>> {
        self.memory.primary().shared().remote()
    }

    /// The shared tier of each K/V group's memory (group order), those attached.
    pub fn kv_remotes(&self) -> Vec<Arc<RemoteTier>> {
        self.kv_memories()
            .iter()
            .filter_map(|s| s.remote())
            .collect()
    }

    /// [`LayerGroups::fetch_remote`] for this context's groups: safe to call on another
    /// thread through the memories it returns ([`Context::kv_group_memories`]).
    pub fn kv_remote_fetch(&self, tokens: &[u32], root: crate::kv::Key) -> Vec<Staged> {
        let groups = self.kv_group_memories();
        let g: Vec<_> = groups.iter().map(|(k, s)| (*k, s.as_ref())).collect();
        LayerGroups::fetch_remote(&g, tokens, root, self.memory.keeps_checkpoints())
    }

    /// Each K/V group's kind and memory, in group order (for [`LayerGroups::fetch_remote`]
    /// off the context's thread).
    pub fn kv_group_memories(&self) -> Vec<(LayerKind, Arc<SharedKv>)> {
        self.memory
            .groups()
            .iter()
            .map(|g| (g.kind, Arc::clone(g.cache.shared())))
            .collect()
    }

    /// [`Context::match_prefix`] that also maps blocks staged from the shared tier, one set
    /// per K/V group ([`LayerGroups::fetch_remote`] for these tokens under this sequence's
    /// salt).
    pub fn match_prefix_staged(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        staged: &[Staged],
    ) -> Result<usize> {
        self.memory.match_prefix_staged(seq, tokens, staged)
    }

    /// The checks of `batch` that `decode` makes before planning it: its columns and values
    /// ([`Batch::validate`]) and, with sliding-window layers, its size (`n_batch`).
    fn check_batch(&self, batch: &Batch) -> Result<()> {
        batch.validate(self.model.n_vocab())?;
        if batch.len() > self.n_batch && self.memory.has_window() {
            return Err(invalid(format!(
                "a batch of {} tokens is larger than this context's n_batch ({}), for which \
                 its sliding-window memory is sized: split it, or make the context with a \
                 larger n_batch",
                batch.len(),
                self.n_batch
            )));
        }
        Ok(())
    }

    /// Asks before decoding: whether `batch` fits the K/V memory now, counting every layer
    /// group (full attention, sliding window, recurrent) — `0` when it fits, else the largest
    /// number of blocks missing in any group's pool ([`LayerGroups::blocks_short`]: free and
    /// cached blocks count as available; a copy-on-write of a shared or keyed partly filled
    /// tail needs a block; a recurrent state for a new or shared sequence needs its blocks in
    /// the primary group's pool; tokens over the context's `n_ctx` count as blocks short).
    /// Changes nothing. When it says `0`, [`Context::decode`] of the same batch does not fail
    /// with `KvCacheFull` as long as nothing else changes the memory in between (another
    /// context of the model allocating from the shared pools could); when it says more, decode
    /// fails with `KvCacheFull` (the count is exact: the blocks the plan reserves). The
    /// tokens themselves do not matter. `InvalidInput` for a batch decode rejects as malformed.
    pub fn blocks_short(&self, batch: &Batch) -> Result<usize> {
        self.check_batch(batch)?;
        self.memory.blocks_short(&batch.seq_ids, &batch.positions)
    }

    /// Runs one batch; returns logits for the tokens that asked for them, in batch order.
    ///
    /// All or nothing: a batch that does not fit fails with `KvCacheFull`, a malformed one with
    /// `InvalidInput`, and a failure inside the forward pass (a worker panic) with `Internal`;
    /// in every case the cache is left as before the call (the batch is rolled back in every
    /// layer group, and no block it touched was given a content key). After a committed batch,
    /// window groups drop the cells that left every later token's window.
    pub fn decode(&mut self, batch: &Batch) -> Result<Logits> {
        self.check_batch(batch)?;
        let shared: Vec<Arc<SharedKv>> = self
            .memory
            .groups()
            .iter()
            .map(|g| Arc::clone(g.cache.shared()))
            .collect();
        // Locked in group order (every decode of the model takes them in this order).
        let mut storages: Vec<_> = shared.iter().map(|s| s.lock_storage()).collect();
        // Every group plans the batch (all or nothing: nothing changed on error); the recurrent
        // group takes fresh blocks for the states of new or shared sequences (in the primary
        // group's pool) and loads the batch's states. `Context::blocks_short` says beforehand
        // whether this fails for want of blocks.
        let PlannedBatch {
            kv: planned,
            rec: rec_tx,
        } = self.memory.begin_batch(batch, &mut storages)?;
        // The tokens after which a state checkpoint is taken (the last of each block of the
        // primary group).
        let pi = self.memory.primary_index();
        let bs = self.memory.primary().table().block_size() as Pos;
        let prefix_on = self.memory.primary().prefix_cache();
        let mut rec = match (rec_tx, self.memory.recurrent()) {
            (Some((tx, states)), Some(r)) => {
                let state_of: Vec<usize> = batch
                    .seq_ids
                    .iter()
                    .map(|s| tx.seqs.iter().position(|x| x == s).unwrap_or(0))
                    .collect();
                let on = prefix_on && r.can_checkpoint();
                let mut n_ckpt = 0;
                let ckpt_of: Vec<usize> = batch
                    .positions
                    .iter()
                    .map(|&p| {
                        if on && (p + 1) % bs == 0 {
                            n_ckpt += 1;
                            n_ckpt - 1
                        } else {
                            lfm2::NO_CHECKPOINT
                        }
                    })
                    .collect();
                let ckpts = vec![0.0f32; n_ckpt * r.layout().floats()];
                Some(RecBatch {
                    tx,
                    states,
                    state_of,
                    ckpts,
                    ckpt_of,
                })
            }
            _ => None,
        };
        let primary_cells = planned[pi].0.clone();
        let mut seqs: Vec<SeqId> = batch.seq_ids.clone();
        seqs.sort_unstable();
        seqs.dedup();
        let mut txs = Vec::with_capacity(planned.len());
        let mut io = Vec::with_capacity(planned.len());
        for ((g, storage), (cells, tx)) in self
            .memory
            .groups_mut()
            .iter_mut()
            .zip(storages.iter_mut())
            .zip(planned)
        {
            let views = seqs.iter().map(|&s| (s, g.cache.view(s))).collect();
            txs.push(tx);
            io.push(KvIo {
                storage,
                cells,
                views,
            });
        }
        let model = &self.model;
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match &model.weights {
            Weights::Llama(w) => llama::forward(model, w, &mut io, batch),
            Weights::Gemma3(w) => gemma3::forward(model, w, &mut io, batch),
            Weights::Lfm2(w) => {
                let rb = rec
                    .as_mut()
                    .ok_or_else(|| Error::Internal("lfm2 context without states".into()))?;
                let conv = lfm2::ConvStates {
                    states: &mut rb.states,
                    state_of: &rb.state_of,
                    ckpts: &mut rb.ckpts,
                    ckpt_of: &rb.ckpt_of,
                };
                lfm2::forward(model, w, &mut io, batch, conv)
            }
        }));
        drop(io);
        // The recurrent group commits (its states written back) or rolls back first: a failed
        // write-back fails the batch in every group.
        let mut ckpts = None;
        let run = match (run, rec) {
            (Ok(Ok(logits)), Some(rb)) => {
                let r = self
                    .memory
                    .recurrent_mut()
                    .expect("states come from the group");
                match r.commit(rb.tx, &rb.states, &mut storages[pi]) {
                    Ok(()) => {
                        ckpts = Some((rb.ckpts, rb.ckpt_of));
                        Ok(Ok(logits))
                    }
                    Err(e) => Ok(Err(e)),
                }
            }
            (run, Some(rb)) => {
                self.memory
                    .recurrent_mut()
                    .expect("states come from the group")
                    .rollback(rb.tx);
                run
            }
            (run, None) => run,
        };
        let ok = matches!(run, Ok(Ok(_)));
        let mut keyed = Vec::new();
        if ok {
            let mut per_group = self.memory.commit_kv(txs, &seqs);
            // Write-through to each group's tiers (if any), copied under its storage lock.
            for ((g, st), k) in self.memory.groups().iter().zip(&storages).zip(&per_group) {
                g.cache.write_through(st, k);
            }
            keyed = std::mem::take(&mut per_group[pi]);
        } else {
            self.memory.rollback_kv(txs);
        }
        if let (Some((vals, of)), Some(r)) = (ckpts, self.memory.recurrent()) {
            // The state after the last token of every primary-group block the commit keyed,
            // stored in the pool and written through to the primary group's tiers.
            let n = r.layout().floats();
            let last = self.memory.primary().table().block_size() as u16 - 1;
            for (b, key) in keyed {
                let t = primary_cells.iter().position(|&c| c == (b, last));
                if let Some(i) = t.map(|t| of[t]).filter(|&i| i != lfm2::NO_CHECKPOINT) {
                    let v = &vals[i * n..(i + 1) * n];
                    self.memory.store_checkpoint(&mut storages[pi], b, key, v);
                }
            }
        }
        drop(storages);
        match run {
            Ok(Ok(logits)) => {
                self.memory.prune_windows(&seqs);
                Ok(logits)
            }
            Ok(Err(e)) => Err(e),
            Err(payload) => {
                let why = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                Err(Error::Internal(format!(
                    "decode failed inside the engine ({why}); the batch was rolled back and \
                     the context is usable"
                )))
            }
        }
    }

    pub fn clear(&mut self) {
        self.memory.clear();
    }

    /// The state of sequence `seq`: its positions, tokens and K/V rows as stored (format and
    /// rules in `kv::state`): version 1 for a model with one K/V group; for a model with several
    /// (sliding-window layers) the version-2 container of each group's cells (a window group's:
    /// only its window).
    ///
    /// A hybrid model's state is the K/V part as above followed by the recurrent state: its
    /// values (`f32`), then a 20-byte footer: its position `i32` (-1: none), the number of
    /// values `u64` (0 or the state's size), version `u32` (1) and `b"KVRS"`, little-endian.
    pub fn seq_state_read(&mut self, seq: i32) -> Result<Vec<u8>> {
        let kv = self.memory.seq_state_read(seq, self.model.id())?;
        let Some(r) = self.memory.recurrent() else {
            return Ok(kv);
        };
        let shared = Arc::clone(self.cache().shared());
        let state = r.read(seq, &shared.lock_storage())?;
        let (pos, vals) = state.unwrap_or((-1, Vec::new()));
        let mut out = kv;
        out.reserve(vals.len() * 4 + REC_FOOTER);
        for v in &vals {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&pos.to_le_bytes());
        out.extend_from_slice(&(vals.len() as u64).to_le_bytes());
        out.extend_from_slice(&REC_VERSION.to_le_bytes());
        out.extend_from_slice(REC_MAGIC);
        Ok(out)
    }

    /// Writes a state from [`Context::seq_state_read`] (of this or another context or process
    /// of the same model and K/V format) into the empty sequence `seq` without recomputing it;
    /// returns the number of cells (the sequence's tokens). All or nothing across every group
    /// and the recurrent state: the K/V is staged in every group, the recurrent state written,
    /// and only then is every group committed; any error undoes all of it.
    pub fn seq_state_write(&mut self, seq: i32, data: &[u8]) -> Result<usize> {
        let n_vocab = self.model.n_vocab();
        let id = self.model.id();
        let Some(r) = self.memory.recurrent() else {
            return self.memory.seq_state_write(seq, data, n_vocab, id);
        };
        let (kv, rec) = split_recurrent(data, r.layout().floats())?;
        if seq < 0 || self.memory.seq_pos_max(seq) >= 0 {
            return Err(invalid(format!(
                "sequence state: sequence {seq} must be >= 0 and empty"
            )));
        }
        let (pos, vals) = rec.map_or((-1, Vec::new()), |(pos, raw)| {
            let vals = raw
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
                .collect();
            (pos, vals)
        });
        let staged = self.memory.seq_state_stage(seq, kv, n_vocab, id)?;
        if !vals.is_empty() {
            let shared = Arc::clone(self.cache().shared());
            let r = self.memory.recurrent_mut().expect("checked above");
            let written = r.write(seq, pos, &vals, &mut shared.lock_storage());
            if let Err(e) = written {
                self.memory.seq_state_rollback(staged);
                return Err(e);
            }
        }
        Ok(self.memory.seq_state_commit(staged))
    }

    /// Checks, writing nothing, that `data` (from [`Context::seq_state_read`]) is a state of
    /// this model, K/V format and layer groups that holds exactly `tokens` at positions
    /// `0..n` (`n = tokens.len()`), as a saved session's state must: everything
    /// [`Context::seq_state_write`] validates (every length exact, every header field in range,
    /// every group's cells consistent with the primary group's), and also that the primary
    /// group holds `tokens` at positions `0..n`, every other group what its layers need of them
    /// ([`LayerGroups::seq_state_check`]), and for a hybrid model a recurrent state at position
    /// `n - 1` (none when `n == 0`). Returns `n`; any mismatch is `InvalidInput` saying what
    /// differs. A state that passes is written by `seq_state_write` into an empty sequence
    /// (given room in the pools) as the sequence of `tokens`.
    pub fn seq_state_check(&self, data: &[u8], tokens: &[u32]) -> Result<usize> {
        let n_vocab = self.model.n_vocab();
        let id = self.model.id();
        let kv = match self.memory.recurrent() {
            None => data,
            Some(r) => kv_part_for_tokens(data, r.layout().floats(), tokens.len())?,
        };
        self.memory.seq_state_check(kv, n_vocab, id, tokens)
    }
}

/// A hybrid model's recurrent state in a sequence state: its position and its values' bytes.
type RecState<'a> = Option<(Pos, &'a [u8])>;

/// Splits a hybrid model's sequence state (see [`Context::seq_state_read`]) into its K/V part
/// and its recurrent state: `None` (no state, position -1) or its position and the raw bytes of
/// its `floats` values. `InvalidInput` unless the footer is exactly one of those two shapes
/// (magic, version, a value count of 0 with position -1 or `floats` with a position >= 0, and
/// enough bytes before it).
fn split_recurrent(data: &[u8], floats: usize) -> Result<(&[u8], RecState<'_>)> {
    let bad = |why: &str| invalid(format!("sequence state: {why}"));
    let len = data.len();
    if len < REC_FOOTER || &data[len - 4..] != REC_MAGIC {
        return Err(bad("no recurrent state (not a state of a hybrid model)"));
    }
    let f = &data[len - REC_FOOTER..];
    let word = |at: usize| u32::from_le_bytes(f[at..at + 4].try_into().expect("4 bytes"));
    if word(12) != REC_VERSION {
        return Err(bad(&format!(
            "unsupported recurrent state version {}",
            word(12)
        )));
    }
    let pos = word(0) as i32;
    let nf = u64::from_le_bytes(f[4..12].try_into().expect("8 bytes"));
    if !((nf == 0 && pos == -1) || (nf == floats as u64 && pos >= 0)) {
        return Err(bad(&format!(
            "recurrent state of {nf} values at position {pos} (this model's: {floats})"
        )));
    }
    // `nf` is 0 or `floats` (checked above), so this cannot overflow.
    let Some(start) = (len - REC_FOOTER).checked_sub(nf as usize * 4) else {
        return Err(bad("truncated recurrent state"));
    };
    let state = &data[start..len - REC_FOOTER];
    Ok((&data[..start], (nf > 0).then_some((pos, state))))
}

/// The K/V part of a hybrid model's state (see [`split_recurrent`]) that must be the state of a
/// sequence of `n` tokens: its recurrent state at position `n - 1`, or none when `n == 0`.
fn kv_part_for_tokens(data: &[u8], floats: usize, n: usize) -> Result<&[u8]> {
    let (kv, rec) = split_recurrent(data, floats)?;
    let pos = rec.map_or(-1, |(p, _)| p as i64);
    if pos != n as i64 - 1 {
        let got = if pos < 0 {
            "absent".to_string()
        } else {
            format!("at position {pos}")
        };
        return Err(invalid(format!(
            "sequence state: the recurrent state is {got}, but the sequence has {n} tokens (its \
             state must be at position {})",
            n as i64 - 1
        )));
    }
    Ok(kv)
}

/// Throughput measured like llama-bench: `pp` is one batch of `n_prompt` tokens, `tg` is
/// `n_gen` single-token steps, each after `depth` tokens already in the context (llama-bench's
/// `-d`; 0: an empty context); each after one warm-up run, averaged over `reps` runs
/// (llama-bench reports the mean too).
#[derive(Debug, Clone)]
pub struct BenchResult {
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    /// Per K/V layer group, what the benchmark's one sequence held after its prompt (after
    /// its generated tokens when there is no prompt): a window group's stays bounded by the
    /// window.
    pub groups: Vec<GroupUsage>,
}

/// One K/V layer group's memory as [`bench()`] saw it.
#[derive(Debug, Clone, Copy)]
pub struct GroupUsage {
    pub kind: LayerKind,
    pub layers: usize,
    pub blocks_total: usize,
    pub blocks_held: usize,
    pub bytes_per_block: usize,
    pub block_size: usize,
}

impl Context {
    /// Per K/V layer group: its pool's size and the blocks this context holds in it.
    pub fn group_usage(&self) -> Vec<GroupUsage> {
        self.memory
            .groups()
            .iter()
            .map(|g| GroupUsage {
                kind: g.kind,
                layers: g.layers.len(),
                blocks_total: g.cache.shared().pool_stats().total,
                blocks_held: g.cache.table().stats().held_blocks,
                bytes_per_block: g.cache.shared().layout().bytes_per_block(),
                block_size: g.cache.shared().layout().block_size,
            })
            .collect()
    }
}

pub fn bench(
    model: &Arc<Model>,
    n_prompt: usize,
    n_gen: usize,
    depth: usize,
    reps: usize,
) -> Result<BenchResult> {
    let n_vocab = model.n_vocab() as u64;
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut tok = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % n_vocab) as u32
    };
    // The prompt is one batch (llama-bench's pp is one n_batch = n_prompt batch); the depth is
    // filled in batches of up to 512 tokens, untimed.
    const FILL_BATCH: usize = 512;
    let mut ctx = Context::with_options(
        Arc::clone(model),
        &KvOptions {
            n_ctx: (depth + n_prompt + n_gen).max(1) + 8,
            n_batch: n_prompt.max(depth.min(FILL_BATCH)).max(1),
            ..KvOptions::default()
        },
    )?;
    // Each run starts from a fresh context holding `depth` tokens (refilled, not trimmed: a
    // window group or a recurrent state cannot be rolled back to the depth).
    let reset = |ctx: &mut Context, tok: &mut dyn FnMut() -> u32| -> Result<()> {
        ctx.clear();
        let mut p = 0;
        while p < depth {
            let n = (depth - p).min(FILL_BATCH);
            let tokens: Vec<u32> = (0..n).map(|_| tok()).collect();
            ctx.decode(&Batch::prompt(&tokens, p as i32, 0))?;
            p += n;
        }
        Ok(())
    };
    let reps = reps.max(1);
    let (mut pp, mut tg) = (0.0f64, 0.0f64);
    let mut groups = Vec::new();
    if n_prompt > 0 {
        for r in 0..=reps {
            reset(&mut ctx, &mut tok)?;
            let tokens: Vec<u32> = (0..n_prompt).map(|_| tok()).collect();
            let t0 = Instant::now();
            ctx.decode(&Batch::prompt(&tokens, depth as i32, 0))?;
            if r > 0 {
                pp += t0.elapsed().as_secs_f64() / reps as f64;
            }
        }
        groups = ctx.group_usage();
    }
    if n_gen > 0 {
        for r in 0..=reps {
            reset(&mut ctx, &mut tok)?;
            let t0 = Instant::now();
            for i in 0..n_gen {
                ctx.decode(&Batch::prompt(&[tok()], (depth + i) as i32, 0))?;
            }
            if r > 0 {
                tg += t0.elapsed().as_secs_f64() / reps as f64;
            }
        }
        if groups.is_empty() {
            groups = ctx.group_usage();
        }
    }
    Ok(BenchResult {
        prefill_tok_s: if n_prompt > 0 {
            n_prompt as f64 / pp
        } else {
            0.0
        },
        decode_tok_s: if n_gen > 0 { n_gen as f64 / tg } else { 0.0 },
        groups,
    })
}

/// Throughput of `batch` sequences served together, measured like llama-batched-bench:
/// `prefill_tok_s` = all sequences' prompt tokens (one batch holding every prompt) per second,
/// `decode_tok_s` = all sequences' generated tokens per second, one token per sequence per step.
#[derive(Debug, Clone, Copy)]
pub struct BatchedBenchResult {
    pub batch: usize,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
}

pub fn bench_batched(
    model: &Arc<Model>,
    batch: usize,
    n_prompt: usize,
    n_gen: usize,
) -> Result<BatchedBenchResult> {
    if batch == 0 || n_prompt == 0 {
        return Err(invalid(
            "batched bench needs at least one sequence and one prompt token",
        ));
    }
    let n_vocab = model.n_vocab() as u64;
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let mut tok = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % n_vocab) as u32
    };
    let mut ctx = Context::with_options(
        Arc::clone(model),
        &KvOptions {
            n_ctx: batch * (n_prompt + n_gen) + 8,
            n_seq_max: batch,
            n_batch: batch * n_prompt,
            ..KvOptions::default()
        },
    )?;
    let mut prompt = Batch::default();
    for s in 0..batch {
        for p in 0..n_prompt {
            prompt.tokens.push(tok());
            prompt.positions.push(p as i32);
            prompt.seq_ids.push(s as i32);
            prompt.logits.push(p + 1 == n_prompt);
        }
    }
    // Warm-up (page in the weights), then the measured run.
    ctx.decode(&Batch::prompt(&[tok()], 0, 0))?;
    ctx.clear();
    let t0 = Instant::now();
    ctx.decode(&prompt)?;
    let pp = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    for i in 0..n_gen {
        let step = Batch {
            tokens: (0..batch).map(|_| tok()).collect(),
            positions: vec![(n_prompt + i) as i32; batch],
            seq_ids: (0..batch as i32).collect(),
            logits: vec![true; batch],
        };
        ctx.decode(&step)?;
    }
    let tg = t0.elapsed().as_secs_f64();
    Ok(BatchedBenchResult {
        batch,
        prefill_tok_s: (batch * n_prompt) as f64 / pp,
        decode_tok_s: if n_gen > 0 {
            (batch * n_gen) as f64 / tg
        } else {
            0.0
        },
    })
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::kv::PoolStats;

    fn real_model() -> GgufFile {
        let path = std::env::var("KVSERVE_TEST_MODEL")
            .expect("KVSERVE_TEST_MODEL is not set: point it at the default model's GGUF");
        GgufFile::open(path).expect("KVSERVE_TEST_MODEL must be a readable GGUF")
    }

    /// The identity covers metadata, the tensor table and tensor data: changing one byte of
    /// any of them (inside a sampled stripe for data) changes it.
    #[test]
    fn model_identity_sees_metadata_table_and_data() {
        let g = real_model();
        let bytes = std::fs::read(std::env::var("KVSERVE_TEST_MODEL").unwrap()).unwrap();
        let id = model_identity(&g);
        assert_eq!(
            id,
            model_identity(&GgufFile::from_bytes(bytes.clone()).unwrap())
        );
        let t = &g.tensors()[g.tensors().len() / 2];
        let data_at = t.offset as usize;
        // One byte in: the name of a metadata key's value (general.name is a string).
        let name_at = bytes
            .windows(b"general.name".len())
            .position(|w| w == b"general.name")
            .unwrap();
        for (what, at) in [
            ("metadata", name_at + b"general.name".len() + 12),
            ("first stripe of a tensor", data_at + 100),
            ("last byte of a tensor", data_at + t.n_bytes as usize - 1),
        ] {
            let mut b = bytes.clone();
            b[at] ^= 0x01;
            let g2 = GgufFile::from_bytes(b).unwrap();
            assert_ne!(model_identity(&g2), id, "{what}");
        }
    }

    /// A member stalled inside a matmul task (the test hook sleeps in the first run of task 0)
    /// is redone by its partner, and the published logits are bit-identical to those of the
    /// same tokens computed in one large batch (more than `REDO_MAX_TOKENS` tokens: plain
    /// steps, each task writing its outputs in place; token outputs do not depend on the
    /// batch), whichever projection stalls (first layer, a middle one, the output head), for
    /// one-token and several-token batches. (The partner can redo only while it has a core: on
    /// a loaded machine a stall may pass unnoticed, so longer stalls are tried before failing.)
    #[test]
    fn a_stalled_matmul_task_is_redone_with_identical_results() {
        let path = std::env::var("KVSERVE_TEST_MODEL")
            .expect("KVSERVE_TEST_MODEL is not set: point it at the default model's GGUF");
        let m = Arc::new(Model::load(&path, Some(2)).unwrap());
        let text = "The quick brown fox jumps over the lazy dog while the capital of France, \
                    which is Paris, sleeps under a grey autumn sky and the rivers run slowly \
                    towards the sea";
        let toks = m.tokenizer.encode(text, true, false);
        assert!(toks.len() >= 32, "prompt of {} tokens", toks.len());
        let toks = &toks[..32];
        let o = KvOptions {
            n_ctx: 256,
            ..KvOptions::default()
        };
        // Reference: all 32 tokens in one batch, logits for every row.
        let mut b = Context::with_options(Arc::clone(&m), &o).unwrap();
        let all = Batch {
            logits: vec![true; toks.len()],
            ..Batch::prompt(toks, 0, 0)
        };
        let want = b.decode(&all).unwrap();
        let v = m.n_vocab();
        let calls = 4 * m.config.n_layer + 1;
        let mut pos = 20usize;
        for (call, len) in [(0, 1), (9, 5), (calls - 1, 1), (2, 5)] {
            assert!(len <= llama::REDO_MAX_TOKENS);
            // The partner redoes the stalled task only if it is itself on a core during the
            // stall: under a loaded machine (other tests' threads) it may not be, so a longer
            // stall is tried before the test gives up.
            let mut redone = false;
            for stall_ms in [30u64, 150, 750, 3000] {
                let mut a = Context::with_options(Arc::clone(&m), &o).unwrap();
                a.decode(&Batch::prompt(&toks[..pos], 0, 0)).unwrap();
                let before = m.redone_tasks();
                m.inject_task_stall(Some((call, std::time::Duration::from_millis(stall_ms))));
                let batch = Batch {
                    logits: vec![true; len],
                    ..Batch::prompt(&toks[pos..pos + len], pos as i32, 0)
                };
                let got = a.decode(&batch).unwrap();
                m.inject_task_stall(None);
                assert!(
                    got.data[..] == want.data[pos * v..(pos + len) * v],
                    "projection {call} (stall {stall_ms} ms): logits differ from the one-batch pass"
                );
                if m.redone_tasks() > before {
                    redone = true;
                    break;
                }
            }
            assert!(
                redone,
                "projection {call}: the stalled task was never redone"
            );
            pos += len;
        }
    }

    /// Attention split across the team by chunks of cells (a one-sequence decode step deeper
    /// than one chunk: `llama::split_plan`) gives the bits of the unsplit path (a large batch:
    /// one task per token and KV head, each folding its chunks itself): decoding tokens one by
    /// one after a 600-token prompt (3 chunks) reproduces, bit for bit, the logits of the same
    /// tokens in one 606-token batch; two sequences decoded together (still split) too.
    /// The weights' decode copies change no logit: a prompt and one-token steps on the model
    /// with and without them give the same bits; the copies exist exactly where their kernels
    /// run (x86-64 with AVX2) and take the copied matrices' bytes.
    #[test]
    fn decode_copies_change_no_bits() {
        let path = std::env::var("KVSERVE_TEST_MODEL")
            .expect("KVSERVE_TEST_MODEL is not set: point it at the default model's GGUF");
        let load = |budget| {
            Arc::new(
                Model::from_gguf_with(GgufFile::open(&path).unwrap(), Some(2), budget).unwrap(),
            )
        };
        let copies = crate::quant::simd::level() >= crate::quant::simd::SimdLevel::Avx2;
        // SmolLM2 Q4_1: every layer matrix is Q4_1, the output head (the tied embedding) Q8_0.
        let without = load(None);
        let c = &without.config;
        let per_layer =
            2 * c.n_embd * c.q_dim() + 2 * c.n_embd * c.kv_dim() + 3 * c.n_embd * c.n_ff;
        let all = c.n_layer * per_layer / 32 * 20 + c.n_vocab * c.n_embd / 32 * 34;
        let with = load(Some(usize::MAX));
        // A budget for about half of them: some matrices copied, the rest left in place.
        let half = load(Some(all / 2));
        assert_eq!(without.repacked_bytes(), 0);
        assert_eq!(with.repacked_bytes(), if copies { all } else { 0 });
        if copies {
            let h = half.repacked_bytes();
            assert!(
                h > all / 4 && h <= all / 2,
                "{h} bytes copied for a budget of {}",
                all / 2
            );
        }
        let mut rng = crate::test_rng::Rng(9);
        let toks: Vec<u32> = (0..45).map(|_| rng.below(1000) as u32 + 100).collect();
        let o = KvOptions {
            n_ctx: 256,
            ..KvOptions::default()
        };
        // A 40-token prompt, then 5 one-token steps: every model gives the same logits.
        let same_logits = |models: &[&Arc<Model>], toks: &[u32], name: &str| {
            let mut ctxs: Vec<Context> = models
                .iter()
                .map(|&m| Context::with_options(Arc::clone(m), &o).unwrap())
                .collect();
            let mut step = |batch: &Batch, what: &str| {
                let got: Vec<Vec<f32>> = ctxs
                    .iter_mut()
                    .map(|c| c.decode(batch).unwrap().data)
                    .collect();
                assert!(
                    got.iter().all(|g| *g == got[0]),
                    "{name}, {what}: the decode copies changed the logits"
                );
            };
            step(&Batch::prompt(&toks[..40], 0, 0), "the prompt");
            for p in 40..45 {
                step(
                    &Batch::prompt(&toks[p..p + 1], p as i32, 0),
                    &format!("token {p}"),
                );
            }
        };
        same_logits(&[&with, &half, &without], &toks, "SmolLM2");
        // Gemma 3 Q4_K_M: its Q5_0 and Q8_0 layer matrices and its tied Q8_0 embedding (the
        // output head) are copied, whole (every row count is a multiple of 16); the K-quants
        // are not.
        let path = std::env::var("KVSERVE_TEST_GEMMA").expect("KVSERVE_TEST_GEMMA is not set");
        let gguf = GgufFile::open(&path).unwrap();
        let all: usize = gguf
            .tensors()
            .iter()
            .filter(|t| t.dims.len() == 2 && crate::quant::x16::supports(t.ty))
            .map(|t| (t.n_rows() * t.dims[0] / 32) as usize * t.ty.type_size())
            .sum();
        let load = |budget| {
            let gguf = GgufFile::open(&path).unwrap();
            Arc::new(Model::from_gguf_with(gguf, Some(2), budget).unwrap())
        };
        let (with, without) = (load(Some(usize::MAX)), load(None));
        assert_eq!(with.repacked_bytes(), if copies { all } else { 0 });
        let n_vocab = with.n_vocab() as u32;
        let toks: Vec<u32> = (0..45)
            .map(|_| rng.below(n_vocab as usize) as u32)
            .collect();
        same_logits(&[&with, &without], &toks, "Gemma 3");
    }

    #[test]
    fn split_attention_at_depth_gives_the_unsplit_bits() {
        let path = std::env::var("KVSERVE_TEST_MODEL")
            .expect("KVSERVE_TEST_MODEL is not set: point it at the default model's GGUF");
        let m = Arc::new(Model::load(&path, Some(2)).unwrap());
        let n_vocab = m.n_vocab();
        let mut rng = crate::test_rng::Rng(5);
        let toks: Vec<u32> = (0..606).map(|_| rng.below(1000) as u32 + 100).collect();
        let (deep, steps) = (600usize, 6usize);
        assert!(crate::kv::attention::n_chunks(deep, 16) >= 3);
        let o = KvOptions {
            n_ctx: 2048,
            n_seq_max: 2,
            n_batch: 1024,
            ..KvOptions::default()
        };
        let mut one = Context::with_options(Arc::clone(&m), &o).unwrap();
        let all = Batch {
            logits: (0..toks.len()).map(|i| i >= deep).collect(),
            ..Batch::prompt(&toks, 0, 0)
        };
        let want = one.decode(&all).unwrap();
        let mut ctx = Context::with_options(Arc::clone(&m), &o).unwrap();
        let mut prompt = Batch::prompt(&toks[..deep], 0, 0);
        let mut second = Batch::prompt(&toks[..deep], 0, 1);
        prompt.tokens.append(&mut second.tokens);
        prompt.positions.append(&mut second.positions);
        prompt.seq_ids.append(&mut second.seq_ids);
        prompt.logits.append(&mut second.logits);
        ctx.decode(&prompt).unwrap();
        let mut lag = deep; // sequence 1's next position: it decodes every other step
        for i in 0..steps {
            let p = deep + i;
            let got = if i % 2 == 0 {
                ctx.decode(&Batch::prompt(&toks[p..p + 1], p as i32, 0))
                    .unwrap()
            } else {
                let both = Batch {
                    tokens: vec![toks[lag], toks[p]],
                    positions: vec![lag as i32, p as i32],
                    seq_ids: vec![1, 0],
                    logits: vec![true, true],
                };
                let l = ctx.decode(&both).unwrap();
                let r = lag - deep;
                assert!(
                    l.data[..n_vocab] == want.data[r * n_vocab..(r + 1) * n_vocab],
                    "sequence 1 at {lag}: logits differ from the one-batch pass"
                );
                lag += 1;
                Logits {
                    data: l.data[n_vocab..].to_vec(),
                    n_rows: 1,
                    n_vocab,
                }
            };
            assert!(
                got.data[..] == want.data[i * n_vocab..(i + 1) * n_vocab],
                "token {p}: logits of the split step differ from the one-batch pass"
            );
        }
    }

    /// A sequence's state written into a context of another instance of the model (its own
    /// K/V memory) continues exactly as the original: the next token's logits are identical,
    /// bit for bit, in f16 and q8_0, and nothing was recomputed (no decode before the check).
    #[test]
    fn seq_state_restores_a_sequence_in_another_model_instance() {
        let path = std::env::var("KVSERVE_TEST_MODEL")
            .expect("KVSERVE_TEST_MODEL is not set: point it at the default model's GGUF");
        let m1 = Arc::new(Model::load(&path, Some(2)).unwrap());
        let m2 = Arc::new(Model::load(&path, Some(2)).unwrap());
        let prompt = m1.tokenizer.encode(
            "The quick brown fox jumps over the lazy dog, and then",
            true,
            false,
        );
        let next = prompt[3];
        for kv_type in [KvType::F16, KvType::Q8_0] {
            let o = KvOptions {
                n_ctx: 256,
                kv_type,
                ..KvOptions::default()
            };
            let mut a = Context::with_options(Arc::clone(&m1), &o).unwrap();
            let mut b = Context::with_options(Arc::clone(&m2), &o).unwrap();
            a.decode(&Batch::prompt(&prompt, 0, 0)).unwrap();
            let state = a.seq_state_read(0).unwrap();
            assert_eq!(b.seq_state_write(4, &state).unwrap(), prompt.len());
            let n = prompt.len() as i32;
            let la = a.decode(&Batch::prompt(&[next], n, 0)).unwrap();
            let lb = b.decode(&Batch::prompt(&[next], n, 4)).unwrap();
            assert!(la.data == lb.data, "{kv_type:?}: logits differ");
            // A context of another K/V type rejects it.
            let other = KvOptions {
                kv_type: if kv_type == KvType::F16 {
                    KvType::Q8_0
                } else {
                    KvType::F16
                },
                ..o
            };
            let mut c = Context::with_options(Arc::clone(&m2), &other).unwrap();
            assert!(c.seq_state_write(0, &state).is_err());
        }
    }

    /// The disk tier on a real model (SmolLM2, one full-attention group): a prompt whose
    /// blocks the pool evicted is read back from disk, in the same model instance and after a
    /// restart (another instance, a new tier on the directory), and the next logits are
    /// bit for bit those of the same prompt served from RAM and of a model without the tier
    /// computing it whole; the same for Gemma 3 (a full and a window group) past its window.
    #[test]
    fn disk_tier_serves_evicted_prompts_bit_identically() {
        let path = std::env::var("KVSERVE_TEST_MODEL")
            .expect("KVSERVE_TEST_MODEL is not set: point it at the default model's GGUF");
        let dir = std::env::temp_dir().join(format!("kvserve-model-disk-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let disk = crate::kv::DiskOptions {
            max_bytes: 1 << 30,
            min_tokens: 0,
            queue_bytes: 64 << 20,
        };
        let load = || Arc::new(Model::load(&path, Some(2)).unwrap());
        let m1 = load();
        let n_vocab = m1.n_vocab() as u32;
        let p: Vec<u32> = (0..101u32).map(|i| (i * 7919 + 13) % n_vocab).collect();
        let other: Vec<u32> = (0..192u32).map(|i| (i * 104_729 + 5) % n_vocab).collect();
        let per_block = KvLayout {
            ty: KvType::F16,
            n_layers: m1.config.n_layer,
            kv_dim: m1.config.kv_dim(),
            block_size: 16,
        }
        .bytes_per_block();
        let o = KvOptions {
            kv_memory: Some(12 * per_block),
            ..KvOptions::default()
        };
        // The oracle: another instance without a tier computes the whole prompt.
        let cold = {
            let mut c = Context::with_options(load(), &o).unwrap();
            c.decode(&Batch::prompt(&p, 0, 0)).unwrap().data
        };
        let mut a = Context::with_options(Arc::clone(&m1), &o).unwrap();
        a.set_kv_disk(Some(&dir), disk).unwrap();
        assert!(a.decode(&Batch::prompt(&p, 0, 0)).unwrap().data == cold);
        a.memory_mut().seq_rm(0, -1, -1).unwrap();
        let tier = a.kv_disk().unwrap();
        tier.flush();
        assert_eq!(tier.stats().entries, 6, "the prompt's 6 whole blocks");
        // From RAM.
        let n = a.match_prefix(1, &p).unwrap();
        assert_eq!(n, 96);
        let ram = a.decode(&Batch::prompt(&p[n..], n as Pos, 1)).unwrap().data;
        assert!(ram == cold, "a RAM hit continues as the recomputation");
        a.memory_mut().seq_rm(1, -1, -1).unwrap();
        // Another prompt takes every block of the pool: the prompt leaves RAM.
        a.decode(&Batch::prompt(&other, 0, 2)).unwrap();
        a.memory_mut().seq_rm(2, -1, -1).unwrap();
        assert_eq!(
            a.cache()
                .peek_prefix(&p, crate::kv::ROOT_KEY, None, usize::MAX),
            96
        );
        tier.flush();
        let hits = tier.stats().hit_blocks;
        assert_eq!(a.match_prefix(3, &p).unwrap(), 96);
        assert_eq!(
            tier.stats().hit_blocks,
            hits + 6,
            "all 6 blocks came from disk"
        );
        let from_disk = a.decode(&Batch::prompt(&p[96..], 96, 3)).unwrap().data;
        assert!(
            from_disk == cold,
            "a disk hit continues as the recomputation"
        );
        audit(&a);
        drop((a, tier, m1));
        // A restart: another instance of the model, a new tier on the directory.
        let mut b = Context::with_options(load(), &o).unwrap();
        b.set_kv_disk(Some(&dir), disk).unwrap();
        let tier = b.kv_disk().unwrap();
        assert_eq!(tier.stats().loaded, 6 + 12);
        assert_eq!(b.match_prefix(0, &p).unwrap(), 96);
        assert_eq!(tier.stats().hit_blocks, 6);
        let restarted = b.decode(&Batch::prompt(&p[96..], 96, 0)).unwrap().data;
        assert!(restarted == cold, "after a restart too");
        audit(&b);
        drop((b, tier));
        // Gemma 3 (a full and a window group): each group writes its blocks to its own tier
        // under the directory; after a restart (nothing in RAM) a prompt longer than the
        // window resumes from disk: the full group reads its whole prefix, the window group
        // only the window before the resume point, and the logits are the recomputation's.
        let gemma = std::env::var("KVSERVE_TEST_GEMMA").expect("KVSERVE_TEST_GEMMA is not set");
        let load_g = || Arc::new(Model::load(&gemma, Some(2)).unwrap());
        let g = load_g();
        let n_vocab = g.n_vocab() as u32;
        let q: Vec<u32> = (0..601u32).map(|i| (i * 7919 + 13) % n_vocab).collect();
        let mut c = Context::with_options(g, &KvOptions::default()).unwrap();
        c.set_kv_disk(Some(&dir), disk).unwrap();
        let cold = c.decode(&Batch::prompt(&q, 0, 0)).unwrap().data;
        let tiers = c.kv_disks();
        assert_eq!(tiers.len(), 2, "a tier per group");
        assert_ne!(tiers[0].dir(), tiers[1].dir());
        for t in &tiers {
            t.flush();
            assert_eq!(
                t.stats().entries,
                37,
                "the prompt's 37 whole blocks, each group"
            );
        }
        drop((c, tiers));
        let mut d = Context::with_options(load_g(), &KvOptions::default()).unwrap();
        d.set_kv_disk(Some(&dir), disk).unwrap();
        assert_eq!(d.peek_prefix(&q, b""), 592);
        assert_eq!(d.match_prefix(0, &q).unwrap(), 592);
        let hits: Vec<(bool, u64)> = (d.memory().groups().iter())
            .zip(d.kv_disks())
            .map(|(g, t)| (g.kind == LayerKind::Full, t.stats().hit_blocks))
            .collect();
        // The full group: 37 blocks; the window (512) before 592: positions 81..591, blocks
        // 5..36 (Gemma's group 0 is the window group: its layer 0 is local).
        assert_eq!(hits, vec![(false, 32), (true, 37)]);
        let warm = d.decode(&Batch::prompt(&q[592..], 592, 0)).unwrap().data;
        assert!(warm == cold, "a disk hit continues as the recomputation");
        audit(&d);
        drop(d);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A hybrid state's footer: split exactly (values, position) or refused, and checked
    /// against the sequence's token count (the state after its last token, or none).
    #[test]
    fn recurrent_footer_is_split_and_checked() {
        let footer = |vals: &[f32], pos: i32, nf: u64, version: u32, magic: &[u8; 4]| {
            let mut d = b"K/V part".to_vec();
            for v in vals {
                d.extend_from_slice(&v.to_le_bytes());
            }
            d.extend_from_slice(&pos.to_le_bytes());
            d.extend_from_slice(&nf.to_le_bytes());
            d.extend_from_slice(&version.to_le_bytes());
            d.extend_from_slice(magic);
            d
        };
        let vals = [1.5f32, -2.0, 3.25];
        let good = footer(&vals, 4, 3, REC_VERSION, REC_MAGIC);
        let (kv, rec) = split_recurrent(&good, 3).unwrap();
        let (pos, raw) = rec.unwrap();
        assert_eq!((kv, pos), (&b"K/V part"[..], 4));
        assert_eq!(raw.len(), 12);
        assert_eq!(&raw[4..8], &(-2.0f32).to_le_bytes());
        assert_eq!(kv_part_for_tokens(&good, 3, 5).unwrap(), b"K/V part");
        for n in [0, 4, 6] {
            let e = kv_part_for_tokens(&good, 3, n).unwrap_err();
            assert!(e.to_string().contains("at position 4"), "{n}: {e}");
        }
        let none = footer(&[], -1, 0, REC_VERSION, REC_MAGIC);
        assert_eq!(split_recurrent(&none, 3).unwrap(), (&b"K/V part"[..], None));
        assert_eq!(kv_part_for_tokens(&none, 3, 0).unwrap(), b"K/V part");
        let e = kv_part_for_tokens(&none, 3, 2).unwrap_err();
        assert!(e.to_string().contains("absent"), "{e}");
        let cases = [
            (
                "magic",
                footer(&vals, 4, 3, REC_VERSION, b"KVRX"),
                "no recurrent state",
            ),
            ("version", footer(&vals, 4, 3, 2, REC_MAGIC), "version 2"),
            (
                "value count",
                footer(&vals[..2], 4, 2, REC_VERSION, REC_MAGIC),
                "2 values",
            ),
            (
                "values without a position",
                footer(&vals, -1, 3, REC_VERSION, REC_MAGIC),
                "-1",
            ),
            (
                "a position without values",
                footer(&[], 3, 0, REC_VERSION, REC_MAGIC),
                "0 values",
            ),
            (
                "short",
                good[..REC_FOOTER - 1].to_vec(),
                "no recurrent state",
            ),
            ("truncated", good[8 + 10..].to_vec(), "truncated"),
        ];
        for (what, d, why) in cases {
            let e = split_recurrent(&d, 3).unwrap_err();
            assert!(matches!(e, Error::InvalidInput(_)), "{what}: {e}");
            assert!(e.to_string().contains(why), "{what}: {e}");
        }
    }

    /// `seq_state_check` on real states (SmolLM2: one K/V group; Gemma 3: a window group and
    /// a full group): the sequence's tokens pass, and writing nothing; other tokens, another
    /// K/V type and a corrupted header fail; any corruption that passes loads as the tokens.
    #[test]
    fn seq_state_check_on_real_models() {
        let mut rng = crate::test_rng::Rng(0x0bad_5eed);
        for var in ["KVSERVE_TEST_MODEL", "KVSERVE_TEST_GEMMA"] {
            let path = std::env::var(var).unwrap_or_else(|_| panic!("{var} is not set"));
            let m = Arc::new(Model::load(&path, Some(2)).unwrap());
            let o = KvOptions {
                n_ctx: 256,
                ..KvOptions::default()
            };
            let mut a = Context::with_options(Arc::clone(&m), &o).unwrap();
            let toks = m.tokenizer.encode(
                "The quick brown fox jumps over the lazy dog, and then it",
                true,
                false,
            );
            a.decode(&Batch::prompt(&toks, 0, 0)).unwrap();
            let data = a.seq_state_read(0).unwrap();
            let cells = |c: &Context, s: SeqId| -> Vec<(Pos, u32)> {
                let t = c.cache().table();
                let mut v: Vec<_> = t
                    .cells(s)
                    .into_iter()
                    .map(|(p, b, sl)| (p, t.cell_token(b, sl)))
                    .collect();
                v.sort_unstable();
                v
            };
            let before = (cells(&a, 0), a.cache().shared().pool_stats());
            assert_eq!(
                a.seq_state_check(&data, &toks).unwrap(),
                toks.len(),
                "{var}"
            );
            assert_eq!((cells(&a, 0), a.cache().shared().pool_stats()), before);
            let mut other = toks.clone();
            other[2] = (other[2] + 1) % m.n_vocab() as u32;
            assert!(a.seq_state_check(&data, &other).is_err());
            assert!(a.seq_state_check(&data, &toks[1..]).is_err());
            let q8 = KvOptions {
                kv_type: KvType::Q8_0,
                ..o
            };
            let c = Context::with_options(Arc::clone(&m), &q8).unwrap();
            assert!(c.seq_state_check(&data, &toks).is_err(), "{var}: q8_0");
            let want: Vec<(Pos, u32)> = (0..toks.len() as Pos).zip(toks.iter().copied()).collect();
            let mut b = Context::with_options(Arc::clone(&m), &o).unwrap();
            let mut passed = 0;
            for round in 0..400 {
                let mut d = data.clone();
                let at = rng.below(if round % 2 == 0 { 48 } else { d.len() });
                let bit = rng.below(8);
                d[at] ^= 1 << bit;
                match b.seq_state_check(&d, &toks) {
                    Ok(n) => {
                        passed += 1;
                        // Every byte of the first 48 counts (a one-group state's header; the
                        // container's header and group table with two groups) but the clean
                        // flag of a one-group state (bit 0 of byte 40).
                        assert!(
                            at >= 48 || (at == 40 && bit == 0),
                            "{var}: byte {at} bit {bit}"
                        );
                        assert_eq!(b.seq_state_write(1, &d).unwrap(), n);
                        assert_eq!(cells(&b, 1), want, "{var}: round {round}");
                        b.memory_mut().seq_rm(1, -1, -1).unwrap();
                    }
                    Err(e) => assert!(matches!(e, Error::InvalidInput(_)), "{e}"),
                }
            }
            assert!(passed > 50, "{var}: {passed} corruptions passed");
            for g in b.memory().groups() {
                g.cache.table().check().unwrap();
            }
        }
    }

    /// Checks every layer group's tables and the model's pools (the binding's `audit`).
    fn audit(c: &Context) {
        for g in c.memory().groups() {
            g.cache.table().check().unwrap();
        }
        if let Some(r) = c.memory().recurrent() {
            r.check().unwrap();
        }
    }

    /// `blocks_short` against what `decode` then does, on real models over small pools
    /// (SmolLM2: full attention only; Gemma 3: a window group beside the full one), through
    /// random batches of several sequences, shared prefixes (`seq_cp`, prefix matches of
    /// earlier prompts), removals and another context on the same memory: 0 exactly when
    /// decode succeeds, more exactly when it raises `KvCacheFull`; the tables stay consistent.
    #[test]
    fn blocks_short_agrees_with_decode_on_real_models() {
        let mut rng = crate::test_rng::Rng(0x5407_b10c);
        for (var, steps) in [("KVSERVE_TEST_MODEL", 140), ("KVSERVE_TEST_GEMMA", 50)] {
            let path = std::env::var(var).unwrap_or_else(|_| panic!("{var} is not set"));
            let m = Arc::new(Model::load(&path, Some(2)).unwrap());
            // 10 blocks of 16 tokens in every group's pool.
            let per_block: usize = m
                .layer_groups()
                .iter()
                .map(|(_, layers)| {
                    KvLayout {
                        ty: KvType::F16,
                        n_layers: layers.len(),
                        kv_dim: m.config.kv_dim(),
                        block_size: 16,
                    }
                    .bytes_per_block()
                })
                .sum();
            let o = KvOptions {
                kv_memory: Some(10 * per_block),
                n_seq_max: 4,
                n_batch: 128,
                ..KvOptions::default()
            };
            let mut ctx = Context::with_options(Arc::clone(&m), &o).unwrap();
            let mut other = Context::with_options(Arc::clone(&m), &o).unwrap();
            for g in ctx.group_usage() {
                assert_eq!(g.blocks_total, 10, "{var}");
            }
            let n_vocab = m.n_vocab() as u32;
            let mut text: Vec<Vec<u32>> = vec![Vec::new(); 4];
            let (mut fits, mut short) = (0, 0);
            for step in 0..steps {
                let s = rng.below(4) as SeqId;
                match rng.below(10) {
                    0..=5 => {
                        let mut b = Batch::default();
                        for q in 0..4 {
                            if rng.below(2) == 0 {
                                continue;
                            }
                            let p0 = ctx.memory().seq_pos_max(q) + 1;
                            for i in 0..1 + rng.below(24) {
                                b.tokens.push(100 + rng.below(8) as u32 % n_vocab);
                                b.positions.push(p0 + i as Pos);
                                b.seq_ids.push(q);
                                b.logits.push(i == 0);
                            }
                        }
                        if b.is_empty() {
                            continue;
                        }
                        let want = ctx.blocks_short(&b).unwrap();
                        let got = ctx.decode(&b);
                        match (want, &got) {
                            (0, Ok(_)) => fits += 1,
                            (n, Err(Error::KvCacheFull(_))) if n > 0 => {
                                short += 1;
                                // Preempt one of the batch's sequences.
                                let q = b.seq_ids[rng.below(b.len())];
                                ctx.memory_mut().seq_rm(q, -1, -1).unwrap();
                                text[q as usize].clear();
                            }
                            _ => panic!("{var} step {step}: blocks_short {want}, decode {got:?}"),
                        }
                        if got.is_ok() {
                            for (&q, &t) in b.seq_ids.iter().zip(&b.tokens) {
                                text[q as usize].push(t);
                            }
                        }
                    }
                    6 => {
                        let d = rng.below(4) as SeqId;
                        if d != s && ctx.memory().seq_pos_max(d) < 0 {
                            ctx.memory_mut().seq_cp(s, d, -1, -1).unwrap();
                            text[d as usize] = text[s as usize].clone();
                        }
                    }
                    7 => {
                        ctx.memory_mut().seq_rm(s, -1, -1).unwrap();
                        text[s as usize].clear();
                    }
                    8 => {
                        let src = rng.below(4);
                        if ctx.memory().seq_pos_max(s) < 0 && text[src].len() > 1 {
                            let prompt = text[src].clone();
                            let n = ctx.match_prefix(s, &prompt).unwrap();
                            text[s as usize] = prompt[..n].to_vec();
                        }
                    }
                    _ => {
                        // Another context takes blocks of the pool, or gives them back.
                        if other.memory().seq_pos_max(0) < 0 {
                            let _ = other.decode(&Batch::prompt(&[7; 20], 0, 0));
                        } else {
                            other.memory_mut().seq_rm(0, -1, -1).unwrap();
                        }
                    }
                }
                audit(&ctx);
                audit(&other);
            }
            assert!(
                fits > steps / 10 && short > steps / 20,
                "{var}: {fits} fit, {short} short"
            );
            // A malformed batch: InvalidInput from both.
            let bad = Batch::prompt(&[1, 2], 0, 0);
            let q = Batch {
                positions: vec![3, 3],
                ..bad.clone()
            };
            assert!(matches!(ctx.blocks_short(&q), Err(Error::InvalidInput(_))));
            assert!(matches!(ctx.decode(&q), Err(Error::InvalidInput(_))));
        }
        // The context's token limit counts as blocks short: 40 tokens of a larger pool.
        let path = std::env::var("KVSERVE_TEST_MODEL").unwrap();
        let m = Arc::new(Model::load(&path, Some(2)).unwrap());
        let mut ctx = Context::new(Arc::clone(&m), 40).unwrap();
        ctx.decode(&Batch::prompt(&[5; 30], 0, 0)).unwrap();
        for (n, want) in [(10, 0), (11, 1), (26, 1), (27, 2)] {
            let b = Batch::prompt(&vec![6; n], 0, 1);
            assert_eq!(ctx.blocks_short(&b).unwrap(), want, "{n} tokens");
            assert_eq!(ctx.decode(&b).is_ok(), want == 0, "{n} tokens");
            ctx.memory_mut().seq_rm(1, -1, -1).unwrap();
        }
    }

    /// Dropping a context (what the binding does when a panic closes one) gives every block its
    /// sequences held back to the model's shared pools, in every group: each pool's referenced
    /// count returns to what another context alone holds, the blocks its prompt filled stay
    /// cached and indexed, and a new context maps them and goes on as the dropped one would
    /// have. SmolLM2 (one group) and Gemma 3 with a prompt past its 512-position window (the
    /// window group pruned). (The recurrent group: `kv::memory`'s
    /// `dropping_a_memory_gives_every_block_back`; a context's drop is its memory's.)
    #[test]
    fn dropping_a_context_releases_its_blocks_to_the_shared_pools() {
        for (var, len) in [("KVSERVE_TEST_MODEL", 100), ("KVSERVE_TEST_GEMMA", 540)] {
            let path = std::env::var(var).unwrap_or_else(|_| panic!("{var} is not set"));
            let m = Arc::new(Model::load(&path, Some(2)).unwrap());
            let o = KvOptions {
                n_ctx: 2048,
                ..KvOptions::default()
            };
            let text = "Once upon a time, in a kingdom by the sea, there lived a keeper of \
                        lighthouses who counted the ships that passed each night. ";
            let mut prompt = Vec::new();
            while prompt.len() < len {
                prompt.extend(m.tokenizer.encode(text, prompt.is_empty(), false));
            }
            prompt.truncate(len);
            let mut keep = Context::with_options(Arc::clone(&m), &o).unwrap();
            keep.decode(&Batch::prompt(&prompt[..20], 0, 0)).unwrap();
            let pools = |c: &Context| -> Vec<PoolStats> {
                c.memory()
                    .groups()
                    .iter()
                    .map(|g| g.cache.shared().pool_stats())
                    .collect()
            };
            let base = pools(&keep);
            let mut ctx = Context::with_options(Arc::clone(&m), &o).unwrap();
            let want = ctx.decode(&Batch::prompt(&prompt, 0, 0)).unwrap();
            ctx.memory_mut().seq_cp(0, 1, -1, -1).unwrap();
            ctx.decode(&Batch::prompt(&[prompt[3]], len as Pos, 1))
                .unwrap();
            ctx.decode(&Batch::prompt(&prompt[5..30], 0, 2)).unwrap();
            audit(&ctx);
            if var == "KVSERVE_TEST_GEMMA" {
                let win = &ctx.memory().groups()[0];
                assert!(matches!(win.kind, LayerKind::Window(512)), "{:?}", win.kind);
                assert!(
                    win.cache.table().seq_pos_min(0) > 0,
                    "the window was pruned"
                );
            }
            for (g, b) in pools(&ctx).iter().zip(&base) {
                assert!(g.referenced > b.referenced, "{var}");
            }
            drop(ctx);
            for (g, b) in pools(&keep).iter().zip(&base) {
                assert_eq!(
                    g.referenced, b.referenced,
                    "{var}: {g:?} after, {b:?} before"
                );
                assert_eq!(g.free + g.cached + g.referenced, g.total);
                assert!(
                    g.cached > b.cached,
                    "{var}: the prompt's blocks stay cached"
                );
            }
            audit(&keep);
            // A new context on the same model maps the prompt's cached blocks and continues.
            let mut c2 = Context::with_options(Arc::clone(&m), &o).unwrap();
            let n = c2.match_prefix(0, &prompt).unwrap();
            assert_eq!(n, (len - 1) / 16 * 16, "{var}");
            let got = c2
                .decode(&Batch::prompt(&prompt[n..], n as Pos, 0))
                .unwrap();
            let scale = want.data.iter().fold(0f32, |a, x| a.max(x.abs()));
            let diff = want
                .data
                .iter()
                .zip(&got.data)
                .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
            assert!(
                diff <= 1e-3 * scale,
                "{var}: logits differ by {diff} (of {scale})"
            );
            audit(&c2);
        }
    }
}
