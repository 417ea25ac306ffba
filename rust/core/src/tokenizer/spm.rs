//! SentencePiece-style (llama.cpp "SPM") encoder over scored pieces.
//!
//! Starts from single UTF-8 characters and repeatedly merges the adjacent pair whose
//! concatenation is a vocabulary piece with the highest score (ties: leftmost), like llama.cpp's
//! `llm_tokenizer_spm_session`; characters that end up as no piece are emitted as byte tokens
//! (`<0xXX>`).  Guarantees: never panics; every output id is a valid vocabulary id.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Bigram {
    /// Max-heap order: higher score first, then smaller left index.
    fn cmp(&self, o: &Self) -> Ordering {
        self.score
            .partial_cmp(&o.score)
            .unwrap_or(Ordering::Equal)
            .then_with(|| o.left.cmp(&self.left))
    }
}

struct Sym {
    start: usize,
    len: usize,
    prev: usize,
    next: usize,
}

const NONE: usize = usize::MAX;

/// What the encoder needs from the vocabulary.
pub struct SpmVocab<'a> {
    pub token_to_id: &'a HashMap<String, u32>,
    pub scores: &'a [f32],
    /// id for each byte: `<0xXX>`, else the one-byte piece, else `unk`
    pub byte_tok: &'a [Option<u32>; 256],
}

/// Encode `text` (spaces already escaped to U+2581), appending ids to `out`.
pub fn encode(v: &SpmVocab, text: &str, out: &mut Vec<u32>) {
    let mut syms: Vec<Sym> = Vec::with_capacity(text.len());
    for (i, (off, c)) in text.char_indices().enumerate() {
        syms.push(Sym {
            start: off,
            len: c.len_utf8(),
            prev: i.wrapping_sub(1),
            next: i + 1,
        });
    }
    let Some(last) = syms.last_mut() else { return };
    last.next = NONE;
    if let Some(first) = syms.first_mut() {
        first.prev = NONE;
    }
    let mut heap = BinaryHeap::new();
    let try_add = |heap: &mut BinaryHeap<Bigram>, syms: &[Sym], l: usize, r: usize| {
        if l == NONE || r == NONE {
            return;
        }
        let (s, e) = (syms[l].start, syms[r].start + syms[r].len);
        if let Some(&id) = v.token_to_id.get(&text[s..e]) {
            let score = v.scores.get(id as usize).copied().unwrap_or(0.0);
            heap.push(Bigram {
                score,
                left: l,
                right: r,
                size: e - s,
            });
        }
    };
    for i in 1..syms.len() {
        try_add(&mut heap, &syms, i - 1, i);
    }
    while let Some(bg) = heap.pop() {
        let (l, r) = (bg.left, bg.right);
        if syms[l].len == 0 || syms[r].len == 0 || syms[l].len + syms[r].len != bg.size {
            continue;
        }
        syms[l].len += syms[r].len;
        syms[r].len = 0;
        let rn = syms[r].next;
        syms[l].next = rn;
        if rn != NONE {
            syms[rn].prev = l;
        }
        let lp = syms[l].prev;
        try_add(&mut heap, &syms, lp, l);
        try_add(&mut heap, &syms, l, rn);
    }
    let mut i = 0;
    while i != NONE {
        let s = &syms[i];
        let piece = &text[s.start..s.start + s.len];
        match v.token_to_id.get(piece) {
            Some(&id) => out.push(id),
            None => out.extend(piece.bytes().filter_map(|b| v.byte_tok[b as usize])),
        }
        i = s.next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn highest_score_then_leftmost() {
        let toks = ["a", "b", "ab", "bb", "abb"];
        let scores = [0.0, 0.0, -1.0, -1.0, -0.5];
        let map: HashMap<String, u32> = toks
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        let mut byte_tok = [None; 256];
        byte_tok[b'x' as usize] = Some(7);
        let v = SpmVocab {
            token_to_id: &map,
            scores: &scores,
            byte_tok: &byte_tok,
        };
        let mut out = vec![];
        // "ab" and "bb" tie at -1: leftmost "ab" first, then "ab"+"b" = "abb"
        encode(&v, "abb", &mut out);
        assert_eq!(out, [4]);
        out.clear();
        encode(&v, "bab", &mut out);
        assert_eq!(out, [1, 2]);
        out.clear();
        // an unknown char falls back to its bytes ("x" has a byte token, "é" has none)
        encode(&v, "xé", &mut out);
        assert_eq!(out, [7]);
    }
}
