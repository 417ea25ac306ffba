//! Tests for the GGUF reader. Files are built byte by byte by the small writer below (written
//! from the format description, independent of the parser), then corrupted on purpose; one test
//! cross-checks a real model whose expected facts were read with the `gguf` Python package.

use super::*;

// ---------------------------------------------------------------------------------------------
// A minimal GGUF writer for tests.

#[derive(Default)]
struct W(Vec<u8>);

impl W {
    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn raw(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    /// A length-prefixed string from raw bytes (may be invalid UTF-8).
    fn bstr(&mut self, b: &[u8]) -> &mut Self {
        self.u64(b.len() as u64).raw(b)
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.bstr(s.as_bytes())
    }
    fn header(&mut self, version: u32, n_tensors: u64, n_kv: u64) -> &mut Self {
        self.raw(b"GGUF").u32(version).u64(n_tensors).u64(n_kv)
    }
    /// A value's payload (no type id). Arrays take their element type from the first element
    /// (U8 when empty).
    fn value(&mut self, v: &Value) -> &mut Self {
        match v {
            Value::U8(x) => self.u8(*x),
            Value::I8(x) => self.u8(*x as u8),
            Value::U16(x) => self.raw(&x.to_le_bytes()),
            Value::I16(x) => self.raw(&x.to_le_bytes()),
            Value::U32(x) => self.u32(*x),
            Value::I32(x) => self.raw(&x.to_le_bytes()),
            Value::U64(x) => self.u64(*x),
            Value::I64(x) => self.raw(&x.to_le_bytes()),
            Value::F32(x) => self.raw(&x.to_le_bytes()),
            Value::F64(x) => self.raw(&x.to_le_bytes()),
            Value::Bool(b) => self.u8(*b as u8),
            Value::String(s) => self.str(s),
            Value::Array(items) => {
                self.u32(items.first().map_or(0, Value::type_id))
                    .u64(items.len() as u64);
                for it in items {
                    self.value(it);
                }
                self
            }
        }
    }
    fn kv(&mut self, key: &str, v: &Value) -> &mut Self {
        self.str(key).u32(v.type_id()).value(v)
    }
    fn info(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
    fn pad(&mut self, align: u64) -> &mut Self {
        let n = (self.0.len() as u64).next_multiple_of(align);
        self.0.resize(n as usize, 0);
        self
    }
}

/// Deterministic content of byte `j` of tensor `i`.
fn fill(i: usize, j: usize) -> u8 {
    (i * 7 + j * 13 + 1) as u8
}

type T<'a> = (&'a str, &'a [u64], GgmlType, u64);

/// A valid file: header, `kvs`, tensor infos, padding, data. Each tensor is `(name, dims, type,
/// n_bytes)`; tensors are laid out in order at aligned offsets and the file ends right after the
/// last tensor's data (no trailing padding), so cutting any byte makes it invalid.
fn build(kvs: &[(&str, Value)], tensors: &[T], align: u64) -> Vec<u8> {
    let mut w = W::default();
    w.header(3, tensors.len() as u64, kvs.len() as u64);
    for (k, v) in kvs {
        w.kv(k, v);
    }
    let mut off = 0u64;
    let mut offsets = vec![];
    for (name, dims, ty, n_bytes) in tensors {
        off = off.next_multiple_of(align);
        w.info(name, dims, ty.id(), off);
        offsets.push(off);
        off += n_bytes;
    }
    w.pad(align);
    let data_start = w.0.len() as u64;
    for (i, ((_, _, _, n), o)) in tensors.iter().zip(&offsets).enumerate() {
        while (w.0.len() as u64) < data_start + o {
            w.u8(0xAA);
        }
        for j in 0..*n as usize {
            w.u8(fill(i, j));
        }
    }
    w.0
}

fn s(x: &str) -> Value {
    Value::String(x.to_string())
}

fn sample_kvs() -> Vec<(&'static str, Value)> {
    vec![
        ("general.architecture", s("llama")),
        ("llama.block_count", Value::U32(30)),
        ("k.u8", Value::U8(200)),
        ("k.i8", Value::I8(-5)),
        ("k.u16", Value::U16(65535)),
        ("k.i16", Value::I16(-300)),
        ("k.i32", Value::I32(-1)),
        ("k.u64", Value::U64(1 << 40)),
        ("k.i64", Value::I64(-(1 << 40))),
        ("k.f32", Value::F32(1e-5)),
        ("k.f64", Value::F64(0.1)),
        ("k.bool", Value::Bool(true)),
        ("k.utf8", s("héllo ✓")),
        (
            "tokenizer.ggml.tokens",
            Value::Array(vec![s("<s>"), s("a"), s(""), s("Ġt")]),
        ),
        (
            "k.scores",
            Value::Array(vec![Value::F32(-1.5), Value::F32(0.0)]),
        ),
        (
            "k.types",
            Value::Array(vec![Value::I32(1), Value::I32(-2), Value::I32(3)]),
        ),
        ("k.u8arr", Value::Array(vec![Value::U8(1), Value::U8(255)])),
        ("k.empty", Value::Array(vec![])),
        (
            "k.nested",
            Value::Array(vec![
                Value::Array(vec![Value::U16(1), Value::U16(2)]),
                Value::Array(vec![Value::U16(3)]),
            ]),
        ),
    ]
}

/// (name, dims, type, n_bytes) with sizes worked out by hand from the block geometry.
const F32_DIMS: &[u64] = &[4, 3];
const Q8_DIMS: &[u64] = &[64, 2]; // 2 blocks of 32 per row, 34 bytes each: 2 * 2 * 34 = 136
const Q4K_DIMS: &[u64] = &[256]; // one 144-byte block
fn sample_tensors() -> Vec<T<'static>> {
    vec![
        ("a.f32", F32_DIMS, GgmlType::F32, 48),
        ("b.q8", Q8_DIMS, GgmlType::Q8_0, 136),
        ("c.q4k", Q4K_DIMS, GgmlType::Q4_K, 144),
    ]
}

fn sample() -> Vec<u8> {
    build(&sample_kvs(), &sample_tensors(), 32)
}

/// Asserts a `Model` error whose single-line message contains every piece of `parts`.
#[track_caller]
fn expect_err(bytes: Vec<u8>, parts: &[&str]) -> String {
    match GgufFile::from_bytes(bytes) {
        Ok(f) => panic!("expected an error containing {parts:?}, got Ok({f:?})"),
        Err(Error::Model(m)) => {
            assert!(m.starts_with("GGUF: "), "{m}");
            assert!(!m.contains('\n'), "multi-line message: {m}");
            for p in parts {
                assert!(m.contains(p), "message {m:?} lacks {p:?}");
            }
            m
        }
        Err(e) => panic!("expected Error::Model, got {e:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Valid files.

#[test]
fn parses_valid_file() {
    let bytes = sample();
    let n = bytes.len() as u64;
    let f = GgufFile::from_bytes(bytes).unwrap();
    assert_eq!(f.version, 3);
    assert_eq!(f.alignment, 32);
    assert_eq!(f.file_size(), n);
    assert_eq!(f.data_offset % 32, 0);

    let kvs = sample_kvs();
    assert_eq!(f.metadata().len(), kvs.len());
    for ((k, v), (ek, ev)) in f.metadata().iter().zip(&kvs) {
        assert_eq!(k, ek);
        assert_eq!(v, ev, "key {k}");
        assert_eq!(f.get(k), Some(ev));
    }
    assert_eq!(f.get("missing"), None);

    let ts = f.tensors();
    assert_eq!(ts.len(), 3);
    assert_eq!(ts[0].name, "a.f32");
    assert_eq!(ts[0].dims, vec![4, 3]);
    assert_eq!(
        (ts[0].ty, ts[0].n_elements, ts[0].n_bytes),
        (GgmlType::F32, 12, 48)
    );
    assert_eq!(ts[0].offset, f.data_offset);
    assert_eq!(ts[0].n_rows(), 3);
    assert_eq!(
        (ts[1].ty, ts[1].n_elements, ts[1].n_bytes),
        (GgmlType::Q8_0, 128, 136)
    );
    assert_eq!(ts[1].offset, f.data_offset + 64); // 48 rounded up to 32
    assert_eq!(
        (ts[2].ty, ts[2].n_elements, ts[2].n_bytes),
        (GgmlType::Q4_K, 256, 144)
    );
    assert_eq!(ts[2].offset, f.data_offset + 224); // 64 + 136 = 200 -> 224
    assert_eq!(ts[2].offset + ts[2].n_bytes, n);
    for (i, t) in ts.iter().enumerate() {
        assert_eq!(f.tensor(&t.name), Some(t));
        let data = f.tensor_data(t);
        assert_eq!(data.len() as u64, t.n_bytes);
        assert!(
            data.iter().enumerate().all(|(j, &b)| b == fill(i, j)),
            "{}",
            t.name
        );
        assert_eq!(f.tensor_bytes(&t.name), Some(data));
    }
    assert!(f.tensor("nope").is_none());
}

#[test]
fn typed_accessors() {
    let f = GgufFile::from_bytes(sample()).unwrap();
    assert_eq!(f.get_u32("llama.block_count").unwrap(), Some(30));
    assert_eq!(f.get_u32("k.u8").unwrap(), Some(200));
    assert_eq!(f.get_u32("k.u16").unwrap(), Some(65535));
    assert_eq!(f.get_u64("k.u64").unwrap(), Some(1 << 40));
    assert_eq!(f.get_i64("k.i64").unwrap(), Some(-(1 << 40)));
    assert_eq!(f.get_i64("k.i8").unwrap(), Some(-5));
    assert_eq!(f.get_i64("k.i16").unwrap(), Some(-300));
    assert_eq!(f.get_u32("missing").unwrap(), None);
    assert_eq!(f.get_f32("k.f32").unwrap(), Some(1e-5));
    assert_eq!(f.get_f32("k.f64").unwrap(), Some(0.1f32));
    assert_eq!(f.get_f32("llama.block_count").unwrap(), Some(30.0));
    assert_eq!(f.get_bool("k.bool").unwrap(), Some(true));
    assert_eq!(f.get_str("general.architecture").unwrap(), Some("llama"));
    assert_eq!(f.get_str("k.utf8").unwrap(), Some("héllo ✓"));
    assert_eq!(
        f.get_str_array("tokenizer.ggml.tokens").unwrap(),
        Some(vec!["<s>", "a", "", "Ġt"])
    );
    assert_eq!(f.get_f32_array("k.scores").unwrap(), Some(vec![-1.5, 0.0]));
    assert_eq!(f.get_i32_array("k.types").unwrap(), Some(vec![1, -2, 3]));
    assert_eq!(f.get_i32_array("k.u8arr").unwrap(), Some(vec![1, 255]));
    assert_eq!(f.get_u32_array("k.u8arr").unwrap(), Some(vec![1, 255]));
    assert_eq!(f.get_f32_array("k.u8arr").unwrap(), Some(vec![1.0, 255.0]));
    assert_eq!(f.get_str_array("k.empty").unwrap(), Some(vec![]));
    assert_eq!(f.get_str_array("missing").unwrap(), None);
    assert_eq!(f.get_array("k.nested").unwrap().map(|a| a.len()), Some(2));

    // Wrong types and out-of-range values name the key.
    let e = |r: Result<_, Error>| match r {
        Err(Error::Model(m)) => m,
        other => panic!("expected a Model error, got {other:?}"),
    };
    let m = e(f.get_u32("k.i32").map(|_| ()));
    assert!(
        m.contains("'k.i32'") && m.contains("-1") && m.contains("u32"),
        "{m}"
    );
    let m = e(f.get_u32("k.u64").map(|_| ()));
    assert!(m.contains("'k.u64'") && m.contains("u32"), "{m}");
    assert!(e(f.get_u32("k.f32").map(|_| ())).contains("'k.f32' is F32"));
    assert!(e(f.get_u64("k.i8").map(|_| ())).contains("'k.i8'"));
    assert!(e(f.get_f32("general.architecture").map(|_| ())).contains("STRING"));
    assert!(e(f.get_bool("k.u8").map(|_| ())).contains("'k.u8' is U8, expected BOOL"));
    assert!(e(f.get_str("k.u8").map(|_| ())).contains("expected STRING"));
    let m = e(f.get_str_array("k.types").map(|_| ()));
    assert!(m.contains("element 0") && m.contains("'k.types'"), "{m}");
    assert!(e(f.get_str_array("general.architecture").map(|_| ())).contains("expected ARRAY"));
    assert!(e(f.get_i32_array("k.scores").map(|_| ())).contains("F32 -1.5"));
    assert!(e(f.get_u32_array("k.types").map(|_| ())).contains("element 1"));
}

#[test]
fn version_2_and_custom_alignment() {
    let mut kvs = sample_kvs();
    kvs.push(("general.alignment", Value::U32(64)));
    let mut bytes = build(&kvs, &sample_tensors(), 64);
    bytes[4] = 2;
    let f = GgufFile::from_bytes(bytes).unwrap();
    assert_eq!((f.version, f.alignment), (2, 64));
    assert_eq!(f.data_offset % 64, 0);
    for t in f.tensors() {
        assert_eq!((t.offset - f.data_offset) % 64, 0);
    }
    assert_eq!(f.tensors()[1].offset, f.data_offset + 64);
    assert_eq!(f.tensors()[2].offset, f.data_offset + 256);

    // Alignment 1 packs tensors back to back with no padding.
    let kvs = [("general.alignment", Value::U32(1))];
    let f = GgufFile::from_bytes(build(&kvs, &sample_tensors(), 1)).unwrap();
    assert_eq!(f.alignment, 1);
    assert_eq!(f.tensors()[1].offset, f.data_offset + 48);
}

#[test]
fn empty_file_without_tensors() {
    let mut w = W::default();
    w.header(3, 0, 0);
    let f = GgufFile::from_bytes(w.0).unwrap();
    assert!(f.metadata().is_empty() && f.tensors().is_empty());
}

#[test]
fn bad_alignment_rejected() {
    for (v, shown) in [
        (Value::U32(0), "U32 0"),
        (Value::U32(48), "U32 48"),
        (Value::I32(-32), "I32 -32"),
        (s("32"), "STRING"),
    ] {
        let kvs = [("general.alignment", v)];
        expect_err(
            build(&kvs, &[], 32),
            &["general.alignment", shown, "power of two", "byte 49"],
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Malformed files.

#[test]
fn truncation_at_every_length_is_an_error() {
    let full = sample();
    for len in 0..full.len() {
        match GgufFile::from_bytes(full[..len].to_vec()) {
            Ok(_) => panic!("truncated to {len} of {} bytes parsed", full.len()),
            Err(Error::Model(m)) => {
                assert!(m.starts_with("GGUF: ") && !m.contains('\n'), "{m}");
                assert!(m.contains("byte"), "no position in {m}");
            }
            Err(e) => panic!("unexpected error kind {e:?}"),
        }
    }
}

#[test]
fn truncation_message_names_key_and_offset() {
    let mut w = W::default();
    w.header(3, 0, 2).kv("general.name", &s("x"));
    let at = w.0.len() + 8 + "llama.block_count".len() + 4;
    w.kv("llama.block_count", &Value::U32(30));
    w.0.truncate(at + 2);
    let at = format!("at byte {at}");
    expect_err(w.0, &["truncated", "value of key 'llama.block_count'", &at]);
}

#[test]
fn bad_magic_and_version() {
    let mut b = sample();
    b[0..4].copy_from_slice(b"GGML");
    expect_err(b, &["bad magic", "GGML", "byte 0"]);
    for v in [0u32, 1, 4, 0x0300_0000] {
        let mut b = sample();
        b[4..8].copy_from_slice(&v.to_le_bytes());
        expect_err(b, &["unsupported version", &v.to_string(), "byte 4"]);
    }
}

#[test]
fn unknown_value_types() {
    let mut w = W::default();
    w.header(3, 0, 1).str("my.key").u32(13).u32(0);
    expect_err(
        w.0,
        &["unknown metadata value type id 13", "'my.key'", "byte 38"],
    );

    let mut w = W::default();
    w.header(3, 0, 1).str("arr").u32(9).u32(99).u64(0);
    expect_err(w.0, &["unknown array element type id 99", "'arr'"]);
}

#[test]
fn unknown_tensor_type() {
    let mut w = W::default();
    w.header(3, 1, 0)
        .info("blk.0.w", &[32], 4, 0)
        .pad(32)
        .raw(&[0; 64]);
    let m = expect_err(w.0, &["'blk.0.w'", "unknown ggml type id 4", "byte 51"]);
    assert!(
        m.contains("8 Q8_0") && m.contains("12 Q4_K"),
        "known types not listed: {m}"
    );

    // Known but unsupported types parse here.
    let t = [("x", &[256u64][..], GgmlType::IQ2_XXS, 66)];
    let f = GgufFile::from_bytes(build(&[], &t, 32)).unwrap();
    assert_eq!(f.tensors()[0].ty, GgmlType::IQ2_XXS);
}

#[test]
fn absurd_counts_rejected_before_allocation() {
    for n in [u64::MAX, 1 << 40, 1000] {
        let mut w = W::default();
        w.header(3, 0, n).kv("a", &Value::U8(1));
        expect_err(w.0, &["kv_count", &n.to_string(), "byte 16"]);

        let mut w = W::default();
        w.header(3, n, 0).info("a", &[1], 0, 0);
        expect_err(w.0, &["tensor_count", &n.to_string(), "byte 8"]);

        // Array lengths are bounded by the element size: 4 bytes left cannot hold 2 u32s.
        let mut w = W::default();
        w.header(3, 0, 1).str("arr").u32(9).u32(4).u64(n).u32(7);
        expect_err(w.0, &["array length", &n.to_string(), "'arr'", "byte 43"]);
    }
    let mut w = W::default();
    w.header(3, 0, 1).str("arr").u32(9).u32(4).u64(2).u32(7);
    expect_err(w.0, &["array length 2", "4 bytes left"]);

    // Nested arrays: each inner array needs at least 12 bytes.
    let mut w = W::default();
    w.header(3, 0, 1)
        .str("arr")
        .u32(9)
        .u32(9)
        .u64(2)
        .u32(0)
        .u64(0);
    expect_err(w.0, &["array length 2", "'arr'"]);
}

#[test]
fn absurd_string_lengths() {
    for n in [u64::MAX, u64::MAX - 7, 1 << 62, 9] {
        let mut w = W::default();
        w.header(3, 0, 1).u64(n).raw(b"abcdefgh");
        expect_err(
            w.0,
            &[
                "string length",
                &n.to_string(),
                "key of metadata entry 0",
                "byte 24",
            ],
        );

        let mut w = W::default();
        w.header(3, 0, 1).str("k").u32(8).u64(n).raw(b"abcdefgh");
        expect_err(w.0, &["string length", "value of key 'k'", "byte 37"]);
    }
    for n in [u64::MAX, 1 << 62, 41] {
        let mut w = W::default();
        w.header(3, 1, 0).u64(n).raw(&[0; 40]);
        expect_err(
            w.0,
            &["string length", "name of tensor info 0", "40 bytes left"],
        );
    }
}

#[test]
fn bad_dimensions() {
    let one = |name: &str, dims: &[u64], ty: GgmlType| {
        let mut w = W::default();
        w.header(3, 1, 0)
            .info(name, dims, ty.id(), 0)
            .pad(32)
            .raw(&[0; 256]);
        w.0
    };
    expect_err(
        one("t0", &[], GgmlType::F32),
        &["'t0'", "0 dimensions", "byte 34"],
    );
    expect_err(one("t5", &[1; 5], GgmlType::F32), &["'t5'", "5 dimensions"]);
    expect_err(
        one("tz", &[4, 0], GgmlType::F32),
        &["'tz'", "dimension 1 is 0", "byte 46"],
    );
    let big = 1u64 << 32;
    expect_err(
        one("tb", &[big, big, big], GgmlType::F32),
        &["'tb'", "overflows"],
    );
    expect_err(
        one("ti", &[1 << 32, 1 << 31], GgmlType::F32),
        &["'ti'", "overflows"],
    );
    expect_err(
        one("tq", &[33, 2], GgmlType::Q8_0),
        &["'tq'", "first dimension 33", "Q8_0 block size 32"],
    );
    // Elements fit in i64 but the byte size of F64 data does not fit in u64.
    expect_err(
        one("tf", &[1 << 62], GgmlType::F64),
        &["'tf'", "byte size overflows"],
    );
    // 4 dims is fine.
    let f = GgufFile::from_bytes(one("t4", &[2, 2, 2, 2], GgmlType::F32)).unwrap();
    assert_eq!(f.tensors()[0].n_elements, 16);
}

#[test]
fn tensor_data_must_lie_in_file() {
    let mut w = W::default();
    w.header(3, 1, 0)
        .info("w", &[8], 0, 0)
        .pad(32)
        .raw(&[0; 31]);
    expect_err(
        w.0,
        &["'w'", "outside the file", "32 bytes", "info at byte 24"],
    );

    let mut w = W::default();
    w.header(3, 1, 0)
        .info("w", &[8], 0, 1 << 20)
        .pad(32)
        .raw(&[0; 64]);
    expect_err(w.0, &["'w'", "offset 1048576", "outside the file"]);

    // Offset + size overflowing u64.
    let mut w = W::default();
    w.header(3, 1, 0)
        .info("w", &[8], 0, u64::MAX - 31)
        .pad(32)
        .raw(&[0; 64]);
    expect_err(w.0, &["'w'", "outside the file"]);
}

#[test]
fn misaligned_offset() {
    let mut w = W::default();
    w.header(3, 1, 0)
        .info("w", &[2], 0, 4)
        .pad(32)
        .raw(&[0; 64]);
    expect_err(w.0, &["'w'", "offset 4", "alignment 32", "byte 49"]);
}

#[test]
fn overlapping_and_duplicate_tensors() {
    let mut w = W::default();
    w.header(3, 2, 0)
        .info("a", &[16], 0, 0)
        .info("b", &[16], 0, 32)
        .pad(32)
        .raw(&[0; 96]);
    expect_err(w.0, &["'a'", "overlaps tensor 'b'"]);

    // Same offset, listed in reverse order.
    let mut w = W::default();
    w.header(3, 2, 0)
        .info("x", &[8], 0, 64)
        .info("y", &[8], 0, 64)
        .pad(32)
        .raw(&[0; 96]);
    expect_err(w.0, &["overlaps"]);

    // Back to back is fine.
    let mut w = W::default();
    w.header(3, 2, 0)
        .info("a", &[8], 0, 0)
        .info("b", &[8], 0, 32)
        .pad(32)
        .raw(&[0; 64]);
    assert_eq!(GgufFile::from_bytes(w.0).unwrap().tensors().len(), 2);

    let mut w = W::default();
    w.header(3, 2, 0)
        .info("a", &[8], 0, 0)
        .info("a", &[8], 0, 32)
        .pad(32)
        .raw(&[0; 64]);
    expect_err(w.0, &["duplicate tensor name 'a'", "byte 57"]);
}

#[test]
fn duplicate_and_empty_keys() {
    let mut w = W::default();
    w.header(3, 0, 2)
        .kv("k", &Value::U8(1))
        .kv("k", &Value::U8(2));
    expect_err(w.0, &["duplicate metadata key 'k'", "byte 38"]);
    let mut w = W::default();
    w.header(3, 0, 1).kv("", &Value::U8(1));
    expect_err(w.0, &["empty key", "byte 24"]);
}

#[test]
fn invalid_utf8() {
    let mut w = W::default();
    w.header(3, 0, 1).bstr(b"ab\xffc").u32(0).u8(0);
    expect_err(
        w.0,
        &["invalid UTF-8", "key of metadata entry 0", "byte 34"],
    );

    let mut w = W::default();
    w.header(3, 0, 1).str("k").u32(8).bstr(b"\xc3");
    expect_err(w.0, &["invalid UTF-8", "value of key 'k'"]);

    let mut w = W::default();
    w.header(3, 1, 0)
        .bstr(b"\x80w")
        .u32(1)
        .u64(8)
        .u32(0)
        .u64(0)
        .pad(32)
        .raw(&[0; 32]);
    expect_err(w.0, &["invalid UTF-8", "name of tensor info 0", "byte 32"]);
}

#[test]
fn bad_bool_and_deep_nesting() {
    let mut w = W::default();
    w.header(3, 0, 1).str("b").u32(7).u8(2);
    expect_err(w.0, &["bool value 2", "'b'", "byte 37"]);

    // Arrays nested MAX_ARRAY_DEPTH deep parse; one more level is rejected.
    for (depth, ok) in [(MAX_ARRAY_DEPTH, true), (MAX_ARRAY_DEPTH + 1, false)] {
        let mut w = W::default();
        w.header(3, 0, 1).str("n").u32(9);
        for _ in 1..depth {
            w.u32(9).u64(1);
        }
        w.u32(0).u64(1).u8(5);
        let r = GgufFile::from_bytes(w.0.clone());
        if ok {
            let f = r.unwrap();
            let mut v = f.get("n").unwrap();
            for _ in 0..depth {
                v = &v.as_array().unwrap()[0];
            }
            assert_eq!(v, &Value::U8(5));
        } else {
            expect_err(w.0, &["nested deeper", "'n'"]);
        }
    }
}

#[test]
fn names_in_messages_are_escaped_to_one_line() {
    let mut w = W::default();
    w.header(3, 0, 2)
        .kv("a\nb", &Value::U8(1))
        .kv("a\nb", &Value::U8(1));
    expect_err(w.0, &["'a\\nb'"]);
}

/// xorshift64* — deterministic, no crates.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[test]
fn random_mutations_never_panic() {
    let base = sample();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let (mut ok, mut bad) = (0, 0);
    for _ in 0..10_000 {
        let mut b = base.clone();
        for _ in 0..1 + rng.below(4) {
            let i = rng.below(b.len());
            b[i] = match rng.below(4) {
                0 => 0,
                1 => 0xFF,
                2 => b[i] ^ (1 << rng.below(8)),
                _ => rng.next() as u8,
            };
        }
        if rng.below(8) == 0 {
            let n = rng.below(b.len());
            b.truncate(n);
        }
        match GgufFile::from_bytes(b) {
            Ok(f) => {
                ok += 1;
                // Whatever parsed must satisfy the documented invariants.
                for t in f.tensors() {
                    assert_eq!(f.tensor_data(t).len() as u64, t.n_bytes);
                    assert_eq!((t.offset - f.data_offset) % f.alignment, 0);
                }
                for (k, _) in f.metadata() {
                    let _ = (
                        f.get_u32(k),
                        f.get_f32(k),
                        f.get_str_array(k),
                        f.get_i32_array(k),
                    );
                }
            }
            Err(Error::Model(m)) => {
                bad += 1;
                assert!(m.starts_with("GGUF: ") && !m.contains('\n'), "{m}");
            }
            Err(e) => panic!("unexpected error kind {e:?}"),
        }
    }
    // Both outcomes must occur, or the mutations are not exercising the parser.
    assert!(ok > 100 && bad > 100, "ok {ok}, bad {bad}");
}

// ---------------------------------------------------------------------------------------------
// Files on disk.

fn temp_path(tag: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("kvserve-gguf-{}-{tag}.gguf", std::process::id()))
}

#[test]
fn open_maps_file() {
    let path = temp_path("valid");
    std::fs::write(&path, sample()).unwrap();
    let f = GgufFile::open(&path);
    let _ = std::fs::remove_file(&path);
    let f = f.unwrap();
    let g = GgufFile::from_bytes(sample()).unwrap();
    assert_eq!(f.metadata(), g.metadata());
    assert_eq!(f.tensors(), g.tensors());
    for t in f.tensors() {
        assert_eq!(f.tensor_data(t), g.tensor_data(t));
    }
}

#[test]
fn open_errors_name_the_path() {
    let dir = std::env::temp_dir();
    match GgufFile::open(&dir) {
        Err(Error::Io(m)) => assert!(m.contains(&*dir.to_string_lossy()), "{m}"),
        other => panic!("directory: {other:?}"),
    }
    let missing = dir.join("kvserve-definitely-missing.gguf");
    match GgufFile::open(&missing) {
        Err(Error::Io(m)) => assert!(m.contains("kvserve-definitely-missing.gguf"), "{m}"),
        other => panic!("missing: {other:?}"),
    }
    for (tag, bytes) in [("empty", vec![]), ("bad", b"GGUF\x01\0\0\0".to_vec())] {
        let path = temp_path(tag);
        std::fs::write(&path, bytes).unwrap();
        let r = GgufFile::open(&path);
        let _ = std::fs::remove_file(&path);
        match r {
            Err(Error::Model(m)) => {
                assert!(
                    m.contains(&*path.to_string_lossy()) && !m.contains('\n'),
                    "{m}"
                )
            }
            other => panic!("{tag}: {other:?}"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The real model. Expected values were read with the `gguf` Python package (GGUFReader).

#[test]
fn real_model_matches_reference_reader() {
    let path = std::env::var("KVSERVE_TEST_MODEL").expect(
        "KVSERVE_TEST_MODEL is not set; point it at SmolLM2-135M-Instruct.Q4_1.gguf \
         (e.g. /work/models/SmolLM2-135M-Instruct.Q4_1.gguf)",
    );
    let t0 = std::time::Instant::now();
    let f = GgufFile::open(&path).unwrap_or_else(|e| panic!("KVSERVE_TEST_MODEL={path}: {e}"));
    let elapsed = t0.elapsed();
    eprintln!("opened {path} in {elapsed:?}");
    // Generous bound for a loaded debug/test build; release opens in a few milliseconds.
    assert!(elapsed.as_secs_f64() < 2.0, "open took {elapsed:?}");

    assert_eq!(f.version, 3);
    assert_eq!(f.file_size(), 98_362_432);
    assert_eq!(f.alignment, 32);
    assert_eq!(f.data_offset, 1_785_664);
    assert_eq!(f.data_offset % f.alignment, 0);
    assert_eq!(f.metadata().len(), 33);
    assert_eq!(f.tensors().len(), 272);

    assert_eq!(f.get_str("general.architecture").unwrap(), Some("llama"));
    assert_eq!(f.get_u32("llama.block_count").unwrap(), Some(30));
    assert_eq!(f.get_u32("llama.embedding_length").unwrap(), Some(576));
    assert_eq!(f.get_f32("llama.rope.freq_base").unwrap(), Some(100_000.0));
    assert_eq!(
        f.get_f32("llama.attention.layer_norm_rms_epsilon").unwrap(),
        Some(1e-5)
    );
    assert_eq!(f.get_str("tokenizer.ggml.pre").unwrap(), Some("smollm"));
    assert_eq!(
        f.get_bool("tokenizer.ggml.add_bos_token").unwrap(),
        Some(false)
    );
    assert_eq!(f.get_u32("tokenizer.ggml.eos_token_id").unwrap(), Some(2));

    let tokens = f.get_str_array("tokenizer.ggml.tokens").unwrap().unwrap();
    assert_eq!(tokens.len(), 49152);
    assert_eq!(
        &tokens[..3],
        &["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    );
    assert_eq!(tokens[49151], "ectable");
    assert_eq!(
        f.get_i32_array("tokenizer.ggml.token_type")
            .unwrap()
            .unwrap()
            .len(),
        49152
    );
    let merges = f.get_str_array("tokenizer.ggml.merges").unwrap().unwrap();
    assert_eq!((merges.len(), merges[0]), (48900, "Ġ t"));

    let emb = f.tensor("token_embd.weight").unwrap();
    assert_eq!(
        (emb.ty, emb.dims.as_slice()),
        (GgmlType::Q8_0, &[576u64, 49152][..])
    );
    assert_eq!((emb.offset, emb.n_bytes), (1_785_664, 30_081_024));
    let q = f.tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!(
        (q.ty, q.dims.as_slice()),
        (GgmlType::Q4_1, &[576u64, 576][..])
    );
    assert_eq!((q.offset, q.n_bytes), (33_806_656, 207_360));
    let down = f.tensor("blk.29.ffn_down.weight").unwrap();
    assert_eq!(
        (down.dims.as_slice(), down.offset),
        (&[1536u64, 576][..], 80_630_848)
    );
    let norm = f.tensor("output_norm.weight").unwrap();
    assert_eq!(
        (norm.ty, norm.offset, norm.n_bytes),
        (GgmlType::F32, 98_360_128, 2304)
    );
    assert_eq!(norm.offset + norm.n_bytes, f.file_size());
    assert_eq!(f.tensors()[0].name, "token_embd.weight");
    assert_eq!(f.tensors()[271].name, "output_norm.weight");

    let count = |ty| f.tensors().iter().filter(|t| t.ty == ty).count();
    assert_eq!(count(GgmlType::Q4_1), 210);
    assert_eq!(count(GgmlType::F32), 61);
    assert_eq!(count(GgmlType::Q8_0), 1);

    // Tensor data is a view of the mapping, not a copy.
    let data = f.tensor_data(norm);
    assert_eq!(data.len(), 2304);
    let base = f.tensor_data(emb).as_ptr() as usize;
    assert_eq!(
        data.as_ptr() as usize - base,
        (norm.offset - emb.offset) as usize
    );
    // The RMS norm weights are finite, positive-ish floats.
    let w0 = f32::from_le_bytes(data[..4].try_into().unwrap());
    assert!(w0.is_finite() && w0 != 0.0, "{w0}");
}

/// Found by fuzzing (`scripts/fuzz.sh gguf`; the input is kept as
/// fuzz/corpus/gguf/finding-block-count-alloc-*): a 30 KB file whose `llama.block_count` was
/// 2^24 (the largest the config took) made `llama::Weights::load` reserve room for 2^24 layers,
/// gigabytes, before it looked for the first layer's tensors. The config now refuses a block
/// count beyond the tensor table, with a message naming the key, before anything is sized by it.
#[test]
fn block_count_beyond_the_tensor_table_is_refused_before_allocation() {
    use crate::model::config::Config;
    let kvs = |blocks: u32| {
        vec![
            ("general.architecture", s("llama")),
            ("llama.block_count", Value::U32(blocks)),
            ("llama.embedding_length", Value::U32(32)),
            ("llama.feed_forward_length", Value::U32(64)),
            ("llama.attention.head_count", Value::U32(2)),
        ]
    };
    let tensors: Vec<T> = vec![("token_embd.weight", &[32, 8], GgmlType::F32, 32 * 8 * 4)];
    for blocks in [1 << 24, 2] {
        let g = GgufFile::from_bytes(build(&kvs(blocks), &tensors, 32)).unwrap();
        let err = Config::from_gguf(&g).unwrap_err().to_string();
        assert!(
            err.contains(&format!(
                "'llama.block_count' is {blocks}, but the file has only 1 tensors"
            )),
            "{err}"
        );
        let err = crate::model::Model::from_gguf(g, Some(1))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("block_count"), "{err}");
    }
    // As many blocks as tensors passes this check (and fails later, on the missing tensors).
    let g = GgufFile::from_bytes(build(&kvs(1), &tensors, 32)).unwrap();
    assert!(Config::from_gguf(&g).is_ok());
}
