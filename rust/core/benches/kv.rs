//! KV cache hot paths: attention of one query token (a GQA group of 3 heads, head_dim 64, as
//! SmolLM2, over 128-4096 cached cells of each K/V type at each SIMD level; and Gemma 3's group
//! of 4 heads of 256 over f16 K/V), of a tile of prompt tokens, and taking a block from a pool
//! full of cached blocks (evict the LRU block, key it, release it).
//!
//! `cargo bench -p kvserve-core --bench kv`. Moved here from the `#[ignore]`d `kv_measure`
//! and `measure_eviction` tests; the accuracy of the K/V types is asserted by the attention
//! tests (`attention::tests`), not measured here.

mod common;

use common::Rng;
use divan::counter::ItemsCount;
use divan::Bencher;
use kvserve_core::kv::attention::{attend_at, attend_tile_at, Mask, Query, Scratch, TILE_TOKENS};
use kvserve_core::kv::storage::{KvLayout, KvStorage, KvType};
use kvserve_core::kv::BlockPool;
use kvserve_core::quant::SimdLevel;

fn main() {
    divan::main();
}

const HEAD_DIM: usize = 64;
const KV_HEADS: usize = 3;
const GROUP: usize = 3;
const BLOCK: usize = 16;

#[derive(Clone, Copy)]
struct Case {
    ty: KvType,
    level: SimdLevel,
    n_kv: usize,
    /// Query heads of the group and their size: SmolLM2's (3 x 64, one of 3 KV heads in
    /// each row) or Gemma 3's (4 x 256, the only KV head).
    gemma: bool,
}

impl std::fmt::Display for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (ty, lvl, n) = (self.ty.name(), self.level.name(), self.n_kv);
        let geo = if self.gemma { "gemma 4x256 " } else { "" };
        write!(f, "{geo}{ty} {lvl} n_kv={n:04}")
    }
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    for ty in [KvType::F32, KvType::F16, KvType::Q8_0] {
        // avx512vnni has no attention kernel of its own (it runs avx512's).
        for level in SimdLevel::available() {
            if level == SimdLevel::Avx512Vnni {
                continue;
            }
            for n_kv in [128, 1024, 4096] {
                out.push(Case {
                    ty,
                    level,
                    n_kv,
                    gemma: false,
                });
            }
            if ty == KvType::F16 {
                for n_kv in [256, 1024] {
                    out.push(Case {
                        ty,
                        level,
                        n_kv,
                        gemma: true,
                    });
                }
            }
        }
    }
    out
}

