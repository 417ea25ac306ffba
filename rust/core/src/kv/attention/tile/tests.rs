use super::super::{attend_chunked, Mask, Query, Scratch};
use super::*;
use crate::kv::storage::KvLayout;
use crate::test_rng::Rng;

/// Roughly standard normal values (a sum of 4 uniforms, centred and scaled).
fn normals(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u: f32 = (0..4)
                .map(|_| (rng.next() >> 40) as f32 / (1u64 << 24) as f32)
                .sum();
            (u - 2.0) * 1.73 * scale
        })
        .collect()
}

/// A storage of `blocks` blocks with random keys (a few large channels) and values in
/// cells `0..n_kv` of a shuffled table of every layer.
fn filled(
    ty: KvType,
    hd: usize,
    kv_heads: usize,
    bs: usize,
    n_kv: usize,
    rng: &mut Rng,
) -> (KvStorage, Vec<u32>) {
    let layout = KvLayout {
        ty,
        n_layers: 2,
        kv_dim: hd * kv_heads,
        block_size: bs,
    };
    let nb = n_kv.div_ceil(bs);
    let mut s = KvStorage::new(layout, nb + 3).unwrap();
    let mut table: Vec<u32> = (0..(nb + 3) as u32).collect();
    for i in (1..table.len()).rev() {
        table.swap(i, rng.below(i + 1));
    }
    table.truncate(nb);
    let d = hd * kv_heads;
    for layer in 0..2 {
        for i in 0..n_kv {
            let mut k = normals(rng, d, 1.0);
            for c in (3..d).step_by(17) {
                k[c] *= 6.0;
            }
            let v = normals(rng, d, 1.0);
            s.write(layer, table[i / bs], i % bs, &k, &v).unwrap();
        }
    }
    (s, table)
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[cfg(target_arch = "x86_64")]
#[test]
fn transpose16_matches_scalar_transpose() {
    if simd::detect() < SimdLevel::Avx512 {
        eprintln!("no AVX-512 on this CPU: the tile kernels are not run here");
        return;
    }
    use std::arch::x86_64::*;
    let m: Vec<f32> = (0..256).map(|i| i as f32).collect();
    // SAFETY: AVX-512 was detected above; every load and store is of 16 values inside `m`
    // and `t`.
    unsafe {
        let mut r: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(m[16 * i..].as_ptr()));
        x86::transpose16(&mut r);
        let mut t = vec![0.0f32; 256];
        for (i, ri) in r.iter().enumerate() {
            _mm512_storeu_ps(t[16 * i..].as_mut_ptr(), *ri);
        }
        for i in 0..16 {
            for j in 0..16 {
                assert_eq!(t[16 * i + j], m[16 * j + i], "({i}, {j})");
            }
        }
    }
}

