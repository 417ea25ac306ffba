//! NEON (aarch64 Advanced SIMD) kernels: the legacy row dot against Q8 activations (Q4_0, Q4_1,
//! Q5_0, Q5_1, Q8_0), the K-quant row dots against Q8_K activations (Q4_K, Q5_K, Q6_K) and the
//! Q8 activation quantizer.
//!
//! Guarantee: every kernel returns the bits of its scalar twin (`legacy::vec_dot_scalar`,
//! `kquants::dot_q*_k_scalar`, `q8::quantize_block`). NEON computes the exact integer sums (of
//! a 32-element block, of a K-quant sub-block) with widening multiplies (`smull`, products of
//! at most 128 * 127 in i16) and pairwise widening adds into i32, where the order of additions
//! does not matter; the f32 operations that follow are the scalar code's own, in its canonical
//! order (legacy: 8 slot accumulators, block `b` into slot `b % 8`, `fma(m, sa, fma(isum, d *
//! da, acc))`, fixed final tree; K-quants: `fma(sumi, d, acc)` per super-block). So a token's
//! result does not depend on the kernel nor on the batch it is in, as at AVX-512 VNNI.
//!
//! Every function carries `#[target_feature(enable = "neon")]` (the intrinsics require it even
//! though the aarch64 target enables NEON), so callers outside call them in `unsafe` after the
//! level check, as on x86-64; inside, only the loads and stores through raw pointers are
//! `unsafe`. The `dotprod` extension (`sdot`) is not used: it is optional before Armv8.4 and
//! would need its own detected level.

#![cfg(target_arch = "aarch64")]

use std::arch::aarch64::*;

use super::kquants::{self, BlockQ8K, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES};
use super::legacy::{self, QK, SLOTS};
use super::types::GgmlType;

/// Const-generic legacy type codes (the ggml ids, as in `avx2`).
const T_Q4_0: u8 = 2;
const T_Q4_1: u8 = 3;
const T_Q5_0: u8 = 6;
const T_Q5_1: u8 = 7;
const T_Q8_0: u8 = 8;

/// Bytes per block for a type code.
const fn block_bytes(t: u8) -> usize {
    match t {
        T_Q4_0 => 18,
        T_Q4_1 => 20,
        T_Q5_0 => 22,
        T_Q5_1 => 24,
        _ => 34,
    }
}

/// Loads 16 bytes of `b` from `off`.
#[inline]
#[target_feature(enable = "neon")]
fn load_u8(b: &[u8], off: usize) -> uint8x16_t {
    let s = &b[off..off + 16];
    // SAFETY: `s` holds exactly 16 readable bytes (the slice above is bounds-checked).
    unsafe { vld1q_u8(s.as_ptr()) }
}

/// Loads 16 signed bytes of `a` from `off`.
#[inline]
#[target_feature(enable = "neon")]
fn load_i8(a: &[i8], off: usize) -> int8x16_t {
    let s = &a[off..off + 16];
    // SAFETY: `s` holds exactly 16 readable bytes (the slice above is bounds-checked).
    unsafe { vld1q_s8(s.as_ptr()) }
}

/// Exact `sum(w[j] * a[j])` of 16 signed bytes each, as 4 i32 partial sums (`smull` products
/// fit i16: |w * a| <= 128 * 128).
#[inline]
#[target_feature(enable = "neon")]
fn dot16(w: int8x16_t, a: int8x16_t) -> int32x4_t {
    let lo = vmull_s8(vget_low_s8(w), vget_low_s8(a));
    let hi = vmull_high_s8(w, a);
    vpadalq_s16(vpaddlq_s16(lo), hi)
}

/// Exact `sum(w[j] * a[j])` of 32 signed bytes given as two halves each.
#[inline]
#[target_feature(enable = "neon")]
fn dot32(w0: int8x16_t, w1: int8x16_t, a0: int8x16_t, a1: int8x16_t) -> i32 {
    vaddvq_s32(vaddq_s32(dot16(w0, a0), dot16(w1, a1)))
}

