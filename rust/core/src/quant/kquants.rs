//! ggml K-quant super-block formats Q4_K, Q5_K, Q6_K and the Q8_K activation format:
//! dequantization to f32, Q8_K activation quantization, and integer dot products of one weight
//! row against Q8_K activations.
//!
//! Guarantees: the block layouts are bit-compatible with ggml/GGUF (verified against the `gguf`
//! Python package in tests); dequantization reproduces ggml's f32 values exactly; every SIMD
//! kernel computes the same per-block integer sums as the scalar reference; the AVX-512 and NEON
//! kernels (and the prefill tile of `quant::ktile`) also follow its f32 order and return its
//! bits, the AVX2 ones differ by f32 accumulation order only; a SIMD level the running CPU lacks
//! is never executed, whatever level the caller passes.
//!
//! Layouts (256 weights per super-block, split into sub-blocks):
//! - Q4_K (144 bytes): f16 `d`, f16 `dmin`, 12 bytes of packed 6-bit scales/mins for eight
//!   32-weight sub-blocks, 128 bytes of nibbles. Weight = `d*sc*q - dmin*m`, `q` in 0..16.
//!   Nibble byte `l` of 32-byte chunk `j` holds sub-block `2j` (low) and `2j+1` (high).
//! - Q5_K (176 bytes): as Q4_K plus 32 bytes `qh`; bit `i` of `qh[l]` is the fifth bit of
//!   element `l` of sub-block `i`. `q` in 0..32.
//! - Q6_K (210 bytes): 128 bytes `ql` (low nibbles), 64 bytes `qh` (2-bit high parts), 16 i8
//!   scales (one per 16 weights), f16 `d` last. Weight = `d*sc*(q-32)`, `q` in 0..64.
//! - Q8_K: f32 `d`, 256 i8 quants, 16 i16 sums of 16-element groups (`bsums`).

use half::f16;

use super::simd::SimdLevel;

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;
/// Bytes per Q4_K block.
pub const Q4_K_BYTES: usize = 144;
/// Bytes per Q5_K block.
pub const Q5_K_BYTES: usize = 176;
/// Bytes per Q6_K block.
pub const Q6_K_BYTES: usize = 210;

/// One block of 256 activations quantized to int8 with a shared f32 scale (ggml `block_q8_K`).
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct BlockQ8K {
    /// Scale: value ~= `d * qs[i]`.
    pub d: f32,
    /// Quantized values in -127..=127.
    pub qs: [i8; QK_K],
    /// `bsums[g]` = sum of `qs[16g..16g+16]`.
    pub bsums: [i16; QK_K / 16],
}

impl BlockQ8K {
    /// An all-zero block (d = 0).
    pub const ZERO: BlockQ8K = BlockQ8K {
        d: 0.0,
        qs: [0; QK_K],
        bsums: [0; QK_K / 16],
    };
}

impl Default for BlockQ8K {
    fn default() -> Self {
        BlockQ8K::ZERO
    }
}

