//! K-quant dot products (Q4_K, Q5_K, Q6_K weights against Q8_K activations, as Gemma 3's
//! Q4_K_M files use them) at every SIMD level this CPU runs: 512 rows of 4096 columns per
//! iteration, one thread.
//!
//! `cargo bench -p kvserve-core --bench kquants`. Moved here from the `#[ignore]`d
//! `kquants_bench` test.

mod common;

use common::{f16_bytes, Rng};
use divan::counter::BytesCount;
use divan::Bencher;
use kvserve_core::quant::kquants::{
    quantize_row_q8_k, vec_dot_q4_k, vec_dot_q5_k, vec_dot_q6_k, BlockQ8K, Q4_K_BYTES, Q5_K_BYTES,
    Q6_K_BYTES, QK_K,
};
use kvserve_core::quant::SimdLevel;

fn main() {
    divan::main();
}

const BLOCKS_PER_ROW: usize = 16; // 4096 columns
const ROWS: usize = 512;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Q4K,
    Q5K,
    Q6K,
}

impl Kind {
    fn bytes(self) -> usize {
        match self {
            Kind::Q4K => Q4_K_BYTES,
            Kind::Q5K => Q5_K_BYTES,
            Kind::Q6K => Q6_K_BYTES,
        }
    }
    fn dot(self, w: &[u8], a: &[BlockQ8K], level: SimdLevel) -> f32 {
        match self {
            Kind::Q4K => vec_dot_q4_k(w, a, level),
            Kind::Q5K => vec_dot_q5_k(w, a, level),
            Kind::Q6K => vec_dot_q6_k(w, a, level),
        }
    }
    /// Random blocks whose f16 scales are small normal numbers (no NaN, inf or subnormal).
    fn random_blocks(self, rng: &mut Rng, n: usize) -> Vec<u8> {
        let mut v = rng.bytes(n * self.bytes());
        for blk in v.chunks_exact_mut(self.bytes()) {
            match self {
                Kind::Q4K | Kind::Q5K => {
                    blk[0..2].copy_from_slice(&f16_bytes(0.01 + rng.f().abs() * 0.05));
                    blk[2..4].copy_from_slice(&f16_bytes(0.01 + rng.f().abs() * 0.05));
                }
                Kind::Q6K => blk[208..210].copy_from_slice(&f16_bytes(0.01 + rng.f().abs() * 0.05)),
            }
        }
        v
    }
}

/// (kind, level) for every level this CPU has; the name reads `Q4K avx2`.
#[derive(Clone, Copy)]
struct Case(Kind, SimdLevel);

impl std::fmt::Display for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?} {}", self.0, self.1.name())
    }
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    for kind in [Kind::Q4K, Kind::Q5K, Kind::Q6K] {
        for level in SimdLevel::available() {
            out.push(Case(kind, level));
        }
    }
    out
}

/// 512 row dot products; counts the weight bytes read.
#[divan::bench(args = cases(), max_time = 1)]
fn vec_dot_rows(bencher: Bencher, Case(kind, level): Case) {
    let mut rng = Rng(1);
    let w = kind.random_blocks(&mut rng, BLOCKS_PER_ROW * ROWS);
    let x: Vec<f32> = (0..BLOCKS_PER_ROW * QK_K).map(|_| rng.f()).collect();
    let mut a = vec![BlockQ8K::ZERO; BLOCKS_PER_ROW];
    quantize_row_q8_k(&x, &mut a);
    let row = BLOCKS_PER_ROW * kind.bytes();
    bencher.counter(BytesCount::new(w.len())).bench_local(|| {
        let mut sink = 0f32;
        for r in 0..ROWS {
            sink += kind.dot(&w[r * row..(r + 1) * row], &a, level);
        }
        sink
    });
}
