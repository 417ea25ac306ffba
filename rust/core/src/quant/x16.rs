//! The decode layout of the legacy types Q4_0, Q4_1, Q5_0 and Q8_0: 16 rows interleaved, so
//! that one token's matrix-vector product needs no horizontal reduction.
//!
//! The row-major GGUF layout makes a one-token dot product reduce each block's 32 products
//! across vector lanes before it can scale them (`avx512::dot_row2`: about 9 vector operations
//! per row and block, which on the development host made a 576-column Q4_1 matrix-vector
//! product compute-bound at ~8 GB/s per thread with the weights in L2). Here lane `i` of a
//! 512-bit vector belongs to row `i` of a group of 16: a `vpdpbusd` of 4 quant bytes of each of
//! the 16 rows against 4 broadcast activation bytes advances 16 exact block sums at once, and
//! the rows' scales load as 16 contiguous f16 values. About 40 operations per group of 16 rows
//! and one block, 2.5 per row (Q8_0: 8 quant loads and dot products instead of 4 and 8 with the
//! nibble split). Several tokens take the same layout, `TOKENS` at a time
//! (`dot16_tokens`): the quant bytes are loaded and split once per block for all of them,
//! and each token adds its 8 `vpdpbusd`s and its scaling. On the development host that beat
//! the narrow and wide tiles over the GGUF rows at every batch size (SmolLM2's step at B = 2
//! ~1.9x, B = 4 ~1.6x, B = 9 ~2x, B = 16-64 1.3-1.5x, B = 128-384 1.1-1.2x, a prompt's 512-token
//! chunks 1.07x), so the copy, made for decode, now serves prefill too.
//!
//! CPUs with AVX2 but not AVX-512 VNNI take the same layout through `dot16_tokens_avx2`:
//! 8 rows to a 256-bit vector, `maddubs` + `madd` in place of `vpdpbusd`. On an AVX2-only
//! Zen 3 host (2 threads, SmolLM2) it took prompts from 231 to 577 tok/s and decode from 89
//! to 162 tok/s against the GGUF-row kernels (`avx2::dot_row`). One to a few tokens take
//! `dot16_pass_avx2`, both halves in one pass (~1.13x SmolLM2's decode there).
//!
//! # Layout
//!
//! [`repack`] copies the first `16 * (rows / 16)` rows; the remaining rows stay in the GGUF
//! layout only. Group `g` (rows `16g..16g + 16`) and block `b` (columns `32b..32b + 32`) take
//! `16 * type_size` bytes (the same as the 16 rows' blocks) at `(g * nb + b) * 16 * type_size`:
//!
//! * `nq` chunks of 64 bytes (4 for the 4-bit types, 8 for Q8_0, whose byte `j` is element
//!   `j`, signed): chunk `k` holds bytes `4k..4k + 4` of each row's quant bytes, row
//!   by row (byte `j` of a block holds element `j` in its low nibble and `j + 16` in its high
//!   nibble, as in ggml);
//! * the 16 rows' `d` (f16, little-endian);
//! * Q4_1 only: the 16 rows' `m` (f16);
//! * Q5_0 only: the 16 rows' high bits (4 bytes a row), rearranged so that chunk `k`'s come
//!   out with one shift: bit `2k + h` of byte `j` is the high bit of element `16h + 4k + j`
//!   (`h` = 0 for the low nibbles, 1 for the high ones). Shifted to bit 4 and or-ed into the
//!   nibbles, they give the 5-bit quants (two operations per chunk and half).
//!
//! # Guarantees
//!
//! * `dot16` returns, per row, the bits of `legacy::vec_dot_scalar` on the GGUF row: the
//!   canonical order (8 slot accumulators, block `b` into slot `b % 8`, `s = m * sa + (isum *
//!   (d * da) + s)` as two fused multiply-adds, the fixed final tree), so a token's logits stay
//!   independent of the batch and of whether its rows were repacked. Tests compare the AVX-512
//!   and AVX2 kernels, their scalar twin ([`dot16_scalar`]) and the reference bit for bit.
//! * The copy costs as much memory as the repacked matrices (the model reports it); the GGUF
//!   mapping stays, for prefill's kernels and the rows of an incomplete group.

use super::{legacy, GgmlType};
use half::f16;

/// Rows per interleaved group.
pub const ROWS: usize = 16;

/// Whether [`repack`] takes `ty`.
pub fn supports(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q8_0
    )
}

/// Quant chunks of 64 bytes per (group, block); the scales follow them.
fn quant_chunks(ty: GgmlType) -> usize {
    if ty == GgmlType::Q8_0 {
        8
    } else {
        4
    }
}

/// Bytes of one (group, block).
pub fn group_block_bytes(ty: GgmlType) -> usize {
    ROWS * ty.type_size()
}

/// Offset of the quant bytes in a GGUF block.
fn quant_offset(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q4_1 => 4,
        GgmlType::Q5_0 => 6,
        _ => 2,
    }
}

/// A Q5_0 block's high bits (`qh`: bit `e` is element `e`'s) in the layout's order: bit
/// `2k + h` of byte `j` is element `16h + 4k + j`'s.
fn spread_high_bits(qh: u32) -> [u8; 4] {
    let mut out = [0u8; 4];
    for (j, byte) in out.iter_mut().enumerate() {
        for k in 0..4 {
            for h in 0..2 {
                *byte |= (((qh >> (16 * h + 4 * k + j)) & 1) as u8) << (2 * k + h);
            }
        }
    }
    out
}

/// The interleaved copy of the first `16 * (rows / 16)` rows of a `rows x cols` matrix of
/// type `ty` (`data`: its GGUF bytes, `rows` rows of `cols / 32` blocks), or `None` when `ty`
/// is not supported, there is no full group, or the allocator refuses the memory. The caller
/// has validated the shape.
pub fn repack(ty: GgmlType, rows: usize, cols: usize, data: &[u8]) -> Option<Vec<u8>> {
    if !supports(ty) || rows < ROWS {
        return None;
    }
    let (ts, nb) = (ty.type_size(), cols / legacy::QK);
    let (rb, gbb, qoff, nq) = (
        nb * ts,
        group_block_bytes(ty),
        quant_offset(ty),
        quant_chunks(ty),
    );
    assert_eq!(
        data.len(),
        rows * rb,
        "x16::repack: data is not rows x cols"
    );
    let groups = rows / ROWS;
    let mut out = Vec::new();
    out.try_reserve_exact(groups * nb * gbb).ok()?;
    out.resize(groups * nb * gbb, 0u8);
    for (gb, dst) in out.chunks_exact_mut(gbb).enumerate() {
        let (g, b) = (gb / nb, gb % nb);
        for i in 0..ROWS {
            let blk = &data[(g * ROWS + i) * rb + b * ts..][..ts];
            for k in 0..nq {
                dst[k * 64 + 4 * i..][..4].copy_from_slice(&blk[qoff + 4 * k..][..4]);
            }
            dst[64 * nq + 2 * i..][..2].copy_from_slice(&blk[..2]);
            if ty == GgmlType::Q4_1 {
                dst[64 * nq + 2 * ROWS + 2 * i..][..2].copy_from_slice(&blk[2..4]);
            }
            if ty == GgmlType::Q5_0 {
                let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                dst[64 * nq + 2 * ROWS + 4 * i..][..4].copy_from_slice(&spread_high_bits(qh));
            }
        }
    }
    Some(out)
}

