//! Models: loading a GGUF file into a runnable [`Model`] (weights stay in the mapping), and a
//! [`Context`] that runs batches through it and keeps their keys and values.

pub mod config;
pub mod llama;

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use crate::batch::Batch;
use crate::error::{invalid, Result};
use crate::gguf::GgufFile;
use crate::kv::storage::{KvLayout, KvType};
use crate::kv::{PagedCache, DEFAULT_BLOCK_SIZE};
use crate::tokenizer::{Tokenizer, VocabData};

pub use config::{Arch, Config};

/// A loaded model: configuration, weight locations in the mmapped file, tokenizer, thread pool.
pub struct Model {
    pub config: Config,
    pub tokenizer: Tokenizer,
    weights: llama::Weights,
    gguf: GgufFile,
    team: crate::threads::Team,
    /// Stable identity of the weights, part of every prefix-cache block key.
    id: u64,
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
    pub fn load(path: impl AsRef<Path>, threads: Option<usize>) -> Result<Model> {
        Model::from_gguf(GgufFile::open(path)?, threads)
    }

    pub fn from_gguf(gguf: GgufFile, threads: Option<usize>) -> Result<Model> {
        let mut config = Config::from_gguf(&gguf)?;
        let weights = llama::Weights::load(&gguf, &mut config)?;
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
        Ok(Model {
            config,
            tokenizer,
            weights,
            gguf,
            team,
            id,
        })
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
    pub fn id(&self) -> u64 {
        self.id
    }
}

/// A stable 64-bit identity of a model file's weights for prefix-cache keys: the tensor table
/// (names, types, shapes, offsets), the file size, and the first and last 4 KiB of every
/// tensor's data. Cheap (no full read of the weights) and the same on every run and platform.
pub fn model_identity(g: &GgufFile) -> u64 {
    fn words(bytes: &[u8]) -> Vec<u32> {
        bytes
            .chunks(4)
            .map(|c| {
                let mut w = [0u8; 4];
                w[..c.len()].copy_from_slice(c);
                u32::from_le_bytes(w)
            })
            .collect()
    }
    let mut h = crate::kv::block_key(0x6b76_7365_7276_6549, g.file_size(), &[]);
    for t in g.tensors() {
        let mut w = words(t.name.as_bytes());
        w.push(t.ty.id());
        for &d in &t.dims {
            w.extend([d as u32, (d >> 32) as u32]);
        }
        w.extend([t.offset as u32, (t.offset >> 32) as u32]);
        let data = g.tensor_data(t);
        let head = &data[..data.len().min(4096)];
        let tail = &data[data.len().saturating_sub(4096)..];
        w.extend(words(head));
        w.extend(words(tail));
        h = crate::kv::block_key(h, h, &w);
    }
    h
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

/// How a context's KV cache is sized and stored.
#[derive(Debug, Clone, Copy)]
pub struct KvOptions {
    /// Token limit across all sequences (ignored when `kv_memory` is set).
    pub n_ctx: usize,
    /// Size the cache by bytes of K/V storage instead (`--kv-memory`).
    pub kv_memory: Option<usize>,
    pub kv_type: KvType,
    pub block_size: usize,
}

impl Default for KvOptions {
    fn default() -> KvOptions {
        KvOptions {
            n_ctx: 4096,
            kv_memory: None,
            kv_type: KvType::F16,
            block_size: DEFAULT_BLOCK_SIZE,
        }
    }
}

/// A running context: the model plus the keys and values of its sequences.
pub struct Context {
    model: Arc<Model>,
    cache: PagedCache,
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

    pub fn with_options(model: Arc<Model>, o: &KvOptions) -> Result<Context> {
        if o.n_ctx == 0 && o.kv_memory.is_none() {
            return Err(invalid("n_ctx must be positive"));
        }
        let c = &model.config;
        let layout = KvLayout {
            ty: o.kv_type,
            n_layers: c.n_layer,
            kv_dim: c.kv_dim(),
            block_size: o.block_size,
        };
        let (hd, rope) = (c.head_dim, c.rope.clone());
        let mut cache = match o.kv_memory {
            Some(bytes) => PagedCache::with_bytes(layout, hd, rope, bytes)?,
            None => PagedCache::new(layout, hd, rope, o.n_ctx)?,
        };
        // Keys of cached blocks identify the weights and the K/V format that produced them.
        let kv_format = [o.kv_type as u32, o.block_size as u32];
        cache.set_model_id(crate::kv::block_key(model.id(), 0, &kv_format));
        Ok(Context { model, cache })
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    pub fn n_ctx(&self) -> usize {
        self.cache.n_ctx()
    }

    pub fn cache(&self) -> &PagedCache {
        &self.cache
    }

    pub fn cache_mut(&mut self) -> &mut PagedCache {
        &mut self.cache
    }

    /// Runs one batch; returns logits for the tokens that asked for them, in batch order.
    /// A batch that does not fit fails with `KvCacheFull` and leaves the cache unchanged.
    pub fn decode(&mut self, batch: &Batch) -> Result<Logits> {
        batch.validate(self.model.n_vocab())?;
        llama::forward(&self.model, &mut self.cache, batch)
    }

    pub fn clear(&mut self) {
        self.cache.clear();
    }
}

/// Throughput measured like llama-bench: `pp` is one batch of `n_prompt` tokens, `tg` is
/// `n_gen` single-token steps from an empty context; each after one warm-up run, averaged over
/// `reps` runs (llama-bench reports the mean too).
#[derive(Debug, Clone, Copy)]
pub struct BenchResult {
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
}

pub fn bench(
    model: &Arc<Model>,
    n_prompt: usize,
    n_gen: usize,
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
    let mut ctx = Context::new(Arc::clone(model), (n_prompt + n_gen).max(1) + 8)?;
    let reps = reps.max(1);
    let (mut pp, mut tg) = (0.0f64, 0.0f64);
    if n_prompt > 0 {
        for r in 0..=reps {
            ctx.clear();
            let tokens: Vec<u32> = (0..n_prompt).map(|_| tok()).collect();
            let t0 = Instant::now();
            ctx.decode(&Batch::prompt(&tokens, 0, 0))?;
            if r > 0 {
                pp += t0.elapsed().as_secs_f64() / reps as f64;
            }
        }
    }
    if n_gen > 0 {
        for r in 0..=reps {
            ctx.clear();
            let t0 = Instant::now();
            for i in 0..n_gen {
                ctx.decode(&Batch::prompt(&[tok()], i as i32, 0))?;
            }
            if r > 0 {
                tg += t0.elapsed().as_secs_f64() / reps as f64;
            }
        }
    }
    Ok(BenchResult {
        prefill_tok_s: if n_prompt > 0 {
            n_prompt as f64 / pp
        } else {
            0.0
        },
        decode_tok_s: if n_gen > 0 { n_gen as f64 / tg } else { 0.0 },
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
    let mut ctx = Context::new(Arc::clone(model), batch * (n_prompt + n_gen) + 8)?;
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
