//! The bounded GGUF parser behind [`super::GgufFile`].
//!
//! Every read goes through [`Cursor`], which checks the bytes left before touching them and
//! reports the byte offset and what was being read. Counts read from the file are compared with
//! the bytes left (times the smallest possible encoded size of one item) before any allocation.

use std::collections::HashMap;
use std::fmt;

use super::{TensorInfo, Value, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAX_ARRAY_DEPTH, MAX_DIMS};
use crate::error::{model_err, Error, Result};
use crate::quant::GgmlType;

/// Smallest encoded size of one metadata entry: empty key (8) + type (4) + 1-byte value.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
/// Smallest encoded size of one tensor info: empty name (8) + n_dims (4) + one dim (8) +
/// type (4) + offset (8).
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 8 + 4 + 8;

/// What the parser produced; moved into `GgufFile`.
pub(super) struct Parsed {
    pub version: u32,
    pub alignment: u64,
    pub data_offset: u64,
    pub metadata: Vec<(String, Value)>,
    pub meta_index: HashMap<String, usize>,
    pub tensors: Vec<TensorInfo>,
    pub tensor_index: HashMap<String, usize>,
}

/// A name made safe for a one-line message: control characters escaped, long names cut.
pub(super) fn shown(s: &str) -> String {
    const MAX: usize = 96;
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i == MAX {
            out.push_str("...");
            break;
        }
        out.extend(c.escape_debug());
    }
    out
}

/// A value described for a message: type and, for scalars, the value.
pub(super) fn shown_value(v: &Value) -> String {
    match v {
        Value::String(_) | Value::Array(_) => v.type_name().to_string(),
        Value::F32(x) => format!("F32 {x}"),
        Value::F64(x) => format!("F64 {x}"),
        Value::Bool(b) => format!("BOOL {b}"),
        _ => format!("{} {}", v.type_name(), v.as_integer().unwrap_or_default()),
    }
}

/// What the cursor is reading, for error messages.
#[derive(Clone, Copy)]
enum Ctx<'a> {
    Header(&'static str),
    KeyOf(u64),
    Value(&'a str),
    TensorName(u64),
    Tensor(&'a str),
}

impl fmt::Display for Ctx<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Ctx::Header(what) => write!(f, "header {what}"),
            Ctx::KeyOf(i) => write!(f, "key of metadata entry {i}"),
            Ctx::Value(k) => write!(f, "value of key '{}'", shown(k)),
            Ctx::TensorName(i) => write!(f, "name of tensor info {i}"),
            Ctx::Tensor(n) => write!(f, "info of tensor '{}'", shown(n)),
        }
    }
}

fn err(msg: String) -> Error {
    model_err(format!("GGUF: {msg}"))
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, ctx: Ctx<'_>) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(err(format!(
                "truncated file reading {ctx} at byte {} (need {n} bytes, {} left)",
                self.pos,
                self.remaining()
            )));
        }
        // n <= remaining <= usize::MAX, so the cast is lossless.
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.buf[start..self.pos])
    }

    fn array<const N: usize>(&mut self, ctx: Ctx<'_>) -> Result<[u8; N]> {
        let b = self.take(N as u64, ctx)?;
        let mut out = [0u8; N];
        out.copy_from_slice(b);
        Ok(out)
    }

    fn u8(&mut self, ctx: Ctx<'_>) -> Result<u8> {
        Ok(self.array::<1>(ctx)?[0])
    }
    fn u16(&mut self, ctx: Ctx<'_>) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array(ctx)?))
    }
    fn u32(&mut self, ctx: Ctx<'_>) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(ctx)?))
    }
    fn u64(&mut self, ctx: Ctx<'_>) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(ctx)?))
    }

    /// A length-prefixed UTF-8 string borrowed from the buffer.
    fn str(&mut self, ctx: Ctx<'_>) -> Result<&'a str> {
        let at = self.pos;
        let len = self.u64(ctx)?;
        if len > self.remaining() {
            return Err(err(format!(
                "string length {len} at byte {at} exceeds the {} bytes left, reading {ctx}",
                self.remaining()
            )));
        }
        let bytes = self.take(len, ctx)?;
        std::str::from_utf8(bytes).map_err(|e| {
            err(format!(
                "invalid UTF-8 in {ctx} at byte {}",
                at + 8 + e.valid_up_to()
            ))
        })
    }

    /// A metadata value of type id `ty` (already read). `depth` counts enclosing arrays.
    fn value(&mut self, ty: u32, ty_at: usize, key: &str, depth: usize) -> Result<Value> {
        let ctx = Ctx::Value(key);
        Ok(match ty {
            0 => Value::U8(self.u8(ctx)?),
            1 => Value::I8(self.u8(ctx)? as i8),
            2 => Value::U16(self.u16(ctx)?),
            3 => Value::I16(self.u16(ctx)? as i16),
            4 => Value::U32(self.u32(ctx)?),
            5 => Value::I32(self.u32(ctx)? as i32),
            6 => Value::F32(f32::from_bits(self.u32(ctx)?)),
            7 => {
                let at = self.pos;
                match self.u8(ctx)? {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    b => {
                        return Err(err(format!(
                            "bool value {b} (not 0 or 1) for key '{}' at byte {at}",
                            shown(key)
                        )))
                    }
                }
            }
            8 => Value::String(self.str(ctx)?.to_owned()),
            9 => self.array_value(key, depth)?,
            10 => Value::U64(self.u64(ctx)?),
            11 => Value::I64(self.u64(ctx)? as i64),
            12 => Value::F64(f64::from_bits(self.u64(ctx)?)),
            _ => {
                return Err(err(format!(
                    "unknown metadata value type id {ty} for key '{}' at byte {ty_at} \
                     (known: 0..=12)",
                    shown(key)
                )))
            }
        })
    }

    fn array_value(&mut self, key: &str, depth: usize) -> Result<Value> {
        let ctx = Ctx::Value(key);
        let at = self.pos;
        if depth >= MAX_ARRAY_DEPTH {
            return Err(err(format!(
                "arrays nested deeper than {MAX_ARRAY_DEPTH} levels for key '{}' at byte {at}",
                shown(key)
            )));
        }
        let elem_ty = self.u32(ctx)?;
        let min = min_value_bytes(elem_ty).ok_or_else(|| {
            err(format!(
                "unknown array element type id {elem_ty} for key '{}' at byte {at} \
                 (known: 0..=12)",
                shown(key)
            ))
        })?;
        let count_at = self.pos;
        let count = self.u64(ctx)?;
        let room = self.remaining() / min;
        if count > room {
            return Err(err(format!(
                "array length {count} of key '{}' at byte {count_at} exceeds what the {} bytes \
                 left could hold",
                shown(key),
                self.remaining()
            )));
        }
        // count <= remaining bytes, so the allocation is bounded by the file size.
        let mut items = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let elem_at = self.pos;
            items.push(self.value(elem_ty, elem_at, key, depth + 1)?);
        }
        Ok(Value::Array(items))
    }
}

