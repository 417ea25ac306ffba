//! The single-context key/value store of the engine foundation: per sequence, per layer, one
//! growing row of cells (position + K + V). Values are rounded to f16 when stored, so attention
//! sees exactly what an f16 cache (llama.cpp's default) holds.
//!
//! This store grows on demand and is bounded by `n_ctx` cells in total. The paged block pool of
//! the KV-cache issue replaces it behind the same three calls: `reserve`, `write`, `layer_view`.

use std::collections::BTreeMap;

use half::f16;

use crate::batch::Batch;
use crate::error::{Error, Result};

#[derive(Default)]
struct SeqKv {
    positions: Vec<i32>,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

pub struct SeqCache {
    n_layer: usize,
    kv_dim: usize,
    n_ctx: usize,
    seqs: BTreeMap<i32, SeqKv>,
    empty: SeqKv,
}

/// Where token `t` of a batch is stored: (sequence, cell index in that sequence).
pub type CellRef = (i32, usize);

impl SeqCache {
    pub fn new(n_layer: usize, kv_dim: usize, n_ctx: usize) -> SeqCache {
        SeqCache {
            n_layer,
            kv_dim,
            n_ctx,
            seqs: BTreeMap::new(),
            empty: SeqKv::default(),
        }
    }

    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// Cells in use across all sequences.
    pub fn n_cells(&self) -> usize {
        self.seqs.values().map(|s| s.positions.len()).sum()
    }

    pub fn clear(&mut self) {
        self.seqs.clear();
    }

    /// Highest position stored for `seq`, or -1.
    pub fn pos_max(&self, seq: i32) -> i32 {
        self.seqs
            .get(&seq)
            .and_then(|s| s.positions.iter().max().copied())
            .unwrap_or(-1)
    }

    /// Takes one cell per batch token. Fails with `KvCacheFull`, changing nothing, when the
    /// batch does not fit.
    pub fn reserve(&mut self, batch: &Batch) -> Result<Vec<CellRef>> {
        let used = self.n_cells();
        if used + batch.len() > self.n_ctx {
            return Err(Error::KvCacheFull(format!(
                "KV cache full: {used} of {} cells used, batch needs {}",
                self.n_ctx,
                batch.len()
            )));
        }
        let (n_layer, kv_dim) = (self.n_layer, self.kv_dim);
        let mut cells = Vec::with_capacity(batch.len());
        for (&seq, &pos) in batch.seq_ids.iter().zip(&batch.positions) {
            let s = self.seqs.entry(seq).or_insert_with(|| SeqKv {
                positions: Vec::new(),
                k: vec![Vec::new(); n_layer],
                v: vec![Vec::new(); n_layer],
            });
            cells.push((seq, s.positions.len()));
            s.positions.push(pos);
            for l in 0..n_layer {
                s.k[l].resize(s.positions.len() * kv_dim, 0.0);
                s.v[l].resize(s.positions.len() * kv_dim, 0.0);
            }
        }
        Ok(cells)
    }

    /// Stores the keys and values of layer `layer` for the reserved cells (`k`, `v`: one row of
    /// `kv_dim` per batch token).
    pub fn write(&mut self, layer: usize, cells: &[CellRef], k: &[f32], v: &[f32]) {
        let d = self.kv_dim;
        for (t, &(seq, cell)) in cells.iter().enumerate() {
            let s = self
                .seqs
                .get_mut(&seq)
                .expect("cell was reserved for this sequence");
            let dst_k = &mut s.k[layer][cell * d..(cell + 1) * d];
            for (o, &x) in dst_k.iter_mut().zip(&k[t * d..(t + 1) * d]) {
                *o = f16::from_f32(x).to_f32();
            }
            let dst_v = &mut s.v[layer][cell * d..(cell + 1) * d];
            for (o, &x) in dst_v.iter_mut().zip(&v[t * d..(t + 1) * d]) {
                *o = f16::from_f32(x).to_f32();
            }
        }
    }

    /// Keys, values (rows of `kv_dim`) and positions of every cell of `seq` in `layer`.
    pub fn layer_view(&self, layer: usize, seq: i32) -> (&[f32], &[f32], &[i32]) {
        match self.seqs.get(&seq) {
            Some(s) => (&s.k[layer], &s.v[layer], &s.positions),
            None => (&[], &[], &self.empty.positions),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_cache_changes_nothing() {
        let mut c = SeqCache::new(2, 4, 5);
        let b = Batch::prompt(&[1, 2, 3], 0, 0);
        let cells = c.reserve(&b).unwrap();
        assert_eq!(cells, vec![(0, 0), (0, 1), (0, 2)]);
        let err = c.reserve(&Batch::prompt(&[1, 2, 3], 3, 1)).unwrap_err();
        assert!(matches!(err, Error::KvCacheFull(_)));
        assert_eq!(c.n_cells(), 3);
        assert_eq!(c.pos_max(0), 2);
        assert_eq!(c.pos_max(1), -1);
    }

    #[test]
    fn values_round_to_f16() {
        let mut c = SeqCache::new(1, 2, 8);
        let cells = c.reserve(&Batch::prompt(&[0], 0, 3)).unwrap();
        c.write(0, &cells, &[1.0001, 2.0], &[0.1, -3.0]);
        let (k, v, p) = c.layer_view(0, 3);
        assert_eq!(p, &[0]);
        assert_eq!(k, &[f16::from_f32(1.0001).to_f32(), 2.0]);
        assert_eq!(v, &[f16::from_f32(0.1).to_f32(), -3.0]);
    }
}