/// Scalar twin of `dot16`: the dots of the 16 rows of one group (`grp`: its `nb` blocks)
/// with one token's Q8 activations (`qa`: `32 * nb` quants, `ds`: `nb` pairs `(da, sa)`), in
/// the canonical order.
pub fn dot16_scalar(ty: GgmlType, grp: &[u8], qa: &[i8], ds: &[f32]) -> [f32; ROWS] {
    let nb = ds.len() / 2;
    let (gbb, nq) = (group_block_bytes(ty), quant_chunks(ty));
    assert!(grp.len() >= nb * gbb && qa.len() >= nb * legacy::QK);
    let half = |p: &[u8]| f16::from_bits(u16::from_le_bytes([p[0], p[1]])).to_f32();
    let mut out = [0f32; ROWS];
    for (i, o) in out.iter_mut().enumerate() {
        let mut acc = [0f32; legacy::SLOTS];
        for b in 0..nb {
            let p = &grp[b * gbb..(b + 1) * gbb];
            let a = &qa[b * legacy::QK..(b + 1) * legacy::QK];
            let mut isum = 0i32;
            for k in 0..nq {
                for j in 0..4 {
                    let (byte, e) = (p[k * 64 + 4 * i + j], 4 * k + j);
                    let (mut lo, mut hi) = ((byte & 0x0F) as i32, (byte >> 4) as i32);
                    if ty == GgmlType::Q5_0 {
                        let planes = p[64 * nq + 2 * ROWS + 4 * i + j] as i32;
                        lo |= ((planes >> (2 * k)) & 1) << 4;
                        hi |= ((planes >> (2 * k + 1)) & 1) << 4;
                    }
                    isum += match ty {
                        // The canonical order's unsigned weights: q + 128, corrected by m.
                        GgmlType::Q8_0 => (byte as i8 as i32 + 128) * a[e] as i32,
                        _ => lo * a[e] as i32 + hi * a[16 + e] as i32,
                    };
                }
            }
            let d = half(&p[64 * nq + 2 * i..]);
            let m = match ty {
                GgmlType::Q4_1 => half(&p[64 * nq + 2 * ROWS + 2 * i..]),
                GgmlType::Q8_0 => -128.0 * d,
                GgmlType::Q5_0 => -16.0 * d,
                _ => -8.0 * d,
            };
            let s = &mut acc[b % legacy::SLOTS];
            *s = m.mul_add(ds[2 * b + 1], (isum as f32).mul_add(d * ds[2 * b], *s));
        }
        *o = legacy::tree_sum(&mut acc);
    }
    out
}

/// Type codes of [`dot16`].
pub(crate) const T_Q4_0: u8 = 0;
pub(crate) const T_Q4_1: u8 = 1;
pub(crate) const T_Q5_0: u8 = 5;
pub(crate) const T_Q8_0: u8 = 8;

/// Quant chunk `k` (0..4) of a 4-bit block at `p` of [`dot16`]'s layout, as two vectors of
/// unsigned values: the low nibbles (columns `4k..4k + 4` of each row's 32) and the high ones
/// (`16 + 4k..`); for Q5_0 with bit 4 of each from `planes` (planes `2k` and `2k + 1` shifted
/// to bit 4; no bit crosses a byte that is kept: the 0x10 mask keeps bit 4 only).
///
/// # Safety
/// The features in the attribute are available; `p` covers the block's quant bytes.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn quants<const T: u8>(
    p: *const u8,
    k: usize,
    planes: std::arch::x86_64::__m512i,
) -> (std::arch::x86_64::__m512i, std::arch::x86_64::__m512i) {
    use std::arch::x86_64::*;
    let lo4 = _mm512_set1_epi8(0x0F);
    // SAFETY: 64 bytes at chunk k of the block (the caller's contract); unaligned load.
    let w = unsafe { _mm512_loadu_si512(p.add(64 * k).cast()) };
    let lo = _mm512_and_si512(w, lo4);
    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(w), lo4);
    if T != T_Q5_0 {
        return (lo, hi);
    }
    let (s0, s1) = match k {
        0 => (
            _mm512_slli_epi32::<4>(planes),
            _mm512_slli_epi32::<3>(planes),
        ),
        1 => (
            _mm512_slli_epi32::<2>(planes),
            _mm512_slli_epi32::<1>(planes),
        ),
        2 => (planes, _mm512_srli_epi32::<1>(planes)),
        _ => (
            _mm512_srli_epi32::<2>(planes),
            _mm512_srli_epi32::<3>(planes),
        ),
    };
    let bit4 = _mm512_set1_epi8(0x10);
    (
        _mm512_ternarylogic_epi32::<0xF8>(lo, s0, bit4),
        _mm512_ternarylogic_epi32::<0xF8>(hi, s1, bit4),
    )
}

/// AVX-512 VNNI kernel: [`dot16_scalar`] of one group into `out`, for the type `T`
/// ([`T_Q4_0`], [`T_Q4_1`], [`T_Q5_0`] or [`T_Q8_0`]).
///
/// # Safety
/// The features in the attribute are available; `grp` covers `nb` (group, block)s of the type,
/// `qa` `32 * nb` quants and `ds` `2 * nb` floats; `out` is valid for 16 floats' writes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn dot16<const T: u8>(
    grp: *const u8,
    nb: usize,
    qa: *const i8,
    ds: *const f32,
    out: *mut f32,
) {
    use std::arch::x86_64::*;
    let (gbb, nq) = match T {
        T_Q4_0 => (288, 4),
        T_Q4_1 => (320, 4),
        T_Q5_0 => (352, 4),
        _ => (544, 8),
    };
    let flip = _mm512_set1_epi8(-128);
    let mut slots = [_mm512_setzero_ps(); legacy::SLOTS];
    let mut b0 = 0;
    // SAFETY: every block index b < nb, so reads stay inside the ranges the caller guarantees;
    // the loads are unaligned.
    unsafe {
        while b0 < nb {
            // Constant slot indices (s), so the accumulators stay in registers.
            for (s, slot) in slots.iter_mut().enumerate() {
                let b = b0 + s;
                if b >= nb {
                    break;
                }
                let p = grp.add(b * gbb);
                let a = qa.add(b * legacy::QK);
                let act = |k: usize| _mm512_set1_epi32(a.add(4 * k).cast::<i32>().read_unaligned());
                let (mut i0, mut i1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                if T == T_Q8_0 {
                    for k in (0..8).step_by(2) {
                        let w0 = _mm512_xor_si512(_mm512_loadu_si512(p.add(64 * k).cast()), flip);
                        let w1 =
                            _mm512_xor_si512(_mm512_loadu_si512(p.add(64 * k + 64).cast()), flip);
                        i0 = _mm512_dpbusd_epi32(i0, w0, act(k));
                        i1 = _mm512_dpbusd_epi32(i1, w1, act(k + 1));
                    }
                } else {
                    let planes = if T == T_Q5_0 {
                        _mm512_loadu_si512(p.add(64 * nq + 2 * ROWS).cast())
                    } else {
                        _mm512_setzero_si512()
                    };
                    for k in 0..4 {
                        let (lo, hi) = quants::<T>(p, k, planes);
                        i0 = _mm512_dpbusd_epi32(i0, lo, act(k));
                        i1 = _mm512_dpbusd_epi32(i1, hi, act(4 + k));
                    }
                }
                let isum = _mm512_add_epi32(i0, i1);
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(64 * nq).cast()));
                let m = match T {
                    T_Q4_1 => _mm512_cvtph_ps(_mm256_loadu_si256(p.add(64 * nq + 2 * ROWS).cast())),
                    T_Q4_0 => _mm512_mul_ps(d, _mm512_set1_ps(-8.0)),
                    T_Q5_0 => _mm512_mul_ps(d, _mm512_set1_ps(-16.0)),
                    _ => _mm512_mul_ps(d, _mm512_set1_ps(-128.0)),
                };
                let da = _mm512_set1_ps(*ds.add(2 * b));
                let sa = _mm512_set1_ps(*ds.add(2 * b + 1));
                let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, da), *slot);
                *slot = _mm512_fmadd_ps(m, sa, acc);
            }
            b0 += legacy::SLOTS;
        }
        for h in [4, 2, 1] {
            for j in 0..h {
                slots[j] = _mm512_add_ps(slots[j], slots[j + h]);
            }
        }
        _mm512_storeu_ps(out, slots[0]);
    }
}

