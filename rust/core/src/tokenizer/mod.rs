//! Tokenizers built from GGUF metadata: byte-level BPE (`gpt2`) and SentencePiece-style (`llama`).
//!
//! Guarantees: for the supported tokenizer models and pre-tokenizers, [`Tokenizer::encode`],
//! [`Tokenizer::token_to_piece`] and [`Tokenizer::decode`] produce the same ids and bytes as
//! llama.cpp's `llama_tokenize`, `llama_token_to_piece` and `llama_detokenize`
//! (`remove_special = false`, `unparse_special = false`), including llama.cpp's special-token
//! handling (text-based EOG detection, forced control attributes) and its decode clean-up.
//! Construction validates the vocabulary and returns `Error::Model` / `Error::Unsupported`;
//! encoding and decoding never fail and never panic (unknown ids decode to nothing).

mod bpe;
mod pretokenize;
mod spm;
mod unicode;
mod unicode_tables;

pub use pretokenize::PreTokenizer;
/// Unicode version of the character-class table used by the pre-tokenizers.
pub use unicode_tables::UNICODE_VERSION;

use crate::error::{model_err, Error, Result};
use std::collections::HashMap;

/// Tokenizer metadata as stored in a GGUF file (`tokenizer.ggml.*`).
#[derive(Debug, Clone, Default)]
pub struct VocabData {
    /// `tokenizer.ggml.model`: "gpt2" | "llama"
    pub model: String,
    /// `tokenizer.ggml.pre`
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    pub token_types: Option<Vec<i32>>,
    pub scores: Option<Vec<f32>>,
    pub merges: Option<Vec<String>>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub add_space_prefix: Option<bool>,
}

// token attributes (llama.cpp's llama_token_attr bits)
const ATTR_UNKNOWN: u16 = 1 << 0;
const ATTR_UNUSED: u16 = 1 << 1;
const ATTR_NORMAL: u16 = 1 << 2;
const ATTR_CONTROL: u16 = 1 << 3;
const ATTR_USER_DEFINED: u16 = 1 << 4;
const ATTR_BYTE: u16 = 1 << 5;

fn attr_of_type(t: i32) -> u16 {
    match t {
        1 => ATTR_NORMAL,
        2 => ATTR_UNKNOWN,
        3 => ATTR_CONTROL,
        4 => ATTR_USER_DEFINED,
        5 => ATTR_UNUSED,
        6 => ATTR_BYTE,
        _ => 0, // undefined
    }
}

/// Token texts that end generation (llama.cpp matches these by text); they are forced to
/// control tokens.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];
/// Fill-in-the-middle prefix/suffix/middle markers: forced to control tokens.
const FIM_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
/// FIM pad / repo / file-separator candidates, each group yields one EOG control token.
const FIM_EOG_GROUPS: &[&[&str]] = &[
    &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
    &[
        "<|fim_repo|>",
        "<|repo_name|>",
        "<fim-repo>",
        "<REPO>",
        "<reponame>",
    ],
    &["<|file_sep|>"],
];

/// Settings implied by a `tokenizer.ggml.pre` value.
struct PreInfo {
    pre: PreTokenizer,
    clean_spaces: bool,
    ignore_merges: bool,
    add_bos: bool,
}

const SUPPORTED_PRE: &str = "default, gpt-2, phi-2, mpt, olmo, exaone4, llama3, llama-v3, \
     llama-bpe, falcon3, falcon-h1, pixtral, lfm2, dbrx, smaug-bpe, qwen2, deepseek-r1-qwen, \
     megrez, stablelm2, smollm, starcoder, refact, codeshell, exaone, minerva-7b, command-r";

