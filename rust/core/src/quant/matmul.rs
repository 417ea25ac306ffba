//! Matrix multiplication `out[t * rows + r] = dot(W row r, token t)` on the current rayon pool.
//!
//! Four paths:
//! - the interleaved copy (Q4_0/Q4_1/Q5_0/Q8_0 weights with [`QMatrix::x16`] set, AVX2 or
//!   above, any number of tokens): chunks of whole 16-row groups, each group's 16 exact block
//!   sums advanced together per `vpdpbusd` (`x16::dot16`, `x16::dot16_tokens`; without VNNI
//!   8 rows at a time per `maddubs`, `x16::dot16_tokens_avx2`), the rows past the last full
//!   group per row as below;
//! - per-row (one token, non-VNNI CPUs, K-quant and float weights): output rows are split
//!   into about `4 * threads` chunks; each row is dotted with the tokens while it is hot in
//!   L1, by blocks of rows and tokens that stay in L2 together (`per_row_blocks`: a prompt's
//!   activations are not reread from memory for every row); legacy weights at the AVX2
//!   levels, and K-quant weights at the AVX2 level, unpack each block once for up to 4 tokens;
//! - narrow tile (legacy weights, AVX-512 VNNI, 2 to 32 tokens packed narrow by
//!   `quantize_acts`): row chunks as above; inside, 4 rows x all tokens per kernel call with
//!   each weight block unpacked once per group of tokens (`tile4`: 2 rows x 4 tokens per
//!   256-bit vector for up to 4 tokens, `tile8`: 1 row x 8 tokens, once per group of 8, for 5
//!   to 32); rows ahead are prefetched into L2, so a decode step streams the weights once;
//! - wide tile (legacy and K-quant weights, AVX-512 VNNI, activations packed for
//!   `PACK_MIN_TOKENS` (33) tokens or more, i.e. prefill): tasks own a range of rows (and of
//!   16-token groups when rows are few); inside, legacy weights take 4 rows x 32 tokens per
//!   kernel call with weights unpacked once per block and activations of the token groups
//!   staying in L1 across rows; K-quant weights take 4 rows x 16 tokens per call over rows
//!   unpacked once per task and group range (`ktile`).
//!
//! Legacy weights follow the canonical order of `legacy::vec_dot_scalar` on every path and at
//! every level (the AVX2 and AVX-512 per-row kernels, the tiles, the interleaved copy's AVX2
//! and VNNI kernels, NEON), so a token's outputs are bit-identical whatever path its batch
//! takes (batch invariance) and on every CPU. K-quants follow `kquants::dot_q4_k_scalar`'s
//! order at AVX-512 VNNI; at the AVX2 levels every token goes through the same per-row kernel
//! (at AVX2, several tokens at once with each token's one-token bits).
//! On aarch64 only the per-row path exists.
//!
//! No allocation happens inside the parallel loops.

#[cfg(target_arch = "x86_64")]
use super::legacy;
use super::q8::{self, Pack, QuantizedActs};
use super::simd::{self, SimdLevel};
use super::QMatrix;
use crate::error::{invalid, Result};
use crate::shared::SharedSlice;
use rayon::prelude::*;

/// `out[t * w.rows + r]` = dot of row `r` with token `t`, for all rows and tokens of `a`.
///
/// # Panics
/// If the shapes disagree (see [`try_matmul_q`] for a `Result`).
pub fn matmul_q(w: &QMatrix, a: &QuantizedActs, out: &mut [f32]) {
    if let Err(e) = try_matmul_q(w, a, out) {
        panic!("matmul_q: {e}");
    }
}

/// [`matmul_q`] returning an error when `a` does not match `w` or `out` has the wrong length.
pub fn try_matmul_q(w: &QMatrix, a: &QuantizedActs, out: &mut [f32]) -> Result<()> {
    matmul_level(w, a, out, simd::level())
}

/// Quantizes `x` (`n_tokens` rows of `w.cols`) for `w.ty` and multiplies.
///
/// # Panics
/// If the shapes disagree.
pub fn matmul(w: &QMatrix, x: &[f32], n_tokens: usize, out: &mut [f32]) {
    let a = q8::quantize_acts(x, n_tokens, w.cols, w.ty);
    matmul_q(w, &a, out);
}

pub(crate) fn matmul_level(
    w: &QMatrix,
    a: &QuantizedActs,
    out: &mut [f32],
    level: SimdLevel,
) -> Result<()> {
    let threads = rayon::current_num_threads().max(1);
    let out = SharedSlice::new(out);
    let job = MatmulJob::with_level(*w, a, &out, threads, level)?;
    (0..job.n_tasks()).into_par_iter().for_each(|i| {
        // SAFETY: every task index runs once; tasks write disjoint elements of `out`, which
        // nothing else touches during the loop (it is borrowed mutably by this function).
        unsafe { job.run_task(i) }
    });
    Ok(())
}

/// Asks the CPU to start loading `bytes` into cache (decode streams weights from memory; the
/// hint keeps more loads in flight than the hardware prefetcher alone).
#[inline]
fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for off in (0..bytes.len()).step_by(64) {
        // SAFETY: prefetch never faults and reads nothing architecturally; the address is
        // inside `bytes` anyway.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                bytes.as_ptr().add(off).cast(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// Like [`prefetch`] but into L2 only (`prefetcht1`): for kernels that reread a larger set of
/// activations from L1 for every row (the x86-64 tiles).
#[cfg(target_arch = "x86_64")]
#[inline]
fn prefetch_l2(bytes: &[u8]) {
    for off in (0..bytes.len()).step_by(64) {
        // SAFETY: as in `prefetch`.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                bytes.as_ptr().add(off).cast(),
            )
        };
    }
}

/// Bytes of weight rows, and of token activations, that the per-row path keeps in L2 at a
/// time.
const PER_ROW_BLOCK_BYTES: usize = 64 << 10;

/// Rows and tokens (a multiple of `DOT_ROW_TOKENS`) per block of the per-row path, for rows of
/// `row_bytes` and the activations `a`: a prompt's activations are read once per block of rows
/// from L2, not once per row from memory. Gemma 3 270M (its Q4_K/Q6_K matrices take this path
/// below AVX-512 VNNI), pp512 on the AVX2-only host, 7 interleaved rounds against one row at a
/// time over every token: median 1.07x.
fn per_row_blocks(row_bytes: usize, a: &QuantizedActs) -> (usize, usize) {
    let cols = a.cols;
    let act_bytes = match a.kind {
        q8::ActKind::Q8 => cols + 8 * (cols / 32),
        q8::ActKind::Q8K => {
            cols / super::kquants::QK_K * std::mem::size_of::<super::kquants::BlockQ8K>()
        }
        q8::ActKind::F32 => 4 * cols,
    };
    let rows = (PER_ROW_BLOCK_BYTES / row_bytes.max(1)).max(1);
    let toks = (PER_ROW_BLOCK_BYTES / act_bytes.max(1))
        .max(1)
        .next_multiple_of(super::DOT_ROW_TOKENS);
    (rows, toks)
}

/// How many rows ahead the per-row path prefetches (measured on SmolLM2 decode, 2 threads:
/// 2 rows ahead gave 175 tok/s, 4 and 8 rows ahead ~200 tok/s).
const PREFETCH_ROWS: usize = 8;

/// Lowest level of the tile kernel (legacy weights, packed activations; see `simd::coverage`).
#[cfg(test)]
pub(crate) const TILE_KERNELS: [SimdLevel; 1] = [SimdLevel::Avx512Vnni];

/// Lowest level of the narrow tile kernels (legacy weights, 2 to 32 tokens packed narrow).
#[cfg(test)]
pub(crate) const NARROW_KERNELS: [SimdLevel; 1] = [SimdLevel::Avx512Vnni];

/// Lowest level of `dot_row_tokens`'s several-token kernel (AVX2, run at the AVX2 and AVX-512
/// levels; at VNNI the one-token kernel runs per token).
#[cfg(test)]
pub(crate) const ROW_TOKENS_KERNELS: [SimdLevel; 1] = [SimdLevel::Avx2];

/// Most weight bytes one task of the interleaved-copy plan streams: a large matrix (an output
/// head of 30 MB) in about `4 * threads` tasks left one member waiting up to a whole task of
/// ~300 µs at the end of the step. At most `MAX_BYTE_TASKS` tasks a matrix, so that a step of
/// up to four matrices stays within the team's redoable steps (1,024 tasks; a 1 GB head of a
/// 7B-class model is then 256 tasks of ~4 MB).
#[cfg(target_arch = "x86_64")]
const TASK_BYTES: usize = 256 * 1024;
#[cfg(target_arch = "x86_64")]
const MAX_BYTE_TASKS: usize = 256;

enum Plan {
    /// Rows split into chunks of `chunk`; each row dotted with every token.
    PerRow { chunk: usize },
    /// Rows split into chunks of `chunk` (a multiple of 4); 4 rows at a time times all (at
    /// most 8) tokens of the narrow packed activations (either width).
    #[cfg(target_arch = "x86_64")]
    Narrow { chunk: usize },
    /// A matrix with the interleaved copy, any number of tokens: rows split into chunks of
    /// `chunk` (a multiple of 16); each full group of 16 rows from the copy, up to
    /// `x16::TOKENS` tokens at a time (`x16::dot16`, `x16::dot16_tokens`), the rows past the
    /// last full group one by one.
    #[cfg(target_arch = "x86_64")]
    Rows16 { chunk: usize },
    /// Tiles of `row_chunk` rows x `group_chunk` 16-token groups (packed VNNI activations).
    #[cfg(target_arch = "x86_64")]
    Tiled {
        row_chunk: usize,
        group_chunk: usize,
        tok_chunks: usize,
    },
}