/// Bytes equal to 0x10 where bit `j` of the 16-bit `bits` is set (byte `j`), else 0: the fifth
/// bit of 16 elements of a Q5 block.
#[inline]
#[target_feature(enable = "neon")]
fn fifth_bits(bits: u32) -> uint8x16_t {
    const MASK: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
    let v = vcombine_u8(vdup_n_u8(bits as u8), vdup_n_u8((bits >> 8) as u8));
    let m = load_u8(&MASK, 0);
    vandq_u8(vtstq_u8(v, m), vdupq_n_u8(0x10))
}

/// The exact integer sum `isum`, `d` and `m_eff` of one legacy block of type `T` against one
/// token's 32 activation quants, as `legacy::vec_dot_scalar` forms them (Q8_0: weights offset
/// by 128 with `m_eff = -128 d`).
#[inline]
#[target_feature(enable = "neon")]
fn block_dot<const T: u8>(blk: &[u8], a: &[i8]) -> (i32, f32, f32) {
    let (a0, a1) = (load_i8(a, 0), load_i8(a, 16));
    let d = legacy::f16_at(blk, 0);
    let lo4 = vdupq_n_u8(0x0F);
    match T {
        T_Q4_0 | T_Q4_1 | T_Q5_0 | T_Q5_1 => {
            let off = match T {
                T_Q4_0 => 2,
                T_Q4_1 => 4,
                T_Q5_0 => 6,
                _ => 8,
            };
            let q = load_u8(blk, off);
            let (mut w0, mut w1) = (vandq_u8(q, lo4), vshrq_n_u8::<4>(q));
            if T == T_Q5_0 || T == T_Q5_1 {
                let hoff = if T == T_Q5_0 { 2 } else { 4 };
                let qh =
                    u32::from_le_bytes([blk[hoff], blk[hoff + 1], blk[hoff + 2], blk[hoff + 3]]);
                w0 = vorrq_u8(w0, fifth_bits(qh & 0xFFFF));
                w1 = vorrq_u8(w1, fifth_bits(qh >> 16));
            }
            // The weights are 0..31: as signed bytes they keep their values.
            let isum = dot32(vreinterpretq_s8_u8(w0), vreinterpretq_s8_u8(w1), a0, a1);
            let m = match T {
                T_Q4_0 => -8.0 * d,
                T_Q5_0 => -16.0 * d,
                _ => legacy::f16_at(blk, 2),
            };
            (isum, d, m)
        }
        _ => {
            let (w0, w1) = (
                vreinterpretq_s8_u8(load_u8(blk, 2)),
                vreinterpretq_s8_u8(load_u8(blk, 18)),
            );
            // sum((w + 128) * a) = sum(w * a) + 128 * sum(a), all exact in i32.
            let asum = vaddlvq_s8(a0) as i32 + vaddlvq_s8(a1) as i32;
            (dot32(w0, w1, a0, a1) + 128 * asum, d, -128.0 * d)
        }
    }
}

/// `legacy::vec_dot_scalar` of one row of type `T`, with the block sums taken by NEON.
#[inline]
#[target_feature(enable = "neon")]
fn legacy_row<const T: u8>(row: &[u8], qa: &[i8], ds: &[f32]) -> f32 {
    let ts = block_bytes(T);
    let mut acc = [0.0f32; SLOTS];
    for (b, (blk, a)) in row.chunks_exact(ts).zip(qa.chunks_exact(QK)).enumerate() {
        let (isum, d, m) = block_dot::<T>(blk, a);
        let s = &mut acc[b % SLOTS];
        *s = m.mul_add(ds[2 * b + 1], (isum as f32).mul_add(d * ds[2 * b], *s));
    }
    legacy::tree_sum(&mut acc)
}