fn pre_info(pre: Option<&str>) -> Result<PreInfo> {
    use PreTokenizer::*;
    let p = |pre, clean_spaces, ignore_merges, add_bos| PreInfo {
        pre,
        clean_spaces,
        ignore_merges,
        add_bos,
    };
    Ok(match pre.unwrap_or("") {
        "" | "default" => p(Default, true, false, false),
        "gpt-2" | "phi-2" | "mpt" | "olmo" | "exaone4" => p(Gpt2, true, false, false),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "lfm2" => {
            p(Llama3, true, true, true)
        }
        "dbrx" | "smaug-bpe" => p(Llama3, true, false, false),
        "qwen2" | "deepseek-r1-qwen" => p(Qwen2, false, false, false),
        "megrez" | "stablelm2" => p(Qwen2, true, false, false),
        "smollm" | "command-r" => p(DigitsThenGpt2, false, false, false),
        "starcoder" | "refact" | "codeshell" | "exaone" | "minerva-7b" => p(DigitsThenGpt2, true, false, false),
        other => {
            return Err(Error::Unsupported(format!(
                "unsupported pre-tokenizer '{other}' (tokenizer.ggml.pre) for a gpt2 tokenizer; supported: {SUPPORTED_PRE}"
            )))
        }
    })
}

enum Kind {
    Bpe {
        bpe: Box<bpe::Bpe>,
        pre: PreTokenizer,
        ignore_merges: bool,
        byte_chars: Box<[char; 256]>,
    },
    Spm {
        byte_tok: Box<[Option<u32>; 256]>,
    },
}

/// A text fragment of the input or an already-resolved special token.
enum Frag {
    Text(usize, usize),
    Token(u32),
}

/// A tokenizer for one vocabulary; immutable and shareable across threads.
pub struct Tokenizer {
    kind: Kind,
    tokens: Vec<String>,
    scores: Vec<f32>,
    attrs: Vec<u16>,
    token_to_id: HashMap<String, u32>,
    /// control / user-defined / unknown tokens, longest text first
    specials: Vec<u32>,
    /// trie over the texts of `specials`, yielding indices into `specials`
    special_trie: Trie,
    eog: Vec<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    clean_spaces: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field(
                "kind",
                &match self.kind {
                    Kind::Bpe { pre, .. } => format!("bpe/{pre:?}"),
                    Kind::Spm { .. } => "spm".to_string(),
                },
            )
            .field("n_vocab", &self.tokens.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish()
    }
}

