//! `tokenizer`: the SmolLM2 (byte-level BPE) and Gemma 3 (SentencePiece) vocabularies of the
//! real models, built once from their GGUF metadata (the files are mapped, the weights never
//! read). The first input byte picks the vocabulary and the operation:
//!
//! - bit 0: 0 = SmolLM2, 1 = Gemma 3;
//! - bits 1-2: 0/1 = tokenize the rest as text (lossy UTF-8) with `parse_special` = bit 1 and
//!   `add_special` = bit 3; 2/3 = detokenize the rest as little-endian `u32` ids (any value,
//!   in or out of the vocabulary), and render each as a piece, with and without specials.
//!
//! Properties: no panic; every id `encode` returns is in the vocabulary; and for text without
//! special-token handling, without a literal U+2581 (SentencePiece's escaped space, which
//! decodes to ' ') and whose tokens include no control token, `decode(encode(text)) == text`
//! (the round trip the golden tests check against llama.cpp's fixtures) when the vocabulary
//! can spell every byte of the text: SmolLM2's has no byte token for 0x04, 0x06, 0x13, 0x14,
//! 0x16 and 0x1d, which are then dropped, as llama.cpp drops them (see
//! `bpe_drops_bytes_the_vocabulary_lacks` in rust/core/src/tokenizer/tests.rs).
//!
//! Model paths: `KVSERVE_TEST_MODEL` and `KVSERVE_TEST_GEMMA`, else the default cache paths.
#![no_main]

#[path = "alloc_limit.rs"]
mod alloc_limit;

#[global_allocator]
static ALLOC: alloc_limit::Limited = alloc_limit::Limited;

use std::sync::LazyLock;

use kvserve_core::gguf::GgufFile;
use kvserve_core::model::vocab_from_gguf;
use kvserve_core::tokenizer::Tokenizer;
use libfuzzer_sys::fuzz_target;

fn load(var: &str, default: &str) -> Tokenizer {
    let path = std::env::var(var).unwrap_or_else(|_| {
        let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
        format!("{home}/.cache/kvserve/models/{default}")
    });
    let g = GgufFile::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    Tokenizer::new(vocab_from_gguf(&g).expect("vocabulary")).expect("tokenizer")
}

/// GPT-2's byte-level alphabet: the character byte `b` is written as in a BPE vocabulary.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff);
    if printable(b) {
        return char::from(b);
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).expect("a valid char")
}

/// Whether every byte of `text` has a token: its byte-level character (BPE) or its
/// `<0xXX>` byte-fallback token (SentencePiece), unless the whole character is a token.
fn spellable(t: &Tokenizer, bpe: bool, text: &str) -> bool {
    text.chars().all(|c| {
        let mut buf = [0u8; 4];
        let bytes = c.encode_utf8(&mut buf).as_bytes();
        if bpe {
            bytes
                .iter()
                .all(|&b| t.token_id(&byte_char(b).to_string()).is_some())
        } else {
            t.token_id(&c.to_string()).is_some()
                || bytes
                    .iter()
                    .all(|&b| t.token_id(&format!("<0x{b:02X}>")).is_some())
        }
    })
}

static TOKENIZERS: LazyLock<[Tokenizer; 2]> = LazyLock::new(|| {
    [
        load("KVSERVE_TEST_MODEL", "SmolLM2-135M-Instruct.Q4_1.gguf"),
        load("KVSERVE_TEST_GEMMA", "gemma-3-270m-q4_k_m.gguf"),
    ]
});

fuzz_target!(|data: &[u8]| {
    let Some((&op, rest)) = data.split_first() else {
        return;
    };
    let t = &TOKENIZERS[(op & 1) as usize];
    let n = t.n_vocab() as u32;
    if op & 4 == 0 {
        let text = String::from_utf8_lossy(rest);
        let (parse, add) = (op & 2 != 0, op & 8 != 0);
        let ids = t.encode(&text, add, parse);
        assert!(ids.iter().all(|&id| id < n), "id out of the vocabulary");
        let back = t.decode(&ids);
        let lossy = text.contains('\u{2581}') || ids.iter().any(|&id| t.is_control(id));
        if !parse && !add && !lossy && spellable(t, op & 1 == 0, &text) {
            assert!(
                back == text.as_bytes(),
                "round trip of {text:?}: tokens {ids:?} decode to {:?}",
                String::from_utf8_lossy(&back)
            );
        }
    } else {
        let ids: Vec<u32> = rest
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        let _ = t.decode(&ids);
        for &id in &ids {
            let _ = (t.token_to_piece(id, true), t.token_to_piece(id, false));
        }
    }
});
