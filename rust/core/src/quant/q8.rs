//! Activation formats: each token's row of f32 activations is converted once into the format
//! the weight type's dot product consumes, and the result is reused by every matmul that shares
//! the input (Q, K, V).
//!
//! - Legacy weights (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0): blocks of 32 int8 `qa` with f32 scale
//!   `da = amax / 127` and `sa = da * sum(qa)` (like ggml's Q8_1 but with f32 scales). Values
//!   round to nearest, ties away from zero. Stored contiguously per token. When a tile kernel
//!   will be used (AVX-512 VNNI, see `Pack`), a second "packed" copy interleaves the tokens:
//!   for every block and every 4-element group, 4 tokens x 4 bytes in one 16-byte line (2 to 4
//!   tokens), 8 tokens x 4 bytes in one 32-byte line (5 to 32 tokens, groups of 8) or 16
//!   tokens x 4 bytes in one 64-byte line (wide, 33 tokens and more: prefill).
//! - K-quant weights: Q8_K blocks of 256 per token.
//! - Float weights: a plain f32 copy.

use super::kquants::{self, BlockQ8K, QK_K};
use super::legacy::QK;
use super::simd::{self, SimdLevel};
use super::types::GgmlType;
use crate::error::{invalid, Error, Result};

/// Tokens interleaved in one wide packed group.
pub(crate) const GROUP: usize = 16;
/// Tokens of a group of the 4-lane (one group) and the 8-lane narrow packings.
pub(crate) const NARROW4: usize = 4;
pub(crate) const NARROW8: usize = 8;
/// The narrow packings are built from this many tokens on (one token takes the per-row
/// kernel, which streams a row once for it anyway).
pub(crate) const NARROW_MIN_TOKENS: usize = 2;
/// The wide packing is built from this many tokens on (below, the narrow tiles waste fewer
/// lanes and stream the weights better). All paths give bit-identical results.
pub(crate) const PACK_MIN_TOKENS: usize = NARROW8_MAX + 1;
/// Most tokens of the 8-lane narrow packing, in groups of 8 (decode of 9 to 32 sequences:
/// one step took 6-15% less CPU time than with the 16-lane wide tile).
pub(crate) const NARROW8_MAX: usize = 32;

/// Which interleaved copy of Q8 activations is built next to the token-major one, and so
/// which kernel the matmul runs (AVX-512 VNNI only): none (per-row kernels), narrow with 4
/// lanes (16-byte lines, 2 to 4 tokens), narrow with 8 lanes (32-byte lines, groups of 8: 5
/// to `NARROW8_MAX` tokens) or
/// wide (groups of 16, 64-byte lines, from `PACK_MIN_TOKENS` tokens).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pack {
    None,
    Narrow4,
    Narrow8,
    Wide,
}

impl Pack {
    /// The packing the engine builds for `n_tokens` tokens at `level`.
    pub(crate) fn for_tokens(n_tokens: usize, level: SimdLevel) -> Pack {
        if level < SimdLevel::Avx512Vnni || n_tokens < NARROW_MIN_TOKENS {
            Pack::None
        } else if n_tokens <= NARROW4 {
            Pack::Narrow4
        } else if n_tokens < PACK_MIN_TOKENS {
            Pack::Narrow8
        } else {
            Pack::Wide
        }
    }
}

/// 64 activation bytes aligned to a cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Line(pub [i8; 64]);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ActKind {
    Q8,
    Q8K,
    F32,
}

/// `n_tokens` rows of `cols` activations, quantized for one family of weight types.
pub struct QuantizedActs {
    pub(crate) kind: ActKind,
    pub(crate) n_tokens: usize,
    pub(crate) cols: usize,
    /// Q8: `n_tokens * cols` quants, token-major.
    pub(crate) qs: Vec<i8>,
    /// Q8: per block the pair `(da, sa = da * sum(qa))`, interleaved: `2 * n_tokens * cols / 32`.
    pub(crate) ds: Vec<f32>,
    /// Which packed copy `packed`, `pd` and `ps` hold.
    pub(crate) pack: Pack,
    /// Q8 packed copy (empty when not built). Wide: line `(g * nb + b) * 8 + k` holds bytes
    /// `4k..4k+4` of block `b` for tokens `16g..16g+16` (zero for padding tokens). Narrow with
    /// `L` = 8 or 4 lanes: the `4L`-byte line `(g * nb + b) * 8 + k` (`16 / L` per `Line`)
    /// holds bytes `4k..4k+4` of block `b` for tokens `Lg..Lg+L` (zero for padding tokens).
    ///
    /// Q8_K (wide only): per group `g` of 16 tokens and block `b` of 256, [`K_LINES`] lines from
    /// `(g * nb + b) * K_LINES`: line `k < 64` holds quants `4k..4k+4` of each token as unsigned
    /// bytes `q + 128` (the tile kernel's `vpdpbusd` operand; padding tokens 128), line `64 + i`
    /// holds for each token the i16 pair (sum of sub-block `2i`, sum of sub-block `2i + 1`),
    /// sub-blocks being 32 quants; `pd` holds each token's `d`.
    pub(crate) packed: Vec<Line>,
    /// Packed scales: `(g * nb + b) * 16 + lane` (wide), `(g * nb + b) * L + lane` (narrow).
    pub(crate) pd: Vec<f32>,
    pub(crate) ps: Vec<f32>,
    /// Q8_K: `n_tokens * cols / 256` blocks.
    pub(crate) k: Vec<BlockQ8K>,
    /// F32: `n_tokens * cols` values.
    pub(crate) f: Vec<f32>,
    /// Where the groups go while [`QuantizedActs::prepare_wide_q8`]'s layout is being filled
    /// by parallel tasks (None otherwise).
    pub(crate) wide: Option<WideQ8>,
}

