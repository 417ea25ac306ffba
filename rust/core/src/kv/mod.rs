//! Paged KV cache: block storage of keys/values ([`storage`]) and attention over a sequence's
//! block table ([`attention`]).

pub mod attention;
pub mod storage;