/// Tokens [`dot16_tokens`] takes at once (the matmul's `Rows16` plan takes a batch this many
/// at a time, each group of rows staying in L1 meanwhile); from 3 on, the slots spill.
pub(crate) const TOKENS: usize = 8;

/// [`dot16`] of one group for `NT` tokens at once (2 to [`TOKENS`]): each block's quant bytes
/// are loaded and split into nibbles once for all of them, so a token past the first costs
/// its `vpdpbusd`s and its scaling only. Token `t`'s activations are `qa[t]`, `ds[t]`, its
/// results `out[t]`: the bits of [`dot16`] (and of [`dot16_scalar`]) for it alone. The blocks
/// are taken in order, as the weights lie (taken slot by slot, blocks `s`, `s + 8`, ..., to
/// keep fewer accumulators, the strided reads stalled on memory and B = 2 to 4 ran slower than
/// the narrow tiles); from 3 tokens on the slots spill to the stack, which costs less than the
/// weight loads and nibble splits it saves.
///
/// # Safety
/// As [`dot16`]'s, for each token's `qa[t]`, `ds[t]` and `out[t]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn dot16_tokens<const T: u8, const NT: usize>(
    grp: *const u8,
    nb: usize,
    qa: &[*const i8; NT],
    ds: &[*const f32; NT],
    out: &[*mut f32; NT],
) {
    use std::arch::x86_64::*;
    let (gbb, nq) = match T {
        T_Q4_0 => (288, 4),
        T_Q4_1 => (320, 4),
        T_Q5_0 => (352, 4),
        _ => (544, 8),
    };
    let flip = _mm512_set1_epi8(-128);
    let zero = _mm512_setzero_si512();
    let zps = _mm512_setzero_ps();
    // Not zero-filled: the first round of blocks starts each slot from zero (a 4 KiB memset
    // per call at 8 tokens cost ~3% of a prompt's time); slots past a row of fewer than 8
    // blocks are zeroed here. Every slot is written before it is read.
    let mut slots = [[std::mem::MaybeUninit::<__m512>::uninit(); legacy::SLOTS]; NT];
    for sl in slots.iter_mut() {
        for x in sl.iter_mut().skip(nb) {
            x.write(zps);
        }
    }
    // SAFETY: every block index b < nb, so reads stay inside the ranges the caller guarantees;
    // the loads are unaligned.
    unsafe {
        macro_rules! round {
            ($b0:expr, $first:expr) => {
                // Blocks in order (the weights stream), constant slot indices (s).
                for s in 0..legacy::SLOTS {
                    let b = $b0 + s;
                    if b >= nb {
                        break;
                    }
                    let p = grp.add(b * gbb);
                    let act = |t: usize, k: usize| {
                        let at = qa[t].add(b * legacy::QK + 4 * k);
                        _mm512_set1_epi32(at.cast::<i32>().read_unaligned())
                    };
                    let (mut i0, mut i1) = ([zero; NT], [zero; NT]);
                    if T == T_Q8_0 {
                        for k in (0..8).step_by(2) {
                            let w0 =
                                _mm512_xor_si512(_mm512_loadu_si512(p.add(64 * k).cast()), flip);
                            let w1 = _mm512_xor_si512(
                                _mm512_loadu_si512(p.add(64 * k + 64).cast()),
                                flip,
                            );
                            for t in 0..NT {
                                i0[t] = _mm512_dpbusd_epi32(i0[t], w0, act(t, k));
                                i1[t] = _mm512_dpbusd_epi32(i1[t], w1, act(t, k + 1));
                            }
                        }
                    } else {
                        let planes = if T == T_Q5_0 {
                            _mm512_loadu_si512(p.add(64 * nq + 2 * ROWS).cast())
                        } else {
                            zero
                        };
                        for k in 0..4 {
                            let (lo, hi) = quants::<T>(p, k, planes);
                            for t in 0..NT {
                                i0[t] = _mm512_dpbusd_epi32(i0[t], lo, act(t, k));
                                i1[t] = _mm512_dpbusd_epi32(i1[t], hi, act(t, 4 + k));
                            }
                        }
                    }
                    let d = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(64 * nq).cast()));
                    let m = match T {
                        T_Q4_1 => {
                            _mm512_cvtph_ps(_mm256_loadu_si256(p.add(64 * nq + 2 * ROWS).cast()))
                        }
                        T_Q4_0 => _mm512_mul_ps(d, _mm512_set1_ps(-8.0)),
                        T_Q5_0 => _mm512_mul_ps(d, _mm512_set1_ps(-16.0)),
                        _ => _mm512_mul_ps(d, _mm512_set1_ps(-128.0)),
                    };
                    for t in 0..NT {
                        let isum = _mm512_add_epi32(i0[t], i1[t]);
                        let da = _mm512_set1_ps(*ds[t].add(2 * b));
                        let sa = _mm512_set1_ps(*ds[t].add(2 * b + 1));
                        // The first round starts from zero; later ones from what it wrote.
                        let prev = if $first {
                            zps
                        } else {
                            slots[t][s].assume_init()
                        };
                        let f =
                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, da), prev);
                        slots[t][s].write(_mm512_fmadd_ps(m, sa, f));
                    }
                }
            };
        }
        round!(0, true);
        let mut b0 = legacy::SLOTS;
        while b0 < nb {
            round!(b0, false);
            b0 += legacy::SLOTS;
        }
        for (&o, sl) in out.iter().zip(slots.iter()) {
            // Every slot is written: by the first round (s < nb) or above (s >= nb).
            let mut sl = sl.map(|x| x.assume_init());
            for h in [4, 2, 1] {
                for j in 0..h {
                    sl[j] = _mm512_add_ps(sl[j], sl[j + h]);
                }
            }
            // SAFETY: 16 floats at `o` (the contract).
            _mm512_storeu_ps(o, sl[0]);
        }
    }
}

