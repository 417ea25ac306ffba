//! Unicode character classes for the pre-tokenizers.
//!
//! Guarantees: `class` returns the general-category class of any `char` according to the
//! generated table in `unicode_tables.rs` (Unicode 15.1, the version llama.cpp's tables use),
//! and `is_whitespace` is exactly the Unicode `White_Space` property.  Both are total functions
//! (no panics) and ASCII takes a constant-time path.

use super::unicode_tables::CLASS_RUNS;

/// General-category class of a codepoint (`\p{L}`, `\p{N}`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    Unassigned,
    Letter,
    Number,
    Mark,
    Punctuation,
    Symbol,
    Separator,
    Control,
}

impl Class {
    fn from_id(id: u8) -> Class {
        match id {
            1 => Class::Letter,
            2 => Class::Number,
            3 => Class::Mark,
            4 => Class::Punctuation,
            5 => Class::Symbol,
            6 => Class::Separator,
            7 => Class::Control,
            _ => Class::Unassigned,
        }
    }
}

/// The class of `c`.
pub fn class(c: char) -> Class {
    let cp = c as u32;
    if cp < 0x80 {
        let b = cp as u8;
        return if b.is_ascii_alphabetic() {
            Class::Letter
        } else if b.is_ascii_digit() {
            Class::Number
        } else if b == b' ' {
            Class::Separator
        } else if b < 0x20 || b == 0x7f {
            Class::Control
        } else if matches!(
            b,
            b'$' | b'+' | b'<' | b'=' | b'>' | b'^' | b'`' | b'|' | b'~'
        ) {
            Class::Symbol
        } else {
            Class::Punctuation
        };
    }
    // last run whose start is <= cp; the table starts at 0 so the index is never negative
    let idx = CLASS_RUNS.partition_point(|&(start, _)| start <= cp);
    CLASS_RUNS
        .get(idx.wrapping_sub(1))
        .map_or(Class::Unassigned, |&(_, id)| Class::from_id(id))
}

pub fn is_letter(c: char) -> bool {
    class(c) == Class::Letter
}

pub fn is_number(c: char) -> bool {
    class(c) == Class::Number
}

/// The Unicode `White_Space` property (25 codepoints).
pub fn is_whitespace(c: char) -> bool {
    matches!(
        c as u32,
        0x09..=0x0D
            | 0x20
            | 0x85
            | 0xA0
            | 0x1680
            | 0x2000..=0x200A
            | 0x2028
            | 0x2029
            | 0x202F
            | 0x205F
            | 0x3000
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ascii_fast_path_matches_table() {
        // the generated table must agree with the hand-written ASCII path
        for cp in 0u32..0x80 {
            let c = char::from_u32(cp).unwrap();
            let idx = CLASS_RUNS.partition_point(|&(s, _)| s <= cp);
            let from_table = Class::from_id(CLASS_RUNS[idx - 1].1);
            assert_eq!(class(c), from_table, "codepoint {cp:#x}");
        }
    }

    #[test]
    fn known_classes() {
        assert_eq!(class('é'), Class::Letter);
        assert_eq!(class('中'), Class::Letter);
        assert_eq!(class('٣'), Class::Number);
        assert_eq!(class('½'), Class::Number);
        assert_eq!(class('\u{301}'), Class::Mark);
        assert_eq!(class('“'), Class::Punctuation);
        assert_eq!(class('😀'), Class::Symbol);
        assert_eq!(class('\u{3000}'), Class::Separator);
        assert_eq!(class('\u{200d}'), Class::Control);
        assert_eq!(class('\u{378}'), Class::Unassigned);
        // CJK extension I, added in Unicode 15.1
        assert_eq!(class('\u{2EBF0}'), Class::Letter);
        assert_eq!(class('\u{10FFFF}'), Class::Unassigned);
        assert!(is_whitespace('\u{a0}') && is_whitespace('\u{85}') && !is_whitespace('\u{200b}'));
        assert!(!is_whitespace('\u{1c}'));
    }
}