/// A tile gives every token the bits the single-token kernel gives it alone: every K/V type
/// (Q8_0 and head sizes not a multiple of 16 take the token-by-token fallback), every SIMD
/// level, GQA groups of 1-5 heads (row groups of 4 that cross tokens), 1-3 KV heads per
/// query, blocks of 16, 5 and 32 cells (pieces of 16 and a partial one), chunks of 1, 3 and
/// the default blocks, causal tiles over a cache with gaps and empty cells, window masks
/// that hide whole blocks for some tokens and not others, a token that sees nothing, and
/// per-token scales.
#[test]
fn tile_gives_each_token_its_single_token_bits() {
    let mut rng = Rng(0x5EED_71E5);
    let mut fast_cases = 0;
    for (ty, hd, kv_heads, bs) in [
        (KvType::F16, 64, 3, 16),
        (KvType::F32, 64, 2, 16),
        (KvType::F16, 32, 1, 5),
        (KvType::F16, 48, 2, 32),
        (KvType::F16, 256, 1, 16),
        (KvType::Q8_0, 64, 2, 16),
        (KvType::F16, 24, 1, 16),
    ] {
        let n_kv = 9 * bs + 7;
        let (s, table) = filled(ty, hd, kv_heads, bs, n_kv, &mut rng);
        // Cell i holds position i, but for a few empty cells and a gap.
        let positions: Vec<i32> = (0..n_kv as i32)
            .map(|i| match i % 13 {
                4 => -1,
                _ if i > 40 => i + 5,
                _ => i,
            })
            .collect();
        for (group, qh) in [(1, 1), (3, kv_heads), (5, 1), (2, kv_heads.min(2)), (4, 1)] {
            let kv_head = kv_heads - qh;
            for tokens in [2, 7, 16] {
                // The tile's last `tokens` positions, the first one before any cell for one
                // tile (it sees nothing).
                let last = positions[n_kv - 1];
                let qpos: Vec<i32> = (0..tokens as i32)
                    .map(|t| {
                        if tokens == 7 && t == 0 {
                            -3
                        } else {
                            last - (tokens as i32 - 1 - t) * 3
                        }
                    })
                    .collect();
                let qs: Vec<Vec<f32>> = (0..tokens)
                    .map(|_| normals(&mut rng, qh * group * hd, 1.0))
                    .collect();
                for window in [None, Some(2 * bs as i32 + 3), Some(bs as i32 / 2 + 1)] {
                    let queries: Vec<Query> = (0..tokens)
                        .map(|t| Query {
                            layer: 1,
                            kv_head,
                            kv_heads: qh,
                            head_dim: hd,
                            q: &qs[t],
                            scale: (1.0 + t as f32 * 0.01) / (hd as f32).sqrt(),
                            mask: match window {
                                None => Mask::Causal {
                                    positions: &positions,
                                    qpos: qpos[t],
                                },
                                Some(window) => Mask::Window {
                                    positions: &positions,
                                    qpos: qpos[t],
                                    window,
                                },
                            },
                        })
                        .collect();
                    let ql = qh * group * hd;
                    for lvl in SimdLevel::available() {
                        let lvl = simd::cap(lvl);
                        if fast_path(lvl, ty, hd, tokens) {
                            fast_cases += 1;
                        }
                        for chunk in [1, 3, chunk_blocks(bs)] {
                            let mut scratch = Scratch::default();
                            let mut want = vec![f32::NAN; tokens * ql];
                            for (q, o) in queries.iter().zip(want.chunks_exact_mut(ql)) {
                                attend_chunked(lvl, &s, &table, n_kv, q, o, &mut scratch, chunk)
                                    .unwrap();
                            }
                            let mut got = vec![f32::NAN; tokens * ql];
                            tile_chunked(
                                lvl,
                                &s,
                                &table,
                                n_kv,
                                &queries,
                                &mut got,
                                &mut scratch,
                                chunk,
                            )
                            .unwrap();
                            assert_eq!(
                                bits(&got),
                                bits(&want),
                                "{ty:?} hd={hd} bs={bs} group={group} kv_heads={qh} \
                                 tokens={tokens} window={window:?} {lvl:?} chunk={chunk}"
                            );
                            if tokens == 7 && window.is_none() {
                                assert!(got[..ql].iter().all(|&x| x == 0.0));
                            }
                        }
                    }
                }
            }
        }
    }
    if simd::detect() >= SimdLevel::Avx2 {
        assert!(
            fast_cases > 100,
            "the tile kernels ran in {fast_cases} cases"
        );
    }
}

/// The public entry point with the default chunk and `Mask::All`/`Mask::Custom` tokens mixed
/// in one tile.
#[test]
fn mixed_masks_in_one_tile() {
    let mut rng = Rng(99);
    let (hd, bs) = (64, 16);
    let n_kv = 20 * bs + 3;
    let (s, table) = filled(KvType::F16, hd, 2, bs, n_kv, &mut rng);
    let every_third = |i: usize| i.is_multiple_of(3);
    let late = |i: usize| i > 200;
    let masks = [
        Mask::All,
        Mask::Custom(&every_third),
        Mask::Custom(&late),
        Mask::All,
    ];
    let qs: Vec<Vec<f32>> = (0..4).map(|_| normals(&mut rng, 2 * 3 * hd, 1.5)).collect();
    let queries: Vec<Query> = (0..4)
        .map(|t| Query {
            layer: 0,
            kv_head: 0,
            kv_heads: 2,
            head_dim: hd,
            q: &qs[t],
            scale: 0.125,
            mask: masks[t],
        })
        .collect();
    let ql = 6 * hd;
    let mut scratch = Scratch::default();
    let mut want = vec![0.0; 4 * ql];
    for (q, o) in queries.iter().zip(want.chunks_exact_mut(ql)) {
        super::super::attend(&s, &table, n_kv, q, o, &mut scratch).unwrap();
    }
    let mut got = vec![0.0; 4 * ql];
    attend_tile(&s, &table, n_kv, &queries, &mut got, &mut scratch).unwrap();
    assert_eq!(bits(&got), bits(&want));
}