/// One query token's attention for one GQA group over `n_kv` cells in shuffled blocks;
/// counts cells.
#[divan::bench(args = cases(), max_time = 1)]
fn attend(bencher: Bencher, c: Case) {
    // (head_dim, KV heads in a row, query heads of the group, the group's KV head)
    let (hd, kv_heads, group, kv_head) = if c.gemma {
        (256, 1, 4, 0)
    } else {
        (HEAD_DIM, KV_HEADS, GROUP, 1)
    };
    let kv_dim = hd * kv_heads;
    let nb = c.n_kv / BLOCK;
    let mut rng = Rng(c.n_kv as u64);
    let layout = KvLayout {
        ty: c.ty,
        n_layers: 1,
        kv_dim,
        block_size: BLOCK,
    };
    let mut store = KvStorage::new(layout, nb).unwrap();
    let mut table: Vec<u32> = (0..nb as u32).collect();
    for i in (1..nb).rev() {
        table.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    for i in 0..c.n_kv {
        let (k, v) = (rng.normals(kv_dim, 1.0), rng.normals(kv_dim, 1.0));
        store.write(0, table[i / BLOCK], i % BLOCK, &k, &v).unwrap();
    }
    let q = rng.normals(group * hd, 1.5);
    let query = Query {
        layer: 0,
        kv_head,
        kv_heads: 1,
        head_dim: hd,
        q: &q,
        scale: 1.0 / (hd as f32).sqrt(),
        mask: Mask::All,
    };
    let mut out = vec![0.0; group * hd];
    let mut scratch = Scratch::default();
    bencher.counter(ItemsCount::new(c.n_kv)).bench_local(|| {
        attend_at(
            c.level,
            &store,
            &table,
            c.n_kv,
            &query,
            &mut out,
            &mut scratch,
        )
        .unwrap();
    });
}

/// One decode step's attention of a deep sequence, on one thread: every layer and KV head of
/// SmolLM2's geometry (30 layers, 3 KV heads of 3 query heads, head_dim 64, F16, blocks of 16)
/// over `n_kv` cells in shuffled blocks of a pool of every layer's K/V (as the model's cache
/// is laid out: at 4,096 cells 94 MB, far more than the caches). Counts cells x layers x KV
/// heads.
#[divan::bench(args = [512, 4096], max_time = 3)]
fn decode_step_deep(bencher: Bencher, n_kv: usize) {
    const LAYERS: usize = 30;
    let kv_dim = HEAD_DIM * KV_HEADS;
    let nb = n_kv / BLOCK;
    let mut rng = Rng(n_kv as u64 + 1);
    let layout = KvLayout {
        ty: KvType::F16,
        n_layers: LAYERS,
        kv_dim,
        block_size: BLOCK,
    };
    let mut store = KvStorage::new(layout, nb + 8).unwrap();
    let mut table: Vec<u32> = (0..nb as u32).collect();
    for i in (1..nb).rev() {
        table.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    let (k, v) = (rng.normals(kv_dim, 1.0), rng.normals(kv_dim, 1.0));
    for layer in 0..LAYERS {
        for i in 0..n_kv {
            store
                .write(layer, table[i / BLOCK], i % BLOCK, &k, &v)
                .unwrap();
        }
    }
    // Every KV head in one query, as the model asks (one pass over each block's rows).
    let q = rng.normals(KV_HEADS * GROUP * HEAD_DIM, 1.5);
    let mut out = vec![0.0; KV_HEADS * GROUP * HEAD_DIM];
    let mut scratch = Scratch::default();
    let level = kvserve_core::quant::simd::level();
    bencher
        .counter(ItemsCount::new(n_kv * LAYERS * KV_HEADS))
        .bench_local(|| {
            for layer in 0..LAYERS {
                let query = Query {
                    layer,
                    kv_head: 0,
                    kv_heads: KV_HEADS,
                    head_dim: HEAD_DIM,
                    q: &q,
                    scale: 1.0 / (HEAD_DIM as f32).sqrt(),
                    mask: Mask::All,
                };
                attend_at(level, &store, &table, n_kv, &query, &mut out, &mut scratch).unwrap();
            }
        });
}

/// Prompt attention: a tile of [`TILE_TOKENS`] consecutive prompt tokens (causal) after
/// `depth` cached cells, every KV head of SmolLM2's geometry (3 KV heads of 3 query heads,
/// head_dim 64, F16, blocks of 16), one layer, one thread: token by token with the
/// single-token kernel (`tile = false`) or with the tile kernels (`tile = true`; the same
/// bits). Counts cells x tokens x KV heads.
#[divan::bench(args = [(128, false), (128, true), (1024, false), (1024, true)], max_time = 2)]
fn prompt_tile(bencher: Bencher, (depth, tile): (usize, bool)) {
    let kv_dim = HEAD_DIM * KV_HEADS;
    let n_kv = depth + TILE_TOKENS;
    let nb = n_kv.div_ceil(BLOCK);
    let mut rng = Rng(depth as u64 + 7);
    let layout = KvLayout {
        ty: KvType::F16,
        n_layers: 1,
        kv_dim,
        block_size: BLOCK,
    };
    let mut store = KvStorage::new(layout, nb).unwrap();
    let mut table: Vec<u32> = (0..nb as u32).collect();
    for i in (1..nb).rev() {
        table.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    for i in 0..n_kv {
        let (k, v) = (rng.normals(kv_dim, 1.0), rng.normals(kv_dim, 1.0));
        store.write(0, table[i / BLOCK], i % BLOCK, &k, &v).unwrap();
    }
    let positions: Vec<i32> = (0..n_kv as i32).collect();
    let ql = KV_HEADS * GROUP * HEAD_DIM;
    let q = rng.normals(TILE_TOKENS * ql, 1.5);
    let queries: Vec<Query> = (0..TILE_TOKENS)
        .map(|t| Query {
            layer: 0,
            kv_head: 0,
            kv_heads: KV_HEADS,
            head_dim: HEAD_DIM,
            q: &q[t * ql..(t + 1) * ql],
            scale: 1.0 / (HEAD_DIM as f32).sqrt(),
            mask: Mask::Causal {
                positions: &positions,
                qpos: (depth + t) as i32,
            },
        })
        .collect();
    let mut out = vec![0.0; TILE_TOKENS * ql];
    let mut scratch = Scratch::default();
    let level = kvserve_core::quant::simd::level();
    bencher
        .counter(ItemsCount::new(n_kv * TILE_TOKENS * KV_HEADS))
        .bench_local(|| {
            if tile {
                attend_tile_at(
                    level,
                    &store,
                    &table,
                    n_kv,
                    &queries,
                    &mut out,
                    &mut scratch,
                )
                .unwrap();
            } else {
                for (query, o) in queries.iter().zip(out.chunks_exact_mut(ql)) {
                    attend_at(level, &store, &table, n_kv, query, o, &mut scratch).unwrap();
                }
            }
        });
}

/// A pool of `n` blocks, all cached (keyed, unreferenced): allocate (evicts the LRU block),
/// key and release one block.
#[divan::bench(args = [1024, 8192, 65536], max_time = 1)]
fn evict_key_release(bencher: Bencher, n: u32) {
    let pool = BlockPool::new(n);
    let all: Vec<_> = (0..n).map(|_| pool.allocate().unwrap()).collect();
    for (i, &b) in all.iter().enumerate() {
        pool.set_key(b, i as u64).unwrap();
    }
    for &b in all.iter().rev() {
        pool.release(b).unwrap();
    }
    assert_eq!(pool.stats().cached, n as usize);
    let mut key = n as u64;
    bencher.bench_local(|| {
        let b = pool.allocate().unwrap();
        pool.set_key(b, key).unwrap();
        pool.release(b).unwrap();
        key += 1;
    });
    pool.audit().unwrap();
}