/// One matmul split into independent tasks that write disjoint parts of the output, for
/// callers that schedule the tasks themselves (rayon above, the SPMD team of the forward pass).
pub struct MatmulJob<'a, 'o> {
    w: QMatrix<'a>,
    a: &'a QuantizedActs,
    out: &'a SharedSlice<'o, f32>,
    level: SimdLevel,
    plan: Plan,
    n_tasks: usize,
}

/// How `rows` output rows times `n` tokens are split into about `4 * threads` tasks for
/// activations packed as `pack`: the plan and its task count.
fn plan(
    rows: usize,
    row_bytes: usize,
    ty: super::GgmlType,
    n: usize,
    pack: Pack,
    x16: bool,
    threads: usize,
    level: SimdLevel,
) -> (Plan, usize) {
    let target = 4 * threads.max(1);
    if n == 0 || rows == 0 {
        return (Plan::PerRow { chunk: 1 }, 0);
    }
    #[cfg(target_arch = "x86_64")]
    {
        // The interleaved copy serves every batch size: measured against the tiles (SmolLM2,
        // 2 threads, decode steps of B sequences and 512-token prompt chunks), it was faster at
        // every size tried: B = 2 ~1.9x, 9 ~2x, 16-64 1.3-1.5x, 128-384 1.1-1.2x, and a
        // 1,536-token prompt 1.07x (no weight unpacking per task; the scales load as vectors).
        if level >= SimdLevel::Avx2 && x16 {
            let by_bytes = (rows * row_bytes).div_ceil(TASK_BYTES).min(MAX_BYTE_TASKS);
            let tasks = target.max(by_bytes);
            let chunk = rows.div_ceil(tasks).next_multiple_of(super::x16::ROWS);
            return (Plan::Rows16 { chunk }, rows.div_ceil(chunk));
        }
        let narrow = matches!(pack, Pack::Narrow4 | Pack::Narrow8);
        if level >= SimdLevel::Avx512Vnni && narrow && legacy::is_legacy(ty) {
            let chunk = rows.div_ceil(target).next_multiple_of(4).max(4);
            return (Plan::Narrow { chunk }, rows.div_ceil(chunk));
        }
        let tiled = legacy::is_legacy(ty) || super::ktile::serves(ty);
        if level >= SimdLevel::Avx512Vnni && pack == Pack::Wide && tiled {
            let groups = n.div_ceil(q8::GROUP);
            let row_chunk = rows.div_ceil(target).next_multiple_of(4).max(4);
            let row_chunks = rows.div_ceil(row_chunk);
            let tok_chunks = if row_chunks >= target {
                1
            } else {
                target.div_ceil(row_chunks).min(groups)
            };
            let group_chunk = groups.div_ceil(tok_chunks);
            let tok_chunks = groups.div_ceil(group_chunk);
            let plan = Plan::Tiled {
                row_chunk,
                group_chunk,
                tok_chunks,
            };
            return (plan, row_chunks * tok_chunks);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (ty, pack, x16, level, row_bytes);
    let chunk = rows.div_ceil(target).max(1);
    (Plan::PerRow { chunk }, rows.div_ceil(chunk))
}

impl<'a, 'o> MatmulJob<'a, 'o> {
    /// Plans `out = W a` for about `4 * threads` tasks at the detected SIMD level.
    pub fn new(
        w: QMatrix<'a>,
        a: &'a QuantizedActs,
        out: &'a SharedSlice<'o, f32>,
        threads: usize,
    ) -> Result<Self> {
        Self::with_level(w, a, out, threads, simd::level())
    }

    fn with_level(
        w: QMatrix<'a>,
        a: &'a QuantizedActs,
        out: &'a SharedSlice<'o, f32>,
        threads: usize,
        level: SimdLevel,
    ) -> Result<Self> {
        if !a.serves(w.ty) {
            return Err(invalid(format!(
                "activations were not quantized for {} weights",
                w.ty.name()
            )));
        }
        if a.cols != w.cols {
            return Err(invalid(format!(
                "activations have {} columns, weights {}",
                a.cols, w.cols
            )));
        }
        let n = a.n_tokens;
        if out.len() != n * w.rows {
            return Err(invalid(format!(
                "output holds {} values, expected {n} tokens x {} rows",
                out.len(),
                w.rows
            )));
        }
        let level = simd::cap(level);
        let (plan, n_tasks) = plan(
            w.rows,
            w.row_bytes(),
            w.ty,
            n,
            a.pack,
            w.x16.is_some(),
            threads,
            level,
        );
        Ok(MatmulJob {
            w,
            a,
            out,
            level,
            plan,
            n_tasks,
        })
    }

    /// The number of tasks `new` plans for `w` times `n_tokens` tokens of activations quantized
    /// by `quantize_acts_into` for `w`'s type — known before the activations exist (a team
    /// step must know its task count before anyone may read its inputs).
    pub fn planned_tasks(w: &QMatrix<'_>, n_tokens: usize, threads: usize) -> usize {
        let level = simd::cap(simd::level());
        let pack = match super::q8::act_kind(w.ty) {
            Some(super::q8::ActKind::Q8) => Pack::for_tokens(n_tokens, simd::level()),
            // Q8_K activations are packed for the wide tile only.
            Some(super::q8::ActKind::Q8K) => match Pack::for_tokens(n_tokens, simd::level()) {
                Pack::Wide => Pack::Wide,
                _ => Pack::None,
            },
            _ => Pack::None,
        };
        plan(
            w.rows,
            w.row_bytes(),
            w.ty,
            n_tokens,
            pack,
            w.x16.is_some(),
            threads,
            level,
        )
        .1
    }

    pub fn n_tasks(&self) -> usize {
        self.n_tasks
    }

    /// The output elements task `i` writes: rows `.0` of tokens `.1` (element `t * rows + r`).
    pub fn task_region(&self, i: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        let (rows, groups) = self.task_tile(i);
        let n = self.a.n_tokens;
        let tokens = (groups.start * q8::GROUP).min(n)..(groups.end * q8::GROUP).min(n);
        (rows, tokens)
    }

    /// Rows and 16-token groups of task `i` (per-row and narrow plans: every group).
    fn task_tile(&self, i: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        let (rows, groups) = (self.w.rows, self.a.n_tokens.div_ceil(q8::GROUP));
        match self.plan {
            Plan::PerRow { chunk } => (
                (i * chunk).min(rows)..((i + 1) * chunk).min(rows),
                0..groups,
            ),
            #[cfg(target_arch = "x86_64")]
            Plan::Narrow { chunk } | Plan::Rows16 { chunk } => (
                (i * chunk).min(rows)..((i + 1) * chunk).min(rows),
                0..groups,
            ),
            #[cfg(target_arch = "x86_64")]
            Plan::Tiled {
                row_chunk,
                group_chunk,
                tok_chunks,
            } => {
                let (rc, tc) = (i / tok_chunks, i % tok_chunks);
                let (r0, g0) = ((rc * row_chunk).min(rows), (tc * group_chunk).min(groups));
                (
                    r0..(r0 + row_chunk).min(rows),
                    g0..(g0 + group_chunk).min(groups),
                )
            }
        }
    }

    /// Computes task `i` (`i < n_tasks()`).
    ///
    /// # Safety
    /// Each task index runs at most once at a time, and no one else accesses the output while
    /// tasks run: tasks write disjoint (token, row) elements.
    pub unsafe fn run_task(&self, i: usize) {
        let (w, a) = (&self.w, self.a);
        match self.plan {
            Plan::PerRow { chunk } => {
                let (rows, n) = (w.rows, a.n_tokens);
                let end = ((i + 1) * chunk).min(rows);
                for r in i * chunk..(i * chunk + PREFETCH_ROWS).min(end) {
                    prefetch(w.row(r));
                }
                let mut vals = [0f32; super::DOT_ROW_TOKENS];
                // Blocks of rows x tokens that stay in L2 together (many tokens: a prompt).
                let (row_block, tok_block) = per_row_blocks(w.row(0).len(), a);
                for rb in (i * chunk..end).step_by(row_block) {
                    let rb_end = (rb + row_block).min(end);
                    for tb in (0..n).step_by(tok_block) {
                        let tb_end = (tb + tok_block).min(n);
                        for r in rb..rb_end {
                            let row = w.row(r);
                            if r + PREFETCH_ROWS < end && tb == 0 {
                                prefetch(w.row(r + PREFETCH_ROWS));
                            }
                            for t0 in (tb..tb_end).step_by(vals.len()) {
                                let v = &mut vals[..(tb_end - t0).min(super::DOT_ROW_TOKENS)];
                                super::dot_row_tokens(w.ty, row, a, t0, self.level, v);
                                for (k, &x) in v.iter().enumerate() {
                                    // SAFETY: r < rows and t0 + k < n: inside `out` (length
                                    // n * rows, checked when planning); row r belongs to this
                                    // task only.
                                    unsafe { self.out.write((t0 + k) * rows + r, x) };
                                }
                            }
                        }
                    }
                }
            }
            #[cfg(target_arch = "x86_64")]
            Plan::Rows16 { .. } => {
                let (r, _) = self.task_tile(i);
                // SAFETY: forwarded contract; this task owns rows r (every token).
                unsafe { rows16(w, a, self.out, r.start, r.end, self.level) };
            }
            #[cfg(target_arch = "x86_64")]
            Plan::Narrow { .. } => {
                let (r, _) = self.task_tile(i);
                let (r0, r1) = (r.start, r.end);
                // SAFETY: forwarded contract; this task owns rows r0..r1 (all tokens).
                unsafe { narrow::range(w, a, self.out, r0, r1) };
            }
            #[cfg(target_arch = "x86_64")]
            Plan::Tiled { .. } => {
                let (r, g) = self.task_tile(i);
                let (r0, r1, g0, g1) = (r.start, r.end, g.start, g.end);
                // SAFETY: forwarded contract; this task owns rows r0..r1 x groups g0..g1; the
                // activations were packed wide for `w`'s type (`serves`, checked when planning).
                unsafe {
                    if legacy::is_legacy(w.ty) {
                        tiled::range(w, a, self.out, r0, r1, g0, g1)
                    } else {
                        super::ktile::range(w, a, self.out, r0, r1, g0, g1)
                    }
                };
            }
        }
    }
}

/// Rows `r0..r1` (`r0` a multiple of 16) times the tokens of `a`: each full group of 16 rows
/// from `w.x16`, for up to `x16::TOKENS`
/// tokens at a time while the group's bytes stay in L1; the rows past the last full group row
/// by row and token by token (the same bits either way).
///
/// # Safety
/// Only at level Avx2 or above with `w.x16` set (the `Rows16` plan); the caller owns rows r0..r1
/// of `out` (every token) exclusively.
#[cfg(target_arch = "x86_64")]
unsafe fn rows16(
    w: &QMatrix,
    a: &QuantizedActs,
    out: &SharedSlice<f32>,
    r0: usize,
    r1: usize,
    level: SimdLevel,
) {
    use super::x16::{group_block_bytes, ROWS, TOKENS};
    let x16 = w.x16.expect("the Rows16 plan has the interleaved copy");
    let (rows, n, nb) = (w.rows, a.n_tokens, w.cols / 32);
    let gbb = nb * group_block_bytes(w.ty);
    let full = (rows / ROWS * ROWS).min(r1);
    // The tokens' quants and scales (Q8 activations: `serves` was checked).
    let (qs, ds) = (&a.qs[..n * w.cols], &a.ds[..2 * n * nb]);
    let vnni = level >= SimdLevel::Avx512Vnni;
    let mut r = r0;
    while r + ROWS <= full {
        let grp = &x16[r / ROWS * gbb..][..gbb];
        for t0 in (0..n).step_by(TOKENS) {
            let nt = (n - t0).min(TOKENS);
            let qa = |t: usize| qs[(t0 + t) * w.cols..].as_ptr();
            let da = |t: usize| ds[2 * (t0 + t) * nb..].as_ptr();
            // SAFETY: the plan is taken at level Avx2 or above (never above detection), the
            // VNNI kernels at level Avx512Vnni only;
            // `grp` covers the group's nb blocks, each token's quants and scales its nb
            // blocks; rows r..r + 16 of tokens t0..t0 + nt are the caller's.
            unsafe {
                let g = grp.as_ptr();
                match nt {
                    1 => group_tokens::<1>(w.ty, g, nb, qa, da, out, rows, r, t0, vnni),
                    2 => group_tokens::<2>(w.ty, g, nb, qa, da, out, rows, r, t0, vnni),
                    3 => group_tokens::<3>(w.ty, g, nb, qa, da, out, rows, r, t0, vnni),
                    4 => group_tokens::<4>(w.ty, g, nb, qa, da, out, rows, r, t0, vnni),
                    5 => group_tokens::<5>(w.ty, g, nb, qa, da, out, rows, r, t0, vnni),
                    6 => group_tokens::<6>(w.ty, g, nb, qa, da, out, rows, r, t0, vnni),
                    7 => group_tokens::<7>(w.ty, g, nb, qa, da, out, rows, r, t0, vnni),
                    _ => group_tokens::<8>(w.ty, g, nb, qa, da, out, rows, r, t0, vnni),
                }
            }
        }
        r += ROWS;
    }
    for r in r..r1 {
        for t in 0..n {
            // Not `dot_row_tokens`: a second caller makes the compiler stop inlining it into
            // the per-row path, which then measured ~15% slower on Gemma 3's decode.
            let v = super::dot_row(w.ty, w.row(r), a, t, level);
            // SAFETY: r < rows, t < n: inside `out`; the caller owns these rows.
            unsafe { out.write(t * rows + r, v) };
        }
    }
}

/// One group of 16 rows (`grp`, `nb` blocks of type `ty` in the interleaved layout) times the
/// `NT` tokens `t0..t0 + NT` (token `t0 + t`'s quants at `qa(t)`, scales at `ds(t)`), written
/// to rows `r..r + 16` of those tokens in `out` (`rows` a token).
///
/// # Safety
/// AVX2/FMA/F16C are available, and AVX-512 VNNI when `vnni`; `grp` covers `nb` blocks, each
/// token's quants and scales `nb`
/// blocks; the caller owns those elements of `out`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[inline]
unsafe fn group_tokens<const NT: usize>(
    ty: super::GgmlType,
    grp: *const u8,
    nb: usize,
    qa: impl Fn(usize) -> *const i8,
    ds: impl Fn(usize) -> *const f32,
    out: &SharedSlice<f32>,
    rows: usize,
    r: usize,
    t0: usize,
    vnni: bool,
) {
    use super::x16::{
        dot16, dot16_tokens, dot16_tokens_avx2, pass_tokens, pass_turn, T_Q4_0, T_Q4_1, T_Q5_0,
        T_Q8_0,
    };
    // Rows r..r + 16 of token t0 + t: contiguous, written by the kernel's one store.
    debug_assert!((t0 + NT - 1) * rows + r + 16 <= out.len());
    let o: [*mut f32; NT] = std::array::from_fn(|t| out.ptr_at((t0 + t) * rows + r));
    // SAFETY: the caller's contract; it owns those 16 floats of each token.
    unsafe {
        if !vnni && NT <= pass_tokens(ty) {
            pass_turn_tokens::<NT>(ty, grp, nb, 0, &qa, &ds, &o);
        } else if let Some(turn) = pass_turn(ty).filter(|_| !vnni) {
            // A few tokens at a time through the one-pass kernel (`pass_turn`).
            let mut t = 0;
            while t < NT {
                // `pass_turn` is at most 3: the arms below cover every k.
                let k = (NT - t).min(turn).min(3);
                match k {
                    1 => pass_turn_tokens::<1>(ty, grp, nb, t, &qa, &ds, &o),
                    2 => pass_turn_tokens::<2>(ty, grp, nb, t, &qa, &ds, &o),
                    _ => pass_turn_tokens::<3>(ty, grp, nb, t, &qa, &ds, &o),
                }
                t += k;
            }
        } else if !vnni {
            let q: [*const i8; NT] = std::array::from_fn(&qa);
            let d: [*const f32; NT] = std::array::from_fn(&ds);
            match ty {
                super::GgmlType::Q4_0 => dot16_tokens_avx2::<T_Q4_0, NT>(grp, nb, &q, &d, &o),
                super::GgmlType::Q4_1 => dot16_tokens_avx2::<T_Q4_1, NT>(grp, nb, &q, &d, &o),
                super::GgmlType::Q5_0 => dot16_tokens_avx2::<T_Q5_0, NT>(grp, nb, &q, &d, &o),
                _ => dot16_tokens_avx2::<T_Q8_0, NT>(grp, nb, &q, &d, &o),
            }
        } else if NT == 1 {
            let (q, d) = (qa(0), ds(0));
            match ty {
                super::GgmlType::Q4_0 => dot16::<T_Q4_0>(grp, nb, q, d, o[0]),
                super::GgmlType::Q4_1 => dot16::<T_Q4_1>(grp, nb, q, d, o[0]),
                super::GgmlType::Q5_0 => dot16::<T_Q5_0>(grp, nb, q, d, o[0]),
                _ => dot16::<T_Q8_0>(grp, nb, q, d, o[0]),
            }
        } else {
            let q: [*const i8; NT] = std::array::from_fn(&qa);
            let d: [*const f32; NT] = std::array::from_fn(&ds);
            match ty {
                super::GgmlType::Q4_0 => dot16_tokens::<T_Q4_0, NT>(grp, nb, &q, &d, &o),
                super::GgmlType::Q4_1 => dot16_tokens::<T_Q4_1, NT>(grp, nb, &q, &d, &o),
                super::GgmlType::Q5_0 => dot16_tokens::<T_Q5_0, NT>(grp, nb, &q, &d, &o),
                _ => dot16_tokens::<T_Q8_0, NT>(grp, nb, &q, &d, &o),
            }
        }
    }
}

/// [`dot16_pass_avx2`] for tokens `t..t + K` of a [`group_tokens`] call (`o`: every token's
/// output pointer): all of them, or one turn of a few.
///
/// # Safety
/// AVX2, FMA and F16C are available; as [`group_tokens`] for those tokens.
#[cfg(target_arch = "x86_64")]
#[inline]
unsafe fn pass_turn_tokens<const K: usize>(
    ty: super::GgmlType,
    grp: *const u8,
    nb: usize,
    t: usize,
    qa: &impl Fn(usize) -> *const i8,
    ds: &impl Fn(usize) -> *const f32,
    o: &[*mut f32],
) {
    use super::x16::{dot16_pass_avx2, T_Q4_0, T_Q4_1, T_Q5_0, T_Q8_0};
    let q: [*const i8; K] = std::array::from_fn(|i| qa(t + i));
    let d: [*const f32; K] = std::array::from_fn(|i| ds(t + i));
    let out: [*mut f32; K] = std::array::from_fn(|i| o[t + i]);
    // SAFETY: the caller's contract, for these K tokens.
    unsafe {
        match ty {
            super::GgmlType::Q4_0 => dot16_pass_avx2::<T_Q4_0, K>(grp, nb, &q, &d, &out),
            super::GgmlType::Q4_1 => dot16_pass_avx2::<T_Q4_1, K>(grp, nb, &q, &d, &out),
            super::GgmlType::Q5_0 => dot16_pass_avx2::<T_Q5_0, K>(grp, nb, &q, &d, &out),
            _ => dot16_pass_avx2::<T_Q8_0, K>(grp, nb, &q, &d, &out),
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod narrow {
    use super::*;
    use crate::quant::avx2::{T_Q4_0, T_Q4_1, T_Q5_0, T_Q5_1, T_Q8_0};
    use crate::quant::avx512::{tile4, tile8, NARROW4_LANES, NARROW_LANES};
    use crate::quant::GgmlType;

    /// How many rows ahead the narrow path prefetches, into L2 (see `range_t`).
    const PREFETCH_ROWS_NARROW: usize = 16;

    /// # Safety
    /// Only at level Avx512Vnni with narrow packed activations; the caller owns rows r0..r1 of
    /// `out` (every token) exclusively.
    pub(super) unsafe fn range(
        w: &QMatrix,
        a: &QuantizedActs,
        out: &SharedSlice<f32>,
        r0: usize,
        r1: usize,
    ) {
        // SAFETY: forwarded contract.
        unsafe {
            match w.ty {
                GgmlType::Q4_0 => range_t::<T_Q4_0>(w, a, out, r0, r1),
                GgmlType::Q4_1 => range_t::<T_Q4_1>(w, a, out, r0, r1),
                GgmlType::Q5_0 => range_t::<T_Q5_0>(w, a, out, r0, r1),
                GgmlType::Q5_1 => range_t::<T_Q5_1>(w, a, out, r0, r1),
                _ => range_t::<T_Q8_0>(w, a, out, r0, r1),
            }
        }
    }

    /// Rows `r0..r1`: 4-row kernel calls, then the remaining rows; rows ahead are prefetched
    /// into L2 (decode streams the weights from memory; prefetching into L1 measured slower,
    /// as the lines evict the activations the kernel rereads for every row).
    unsafe fn range_t<const T: u8>(
        w: &QMatrix,
        a: &QuantizedActs,
        out: &SharedSlice<f32>,
        r0: usize,
        r1: usize,
    ) {
        let pf = PREFETCH_ROWS_NARROW;
        for r in r0..(r0 + pf).min(r1) {
            prefetch_l2(w.row(r));
        }
        let four = a.pack == Pack::Narrow4;
        let mut r = r0;
        while r + 4 <= r1 {
            for p in (r + pf).min(r1)..(r + 4 + pf).min(r1) {
                prefetch_l2(w.row(p));
            }
            // SAFETY: forwarded contract; rows r..r+4 lie in r0..r1.
            unsafe {
                if four {
                    call4::<T, 2>(w, a, out, r, 4)
                } else {
                    call8::<T, 4>(w, a, out, r)
                }
            };
            r += 4;
        }
        while r < r1 {
            // SAFETY: forwarded contract; rows r..min(r + 2, r1) lie in r0..r1.
            unsafe {
                if four {
                    call4::<T, 1>(w, a, out, r, (r1 - r).min(2))
                } else {
                    call8::<T, 1>(w, a, out, r)
                }
            };
            r += if four { 2 } else { 1 };
        }
    }

    /// Rows `r..r + 4` (or `r + 1`) with the 8-lane kernel, one call per group of 8 tokens
    /// (the rows stay in L1 across the groups).
    #[inline]
    unsafe fn call8<const T: u8, const R: usize>(
        w: &QMatrix,
        a: &QuantizedActs,
        out: &SharedSlice<f32>,
        r: usize,
    ) {
        let nb = w.cols / 32;
        let n = a.n_tokens;
        let rows: [*const u8; R] = std::array::from_fn(|i| w.row(r + i).as_ptr());
        for g in 0..n.div_ceil(NARROW_LANES) {
            let mut res = [[0f32; NARROW_LANES]; R];
            // The slices prove the packed buffers cover group g's `nb` blocks (panics
            // otherwise): 8 lines of 32 bytes per block are 4 `Line`s.
            let lines = &a.packed[g * nb * 4..(g + 1) * nb * 4];
            let pd = &a.pd[g * nb * NARROW_LANES..(g + 1) * nb * NARROW_LANES];
            let ps = &a.ps[g * nb * NARROW_LANES..(g + 1) * nb * NARROW_LANES];
            // SAFETY: the caller only takes this path at level Avx512Vnni (detected); each row
            // slice has `nb` blocks of type T (QMatrix invariant); the packed slices above
            // cover them and `Line`s are 64-byte aligned.
            unsafe {
                tile8::<T, R>(
                    &rows,
                    nb,
                    lines.as_ptr().cast(),
                    pd.as_ptr(),
                    ps.as_ptr(),
                    &mut res,
                )
            };
            for (i, lanes) in res.iter().enumerate() {
                for (lane, &v) in lanes.iter().enumerate() {
                    let t = g * NARROW_LANES + lane;
                    if t < n {
                        // SAFETY: t < n and r + i < rows: inside `out`; the caller owns
                        // these rows.
                        unsafe { out.write(t * w.rows + r + i, v) };
                    }
                }
            }
        }
    }

    /// Rows `r..r + count` (`count <= 2 * P`) with the 4-lane kernel, in pairs; a missing
    /// second row of the last pair repeats the first and is not written.
    #[inline]
    unsafe fn call4<const T: u8, const P: usize>(
        w: &QMatrix,
        a: &QuantizedActs,
        out: &SharedSlice<f32>,
        r: usize,
        count: usize,
    ) {
        let nb = w.cols / 32;
        let row = |i: usize| w.row(r + i.min(count - 1)).as_ptr();
        let rows: [[*const u8; 2]; P] = std::array::from_fn(|p| [row(2 * p), row(2 * p + 1)]);
        let mut res = [[0f32; 2 * NARROW4_LANES]; P];
        // 8 lines of 16 bytes per block are 2 `Line`s.
        let lines = &a.packed[..nb * 2];
        let pd = &a.pd[..nb * NARROW4_LANES];
        let ps = &a.ps[..nb * NARROW4_LANES];
        // SAFETY: as in `call8`.
        unsafe {
            tile4::<T, P>(
                &rows,
                nb,
                lines.as_ptr().cast(),
                pd.as_ptr(),
                ps.as_ptr(),
                &mut res,
            )
        };
        let n = a.n_tokens;
        for i in 0..count {
            for t in 0..n {
                let v = res[i / 2][(i % 2) * NARROW4_LANES + t];
                // SAFETY: t < n and r + i < rows: inside `out`; the caller owns these rows.
                unsafe { out.write(t * w.rows + r + i, v) };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod tiled {
    use super::*;
    use crate::quant::avx2::{T_Q4_0, T_Q4_1, T_Q5_0, T_Q5_1, T_Q8_0};
    use crate::quant::avx512::{store_transposed, tile, tile_unpacked, unpack_ublock, UBlock};
    use crate::quant::q8::GROUP;
    use crate::quant::GgmlType;

    /// Rows per inner block: their weights stay in L1/L2 while all token groups pass over them.
    const ROW_BLOCK: usize = 64;

    /// # Safety
    /// Only at level Avx512Vnni with packed activations; the caller owns rows r0..r1 x groups
    /// g0..g1 of `out` exclusively.
    pub(super) unsafe fn range(
        w: &QMatrix,
        a: &QuantizedActs,
        out: &SharedSlice<f32>,
        r0: usize,
        r1: usize,
        g0: usize,
        g1: usize,
    ) {
        // SAFETY: forwarded contract.
        unsafe {
            match w.ty {
                GgmlType::Q4_0 => range_t::<T_Q4_0>(w, a, out, r0, r1, g0, g1),
                GgmlType::Q4_1 => range_t::<T_Q4_1>(w, a, out, r0, r1, g0, g1),
                GgmlType::Q5_0 => range_t::<T_Q5_0>(w, a, out, r0, r1, g0, g1),
                GgmlType::Q5_1 => range_t::<T_Q5_1>(w, a, out, r0, r1, g0, g1),
                _ => range_t::<T_Q8_0>(w, a, out, r0, r1, g0, g1),
            }
        }
    }

    /// Most blocks per row (2,048 columns) of the unpacked-row path.
    const UNPACK_MAX_BLOCKS: usize = 64;

    unsafe fn range_t<const T: u8>(
        w: &QMatrix,
        a: &QuantizedActs,
        out: &SharedSlice<f32>,
        r0: usize,
        r1: usize,
        g0: usize,
        g1: usize,
    ) {
        if T != T_Q8_0 && w.cols / 32 <= UNPACK_MAX_BLOCKS {
            // SAFETY: forwarded contract.
            unsafe { range_unpacked::<T>(w, a, out, r0, r1, g0, g1) };
            return;
        }
        let mut rb = r0;
        while rb < r1 {
            let rb1 = (rb + ROW_BLOCK).min(r1);
            // The next row block into L2 while this one is computed (decode of 9+ sequences
            // streams the weights: 12% less CPU per step at 16 sequences, 8% at 32).
            for r in rb1..(rb1 + ROW_BLOCK).min(r1) {
                prefetch_l2(w.row(r));
            }
            let mut g = g0;
            while g < g1 {
                if g + 2 <= g1 {
                    // SAFETY: forwarded contract; rows rb..rb1 x groups g..g+2 are owned.
                    unsafe { rows_t::<T, 2>(w, a, out, rb, rb1, g) };
                    g += 2;
                } else {
                    // SAFETY: forwarded contract; rows rb..rb1 x group g are owned.
                    unsafe { rows_t::<T, 1>(w, a, out, rb, rb1, g) };
                    g += 1;
                }
            }
            rb = rb1;
        }
    }

    /// Rows `r0..r1` x groups `g0..g1` of 4- and 5-bit weights with rows of at most
    /// `UNPACK_MAX_BLOCKS` blocks: every 4 rows are unpacked once, then `tile_unpacked` runs
    /// them over each group.
    ///
    /// # Safety
    /// As [`range`].
    unsafe fn range_unpacked<const T: u8>(
        w: &QMatrix,
        a: &QuantizedActs,
        out: &SharedSlice<f32>,
        r0: usize,
        r1: usize,
        g0: usize,
        g1: usize,
    ) {
        // The unpacked rows live in a per-thread buffer: zeroing a 16 KiB one on the stack at
        // every call took ~3.5% of a prompt step (a task is a few rows of one matrix).
        thread_local! {
            static UNPACKED: std::cell::RefCell<Vec<UBlock>> =
                const { std::cell::RefCell::new(Vec::new()) };
        }
        UNPACKED.with_borrow_mut(|buf| {
            // SAFETY: forwarded contract.
            unsafe { range_unpacked_in::<T>(w, a, out, r0, r1, g0, g1, buf) }
        });
    }

    /// [`range_unpacked`] with `buf` for the unpacked rows (grown to 4 rows of blocks).
    ///
    /// # Safety
    /// As [`range`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn range_unpacked_in<const T: u8>(
        w: &QMatrix,
        a: &QuantizedActs,
        out: &SharedSlice<f32>,
        r0: usize,
        r1: usize,
        g0: usize,
        g1: usize,
        buf: &mut Vec<UBlock>,
    ) {
        let nb = w.cols / 32;
        let ts = w.ty.type_size();
        if buf.len() < 4 * nb {
            buf.resize(4 * nb, UBlock::ZERO);
        }
        let n = a.n_tokens;
        let mut r = r0;
        while r < r1 {
            let rn = (r1 - r).min(4);
            for (i, rowbuf) in buf.chunks_exact_mut(nb).enumerate().take(rn) {
                let row = w.row(r + i);
                for (b, ub) in rowbuf.iter_mut().enumerate() {
                    let blk = &row[b * ts..(b + 1) * ts];
                    // SAFETY: level Avx512Vnni (caller); `blk` is one whole block of type T,
                    // which is not Q8_0 here.
                    unsafe { unpack_ublock::<T>(blk.as_ptr(), ub) };
                }
            }
            let rows: [*const UBlock; 4] =
                std::array::from_fn(|i| buf[i.min(rn - 1) * nb..].as_ptr());
            for g in g0..g1 {
                let off = g * nb;
                // The slices prove the packed buffers cover group g (panics otherwise).
                let lines = &a.packed[off * 8..(off + nb) * 8];
                let pd = &a.pd[off * GROUP..(off + nb) * GROUP];
                let ps = &a.ps[off * GROUP..(off + nb) * GROUP];
                let mut res = [[0f32; 16]; 4];
                let (l, d, s) = (lines.as_ptr(), pd.as_ptr(), ps.as_ptr());
                // SAFETY: the caller only takes this path at level Avx512Vnni (detected); the
                // first `rn` rows of `rows` hold `nb` unpacked blocks; the slices above cover
                // group g's `nb` blocks.
                unsafe {
                    match rn {
                        4 => tile_unpacked::<4>(&rows, nb, l, d, s, &mut res),
                        3 => tile_unpacked::<3>(&rows, nb, l, d, s, &mut res),
                        2 => tile_unpacked::<2>(&rows, nb, l, d, s, &mut res),
                        _ => tile_unpacked::<1>(&rows, nb, l, d, s, &mut res),
                    }
                };
                let lanes = GROUP.min(n - g * GROUP);
                let at = g * GROUP * w.rows + r;
                assert!(at + (lanes - 1) * w.rows + rn <= out.len());
                // SAFETY: level Avx512Vnni (caller); tokens g * 16 + 0..lanes (< n) x rows
                // r..r+rn lie inside `out` (asserted) and the caller owns this tile exclusively.
                unsafe { store_transposed(&res, rn, lanes, out.ptr_at(at), w.rows) };
            }
            r += rn;
        }
    }

    /// Rows `r0..r1` of `G` token groups from `g`: 4-row kernel calls, then single rows.
    ///
    /// # Safety
    /// As [`range`]: the caller owns rows r0..r1 x groups g..g+G.
    unsafe fn rows_t<const T: u8, const G: usize>(
        w: &QMatrix,
        a: &QuantizedActs,
        out: &SharedSlice<f32>,
        r0: usize,
        r1: usize,
        g: usize,
    ) {
        let mut r = r0;
        while r + 4 <= r1 {
            // SAFETY: forwarded contract; rows r..r+4 lie in r0..r1.
            unsafe { call::<T, 4, G>(w, a, out, r, g) };
            r += 4;
        }
        while r < r1 {
            // SAFETY: forwarded contract; row r lies in r0..r1.
            unsafe { call::<T, 1, G>(w, a, out, r, g) };
            r += 1;
        }
    }

    #[inline]
    unsafe fn call<const T: u8, const R: usize, const G: usize>(
        w: &QMatrix,
        a: &QuantizedActs,
        out: &SharedSlice<f32>,
        r: usize,
        g: usize,
    ) {
        let nb = w.cols / 32;
        let rows: [*const u8; R] = std::array::from_fn(|i| w.row(r + i).as_ptr());
        let mut res = [[[0f32; 16]; G]; R];
        let off = g * nb;
        // The slices prove the packed buffers cover groups g..g+G (panics otherwise).
        let lines = &a.packed[off * 8..(off + G * nb) * 8];
        let pd = &a.pd[off * GROUP..(off + G * nb) * GROUP];
        let ps = &a.ps[off * GROUP..(off + G * nb) * GROUP];
        // SAFETY: the caller only takes this path at level Avx512Vnni (detected); each row slice
        // has `nb` blocks of type T (QMatrix invariant); the packed slices above cover G groups.
        unsafe {
            tile::<T, R, G>(
                &rows,
                nb,
                lines.as_ptr(),
                pd.as_ptr(),
                ps.as_ptr(),
                &mut res,
            )
        };
        let n = a.n_tokens;
        let total_rows = w.rows;
        for (i, rr) in res.iter().enumerate() {
            for (gi, lanes) in rr.iter().enumerate() {
                for (lane, &v) in lanes.iter().enumerate() {
                    let t = (g + gi) * GROUP + lane;
                    if t < n {
                        // SAFETY: t < n and r + i < rows: inside `out`; the caller owns this
                        // tile exclusively.
                        unsafe { out.write(t * total_rows + r + i, v) };
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::q8::quantize_acts_impl;
    use crate::quant::{dequantize, GgmlType};
    use crate::quant::{legacy, DOT_ROW_TOKENS};
    use half::f16;

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            self.0 >> 33
        }
        fn f(&mut self) -> f32 {
            (self.next() % 1_000_000) as f32 / 500_000.0 - 1.0
        }
    }

    /// Random legacy weights with sane scales (random bytes elsewhere).
    fn random_weights(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
        let ts = ty.type_size();
        let mut data: Vec<u8> = (0..rows * cols / 32 * ts)
            .map(|_| rng.next() as u8)
            .collect();
        for blk in data.chunks_exact_mut(ts) {
            blk[..2].copy_from_slice(&f16::from_f32(rng.f() * 0.05).to_bits().to_le_bytes());
            if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
                blk[2..4].copy_from_slice(&f16::from_f32(rng.f() * 0.2).to_bits().to_le_bytes());
            }
        }
        data
    }

    const LEGACY: [GgmlType; 5] = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
    ];

    /// `avx512::store_transposed` against its scalar twin: every row count and lane count,
    /// a stride wider than the rows, and nothing written outside the tile.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn store_transposed_matches_scalar_twin() {
        use crate::quant::avx512::{store_transposed, store_transposed_scalar};
        use crate::quant::simd::{coverage, SimdLevel};
        const STARTS: [SimdLevel; 1] = [SimdLevel::Avx512Vnni];
        let kernels = coverage::simd_kernels(&STARTS);
        let mut rng = Rng(3);
        let mut res = [[0f32; 16]; 4];
        for row in res.iter_mut() {
            for v in row.iter_mut() {
                *v = rng.f();
            }
        }
        let stride = 7;
        for rows in 1..=4 {
            for lanes in 1..=16 {
                let mut want = vec![-9.0f32; 16 * stride + 3];
                // SAFETY: lanes x rows at stride 7 from index 1 lie inside the buffer.
                unsafe {
                    store_transposed_scalar(&res, rows, lanes, want.as_mut_ptr().add(1), stride)
                };
                for l in 0..16 {
                    for i in 0..stride {
                        let v = want[1 + l * stride + i];
                        assert_eq!(v == -9.0, l >= lanes || i >= rows, "twin wrote {l} {i}");
                    }
                }
                for _ in &kernels {
                    let mut got = vec![-9.0f32; 16 * stride + 3];
                    // SAFETY: AVX-512 detected (simd_kernels); same region as above.
                    unsafe { store_transposed(&res, rows, lanes, got.as_mut_ptr().add(1), stride) };
                    assert_eq!(got, want, "rows {rows} lanes {lanes}");
                }
            }
        }
        coverage::report("store_transposed", &STARTS, &kernels);
    }

    /// `task_region(i)` names exactly the output elements task `i` writes, for every plan (per
    /// row, narrow and wide tiles): the regions partition the output (redoable team steps copy
    /// a task's region from a private buffer, so a wrong region would lose or clobber values).
    #[test]
    fn task_regions_are_what_each_task_writes() {
        let mut rng = Rng(7);
        let (rows, cols) = (75, 64);
        let ty = GgmlType::Q4_1;
        let data = random_weights(ty, rows, cols, &mut rng);
        let w = QMatrix::new(ty, rows, cols, &data).unwrap();
        let mut plans = std::collections::HashSet::new();
        for n in [1usize, 3, 8, 17, 40] {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.f()).collect();
            for pack in [Pack::None, Pack::Narrow4, Pack::Narrow8, Pack::Wide] {
                let mut a = QuantizedActs::new();
                quantize_acts_impl(&mut a, &x, n, cols, ty, pack).unwrap();
                for level in [SimdLevel::Scalar, simd::detect()] {
                    for threads in [1, 2, 3] {
                        let mut out = vec![f32::NAN; n * rows];
                        let shared = SharedSlice::new(&mut out);
                        let job = MatmulJob::with_level(w, &a, &shared, threads, level).unwrap();
                        plans.insert(std::mem::discriminant(&job.plan));
                        let mut owner = vec![usize::MAX; n * rows];
                        for i in 0..job.n_tasks() {
                            // SAFETY: one task at a time; nothing else touches `out`.
                            unsafe { shared.slice_mut(0..n * rows).fill(f32::NAN) };
                            // SAFETY: as above.
                            unsafe { job.run_task(i) };
                            // SAFETY: as above.
                            let got = unsafe { shared.all() };
                            let (rr, tr) = job.task_region(i);
                            for (e, v) in got.iter().enumerate() {
                                let (t, r) = (e / rows, e % rows);
                                let inside = rr.contains(&r) && tr.contains(&t);
                                assert_eq!(
                                    !v.is_nan(),
                                    inside,
                                    "n={n} {pack:?} {} t={threads} task {i}: element (t{t}, r{r})",
                                    level.name()
                                );
                                if inside {
                                    assert_eq!(owner[e], usize::MAX, "two tasks own element {e}");
                                    owner[e] = i;
                                }
                            }
                        }
                        assert!(
                            owner.iter().all(|&o| o != usize::MAX),
                            "an element no task owns"
                        );
                    }
                }
            }
        }
        // Per row everywhere; the narrow and wide tiles where the CPU has AVX-512 VNNI.
        let want = if simd::detect() >= SimdLevel::Avx512Vnni {
            3
        } else {
            1
        };
        assert_eq!(plans.len(), want, "plans exercised");
    }

    #[test]
    fn matmul_matches_dequantized_f32() {
        let mut rng = Rng(1);
        let (rows, cols, n) = (13, 96, 5);
        for ty in LEGACY {
            let data = random_weights(ty, rows, cols, &mut rng);
            let w = QMatrix::new(ty, rows, cols, &data).unwrap();
            let x: Vec<f32> = (0..n * cols).map(|_| rng.f()).collect();
            let mut out = vec![0f32; n * rows];
            matmul(&w, &x, n, &mut out);
            let mut wr = vec![0f32; cols];
            for r in 0..rows {
                dequantize(ty, w.row(r), &mut wr).unwrap();
                for t in 0..n {
                    let xt = &x[t * cols..(t + 1) * cols];
                    let want: f32 = wr.iter().zip(xt).map(|(a, b)| a * b).sum();
                    let nw = wr.iter().map(|v| v * v).sum::<f32>().sqrt();
                    let nx = xt.iter().map(|v| v * v).sum::<f32>().sqrt();
                    let got = out[t * rows + r];
                    assert!(
                        (got - want).abs() <= 1e-2 * nw * nx,
                        "{} r={r} t={t}: {got} vs {want}",
                        ty.name()
                    );
                }
            }
        }
    }

    /// Every SIMD kernel (per-row, and the tile path with packed activations) against the
    /// scalar kernel on the same activations.
    #[test]
    fn all_levels_match_scalar() {
        let mut rng = Rng(2);
        let kernels = simd::coverage::simd_kernels(&crate::quant::LEGACY_DOT_KERNELS);
        let tiles = simd::coverage::simd_kernels(&TILE_KERNELS);
        for ty in LEGACY {
            for &(rows, cols) in &[(1usize, 32usize), (5, 64), (13, 96), (9, 576)] {
                let data = random_weights(ty, rows, cols, &mut rng);
                let w = QMatrix::new(ty, rows, cols, &data).unwrap();
                for n in [1usize, 3, 8, 17, 33, 40] {
                    let x: Vec<f32> = (0..n * cols).map(|_| rng.f()).collect();
                    let mut plain = QuantizedActs::new();
                    quantize_acts_impl(&mut plain, &x, n, cols, ty, Pack::None).unwrap();
                    let packed: Vec<QuantizedActs> = [Pack::Narrow4, Pack::Narrow8, Pack::Wide]
                        .into_iter()
                        .map(|p| {
                            let mut a = QuantizedActs::new();
                            quantize_acts_impl(&mut a, &x, n, cols, ty, p).unwrap();
                            a
                        })
                        .filter(|a| a.has_packed())
                        .collect();
                    let mut want = vec![0f32; n * rows];
                    matmul_level(&w, &plain, &mut want, SimdLevel::Scalar).unwrap();
                    // Scale for the tolerance: sum of |w| * |a| per output.
                    let mut wr = vec![0f32; cols];
                    let mut norm = vec![0f32; n * rows];
                    for r in 0..rows {
                        dequantize(ty, w.row(r), &mut wr).unwrap();
                        for t in 0..n {
                            let xt = &x[t * cols..(t + 1) * cols];
                            norm[t * rows + r] =
                                wr.iter().zip(xt).map(|(a, b)| (a * b).abs()).sum::<f32>() + 1e-6;
                        }
                    }
                    for &level in &kernels {
                        // Packed activations take a tile kernel at tile levels (narrow up to 8
                        // tokens, wide at any count); elsewhere they would rerun the per-row
                        // kernel.
                        let packed = packed.iter().filter(|_| tiles.contains(&level));
                        for acts in std::iter::once(&plain).chain(packed) {
                            let mut got = vec![f32::NAN; n * rows];
                            matmul_level(&w, acts, &mut got, level).unwrap();
                            for i in 0..n * rows {
                                assert!(
                                    (got[i] - want[i]).abs() <= 1e-4 * norm[i],
                                    "{} {}x{cols} n={n} {} packed={:?} i={i}: {} vs {}",
                                    ty.name(),
                                    rows,
                                    level.name(),
                                    acts.pack,
                                    got[i],
                                    want[i]
                                );
                            }
                        }
                        // vec_dot agrees with the matmul entry.
                        let t = n - 1;
                        let v = crate::quant::vec_dot(ty, w.row(rows - 1), &plain, t, level);
                        let i = t * rows + rows - 1;
                        assert!((v - want[i]).abs() <= 1e-4 * norm[i]);
                    }
                }
            }
        }
        let legacy = &crate::quant::LEGACY_DOT_KERNELS;
        simd::coverage::report("legacy matmul, per-row kernels", legacy, &kernels);
        simd::coverage::report("legacy matmul, tile kernel", &TILE_KERNELS, &tiles);
    }

    /// Issue #3: a token's outputs are bit-identical whether it is computed alone or at any
    /// position of a batch (per-row vs tile path, any batch size), at every SIMD level; the
    /// AVX2, AVX-512 and NEON kernels also reproduce the scalar canonical order bit for bit.
    #[test]
    fn batch_invariant_bit_exact() {
        let mut rng = Rng(11);
        let rows = 13;
        // Scalar and each distinct SIMD kernel (a level that reruns another's kernel adds
        // nothing).
        let kernels = simd::coverage::simd_kernels(&crate::quant::LEGACY_DOT_KERNELS);
        let levels: Vec<SimdLevel> = std::iter::once(SimdLevel::Scalar)
            .chain(kernels.iter().copied())
            .collect();
        for ty in LEGACY {
            for cols in [96usize, 576, 1056, 2080] {
                let data = random_weights(ty, rows, cols, &mut rng);
                let w = QMatrix::new(ty, rows, cols, &data).unwrap();
                let tok: Vec<f32> = (0..cols).map(|_| rng.f() * 3.0).collect();
                let mut a1 = QuantizedActs::new();
                quantize_acts_impl(&mut a1, &tok, 1, cols, ty, Pack::None).unwrap();
                let mut scalar = vec![0f32; rows];
                matmul_level(&w, &a1, &mut scalar, SimdLevel::Scalar).unwrap();
                for &level in &levels {
                    let mut alone = vec![0f32; rows];
                    matmul_level(&w, &a1, &mut alone, level).unwrap();
                    if level != SimdLevel::Scalar {
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&alone), bits(&scalar), "{} {cols}", ty.name());
                    }
                    for n in [2usize, 7, 8, 9, 33, 40] {
                        for pos in [0, n / 2, n - 1] {
                            let mut x: Vec<f32> = (0..n * cols).map(|_| rng.f()).collect();
                            x[pos * cols..(pos + 1) * cols].copy_from_slice(&tok);
                            // Packing as the engine decides, and each one forced (the tile
                            // paths at any n they take).
                            let engine = Pack::for_tokens(n, SimdLevel::Avx512Vnni);
                            let all = [Pack::None, Pack::Narrow4, Pack::Narrow8, Pack::Wide];
                            for pack in std::iter::once(engine).chain(all) {
                                let mut a = QuantizedActs::new();
                                quantize_acts_impl(&mut a, &x, n, cols, ty, pack).unwrap();
                                let mut out = vec![0f32; n * rows];
                                matmul_level(&w, &a, &mut out, level).unwrap();
                                for r in 0..rows {
                                    assert_eq!(
                                        out[pos * rows + r].to_bits(),
                                        alone[r].to_bits(),
                                        "{} cols={cols} {} n={n} pos={pos} pack={pack:?} r={r}: \
                                         {} vs {}",
                                        ty.name(),
                                        level.name(),
                                        out[pos * rows + r],
                                        alone[r]
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// The decode kernels for a few tokens against their scalar twin, bit for bit, at every
    /// shape they take apart: 1 to 8 tokens (and 9 to 32 in groups of 8 for `tile8`), row counts that leave a 4-row kernel call, a pair
    /// or a single row over, rows of fewer and more than 8 blocks (partly filled slots), every
    /// legacy weight type.
    /// - AVX-512 VNNI: the 4-lane (`tile4`, 1..=4 tokens) and 8-lane (`tile8`, 1..=32 tokens)
    ///   narrow tiles through the matmul entry, against `legacy::vec_dot_scalar` (their twin:
    ///   the canonical order they follow);
    /// - AVX2 (also run at the AVX-512 level): `dot_row_tokens`, 1 to 4 tokens per call,
    ///   against the one-token `dot_row` kernel it shares its f32 order with, and within the
    ///   usual tolerance of the scalar twin.
    #[test]
    fn narrow_kernels_match_scalar_twin() {
        let mut rng = Rng(21);
        let narrow = simd::coverage::simd_kernels(&NARROW_KERNELS);
        let multi = simd::coverage::simd_kernels(&ROW_TOKENS_KERNELS);
        for ty in LEGACY {
            for &(rows, cols) in &[
                (1usize, 32usize),
                (2, 96),
                (3, 288),
                (5, 576),
                (7, 64),
                (13, 1536),
            ] {
                let data = random_weights(ty, rows, cols, &mut rng);
                let w = QMatrix::new(ty, rows, cols, &data).unwrap();
                let nb = cols / 32;
                for n in (1..=8usize).chain([9, 16, 17, 32]) {
                    let x: Vec<f32> = (0..n * cols).map(|_| rng.f() * 2.0).collect();
                    let mut plain = QuantizedActs::new();
                    quantize_acts_impl(&mut plain, &x, n, cols, ty, Pack::None).unwrap();
                    // The scalar twin on the token-major activations.
                    let mut twin = vec![0f32; n * rows];
                    for r in 0..rows {
                        for t in 0..n {
                            let qa = &plain.qs[t * cols..(t + 1) * cols];
                            let ds = &plain.ds[2 * t * nb..2 * (t + 1) * nb];
                            twin[t * rows + r] = legacy::vec_dot_scalar(ty, w.row(r), qa, ds);
                        }
                    }
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    for &level in &narrow {
                        for pack in [Pack::Narrow4, Pack::Narrow8] {
                            let mut a = QuantizedActs::new();
                            quantize_acts_impl(&mut a, &x, n, cols, ty, pack).unwrap();
                            if !a.has_packed() {
                                continue; // more tokens than this layout's lanes
                            }
                            let mut got = vec![f32::NAN; n * rows];
                            matmul_level(&w, &a, &mut got, level).unwrap();
                            assert_eq!(
                                bits(&got),
                                bits(&twin),
                                "{} {rows}x{cols} n={n} {pack:?} {}:\n{got:?}\nvs\n{twin:?}",
                                ty.name(),
                                level.name()
                            );
                        }
                    }
                    for &level in &multi {
                        for r in 0..rows {
                            for t0 in 0..n {
                                let k = (n - t0).min(DOT_ROW_TOKENS);
                                let mut got = vec![f32::NAN; k];
                                crate::quant::dot_row_tokens(
                                    ty,
                                    w.row(r),
                                    &plain,
                                    t0,
                                    level,
                                    &mut got,
                                );
                                for (i, &g) in got.iter().enumerate() {
                                    let one =
                                        crate::quant::dot_row(ty, w.row(r), &plain, t0 + i, level);
                                    assert_eq!(
                                        g.to_bits(),
                                        one.to_bits(),
                                        "{} {rows}x{cols} r={r} tokens {t0}..{} #{i} {}: {g} vs {one}",
                                        ty.name(),
                                        t0 + k,
                                        level.name()
                                    );
                                    let want = twin[(t0 + i) * rows + r];
                                    let mag: f32 = {
                                        let mut wr = vec![0f32; cols];
                                        dequantize(ty, w.row(r), &mut wr).unwrap();
                                        let xt = &x[(t0 + i) * cols..(t0 + i + 1) * cols];
                                        wr.iter().zip(xt).map(|(a, b)| (a * b).abs()).sum()
                                    };
                                    assert!(
                                        (g - want).abs() <= 1e-4 * mag + 1e-6,
                                        "{} r={r} t={} {}: {g} vs scalar {want}",
                                        ty.name(),
                                        t0 + i,
                                        level.name()
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
        simd::coverage::report("legacy matmul, narrow tiles", &NARROW_KERNELS, &narrow);
        simd::coverage::report(
            "legacy row dot, several tokens",
            &ROW_TOKENS_KERNELS,
            &multi,
        );
    }

    #[test]
    fn float_weights_matmul() {
        let mut rng = Rng(3);
        let (rows, cols, n) = (7, 40, 3);
        let wf: Vec<f32> = (0..rows * cols).map(|_| rng.f()).collect();
        let x: Vec<f32> = (0..n * cols).map(|_| rng.f()).collect();
        for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
            let data: Vec<u8> = match ty {
                GgmlType::F32 => wf.iter().flat_map(|v| v.to_le_bytes()).collect(),
                GgmlType::F16 => wf
                    .iter()
                    .flat_map(|v| f16::from_f32(*v).to_bits().to_le_bytes())
                    .collect(),
                _ => wf
                    .iter()
                    .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
                    .collect(),
            };
            let w = QMatrix::new(ty, rows, cols, &data).unwrap();
            let mut out = vec![0f32; n * rows];
            matmul(&w, &x, n, &mut out);
            let mut wr = vec![0f32; cols];
            for r in 0..rows {
                w.dequantize_row(r, &mut wr).unwrap();
                for t in 0..n {
                    let want: f32 = wr
                        .iter()
                        .zip(&x[t * cols..(t + 1) * cols])
                        .map(|(a, b)| a * b)
                        .sum();
                    assert!((out[t * rows + r] - want).abs() < 1e-4, "{}", ty.name());
                }
            }
        }
    }

    const KQUANTS: [GgmlType; 3] = [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K];

    /// Random K-quant rows: random bits everywhere except sane f16 super-block scales
    /// (`d`, `dmin` for Q4_K/Q5_K, `d` for Q6_K) of magnitude up to 0.05.
    fn random_kquant_weights(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
        let ts = ty.type_size();
        let mut data: Vec<u8> = (0..rows * cols / 256 * ts)
            .map(|_| rng.next() as u8)
            .collect();
        let scales: &[usize] = if ty == GgmlType::Q6_K {
            &[208]
        } else {
            &[0, 2]
        };
        for blk in data.chunks_exact_mut(ts) {
            for &off in scales {
                let v = f16::from_f32(rng.f() * 0.05);
                blk[off..off + 2].copy_from_slice(&v.to_bits().to_le_bytes());
            }
        }
        data
    }

    /// K-quant weights through the whole matmul entry (Q8_K activation quantization, the
    /// planner, the per-row loop) against the f32 dot of the dequantized weights with the
    /// unquantized activations: Q8_K rounds each activation by at most half its block's step,
    /// so the difference is bounded by `sum_b d_b / 2 * sum |w|` (plus f32 rounding).
    #[test]
    fn kquant_matmul_matches_dequantized_f32() {
        let mut rng = Rng(5);
        let (rows, cols) = (11, 512);
        for ty in KQUANTS {
            let data = random_kquant_weights(ty, rows, cols, &mut rng);
            let w = QMatrix::new(ty, rows, cols, &data).unwrap();
            for n in [1usize, 3, 8, 17] {
                let x: Vec<f32> = (0..n * cols).map(|_| rng.f() * 2.0).collect();
                let mut out = vec![f32::NAN; n * rows];
                matmul(&w, &x, n, &mut out);
                let mut wr = vec![0f32; cols];
                for r in 0..rows {
                    dequantize(ty, w.row(r), &mut wr).unwrap();
                    for t in 0..n {
                        let xt = &x[t * cols..(t + 1) * cols];
                        let exact: f64 =
                            wr.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
                        let mut bound = 0f64;
                        let mut mag = 0f64;
                        for (wb, xb) in wr.chunks_exact(256).zip(xt.chunks_exact(256)) {
                            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
                            let wsum: f64 = wb.iter().map(|v| v.abs() as f64).sum();
                            bound += amax / 127.0 / 2.0 * wsum;
                            mag += wb
                                .iter()
                                .zip(xb)
                                .map(|(&a, &b)| (a * b).abs() as f64)
                                .sum::<f64>();
                        }
                        let got = out[t * rows + r] as f64;
                        assert!(
                            (got - exact).abs() <= bound * 1.001 + 1e-5 * mag,
                            "{} r={r} t={t} n={n}: {got} vs {exact} (bound {bound})",
                            ty.name()
                        );
                    }
                }
            }
        }
    }

    /// The K-quant matmul at every SIMD kernel against the scalar kernel, both fed the
    /// activations that `quantize_acts` made, and the Q8_K activations against
    /// `quantize_row_q8_k` run on each token alone.
    #[test]
    fn kquant_matmul_all_kernels_match_scalar() {
        use crate::quant::kquants::{self, BlockQ8K, QK_K};
        let mut rng = Rng(6);
        let kernels = simd::coverage::simd_kernels(&kquants::DOT_KERNELS);
        for ty in KQUANTS {
            for &(rows, cols) in &[(1usize, 256usize), (9, 512), (6, 1536)] {
                let data = random_kquant_weights(ty, rows, cols, &mut rng);
                let w = QMatrix::new(ty, rows, cols, &data).unwrap();
                for n in [1usize, 4, 17] {
                    let x: Vec<f32> = (0..n * cols).map(|_| rng.f() * 3.0).collect();
                    let a = q8::quantize_acts(&x, n, cols, ty);
                    let nb = cols / QK_K;
                    for t in 0..n {
                        let mut want = vec![BlockQ8K::ZERO; nb];
                        kquants::quantize_row_q8_k(&x[t * cols..(t + 1) * cols], &mut want);
                        assert_eq!(&a.k[t * nb..(t + 1) * nb], &want[..], "{} t={t}", ty.name());
                    }
                    let mut want = vec![0f32; n * rows];
                    matmul_level(&w, &a, &mut want, SimdLevel::Scalar).unwrap();
                    // Scale per output: sum over blocks of |block dot| (cancellation-aware).
                    let mut mag = vec![0f32; n * rows];
                    let bb = ty.type_size();
                    for r in 0..rows {
                        for t in 0..n {
                            mag[t * rows + r] = (0..nb)
                                .map(|b| {
                                    let wb = &w.row(r)[b * bb..(b + 1) * bb];
                                    let ab = &a.k[t * nb + b..t * nb + b + 1];
                                    match ty {
                                        GgmlType::Q4_K => {
                                            kquants::vec_dot_q4_k(wb, ab, SimdLevel::Scalar)
                                        }
                                        GgmlType::Q5_K => {
                                            kquants::vec_dot_q5_k(wb, ab, SimdLevel::Scalar)
                                        }
                                        _ => kquants::vec_dot_q6_k(wb, ab, SimdLevel::Scalar),
                                    }
                                    .abs()
                                })
                                .sum::<f32>()
                                + f32::MIN_POSITIVE;
                        }
                    }
                    for &level in &kernels {
                        let mut got = vec![f32::NAN; n * rows];
                        matmul_level(&w, &a, &mut got, level).unwrap();
                        for i in 0..n * rows {
                            assert!(
                                (got[i] - want[i]).abs() <= 1e-5 * mag[i],
                                "{} {rows}x{cols} n={n} {} i={i}: {} vs scalar {}",
                                ty.name(),
                                level.name(),
                                got[i],
                                want[i]
                            );
                        }
                    }
                }
            }
        }
        simd::coverage::report("K-quant matmul", &kquants::DOT_KERNELS, &kernels);
    }

    /// K-quant weights on the per-row path: a token's outputs are bit-identical alone and at
    /// any position of a batch, at every level: with rows and tokens over several of the
    /// path's L2 blocks (`per_row_blocks`), and at the AVX2 level several tokens per weight
    /// block (`kquants::dot_row_tokens_avx2`) against one.
    #[test]
    fn kquant_batch_invariant_bit_exact() {
        let mut rng = Rng(23);
        let levels: Vec<SimdLevel> = std::iter::once(SimdLevel::Scalar)
            .chain(simd::coverage::simd_kernels(
                &crate::quant::kquants::DOT_KERNELS,
            ))
            .collect();
        let (rows, cols) = (600usize, 2048usize);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        for ty in KQUANTS {
            let data = random_kquant_weights(ty, rows, cols, &mut rng);
            let w = QMatrix::new(ty, rows, cols, &data).unwrap();
            let tok: Vec<f32> = (0..cols).map(|_| rng.f() * 3.0).collect();
            let a1 = q8::quantize_acts(&tok, 1, cols, ty);
            let (row_block, tok_block) = per_row_blocks(w.row(0).len(), &a1);
            let n = 2 * tok_block + 5;
            let per_task = rows.div_ceil(4 * 2); // the pool below
            assert!(row_block < per_task, "row blocks too large for the test");
            for &level in &levels {
                let mut alone = vec![0f32; rows];
                matmul_level(&w, &a1, &mut alone, level).unwrap();
                for pos in [3, tok_block + 2, n - 1] {
                    let mut x: Vec<f32> = (0..n * cols).map(|_| rng.f()).collect();
                    x[pos * cols..(pos + 1) * cols].copy_from_slice(&tok);
                    let a = q8::quantize_acts(&x, n, cols, ty);
                    let mut out = vec![0f32; n * rows];
                    pool.install(|| matmul_level(&w, &a, &mut out, level))
                        .unwrap();
                    for r in 0..rows {
                        assert_eq!(
                            out[pos * rows + r].to_bits(),
                            alone[r].to_bits(),
                            "{} {} n={n} pos={pos} r={r}",
                            ty.name(),
                            level.name()
                        );
                    }
                }
            }
        }
    }

    /// Lowest level of the K-quant prefill tile (`ktile`), and of the per-row K-quant kernels
    /// that follow the canonical order bit for bit (the AVX-512 and NEON ones).
    const KTILE_KERNELS: [SimdLevel; 1] = [SimdLevel::Avx512Vnni];
    const KQUANT_EXACT_KERNELS: [SimdLevel; 2] = [SimdLevel::Neon, SimdLevel::Avx512];

    /// Issue #9: the K-quant prefill tile (wide packed Q8_K activations) against its scalar
    /// twin (`kquants::dot_q*_k_scalar` per row and token) bit for bit, at shapes that leave a
    /// 4-row call, single rows, partly filled token groups and rows longer than one unpacked
    /// block chunk; the AVX-512 per-row kernels (decode) give the same bits, so a token's
    /// outputs do not depend on its batch.
    #[test]
    fn kquant_tile_matches_scalar_twin_bit_exact() {
        let mut rng = Rng(17);
        let tiles = simd::coverage::simd_kernels(&KTILE_KERNELS);
        let rows_exact = simd::coverage::simd_kernels(&KQUANT_EXACT_KERNELS);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for ty in KQUANTS {
            for &(rows, cols) in &[(1usize, 256usize), (6, 512), (9, 1024), (4, 4608)] {
                let data = random_kquant_weights(ty, rows, cols, &mut rng);
                let w = QMatrix::new(ty, rows, cols, &data).unwrap();
                for n in [33usize, 48, 70] {
                    let x: Vec<f32> = (0..n * cols).map(|_| rng.f() * 3.0).collect();
                    let mut plain = QuantizedActs::new();
                    quantize_acts_impl(&mut plain, &x, n, cols, ty, Pack::None).unwrap();
                    let mut wide = QuantizedActs::new();
                    quantize_acts_impl(&mut wide, &x, n, cols, ty, Pack::Wide).unwrap();
                    assert!(wide.has_packed());
                    let mut twin = vec![0f32; n * rows];
                    matmul_level(&w, &plain, &mut twin, SimdLevel::Scalar).unwrap();
                    for &level in &tiles {
                        let mut got = vec![f32::NAN; n * rows];
                        matmul_level(&w, &wide, &mut got, level).unwrap();
                        assert_eq!(
                            bits(&got),
                            bits(&twin),
                            "{} {rows}x{cols} n={n} tile {}:\n{got:?}\nvs\n{twin:?}",
                            ty.name(),
                            level.name()
                        );
                    }
                    for &level in &rows_exact {
                        for l in SimdLevel::ALL.into_iter().filter(|&l| l >= level) {
                            let mut got = vec![f32::NAN; n * rows];
                            matmul_level(&w, &plain, &mut got, l).unwrap();
                            assert_eq!(
                                bits(&got),
                                bits(&twin),
                                "{} {rows}x{cols} n={n} per-row {}",
                                ty.name(),
                                l.name()
                            );
                        }
                    }
                }
            }
        }
        simd::coverage::report("K-quant matmul, prefill tile", &KTILE_KERNELS, &tiles);
        simd::coverage::report(
            "K-quant matmul, canonical per-row kernels",
            &KQUANT_EXACT_KERNELS,
            &rows_exact,
        );
    }

    #[test]
    fn mismatched_shapes_are_errors() {
        let data = vec![0u8; 2 * 20];
        let w = QMatrix::new(GgmlType::Q4_1, 2, 32, &data).unwrap();
        let a = q8::quantize_acts(&[0.5; 64], 1, 64, GgmlType::Q4_1);
        assert!(try_matmul_q(&w, &a, &mut [0.0; 2]).is_err());
        let a = q8::quantize_acts(&[0.5; 32], 1, 32, GgmlType::F16);
        assert!(try_matmul_q(&w, &a, &mut [0.0; 2]).is_err());
        let a = q8::quantize_acts(&[0.5; 32], 1, 32, GgmlType::Q8_0);
        assert!(try_matmul_q(&w, &a, &mut [0.0; 3]).is_err());
        assert!(try_matmul_q(&w, &a, &mut [0.0; 2]).is_ok());
    }
}
