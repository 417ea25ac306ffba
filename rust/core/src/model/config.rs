//! Hyper-parameters of a llama-family model, read and validated from GGUF metadata.

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
    /// LFM2 (Liquid): short-conv layers (`head_count_kv` 0) beside GQA attention layers with
    /// q/k norms and NeoX RoPE (model/lfm2.rs).
    Lfm2,
}

pub const SUPPORTED_ARCHS: &[&str] = &["llama", "qwen2", "qwen3", "lfm2"];

impl Arch {
    pub fn from_name(name: &str) -> Result<Arch> {
        match name {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "qwen3" => Ok(Arch::Qwen3),
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
    pub rope: Rope,
    /// Short-conv (recurrent) layers, for LFM2; `None` for attention-only models.
    pub shortconv: Option<ShortConv>,
}

/// LFM2's short convolutions: which layers are conv blocks and the kernel length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShortConv {
    /// `shortconv.l_cache`: taps of the causal depthwise convolution; a sequence's state is
    /// its last `l_cache - 1` inputs per conv layer.
    pub l_cache: usize,
    /// Per layer: a short-conv block (its `head_count_kv` entry is 0) instead of attention.
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

    /// Whether layer `li` is a short-conv (recurrent) layer.
    pub fn is_conv(&self, li: usize) -> bool {
        self.shortconv.as_ref().is_some_and(|s| s.is_conv[li])
    }

    /// Layers that keep K/V in the paged cache (all but the short-conv ones).
    pub fn n_kv_layers(&self) -> usize {
        self.n_layer - self.shortconv.as_ref().map_or(0, ShortConv::n_conv_layers)
    }

    /// Per layer, its index among the K/V layers (the short-conv layers have none).
    pub fn kv_layer_index(&self) -> Vec<Option<usize>> {
        let mut next = 0;
        (0..self.n_layer)
            .map(|li| {
                (!self.is_conv(li)).then(|| {
                    next += 1;
                    next - 1
                })
            })
            .collect()
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
            rope: Rope {
                n_rot,
                neox,
                freq_base,
                scaling,
                freq_factors: None,
            },
            shortconv,
        })
    }
}

/// LFM2's layer pattern as llama.cpp reads it: `head_count_kv` is an array with one entry per
/// layer (0 marks a short-conv layer) or one number for every layer; `shortconv.l_cache` is the
/// conv kernel length. Returns the attention layers' KV head count (they must agree) and the
/// pattern. A sliding window on the attention layers (`attention.sliding_window`) is not
/// supported yet.
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
    if g.get_u64(&format!("{a}.attention.sliding_window"))?
        .is_some_and(|w| w > 0)
    {
        return Err(Error::Unsupported(
            "lfm2 with a sliding window on its attention layers is not supported yet".into(),
        ));
    }
    let is_conv = per_layer.iter().map(|&n| n == 0).collect();
    Ok((n_head_kv, Some(ShortConv { l_cache, is_conv })))
}
