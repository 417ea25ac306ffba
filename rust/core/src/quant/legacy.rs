//! The legacy 32-element block formats Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0: byte layout,
//! dequantization (bit-exact with ggml's reference formulas) and the scalar reference dot
//! product against Q8 activations.
//!
//! Layouts (little-endian, `d`/`m` are IEEE half floats):
//! - Q4_0 (18 B): `d, qs[16]; x[j] = (lo(qs[j]) - 8) * d, x[j+16] = (hi(qs[j]) - 8) * d`
//! - Q4_1 (20 B): `d, m, qs[16]; x[j] = lo(qs[j]) * d + m, x[j+16] = hi(qs[j]) * d + m`
//! - Q5_0 (22 B): `d, qh: u32, qs[16]; bit j of qh is bit 4 of element j; value - 16, times d`
//! - Q5_1 (24 B): `d, m, qh, qs[16]; value * d + m`
//! - Q8_0 (34 B): `d, qs: [i8; 32]; x[j] = qs[j] * d`
//!
//! For dot products every block is viewed as `x[j] = d * q[j] + m_eff` with integer `q[j]`
//! (unsigned 0..31 for the 4/5-bit types, signed for Q8_0) and `m_eff` = `m`, `-8d`, `-16d`
//! or 0. Against an activation block `a[j] = da * qa[j]` with `sa = da * sum(qa)` this gives
//! `d * da * sum(q * qa) + m_eff * sa`, which is what every kernel computes.

use super::types::GgmlType;
use half::f16;

/// Elements per block.
pub const QK: usize = 32;

#[inline(always)]
pub(crate) fn f16_at(b: &[u8], off: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

#[inline(always)]
fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// True for the five legacy block types handled here.
pub fn is_legacy(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0
    )
}

/// Dequantizes whole blocks of a legacy type. Lengths are validated by the caller:
/// `src.len() == dst.len() / 32 * type_size`.
pub(crate) fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    let ts = ty.type_size();
    for (blk, y) in src.chunks_exact(ts).zip(dst.chunks_exact_mut(QK)) {
        match ty {
            GgmlType::Q4_0 => {
                let d = f16_at(blk, 0);
                for j in 0..16 {
                    let q = blk[2 + j];
                    y[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
                    y[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
                }
            }
            GgmlType::Q4_1 => {
                let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
                for j in 0..16 {
                    let q = blk[4 + j];
                    y[j] = (q & 0x0F) as f32 * d + m;
                    y[j + 16] = (q >> 4) as f32 * d + m;
                }
            }
            GgmlType::Q5_0 => {
                let d = f16_at(blk, 0);
                let qh = u32_at(blk, 2);
                for j in 0..16 {
                    let q = blk[6 + j];
                    let h0 = ((qh >> j) & 1) << 4;
                    let h1 = ((qh >> (j + 16)) & 1) << 4;
                    y[j] = (((q & 0x0F) as u32 | h0) as i32 - 16) as f32 * d;
                    y[j + 16] = (((q >> 4) as u32 | h1) as i32 - 16) as f32 * d;
                }
            }
            GgmlType::Q5_1 => {
                let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
                let qh = u32_at(blk, 4);
                for j in 0..16 {
                    let q = blk[8 + j];
                    let h0 = ((qh >> j) & 1) << 4;
                    let h1 = ((qh >> (j + 16)) & 1) << 4;
                    y[j] = ((q & 0x0F) as u32 | h0) as f32 * d + m;
                    y[j + 16] = ((q >> 4) as u32 | h1) as f32 * d + m;
                }
            }
            GgmlType::Q8_0 => {
                let d = f16_at(blk, 0);
                for j in 0..32 {
                    y[j] = (blk[2 + j] as i8) as f32 * d;
                }
            }
            _ => unreachable!("legacy::dequantize called with {}", ty.name()),
        }
    }
}

/// Unpacks one block into integer weights `q` and returns `(d, m_eff)` such that
/// `x[j] = d * q[j] + m_eff` (see the module docs).
#[inline(always)]
pub(crate) fn unpack_block(ty: GgmlType, blk: &[u8], q: &mut [i32; QK]) -> (f32, f32) {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let off = if ty == GgmlType::Q4_0 { 2 } else { 4 };
            for j in 0..16 {
                q[j] = (blk[off + j] & 0x0F) as i32;
                q[j + 16] = (blk[off + j] >> 4) as i32;
            }
            let d = f16_at(blk, 0);
            if ty == GgmlType::Q4_0 {
                (d, -8.0 * d)
            } else {
                (d, f16_at(blk, 2))
            }
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let (hoff, off) = if ty == GgmlType::Q5_0 { (2, 6) } else { (4, 8) };
            let qh = u32_at(blk, hoff);
            for j in 0..16 {
                q[j] = ((blk[off + j] & 0x0F) as u32 | (((qh >> j) & 1) << 4)) as i32;
                q[j + 16] = ((blk[off + j] >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4)) as i32;
            }
            let d = f16_at(blk, 0);
            if ty == GgmlType::Q5_0 {
                (d, -16.0 * d)
            } else {
                (d, f16_at(blk, 2))
            }
        }
        GgmlType::Q8_0 => {
            for j in 0..32 {
                q[j] = (blk[2 + j] as i8) as i32;
            }
            (f16_at(blk, 0), 0.0)
        }
        _ => unreachable!("legacy::unpack_block called with {}", ty.name()),
    }
}

