//! Hyper-parameters of a model, read and validated from GGUF metadata: the llama family and
//! Gemma 3, with each layer's memory kind ([`LayerKind`]: full attention, a sliding window or a
//! recurrent state).

use crate::error::{model_err, Error, Result};
use crate::gguf::GgufFile;
use crate::ops::{Rope, RopeScaling};

/// Architectures this engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// SmolLM2, Llama 2/3, Mistral: normal RoPE, no biases.
    Llama,
    /// Qwen2: NeoX RoPE, biases on q/k/v.
    Qwen2,
    /// Qwen3: NeoX RoPE, RMSNorm on q and k per head.
    Qwen3,
    /// Gemma 3: scaled embeddings, four norms per layer, q/k norms, GELU-gated FFN, local
    /// (sliding-window) layers with their own RoPE base between global ones.
    Gemma3,
    /// LFM2 (Liquid): short-conv layers (`head_count_kv` 0) beside GQA attention layers with
    /// q/k norms and NeoX RoPE (model/lfm2.rs).
    Lfm2,
}

pub const SUPPORTED_ARCHS: &[&str] = &["llama", "qwen2", "qwen3", "gemma3", "lfm2"];

/// Each layer's memory kind is the K/V cache's notion ([`crate::kv::LayerKind`]): what memory a
/// layer needs belongs to `kv`; the config only reads which kind each layer is.
pub use crate::kv::LayerKind;

