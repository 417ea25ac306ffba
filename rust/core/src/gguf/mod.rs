//! GGUF v2/v3 reader over mmap with bounded, checked parsing.
