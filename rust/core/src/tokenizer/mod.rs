//! Tokenizers built from GGUF metadata: byte-level BPE and SentencePiece-style.