/// AVX2 kernel of [`dot16_tokens`], for CPUs without AVX-512
/// VNNI: the same bits (the canonical order of [`dot16_scalar`]). A 256-bit vector holds 8
/// rows, so the group is taken in two halves of 8 rows, each over all blocks (its 8 slot
/// vectors per token; the half's bytes stay in L1 for the second pass). Without `vpdpbusd`,
/// `maddubs` multiplies 4 quant bytes of each row by the 4 broadcast activation bytes into i16
/// pairs; the 4-bit types add their 8 chunks' pairs in i16 (at most 8 x 2 x 15 x 127 = 30480:
/// no overflow), Q5_0 two sums of 4 (4 x 2 x 31 x 127 = 31496), before one `madd` to i32 each.
/// Q8_0 takes `|w|` times the activation with `w`'s sign (each pair at most 2 x 128 x 127) and
/// adds `128 x sum(qa)`, the canonical `sum((w + 128) x qa)`. Integer sums are exact in any
/// order, so the f32 operations are the scalar twin's.
///
/// # Safety
/// AVX2, FMA and F16C are available; as [`dot16`]'s for each token's `qa[t]`, `ds[t]` and
/// `out[t]` (`NT` >= 1).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot16_tokens_avx2<const T: u8, const NT: usize>(
    grp: *const u8,
    nb: usize,
    qa: &[*const i8; NT],
    ds: &[*const f32; NT],
    out: &[*mut f32; NT],
) {
    use std::arch::x86_64::*;
    let (gbb, nq) = avx2_layout(T);
    let lo4 = _mm256_set1_epi8(0x0F);
    let ones16 = _mm256_set1_epi16(1);
    // SAFETY: every block index b < nb, so reads stay inside the ranges the caller guarantees
    // (half h reads bytes 32h..32h + 32 of each 64-byte chunk, and its 8 rows' scales); the
    // loads are unaligned; each `out[t]` is valid for 16 floats.
    unsafe {
        for h in 0..2 {
            // Written before they are read: by the first round of blocks (b < SLOTS), which
            // starts from zero, or below when there are fewer blocks than slots. (A zeroed
            // array here was a 2 KiB memset per call: ~2% of a prompt step.)
            let mut slots = [[std::mem::MaybeUninit::<__m256>::uninit(); legacy::SLOTS]; NT];
            for b in 0..nb {
                let p = grp.add(b * gbb);
                let s = b % legacy::SLOTS;
                let first = b < legacy::SLOTS;
                let act = |t: usize, k: usize| {
                    let at = qa[t].add(b * legacy::QK + 4 * k);
                    _mm256_set1_epi32(at.cast::<i32>().read_unaligned())
                };
                let (d, m) = half_scales::<T>(p, h);
                if T == T_Q8_0 {
                    let mut w = [_mm256_setzero_si256(); 8];
                    let mut aw = [_mm256_setzero_si256(); 8];
                    for k in 0..8 {
                        w[k] = _mm256_loadu_si256(p.add(64 * k + 32 * h).cast());
                        aw[k] = _mm256_abs_epi8(w[k]);
                    }
                    for t in 0..NT {
                        let mut i0 = _mm256_setzero_si256();
                        let mut i1 = _mm256_setzero_si256();
                        for k in (0..8).step_by(2) {
                            let p0 = _mm256_maddubs_epi16(aw[k], _mm256_sign_epi8(act(t, k), w[k]));
                            let p1 = _mm256_maddubs_epi16(
                                aw[k + 1],
                                _mm256_sign_epi8(act(t, k + 1), w[k + 1]),
                            );
                            i0 = _mm256_add_epi32(i0, _mm256_madd_epi16(p0, ones16));
                            i1 = _mm256_add_epi32(i1, _mm256_madd_epi16(p1, ones16));
                        }
                        let sa = act_sum128(qa[t].add(b * legacy::QK));
                        let isum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), sa);
                        scale(&mut slots[t][s], first, isum, d, m, ds[t].add(2 * b));
                    }
                } else {
                    let mut lo = [_mm256_setzero_si256(); 4];
                    let mut hi = [_mm256_setzero_si256(); 4];
                    let planes = if T == T_Q5_0 {
                        _mm256_loadu_si256(p.add(64 * nq + 2 * ROWS + 32 * h).cast())
                    } else {
                        _mm256_setzero_si256()
                    };
                    for k in 0..4 {
                        let w = _mm256_loadu_si256(p.add(64 * k + 32 * h).cast());
                        lo[k] = _mm256_and_si256(w, lo4);
                        hi[k] = _mm256_and_si256(_mm256_srli_epi16::<4>(w), lo4);
                        if T == T_Q5_0 {
                            (lo[k], hi[k]) = with_high_bits(lo[k], hi[k], planes, k);
                        }
                    }
                    for t in 0..NT {
                        let pair = |k: usize| {
                            _mm256_add_epi16(
                                _mm256_maddubs_epi16(lo[k], act(t, k)),
                                _mm256_maddubs_epi16(hi[k], act(t, 4 + k)),
                            )
                        };
                        let (q0, q1) = (
                            _mm256_add_epi16(pair(0), pair(1)),
                            _mm256_add_epi16(pair(2), pair(3)),
                        );
                        let isum = if T == T_Q5_0 {
                            _mm256_add_epi32(
                                _mm256_madd_epi16(q0, ones16),
                                _mm256_madd_epi16(q1, ones16),
                            )
                        } else {
                            _mm256_madd_epi16(_mm256_add_epi16(q0, q1), ones16)
                        };
                        scale(&mut slots[t][s], first, isum, d, m, ds[t].add(2 * b));
                    }
                }
            }
            for (t, sl) in slots.iter().enumerate() {
                reduce_slots(sl, nb, out[t].add(8 * h));
            }
        }
    }
}

