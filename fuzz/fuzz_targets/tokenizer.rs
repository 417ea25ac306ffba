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
//! (the round trip the golden tests check against llama.cpp's fixtures).
//!
//! Model paths: `KVSERVE_TEST_MODEL` and `KVSERVE_TEST_GEMMA`, else the default cache paths.
#![no_main]

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
        if !parse && !add && !lossy {
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
