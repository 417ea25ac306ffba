//! Quantized matmul (the projections of a forward pass): `matmul_q` over SmolLM2-135M's shapes
//! (Q4_1 1536x576 and 576x1536, the Q8_0 49152x576 output head) for 1 to 512 tokens, on a
//! rayon pool of 1 and 2 threads, and the activation quantization that precedes it.
//!
//! `cargo bench -p kvserve-core --bench matmul` (a filter after `--` picks cases, e.g.
//! `-- "q4_1 1536x576"`). Moved here from the `#[ignore]`d `bench_matmul` test.

mod common;

use common::{f16_bytes, Rng};
use divan::counter::ItemsCount;
use divan::Bencher;
use kvserve_core::quant::{matmul_q, quantize_acts_into, GgmlType, QMatrix, QuantizedActs};

fn main() {
    divan::main();
}

#[derive(Clone, Copy)]
struct Case {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    n: usize,
}

impl std::fmt::Display for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (ty, r, c, n) = (self.ty.name(), self.rows, self.cols, self.n);
        write!(f, "{ty} {r}x{c} n={n:03}")
    }
}

const fn case(ty: GgmlType, rows: usize, cols: usize, n: usize) -> Case {
    Case { ty, rows, cols, n }
}

use GgmlType::{Q4_1, Q8_0};

/// Token counts: decode of 1-32 sequences (the narrow and row paths) and a 512-token prefill
/// (the tile path); the 49152-row head only where the engine runs it (decode and prefill).
#[rustfmt::skip]
const CASES: &[Case] = &[
    case(Q4_1, 1536, 576, 1), case(Q4_1, 1536, 576, 2), case(Q4_1, 1536, 576, 4),
    case(Q4_1, 1536, 576, 8), case(Q4_1, 1536, 576, 16), case(Q4_1, 1536, 576, 32),
    case(Q4_1, 1536, 576, 512),
    case(Q4_1, 576, 1536, 1), case(Q4_1, 576, 1536, 4), case(Q4_1, 576, 1536, 32),
    case(Q4_1, 576, 1536, 512),
    case(Q8_0, 49152, 576, 1), case(Q8_0, 49152, 576, 4), case(Q8_0, 49152, 576, 8),
];

fn random_weights(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let ts = ty.type_size();
    let mut data = rng.bytes(rows * cols / ty.block_size() * ts);
    for blk in data.chunks_exact_mut(ts) {
        blk[..2].copy_from_slice(&f16_bytes(rng.f() * 0.05));
        if ty == Q4_1 {
            blk[2..4].copy_from_slice(&f16_bytes(rng.f() * 0.2));
        }
    }
    data
}

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("a rayon pool")
}

/// `matmul_q` on a pool of `T` threads, with the interleaved copy (`quant::x16`) as the
/// engine loads it (every batch size takes it at AVX-512 VNNI); counts multiply-adds (rows x
/// cols x tokens).
#[divan::bench(args = CASES, consts = [1, 2], max_time = 2)]
fn matmul_q_threads<const T: usize>(bencher: Bencher, c: Case) {
    let mut rng = Rng(4);
    let data = random_weights(c.ty, c.rows, c.cols, &mut rng);
    let x16 = kvserve_core::quant::x16::repack(c.ty, c.rows, c.cols, &data).unwrap();
    let w = QMatrix::new(c.ty, c.rows, c.cols, &data)
        .unwrap()
        .with_x16(&x16)
        .unwrap();
    let x: Vec<f32> = (0..c.n * c.cols).map(|_| rng.f()).collect();
    let mut a = QuantizedActs::new();
    quantize_acts_into(&mut a, &x, c.n, c.cols, c.ty).unwrap();
    let mut out = vec![0f32; c.n * c.rows];
    let pool = pool(T);
    pool.install(|| matmul_q(&w, &a, &mut out)); // warm the pool's threads
    bencher
        .counter(ItemsCount::new(c.rows * c.cols * c.n))
        .bench_local(|| pool.install(|| matmul_q(&w, &a, divan::black_box(&mut out))));
}

/// One token (decode of one sequence) on a pool of `T` threads, from the GGUF rows (`X = 0`)
/// or from the interleaved decode copy (`X = 1`, `quant::x16`); counts multiply-adds.
#[divan::bench(args = [(1536, 576), (576, 1536), (192, 576)], consts = [0, 1], max_time = 2)]
fn one_token_q4_1<const X: usize>(bencher: Bencher, (rows, cols): (usize, usize)) {
    let mut rng = Rng(5);
    let data = random_weights(Q4_1, rows, cols, &mut rng);
    let x16 = kvserve_core::quant::x16::repack(Q4_1, rows, cols, &data).unwrap();
    let mut w = QMatrix::new(Q4_1, rows, cols, &data).unwrap();
    if X == 1 {
        w = w.with_x16(&x16).unwrap();
    }
    let x: Vec<f32> = (0..cols).map(|_| rng.f()).collect();
    let mut a = QuantizedActs::new();
    quantize_acts_into(&mut a, &x, 1, cols, Q4_1).unwrap();
    let mut out = vec![0f32; rows];
    let pool = pool(2);
    pool.install(|| matmul_q(&w, &a, &mut out));
    bencher
        .counter(ItemsCount::new(rows * cols))
        .bench_local(|| pool.install(|| matmul_q(&w, &a, divan::black_box(&mut out))));
}

/// Quantizing `n` activation rows for a weight type (one thread; done before each matmul).
#[divan::bench(args = [1, 4, 32, 512], max_time = 1)]
fn quantize_acts(bencher: Bencher, n: usize) {
    let cols = 1536;
    let mut rng = Rng(7);
    let x: Vec<f32> = (0..n * cols).map(|_| rng.f()).collect();
    let mut a = QuantizedActs::new();
    bencher.counter(ItemsCount::new(n * cols)).bench_local(|| {
        quantize_acts_into(&mut a, divan::black_box(&x), n, cols, Q4_1).unwrap();
    });
}