/// Smallest encoded size of one value of type id `ty`; `None` for an unknown id.
fn min_value_bytes(ty: u32) -> Option<u64> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        10..=12 => 8,
        8 => 8,
        9 => 4 + 8,
        _ => return None,
    })
}

fn known_tensor_types() -> String {
    (0..64)
        .filter_map(GgmlType::from_id)
        .map(|t| format!("{} {}", t.id(), t.name()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Parses a whole GGUF file held in `buf`.
pub(super) fn parse(buf: &[u8]) -> Result<Parsed> {
    let mut c = Cursor { buf, pos: 0 };

    let magic: [u8; 4] = c.array(Ctx::Header("magic"))?;
    if &magic != b"GGUF" {
        return Err(err(format!(
            "bad magic {} at byte 0 (expected \"GGUF\"); not a GGUF file",
            magic.escape_ascii()
        )));
    }
    let version = c.u32(Ctx::Header("version"))?;
    if version != 2 && version != 3 {
        return Err(err(format!(
            "unsupported version {version} at byte 4 (supported: 2, 3)"
        )));
    }
    let tensor_count = c.u64(Ctx::Header("tensor_count"))?;
    let kv_count = c.u64(Ctx::Header("kv_count"))?;
    if kv_count > c.remaining() / MIN_KV_BYTES {
        return Err(err(format!(
            "kv_count {kv_count} at byte 16 exceeds what the {} bytes left could hold",
            c.remaining()
        )));
    }
    if tensor_count > c.remaining() / MIN_TENSOR_INFO_BYTES {
        return Err(err(format!(
            "tensor_count {tensor_count} at byte 8 exceeds what the {} bytes left could hold",
            c.remaining()
        )));
    }

    // Metadata. Both counts are now bounded by the file size, so capacities are safe.
    let mut metadata: Vec<(String, Value)> = Vec::with_capacity(kv_count as usize);
    let mut meta_index: HashMap<String, usize> = HashMap::with_capacity(kv_count as usize);
    let mut align_at = 0;
    for i in 0..kv_count {
        let key_at = c.pos;
        let key = c.str(Ctx::KeyOf(i))?;
        if key.is_empty() {
            return Err(err(format!(
                "empty key in metadata entry {i} at byte {key_at}"
            )));
        }
        if meta_index.contains_key(key) {
            return Err(err(format!(
                "duplicate metadata key '{}' at byte {key_at}",
                shown(key)
            )));
        }
        let ty_at = c.pos;
        if key == ALIGNMENT_KEY {
            align_at = ty_at;
        }
        let ty = c.u32(Ctx::Value(key))?;
        let value = c.value(ty, ty_at, key, 0)?;
        meta_index.insert(key.to_owned(), metadata.len());
        metadata.push((key.to_owned(), value));
    }

    let alignment = match meta_index.get(ALIGNMENT_KEY).map(|&i| &metadata[i].1) {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_integer() {
            Some(a) if a > 0 && a <= u32::MAX as i128 && (a as u64).is_power_of_two() => a as u64,
            _ => {
                return Err(err(format!(
                    "'{ALIGNMENT_KEY}' at byte {align_at} is {}, expected a non-zero power of two \
                     (u32)",
                    shown_value(v)
                )))
            }
        },
    };

    // Tensor infos.
    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(tensor_count as usize);
    let mut tensor_index: HashMap<String, usize> = HashMap::with_capacity(tensor_count as usize);
    let mut info_at: Vec<usize> = Vec::with_capacity(tensor_count as usize);
    for i in 0..tensor_count {
        let at = c.pos;
        let name = c.str(Ctx::TensorName(i))?;
        let sname = shown(name);
        if tensor_index.contains_key(name) {
            return Err(err(format!("duplicate tensor name '{sname}' at byte {at}")));
        }
        let ctx = Ctx::Tensor(name);
        let nd_at = c.pos;
        let n_dims = c.u32(ctx)?;
        if n_dims == 0 || n_dims as usize > MAX_DIMS {
            return Err(err(format!(
                "tensor '{sname}' has {n_dims} dimensions at byte {nd_at} (allowed 1..={MAX_DIMS})"
            )));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        let mut n_elements: u64 = 1;
        for d in 0..n_dims {
            let dim_at = c.pos;
            let dim = c.u64(ctx)?;
            if dim == 0 {
                return Err(err(format!(
                    "tensor '{sname}' dimension {d} is 0 at byte {dim_at}"
                )));
            }
            n_elements = n_elements
                .checked_mul(dim)
                .filter(|&n| n <= i64::MAX as u64)
                .ok_or_else(|| {
                    err(format!(
                        "tensor '{sname}' element count overflows at dimension {d} \
                         (byte {dim_at})"
                    ))
                })?;
            dims.push(dim);
        }
        let ty_at = c.pos;
        let ty_id = c.u32(ctx)?;
        let ty = GgmlType::from_id(ty_id).ok_or_else(|| {
            err(format!(
                "tensor '{sname}' has unknown ggml type id {ty_id} at byte {ty_at} (known: {})",
                known_tensor_types()
            ))
        })?;
        let off_at = c.pos;
        let rel_offset = c.u64(ctx)?;
        if dims[0] % ty.block_size() as u64 != 0 {
            return Err(err(format!(
                "tensor '{sname}' first dimension {} is not a multiple of the {} block size {} \
                 (info at byte {at})",
                dims[0],
                ty.name(),
                ty.block_size()
            )));
        }
        let n_bytes = ty
            .row_bytes(dims[0])
            .and_then(|row| row.checked_mul(n_elements / dims[0]))
            .ok_or_else(|| {
                err(format!(
                    "tensor '{sname}' byte size overflows (info at byte {at})"
                ))
            })?;
        if rel_offset % alignment != 0 {
            return Err(err(format!(
                "tensor '{sname}' offset {rel_offset} at byte {off_at} is not a multiple of the \
                 alignment {alignment}"
            )));
        }
        tensor_index.insert(name.to_owned(), tensors.len());
        info_at.push(at);
        tensors.push(TensorInfo {
            name: name.to_owned(),
            dims,
            ty,
            offset: rel_offset,
            n_bytes,
            n_elements,
        });
    }

    // Data section: starts at the next multiple of the alignment after the infos.
    let end_of_infos = c.pos as u64;
    let data_offset = end_of_infos
        .checked_next_multiple_of(alignment)
        .ok_or_else(|| {
            err(format!(
                "data section offset overflows after byte {end_of_infos}"
            ))
        })?;
    let file_size = buf.len() as u64;
    for (t, &at) in tensors.iter_mut().zip(&info_at) {
        let rel = t.offset;
        let range = data_offset
            .checked_add(rel)
            .and_then(|start| start.checked_add(t.n_bytes).map(|end| (start, end)));
        match range {
            Some((start, end)) if end <= file_size => t.offset = start,
            _ => {
                return Err(err(format!(
                    "tensor '{}' data (offset {rel} + {} bytes after data section at byte \
                     {data_offset}) lies outside the file of {file_size} bytes (info at byte {at})",
                    shown(&t.name),
                    t.n_bytes
                )))
            }
        }
    }

    // No two tensors may share bytes.
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_unstable_by_key(|&i| tensors[i].offset);
    for w in order.windows(2) {
        let (a, b) = (&tensors[w[0]], &tensors[w[1]]);
        if a.offset + a.n_bytes > b.offset {
            return Err(err(format!(
                "tensor '{}' data [{}, {}) overlaps tensor '{}' data starting at byte {}",
                shown(&a.name),
                a.offset,
                a.offset + a.n_bytes,
                shown(&b.name),
                b.offset
            )));
        }
    }

    Ok(Parsed {
        version,
        alignment,
        data_offset,
        metadata,
        meta_index,
        tensors,
        tensor_index,
    })
}