impl Default for QuantizedActs {
    fn default() -> Self {
        QuantizedActs {
            kind: ActKind::F32,
            n_tokens: 0,
            cols: 0,
            qs: Vec::new(),
            ds: Vec::new(),
            pack: Pack::None,
            packed: Vec::new(),
            pd: Vec::new(),
            ps: Vec::new(),
            k: Vec::new(),
            f: Vec::new(),
            wide: None,
        }
    }
}

impl QuantizedActs {
    /// An empty buffer, to be filled by [`quantize_acts_into`].
    pub fn new() -> Self {
        Self::default()
    }

    pub fn n_tokens(&self) -> usize {
        self.n_tokens
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Whether these activations can be multiplied with weights of type `ty`.
    pub fn serves(&self, ty: GgmlType) -> bool {
        act_kind(ty) == Some(self.kind)
    }

    /// Lays these out for `n_tokens` rows of `cols` activations in the Q8 format of weights of
    /// type `for_type`, packed wide, without computing them: then each group of 16 tokens is
    /// filled by [`WideQ8::fill_group`] (from [`Self::wide`]), by as many tasks as groups, in
    /// any order or in parallel; the result is what [`quantize_acts_impl`] with `Pack::Wide`
    /// gives. The buffers keep their old contents where they do not grow (every byte the
    /// groups own is rewritten, padding lanes included), so no memset per call.
    ///
    /// Without `pack` the groups are quantized only (token-major `qs` and `ds`, `Pack::None`):
    /// for weights that all take the interleaved copy (`x16`), which reads nothing else.
    pub(crate) fn prepare_wide_q8(
        &mut self,
        n_tokens: usize,
        cols: usize,
        for_type: GgmlType,
        pack: bool,
    ) -> Result<()> {
        if act_kind(for_type) != Some(ActKind::Q8) || !cols.is_multiple_of(QK) || n_tokens == 0 {
            return Err(invalid(format!(
                "no wide Q8 layout for {n_tokens} tokens x {cols} columns of {}",
                for_type.name()
            )));
        }
        let nb = cols / QK;
        let groups = n_tokens.div_ceil(GROUP);
        self.kind = ActKind::Q8;
        self.n_tokens = n_tokens;
        self.cols = cols;
        self.pack = if pack { Pack::Wide } else { Pack::None };
        self.qs.resize(n_tokens * cols, 0);
        self.ds.resize(2 * n_tokens * nb, 0.0);
        let packs = if pack { groups } else { 0 };
        self.packed.resize(packs * nb * 8, Line([0; 64]));
        self.pd.resize(packs * nb * GROUP, 0.0);
        self.ps.resize(packs * nb * GROUP, 0.0);
        self.wide = Some(WideQ8 {
            qs: self.qs.as_mut_ptr(),
            ds: self.ds.as_mut_ptr(),
            packed: self.packed.as_mut_ptr(),
            pd: self.pd.as_mut_ptr(),
            ps: self.ps.as_mut_ptr(),
            n_tokens,
            cols,
            pack,
        });
        Ok(())
    }

    /// Whether a packed copy was built (either width).
    #[cfg(test)]
    pub(crate) fn has_packed(&self) -> bool {
        self.pack != Pack::None
    }
}

/// The buffers of a [`QuantizedActs`] laid out by [`QuantizedActs::prepare_wide_q8`], as raw
/// pointers, so that tasks on several threads can each fill their own groups of 16 tokens
/// (no `&mut` to the whole buffers exists meanwhile). Valid until the buffers are touched
/// again: the next `prepare_wide_q8` or `quantize_acts_into` replaces or clears it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WideQ8 {
    qs: *mut i8,
    ds: *mut f32,
    packed: *mut Line,
    pd: *mut f32,
    ps: *mut f32,
    n_tokens: usize,
    cols: usize,
    /// Whether the groups are packed too (else the packed buffers are empty).
    pack: bool,
}

