//! Byte-level BPE (GPT-2 style) word encoder.
//!
//! A word's UTF-8 bytes are mapped one-to-one onto the GPT-2 "byte-encoded" alphabet, then
//! adjacent symbols are merged lowest merge rank first (ties: leftmost), exactly as llama.cpp's
//! `llm_tokenizer_bpe_session` does, using a binary heap and a linked list of symbols, so one
//! word costs O(n log n).  Guarantees: never panics; every output id is a valid vocabulary id.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// The GPT-2 byte -> char table: printable Latin-1 bytes map to themselves, the other 68
/// bytes to U+0100.. in byte order.
pub fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for (b, slot) in table.iter_mut().enumerate() {
        let keep = matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
        let cp = if keep {
            b as u32
        } else {
            n += 1;
            255 + n
        };
        *slot = char::from_u32(cp).unwrap_or('\0');
    }
    table
}

/// Inverse of [`byte_to_char_table`]: `char -> byte` for the 256 encoded chars.
pub fn char_to_byte(c: char) -> Option<u8> {
    let cp = c as u32;
    match cp {
        0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF => Some(cp as u8),
        0x100..=0x143 => {
            // the n-th byte (in order) that is not kept
            let n = cp - 0x100;
            (0u32..256)
                .filter(|b| !matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF))
                .nth(n as usize)
                .map(|b| b as u8)
        }
        _ => None,
    }
}

/// Merge table over token ids.
pub struct Bpe {
    /// (left id, right id) -> (rank, id of the concatenation if it is a token)
    merges: HashMap<(u32, u32), (u32, Option<u32>)>,
    /// id of the single encoded char of each byte, if the vocabulary has it
    byte_sym: [Option<u32>; 256],
}

#[derive(Clone, Copy)]
struct Sym {
    start: usize,
    end: usize,
    id: Option<u32>,
    next: usize,
    prev: usize,
    alive: bool,
}

const NONE: usize = usize::MAX;

/// Heap entry: (rank, left, right, end of right when pushed, id of the merge result).
type Entry = Reverse<(u32, usize, usize, usize, Option<u32>)>;

impl Bpe {
    pub fn new(
        merges: HashMap<(u32, u32), (u32, Option<u32>)>,
        byte_sym: [Option<u32>; 256],
    ) -> Bpe {
        Bpe { merges, byte_sym }
    }

    /// Encode one pre-tokenized word (raw UTF-8 bytes), appending ids to `out`.
    pub fn encode_word(&self, word: &[u8], out: &mut Vec<u32>) {
        let n = word.len();
        if n == 0 {
            return;
        }
        let mut syms: Vec<Sym> = word
            .iter()
            .enumerate()
            .map(|(i, &b)| Sym {
                start: i,
                end: i + 1,
                id: self.byte_sym[b as usize],
                next: if i + 1 < n { i + 1 } else { NONE },
                prev: if i > 0 { i - 1 } else { NONE },
                alive: true,
            })
            .collect();
        // (rank, left) ordered min-first; `end` detects stale entries
        let mut heap: BinaryHeap<Entry> = BinaryHeap::new();
        let push = |heap: &mut BinaryHeap<_>, syms: &[Sym], l: usize| {
            let r = syms[l].next;
            if r == NONE {
                return;
            }
            if let (Some(a), Some(b)) = (syms[l].id, syms[r].id) {
                if let Some(&(rank, merged)) = self.merges.get(&(a, b)) {
                    heap.push(Reverse((rank, l, r, syms[r].end, merged)));
                }
            }
        };
        for l in 0..n - 1 {
            push(&mut heap, &syms, l);
        }
        while let Some(Reverse((_, l, r, end, merged))) = heap.pop() {
            if !syms[l].alive || !syms[r].alive || syms[l].next != r || syms[r].end != end {
                continue;
            }
            let rn = syms[r].next;
            syms[l].end = end;
            syms[l].id = merged;
            syms[l].next = rn;
            syms[r].alive = false;
            if rn != NONE {
                syms[rn].prev = l;
            }
            let lp = syms[l].prev;
            if lp != NONE {
                push(&mut heap, &syms, lp);
            }
            push(&mut heap, &syms, l);
        }
        let mut i = 0;
        while i != NONE {
            let s = &syms[i];
            match s.id {
                Some(id) => out.push(id),
                None => {
                    // llama.cpp falls back to single-byte token strings; only printable ASCII
                    // can match one
                    for &b in &word[s.start..s.end] {
                        if (0x21..=0x7E).contains(&b) {
                            if let Some(id) = self.byte_sym[b as usize] {
                                out.push(id);
                            }
                        }
                    }
                }
            }
            i = s.next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_gpt2() {
        let t = byte_to_char_table();
        assert_eq!(t[b'A' as usize], 'A');
        assert_eq!(t[b' ' as usize], 'Ġ'); // U+0120
        assert_eq!(t[b'\n' as usize], 'Ċ'); // U+010A
        assert_eq!(t[0xAD], 'Ń'); // U+0143, the last remapped byte
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(t[b as usize]), Some(b));
        }
        assert_eq!(char_to_byte('\u{144}'), None);
    }

    #[test]
    fn merges_lowest_rank_first() {
        // bytes a=0, b=1, c=2; ids 3=ab, 4=bc, 5=abc
        let mut byte_sym = [None; 256];
        byte_sym[b'a' as usize] = Some(0);
        byte_sym[b'b' as usize] = Some(1);
        byte_sym[b'c' as usize] = Some(2);
        let mut m = HashMap::new();
        m.insert((1, 2), (0, Some(4))); // "b c" rank 0
        m.insert((0, 1), (1, Some(3))); // "a b" rank 1
        m.insert((0, 4), (2, Some(5))); // "a bc" rank 2
        let bpe = Bpe::new(m, byte_sym);
        let mut out = vec![];
        bpe.encode_word(b"abc", &mut out);
        assert_eq!(out, [5]);
        out.clear();
        bpe.encode_word(b"abab", &mut out);
        assert_eq!(out, [3, 3]);
        out.clear();
        // unknown byte: dropped by the llama.cpp fallback
        bpe.encode_word(b"a\x01c", &mut out);
        assert_eq!(out, [0, 2]);
    }
}