/// Slots of the canonical accumulation order (see [`vec_dot_scalar`]).
pub(crate) const SLOTS: usize = 8;

/// Scalar reference dot product of one weight row with one token's Q8 activations
/// (`qa`: quants, `ds`: per block the scale `da` and `sa = da * sum(qa)`).
///
/// Canonical f32 order, followed bit for bit by every AVX-512 VNNI kernel (per-row and tile),
/// so a token's result never depends on the kernel or on the other tokens of the batch:
/// - per block `b`: exact integer `isum = sum(q * qa)` (Q8_0 uses `q + 128` with
///   `m_eff = -128 d`, the form the VNNI kernels need), then in slot `s = b % 8`:
///   `acc[s] = fma(m_eff, sa, fma(isum as f32, d * da, acc[s]))`;
/// - final: fixed pairwise tree `acc[j] += acc[j + h]` for `h = 4, 2, 1`, result `acc[0]`.
pub(crate) fn vec_dot_scalar(ty: GgmlType, row: &[u8], qa: &[i8], ds: &[f32]) -> f32 {
    let ts = ty.type_size();
    let mut q = [0i32; QK];
    let mut acc = [0.0f32; SLOTS];
    for (b, blk) in row.chunks_exact(ts).enumerate() {
        let (d, mut m) = unpack_block(ty, blk, &mut q);
        if ty == GgmlType::Q8_0 {
            q.iter_mut().for_each(|v| *v += 128);
            m = -128.0 * d;
        }
        let a = &qa[b * QK..(b + 1) * QK];
        let isum: i32 = q.iter().zip(a).map(|(&w, &x)| w * x as i32).sum();
        let s = &mut acc[b % SLOTS];
        *s = m.mul_add(ds[2 * b + 1], (isum as f32).mul_add(d * ds[2 * b], *s));
    }
    tree_sum(&mut acc)
}

/// The canonical final reduction of the slot accumulators.
#[inline]
pub(crate) fn tree_sum(acc: &mut [f32; SLOTS]) -> f32 {
    let mut h = SLOTS / 2;
    while h > 0 {
        for j in 0..h {
            acc[j] += acc[j + h];
        }
        h /= 2;
    }
    acc[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16b(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_bits().to_le_bytes()
    }

    #[test]
    fn hand_built_blocks_dequantize() {
        // Q4_0: d = 0.5, qs[j] = j | (15 - j) << 4.
        let mut b = f16b(0.5).to_vec();
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut y = [0f32; 32];
        dequantize(GgmlType::Q4_0, &b, &mut y);
        for j in 0..16 {
            assert_eq!(y[j], (j as f32 - 8.0) * 0.5);
            assert_eq!(y[j + 16], (15.0 - j as f32 - 8.0) * 0.5);
        }
        // Q4_1: d = 2, m = -3.
        let mut b = f16b(2.0).to_vec();
        b.extend(f16b(-3.0));
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        dequantize(GgmlType::Q4_1, &b, &mut y);
        for j in 0..16 {
            assert_eq!(y[j], j as f32 * 2.0 - 3.0);
            assert_eq!(y[j + 16], (15 - j) as f32 * 2.0 - 3.0);
        }
        // Q5_0: qh has bits set for odd elements -> value gains 16.
        let mut b = f16b(1.0).to_vec();
        b.extend(0xAAAA_AAAAu32.to_le_bytes());
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        dequantize(GgmlType::Q5_0, &b, &mut y);
        for j in 0..16 {
            let h = if j % 2 == 1 { 16 } else { 0 };
            assert_eq!(y[j], (j as i32 + h - 16) as f32);
            assert_eq!(y[j + 16], (15 - j as i32 + h - 16) as f32);
        }
        // Q5_1: qh = only bit 31 (element 31), d = 0.25, m = 1.
        let mut b = f16b(0.25).to_vec();
        b.extend(f16b(1.0));
        b.extend(0x8000_0000u32.to_le_bytes());
        b.extend([0xFFu8; 16]);
        dequantize(GgmlType::Q5_1, &b, &mut y);
        for j in 0..31 {
            assert_eq!(y[j], 15.0 * 0.25 + 1.0);
        }
        assert_eq!(y[31], 31.0 * 0.25 + 1.0);
        // Q8_0: signed bytes.
        let mut b = f16b(0.125).to_vec();
        b.extend((0..32).map(|j| (j as i8 - 16) as u8));
        dequantize(GgmlType::Q8_0, &b, &mut y);
        for j in 0..32 {
            assert_eq!(y[j], (j as f32 - 16.0) * 0.125);
        }
    }

    #[test]
    fn unpack_matches_dequantize() {
        let mut seed = 12345u64;
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
        ] {
            let mut blk: Vec<u8> = (0..ty.type_size())
                .map(|_| {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (seed >> 33) as u8
                })
                .collect();
            blk[..2].copy_from_slice(&f16b(0.75));
            if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
                blk[2..4].copy_from_slice(&f16b(-1.5));
            }
            let mut y = [0f32; 32];
            dequantize(ty, &blk, &mut y);
            let mut q = [0i32; 32];
            let (d, m) = unpack_block(ty, &blk, &mut q);
            for j in 0..32 {
                assert!(
                    (d * q[j] as f32 + m - y[j]).abs() < 1e-5,
                    "{} element {j}",
                    ty.name()
                );
            }
        }
    }
}