/// Dot product of one legacy row of type `ty` with one token's Q8 activations (`qa`: quants,
/// `ds`: per block `(da, sa)`): the bits of `legacy::vec_dot_scalar`.
///
/// # Panics
/// If `ty` is not a legacy type or the lengths disagree (`nb` blocks in each operand).
#[target_feature(enable = "neon")]
pub(crate) fn legacy_dot(ty: GgmlType, row: &[u8], qa: &[i8], ds: &[f32]) -> f32 {
    let nb = ds.len() / 2;
    assert!(
        row.len() == nb * ty.type_size() && qa.len() == nb * QK,
        "legacy_dot: operand lengths disagree"
    );
    match ty {
        GgmlType::Q4_0 => legacy_row::<T_Q4_0>(row, qa, ds),
        GgmlType::Q4_1 => legacy_row::<T_Q4_1>(row, qa, ds),
        GgmlType::Q5_0 => legacy_row::<T_Q5_0>(row, qa, ds),
        GgmlType::Q5_1 => legacy_row::<T_Q5_1>(row, qa, ds),
        GgmlType::Q8_0 => legacy_row::<T_Q8_0>(row, qa, ds),
        _ => unreachable!("neon::legacy_dot called with {}", ty.name()),
    }
}

/// Q4_K/Q5_K row dot (`kquants::dot_q4_k_scalar` / `dot_q5_k_scalar` with NEON sub-block sums).
#[inline]
#[target_feature(enable = "neon")]
fn dot_q45_k<const Q5: bool>(w: &[u8], a: &[BlockQ8K]) -> f32 {
    let bytes = if Q5 { Q5_K_BYTES } else { Q4_K_BYTES };
    let lo4 = vdupq_n_u8(0x0F);
    let (mut acc, mut accm) = (0.0f32, 0.0f32);
    for (blk, ab) in w.chunks_exact(bytes).zip(a) {
        let d = kquants::f16_at(blk, 0) * ab.d;
        let dmin = kquants::f16_at(blk, 2) * ab.d;
        let (sc, m) = kquants::unpack_scales_mins(&blk[4..16]);
        let (sc, m) = (sc.to_le_bytes(), m.to_le_bytes());
        let qs = if Q5 { &blk[48..] } else { &blk[16..] };
        // Q5_K: bit `i` of `qh[l]` is the fifth bit of element `l` of sub-block `i`.
        let qh = if Q5 {
            [load_u8(blk, 16), load_u8(blk, 32)]
        } else {
            [vdupq_n_u8(0); 2]
        };
        let mut sumi = 0i32;
        for j in 0..4 {
            let q = [load_u8(qs, 32 * j), load_u8(qs, 32 * j + 16)];
            let mut lo = [vandq_u8(q[0], lo4), vandq_u8(q[1], lo4)];
            let mut hi = [vshrq_n_u8::<4>(q[0]), vshrq_n_u8::<4>(q[1])];
            if Q5 {
                let one = vdupq_n_u8(1);
                let sh_lo = vdupq_n_s8(-(2 * j as i8));
                let sh_hi = vdupq_n_s8(-(2 * j as i8 + 1));
                for h in 0..2 {
                    let b0 = vandq_u8(vshlq_u8(qh[h], sh_lo), one);
                    let b1 = vandq_u8(vshlq_u8(qh[h], sh_hi), one);
                    lo[h] = vorrq_u8(lo[h], vshlq_n_u8::<4>(b0));
                    hi[h] = vorrq_u8(hi[h], vshlq_n_u8::<4>(b1));
                }
            }
            let s = |v: [uint8x16_t; 2], off: usize| {
                // 0..31 as signed bytes keep their values.
                dot32(
                    vreinterpretq_s8_u8(v[0]),
                    vreinterpretq_s8_u8(v[1]),
                    load_i8(&ab.qs, off),
                    load_i8(&ab.qs, off + 16),
                )
            };
            let (s0, s1) = (s(lo, 64 * j), s(hi, 64 * j + 32));
            sumi += s0 * sc[2 * j] as i32 + s1 * sc[2 * j + 1] as i32;
        }
        let summ = kquants::mins_dot_bsums(&m, &ab.bsums);
        acc = (sumi as f32).mul_add(d, acc);
        accm = (summ as f32).mul_add(dmin, accm);
    }
    acc - accm
}