/// [`dot16_tokens_avx2`]'s arithmetic for a few tokens with both halves of 8 rows in one pass
/// over the blocks: each chunk of quants is loaded and split per half once for all `NT` tokens
/// while each token's activation broadcast (and for Q8_0 the block's activation sum) serves
/// all 16 rows, and the loop runs once. The same bits. In interleaved A/Bs on the AVX2-only
/// Zen 3 host it ran a group of one token 1.11-1.24x faster than
/// `dot16_tokens_avx2::<_, 1>` (Q4_1 and Q8_0, in L1 and streamed from memory; SmolLM2's
/// tg128 ~1.13x), of 2 and 3 tokens 1.31-1.49x. Each token keeps 4 accumulators (two chunk
/// pairs of each half) in registers, so it pays for few tokens only ([`pass_tokens`]).
///
/// # Safety
/// AVX2, FMA and F16C are available; as [`dot16`]'s for each token's `qa[t]`, `ds[t]` and
/// `out[t]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot16_pass_avx2<const T: u8, const NT: usize>(
    grp: *const u8,
    nb: usize,
    qa: &[*const i8; NT],
    ds: &[*const f32; NT],
    out: &[*mut f32; NT],
) {
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;
    let (gbb, nq) = avx2_layout(T);
    let lo4 = _mm256_set1_epi8(0x0F);
    let ones16 = _mm256_set1_epi16(1);
    let zero = _mm256_setzero_si256();
    // Written before they are read: by the first round of blocks (b < SLOTS), which starts
    // from zero; slots past `nb` are taken as zero at the end.
    let mut slots = [[[MaybeUninit::<__m256>::uninit(); legacy::SLOTS]; 2]; NT];
    // SAFETY: every block index b < nb, so reads stay inside the ranges the caller guarantees;
    // the loads are unaligned; each `out[t]` is valid for 16 floats.
    unsafe {
        for b in 0..nb {
            let p = grp.add(b * gbb);
            let s = b % legacy::SLOTS;
            let first = b < legacy::SLOTS;
            let act = |t: usize, k: usize| {
                let at = qa[t].add(b * legacy::QK + 4 * k);
                _mm256_set1_epi32(at.cast::<i32>().read_unaligned())
            };
            let mut isum = [[zero; 2]; NT];
            if T == T_Q8_0 {
                // Even and odd chunks apart, per token and half.
                let mut acc = [[[zero; 2]; 2]; NT];
                for k in (0..8).step_by(2) {
                    let a: [[__m256i; 2]; NT] = std::array::from_fn(|t| [act(t, k), act(t, k + 1)]);
                    for h in 0..2 {
                        let w =
                            [k, k + 1].map(|kk| _mm256_loadu_si256(p.add(64 * kk + 32 * h).cast()));
                        let aw = w.map(|w| _mm256_abs_epi8(w));
                        for t in 0..NT {
                            for j in 0..2 {
                                let pr =
                                    _mm256_maddubs_epi16(aw[j], _mm256_sign_epi8(a[t][j], w[j]));
                                acc[t][j][h] =
                                    _mm256_add_epi32(acc[t][j][h], _mm256_madd_epi16(pr, ones16));
                            }
                        }
                    }
                }
                for t in 0..NT {
                    let sa = act_sum128(qa[t].add(b * legacy::QK));
                    for h in 0..2 {
                        isum[t][h] =
                            _mm256_add_epi32(_mm256_add_epi32(acc[t][0][h], acc[t][1][h]), sa);
                    }
                }
            } else {
                let planes = if T == T_Q5_0 {
                    [0, 1].map(|h| _mm256_loadu_si256(p.add(64 * nq + 2 * ROWS + 32 * h).cast()))
                } else {
                    [zero; 2]
                };
                // Chunks 0-1 and 2-3 apart, per token and half (Q5_0 widens each before the
                // sum; the 4-bit types add them in i16).
                let mut q = [[[zero; 2]; 2]; NT];
                for k in 0..4 {
                    let a: [[__m256i; 2]; NT] = std::array::from_fn(|t| [act(t, k), act(t, 4 + k)]);
                    for h in 0..2 {
                        let w = _mm256_loadu_si256(p.add(64 * k + 32 * h).cast());
                        let mut lo = _mm256_and_si256(w, lo4);
                        let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(w), lo4);
                        if T == T_Q5_0 {
                            (lo, hi) = with_high_bits(lo, hi, planes[h], k);
                        }
                        for t in 0..NT {
                            let pair = _mm256_add_epi16(
                                _mm256_maddubs_epi16(lo, a[t][0]),
                                _mm256_maddubs_epi16(hi, a[t][1]),
                            );
                            q[t][k / 2][h] = _mm256_add_epi16(q[t][k / 2][h], pair);
                        }
                    }
                }
                for t in 0..NT {
                    for h in 0..2 {
                        isum[t][h] = if T == T_Q5_0 {
                            _mm256_add_epi32(
                                _mm256_madd_epi16(q[t][0][h], ones16),
                                _mm256_madd_epi16(q[t][1][h], ones16),
                            )
                        } else {
                            _mm256_madd_epi16(_mm256_add_epi16(q[t][0][h], q[t][1][h]), ones16)
                        };
                    }
                }
            }
            for h in 0..2 {
                let (d, m) = half_scales::<T>(p, h);
                for t in 0..NT {
                    scale(
                        &mut slots[t][h][s],
                        first,
                        isum[t][h],
                        d,
                        m,
                        ds[t].add(2 * b),
                    );
                }
            }
        }
        for (t, halves) in slots.iter().enumerate() {
            for (h, sl) in halves.iter().enumerate() {
                reduce_slots(sl, nb, out[t].add(8 * h));
            }
        }
    }
}

/// Most tokens for which the matmul takes [`dot16_pass_avx2`] for weights of type `ty` (more
/// take [`dot16_tokens_avx2`]). Measured on the AVX2-only Zen 3 host (interleaved in one
/// process, a group in L1 and a whole matrix streamed): the 4-bit types 1.18-1.24x at 1 token,
/// 1.31-1.49x at 2 and 3, 0.97x at 4; Q8_0 (whose two-pass kernel keeps 16 vectors of quants
/// and their absolute values, and spills) 1.17-1.25x at 1, 1.34-1.53x at 2 to 4, 1.19-1.48x at
/// 5, 1.19-1.33x at 6, 1.04-1.14x at 8.
#[cfg(target_arch = "x86_64")]
pub(crate) fn pass_tokens(ty: GgmlType) -> usize {
    if ty == GgmlType::Q8_0 {
        6
    } else {
        3
    }
}

/// How many tokens (at most 3) at a time a group of more than [`pass_tokens`] tokens with
/// weights of type `ty` takes through [`dot16_pass_avx2`] (each turn reading the group's bytes from L1 again);
/// `None`: all at once through [`dot16_tokens_avx2`]. The same bits either way. Measured on the
/// AVX2-only Zen 3 host (2 threads, with the copy, the ways alternating in one process, median
/// time ratio against all at once): Q4_1 (1536 x 576) in pairs 1.19x at 512 tokens, 1.15x at
/// 8, 1.03x at 4 (in threes 1.13x, 1.13x, 1.05x); Q4_0 in pairs 1.23x, 1.16x, 1.14x; Q8_0
/// (49152 x 576, the head) in threes 1.32x at 512, 1.45x at 8, 1.40x at 7 (pairs 1.29-1.37x,
/// fours 1.15-1.34x). Q5_0 stays on the all-token kernel: pairs 0.97-1.06x, threes 0.70-0.84x.
#[cfg(target_arch = "x86_64")]
pub(crate) fn pass_turn(ty: GgmlType) -> Option<usize> {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => Some(2),
        GgmlType::Q8_0 => Some(3),
        _ => None,
    }
}