#[test]
fn bad_tiles_are_errors() {
    let mut rng = Rng(7);
    let (s, table) = filled(KvType::F16, 64, 2, 16, 40, &mut rng);
    let q = normals(&mut rng, 2 * 64, 1.0);
    let query = |kv_head: usize| Query {
        layer: 0,
        kv_head,
        kv_heads: 1,
        head_dim: 64,
        q: &q,
        scale: 0.125,
        mask: Mask::All,
    };
    let mut scratch = Scratch::default();
    let mut out = vec![0.0; 2 * 128];
    // Mixed KV heads, a short output, a non-empty output of no query, a bad layer.
    let mixed = [query(0), query(1)];
    assert!(attend_tile(&s, &table, 40, &mixed, &mut out, &mut scratch).is_err());
    let same = [query(0), query(0)];
    assert!(attend_tile(&s, &table, 40, &same, &mut out[..200], &mut scratch).is_err());
    assert!(attend_tile(&s, &table, 40, &[], &mut out, &mut scratch).is_err());
    assert!(attend_tile(&s, &table, 40, &[], &mut [], &mut scratch).is_ok());
    let bad_layer = [
        Query {
            layer: 5,
            ..query(0)
        },
        Query {
            layer: 5,
            ..query(0)
        },
    ];
    assert!(attend_tile(&s, &table, 40, &bad_layer, &mut out, &mut scratch).is_err());
    // Too many cells for the table.
    assert!(attend_tile(&s, &table, 400, &same, &mut out, &mut scratch).is_err());
    attend_tile(&s, &table, 40, &same, &mut out, &mut scratch).unwrap();
}

/// `block_hidden`'s answers agree with `Mask::visible` cell by cell: random positions (empty
/// cells, gaps, blocks after the query), causal and window masks, and extreme positions and
/// windows where `qpos - p` would wrap.
#[test]
fn block_hidden_agrees_with_the_per_cell_mask() {
    let mut rng = Rng(0xB10C);
    let mut decided = 0;
    for case in 0..4000 {
        let n = 1 + rng.below(16);
        let extreme = case % 10 == 0;
        let positions: Vec<i32> = (0..n)
            .map(|_| match rng.below(8) {
                0 => -1,
                _ if extreme => [i32::MIN, i32::MAX, 0, -7][rng.below(4)],
                _ => rng.range(0, 60),
            })
            .collect();
        let qpos = if extreme {
            [i32::MIN, i32::MAX, 0, 30][rng.below(4)]
        } else {
            rng.range(-3, 70)
        };
        let window = if extreme {
            [i32::MAX, 1, 0, -4][rng.below(4)]
        } else {
            rng.range(1, 40)
        };
        for mask in [
            Mask::Causal {
                positions: &positions,
                qpos,
            },
            Mask::Window {
                positions: &positions,
                qpos,
                window,
            },
            Mask::All,
        ] {
            // The per-cell test wraps in release builds only where the fast one answers None.
            let per_cell = |j: usize| -> Option<bool> {
                let p = positions[j];
                match mask {
                    Mask::Window { .. } if p >= 0 && p <= qpos => {
                        i32::checked_sub(qpos, p).map(|d| d < window).map(|v| !v)
                    }
                    _ => Some(!mask.visible(j)),
                }
            };
            let hidden: Option<Vec<bool>> = (0..n).map(per_cell).collect();
            let mut stats = None;
            match (block_hidden(&mask, 0, n, &mut stats), hidden) {
                (None, _) => {}
                (Some(all), Some(h)) => {
                    decided += 1;
                    assert!(h.iter().all(|&x| x == all), "{positions:?} {qpos} {window}");
                }
                (Some(_), None) => panic!("answered where qpos - p wraps: {positions:?} {qpos}"),
            }
        }
    }
    assert!(decided > 4000, "decided {decided}");
}

