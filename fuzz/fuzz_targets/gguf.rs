//! `gguf`: arbitrary bytes as a GGUF file, then everything model loading does with a parsed
//! file short of spawning threads: the typed metadata accessors, the config, the weights'
//! tensor checks, the model identity and the tokenizer built from the metadata.
//!
//! Property: every step returns `Ok` or `Err`; nothing panics, hangs or allocates beyond
//! libFuzzer's `-rss_limit_mb`/`-malloc_limit_mb` (scripts/fuzz.sh sets both).
#![no_main]

#[path = "alloc_limit.rs"]
mod alloc_limit;

#[global_allocator]
static ALLOC: alloc_limit::Limited = alloc_limit::Limited;

use kvserve_core::gguf::GgufFile;
use kvserve_core::model::config::{Arch, Config};
use kvserve_core::model::{gemma3, lfm2, llama, model_identity, vocab_from_gguf};
use kvserve_core::tokenizer::Tokenizer;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(g) = GgufFile::from_bytes(data.to_vec()) else {
        return;
    };
    for (key, value) in g.metadata() {
        // (not `==`: a NaN value is not equal to itself)
        assert!(g.get(key).is_some_and(|v| std::ptr::eq(v, value)));
        let _ = (
            g.get_u32(key),
            g.get_u64(key),
            g.get_i64(key),
            g.get_f32(key),
        );
        let _ = (g.get_bool(key), g.get_str(key), g.get_str_array(key));
        let _ = (
            g.get_f32_array(key),
            g.get_i32_array(key),
            g.get_u32_array(key),
        );
    }
    for t in g.tensors() {
        assert_eq!(g.tensor_data(t).len() as u64, t.n_bytes);
        assert_eq!(g.tensor(&t.name), Some(t));
    }
    let _ = model_identity(&g);
    if let Ok(mut c) = Config::from_gguf(&g) {
        let _ = c.layer_groups();
        let _ = match c.arch {
            Arch::Gemma3 => gemma3::Weights::load(&g, &c).map(drop),
            Arch::Lfm2 => lfm2::Weights::load(&g, &c).map(drop),
            _ => llama::Weights::load(&g, &mut c).map(drop),
        };
    }
    if let Ok(t) = vocab_from_gguf(&g).and_then(Tokenizer::new) {
        let n = t.n_vocab() as u32;
        for (add, parse) in [(true, true), (false, false)] {
            let ids = t.encode("Hello, wörld! <|im_start|><bos> 12345\n\t  end", add, parse);
            assert!(
                ids.iter().all(|&id| id < n),
                "token id out of the vocabulary"
            );
            let _ = t.decode(&ids);
        }
        for id in (0..n.min(64)).chain([n, u32::MAX]) {
            let _ = (t.token_to_piece(id, true), t.token_to_piece(id, false));
        }
    }
});