// SAFETY: the pointers are only dereferenced by `fill_group`, whose callers guarantee that the
// buffers live and that no two threads fill the same group (the groups' regions are disjoint).
unsafe impl Send for WideQ8 {}
// SAFETY: as above; `&WideQ8` only copies the pointers.
unsafe impl Sync for WideQ8 {}

impl WideQ8 {
    /// Groups of 16 tokens to fill.
    pub(crate) fn groups(&self) -> usize {
        self.n_tokens.div_ceil(GROUP)
    }

    /// Quantizes tokens `16g..16g+16` of `x` (`n_tokens * cols` values, token-major) and packs
    /// their group (when laid out to), at SIMD level `level` (every level gives the same bits).
    ///
    /// # Safety
    /// The `QuantizedActs` this came from is alive and its buffers untouched since
    /// `prepare_wide_q8`; no other thread fills group `g` or reads the buffers meanwhile.
    /// Panics if `g` is not a group or `x` has the wrong length.
    pub(crate) unsafe fn fill_group(&self, x: &[f32], g: usize, level: SimdLevel) {
        let (n, cols) = (self.n_tokens, self.cols);
        assert!(
            g < self.groups() && x.len() == n * cols,
            "fill_group {g} of {n} x {cols}"
        );
        let nb = cols / QK;
        let t0 = g * GROUP;
        let lanes = (n - t0).min(GROUP);
        // SAFETY: the regions of group g in the buffers `prepare_wide_q8` sized (qs: its tokens'
        // rows; ds: their blocks' pairs) lie inside them and belong to this call alone
        // (contract).
        let (qs, ds) = unsafe {
            (
                std::slice::from_raw_parts_mut(self.qs.add(t0 * cols), lanes * cols),
                std::slice::from_raw_parts_mut(self.ds.add(2 * t0 * nb), 2 * lanes * nb),
            )
        };
        quantize_blocks(&x[t0 * cols..(t0 + lanes) * cols], qs, ds, level);
        if !self.pack {
            return;
        }
        // SAFETY: as above, for the group's blocks in packed, pd and ps (sized when `pack`).
        let (packed, pd, ps) = unsafe {
            (
                std::slice::from_raw_parts_mut(self.packed.add(g * nb * 8), nb * 8),
                std::slice::from_raw_parts_mut(self.pd.add(g * nb * GROUP), nb * GROUP),
                std::slice::from_raw_parts_mut(self.ps.add(g * nb * GROUP), nb * GROUP),
            )
        };
        pack_group(qs, ds, lanes, nb, packed, pd, ps);
    }
}

pub(crate) fn act_kind(ty: GgmlType) -> Option<ActKind> {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => {
            Some(ActKind::Q8)
        }
        GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => Some(ActKind::Q8K),
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => Some(ActKind::F32),
        _ => None,
    }
}

/// Number of distinct activation formats (8-bit blocks of 32, Q8_K, plain f32).
pub const N_ACT_FORMATS: usize = 3;

/// Index in `0..N_ACT_FORMATS` of the activation format that serves weights of `ty`, so that
/// callers can keep one quantized copy of an input per format.
pub fn act_format_index(ty: GgmlType) -> usize {
    match act_kind(ty) {
        Some(ActKind::Q8) => 0,
        Some(ActKind::Q8K) => 1,
        _ => 2,
    }
}

/// Quantizes one block of 32 values (`d = amax / 127`, `q = round(x / d)`); returns
/// `(da, sa)`.
#[inline]
pub(crate) fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, f32) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (o, &v) in q.iter_mut().zip(x) {
        // Nearest, ties to even (what the SIMD conversion does); saturating cast, NaN -> 0.
        let r = (v * id).round_ties_even() as i8;
        *o = r;
        sum += r as i32;
    }
    (d, d * sum as f32)
}

/// Quantizes `x` (`n_tokens * cols` values, token-major) for weights of type `for_type`.
///
/// # Panics
/// If the shapes are inconsistent or the type is unsupported; use [`try_quantize_acts`] for a
/// `Result`.
pub fn quantize_acts(x: &[f32], n_tokens: usize, cols: usize, for_type: GgmlType) -> QuantizedActs {
    let mut a = QuantizedActs::new();
    if let Err(e) = quantize_acts_into(&mut a, x, n_tokens, cols, for_type) {
        panic!("quantize_acts: {e}");
    }
    a
}

