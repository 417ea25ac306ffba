//! Pre-tokenizers of byte-level BPE vocabularies: split text into words before BPE merging.
//!
//! Each `PreTokenizer` reproduces, by hand-written scanners over Unicode classes, the split
//! that llama.cpp computes for the corresponding `tokenizer.ggml.pre` value (including its
//! quirks, e.g. `\s+(?!\S)` and `\p{N}{1,3}`).  Guarantees: the returned byte ranges are
//! non-empty, ordered, contiguous and cover the whole input, always on `char` boundaries.

use super::unicode::{class, is_letter, is_number, is_whitespace, Class};
use std::ops::Range;

/// The split rules of one family of pre-tokenizers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizer {
    /// llama.cpp's `default`: punctuation runs, GPT-2 rules, digit runs, groups of 3 ASCII digits.
    Default,
    /// GPT-2: `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
    Gpt2,
    /// Every `\p{N}` isolated, then GPT-2 rules (SmolLM, StarCoder, ...).
    DigitsThenGpt2,
    /// Llama 3: case-insensitive contractions, `[^\r\n\p{L}\p{N}]?\p{L}+`, `\p{N}{1,3}`, ...
    Llama3,
    /// Qwen2: as Llama 3 but single digits `\p{N}`.
    Qwen2,
}

/// A text as codepoints plus the byte offset of each (and of the end).
struct Cps {
    chars: Vec<char>,
    offs: Vec<usize>,
}

/// One pass: for the piece `[s, e)` (char indices), push sub-pieces to `out`.
type Pass = fn(&[char], usize, usize, &mut Vec<(usize, usize)>);

impl PreTokenizer {
    /// Split `text` into words; byte ranges into `text`.
    pub fn split(self, text: &str) -> Vec<Range<usize>> {
        if text.is_empty() {
            return Vec::new();
        }
        let mut cps = Cps {
            chars: Vec::with_capacity(text.len()),
            offs: Vec::with_capacity(text.len() + 1),
        };
        for (i, c) in text.char_indices() {
            cps.chars.push(c);
            cps.offs.push(i);
        }
        cps.offs.push(text.len());

        let passes: &[Pass] = match self {
            PreTokenizer::Default => &[punct_runs, gpt2, number_runs, ascii_digit_triples],
            PreTokenizer::Gpt2 => &[gpt2],
            PreTokenizer::DigitsThenGpt2 => &[single_numbers, gpt2],
            PreTokenizer::Llama3 => &[llama3],
            PreTokenizer::Qwen2 => &[qwen2],
        };
        let mut pieces = vec![(0, cps.chars.len())];
        for pass in passes {
            let mut next = Vec::with_capacity(pieces.len() * 2);
            for &(s, e) in &pieces {
                pass(&cps.chars, s, e, &mut next);
            }
            pieces = next;
        }
        pieces
            .into_iter()
            .map(|(s, e)| cps.offs[s]..cps.offs[e])
            .collect()
    }
}

/// Emits consecutive pieces of one segment, remembering where the last one ended.
struct Emitter<'a> {
    out: &'a mut Vec<(usize, usize)>,
    prev: usize,
}

impl Emitter<'_> {
    fn emit(&mut self, end: usize) {
        if end > self.prev {
            self.out.push((self.prev, end));
        }
        self.prev = end;
    }
}

/// Per-codepoint predicates, `false` outside the segment `[s, e)`.
struct Seg<'a> {
    cps: &'a [char],
    e: usize,
}

impl Seg<'_> {
    fn get(&self, pos: usize) -> Option<char> {
        if pos < self.e {
            self.cps.get(pos).copied()
        } else {
            None
        }
    }
    fn letter(&self, pos: usize) -> bool {
        self.get(pos).is_some_and(is_letter)
    }
    fn number(&self, pos: usize) -> bool {
        self.get(pos).is_some_and(is_number)
    }
    fn space(&self, pos: usize) -> bool {
        self.get(pos).is_some_and(is_whitespace)
    }
    /// In the segment and none of whitespace, letter, number: `[^\s\p{L}\p{N}]`.
    fn other(&self, pos: usize) -> bool {
        self.get(pos).is_some_and(|c| {
            !is_whitespace(c) && !matches!(class(c), Class::Letter | Class::Number)
        })
    }
    fn is(&self, pos: usize, c: char) -> bool {
        self.get(pos) == Some(c)
    }
}