impl Tokenizer {
    /// Build a tokenizer; `Error::Unsupported` for unknown models / pre-tokenizers,
    /// `Error::Model` for inconsistent metadata.
    pub fn new(v: VocabData) -> Result<Tokenizer> {
        let is_bpe = match v.model.as_str() {
            "gpt2" => true,
            "llama" => false,
            other => {
                return Err(Error::Unsupported(format!(
                    "unsupported tokenizer model '{other}' (tokenizer.ggml.model); supported: gpt2 (byte-level BPE), llama (SentencePiece)"
                )))
            }
        };
        let pre = if is_bpe {
            Some(pre_info(v.pre.as_deref())?)
        } else {
            None
        };
        let n = v.tokens.len();
        if n == 0 {
            return Err(model_err("tokenizer.ggml.tokens is empty"));
        }
        if n > u32::MAX as usize {
            return Err(model_err(
                "tokenizer.ggml.tokens has more than 2^32 entries",
            ));
        }
        let mut tokens = v.tokens;
        for (i, t) in tokens.iter_mut().enumerate() {
            if t.is_empty() {
                *t = format!("[EMPTY_{i}]");
            }
        }
        let mut token_to_id = HashMap::with_capacity(n);
        for (i, t) in tokens.iter().enumerate() {
            if token_to_id.insert(t.clone(), i as u32).is_some() {
                return Err(model_err(format!(
                    "tokenizer.ggml.tokens: duplicate token {t:?} (id {i})"
                )));
            }
        }
        let scores = match v.scores {
            Some(s) if s.len() < n => {
                return Err(model_err(format!(
                    "tokenizer.ggml.scores has {} entries for {n} tokens",
                    s.len()
                )))
            }
            Some(mut s) => {
                s.truncate(n);
                s
            }
            None => vec![0.0; n],
        };
        let mut attrs = match &v.token_types {
            Some(t) if t.len() < n => {
                return Err(model_err(format!(
                    "tokenizer.ggml.token_type has {} entries for {n} tokens",
                    t.len()
                )))
            }
            Some(t) => t[..n].iter().map(|&t| attr_of_type(t)).collect(),
            None => vec![ATTR_NORMAL; n],
        };

        // special ids: explicit ones must be in range; defaults are llama.cpp's
        let check = |name: &str, id: Option<u32>| -> Result<Option<u32>> {
            match id {
                Some(i) if i as usize >= n => Err(model_err(format!(
                    "tokenizer.ggml.{name}_token_id = {i} is out of range for {n} tokens"
                ))),
                other => Ok(other),
            }
        };
        let in_range = |id: u32| ((id as usize) < n).then_some(id);
        let (def_bos, def_eos, def_unk) = if is_bpe {
            (11, 11, None)
        } else {
            (1, 2, Some(0))
        };
        let bos = check("bos", v.bos)?.or_else(|| in_range(def_bos));
        let eos = check("eos", v.eos)?.or_else(|| in_range(def_eos));
        let unk = check("unknown", v.unk)?.or_else(|| def_unk.and_then(in_range));
        let eot = check("eot", v.eot)?;
        let eom = check("eom", v.eom)?;
        let pad = check("padding", v.pad)?;

        let add_bos = v.add_bos.unwrap_or(match &pre {
            Some(p) => p.add_bos,
            None => true,
        });
        let add_eos = v.add_eos.unwrap_or(false);
        let add_space_prefix = v.add_space_prefix.unwrap_or(!is_bpe);
        if add_bos && bos.is_none() {
            return Err(model_err(
                "tokenizer adds a BOS token but has no valid tokenizer.ggml.bos_token_id",
            ));
        }
        if add_eos && eos.is_none() {
            return Err(model_err(
                "tokenizer adds an EOS token but has no valid tokenizer.ggml.eos_token_id",
            ));
        }

        // end-of-generation tokens and forced control attributes (llama.cpp's text heuristics)
        let mut eog: Vec<u32> = Vec::new();
        let lookup = |t: &str| token_to_id.get(t).copied();
        for group in FIM_EOG_GROUPS {
            if let Some(id) = group.iter().filter_map(|t| lookup(t)).min() {
                eog.push(id);
                attrs[id as usize] |= ATTR_CONTROL;
            }
        }
        for t in FIM_TEXTS {
            if let Some(id) = lookup(t) {
                attrs[id as usize] |= ATTR_CONTROL;
            }
        }
        for t in EOG_TEXTS {
            if let Some(id) = lookup(t) {
                eog.push(id);
                attrs[id as usize] |= ATTR_CONTROL;
            }
        }
        for t in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
            if let Some(id) = lookup(t) {
                attrs[id as usize] = ATTR_USER_DEFINED;
            }
        }
        eog.extend([eos, eot, eom].into_iter().flatten());
        eog.sort_unstable();
        eog.dedup();
        let eog_has = |eog: &[u32], t: &str| lookup(t).filter(|id| eog.binary_search(id).is_ok());
        if let Some(end) = eog_has(&eog, "<|end|>") {
            let call = eog_has(&eog, "<|call|>").is_some() || eog_has(&eog, "<|calls|>").is_some();
            let ret = eog_has(&eog, "<|return|>").is_some();
            let flush = eog_has(&eog, "<|flush|>").is_some();
            if call && (ret || flush) {
                eog.retain(|&x| x != end);
                attrs[end as usize] = ATTR_USER_DEFINED;
            }
        }
        if let Some(s) = eog_has(&eog, "</s>") {
            if eog_has(&eog, "<|tool_response>").is_some()
                || eog_has(&eog, "<|plamo:eos|>").is_some()
            {
                eog.retain(|&x| x != s);
                attrs[s as usize] = ATTR_NORMAL;
            }
        }