/// Like [`quantize_acts`] but returns an error for bad shapes or unsupported types.
pub fn try_quantize_acts(
    x: &[f32],
    n_tokens: usize,
    cols: usize,
    for_type: GgmlType,
) -> Result<QuantizedActs> {
    let mut a = QuantizedActs::new();
    quantize_acts_into(&mut a, x, n_tokens, cols, for_type)?;
    Ok(a)
}

/// Quantizes into an existing buffer, reusing its allocations.
pub fn quantize_acts_into(
    a: &mut QuantizedActs,
    x: &[f32],
    n_tokens: usize,
    cols: usize,
    for_type: GgmlType,
) -> Result<()> {
    let pack = Pack::for_tokens(n_tokens, simd::level());
    quantize_acts_impl(a, x, n_tokens, cols, for_type, pack)
}

pub(crate) fn quantize_acts_impl(
    a: &mut QuantizedActs,
    x: &[f32],
    n_tokens: usize,
    cols: usize,
    for_type: GgmlType,
    pack: Pack,
) -> Result<()> {
    let level = simd::level();
    let kind = act_kind(for_type).ok_or_else(|| {
        Error::Unsupported(format!(
            "no kernels for weight type {}; supported types are {}",
            for_type.name(),
            GgmlType::supported_list()
        ))
    })?;
    if n_tokens.checked_mul(cols) != Some(x.len()) {
        return Err(invalid(format!(
            "activations have {} values, expected {n_tokens} tokens x {cols} columns",
            x.len()
        )));
    }
    let bs = for_type.block_size();
    if !cols.is_multiple_of(bs) {
        return Err(invalid(format!(
            "{} weights need a multiple of {bs} columns, got {cols}",
            for_type.name()
        )));
    }
    a.kind = kind;
    a.n_tokens = n_tokens;
    a.cols = cols;
    a.wide = None;
    a.pack = Pack::None;
    a.packed.clear();
    a.pd.clear();
    a.ps.clear();
    match kind {
        ActKind::F32 => {
            a.f.clear();
            a.f.extend_from_slice(x);
        }
        ActKind::Q8K => {
            let nb = cols / QK_K;
            let zero = BlockQ8K {
                d: 0.0,
                qs: [0; QK_K],
                bsums: [0; 16],
            };
            // Every block is written below: `resize` (not `clear` first) zero-fills only
            // growth, instead of the whole buffer on every call.
            a.k.resize(n_tokens * nb, zero);
            for t in 0..n_tokens {
                kquants::quantize_row_q8_k(
                    &x[t * cols..(t + 1) * cols],
                    &mut a.k[t * nb..(t + 1) * nb],
                );
            }
            if pack == Pack::Wide && n_tokens > 0 {
                pack_q8k(a);
            }
        }
        ActKind::Q8 => {
            let nb = cols / QK;
            // As for Q8K: `quantize_blocks` writes every element.
            a.qs.resize(n_tokens * cols, 0);
            a.ds.resize(2 * n_tokens * nb, 0.0);
            quantize_blocks(x, &mut a.qs, &mut a.ds, level);
            match pack {
                Pack::Wide if n_tokens > 0 => pack_q8(a),
                // More tokens than a narrow layout takes (callers that force a packing in
                // tests get the per-row path instead).
                Pack::Narrow4 if n_tokens <= NARROW4 && n_tokens > 0 => {
                    pack_q8_narrow::<NARROW4>(a, Pack::Narrow4)
                }
                Pack::Narrow8 if n_tokens <= NARROW8_MAX && n_tokens > 0 => {
                    pack_q8_narrow::<NARROW8>(a, Pack::Narrow8)
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// Lowest level of each SIMD kernel of [`quantize_blocks`] (see `simd::coverage`).
#[cfg(test)]
pub(crate) const QUANTIZE_BLOCKS_KERNELS: [SimdLevel; 2] = [SimdLevel::Neon, SimdLevel::Avx2];

/// Quantizes consecutive blocks of `x` into `qs`, `d`, `s` with the kernels of `level`.
/// `ds` receives `(da, sa)` per block.
pub(crate) fn quantize_blocks(x: &[f32], qs: &mut [i8], ds: &mut [f32], level: SimdLevel) {
    assert!(qs.len() == x.len() && ds.len() * QK == 2 * x.len());
    #[cfg(target_arch = "x86_64")]
    if level >= SimdLevel::Avx2 {
        for (i, (xb, qb)) in x.chunks_exact(QK).zip(qs.chunks_exact_mut(QK)).enumerate() {
            // SAFETY: AVX2 was detected (level never exceeds detection); both blocks hold 32.
            (ds[2 * i], ds[2 * i + 1]) =
                unsafe { x86::quantize_block_avx2(xb.as_ptr(), qb.as_mut_ptr()) };
        }
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if level >= SimdLevel::Neon {
        for ((xb, qb), p) in x
            .chunks_exact(QK)
            .zip(qs.chunks_exact_mut(QK))
            .zip(ds.chunks_exact_mut(2))
        {
            // SAFETY: NEON was detected (`level` >= Neon never exceeds detection).
            (p[0], p[1]) = unsafe { super::neon::quantize_block(xb, qb) };
        }
        return;
    }
    let _ = level;
    for ((xb, qb), p) in x
        .chunks_exact(QK)
        .zip(qs.chunks_exact_mut(QK))
        .zip(ds.chunks_exact_mut(2))
    {
        (p[0], p[1]) = quantize_block(xb, qb);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// AVX2 twin of `quantize_block` (identical results for finite input: `cvtps2dq` rounds
    /// to nearest even like `round_ties_even`).
    ///
    /// # Safety
    /// AVX2 available; `x` readable and `q` writable for 32 elements.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn quantize_block_avx2(x: *const f32, q: *mut i8) -> (f32, f32) {
        // SAFETY: 32 elements at x and q (caller).
        unsafe {
            let v = [
                _mm256_loadu_ps(x),
                _mm256_loadu_ps(x.add(8)),
                _mm256_loadu_ps(x.add(16)),
                _mm256_loadu_ps(x.add(24)),
            ];
            let absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
            let m01 = _mm256_max_ps(_mm256_and_ps(v[0], absm), _mm256_and_ps(v[1], absm));
            let m23 = _mm256_max_ps(_mm256_and_ps(v[2], absm), _mm256_and_ps(v[3], absm));
            let m = _mm256_max_ps(m01, m23);
            let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let m1 = _mm_max_ss(m2, _mm_movehdup_ps(m2));
            let amax = _mm_cvtss_f32(m1);
            let d = amax / 127.0;
            let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
            let i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], id));
            let i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], id));
            let i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], id));
            let i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], id));
            let sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
            let s4 = _mm_add_epi32(
                _mm256_castsi256_si128(sum),
                _mm256_extracti128_si256::<1>(sum),
            );
            let s2 = _mm_add_epi32(s4, _mm_shuffle_epi32::<0x4E>(s4));
            let s1 = _mm_add_epi32(s2, _mm_shuffle_epi32::<0xB1>(s2));
            let isum = _mm_cvtsi128_si32(s1);
            let p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
            let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(q.cast(), p);
            (d, d * isum as f32)
        }
    }
}