#[inline(always)]
pub(super) fn f16_at(b: &[u8], off: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

/// Unpacks the 12-byte Q4_K/Q5_K scale field into eight 6-bit scales and eight 6-bit mins, each
/// returned as eight bytes packed little-endian in a `u64` (byte `j` = sub-block `j`).
///
/// Bytes 0..4 hold scales 0..4 in their low 6 bits, bytes 4..8 mins 0..4; bytes 8..12 hold the
/// low nibbles of scales 4..8 (low half) and mins 4..8 (high half), whose top two bits are the
/// spare top bits of bytes 0..4 (scales) and 4..8 (mins).
#[inline(always)]
pub(super) fn unpack_scales_mins(s: &[u8]) -> (u64, u64) {
    let w0 = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    let w1 = u32::from_le_bytes([s[4], s[5], s[6], s[7]]);
    let w2 = u32::from_le_bytes([s[8], s[9], s[10], s[11]]);
    let sc_lo = w0 & 0x3f3f_3f3f;
    let m_lo = w1 & 0x3f3f_3f3f;
    let sc_hi = (w2 & 0x0f0f_0f0f) | ((w0 >> 2) & 0x3030_3030);
    let m_hi = ((w2 >> 4) & 0x0f0f_0f0f) | ((w1 >> 2) & 0x3030_3030);
    (
        sc_lo as u64 | (sc_hi as u64) << 32,
        m_lo as u64 | (m_hi as u64) << 32,
    )
}

// ---------------------------------------------------------------------------------------------
// Dequantization
// ---------------------------------------------------------------------------------------------

/// Dequantizes Q4_K blocks. `src.len()` must be a multiple of 144 and `dst.len()` 256 per block;
/// extra bytes/elements beyond whole matching blocks are left untouched.
pub fn dequantize_q4_k(src: &[u8], dst: &mut [f32]) {
    debug_assert_eq!(src.len() % Q4_K_BYTES, 0);
    debug_assert_eq!(src.len() / Q4_K_BYTES * QK_K, dst.len());
    for (blk, out) in src.chunks_exact(Q4_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(blk, 0);
        let dmin = f16_at(blk, 2);
        let (sc, m) = unpack_scales_mins(&blk[4..16]);
        let (sc, m) = (sc.to_le_bytes(), m.to_le_bytes());
        let qs = &blk[16..Q4_K_BYTES];
        for j in 0..4 {
            let d0 = d * sc[2 * j] as f32;
            let m0 = dmin * m[2 * j] as f32;
            let d1 = d * sc[2 * j + 1] as f32;
            let m1 = dmin * m[2 * j + 1] as f32;
            let q = &qs[32 * j..32 * j + 32];
            let (o0, o1) = out[64 * j..64 * j + 64].split_at_mut(32);
            for l in 0..32 {
                o0[l] = d0 * (q[l] & 0x0f) as f32 - m0;
                o1[l] = d1 * (q[l] >> 4) as f32 - m1;
            }
        }
    }
}

/// Dequantizes Q5_K blocks (176 bytes each) into 256 f32 per block.
pub fn dequantize_q5_k(src: &[u8], dst: &mut [f32]) {
    debug_assert_eq!(src.len() % Q5_K_BYTES, 0);
    debug_assert_eq!(src.len() / Q5_K_BYTES * QK_K, dst.len());
    for (blk, out) in src.chunks_exact(Q5_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(blk, 0);
        let dmin = f16_at(blk, 2);
        let (sc, m) = unpack_scales_mins(&blk[4..16]);
        let (sc, m) = (sc.to_le_bytes(), m.to_le_bytes());
        let qh = &blk[16..48];
        let qs = &blk[48..Q5_K_BYTES];
        for j in 0..4 {
            let d0 = d * sc[2 * j] as f32;
            let m0 = dmin * m[2 * j] as f32;
            let d1 = d * sc[2 * j + 1] as f32;
            let m1 = dmin * m[2 * j + 1] as f32;
            let q = &qs[32 * j..32 * j + 32];
            let (o0, o1) = out[64 * j..64 * j + 64].split_at_mut(32);
            for l in 0..32 {
                let h0 = ((qh[l] >> (2 * j)) & 1) << 4;
                let h1 = ((qh[l] >> (2 * j + 1)) & 1) << 4;
                o0[l] = d0 * ((q[l] & 0x0f) | h0) as f32 - m0;
                o1[l] = d1 * ((q[l] >> 4) | h1) as f32 - m1;
            }
        }
    }
}

/// Decodes the 6-bit unsigned quant (0..64) of element `32k + l` (k in 0..4, l in 0..32) of one
/// 128-element half of a Q6_K block, given that half's 64 `ql` and 32 `qh` bytes.
#[inline(always)]
pub(super) fn q6_quant(ql: &[u8], qh: &[u8], k: usize, l: usize) -> u8 {
    let lo = if k < 2 {
        ql[32 * k + l] & 0x0f
    } else {
        ql[32 * (k - 2) + l] >> 4
    };
    let hi = (qh[l] >> (2 * k)) & 3;
    lo | (hi << 4)
}

/// Dequantizes Q6_K blocks (210 bytes each) into 256 f32 per block.
pub fn dequantize_q6_k(src: &[u8], dst: &mut [f32]) {
    debug_assert_eq!(src.len() % Q6_K_BYTES, 0);
    debug_assert_eq!(src.len() / Q6_K_BYTES * QK_K, dst.len());
    for (blk, out) in src.chunks_exact(Q6_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(blk, 208);
        let scales = &blk[192..208];
        for h in 0..2 {
            let ql = &blk[64 * h..64 * h + 64];
            let qh = &blk[128 + 32 * h..128 + 32 * h + 32];
            for k in 0..4 {
                let base = 128 * h + 32 * k;
                for l in 0..32 {
                    let e = base + l;
                    let ds = d * (scales[e / 16] as i8) as f32;
                    let q = q6_quant(ql, qh, k, l) as i32 - 32;
                    out[e] = ds * q as f32;
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Q8_K activation quantization
// ---------------------------------------------------------------------------------------------

/// Round to nearest, ties to even, for |v| < 2^22 (the float-magic trick; vectorizes on SSE2).
#[inline(always)]
fn nearest_int(v: f32) -> i32 {
    let t = v + 12_582_912.0; // 1.5 * 2^23
    (t.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

#[inline(always)]
fn quantize_q8k_body(x: &[f32], out: &mut [BlockQ8K]) {
    for (xb, yb) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        // Largest magnitude (NaNs never win a `>` comparison, as in ggml).
        let mut amax = 0.0f32;
        for &v in xb {
            let a = v.abs();
            amax = if a > amax { a } else { amax };
        }
        if amax == 0.0 {
            *yb = BlockQ8K::ZERO;
            continue;
        }
        // Signed value of the first element reaching amax.
        let max = xb.iter().copied().find(|v| v.abs() == amax).unwrap_or(amax);
        let iscale = -127.0 / max;
        for (q, &v) in yb.qs.iter_mut().zip(xb) {
            *q = nearest_int(iscale * v).clamp(-128, 127) as i8;
        }
        for (s, g) in yb.bsums.iter_mut().zip(yb.qs.chunks_exact(16)) {
            *s = g.iter().map(|&q| q as i16).sum();
        }
        yb.d = 1.0 / iscale;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn quantize_q8k_avx2(x: &[f32], out: &mut [BlockQ8K]) {
    quantize_q8k_body(x, out)
}

/// Quantizes `x` (256 values per block) to Q8_K with ggml's semantics: per block the element of
/// largest magnitude `max` sets `iscale = -127/max`, `qs = round(iscale*x)` (ties to even,
/// clamped to 127), `d = 1/iscale`, and `bsums` holds the 16-element group sums. An all-zero block
/// gets `d = 0` and zero quants. `x.len()` must equal `out.len() * 256` (only whole matching
/// blocks are written).
pub fn quantize_row_q8_k(x: &[f32], out: &mut [BlockQ8K]) {
    debug_assert_eq!(x.len(), out.len() * QK_K);
    #[cfg(target_arch = "x86_64")]
    if cpu_best() >= SimdLevel::Avx2 {
        // SAFETY: cpu_best() confirmed AVX2, FMA and F16C on this CPU; the function body is
        // safe code only compiled with those features enabled.
        unsafe { quantize_q8k_avx2(x, out) };
        return;
    }
    quantize_q8k_body(x, out)
}

// ---------------------------------------------------------------------------------------------
// Dot products: scalar references
// ---------------------------------------------------------------------------------------------

/// The Q4_K/Q5_K min term of one super-block: `sum(m[j] * (bsums[2j] + bsums[2j + 1]))`.
#[inline(always)]
pub(super) fn mins_dot_bsums(m: &[u8; 8], bsums: &[i16; QK_K / 16]) -> i32 {
    (0..8)
        .map(|j| m[j] as i32 * (bsums[2 * j] as i32 + bsums[2 * j + 1] as i32))
        .sum()
}

/// The canonical order of the K-quant dot products (every AVX-512 kernel follows it, so they
/// give these bits; the AVX2 kernels differ by f32 rounding): per super-block the exact
/// integer sums `sumi` (scaled quants times activations) and `summ` (mins times activation
/// sums), then `acc = fma(sumi, d, acc)` and `accm = fma(summ, dmin, accm)`; the result is
/// `acc - accm` (Q6_K: no mins, `acc`).
pub(super) fn dot_q4_k_scalar(w: &[u8], a: &[BlockQ8K]) -> f32 {
    let (mut acc, mut accm) = (0.0f32, 0.0f32);
    for (blk, ab) in w.chunks_exact(Q4_K_BYTES).zip(a) {
        let d = f16_at(blk, 0) * ab.d;
        let dmin = f16_at(blk, 2) * ab.d;
        let (sc, m) = unpack_scales_mins(&blk[4..16]);
        let (sc, m) = (sc.to_le_bytes(), m.to_le_bytes());
        let qs = &blk[16..Q4_K_BYTES];
        let mut sumi = 0i32;
        for j in 0..4 {
            let q = &qs[32 * j..32 * j + 32];
            let a0 = &ab.qs[64 * j..64 * j + 32];
            let a1 = &ab.qs[64 * j + 32..64 * j + 64];
            let (mut s0, mut s1) = (0i32, 0i32);
            for l in 0..32 {
                s0 += (q[l] & 0x0f) as i32 * a0[l] as i32;
                s1 += (q[l] >> 4) as i32 * a1[l] as i32;
            }
            sumi += s0 * sc[2 * j] as i32 + s1 * sc[2 * j + 1] as i32;
        }
        let summ = mins_dot_bsums(&m, &ab.bsums);
        acc = (sumi as f32).mul_add(d, acc);
        accm = (summ as f32).mul_add(dmin, accm);
    }
    acc - accm
}

pub(super) fn dot_q5_k_scalar(w: &[u8], a: &[BlockQ8K]) -> f32 {
    let (mut acc, mut accm) = (0.0f32, 0.0f32);
    for (blk, ab) in w.chunks_exact(Q5_K_BYTES).zip(a) {
        let d = f16_at(blk, 0) * ab.d;
        let dmin = f16_at(blk, 2) * ab.d;
        let (sc, m) = unpack_scales_mins(&blk[4..16]);
        let (sc, m) = (sc.to_le_bytes(), m.to_le_bytes());
        let qh = &blk[16..48];
        let qs = &blk[48..Q5_K_BYTES];
        let mut sumi = 0i32;
        for j in 0..4 {
            let q = &qs[32 * j..32 * j + 32];
            let a0 = &ab.qs[64 * j..64 * j + 32];
            let a1 = &ab.qs[64 * j + 32..64 * j + 64];
            let (mut s0, mut s1) = (0i32, 0i32);
            for l in 0..32 {
                let q0 = (q[l] & 0x0f) | (((qh[l] >> (2 * j)) & 1) << 4);
                let q1 = (q[l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4);
                s0 += q0 as i32 * a0[l] as i32;
                s1 += q1 as i32 * a1[l] as i32;
            }
            sumi += s0 * sc[2 * j] as i32 + s1 * sc[2 * j + 1] as i32;
        }
        let summ = mins_dot_bsums(&m, &ab.bsums);
        acc = (sumi as f32).mul_add(d, acc);
        accm = (summ as f32).mul_add(dmin, accm);
    }
    acc - accm
}

pub(super) fn dot_q6_k_scalar(w: &[u8], a: &[BlockQ8K]) -> f32 {
    let mut sum = 0.0f32;
    for (blk, ab) in w.chunks_exact(Q6_K_BYTES).zip(a) {
        let d = f16_at(blk, 208) * ab.d;
        let scales = &blk[192..208];
        let mut sumi = 0i32;
        for h in 0..2 {
            let ql = &blk[64 * h..64 * h + 64];
            let qh = &blk[128 + 32 * h..128 + 32 * h + 32];
            for k in 0..4 {
                let base = 128 * h + 32 * k;
                let (mut s0, mut s1) = (0i32, 0i32);
                for l in 0..16 {
                    s0 += (q6_quant(ql, qh, k, l) as i32 - 32) * ab.qs[base + l] as i32;
                    s1 += (q6_quant(ql, qh, k, l + 16) as i32 - 32) * ab.qs[base + 16 + l] as i32;
                }
                let g = base / 16;
                sumi += s0 * (scales[g] as i8) as i32 + s1 * (scales[g + 1] as i8) as i32;
            }
        }
        sum = (sumi as f32).mul_add(d, sum);
    }
    sum
}

// ---------------------------------------------------------------------------------------------
// Dispatch
// ---------------------------------------------------------------------------------------------

/// Best level this CPU supports, detected once (the guard against callers passing too high a
/// level).
#[cfg(target_arch = "x86_64")]
fn cpu_best() -> SimdLevel {
    use std::sync::OnceLock;
    static BEST: OnceLock<SimdLevel> = OnceLock::new();
    *BEST.get_or_init(super::simd::detect)
}

/// Lowest level of each SIMD kernel of the `vec_dot_q*_k` dispatchers (see `simd::coverage`).
#[cfg(test)]
pub(crate) const DOT_KERNELS: [SimdLevel; 4] = [
    SimdLevel::Neon,
    SimdLevel::Avx2,
    SimdLevel::Avx512,
    SimdLevel::Avx512Vnni,
];

/// Number of whole blocks present in both operands.
#[inline(always)]
fn common_blocks(w: &[u8], block_bytes: usize, a: &[BlockQ8K]) -> usize {
    (w.len() / block_bytes).min(a.len())
}

/// Dot product of one Q4_K weight row (`w`, whole 144-byte blocks) with Q8_K activations (one
/// block per weight block), using kernels of `level` or lower (never above what the CPU has).
pub fn vec_dot_q4_k(w: &[u8], a: &[BlockQ8K], level: SimdLevel) -> f32 {
    debug_assert_eq!(w.len(), a.len() * Q4_K_BYTES);
    let n = common_blocks(w, Q4_K_BYTES, a);
    let (w, a) = (&w[..n * Q4_K_BYTES], &a[..n]);
    #[cfg(target_arch = "x86_64")]
    {
        // `simd::cap` keeps the level at most `simd::detect()`, so the CPU has every feature the
        // called kernel enables; kernels only read whole blocks of `w` and `a` (`n` blocks each).
        match super::simd::cap(level) {
            // SAFETY: cap(level) <= detect(): AVX-512 F/BW/VL/DQ/VNNI, AVX2, FMA, F16C present.
            SimdLevel::Avx512Vnni => return unsafe { x86::dot_q4_k_avx512vnni(w, a) },
            // SAFETY: cap(level) <= detect(): AVX-512 F/BW/VL/DQ, AVX2, FMA, F16C present.
            SimdLevel::Avx512 => return unsafe { x86::dot_q4_k_avx512(w, a) },
            // SAFETY: cap(level) <= detect(): AVX2, FMA, F16C present.
            SimdLevel::Avx2 => return unsafe { x86::dot_q4_k_avx2(w, a) },
            SimdLevel::Scalar | SimdLevel::Neon => {}
        }
    }
    #[cfg(target_arch = "aarch64")]
    if super::simd::cap(level) == SimdLevel::Neon {
        // SAFETY: `cap` returns Neon only when NEON was detected on this CPU.
        return unsafe { super::neon::dot_q4_k(w, a) };
    }
    let _ = level;
    dot_q4_k_scalar(w, a)
}

/// Dot product of one Q5_K weight row (176-byte blocks) with Q8_K activations.
pub fn vec_dot_q5_k(w: &[u8], a: &[BlockQ8K], level: SimdLevel) -> f32 {
    debug_assert_eq!(w.len(), a.len() * Q5_K_BYTES);
    let n = common_blocks(w, Q5_K_BYTES, a);
    let (w, a) = (&w[..n * Q5_K_BYTES], &a[..n]);
    #[cfg(target_arch = "x86_64")]
    {
        // As in vec_dot_q4_k: level capped by `simd::cap`; kernels read whole blocks only.
        match super::simd::cap(level) {
            // SAFETY: cap(level) <= detect(): AVX-512 F/BW/VL/DQ/VNNI, AVX2, FMA, F16C present.
            SimdLevel::Avx512Vnni => return unsafe { x86::dot_q5_k_avx512vnni(w, a) },
            // SAFETY: cap(level) <= detect(): AVX-512 F/BW/VL/DQ, AVX2, FMA, F16C present.
            SimdLevel::Avx512 => return unsafe { x86::dot_q5_k_avx512(w, a) },
            // SAFETY: cap(level) <= detect(): AVX2, FMA, F16C present.
            SimdLevel::Avx2 => return unsafe { x86::dot_q5_k_avx2(w, a) },
            SimdLevel::Scalar | SimdLevel::Neon => {}
        }
    }
    #[cfg(target_arch = "aarch64")]
    if super::simd::cap(level) == SimdLevel::Neon {
        // SAFETY: `cap` returns Neon only when NEON was detected on this CPU.
        return unsafe { super::neon::dot_q5_k(w, a) };
    }
    let _ = level;
    dot_q5_k_scalar(w, a)
}

/// Dot product of one Q6_K weight row (210-byte blocks) with Q8_K activations.
pub fn vec_dot_q6_k(w: &[u8], a: &[BlockQ8K], level: SimdLevel) -> f32 {
    debug_assert_eq!(w.len(), a.len() * Q6_K_BYTES);
    let n = common_blocks(w, Q6_K_BYTES, a);
    let (w, a) = (&w[..n * Q6_K_BYTES], &a[..n]);
    #[cfg(target_arch = "x86_64")]
    {
        // As in vec_dot_q4_k: level capped by `simd::cap`; kernels read whole blocks only.
        match super::simd::cap(level) {
            // SAFETY: cap(level) <= detect(): AVX-512 F/BW/VL/DQ/VNNI, AVX2, FMA, F16C present.
            SimdLevel::Avx512Vnni => return unsafe { x86::dot_q6_k_avx512vnni(w, a) },
            // SAFETY: cap(level) <= detect(): AVX-512 F/BW/VL/DQ, AVX2, FMA, F16C present.
            SimdLevel::Avx512 => return unsafe { x86::dot_q6_k_avx512(w, a) },
            // SAFETY: cap(level) <= detect(): AVX2, FMA, F16C present.
            SimdLevel::Avx2 => return unsafe { x86::dot_q6_k_avx2(w, a) },
            SimdLevel::Scalar | SimdLevel::Neon => {}
        }
    }
    #[cfg(target_arch = "aarch64")]
    if super::simd::cap(level) == SimdLevel::Neon {
        // SAFETY: `cap` returns Neon only when NEON was detected on this CPU.
        return unsafe { super::neon::dot_q6_k(w, a) };
    }
    let _ = level;
    dot_q6_k_scalar(w, a)
}

/// `out[i]` = the row dot of `w` (`ty`: Q4_K, Q5_K or Q6_K) with `a[i]` at the AVX2 level,
/// for 1 to 4 tokens: each weight block is unpacked once for all of them, and each result has
/// the bits of [`vec_dot_q4_k`] (and the others) at that level on its token alone.
///
/// # Panics
/// Unless the CPU has AVX2, FMA and F16C, `a` and `out` have the same length (1 to 4), and
/// each token holds a block per whole block of `w`.
#[cfg(target_arch = "x86_64")]
pub(crate) fn dot_row_tokens_avx2(
    ty: super::GgmlType,
    w: &[u8],
    a: &[&[BlockQ8K]],
    out: &mut [f32],
) {
    assert!(
        super::simd::cap(SimdLevel::Avx2) == SimdLevel::Avx2,
        "dot_row_tokens_avx2 needs AVX2, FMA and F16C"
    );
    assert_eq!(a.len(), out.len(), "one result per token");
    macro_rules! run {
        ($n:literal) => {{
            let a: &[&[BlockQ8K]; $n] = a.try_into().expect("length");
            // SAFETY: AVX2, FMA and F16C were detected (asserted); the bodies bound their reads.
            out.copy_from_slice(&unsafe { x86::dot_k_avx2_tokens::<$n>(ty, w, a) });
        }};
    }
    match a.len() {
        1 => run!(1),
        2 => run!(2),
        3 => run!(3),
        4 => run!(4),
        n => panic!("dot_row_tokens_avx2: {n} tokens (1 to 4)"),
    }
}

// ---------------------------------------------------------------------------------------------
// x86-64 kernels
// ---------------------------------------------------------------------------------------------

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! AVX2 and AVX-512 kernels. Each public-to-parent function is a `#[target_feature]` wrapper
    //! around an `#[inline(always)]` body so the body is compiled with the wrapper's features.
    //! All loads are unaligned and stay inside one block of `w` (iterated with `chunks_exact`)
    //! or one `BlockQ8K`.

    use super::{unpack_scales_mins, BlockQ8K, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES};
    use std::arch::x86_64::*;

    /// Reads the little-endian f16 at `b[off..off+2]` as f32 with F16C.
    #[inline(always)]
    unsafe fn f16_at(b: &[u8], off: usize) -> f32 {
        let bits = u16::from_le_bytes([b[off], b[off + 1]]);
        // SAFETY: register-only F16C conversion; callers are compiled with F16C enabled.
        unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32))) }
    }

    /// Horizontal sum of 8 f32 lanes.
    #[inline(always)]
    unsafe fn hsum256_ps(v: __m256) -> f32 {
        // SAFETY: register-only AVX intrinsics; callers are compiled with AVX2 enabled.
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_movehdup_ps(s));
            _mm_cvtss_f32(s)
        }
    }

    /// Q4_K/Q5_K min correction for one block: 8 lanes of `m[j] * (bsums[2j] + bsums[2j+1])`.
    #[inline(always)]
    unsafe fn mins_times_bsums(m: u64, ab: &BlockQ8K) -> __m256i {
        // SAFETY: `bsums` is 16 i16 = 32 bytes, read with one unaligned load; AVX2 enabled by
        // the calling kernel.
        unsafe {
            let bs = _mm256_loadu_si256(ab.bsums.as_ptr() as *const __m256i);
            let m32 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(m as i64));
            // Each i32 lane becomes the i16 pair (m_j, m_j).
            let m16 = _mm256_or_si256(m32, _mm256_slli_epi32::<16>(m32));
            _mm256_madd_epi16(bs, m16)
        }
    }

    // ---------------------------------------------------------------- AVX2

    /// The blocks of a weight row shared by `NT` tokens' activations: every token's row must
    /// hold at least as many blocks as the weights.
    #[inline(always)]
    fn check_tokens<const NT: usize>(w: &[u8], bytes: usize, a: &[&[BlockQ8K]; NT]) -> usize {
        let nb = w.len() / bytes;
        assert!(
            a.iter().all(|t| t.len() >= nb),
            "K-quant dot: a token has fewer blocks than the weight row"
        );
        nb
    }

    /// Q4_K (Q5_K when `Q5`) row dots with `NT` tokens: each weight block is unpacked once and
    /// dotted with every token, each token's accumulators advanced exactly as with `NT = 1`
    /// (the same bits per token whatever `NT`).
    #[inline(always)]
    unsafe fn dot_q45_k_avx2_body<const Q5: bool, const NT: usize>(
        w: &[u8],
        a: &[&[BlockQ8K]; NT],
    ) -> [f32; NT] {
        let bytes = if Q5 { Q5_K_BYTES } else { Q4_K_BYTES };
        let qs_off = if Q5 { 48 } else { 16 };
        let nb = check_tokens(w, bytes, a);
        // SAFETY: every pointer read stays within the current block (`blk`, exactly `bytes`
        // long: qs at qs_off..qs_off+128, qh at 16..48) or the current `BlockQ8K` of each token
        // (qs 0..256; `check_tokens`: each token has block `bi`); AVX2/FMA/F16C are enabled by
        // the calling wrapper.
        unsafe {
            let m4 = _mm256_set1_epi8(0x0f);
            let b4 = _mm256_set1_epi8(0x10);
            let mut accf = [_mm256_setzero_ps(); NT];
            let mut accm = [_mm256_setzero_ps(); NT];
            for (bi, blk) in w.chunks_exact(bytes).take(nb).enumerate() {
                let p = blk.as_ptr();
                let (dw, dminw) = (f16_at(blk, 0), f16_at(blk, 2));
                let (sc, m) = unpack_scales_mins(&blk[4..16]);
                let sc = sc.to_le_bytes();
                let mut qh = if Q5 {
                    _mm256_loadu_si256(p.add(16) as *const __m256i)
                } else {
                    _mm256_setzero_si256()
                };
                let mut acc = [_mm256_setzero_si256(); NT];
                for j in 0..4 {
                    let qv = _mm256_loadu_si256(p.add(qs_off + 32 * j) as *const __m256i);
                    let mut lo = _mm256_and_si256(qv, m4);
                    let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(qv), m4);
                    if Q5 {
                        // Bit 0 / bit 1 of the (progressively shifted) qh bytes -> bit 4.
                        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16::<4>(qh), b4));
                        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16::<3>(qh), b4));
                        qh = _mm256_srli_epi16::<2>(qh);
                    }
                    let s0 = _mm256_set1_epi16(sc[2 * j] as i16);
                    let s1 = _mm256_set1_epi16(sc[2 * j + 1] as i16);
                    for t in 0..NT {
                        let aq = a[t][bi].qs.as_ptr().add(64 * j);
                        let a0 = _mm256_loadu_si256(aq as *const __m256i);
                        let a1 = _mm256_loadu_si256(aq.add(32) as *const __m256i);
                        let p0 = _mm256_maddubs_epi16(lo, a0);
                        let p1 = _mm256_maddubs_epi16(hi, a1);
                        acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(p0, s0));
                        acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(p1, s1));
                    }
                }
                for t in 0..NT {
                    let ab = &a[t][bi];
                    let (d, dmin) = (dw * ab.d, dminw * ab.d);
                    accf[t] =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t]), _mm256_set1_ps(d), accf[t]);
                    let mm = mins_times_bsums(m, ab);
                    accm[t] =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(mm), _mm256_set1_ps(dmin), accm[t]);
                }
            }
            core::array::from_fn(|t| hsum256_ps(accf[t]) - hsum256_ps(accm[t]))
        }
    }

    /// Q6_K row dots with `NT` tokens, each weight block unpacked once (the same bits per token
    /// whatever `NT`, as `dot_q45_k_avx2_body`).
    #[inline(always)]
    unsafe fn dot_q6_k_avx2_body<const NT: usize>(w: &[u8], a: &[&[BlockQ8K]; NT]) -> [f32; NT] {
        let nb = check_tokens(w, Q6_K_BYTES, a);
        // SAFETY: reads stay within the current 210-byte block (ql 0..128, qh 128..192,
        // scales 192..208) and each token's current BlockQ8K (`check_tokens`); AVX2/FMA/F16C
        // enabled by the wrapper.
        unsafe {
            let m4 = _mm256_set1_epi8(0x0f);
            let m30 = _mm256_set1_epi8(0x30);
            let k32 = _mm256_set1_epi8(32);
            // Shuffle controls selecting i16 scale 2k (low 128-bit lane) and 2k+1 (high lane).
            let ctrl: [__m256i; 4] = core::array::from_fn(|k| {
                let pair = |i: i8| _mm_set1_epi16(i16::from_le_bytes([i as u8, i as u8 + 1]));
                _mm256_set_m128i(pair((4 * k + 2) as i8), pair((4 * k) as i8))
            });
            let mut accf = [_mm256_setzero_ps(); NT];
            for (bi, blk) in w.chunks_exact(Q6_K_BYTES).take(nb).enumerate() {
                let p = blk.as_ptr();
                let dw = f16_at(blk, 208);
                let sc8 = _mm_loadu_si128(p.add(192) as *const __m128i);
                let mut acc = [_mm256_setzero_si256(); NT];
                for h in 0..2 {
                    let sc16 = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(if h == 0 {
                        sc8
                    } else {
                        _mm_unpackhi_epi64(sc8, sc8)
                    }));
                    let ql0 = _mm256_loadu_si256(p.add(64 * h) as *const __m256i);
                    let ql1 = _mm256_loadu_si256(p.add(64 * h + 32) as *const __m256i);
                    let qhv = _mm256_loadu_si256(p.add(128 + 32 * h) as *const __m256i);
                    let q = [
                        _mm256_or_si256(
                            _mm256_and_si256(ql0, m4),
                            _mm256_and_si256(_mm256_slli_epi16::<4>(qhv), m30),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(ql1, m4),
                            _mm256_and_si256(_mm256_slli_epi16::<2>(qhv), m30),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
                            _mm256_and_si256(qhv, m30),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
                            _mm256_and_si256(_mm256_srli_epi16::<2>(qhv), m30),
                        ),
                    ];
                    for k in 0..4 {
                        let s = _mm256_shuffle_epi8(sc16, ctrl[k]);
                        for t in 0..NT {
                            let av = _mm256_loadu_si256(
                                a[t][bi].qs.as_ptr().add(128 * h + 32 * k) as *const __m256i
                            );
                            // (q - 32) * a per pair, exact in i16 (|.| <= 2*32*127).
                            let prod = _mm256_sub_epi16(
                                _mm256_maddubs_epi16(q[k], av),
                                _mm256_maddubs_epi16(k32, av),
                            );
                            acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(prod, s));
                        }
                    }
                }
                for t in 0..NT {
                    let d = dw * a[t][bi].d;
                    accf[t] =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t]), _mm256_set1_ps(d), accf[t]);
                }
            }
            core::array::from_fn(|t| hsum256_ps(accf[t]))
        }
    }

    // ---------------------------------------------------------------- AVX-512

    /// Upper 16 of the 32 i16 lanes (the upper 256 bits).
    const UPPER_WORDS: __mmask32 = 0xffff_0000;

    #[inline(always)]
    unsafe fn dot_q45_k_avx512_body<const Q5: bool, const VNNI: bool>(
        w: &[u8],
        a: &[BlockQ8K],
    ) -> f32 {
        let bytes = if Q5 { Q5_K_BYTES } else { Q4_K_BYTES };
        let qs_off = if Q5 { 48 } else { 16 };
        // SAFETY: reads stay within the current block (qs 32-byte chunks at qs_off..+128, qh at
        // 16..48) and the current BlockQ8K (64-byte chunks of qs, 32-byte bsums); the wrapper
        // enables AVX-512 F/BW/VL/DQ (+VNNI when VNNI is true) and AVX2/FMA/F16C.
        unsafe {
            let m4 = _mm512_set1_epi8(0x0f);
            let b16 = _mm512_set1_epi8(0x10);
            // permutexvar indices: i16 scale 2j in the low 16 lanes, 2j+1 in the high 16 lanes.
            let idx: [__m512i; 4] = core::array::from_fn(|j| {
                _mm512_mask_blend_epi16(
                    UPPER_WORDS,
                    _mm512_set1_epi16(2 * j as i16),
                    _mm512_set1_epi16(2 * j as i16 + 1),
                )
            });
            // qh bit masks: bit 2j for the low 32 bytes, bit 2j+1 for the high 32 bytes.
            let hbit: [__m512i; 4] = core::array::from_fn(|j| {
                _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(_mm256_set1_epi8((1u8 << (2 * j)) as i8)),
                    _mm256_set1_epi8((1u8 << (2 * j + 1)) as i8),
                )
            });
            let (mut accf, mut accm) = (0.0f32, 0.0f32);
            for (blk, ab) in w.chunks_exact(bytes).zip(a) {
                let p = blk.as_ptr();
                let d = f16_at(blk, 0) * ab.d;
                let dmin = f16_at(blk, 2) * ab.d;
                let (sc, m) = unpack_scales_mins(&blk[4..16]);
                let sc16 =
                    _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
                let qh = if Q5 {
                    _mm512_broadcast_i64x4(_mm256_loadu_si256(p.add(16) as *const __m256i))
                } else {
                    _mm512_setzero_si512()
                };
                let mut acc = _mm512_setzero_si512();
                for j in 0..4 {
                    // Nibbles of chunk j: low halves -> bytes 0..32, high halves -> 32..64,
                    // matching activations 64j..64j+64.
                    let qb = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                        p.add(qs_off + 32 * j) as *const __m256i
                    ));
                    let mut q =
                        _mm512_and_si512(_mm512_mask_srli_epi16::<4>(qb, UPPER_WORDS, qb), m4);
                    if Q5 {
                        let k = _mm512_test_epi8_mask(qh, hbit[j]);
                        q = _mm512_mask_add_epi8(q, k, q, b16);
                    }
                    let av = _mm512_loadu_si512(ab.qs.as_ptr().add(64 * j) as *const __m512i);
                    let prod = _mm512_maddubs_epi16(q, av);
                    let s = _mm512_permutexvar_epi16(idx[j], sc16);
                    acc = if VNNI {
                        _mm512_dpwssd_epi32(acc, prod, s)
                    } else {
                        _mm512_add_epi32(acc, _mm512_madd_epi16(prod, s))
                    };
                }
                // The canonical order (see `dot_q4_k_scalar`): exact block sums, one fma each.
                let sumi = _mm512_reduce_add_epi32(acc);
                let mm = mins_times_bsums(m, ab);
                let summ = _mm512_reduce_add_epi32(_mm512_zextsi256_si512(mm));
                accf = (sumi as f32).mul_add(d, accf);
                accm = (summ as f32).mul_add(dmin, accm);
            }
            accf - accm
        }
    }

    #[inline(always)]
    unsafe fn dot_q6_k_avx512_body<const VNNI: bool>(w: &[u8], a: &[BlockQ8K]) -> f32 {
        // SAFETY: reads stay within the current 210-byte block (ql 64-byte halves at 0/64,
        // qh 32-byte halves at 128/160, scales 192..208) and the current BlockQ8K; the wrapper
        // enables AVX-512 F/BW/VL/DQ (+VNNI when VNNI is true) and AVX2/FMA/F16C.
        unsafe {
            let m4 = _mm512_set1_epi8(0x0f);
            let m30 = _mm512_set1_epi8(0x30);
            let k32 = _mm512_set1_epi8(32);
            // permutexvar indices: i16 scales 4c..4c+4, each repeated over 8 lanes (16 elements).
            let idx: [__m512i; 4] = core::array::from_fn(|c| {
                let mut v = [0i16; 32];
                for (i, x) in v.iter_mut().enumerate() {
                    *x = (4 * c + i / 8) as i16;
                }
                _mm512_loadu_si512(v.as_ptr() as *const __m512i)
            });
            let mut accf = 0.0f32;
            for (blk, ab) in w.chunks_exact(Q6_K_BYTES).zip(a) {
                let p = blk.as_ptr();
                let d = f16_at(blk, 208) * ab.d;
                let sc8 = _mm_loadu_si128(p.add(192) as *const __m128i);
                let sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc8));
                let mut acc = _mm512_setzero_si512();
                for h in 0..2 {
                    let ql = _mm512_loadu_si512(p.add(64 * h) as *const __m512i);
                    let qhb = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                        p.add(128 + 32 * h) as *const __m256i
                    ));
                    // Low 32 bytes: qh; high 32 bytes: qh >> 2.
                    let x = _mm512_mask_srli_epi16::<2>(qhb, UPPER_WORDS, qhb);
                    let q01 = _mm512_or_si512(
                        _mm512_and_si512(ql, m4),
                        _mm512_and_si512(_mm512_slli_epi16::<4>(x), m30),
                    );
                    let q23 = _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4),
                        _mm512_and_si512(x, m30),
                    );
                    let aq = ab.qs.as_ptr().add(128 * h);
                    let a01 = _mm512_loadu_si512(aq as *const __m512i);
                    let a23 = _mm512_loadu_si512(aq.add(64) as *const __m512i);
                    // (q - 32) * a per pair, exact in i16 (|.| <= 2*32*127).
                    let p01 = _mm512_sub_epi16(
                        _mm512_maddubs_epi16(q01, a01),
                        _mm512_maddubs_epi16(k32, a01),
                    );
                    let p23 = _mm512_sub_epi16(
                        _mm512_maddubs_epi16(q23, a23),
                        _mm512_maddubs_epi16(k32, a23),
                    );
                    let s01 = _mm512_permutexvar_epi16(idx[2 * h], sc16);
                    let s23 = _mm512_permutexvar_epi16(idx[2 * h + 1], sc16);
                    if VNNI {
                        acc = _mm512_dpwssd_epi32(acc, p01, s01);
                        acc = _mm512_dpwssd_epi32(acc, p23, s23);
                    } else {
                        acc = _mm512_add_epi32(acc, _mm512_madd_epi16(p01, s01));
                        acc = _mm512_add_epi32(acc, _mm512_madd_epi16(p23, s23));
                    }
                }
                // The canonical order (see `dot_q6_k_scalar`): the exact block sum, one fma.
                accf = (_mm512_reduce_add_epi32(acc) as f32).mul_add(d, accf);
            }
            accf
        }
    }

    // ---------------------------------------------------------------- wrappers

    macro_rules! kernel {
        ($name:ident, $features:literal, $body:expr) => {
            /// # Safety
            /// The CPU must support every feature in this function's `target_feature` list.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $name(w: &[u8], a: &[BlockQ8K]) -> f32 {
                // SAFETY: the caller guarantees the features; the body's memory accesses are
                // bounded as documented on it.
                unsafe { $body(w, a) }
            }
        };
    }

    /// One token through the AVX2 bodies (as `dot_k_avx2_tokens` with one token).
    #[inline(always)]
    unsafe fn q45_k_avx2_one<const Q5: bool>(w: &[u8], a: &[BlockQ8K]) -> f32 {
        // SAFETY: forwarded (the caller's features; the body's bounds are its own).
        unsafe { dot_q45_k_avx2_body::<Q5, 1>(w, &[a])[0] }
    }

    #[inline(always)]
    unsafe fn q6_k_avx2_one(w: &[u8], a: &[BlockQ8K]) -> f32 {
        // SAFETY: as `q45_k_avx2_one`.
        unsafe { dot_q6_k_avx2_body::<1>(w, &[a])[0] }
    }

    kernel!(dot_q4_k_avx2, "avx2,fma,f16c", q45_k_avx2_one::<false>);
    kernel!(dot_q5_k_avx2, "avx2,fma,f16c", q45_k_avx2_one::<true>);
    kernel!(dot_q6_k_avx2, "avx2,fma,f16c", q6_k_avx2_one);

    /// `ty`'s row `w` dotted with `NT` tokens' activations at AVX2, each weight block
    /// unpacked once for all of them; token `t`'s result has the bits of the one-token AVX2
    /// kernel (`dot_q4_k_avx2` ...) on `a[t]`.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_k_avx2_tokens<const NT: usize>(
        ty: crate::quant::GgmlType,
        w: &[u8],
        a: &[&[BlockQ8K]; NT],
    ) -> [f32; NT] {
        use crate::quant::GgmlType;
        // SAFETY: the caller guarantees the features; the bodies bound their own reads.
        unsafe {
            match ty {
                GgmlType::Q4_K => dot_q45_k_avx2_body::<false, NT>(w, a),
                GgmlType::Q5_K => dot_q45_k_avx2_body::<true, NT>(w, a),
                _ => dot_q6_k_avx2_body::<NT>(w, a),
            }
        }
    }
    kernel!(
        dot_q4_k_avx512,
        "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c",
        dot_q45_k_avx512_body::<false, false>
    );
    kernel!(
        dot_q5_k_avx512,
        "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c",
        dot_q45_k_avx512_body::<true, false>
    );
    kernel!(
        dot_q6_k_avx512,
        "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c",
        dot_q6_k_avx512_body::<false>
    );
    kernel!(
        dot_q4_k_avx512vnni,
        "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
        dot_q45_k_avx512_body::<false, true>
    );
    kernel!(
        dot_q5_k_avx512vnni,
        "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
        dot_q45_k_avx512_body::<true, true>
    );
    kernel!(
        dot_q6_k_avx512vnni,
        "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
        dot_q6_k_avx512_body::<true>
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// splitmix64: tiny deterministic generator for test data.
    struct Rng(u64);
    impl Rng {
        fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        fn byte(&mut self) -> u8 {
            self.next_u64() as u8
        }
        /// Uniform in [-1, 1).
        fn unit(&mut self) -> f32 {
            (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }
        /// Random-sign magnitude in [1e-4, 1e-1] as f16 bits.
        fn f16_scale(&mut self) -> [u8; 2] {
            let e = -4.0 + 3.0 * (self.unit() * 0.5 + 0.5);
            let v = 10f32.powf(e) * if self.next_u64() & 1 == 0 { 1.0 } else { -1.0 };
            f16::from_f32(v).to_bits().to_le_bytes()
        }
    }

    #[derive(Clone, Copy, Debug)]
    enum Kind {
        Q4,
        Q5,
        Q6,
    }

    impl Kind {
        const ALL: [Kind; 3] = [Kind::Q4, Kind::Q5, Kind::Q6];
        fn bytes(self) -> usize {
            match self {
                Kind::Q4 => Q4_K_BYTES,
                Kind::Q5 => Q5_K_BYTES,
                Kind::Q6 => Q6_K_BYTES,
            }
        }
        fn dequantize(self, src: &[u8], dst: &mut [f32]) {
            match self {
                Kind::Q4 => dequantize_q4_k(src, dst),
                Kind::Q5 => dequantize_q5_k(src, dst),
                Kind::Q6 => dequantize_q6_k(src, dst),
            }
        }
        fn dot(self, w: &[u8], a: &[BlockQ8K], level: SimdLevel) -> f32 {
            match self {
                Kind::Q4 => vec_dot_q4_k(w, a, level),
                Kind::Q5 => vec_dot_q5_k(w, a, level),
                Kind::Q6 => vec_dot_q6_k(w, a, level),
            }
        }
        /// Random blocks: random bits everywhere, sane f16 super-block scales.
        fn random_blocks(self, rng: &mut Rng, n: usize) -> Vec<u8> {
            let mut v: Vec<u8> = (0..n * self.bytes()).map(|_| rng.byte()).collect();
            for blk in v.chunks_exact_mut(self.bytes()) {
                match self {
                    Kind::Q4 | Kind::Q5 => {
                        blk[0..2].copy_from_slice(&rng.f16_scale());
                        blk[2..4].copy_from_slice(&rng.f16_scale());
                    }
                    Kind::Q6 => blk[208..210].copy_from_slice(&rng.f16_scale()),
                }
            }
            v
        }
        fn ggml_type(self) -> GgmlType {
            match self {
                Kind::Q4 => GgmlType::Q4_K,
                Kind::Q5 => GgmlType::Q5_K,
                Kind::Q6 => GgmlType::Q6_K,
            }
        }
    }

    use crate::quant::GgmlType;

    #[test]
    fn kquants_block_sizes_match_type_table() {
        for k in Kind::ALL {
            assert_eq!(k.ggml_type().type_size(), k.bytes(), "{k:?}");
            assert_eq!(k.ggml_type().block_size(), QK_K, "{k:?}");
        }
        assert_eq!(std::mem::size_of::<BlockQ8K>(), 4 + 256 + 32);
    }

    fn check_fixture(kind: Kind, data: &[u8]) {
        let n = u32::from_le_bytes(data[0..4].try_into().unwrap()) as usize;
        let raw = &data[4..4 + n * kind.bytes()];
        let exp: Vec<f32> = data[4 + n * kind.bytes()..]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(exp.len(), n * QK_K, "{kind:?} fixture size");
        let mut got = vec![f32::NAN; n * QK_K];
        kind.dequantize(raw, &mut got);
        for (i, (g, e)) in got.iter().zip(&exp).enumerate() {
            assert!(
                g == e || (g - e).abs() <= 1e-6 * e.abs(),
                "{kind:?} element {i} (block {}): got {g}, gguf says {e}",
                i / QK_K
            );
        }
    }

    #[test]
    fn kquants_dequantize_matches_gguf_python() {
        check_fixture(
            Kind::Q4,
            include_bytes!("../../tests/fixtures/kquants_q4_k.bin"),
        );
        check_fixture(
            Kind::Q5,
            include_bytes!("../../tests/fixtures/kquants_q5_k.bin"),
        );
        check_fixture(
            Kind::Q6,
            include_bytes!("../../tests/fixtures/kquants_q6_k.bin"),
        );
    }

    fn random_activations(rng: &mut Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.unit() * 3.0).collect()
    }

    fn quantize(x: &[f32]) -> Vec<BlockQ8K> {
        let mut q = vec![BlockQ8K::ZERO; x.len() / QK_K];
        quantize_row_q8_k(x, &mut q);
        q
    }

    #[test]
    fn kquants_q8k_quantize_roundtrip_and_bsums() {
        let mut rng = Rng(7);
        let mut x = random_activations(&mut rng, 8 * QK_K);
        x[QK_K + 5] = -9.0; // negative extreme in block 1
        x[2 * QK_K..3 * QK_K].fill(0.0); // all-zero block 2
        x[3 * QK_K + 17] = 1e-30; // tiny block 3
        x[3 * QK_K..4 * QK_K].iter_mut().for_each(|v| *v *= 1e-3);
        let q = quantize(&x);
        for (b, (blk, xb)) in q.iter().zip(x.chunks_exact(QK_K)).enumerate() {
            if b == 2 {
                assert_eq!(*blk, BlockQ8K::ZERO);
                continue;
            }
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            // ggml semantics: the largest-magnitude element maps to -127 and d = -max/127.
            let imax = xb.iter().position(|v| v.abs() == amax).unwrap();
            assert_eq!(blk.qs[imax], -127, "block {b}");
            assert!(
                (blk.d - (-xb[imax] / 127.0)).abs() <= 1e-6 * blk.d.abs(),
                "block {b}"
            );
            for (i, (&qv, &xv)) in blk.qs.iter().zip(xb).enumerate() {
                assert!(qv >= -127, "block {b} elem {i}");
                let err = (blk.d * qv as f32 - xv).abs();
                assert!(
                    err <= blk.d.abs() * 0.5 * (1.0 + 1e-5),
                    "block {b} elem {i}: err {err}"
                );
            }
            for g in 0..16 {
                let s: i32 = blk.qs[16 * g..16 * g + 16].iter().map(|&v| v as i32).sum();
                assert_eq!(blk.bsums[g] as i32, s, "block {b} group {g}");
            }
        }
        assert_eq!(q[1].qs[5], -127);
        assert!(q[1].d > 0.0);
    }

    #[test]
    fn kquants_q8k_rounds_ties_to_even_like_ggml() {
        // max = -127 gives iscale = 1: quants equal round-half-even of the inputs.
        let mut x = vec![0.0f32; QK_K];
        x[0] = -127.0;
        x[1] = 2.5;
        x[2] = 3.5;
        x[3] = -2.5;
        x[4] = 126.49;
        let q = quantize(&x);
        assert_eq!(q[0].d, 1.0);
        assert_eq!(&q[0].qs[..5], &[-127, 2, 4, -2, 126]);
    }

    use crate::quant::simd::coverage;

    /// The SIMD kernels to compare with the scalar one (never the scalar kernel itself).
    fn kernels() -> Vec<SimdLevel> {
        coverage::simd_kernels(&DOT_KERNELS)
    }

    /// The AVX2 build of the Q8_K quantizer is the same source as the scalar one compiled with
    /// other features; the two must agree bit for bit (the dispatcher always takes the best).
    #[test]
    fn kquants_q8k_quantize_builds_agree() {
        let mut rng = Rng(8);
        let mut x = random_activations(&mut rng, 12 * QK_K);
        x[QK_K..2 * QK_K].fill(0.0);
        x[5 * QK_K + 3] = 40.0;
        x[7 * QK_K..8 * QK_K].iter_mut().for_each(|v| *v *= 1e-30);
        let mut scalar = vec![BlockQ8K::ZERO; 12];
        quantize_q8k_body(&x, &mut scalar);
        let starts = [SimdLevel::Avx2];
        let tested = coverage::simd_kernels(&starts);
        #[cfg(target_arch = "x86_64")]
        if tested.contains(&SimdLevel::Avx2) {
            let mut simd = vec![BlockQ8K::ZERO; 12];
            // SAFETY: simd_kernels() lists Avx2 only when the CPU has AVX2, FMA and F16C.
            unsafe { quantize_q8k_avx2(&x, &mut simd) };
            assert_eq!(simd, scalar);
        }
        coverage::report("Q8_K activation quantization", &starts, &tested);
    }

    #[test]
    fn kquants_simd_dots_match_scalar() {
        let mut rng = Rng(42);
        let kernels = kernels();
        for kind in Kind::ALL {
            for &nb in &[1usize, 2, 7, 16] {
                for trial in 0..4 {
                    let w = kind.random_blocks(&mut rng, nb);
                    let a = quantize(&random_activations(&mut rng, nb * QK_K));
                    let want = kind.dot(&w, &a, SimdLevel::Scalar);
                    // Scale of the per-block terms, for a cancellation-aware relative bound.
                    let mag: f32 = (0..nb)
                        .map(|b| {
                            let r = b * kind.bytes()..(b + 1) * kind.bytes();
                            kind.dot(&w[r], &a[b..b + 1], SimdLevel::Scalar).abs()
                        })
                        .sum();
                    for &level in &kernels {
                        let got = kind.dot(&w, &a, level);
                        let tol = 1e-5 * want.abs().max(mag) + f32::MIN_POSITIVE;
                        assert!(
                            (got - want).abs() <= tol,
                            "{kind:?} nb={nb} trial={trial} {level:?}: {got} vs scalar {want}"
                        );
                    }
                }
            }
        }
        coverage::report("K-quant row dot", &DOT_KERNELS, &kernels);
    }

    /// The several-token AVX2 kernel gives each token the bits of the one-token AVX2 kernel
    /// (batch invariance), for every K-quant type and 1 to 4 tokens, and stays close to the
    /// scalar reference.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn kquants_avx2_tokens_give_each_tokens_bits() {
        let tested = coverage::simd_kernels(&[SimdLevel::Avx2]);
        if tested.contains(&SimdLevel::Avx2) {
            let mut rng = Rng(77);
            for kind in Kind::ALL {
                for &nb in &[1usize, 3, 8] {
                    let w = kind.random_blocks(&mut rng, nb);
                    let acts: Vec<Vec<BlockQ8K>> = (0..4)
                        .map(|_| quantize(&random_activations(&mut rng, nb * QK_K)))
                        .collect();
                    for n in 1..=4 {
                        let a: Vec<&[BlockQ8K]> = acts[..n].iter().map(|a| &a[..]).collect();
                        let mut got = vec![0.0f32; n];
                        dot_row_tokens_avx2(kind.ggml_type(), &w, &a, &mut got);
                        for (t, g) in got.iter().enumerate() {
                            let one = kind.dot(&w, a[t], SimdLevel::Avx2);
                            assert_eq!(
                                g.to_bits(),
                                one.to_bits(),
                                "{kind:?} nb={nb} token {t} of {n}: {g} vs one token {one}"
                            );
                            let want = kind.dot(&w, a[t], SimdLevel::Scalar);
                            assert!(
                                (g - want).abs() <= 1e-3 * want.abs().max(1.0),
                                "{kind:?} nb={nb} token {t} of {n}: {g} vs scalar {want}"
                            );
                        }
                    }
                }
            }
        }
        coverage::report(
            "K-quant several-token AVX2 row dot",
            &[SimdLevel::Avx2],
            &tested,
        );
    }

    #[test]
    fn kquants_simd_dots_match_scalar_at_extremes() {
        // Saturating inputs: every quant field at its maximum, activations at +-127, scales at
        // their extremes. Exposes any int16 overflow in the SIMD paths.
        let kernels = kernels();
        for kind in Kind::ALL {
            for pattern in [0xffu8, 0x00, 0xaa, 0x55] {
                let mut w = vec![pattern; 4 * kind.bytes()];
                for blk in w.chunks_exact_mut(kind.bytes()) {
                    match kind {
                        Kind::Q4 | Kind::Q5 => {
                            blk[0..4].copy_from_slice(&[0x00, 0x3c, 0x00, 0x38]); // 1.0, 0.5
                            blk[4..16].fill(0xff); // all scales/mins = 63
                        }
                        Kind::Q6 => {
                            blk[192..200].fill(0x80); // -128
                            blk[200..208].fill(0x7f); // 127
                            blk[208..210].copy_from_slice(&[0x00, 0x3c]);
                        }
                    }
                }
                for sign_pat in 0..3 {
                    let x: Vec<f32> = (0..4 * QK_K)
                        .map(|i| match sign_pat {
                            0 => 127.0,
                            1 => -127.0,
                            _ => {
                                if i % 3 == 0 {
                                    127.0
                                } else {
                                    -127.0
                                }
                            }
                        })
                        .collect();
                    let a = quantize(&x);
                    let want = kind.dot(&w, &a, SimdLevel::Scalar);
                    // Exact reference in f64 from the dequantized weights.
                    let mut deq = vec![0f32; 4 * QK_K];
                    kind.dequantize(&w, &mut deq);
                    let exact: f64 = deq.iter().zip(&x).map(|(&w, &x)| w as f64 * x as f64).sum();
                    let mag: f64 = deq
                        .iter()
                        .zip(&x)
                        .map(|(&w, &x)| (w as f64 * x as f64).abs())
                        .sum();
                    assert!(
                        (want as f64 - exact).abs() <= 1e-5 * mag,
                        "{kind:?} {pattern:#x}/{sign_pat}: scalar {want} vs exact {exact}"
                    );
                    for &level in &kernels {
                        let got = kind.dot(&w, &a, level);
                        assert!(
                            ((got - want) as f64).abs() <= 1e-5 * mag,
                            "{kind:?} {pattern:#x}/{sign_pat} {level:?}: {got} vs {want}"
                        );
                    }
                }
            }
        }
        coverage::report("K-quant row dot at extremes", &DOT_KERNELS, &kernels);
    }

    #[test]
    fn kquants_dot_approximates_f32_dot() {
        let mut rng = Rng(99);
        // Against an f64 oracle, so the scalar kernel is checked too.
        let kernels: Vec<SimdLevel> = std::iter::once(SimdLevel::Scalar)
            .chain(kernels())
            .collect();
        for kind in Kind::ALL {
            let nb = 8;
            let w = kind.random_blocks(&mut rng, nb);
            let x = random_activations(&mut rng, nb * QK_K);
            let a = quantize(&x);
            let mut deq = vec![0f32; nb * QK_K];
            kind.dequantize(&w, &mut deq);
            let exact: f64 = deq.iter().zip(&x).map(|(&w, &x)| w as f64 * x as f64).sum();
            // |a_deq - x| <= |d_a|/2 per element, so the activation-quantization error is bounded
            // by sum_b |d_a,b|/2 * sum |w| over block b; add f32 accumulation slack.
            let mut bound = 0f64;
            let mut mag = 0f64;
            for b in 0..nb {
                let wsum: f64 = deq[b * QK_K..(b + 1) * QK_K]
                    .iter()
                    .map(|v| v.abs() as f64)
                    .sum();
                bound += a[b].d.abs() as f64 * 0.5 * wsum;
                mag += deq[b * QK_K..(b + 1) * QK_K]
                    .iter()
                    .zip(&x[b * QK_K..])
                    .map(|(&w, &x)| (w as f64 * x as f64).abs())
                    .sum::<f64>();
            }
            assert!(
                bound < 0.05 * mag,
                "{kind:?}: test data too coarse ({bound} vs {mag})"
            );
            for &level in &kernels {
                let got = kind.dot(&w, &a, level) as f64;
                assert!(
                    (got - exact).abs() <= bound + 1e-5 * mag,
                    "{kind:?} {level:?}: {got} vs f32 dot {exact} (bound {bound})"
                );
            }
            // Against the dequantized activations the match is exact up to f32 rounding.
            let a_deq: f64 = (0..nb * QK_K)
                .map(|i| deq[i] as f64 * (a[i / QK_K].d * a[i / QK_K].qs[i % QK_K] as f32) as f64)
                .sum();
            for &level in &kernels {
                let got = kind.dot(&w, &a, level) as f64;
                assert!(
                    (got - a_deq).abs() <= 1e-5 * mag,
                    "{kind:?} {level:?}: {got} vs {a_deq}"
                );
            }
        }
    }

    #[test]
    fn kquants_level_above_cpu_falls_back() {
        // A level above the CPU's must be safe (capped internally) and run the CPU's best
        // kernel. Only a CPU that lacks some level can check this; on one that has them all
        // there is nothing above its best (and comparing its kernel with itself proves nothing).
        let mut rng = Rng(5);
        let best = crate::quant::simd::detect();
        for above in SimdLevel::ALL.into_iter().filter(|&l| l > best) {
            for kind in Kind::ALL {
                let w = kind.random_blocks(&mut rng, 3);
                let a = quantize(&random_activations(&mut rng, 3 * QK_K));
                let want = kind.dot(&w, &a, best);
                let got = kind.dot(&w, &a, above);
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{kind:?}: {got} at {above:?} vs {want} at {best:?}"
                );
            }
        }
    }
}