/// `kquants::dot_q4_k_scalar` with NEON sub-block sums (same bits).
#[target_feature(enable = "neon")]
pub(crate) fn dot_q4_k(w: &[u8], a: &[BlockQ8K]) -> f32 {
    dot_q45_k::<false>(w, a)
}

/// `kquants::dot_q5_k_scalar` with NEON sub-block sums (same bits).
#[target_feature(enable = "neon")]
pub(crate) fn dot_q5_k(w: &[u8], a: &[BlockQ8K]) -> f32 {
    dot_q45_k::<true>(w, a)
}

/// `kquants::dot_q6_k_scalar` with NEON sums of 16 elements (same bits).
#[target_feature(enable = "neon")]
pub(crate) fn dot_q6_k(w: &[u8], a: &[BlockQ8K]) -> f32 {
    let lo4 = vdupq_n_u8(0x0F);
    let three = vdupq_n_u8(3);
    let m32 = vdupq_n_s8(32);
    let mut sum = 0.0f32;
    for (blk, ab) in w.chunks_exact(Q6_K_BYTES).zip(a) {
        let d = kquants::f16_at(blk, 208) * ab.d;
        let scales = &blk[192..208];
        let mut sumi = 0i32;
        for h in 0..2 {
            // ql[0..32] holds elements 0..32 (low nibbles) and 64..96 (high nibbles), ql[32..64]
            // elements 32..64 and 96..128; qh[l] holds bits 4..6 of elements l + 32k at 2k.
            let ql = [0, 16, 32, 48].map(|o| load_u8(blk, 64 * h + o));
            let qh = [0, 16].map(|o| load_u8(blk, 128 + 32 * h + o));
            for k in 0..4 {
                let base = 128 * h + 32 * k;
                let sh = vdupq_n_s8(-(2 * k as i8));
                let q = |half: usize| {
                    let l = ql[2 * (k % 2) + half];
                    let lo = if k < 2 {
                        vandq_u8(l, lo4)
                    } else {
                        vshrq_n_u8::<4>(l)
                    };
                    let hi = vshlq_n_u8::<4>(vandq_u8(vshlq_u8(qh[half], sh), three));
                    vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(lo, hi)), m32)
                };
                let s0 = vaddvq_s32(dot16(q(0), load_i8(&ab.qs, base)));
                let s1 = vaddvq_s32(dot16(q(1), load_i8(&ab.qs, base + 16)));
                let g = base / 16;
                sumi += s0 * (scales[g] as i8) as i32 + s1 * (scales[g + 1] as i8) as i32;
            }
        }
        sum = (sumi as f32).mul_add(d, sum);
    }
    sum
}