/// Bytes of a (group, block) and its quant chunks of 64 bytes, for the kernel type `t`.
#[cfg(target_arch = "x86_64")]
const fn avx2_layout(t: u8) -> (usize, usize) {
    match t {
        T_Q4_0 => (288, 4),
        T_Q4_1 => (320, 4),
        T_Q5_0 => (352, 4),
        _ => (544, 8),
    }
}

/// Half `h`'s 8 rows' `d` and the factor `m` of the activation sum (Q4_1's `m`; the other
/// types' offset times `d`) of the (group, block) at `p`, for the kernel type `T`.
///
/// # Safety
/// AVX2/F16C are available; `p` points at a whole (group, block) of type `T`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn half_scales<const T: u8>(
    p: *const u8,
    h: usize,
) -> (std::arch::x86_64::__m256, std::arch::x86_64::__m256) {
    use std::arch::x86_64::*;
    let nq = avx2_layout(T).1;
    // SAFETY: the scales lie inside the (group, block) (the contract); the loads are unaligned.
    let d = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.add(64 * nq + 16 * h).cast())) };
    let m = match T {
        // SAFETY: as above (Q4_1's `m` follow the `d`).
        T_Q4_1 => unsafe {
            _mm256_cvtph_ps(_mm_loadu_si128(p.add(64 * nq + 2 * ROWS + 16 * h).cast()))
        },
        T_Q4_0 => _mm256_mul_ps(d, _mm256_set1_ps(-8.0)),
        T_Q5_0 => _mm256_mul_ps(d, _mm256_set1_ps(-16.0)),
        _ => _mm256_mul_ps(d, _mm256_set1_ps(-128.0)),
    };
    (d, m)
}

/// `128 x` the sum of one block's 32 activation quants at `qa`, in every lane (Q8_0's
/// correction for taking `|w|` with `w`'s sign on the activations).
///
/// # Safety
/// AVX2 is available; 32 readable bytes at `qa`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn act_sum128(qa: *const i8) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // SAFETY: 32 readable bytes at `qa` (the contract); the load is unaligned.
    let a = unsafe { _mm256_loadu_si256(qa.cast()) };
    let ones16 = _mm256_set1_epi16(1);
    let sa = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), a), ones16);
    let sa = _mm_add_epi32(
        _mm256_castsi256_si128(sa),
        _mm256_extracti128_si256::<1>(sa),
    );
    let sa = _mm_add_epi32(sa, _mm_shuffle_epi32::<0b01_00_11_10>(sa));
    let sa = _mm_add_epi32(sa, _mm_shuffle_epi32::<0b10_11_00_01>(sa));
    _mm256_slli_epi32::<7>(_mm256_broadcastd_epi32(sa))
}

/// Q5_0's high bits into chunk `k`'s nibbles of 8 rows: plane `2k` to bit 4 of the low
/// nibbles `lo`, plane `2k + 1` of the high ones `hi` (`planes`: the half's high-bit bytes).
///
/// # Safety
/// AVX2 is available.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn with_high_bits(
    lo: std::arch::x86_64::__m256i,
    hi: std::arch::x86_64::__m256i,
    planes: std::arch::x86_64::__m256i,
    k: usize,
) -> (std::arch::x86_64::__m256i, std::arch::x86_64::__m256i) {
    use std::arch::x86_64::*;
    let pl = planes;
    let (s0, s1) = match k {
        0 => (_mm256_slli_epi32::<4>(pl), _mm256_slli_epi32::<3>(pl)),
        1 => (_mm256_slli_epi32::<2>(pl), _mm256_slli_epi32::<1>(pl)),
        2 => (pl, _mm256_srli_epi32::<1>(pl)),
        _ => (_mm256_srli_epi32::<2>(pl), _mm256_srli_epi32::<3>(pl)),
    };
    let bit4 = _mm256_set1_epi8(0x10);
    (
        _mm256_or_si256(lo, _mm256_and_si256(s0, bit4)),
        _mm256_or_si256(hi, _mm256_and_si256(s1, bit4)),
    )
}

/// The canonical final tree of 8 rows' slots (those from `nb` on taken as zero), stored as 8
/// floats at `out`.
///
/// # Safety
/// AVX2 is available; the first `min(nb, SLOTS)` slots are initialized; `out` is valid for 8
/// floats.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn reduce_slots(
    slots: &[std::mem::MaybeUninit<std::arch::x86_64::__m256>; legacy::SLOTS],
    nb: usize,
    out: *mut f32,
) {
    use std::arch::x86_64::*;
    let mut sl: [__m256; legacy::SLOTS] = std::array::from_fn(|j| {
        if j < nb {
            // SAFETY: slots below `nb` were written (the contract); the others are not read.
            unsafe { slots[j].assume_init() }
        } else {
            _mm256_setzero_ps()
        }
    });
    for hw in [4, 2, 1] {
        for j in 0..hw {
            sl[j] = _mm256_add_ps(sl[j], sl[j + hw]);
        }
    }
    // SAFETY: 8 writable floats at `out` (the contract).
    unsafe { _mm256_storeu_ps(out, sl[0]) };
}