        let mut specials: Vec<u32> = (0..n as u32)
            .filter(|&i| attrs[i as usize] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN) != 0)
            .collect();
        specials.sort_by(|&a, &b| {
            tokens[b as usize]
                .len()
                .cmp(&tokens[a as usize].len())
                .then(a.cmp(&b))
        });

        let (kind, clean_spaces) = match pre {
            Some(p) => {
                let byte_chars = bpe::byte_to_char_table();
                let mut byte_sym = [None; 256];
                let mut buf = [0u8; 4];
                for (b, slot) in byte_sym.iter_mut().enumerate() {
                    *slot = lookup(byte_chars[b].encode_utf8(&mut buf));
                }
                let merges = v
                    .merges
                    .ok_or_else(|| model_err("gpt2 tokenizer without tokenizer.ggml.merges"))?;
                let mut table = HashMap::with_capacity(merges.len());
                for (rank, m) in merges.iter().enumerate() {
                    // split at the first space after the first byte, like llama.cpp
                    let pos = m
                        .as_bytes()
                        .iter()
                        .skip(1)
                        .position(|&c| c == b' ')
                        .map(|p| p + 1)
                        .ok_or_else(|| {
                            model_err(format!(
                                "tokenizer.ggml.merges[{rank}] = {m:?} has no space"
                            ))
                        })?;
                    let (a, b) = (&m[..pos], &m[pos + 1..]);
                    let (Some(ia), Some(ib)) = (lookup(a), lookup(b)) else {
                        return Err(model_err(format!(
                            "tokenizer.ggml.merges[{rank}] = {m:?} references a token not in the vocabulary"
                        )));
                    };
                    let merged = token_to_id.get(&format!("{a}{b}")).copied();
                    table.entry((ia, ib)).or_insert((rank as u32, merged));
                }
                let kind = Kind::Bpe {
                    bpe: Box::new(bpe::Bpe::new(table, byte_sym)),
                    pre: p.pre,
                    ignore_merges: p.ignore_merges,
                    byte_chars: Box::new(byte_chars),
                };
                (kind, p.clean_spaces)
            }
            None => {
                let mut byte_tok = Box::new([None; 256]);
                for (b, slot) in byte_tok.iter_mut().enumerate() {
                    let hex = format!("<0x{b:02X}>");
                    let single = if b < 0x80 {
                        lookup(&(b as u8 as char).to_string())
                    } else {
                        None
                    };
                    *slot = lookup(&hex).or(single).or(unk);
                }
                (Kind::Spm { byte_tok }, false)
            }
        };

        let special_trie = Trie::new(specials.iter().map(|&id| tokens[id as usize].as_bytes()));
        Ok(Tokenizer {
            kind,
            tokens,
            scores,
            attrs,
            token_to_id,
            special_trie,
            specials,
            eog,
            bos,
            eos,
            eot,
            unk,
            pad,
            add_bos,
            add_eos,
            add_space_prefix,
            clean_spaces,
        })
    }

    /// Token ids of `text`.  `add_special`: prepend BOS / append EOS as the vocabulary asks
    /// (`add_bos` / `add_eos`).  `parse_special`: control-token texts in `text` become their ids
    /// (user-defined tokens are always matched, as in llama.cpp).
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        let frags = self.partition(text, parse_special);
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        match &self.kind {
            Kind::Bpe {
                bpe,
                pre,
                ignore_merges,
                byte_chars,
            } => {
                let mut encoded = String::new();
                for f in &frags {
                    match *f {
                        Frag::Token(id) => out.push(id),
                        Frag::Text(s, e) => {
                            let frag = &text[s..e];
                            for r in pre.split(frag) {
                                let word = &frag.as_bytes()[r];
                                if *ignore_merges {
                                    encoded.clear();
                                    encoded.extend(word.iter().map(|&b| byte_chars[b as usize]));
                                    if let Some(&id) = self.token_to_id.get(&encoded) {
                                        out.push(id);
                                        continue;
                                    }
                                }
                                bpe.encode_word(word, &mut out);
                            }
                        }
                    }
                }
            }
            Kind::Spm { byte_tok } => {
                let vocab = spm::SpmVocab {
                    token_to_id: &self.token_to_id,
                    scores: &self.scores,
                    byte_tok,
                };
                let mut prev_special = true;
                let mut buf = String::new();
                for f in &frags {
                    match *f {
                        Frag::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                        Frag::Text(s, e) => {
                            buf.clear();
                            if self.add_space_prefix && prev_special {
                                buf.push('\u{2581}');
                            }
                            for c in text[s..e].chars() {
                                buf.push(if c == ' ' { '\u{2581}' } else { c });
                            }
                            spm::encode(&vocab, &buf, &mut out);
                            prev_special = false;
                        }
                    }
                }
            }
        }
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        out
    }

    /// Split `text` at occurrences of special tokens, longest token text first.
    fn partition(&self, text: &str, parse_special: bool) -> Vec<Frag> {
        let mut frags = Vec::new();
        if text.is_empty() {
            return frags;
        }
        frags.push(Frag::Text(0, text.len()));
        // only the specials occurring somewhere in `text`, in priority order
        let mut present = self.special_trie.occurring(text.as_bytes());
        present.sort_unstable();
        present.dedup();
        for rank in present {
            let id = self.specials[rank as usize];
            if !parse_special && self.attrs[id as usize] & (ATTR_CONTROL | ATTR_UNKNOWN) != 0 {
                continue;
            }
            let pat = self.tokens[id as usize].as_str();
            let mut next = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                match f {
                    Frag::Text(s, e) => {
                        let mut cur = s;
                        while let Some(p) = text[cur..e].find(pat) {
                            if p > 0 {
                                next.push(Frag::Text(cur, cur + p));
                            }
                            next.push(Frag::Token(id));
                            cur += p + pat.len();
                        }
                        if cur < e {
                            next.push(Frag::Text(cur, e));
                        }
                    }
                    tok => next.push(tok),
                }
            }
            frags = next;
        }
        frags
    }

    /// The bytes token `id` renders as (llama.cpp `llama_token_to_piece`, no lstrip).  With
    /// `special == false`, control and unknown tokens render empty.  Unknown ids render empty.
    pub fn token_to_piece(&self, id: u32, special: bool) -> Vec<u8> {
        let (Some(text), Some(&attr)) = (self.tokens.get(id as usize), self.attrs.get(id as usize))
        else {
            return Vec::new();
        };
        if attr & (ATTR_UNKNOWN | ATTR_CONTROL) != 0 && !special {
            return Vec::new();
        }
        if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED) != 0 {
            return text.as_bytes().to_vec();
        }
        if attr & ATTR_NORMAL != 0 {
            return match self.kind {
                Kind::Spm { .. } => text.replace('\u{2581}', " ").into_bytes(),
                Kind::Bpe { .. } => decode_byte_level(text),
            };
        }
        if attr & ATTR_BYTE != 0 {
            let b = text
                .get(3..5)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .unwrap_or(0);
            return vec![b];
        }
        Vec::new()
    }

    /// The bytes of `ids` (llama.cpp `llama_detokenize` with `remove_special = false`,
    /// `unparse_special = false`): pieces concatenated, control tokens empty, the first piece's
    /// leading space dropped when the vocabulary adds a space prefix, and llama.cpp's
    /// clean-up of spaces before punctuation for vocabularies that ask for it.
    pub fn decode(&self, ids: &[u32]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut remove_space = self.add_space_prefix;
        for &id in ids {
            let piece = self.token_to_piece(id, false);
            let p = if remove_space {
                piece.strip_prefix(b" ").unwrap_or(&piece)
            } else {
                &piece[..]
            };
            out.extend_from_slice(p);
            remove_space = false;
        }
        if self.clean_spaces {
            clean_up_spaces(&mut out);
        }
        out
    }

    pub fn n_vocab(&self) -> usize {
        self.tokens.len()
    }
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }
    pub fn eot(&self) -> Option<u32> {
        self.eot
    }
    pub fn unk(&self) -> Option<u32> {
        self.unk
    }
    pub fn pad(&self) -> Option<u32> {
        self.pad
    }
    /// Whether `id` ends generation (EOS, EOT, EOM and llama.cpp's text-detected EOG tokens).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }
    /// Whether `id` is a control token (rendered empty by `decode`).
    pub fn is_control(&self, id: u32) -> bool {
        self.attrs
            .get(id as usize)
            .is_some_and(|a| a & ATTR_CONTROL != 0)
    }
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }
    /// The vocabulary text of `id` ("" for an unknown id).
    pub fn token_text(&self, id: u32) -> &str {
        self.tokens.get(id as usize).map_or("", String::as_str)
    }
    /// The id whose vocabulary text is exactly `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }
}