impl Arch {
    pub fn from_name(name: &str) -> Result<Arch> {
        match name {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "qwen3" => Ok(Arch::Qwen3),
            "gemma3" => Ok(Arch::Gemma3),
            "lfm2" => Ok(Arch::Lfm2),
            other => Err(Error::Unsupported(format!(
                "unsupported architecture '{other}' (supported: {})",
                SUPPORTED_ARCHS.join(", ")
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
            Arch::Lfm2 => "lfm2",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Config {
    pub arch: Arch,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    pub rms_eps: f32,
    /// RoPE of full-attention layers (all layers unless `rope_local` is set).
    pub rope: Rope,
    /// RoPE of sliding-window layers when it differs (Gemma 3: base 10,000, no scaling).
    pub rope_local: Option<Rope>,
    /// Memory kind of each layer (`n_layer` entries).
    pub layer_kinds: Vec<LayerKind>,
    /// Scale of the attention scores (1/sqrt(head_dim) unless the architecture says otherwise).
    pub attn_scale: f32,
    /// Factor applied to token embeddings (Gemma: sqrt(n_embd); else 1).
    pub embd_scale: f32,
    /// Final logit soft-capping `c * tanh(logit / c)`, when the metadata has it.
    pub final_softcap: Option<f32>,
    /// Short-conv (recurrent) layers, for LFM2; `None` for attention-only models.
    pub shortconv: Option<ShortConv>,
}

/// LFM2's short convolutions: which layers are conv blocks and the kernel length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShortConv {
    /// `shortconv.l_cache`: taps of the causal depthwise convolution; a sequence's state is
    /// its last `l_cache - 1` inputs per conv layer.
    pub l_cache: usize,
    /// Per layer: a short-conv block (its `head_count_kv` entry is 0) instead of attention
    /// (those layers' kind is [`LayerKind::Recurrent`]).
    pub is_conv: Vec<bool>,
}

impl ShortConv {
    pub fn n_conv_layers(&self) -> usize {
        self.is_conv.iter().filter(|&&c| c).count()
    }
}

impl Config {
    /// Width of one token's keys (or values) across KV heads.
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// The RoPE of layer `layer`.
    pub fn rope_for(&self, layer: usize) -> &Rope {
        match (self.layer_kinds[layer], &self.rope_local) {
            (LayerKind::Window(_), Some(r)) => r,
            _ => &self.rope,
        }
    }

    /// The layers grouped by memory kind, in order of each kind's first layer: one memory
    /// group per kind (`kv::LayerGroups`).
    pub fn layer_groups(&self) -> Vec<(LayerKind, Vec<usize>)> {
        let mut out: Vec<(LayerKind, Vec<usize>)> = Vec::new();
        for (l, &k) in self.layer_kinds.iter().enumerate() {
            match out.iter_mut().find(|(kind, _)| *kind == k) {
                Some((_, layers)) => layers.push(l),
                None => out.push((k, vec![l])),
            }
        }
        out
    }

    /// Whether layer `li` keeps a recurrent state instead of K/V.
    pub fn is_recurrent(&self, li: usize) -> bool {
        self.layer_kinds[li] == LayerKind::Recurrent
    }

    /// Whether any layer attends over a sliding window.
    pub fn has_window_layers(&self) -> bool {
        self.layer_kinds
            .iter()
            .any(|k| matches!(k, LayerKind::Window(_)))
    }

    pub fn from_gguf(g: &GgufFile) -> Result<Config> {
        let arch_name = g
            .get_str("general.architecture")?
            .ok_or_else(|| model_err("GGUF: missing key 'general.architecture'"))?
            .to_string();
        let arch = Arch::from_name(&arch_name)?;
        let a = arch_name.as_str();
        let req = |key: &str| -> Result<usize> {
            let full = format!("{a}.{key}");
            let v = g
                .get_u64(&full)?
                .ok_or_else(|| model_err(format!("GGUF: missing key '{full}'")))?;
            if v == 0 || v > (1 << 24) {
                return Err(model_err(format!(
                    "GGUF: key '{full}' has implausible value {v}"
                )));
            }
            Ok(v as usize)
        };
        let n_layer = req("block_count")?;
        // Every block has tensors of its own, so a count beyond the tensor table is malformed;
        // refused here, before anything is sized by it (fuzzing found a 30 KB file whose
        // block_count of 2^24 made weight loading reserve gigabytes for its layers).
        if n_layer > g.tensors().len() {
            return Err(model_err(format!(
                "GGUF: key '{a}.block_count' is {n_layer}, but the file has only {} tensors",
                g.tensors().len()
            )));
        }
        let n_embd = req("embedding_length")?;
        let n_ff = req("feed_forward_length")?;
        let n_head = req("attention.head_count")?;
        let (n_head_kv, shortconv) = if arch == Arch::Lfm2 {
            lfm2_layers(g, a, n_layer)?
        } else {
            let n_head_kv = match g.get_u64(&format!("{a}.attention.head_count_kv"))? {
                Some(v) => v as usize,
                None => n_head,
            };
            (n_head_kv, None)
        };
        if n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(model_err(format!(
                "GGUF: head_count {n_head} is not a multiple of head_count_kv {n_head_kv}"
            )));
        }
        let head_dim = match g.get_u64(&format!("{a}.attention.key_length"))? {
            Some(v) => v as usize,
            None => {
                if n_embd % n_head != 0 {
                    return Err(model_err(format!(
                        "GGUF: embedding_length {n_embd} is not a multiple of head_count {n_head}"
                    )));
                }
                n_embd / n_head
            }
        };
        if head_dim == 0 || head_dim > 1024 || head_dim % 2 != 0 {
            return Err(model_err(format!(
                "GGUF: implausible head dimension {head_dim}"
            )));
        }
        let n_ctx_train = g.get_u64(&format!("{a}.context_length"))?.unwrap_or(4096) as usize;
        let rms_eps = g
            .get_f32(&format!("{a}.attention.layer_norm_rms_epsilon"))?
            .unwrap_or(1e-5);
        let freq_base = g
            .get_f32(&format!("{a}.rope.freq_base"))?
            .unwrap_or(10000.0);
        let n_rot = g
            .get_u64(&format!("{a}.rope.dimension_count"))?
            .map_or(head_dim, |v| v as usize);
        if n_rot == 0 || n_rot > head_dim || n_rot % 2 != 0 {
            return Err(model_err(format!(
                "GGUF: rope.dimension_count {n_rot} does not fit head dimension {head_dim}"
            )));
        }
        let scaling_type = g
            .get_str(&format!("{a}.rope.scaling.type"))?
            .map(str::to_string);
        let factor = g
            .get_f32(&format!("{a}.rope.scaling.factor"))?
            .filter(|f| *f > 0.0);
        let scaling = match (scaling_type.as_deref(), factor) {
            (Some("linear"), Some(f)) if f != 1.0 => RopeScaling::Linear { factor: f },
            (Some("yarn"), Some(f)) => RopeScaling::Yarn {
                factor: f,
                orig_ctx: g
                    .get_u64(&format!("{a}.rope.scaling.original_context_length"))?
                    .unwrap_or(n_ctx_train as u64) as u32,
                ext_factor: 1.0,
                attn_factor: g
                    .get_f32(&format!("{a}.rope.scaling.attn_factor"))?
                    .unwrap_or(1.0),
                beta_fast: 32.0,
                beta_slow: 1.0,
            },
            (None | Some("none") | Some("linear"), _) => RopeScaling::None,
            (Some(other), _) => {
                return Err(Error::Unsupported(format!(
                    "unsupported rope scaling '{other}' (supported: none, linear, yarn)"
                )))
            }
        };
        if !freq_base.is_finite() || freq_base <= 1.0 {
            return Err(model_err(format!(
                "GGUF: implausible rope.freq_base {freq_base}"
            )));
        }
        let neox = !matches!(arch, Arch::Llama);
        let n_vocab = g
            .tensor("token_embd.weight")
            .map(|t| t.dims.get(1).copied().unwrap_or(0) as usize)
            .ok_or_else(|| model_err("GGUF: missing tensor 'token_embd.weight'"))?;
        let rope = Rope {
            n_rot,
            neox,
            freq_base,
            scaling,
            freq_factors: None,
        };
        let mut layer_kinds = vec![LayerKind::Full; n_layer];
        let (mut rope_local, mut embd_scale, mut final_softcap) = (None, 1.0f32, None);
        let mut attn_scale = 1.0 / (head_dim as f32).sqrt();
        if arch == Arch::Gemma3 {
            if let Some(v) = g.get_u64(&format!("{a}.attention.value_length"))? {
                if v as usize != head_dim {
                    return Err(Error::Unsupported(format!(
                        "gemma3: value_length {v} differs from key_length {head_dim}"
                    )));
                }
            }
            embd_scale = (n_embd as f32).sqrt();
            // llama.cpp: 1/sqrt(n_embd / n_head) for the 27B model (62 layers), else
            // 1/sqrt(head_dim).
            if n_layer == 62 {
                attn_scale = 1.0 / ((n_embd / n_head) as f32).sqrt();
            }
            final_softcap = g
                .get_f32(&format!("{a}.final_logit_softcapping"))?
                .filter(|c| *c != 0.0);
            if let Some(c) = final_softcap {
                if !c.is_finite() || c < 0.0 {
                    return Err(model_err(format!(
                        "GGUF: implausible final_logit_softcapping {c}"
                    )));
                }
            }
            let window = g
                .get_u64(&format!("{a}.attention.sliding_window"))?
                .unwrap_or(0) as usize;
            if window > 0 {
                let swa = swa_pattern(g, a, n_layer, 6)?;
                for (k, is_swa) in layer_kinds.iter_mut().zip(swa) {
                    if is_swa {
                        *k = LayerKind::Window(window);
                    }
                }
                let base_swa = g
                    .get_f32(&format!("{a}.rope.freq_base_swa"))?
                    .unwrap_or(10000.0);
                if !base_swa.is_finite() || base_swa <= 1.0 {
                    return Err(model_err(format!(
                        "GGUF: implausible rope.freq_base_swa {base_swa}"
                    )));
                }
                rope_local = Some(Rope {
                    freq_base: base_swa,
                    scaling: RopeScaling::None,
                    ..rope.clone()
                });
            }
        }
        if let Some(sc) = &shortconv {
            // A sliding window on some attention layers (`attention.sliding_window` and
            // `attention.sliding_window_pattern`, read as for gemma3 with every attention layer
            // local by default): a kvserve extension that llama.cpp's lfm2 does not read, for
            // models that mix all three layer kinds (llama.cpp's `llama_memory_hybrid_iswa`).
            let window = g
                .get_u64(&format!("{a}.attention.sliding_window"))?
                .unwrap_or(0) as usize;
            let swa = if window > 0 {
                swa_pattern(g, a, n_layer, 0)?
            } else {
                vec![false; n_layer]
            };
            for ((k, &conv), local) in layer_kinds.iter_mut().zip(&sc.is_conv).zip(swa) {
                if conv {
                    *k = LayerKind::Recurrent;
                } else if local {
                    *k = LayerKind::Window(window);
                }
            }
        }
        Ok(Config {
            arch,
            n_layer,
            n_embd,
            n_head,
            n_head_kv,
            head_dim,
            n_ff,
            n_vocab,
            n_ctx_train,
            rms_eps,
            rope,
            rope_local,
            layer_kinds,
            attn_scale,
            embd_scale,
            final_softcap,
            shortconv,
        })
    }
}

/// LFM2's layer pattern as llama.cpp reads it: `head_count_kv` is an array with one entry per
/// layer (0 marks a short-conv layer) or one number for every layer; `shortconv.l_cache` is the
/// conv kernel length. Returns the attention layers' KV head count (they must agree) and the
/// pattern.
fn lfm2_layers(g: &GgufFile, a: &str, n_layer: usize) -> Result<(usize, Option<ShortConv>)> {
    let key = format!("{a}.attention.head_count_kv");
    let per_layer: Vec<usize> = match g.get(&key) {
        None => return Err(model_err(format!("GGUF: missing key '{key}'"))),
        Some(v) => match v.as_array() {
            Some(items) => items
                .iter()
                .map(|x| {
                    x.as_integer()
                        .filter(|&n| (0..=1 << 16).contains(&n))
                        .map(|n| n as usize)
                        .ok_or_else(|| model_err(format!("GGUF: key '{key}' holds a non-count")))
                })
                .collect::<Result<_>>()?,
            None => vec![g.get_u64(&key)?.unwrap_or(0) as usize; n_layer],
        },
    };
    if per_layer.len() != n_layer {
        return Err(model_err(format!(
            "GGUF: key '{key}' has {} entries for {n_layer} layers",
            per_layer.len()
        )));
    }
    let attn: Vec<usize> = per_layer.iter().copied().filter(|&n| n > 0).collect();
    let n_head_kv = match attn.first() {
        None => {
            return Err(Error::Unsupported(
                "lfm2 model without attention layers (every head_count_kv entry is 0)".into(),
            ))
        }
        Some(&n) if attn.iter().any(|&m| m != n) => {
            return Err(Error::Unsupported(format!(
                "lfm2 attention layers with different head_count_kv ({per_layer:?})"
            )))
        }
        Some(&n) => n,
    };
    let lkey = format!("{a}.shortconv.l_cache");
    let l_cache =
        g.get_u64(&lkey)?
            .ok_or_else(|| model_err(format!("GGUF: missing key '{lkey}'")))? as usize;
    if !(2..=64).contains(&l_cache) {
        return Err(model_err(format!(
            "GGUF: key '{lkey}' has implausible value {l_cache} (2..=64)"
        )));
    }
    let is_conv = per_layer.iter().map(|&n| n == 0).collect();
    Ok((n_head_kv, Some(ShortConv { l_cache, is_conv })))
}

/// Which layers use the sliding window, as llama.cpp reads it: the metadata's
/// `attention.sliding_window_pattern` as one bool per layer, or as a number `n` (layer `i` is
/// local iff `i % n < n - 1`, so every `n`-th layer is global), else `default_n`.
fn swa_pattern(g: &GgufFile, a: &str, n_layer: usize, default_n: usize) -> Result<Vec<bool>> {
    let key = format!("{a}.attention.sliding_window_pattern");
    if let Some(crate::gguf::Value::Array(items)) = g.get(&key) {
        let v: Vec<bool> = items
            .iter()
            .map(|x| match x {
                crate::gguf::Value::Bool(b) => Ok(*b),
                _ => Err(model_err(format!("GGUF: '{key}' must hold booleans"))),
            })
            .collect::<Result<_>>()?;
        if v.len() != n_layer {
            return Err(model_err(format!(
                "GGUF: '{key}' has {} entries for {n_layer} layers",
                v.len()
            )));
        }
        return Ok(v);
    }
    let n = g.get_u64(&key)?.map_or(default_n, |v| v as usize);
    Ok((0..n_layer).map(|i| n == 0 || i % n < n - 1).collect())
}