/// The canonical slot update of 8 rows: `slot = fma(m, sa, fma(isum, d * da, slot))`, the
/// slot taken as zero when `first` (it may be uninitialized then; it is written either way).
///
/// # Safety
/// AVX2/FMA are available; `dsb` points at a block's `(da, sa)`; `slot` is initialized unless
/// `first`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scale(
    slot: &mut std::mem::MaybeUninit<std::arch::x86_64::__m256>,
    first: bool,
    isum: std::arch::x86_64::__m256i,
    d: std::arch::x86_64::__m256,
    m: std::arch::x86_64::__m256,
    dsb: *const f32,
) {
    use std::arch::x86_64::*;
    // SAFETY: two readable floats at `dsb`, and the slot initialized unless `first` (the
    // contract).
    let (da, sa, prev) = unsafe {
        let prev = if first {
            _mm256_setzero_ps()
        } else {
            slot.assume_init()
        };
        (*dsb, *dsb.add(1), prev)
    };
    let f = _mm256_fmadd_ps(
        _mm256_cvtepi32_ps(isum),
        _mm256_mul_ps(d, _mm256_set1_ps(da)),
        prev,
    );
    slot.write(_mm256_fmadd_ps(m, _mm256_set1_ps(sa), f));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::matmul::matmul_q;
    use crate::quant::q8::{quantize_acts_into, QuantizedActs};
    use crate::quant::simd::{self, SimdLevel};
    use crate::quant::QMatrix;

    /// Random GGUF rows of `ty` with nibbles over the whole range and scales of both signs.
    fn rows_of(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        let mut next = move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) as u32
        };
        let ts = ty.type_size();
        let mut data = vec![0u8; rows * cols / 32 * ts];
        for blk in data.chunks_exact_mut(ts) {
            for x in blk.iter_mut() {
                *x = next() as u8;
            }
            let d = (next() % 2000) as f32 / 1000.0 - 1.0;
            blk[..2].copy_from_slice(&f16::from_f32(d * 0.05).to_bits().to_le_bytes());
            if ty == GgmlType::Q4_1 {
                let m = (next() % 2000) as f32 / 1000.0 - 1.0;
                blk[2..4].copy_from_slice(&f16::from_f32(m * 0.2).to_bits().to_le_bytes());
            }
        }
        data
    }

    /// The several-token kernel (`avx2`: [`dot16_tokens_avx2`] with the first 1, 2, 3, 4 and
    /// 8 of the tokens `qas`/`dss`; else [`dot16_tokens`] with the first 2, 3, 4 and 8):
    /// every result with its token.
    ///
    /// # Safety
    /// AVX-512 VNNI (`avx2`: AVX2/FMA/F16C) is available; `grp` covers `nb` blocks, each
    /// token's slices `nb` blocks.
    #[cfg(target_arch = "x86_64")]
    unsafe fn tokens_kernel(
        ty: GgmlType,
        grp: *const u8,
        nb: usize,
        qas: &[Vec<i8>],
        dss: &[Vec<f32>],
        avx2: bool,
    ) -> Vec<(usize, [f32; ROWS])> {
        fn run<const NT: usize>(
            ty: GgmlType,
            grp: *const u8,
            nb: usize,
            qas: &[Vec<i8>],
            dss: &[Vec<f32>],
            avx2: bool,
        ) -> [[f32; ROWS]; NT] {
            let qa: [*const i8; NT] = std::array::from_fn(|t| qas[t].as_ptr());
            let ds: [*const f32; NT] = std::array::from_fn(|t| dss[t].as_ptr());
            let mut out = [[f32::NAN; ROWS]; NT];
            let o: [*mut f32; NT] = std::array::from_fn(|t| out[t].as_mut_ptr());
            // SAFETY: the caller's contract; `o` points at 16 floats of `out` per token.
            unsafe {
                match (ty, avx2) {
                    (GgmlType::Q4_0, false) => dot16_tokens::<T_Q4_0, NT>(grp, nb, &qa, &ds, &o),
                    (GgmlType::Q4_1, false) => dot16_tokens::<T_Q4_1, NT>(grp, nb, &qa, &ds, &o),
                    (GgmlType::Q5_0, false) => dot16_tokens::<T_Q5_0, NT>(grp, nb, &qa, &ds, &o),
                    (_, false) => dot16_tokens::<T_Q8_0, NT>(grp, nb, &qa, &ds, &o),
                    (GgmlType::Q4_0, true) => {
                        dot16_tokens_avx2::<T_Q4_0, NT>(grp, nb, &qa, &ds, &o)
                    }
                    (GgmlType::Q4_1, true) => {
                        dot16_tokens_avx2::<T_Q4_1, NT>(grp, nb, &qa, &ds, &o)
                    }
                    (GgmlType::Q5_0, true) => {
                        dot16_tokens_avx2::<T_Q5_0, NT>(grp, nb, &qa, &ds, &o)
                    }
                    (_, true) => dot16_tokens_avx2::<T_Q8_0, NT>(grp, nb, &qa, &ds, &o),
                }
            }
            out
        }
        let mut all = Vec::new();
        if avx2 {
            all.extend(
                run::<1>(ty, grp, nb, qas, dss, avx2)
                    .into_iter()
                    .enumerate(),
            );
        }
        all.extend(
            run::<2>(ty, grp, nb, qas, dss, avx2)
                .into_iter()
                .enumerate(),
        );
        all.extend(
            run::<3>(ty, grp, nb, qas, dss, avx2)
                .into_iter()
                .enumerate(),
        );
        all.extend(
            run::<4>(ty, grp, nb, qas, dss, avx2)
                .into_iter()
                .enumerate(),
        );
        all.extend(
            run::<8>(ty, grp, nb, qas, dss, avx2)
                .into_iter()
                .enumerate(),
        );
        all
    }

    /// [`dot16_pass_avx2`] with the first 1, 2 and 3 of the tokens `qas`/`dss`: every result
    /// with its token.
    ///
    /// # Safety
    /// AVX2/FMA/F16C are available; `grp` covers `nb` blocks, each token's slices `nb` blocks.
    #[cfg(target_arch = "x86_64")]
    unsafe fn pass_kernel(
        ty: GgmlType,
        grp: *const u8,
        nb: usize,
        qas: &[Vec<i8>],
        dss: &[Vec<f32>],
    ) -> Vec<(usize, [f32; ROWS])> {
        fn run<const NT: usize>(
            ty: GgmlType,
            grp: *const u8,
            nb: usize,
            qas: &[Vec<i8>],
            dss: &[Vec<f32>],
        ) -> [[f32; ROWS]; NT] {
            let qa: [*const i8; NT] = std::array::from_fn(|t| qas[t].as_ptr());
            let ds: [*const f32; NT] = std::array::from_fn(|t| dss[t].as_ptr());
            let mut out = [[f32::NAN; ROWS]; NT];
            let o: [*mut f32; NT] = std::array::from_fn(|t| out[t].as_mut_ptr());
            // SAFETY: the caller's contract; `o` points at 16 floats of `out` per token.
            unsafe {
                match ty {
                    GgmlType::Q4_0 => dot16_pass_avx2::<T_Q4_0, NT>(grp, nb, &qa, &ds, &o),
                    GgmlType::Q4_1 => dot16_pass_avx2::<T_Q4_1, NT>(grp, nb, &qa, &ds, &o),
                    GgmlType::Q5_0 => dot16_pass_avx2::<T_Q5_0, NT>(grp, nb, &qa, &ds, &o),
                    _ => dot16_pass_avx2::<T_Q8_0, NT>(grp, nb, &qa, &ds, &o),
                }
            }
            out
        }
        let mut all = Vec::new();
        all.extend(run::<1>(ty, grp, nb, qas, dss).into_iter().enumerate());
        all.extend(run::<2>(ty, grp, nb, qas, dss).into_iter().enumerate());
        all.extend(run::<3>(ty, grp, nb, qas, dss).into_iter().enumerate());
        all
    }

    /// Every row of every full group, through the scalar twin and (where the CPU has it) the
    /// AVX-512 kernels, one token and several at once, gives the reference's bits on the GGUF
    /// row; the rows past the last full group are not copied.
    #[test]
    fn groups_give_the_reference_bits() {
        let kernels = simd::coverage::simd_kernels(&[SimdLevel::Avx512Vnni]);
        let avx2 = simd::coverage::simd_kernels(&[SimdLevel::Avx2]);
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q8_0,
        ] {
            // 9 blocks: a partial round of slots; 48 blocks: SmolLM2's down projection.
            for (rows, cols) in [(16, 32), (37, 288), (32, 1536)] {
                let data = rows_of(ty, rows, cols, rows as u64 * 31 + cols as u64);
                let nb = cols / 32;
                let x16 = repack(ty, rows, cols, &data).expect("a full group");
                let gbb = group_block_bytes(ty);
                assert_eq!(x16.len(), rows / ROWS * nb * gbb);
                // TOKENS tokens of activations (token 0's are the one-token kernel's).
                let mut s = 7u64;
                let qas: Vec<Vec<i8>> = (0..TOKENS)
                    .map(|_| {
                        (0..cols)
                            .map(|_| {
                                s = s.wrapping_mul(6364136223846793005).wrapping_add(1);
                                // Quantized activations lie in -127..=127 (q8.rs), which
                                // the AVX2 kernels' sign trick needs.
                                ((s >> 56) as i8).max(-127)
                            })
                            .collect()
                    })
                    .collect();
                let dss: Vec<Vec<f32>> = (0..TOKENS)
                    .map(|t| {
                        (0..nb)
                            .flat_map(|b| {
                                let da = 0.01 + b as f32 * 1e-3 + t as f32 * 3e-3;
                                let q = &qas[t][b * 32..(b + 1) * 32];
                                let sum: i32 = q.iter().map(|&q| q as i32).sum();
                                [da, da * sum as f32]
                            })
                            .collect()
                    })
                    .collect();
                let (qa, ds) = (&qas[0], &dss[0]);
                let rb = nb * ty.type_size();
                for g in 0..rows / ROWS {
                    let grp = &x16[g * nb * gbb..(g + 1) * nb * gbb];
                    let want_of = |t: usize| -> Vec<u32> {
                        (0..ROWS)
                            .map(|i| {
                                let row = &data[(g * ROWS + i) * rb..][..rb];
                                legacy::vec_dot_scalar(ty, row, &qas[t], &dss[t]).to_bits()
                            })
                            .collect()
                    };
                    let want = want_of(0);
                    #[cfg(target_arch = "x86_64")]
                    if !kernels.is_empty() {
                        // SAFETY: AVX-512 VNNI is available (checked); every token's slices
                        // cover nb blocks.
                        unsafe {
                            let p = grp.as_ptr();
                            let got = tokens_kernel(ty, p, nb, &qas, &dss, false);
                            assert_eq!(got.len(), 2 + 3 + 4 + 8);
                            for (t, got) in got.iter() {
                                let bits = got.map(f32::to_bits).to_vec();
                                assert_eq!(
                                    bits,
                                    want_of(*t),
                                    "{ty:?} avx512, token {t} of several"
                                );
                            }
                        }
                    }
                    #[cfg(target_arch = "x86_64")]
                    if !avx2.is_empty() {
                        // SAFETY: AVX2/FMA/F16C are available (checked); every token's slices
                        // cover nb blocks.
                        unsafe {
                            let got = tokens_kernel(ty, grp.as_ptr(), nb, &qas, &dss, true);
                            assert_eq!(got.len(), 1 + 2 + 3 + 4 + 8);
                            for (t, got) in got.iter() {
                                let bits = got.map(f32::to_bits).to_vec();
                                assert_eq!(bits, want_of(*t), "{ty:?} avx2, token {t}");
                            }
                            let got = pass_kernel(ty, grp.as_ptr(), nb, &qas, &dss);
                            assert_eq!(got.len(), 1 + 2 + 3);
                            for (t, got) in got.iter() {
                                let bits = got.map(f32::to_bits).to_vec();
                                assert_eq!(bits, want_of(*t), "{ty:?} avx2 one pass, token {t}");
                            }
                        }
                    }
                    let scalar = dot16_scalar(ty, grp, qa, ds);
                    assert_eq!(scalar.map(f32::to_bits).to_vec(), want, "{ty:?} scalar");
                    #[cfg(target_arch = "x86_64")]
                    if !kernels.is_empty() {
                        let mut out = [f32::NAN; ROWS];
                        // SAFETY: AVX-512 VNNI is available (checked); the slices cover nb
                        // blocks.
                        unsafe {
                            let (p, q, d) = (grp.as_ptr(), qa.as_ptr(), ds.as_ptr());
                            match ty {
                                GgmlType::Q4_0 => dot16::<T_Q4_0>(p, nb, q, d, out.as_mut_ptr()),
                                GgmlType::Q4_1 => dot16::<T_Q4_1>(p, nb, q, d, out.as_mut_ptr()),
                                GgmlType::Q5_0 => dot16::<T_Q5_0>(p, nb, q, d, out.as_mut_ptr()),
                                _ => dot16::<T_Q8_0>(p, nb, q, d, out.as_mut_ptr()),
                            }
                        }
                        assert_eq!(out.map(f32::to_bits).to_vec(), want, "{ty:?} avx512");
                    }
                }
            }
        }
        simd::coverage::report("x16 one-token groups", &[SimdLevel::Avx512Vnni], &kernels);
        simd::coverage::report("x16 groups (avx2)", &[SimdLevel::Avx2], &avx2);
        assert!(repack(GgmlType::Q4_1, 15, 32, &rows_of(GgmlType::Q4_1, 15, 32, 1)).is_none());
        let data = rows_of(GgmlType::Q4_1, 16, 64, 2);
        let w = QMatrix::new(GgmlType::Q4_1, 16, 64, &data).unwrap();
        assert!(w.with_x16(&[0; 7]).is_err(), "a copy of the wrong length");
        let data0 = rows_of(GgmlType::Q4_0, 16, 64, 3);
        let w0 = QMatrix::new(GgmlType::Q4_0, 16, 64, &data0).unwrap();
        assert!(w0
            .with_x16(&repack(GgmlType::Q4_1, 16, 64, &data).unwrap())
            .is_err());
        assert!(repack(GgmlType::Q5_1, 16, 32, &vec![0; 16 * 24]).is_none());
    }

    /// Any number of tokens through the matmul with the copy (full groups from it, [`TOKENS`]
    /// at a time, the last rows from the GGUF rows, tasks of several groups on 1 to 3 threads)
    /// give the bits of the matmul without it (the per-row, narrow and wide kernels), for every
    /// type.
    #[test]
    fn matmul_with_the_copy_gives_the_same_bits() {
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q8_0,
        ] {
            let (rows, cols) = (101, 288);
            let data = rows_of(ty, rows, cols, 17);
            let x16 = repack(ty, rows, cols, &data).unwrap();
            let plain = QMatrix::new(ty, rows, cols, &data).unwrap();
            let copied = plain.with_x16(&x16).unwrap();
            for n in [1, 2, 3, 5, 8, 9, 17, 40] {
                let x: Vec<f32> = (0..n * cols)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
                    .collect();
                let mut a = QuantizedActs::new();
                quantize_acts_into(&mut a, &x, n, cols, ty).unwrap();
                let mut want = vec![0f32; n * rows];
                matmul_q(&plain, &a, &mut want);
                for threads in 1..=3 {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .unwrap();
                    let mut got = vec![f32::NAN; n * rows];
                    pool.install(|| matmul_q(&copied, &a, &mut got));
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{ty:?} n={n} threads={threads}");
                }
            }
        }
    }
}