/// Length of a contraction (`'s`, `'t`, `'re`, `'ve`, `'m`, `'ll`, `'d`) starting at `pos`.
fn contraction(seg: &Seg, pos: usize, ignore_case: bool) -> Option<usize> {
    if !seg.is(pos, '\'') {
        return None;
    }
    let low = |p: usize| {
        seg.get(p).map(|c| {
            if ignore_case {
                c.to_ascii_lowercase()
            } else {
                c
            }
        })
    };
    match low(pos + 1)? {
        's' | 't' | 'm' | 'd' => return Some(2),
        _ => {}
    }
    match (low(pos + 1)?, low(pos + 2)?) {
        ('r', 'e') | ('v', 'e') | ('l', 'l') => Some(3),
        _ => None,
    }
}

/// Whitespace run length starting at `pos`.
fn space_run(seg: &Seg, pos: usize) -> usize {
    let mut n = 0;
    while seg.space(pos + n) {
        n += 1;
    }
    n
}

fn gpt2(cps: &[char], s: usize, e: usize, out: &mut Vec<(usize, usize)>) {
    let seg = Seg { cps, e };
    let mut em = Emitter { out, prev: s };
    let mut pos = s;
    while pos < e {
        if let Some(n) = contraction(&seg, pos, false) {
            pos += n;
            em.emit(pos);
            continue;
        }
        let space = seg.is(pos, ' ');
        let p2 = if space { pos + 1 } else { pos };
        // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`
        let run: Option<fn(&Seg, usize) -> bool> = if seg.letter(p2) {
            Some(|sg, p| sg.letter(p))
        } else if seg.number(p2) {
            Some(|sg, p| sg.number(p))
        } else if seg.other(p2) {
            Some(|sg, p| sg.other(p))
        } else {
            None
        };
        if let Some(in_run) = run {
            pos = p2;
            while in_run(&seg, pos) {
                pos += 1;
            }
            em.emit(pos);
            continue;
        }
        let n = space_run(&seg, pos);
        if n > 1 && pos + n < e {
            // `\s+(?!\S)`: leave the last whitespace for the next word
            pos += n - 1;
        } else if n > 0 {
            pos += n;
        } else {
            pos += 1;
        }
        em.emit(pos);
    }
}

fn llama3_like(cps: &[char], s: usize, e: usize, out: &mut Vec<(usize, usize)>, max_digits: usize) {
    let seg = Seg { cps, e };
    let mut em = Emitter { out, prev: s };
    let mut pos = s;
    while pos < e {
        if let Some(n) = contraction(&seg, pos, true) {
            pos += n;
            em.emit(pos);
            continue;
        }
        let c = cps[pos];
        // `[^\r\n\p{L}\p{N}]?\p{L}+`
        if !(c == '\r' || c == '\n' || is_number(c)) && (is_letter(c) || seg.letter(pos + 1)) {
            pos += 1;
            while seg.letter(pos) {
                pos += 1;
            }
            em.emit(pos);
            continue;
        }
        // `\p{N}{1,max}`
        if is_number(c) {
            let mut ini = pos;
            while seg.number(pos) {
                pos += 1;
                if pos - ini >= max_digits {
                    em.emit(pos);
                    ini = pos;
                }
            }
            em.emit(pos);
            continue;
        }
        // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
        let p2 = if c == ' ' { pos + 1 } else { pos };
        if seg.other(p2) {
            pos = p2;
            while seg.other(pos) {
                pos += 1;
            }
            while seg.is(pos, '\r') || seg.is(pos, '\n') {
                pos += 1;
            }
            em.emit(pos);
            continue;
        }
        // whitespace: `\s*[\r\n]+`, `\s+(?!\S)`, `\s+`
        let n = space_run(&seg, pos);
        let last_newline = (pos..pos + n)
            .rev()
            .find(|&p| cps[p] == '\r' || cps[p] == '\n');
        if let Some(p) = last_newline {
            pos = p + 1;
        } else if n > 1 && pos + n < e {
            pos += n - 1;
        } else if n > 0 {
            pos += n;
        } else {
            pos += 1;
        }
        em.emit(pos);
    }
}

fn llama3(cps: &[char], s: usize, e: usize, out: &mut Vec<(usize, usize)>) {
    llama3_like(cps, s, e, out, 3)
}

fn qwen2(cps: &[char], s: usize, e: usize, out: &mut Vec<(usize, usize)>) {
    llama3_like(cps, s, e, out, 1)
}

/// Regex-iterator split: every match of `m` (leftmost, non-overlapping) becomes a piece, and so
/// does every non-empty gap between matches.  `m(pos)` returns the end of a match at `pos`.
fn isolate(s: usize, e: usize, out: &mut Vec<(usize, usize)>, m: impl Fn(usize) -> Option<usize>) {
    let mut em = Emitter { out, prev: s };
    let mut pos = s;
    while pos < e {
        match m(pos) {
            Some(end) if end > pos => {
                em.emit(pos);
                em.emit(end);
                pos = end;
            }
            _ => pos += 1,
        }
    }
    em.emit(e);
}