/// Decode queries of several sequences whose tables share their first blocks (whole chunks):
/// the shared blocks' folded states (`attend_tile_states`, one call for every query), merged
/// with each query's later chunks (`attend_chunk`), give `attend`'s bits. Tiles of 2 to 7
/// queries (the AVX-512 tile where the CPU has it), one query (the token-by-token twin), and
/// Q8_0 K/V (always the twin).
#[test]
fn shared_block_states_merge_to_single_token_bits() {
    use super::super::{attend, attend_chunk, merge_chunks, partial_len, visible_blocks};
    let mut rng = Rng(0xCA5C);
    let bs = 16;
    let chunk = chunk_blocks(bs);
    for ty in [KvType::F16, KvType::F32, KvType::Q8_0] {
        for (hd, kvh, group) in [(64, 3, 3), (32, 1, 2)] {
            for nq in [1, 2, 5, 7] {
                for shared_chunks in [1, 2] {
                    let shared = shared_chunks * chunk;
                    // Each query's own cells after the shared ones (some none, some past a
                    // chunk of their own).
                    let own: Vec<usize> = (0..nq).map(|i| [0, 1, 37, 300][(i + nq) % 4]).collect();
                    let own_blocks: Vec<usize> = own.iter().map(|n| n.div_ceil(bs)).collect();
                    let nb = shared + own_blocks.iter().sum::<usize>();
                    let layout = KvLayout {
                        ty,
                        n_layers: 1,
                        kv_dim: hd * kvh,
                        block_size: bs,
                    };
                    let mut s = KvStorage::new(layout, nb + 2).unwrap();
                    let mut ids: Vec<u32> = (0..(nb + 2) as u32).collect();
                    for i in (1..ids.len()).rev() {
                        ids.swap(i, rng.below(i + 1));
                    }
                    let d = hd * kvh;
                    for &b in &ids[..nb] {
                        for slot in 0..bs {
                            let mut k = normals(&mut rng, d, 1.0);
                            k[3 % d] *= 6.0;
                            s.write(0, b, slot, &k, &normals(&mut rng, d, 1.0)).unwrap();
                        }
                    }
                    let mut next = shared;
                    let tables: Vec<Vec<u32>> = own_blocks
                        .iter()
                        .map(|&ob| {
                            let mut t = ids[..shared].to_vec();
                            t.extend_from_slice(&ids[next..next + ob]);
                            next += ob;
                            t
                        })
                        .collect();
                    let n_kvs: Vec<usize> = own.iter().map(|o| shared * bs + o).collect();
                    let positions: Vec<Vec<i32>> =
                        n_kvs.iter().map(|&n| (0..n as i32).collect()).collect();
                    let qs: Vec<Vec<f32>> = (0..nq)
                        .map(|_| normals(&mut rng, kvh * group * hd, 1.0))
                        .collect();
                    let query = |i: usize| Query {
                        layer: 0,
                        kv_head: 0,
                        kv_heads: kvh,
                        head_dim: hd,
                        q: &qs[i],
                        scale: 1.0 / (hd as f32).sqrt(),
                        mask: Mask::Causal {
                            positions: &positions[i],
                            qpos: n_kvs[i] as i32 - 1,
                        },
                    };
                    let queries: Vec<Query> = (0..nq).map(query).collect();
                    let (heads, len) = (kvh * group, partial_len(kvh * group, hd));
                    let mut scratch = Scratch::default();
                    let mut states = vec![f32::NAN; nq * len];
                    attend_tile_states(
                        &s,
                        &tables[0][..shared],
                        shared * bs,
                        &queries,
                        &mut states,
                        &mut scratch,
                    )
                    .unwrap();
                    for (i, q) in queries.iter().enumerate() {
                        let what = format!("{ty:?} hd {hd} x {kvh}, {nq} queries, query {i}");
                        let mut want = vec![f32::NAN; heads * hd];
                        attend(&s, &tables[i], n_kvs[i], q, &mut want, &mut scratch).unwrap();
                        let mut vis = Vec::new();
                        visible_blocks(n_kvs[i], bs, &q.mask, &mut vis);
                        let mut parts = vec![states[i * len..(i + 1) * len].to_vec()];
                        for blocks in vis[shared..].chunks(chunk) {
                            let mut p = vec![f32::NAN; len];
                            attend_chunk(&s, &tables[i], n_kvs[i], blocks, q, &mut p, &mut scratch)
                                .unwrap();
                            parts.push(p);
                        }
                        let mut got = vec![f32::NAN; heads * hd];
                        merge_chunks(
                            heads,
                            hd,
                            parts.iter().map(|p| &p[..]),
                            &mut got,
                            &mut scratch,
                        );
                        assert_eq!(bits(&got), bits(&want), "{what}");
                    }
                }
            }
        }
    }
}