/// Builds the `L`-lane interleaved copy of Q8 activations, in groups of `L` tokens (see
/// [`QuantizedActs::packed`]).
fn pack_q8_narrow<const L: usize>(a: &mut QuantizedActs, kind: Pack) {
    let (n, cols) = (a.n_tokens, a.cols);
    debug_assert!(64 % (4 * L) == 0);
    let nb = cols / QK;
    let line = 4 * L;
    // 8 lines of 4L bytes per block and group of L tokens.
    let per_block = 8 * line / 64;
    let groups = n.div_ceil(L);
    a.packed.resize(groups * nb * per_block, Line([0; 64]));
    a.pd.resize(groups * nb * L, 0.0);
    a.ps.resize(groups * nb * L, 0.0);
    for (gb, blk) in a.packed.chunks_exact_mut(per_block).enumerate() {
        let (g, b) = (gb / nb, gb % nb);
        for lane in 0..(n - g * L).min(L) {
            let t = g * L + lane;
            let off = t * cols + b * QK;
            let src = &a.qs[off..off + QK];
            for k in 0..8 {
                let at = k * line + 4 * lane;
                let dst = &mut blk[at / 64].0[at % 64..at % 64 + 4];
                dst.copy_from_slice(&src[4 * k..4 * k + 4]);
            }
            a.pd[gb * L + lane] = a.ds[2 * (t * nb + b)];
            a.ps[gb * L + lane] = a.ds[2 * (t * nb + b) + 1];
        }
    }
    a.pack = kind;
}

/// Lines per Q8_K block and group of 16 tokens in the wide packed copy: 64 lines of quants, 4
/// of sub-block sums (see [`QuantizedActs::packed`]).
pub(crate) const K_LINES: usize = 68;

