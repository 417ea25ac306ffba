//! A batch: the tokens of one forward pass (a "ubatch"), each with its position, the sequence it
//! belongs to and whether its logits are wanted. Single-sequence callers use one seq id; the KV
//! cache issue generalizes the forward pass to many sequences without changing this type.

use crate::error::{invalid, Result};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Batch {
    pub tokens: Vec<u32>,
    pub positions: Vec<i32>,
    pub seq_ids: Vec<i32>,
    pub logits: Vec<bool>,
}

impl Batch {
    /// A batch of consecutive tokens of sequence `seq` starting at position `pos0`; logits only
    /// for the last token (the usual prompt-prefill shape).
    pub fn prompt(tokens: &[u32], pos0: i32, seq: i32) -> Batch {
        let n = tokens.len();
        Batch {
            tokens: tokens.to_vec(),
            positions: (0..n as i32).map(|i| pos0 + i).collect(),
            seq_ids: vec![seq; n],
            logits: (0..n).map(|i| i + 1 == n).collect(),
        }
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Number of tokens whose logits are returned.
    pub fn n_outputs(&self) -> usize {
        self.logits.iter().filter(|&&b| b).count()
    }

    /// Checks that all columns have the same length and values are in range.
    pub fn validate(&self, n_vocab: usize) -> Result<()> {
        let n = self.tokens.len();
        if n == 0 {
            return Err(invalid("batch is empty"));
        }
        if self.positions.len() != n || self.seq_ids.len() != n || self.logits.len() != n {
            return Err(invalid(format!(
                "batch columns differ in length: tokens {}, positions {}, seq_ids {}, logits {}",
                n,
                self.positions.len(),
                self.seq_ids.len(),
                self.logits.len()
            )));
        }
        for (i, &t) in self.tokens.iter().enumerate() {
            if t as usize >= n_vocab {
                return Err(invalid(format!(
                    "token {t} at batch index {i} is out of range (vocabulary has {n_vocab})"
                )));
            }
        }
        for (i, &p) in self.positions.iter().enumerate() {
            if p < 0 {
                return Err(invalid(format!("negative position {p} at batch index {i}")));
            }
        }
        for (i, &s) in self.seq_ids.iter().enumerate() {
            if s < 0 {
                return Err(invalid(format!(
                    "negative sequence id {s} at batch index {i}"
                )));
            }
        }
        Ok(())
    }
}