/// Byte trie over a list of strings, to find which of them occur in a text in one pass.
struct Trie {
    /// (node, byte) -> child node; node 0 is the root
    edges: HashMap<(u32, u8), u32>,
    /// per node: index of the string ending there
    terminal: Vec<Option<u32>>,
}

impl Trie {
    fn new<'a>(keys: impl Iterator<Item = &'a [u8]>) -> Trie {
        let mut t = Trie {
            edges: HashMap::new(),
            terminal: vec![None],
        };
        for (i, key) in keys.enumerate() {
            let mut node = 0u32;
            for &b in key {
                let next = t.terminal.len() as u32;
                node = *t.edges.entry((node, b)).or_insert(next);
                if node == next {
                    t.terminal.push(None);
                }
            }
            t.terminal[node as usize] = Some(i as u32);
        }
        t
    }

    /// Indices of the keys occurring anywhere in `text` (with repetitions).
    fn occurring(&self, text: &[u8]) -> Vec<u32> {
        let mut found = Vec::new();
        if self.edges.is_empty() {
            return found;
        }
        for start in 0..text.len() {
            let mut node = 0u32;
            for &b in &text[start..] {
                match self.edges.get(&(node, b)) {
                    Some(&n) => node = n,
                    None => break,
                }
                if let Some(k) = self.terminal[node as usize] {
                    found.push(k);
                }
            }
        }
        found
    }
}