/// Builds the 16-token interleaved copy of Q8_K activations (see [`QuantizedActs::packed`]).
fn pack_q8k(a: &mut QuantizedActs) {
    let (n, nb) = (a.n_tokens, a.cols / QK_K);
    let groups = n.div_ceil(GROUP);
    // Padding tokens: quants 0 (stored as 0x80), sums 0, d 0.
    let mut pad = Line([-128; 64]);
    a.packed.resize(groups * nb * K_LINES, pad);
    for gb in 0..groups * nb {
        pad.0 = [0; 64];
        a.packed[gb * K_LINES + 64..(gb + 1) * K_LINES].fill(pad);
    }
    a.pd.resize(groups * nb * GROUP, 0.0);
    for g in 0..groups {
        for lane in 0..(n - g * GROUP).min(GROUP) {
            let t = g * GROUP + lane;
            for b in 0..nb {
                let gb = g * nb + b;
                let blk = &a.k[t * nb + b];
                let lines = &mut a.packed[gb * K_LINES..(gb + 1) * K_LINES];
                for (k, line) in lines[..64].iter_mut().enumerate() {
                    for i in 0..4 {
                        // Stored as the unsigned byte q + 128 (see the field docs).
                        line.0[4 * lane + i] = blk.qs[4 * k + i] ^ -128;
                    }
                }
                for (i, line) in lines[64..].iter_mut().enumerate() {
                    let s = |s: usize| blk.bsums[2 * s] as i32 + blk.bsums[2 * s + 1] as i32;
                    // |sum of 32 quants| <= 32 * 128: an exact i16.
                    let pair = [s(2 * i) as i16, s(2 * i + 1) as i16];
                    for (j, v) in pair.iter().enumerate() {
                        let at = 4 * lane + 2 * j;
                        let bytes = v.to_le_bytes();
                        line.0[at] = bytes[0] as i8;
                        line.0[at + 1] = bytes[1] as i8;
                    }
                }
                a.pd[gb * GROUP + lane] = blk.d;
            }
        }
    }
    a.pack = Pack::Wide;
}

/// Builds the 16-token interleaved copy of Q8 activations (see [`QuantizedActs::packed`]).
fn pack_q8(a: &mut QuantizedActs) {
    let (n, cols) = (a.n_tokens, a.cols);
    let nb = cols / QK;
    let groups = n.div_ceil(GROUP);
    a.packed.resize(groups * nb * 8, Line([0; 64]));
    a.pd.resize(groups * nb * GROUP, 0.0);
    a.ps.resize(groups * nb * GROUP, 0.0);
    for g in 0..groups {
        let (t0, lanes) = (g * GROUP, (n - g * GROUP).min(GROUP));
        pack_group(
            &a.qs[t0 * cols..(t0 + lanes) * cols],
            &a.ds[2 * t0 * nb..2 * (t0 + lanes) * nb],
            lanes,
            nb,
            &mut a.packed[g * nb * 8..(g + 1) * nb * 8],
            &mut a.pd[g * nb * GROUP..(g + 1) * nb * GROUP],
            &mut a.ps[g * nb * GROUP..(g + 1) * nb * GROUP],
        );
    }
    a.pack = Pack::Wide;
}