/// `q8::quantize_block` of 32 values (`d = amax / 127`, `q = round(x / d)` to nearest even,
/// saturated; returns `(da, sa)`), the same bits for every input: the maximum ignores NaNs as
/// `f32::max` does (`fmaxnm`), `fcvtns` rounds to nearest even and turns NaN into 0, the
/// narrowing saturates like `as i8`, and the sum is taken over the stored quants.
///
/// # Panics
/// If `x` or `q` does not hold 32 elements.
#[target_feature(enable = "neon")]
pub(crate) fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, f32) {
    assert!(x.len() == QK && q.len() == QK, "quantize_block: 32 values");
    let v: [float32x4_t; 8] = std::array::from_fn(|i| {
        let s = &x[4 * i..4 * i + 4];
        // SAFETY: `s` holds exactly 4 readable f32 (bounds-checked slice).
        unsafe { vld1q_f32(s.as_ptr()) }
    });
    let m = v
        .iter()
        .fold(vdupq_n_f32(0.0), |m, &x| vmaxnmq_f32(m, vabsq_f32(x)));
    let amax = vmaxnmvq_f32(m);
    let d = amax / 127.0;
    let id = vdupq_n_f32(if d != 0.0 { 1.0 / d } else { 0.0 });
    let i: [int32x4_t; 8] = v.map(|x| vcvtnq_s32_f32(vmulq_f32(x, id)));
    let h: [int16x8_t; 4] =
        std::array::from_fn(|k| vcombine_s16(vqmovn_s32(i[2 * k]), vqmovn_s32(i[2 * k + 1])));
    let b = [
        vcombine_s8(vqmovn_s16(h[0]), vqmovn_s16(h[1])),
        vcombine_s8(vqmovn_s16(h[2]), vqmovn_s16(h[3])),
    ];
    for (k, bk) in b.iter().enumerate() {
        let s = &mut q[16 * k..16 * k + 16];
        // SAFETY: `s` holds exactly 16 writable bytes (bounds-checked slice).
        unsafe { vst1q_s8(s.as_mut_ptr(), *bk) };
    }
    let sum = vaddlvq_s8(b[0]) as i32 + vaddlvq_s8(b[1]) as i32;
    (d, d * sum as f32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::kquants::QK_K;

    /// splitmix64 bytes for test data.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        fn bytes(&mut self, n: usize) -> Vec<u8> {
            (0..n).map(|_| self.next() as u8).collect()
        }
        /// Uniform in [-1, 1).
        fn unit(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }
    }

    fn f16_bits(x: f32) -> [u8; 2] {
        half::f16::from_f32(x).to_bits().to_le_bytes()
    }

    const LEGACY: [GgmlType; 5] = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
    ];

    /// Each legacy NEON row dot against its scalar twin, bit for bit: every type, rows of 1 to
    /// 19 blocks (partly filled slots, more than one round of the 8 slots), random activations
    /// and ones at the extremes (+-127, all-equal signs).
    #[test]
    fn neon_legacy_dot_matches_scalar_bits() {
        let mut rng = Rng(3);
        for ty in LEGACY {
            let ts = ty.type_size();
            for nb in [1usize, 2, 7, 8, 9, 17, 19] {
                for trial in 0..6 {
                    let mut row = rng.bytes(nb * ts);
                    for blk in row.chunks_exact_mut(ts) {
                        blk[..2].copy_from_slice(&f16_bits(rng.unit() * 0.1));
                        if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
                            blk[2..4].copy_from_slice(&f16_bits(rng.unit()));
                        }
                        if trial == 5 && ty == GgmlType::Q8_0 {
                            blk[2..].fill(0x80); // -128 everywhere
                        }
                    }
                    let qa: Vec<i8> = match trial {
                        3 => vec![127; nb * QK],
                        4 | 5 => vec![-127; nb * QK],
                        _ => rng
                            .bytes(nb * QK)
                            .iter()
                            .map(|&b| (b as i8).max(-127))
                            .collect(),
                    };
                    let ds: Vec<f32> = (0..nb)
                        .flat_map(|b| {
                            let da = (rng.unit() + 1.5) * 0.01;
                            let s: i32 = qa[b * QK..(b + 1) * QK].iter().map(|&v| v as i32).sum();
                            [da, da * s as f32]
                        })
                        .collect();
                    let want = legacy::vec_dot_scalar(ty, &row, &qa, &ds);
                    // SAFETY: NEON is part of every aarch64 CPU this builds for (and detected:
                    // `simd::tests::detected_level_is_neon_on_aarch64`).
                    let got = unsafe { legacy_dot(ty, &row, &qa, &ds) };
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{} nb={nb} trial={trial}: {got} vs scalar {want}",
                        ty.name()
                    );
                }
            }
        }
    }

    /// The K-quant NEON row dots against their scalar twins, bit for bit, on random blocks and
    /// on saturating ones (every quant field and scale at an extreme, activations at +-127).
    #[test]
    fn neon_kquant_dots_match_scalar_bits() {
        let mut rng = Rng(4);
        type Dot = fn(&[u8], &[BlockQ8K]) -> f32;
        let kinds: [(&str, usize, Dot); 3] = [
            ("Q4_K", Q4_K_BYTES, kquants::dot_q4_k_scalar),
            ("Q5_K", Q5_K_BYTES, kquants::dot_q5_k_scalar),
            ("Q6_K", Q6_K_BYTES, kquants::dot_q6_k_scalar),
        ];
        let neon = |name: &str, w: &[u8], a: &[BlockQ8K]| {
            // SAFETY: NEON is part of every aarch64 CPU this builds for.
            unsafe {
                match name {
                    "Q4_K" => dot_q4_k(w, a),
                    "Q5_K" => dot_q5_k(w, a),
                    _ => dot_q6_k(w, a),
                }
            }
        };
        for (name, bytes, scalar) in kinds {
            for nb in [1usize, 2, 5] {
                for trial in 0..8 {
                    let pattern = [0xFFu8, 0x00, 0xAA, 0x55];
                    let mut w = if trial < 4 {
                        rng.bytes(nb * bytes)
                    } else {
                        vec![pattern[trial - 4]; nb * bytes]
                    };
                    for blk in w.chunks_exact_mut(bytes) {
                        let dpos = if bytes == Q6_K_BYTES { 208 } else { 0 };
                        blk[dpos..dpos + 2].copy_from_slice(&f16_bits(rng.unit() * 0.05));
                        if bytes != Q6_K_BYTES {
                            blk[2..4].copy_from_slice(&f16_bits(rng.unit() * 0.05));
                        }
                    }
                    let x: Vec<f32> = (0..nb * QK_K)
                        .map(|i| match trial % 4 {
                            1 => 127.0,
                            2 => -127.0,
                            _ => rng.unit() * if i % 7 == 0 { 4.0 } else { 1.0 },
                        })
                        .collect();
                    let mut a = vec![BlockQ8K::ZERO; nb];
                    kquants::quantize_row_q8_k(&x, &mut a);
                    let (got, want) = (neon(name, &w, &a), scalar(&w, &a));
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{name} nb={nb} trial={trial}: {got} vs scalar {want}"
                    );
                }
            }
        }
    }

    /// The NEON Q8 block quantizer against `q8::quantize_block`, bit for bit, including zero
    /// blocks, NaNs, infinities, subnormals and values that round to a tie.
    #[test]
    fn neon_quantize_block_matches_scalar_bits() {
        let mut rng = Rng(5);
        let mut blocks: Vec<[f32; QK]> = (0..64)
            .map(|k| std::array::from_fn(|_| rng.unit() * (1 + k) as f32))
            .collect();
        blocks.push([0.0; QK]);
        blocks.push(std::array::from_fn(|j| {
            if j == 3 {
                f32::NAN
            } else {
                j as f32
            }
        }));
        blocks.push([f32::NAN; QK]);
        blocks.push(std::array::from_fn(|j| {
            if j == 9 {
                f32::INFINITY
            } else {
                1.0
            }
        }));
        blocks.push(std::array::from_fn(|j| (j as f32 - 16.0) * 1e-40));
        blocks.push(std::array::from_fn(|j| (j as f32 - 15.5) * 127.0 / 15.5));
        blocks.push(std::array::from_fn(|j| -(j as f32) * 0.5));
        for (k, x) in blocks.iter().enumerate() {
            let (mut q0, mut q1) = ([0i8; QK], [0i8; QK]);
            let want = crate::quant::q8::quantize_block(x, &mut q0);
            // SAFETY: NEON is part of every aarch64 CPU this builds for.
            let got = unsafe { quantize_block(x, &mut q1) };
            assert_eq!(q1, q0, "block {k}");
            assert_eq!(
                (got.0.to_bits(), got.1.to_bits()),
                (want.0.to_bits(), want.1.to_bits()),
                "block {k}: {got:?} vs {want:?}"
            );
        }
    }
}