/// Map a byte-level BPE token text back to bytes; characters outside the byte alphabet are
/// rendered the way llama.cpp does (`[UNK_BYTE_0x..<text>]`).
fn decode_byte_level(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match bpe::char_to_byte(c) {
            Some(b) => out.push(b),
            None => {
                out.extend_from_slice(b"[UNK_BYTE_0x");
                let mut buf = [0u8; 4];
                for b in c.encode_utf8(&mut buf).bytes() {
                    out.extend_from_slice(format!("{b:02x}").as_bytes());
                }
                out.extend_from_slice(text.as_bytes());
                out.push(b']');
            }
        }
    }
    out
}

/// llama.cpp's `clean_up_tokenization_spaces`: three in-place passes over the bytes.
fn clean_up_spaces(t: &mut Vec<u8>) {
    // pass 1: " ?", " !", " .", " ," lose the space
    let n = t.len();
    let mut total = usize::from(n > 0);
    for i in 1..n {
        let x = t[i];
        if t[i - 1] == b' ' && matches!(x, b'?' | b'!' | b'.' | b',') {
            total -= 1;
        }
        t[total] = x;
        total += 1;
    }
    t.truncate(total);
    // pass 2: " ' " -> "'"
    let n = t.len();
    let mut total = usize::from(n > 0);
    let mut i = 1;
    while i < n {
        let x = t[i];
        if x == b'\'' && i + 1 < n && t[i - 1] == b' ' && t[i + 1] == b' ' {
            total -= 1;
            i += 1;
            t[i] = 0;
        }
        t[total] = x;
        total += 1;
        i += 1;
    }
    t.truncate(total);
    // pass 3: " 's", " 'm", " 're", " 've" lose the space
    let n = t.len();
    let mut total = usize::from(n > 0);
    for i in 1..n {
        let x = t[i];
        if t[i - 1] == b' ' && x == b'\'' && i + 1 < n {
            let x1 = t[i + 1];
            if x1 == b's'
                || x1 == b'm'
                || (i + 2 < n && matches!((x1, t[i + 2]), (b'r', b'e') | (b'v', b'e')))
            {
                total -= 1;
            }
        }
        t[total] = x;
        total += 1;
    }
    t.truncate(total);
}

#[cfg(test)]
mod tests;