fn run_end(cps: &[char], pos: usize, e: usize, pred: impl Fn(char) -> bool) -> Option<usize> {
    let mut p = pos;
    while p < e && pred(cps[p]) {
        p += 1;
    }
    (p > pos).then_some(p)
}

/// `\p{N}`: each number codepoint on its own.
fn single_numbers(cps: &[char], s: usize, e: usize, out: &mut Vec<(usize, usize)>) {
    isolate(s, e, out, |p| is_number(cps[p]).then_some(p + 1))
}

/// `\p{N}+`.
fn number_runs(cps: &[char], s: usize, e: usize, out: &mut Vec<(usize, usize)>) {
    isolate(s, e, out, |p| run_end(cps, p, e, is_number))
}

/// `[\p{P}\$\+<=>\^~\|]+` as llama.cpp evaluates it: non-ASCII punctuation plus every ASCII
/// punctuation or symbol character except the backtick.
fn punct_runs(cps: &[char], s: usize, e: usize, out: &mut Vec<(usize, usize)>) {
    let is_p = |c: char| {
        if c.is_ascii() {
            c.is_ascii_punctuation() && c != '`'
        } else {
            !is_whitespace(c) && class(c) == Class::Punctuation
        }
    };
    isolate(s, e, out, |p| run_end(cps, p, e, is_p))
}

/// `[0-9][0-9][0-9]`.
fn ascii_digit_triples(cps: &[char], s: usize, e: usize, out: &mut Vec<(usize, usize)>) {
    isolate(s, e, out, |p| {
        (p + 3 <= e && cps[p..p + 3].iter().all(char::is_ascii_digit)).then_some(p + 3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(p: PreTokenizer, text: &str) -> Vec<&str> {
        p.split(text).into_iter().map(|r| &text[r]).collect()
    }

    // Expected splits below follow the regex definitions in the variant docs.
    #[test]
    fn gpt2_rules() {
        let p = PreTokenizer::Gpt2;
        assert_eq!(words(p, "Hello world"), ["Hello", " world"]);
        assert_eq!(
            words(p, "I'm here, they'll"),
            ["I", "'m", " here", ",", " they", "'ll"]
        );
        assert_eq!(words(p, "I'M"), ["I", "'", "M"]);
        assert_eq!(words(p, "a   b"), ["a", "  ", " b"]);
        assert_eq!(words(p, "a   "), ["a", "   "]);
        assert_eq!(words(p, "x 123 ..."), ["x", " 123", " ..."]);
        // `\s+(?!\S)` leaves the last "\n"; a lone "\n" is not the optional space of ` ?\p{L}+`
        assert_eq!(words(p, "a\n\nb"), ["a", "\n", "\n", "b"]);
        assert_eq!(words(p, ""), Vec::<&str>::new());
    }

    #[test]
    fn digits_then_gpt2() {
        let p = PreTokenizer::DigitsThenGpt2;
        assert_eq!(words(p, "abc 1234"), ["abc", " ", "1", "2", "3", "4"]);
        assert_eq!(words(p, "x٣y"), ["x", "٣", "y"]);
    }

    #[test]
    fn llama3_rules() {
        let p = PreTokenizer::Llama3;
        assert_eq!(
            words(p, "I'M 1234567 ok"),
            ["I", "'M", " ", "123", "456", "7", " ok"]
        );
        assert_eq!(words(p, "a.b\"c"), ["a", ".b", "\"c"]);
        assert_eq!(words(p, "x  \n\n y"), ["x", "  \n\n", " y"]);
        assert_eq!(words(p, "ok!!\n\nz"), ["ok", "!!\n\n", "z"]);
        assert_eq!(words(p, "a   b"), ["a", "  ", " b"]);
    }

    #[test]
    fn qwen2_single_digits() {
        assert_eq!(
            words(PreTokenizer::Qwen2, "x 123"),
            ["x", " ", "1", "2", "3"]
        );
    }

    #[test]
    fn default_rules() {
        let p = PreTokenizer::Default;
        assert_eq!(words(p, "a+b 12345"), ["a", "+", "b", " ", "123", "45"]);
        assert_eq!(words(p, "`x`"), ["`", "x", "`"]);
    }

    #[test]
    fn ranges_cover_input() {
        let text = "héllo  wörld\t\n😀 12,3 'S";
        for p in [
            PreTokenizer::Default,
            PreTokenizer::Gpt2,
            PreTokenizer::DigitsThenGpt2,
            PreTokenizer::Llama3,
            PreTokenizer::Qwen2,
        ] {
            let r = p.split(text);
            assert_eq!(r.first().unwrap().start, 0);
            assert_eq!(r.last().unwrap().end, text.len());
            for w in r.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
            assert!(r.iter().all(|x| x.start < x.end));
        }
    }
}