/// Packs one group of `lanes` (at most 16) tokens, their quants `qs` (token-major, `nb`
/// blocks each) and block pairs `ds`, into the group's `nb * 8` lines and `nb * 16` scales
/// (layout of [`QuantizedActs::packed`]); the padding lanes get zeros.
fn pack_group(
    qs: &[i8],
    ds: &[f32],
    lanes: usize,
    nb: usize,
    packed: &mut [Line],
    pd: &mut [f32],
    ps: &mut [f32],
) {
    let cols = nb * QK;
    for b in 0..nb {
        let lines = &mut packed[b * 8..b * 8 + 8];
        for lane in 0..lanes {
            let off = lane * cols + b * QK;
            let src: &[i8; 32] = qs[off..off + QK].try_into().expect("32-byte block");
            for (k, line) in lines.iter_mut().enumerate() {
                line.0[4 * lane..4 * lane + 4].copy_from_slice(&src[4 * k..4 * k + 4]);
            }
        }
        for line in lines.iter_mut() {
            line.0[4 * lanes..].fill(0);
        }
        for lane in 0..GROUP {
            let (d, s) = if lane < lanes {
                (ds[2 * (lane * nb + b)], ds[2 * (lane * nb + b) + 1])
            } else {
                (0.0, 0.0)
            };
            pd[b * GROUP + lane] = d;
            ps[b * GROUP + lane] = s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantize_block_known_values() {
        let mut x = [0f32; 32];
        for (j, v) in x.iter_mut().enumerate() {
            *v = (j as f32 - 16.0) / 16.0 * 2.54; // amax = 2.54 at j = 0 -> d = 0.02
        }
        let mut q = [0i8; 32];
        let (d, s) = quantize_block(&x, &mut q);
        assert!((d - 0.02).abs() < 1e-7);
        assert_eq!(q[0], -127);
        assert_eq!(q[16], 0);
        for j in 0..32 {
            assert!((q[j] as f32 * d - x[j]).abs() <= d / 2.0 + 1e-6);
        }
        let sum: i32 = q.iter().map(|&v| v as i32).sum();
        assert!((s - d * sum as f32).abs() < 1e-6);
        // All-zero block: d = 0, quants 0.
        let (d, s) = quantize_block(&[0.0; 32], &mut q);
        assert_eq!((d, s), (0.0, 0.0));
        assert!(q.iter().all(|&v| v == 0));
    }

    /// The wide layout filled group by group (`prepare_wide_q8` + `fill_group`, in reverse
    /// order, over buffers that held a larger, different input before) is byte for byte the
    /// one `quantize_acts_impl` builds, padding lanes included, at every SIMD level.
    #[test]
    fn wide_layout_by_groups_matches_whole() {
        let ty = GgmlType::Q4_1;
        let mut a = QuantizedActs::new();
        let junk: Vec<f32> = (0..100 * 576)
            .map(|i| ((i * 13 % 97) as f32) - 48.0)
            .collect();
        a.prepare_wide_q8(100, 576, ty, true).unwrap();
        let fill = a.wide.unwrap();
        for g in 0..fill.groups() {
            // SAFETY: `a` is alive and untouched since prepare; one group at a time.
            unsafe { fill.fill_group(&junk, g, simd::level()) };
        }
        for (n, cols) in [
            (17usize, 64usize),
            (32, 576),
            (33, 576),
            (100, 576),
            (5, 64),
        ] {
            let x: Vec<f32> = (0..n * cols)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                .collect();
            for level in [SimdLevel::Scalar, simd::level()] {
                let mut want = QuantizedActs::new();
                quantize_acts_impl(&mut want, &x, n, cols, ty, Pack::Wide).unwrap();
                // Quantized only (for weights that take the interleaved copy): the same
                // token-major quants and scales, nothing packed.
                a.prepare_wide_q8(n, cols, ty, false).unwrap();
                let fill = a.wide.unwrap();
                for g in 0..fill.groups() {
                    // SAFETY: as above.
                    unsafe { fill.fill_group(&x, g, level) };
                }
                assert_eq!(a.pack, Pack::None);
                assert!(a.packed.is_empty() && a.pd.is_empty() && a.ps.is_empty());
                assert_eq!(
                    (&a.qs, &a.ds),
                    (&want.qs, &want.ds),
                    "{n} x {cols} unpacked"
                );
                a.prepare_wide_q8(n, cols, ty, true).unwrap();
                let fill = a.wide.unwrap();
                assert_eq!(fill.groups(), n.div_ceil(GROUP));
                for g in (0..fill.groups()).rev() {
                    // SAFETY: as above.
                    unsafe { fill.fill_group(&x, g, level) };
                }
                assert_eq!(
                    (a.n_tokens, a.cols, a.kind, a.pack),
                    (n, cols, ActKind::Q8, Pack::Wide)
                );
                assert_eq!(a.qs, want.qs, "{n} x {cols}");
                assert_eq!(a.ds, want.ds);
                assert_eq!(a.pd, want.pd);
                assert_eq!(a.ps, want.ps);
                let bytes = |v: &[Line]| v.iter().flat_map(|l| l.0).collect::<Vec<i8>>();
                assert_eq!(bytes(&a.packed), bytes(&want.packed), "{n} x {cols}");
            }
        }
        assert!(a.prepare_wide_q8(16, 48, ty, true).is_err());
        assert!(a.prepare_wide_q8(16, 64, GgmlType::Q4_K, true).is_err());
        assert!(a.prepare_wide_q8(0, 64, ty, true).is_err());
        quantize_acts_impl(&mut a, &[0.0; 64], 1, 64, ty, Pack::None).unwrap();
        assert!(a.wide.is_none());
    }

    #[test]
    fn packed_layout_matches_token_major() {
        let (n, cols) = (19, 64);
        let x: Vec<f32> = (0..n * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let mut a = QuantizedActs::new();
        quantize_acts_impl(&mut a, &x, n, cols, GgmlType::Q4_1, Pack::Wide).unwrap();
        let nb = cols / 32;
        assert_eq!(a.packed.len(), 2 * nb * 8);
        for t in 0..32 {
            let (g, lane) = (t / 16, t % 16);
            for b in 0..nb {
                for e in 0..32 {
                    let got = a.packed[(g * nb + b) * 8 + e / 4].0[4 * lane + e % 4];
                    let want = if t < n {
                        a.qs[t * cols + b * 32 + e]
                    } else {
                        0
                    };
                    assert_eq!(got, want);
                }
                let want_d = if t < n { a.ds[2 * (t * nb + b)] } else { 0.0 };
                assert_eq!(a.pd[(g * nb + b) * 16 + lane], want_d);
            }
        }
    }

    #[test]
    fn narrow_layouts_match_token_major() {
        let cols = 96;
        let nb = cols / 32;
        for (pack, lanes, most) in [
            (Pack::Narrow4, NARROW4, NARROW4),
            (Pack::Narrow8, NARROW8, NARROW8_MAX),
        ] {
            for n in (1..=lanes).chain([lanes + 1, 2 * lanes + 3, most]) {
                if n > most {
                    continue;
                }
                let x: Vec<f32> = (0..n * cols)
                    .map(|i| ((i * 53 % 97) as f32 - 48.0) / 5.0)
                    .collect();
                let mut a = QuantizedActs::new();
                quantize_acts_impl(&mut a, &x, n, cols, GgmlType::Q5_1, pack).unwrap();
                assert_eq!(a.pack, pack);
                let groups = n.div_ceil(lanes);
                let bytes: Vec<i8> = a.packed.iter().flat_map(|l| l.0).collect();
                assert_eq!(bytes.len(), groups * nb * 8 * 4 * lanes);
                for t in 0..groups * lanes {
                    let (g, lane) = (t / lanes, t % lanes);
                    for b in 0..nb {
                        let gb = g * nb + b;
                        for e in 0..32 {
                            let got = bytes[(gb * 8 + e / 4) * 4 * lanes + 4 * lane + e % 4];
                            let want = if t < n {
                                a.qs[t * cols + b * 32 + e]
                            } else {
                                0
                            };
                            assert_eq!(got, want, "{pack:?} n={n} t={t} b={b} e={e}");
                        }
                        let (d, s) = if t < n {
                            (a.ds[2 * (t * nb + b)], a.ds[2 * (t * nb + b) + 1])
                        } else {
                            (0.0, 0.0)
                        };
                        assert_eq!((a.pd[gb * lanes + lane], a.ps[gb * lanes + lane]), (d, s));
                    }
                }
            }
            // More tokens than the layout takes: no packed copy (the per-row path takes them).
            let x = vec![1.0f32; (most + 1) * cols];
            let mut a = QuantizedActs::new();
            quantize_acts_impl(&mut a, &x, most + 1, cols, GgmlType::Q4_0, pack).unwrap();
            assert_eq!(a.pack, Pack::None);
        }
    }

    /// Which packing (so which matmul kernel) the engine builds by token count.
    #[test]
    fn engine_packing_by_token_count() {
        let level = SimdLevel::Avx512Vnni;
        for n in 0..=40 {
            let want = match n {
                0 | 1 => Pack::None,
                2..=4 => Pack::Narrow4,
                5..=32 => Pack::Narrow8,
                _ => Pack::Wide,
            };
            assert_eq!(Pack::for_tokens(n, level), want, "n={n}");
            assert_eq!(Pack::for_tokens(n, SimdLevel::Avx512), Pack::None);
        }
    }

    #[test]
    fn simd_quantize_matches_scalar() {
        let mut seed = 99u64;
        let x: Vec<f32> = (0..32 * 40)
            .map(|i| {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let v = ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0;
                if i % 97 == 0 {
                    0.0
                } else {
                    v
                }
            })
            .collect();
        let mut x = x;
        x[32..64].fill(0.0); // an all-zero block
        let nb = x.len() / 32;
        let (mut q0, mut ds0) = (vec![0i8; x.len()], vec![0f32; 2 * nb]);
        quantize_blocks(&x, &mut q0, &mut ds0, SimdLevel::Scalar);
        let kernels = simd::coverage::simd_kernels(&QUANTIZE_BLOCKS_KERNELS);
        for &level in &kernels {
            let (mut q, mut ds) = (vec![0i8; x.len()], vec![0f32; 2 * nb]);
            quantize_blocks(&x, &mut q, &mut ds, level);
            assert_eq!(q, q0, "{}", level.name());
            assert_eq!(ds, ds0);
        }
        simd::coverage::report(
            "q8 activation quantization",
            &QUANTIZE_BLOCKS_KERNELS,
            &kernels,
        );
    }

    #[test]
    fn bad_shapes_are_errors() {
        assert!(try_quantize_acts(&[0.0; 10], 1, 10, GgmlType::Q4_1).is_err());
        assert!(try_quantize_acts(&[0.0; 64], 2, 64, GgmlType::Q4_1).is_err());
        assert!(try_quantize_acts(&[0.0; 32], 1, 32, GgmlType::IQ2_XS).is_err());
        assert!(try_quantize_acts(&[0.0; 32], 1, 32, GgmlType::Q8_0).is_ok());
    }
}
