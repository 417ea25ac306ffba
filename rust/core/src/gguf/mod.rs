//! GGUF v2/v3 reader over mmap with bounded, checked parsing.
//!
//! [`GgufFile::open`] maps a model file read-only and parses its header, metadata and tensor
//! table once; tensor data is never copied ([`GgufFile::tensor_data`] returns a slice of the
//! mapping). Guarantees once `open`/`from_bytes` returns `Ok`:
//!
//! * every read stayed inside the file; counts and lengths read from the file were checked
//!   against the bytes remaining *before* anything was allocated for them;
//! * metadata keys and tensor names are valid UTF-8 and unique;
//! * every tensor has 1..=4 non-zero dimensions whose product fits in `i64`, a known ggml type
//!   ([`GgmlType::from_id`]), a first dimension that is a whole number of type blocks, an
//!   offset aligned to `general.alignment`, and a data range that lies inside the file and does
//!   not overlap any other tensor's.
//!
//! Malformed input never panics: it yields [`Error::Model`] with one line naming what is wrong,
//! the key or tensor concerned and the byte offset, e.g.
//! `GGUF: truncated file reading value of key 'llama.block_count' at byte 1234 (...)`.
//!
//! # Format summary
//!
//! All integers are little-endian. A file is: magic `GGUF`; `u32` version (2 or 3); `u64`
//! tensor count; `u64` metadata entry count; the metadata entries (string key, `u32` value type,
//! value); the tensor infos (string name, `u32` dimension count, that many `u64` dimensions with
//! the innermost first, `u32` ggml type, `u64` offset relative to the data section); padding up
//! to a multiple of the alignment; the data section. A string is a `u64` byte length followed by
//! UTF-8 bytes. An array value is a `u32` element type, a `u64` count and the elements.

mod parse;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use memmap2::Mmap;

use crate::error::{model_err, Error, Result};
use crate::quant::GgmlType;

/// Alignment of the data section and of every tensor offset when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// Metadata key that overrides [`DEFAULT_ALIGNMENT`].
pub const ALIGNMENT_KEY: &str = "general.alignment";

/// The largest number of dimensions a tensor may have.
pub const MAX_DIMS: usize = 4;

/// How deeply metadata arrays may nest (an array of arrays is depth 2).
pub const MAX_ARRAY_DEPTH: usize = 8;

/// One metadata value. Arrays keep their elements as values of the array's element type (all
/// elements of one array have the same variant).
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    /// The GGUF name of the value's type, for messages ("U32", "STRING", "ARRAY", ...).
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "U8",
            Value::I8(_) => "I8",
            Value::U16(_) => "U16",
            Value::I16(_) => "I16",
            Value::U32(_) => "U32",
            Value::I32(_) => "I32",
            Value::U64(_) => "U64",
            Value::I64(_) => "I64",
            Value::F32(_) => "F32",
            Value::F64(_) => "F64",
            Value::Bool(_) => "BOOL",
            Value::String(_) => "STRING",
            Value::Array(_) => "ARRAY",
        }
    }

    /// The GGUF on-disk type id of the value (0 = U8 ... 12 = F64).
    pub fn type_id(&self) -> u32 {
        match self {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::String(_) => 8,
            Value::Array(_) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }

    /// The value of any integer variant, widened; `None` for other variants.
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The value of a float or integer variant as `f64`; `None` for other variants.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_integer().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(v) => Some(v),
            _ => None,
        }
    }
}

/// One entry of the tensor table, fully validated at open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions in ggml order: `dims[0]` is the innermost (contiguous) one. 1..=4 entries,
    /// all non-zero.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute byte offset of the tensor's data in the file.
    pub offset: u64,
    /// Size of the tensor's data in bytes.
    pub n_bytes: u64,
    /// Product of `dims`.
    pub n_elements: u64,
}

impl TensorInfo {
    /// Number of rows: product of all dimensions but the first.
    pub fn n_rows(&self) -> u64 {
        self.dims.iter().skip(1).product()
    }
}

/// The bytes behind a [`GgufFile`].
enum Storage {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file: metadata, tensor table and the (mapped) bytes behind tensor data.
pub struct GgufFile {
    /// Format version, 2 or 3.
    pub version: u32,
    /// Alignment of the data section and tensor offsets (a power of two).
    pub alignment: u64,
    /// Absolute byte offset of the data section.
    pub data_offset: u64,
    storage: Storage,
    metadata: Vec<(String, Value)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .field("file_size", &self.file_size())
            .field("n_metadata", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps `path` read-only and parses it.
    ///
    /// A missing, unreadable or non-regular path gives [`Error::Io`]; a malformed file gives
    /// [`Error::Model`]. Both messages name the path. The file must not be modified while the
    /// returned value is alive (the usual contract of a shared read-only mapping).
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let shown = path.display();
        let file =
            File::open(path).map_err(|e| Error::Io(format!("GGUF: cannot open '{shown}': {e}")))?;
        let meta = file
            .metadata()
            .map_err(|e| Error::Io(format!("GGUF: cannot stat '{shown}': {e}")))?;
        if meta.is_dir() {
            return Err(Error::Io(format!(
                "GGUF: '{shown}' is a directory, not a model file"
            )));
        }
        if !meta.is_file() {
            return Err(Error::Io(format!("GGUF: '{shown}' is not a regular file")));
        }
        let storage = if meta.len() == 0 {
            // Mapping zero bytes is not portable; an empty file fails parsing anyway.
            Storage::Owned(Vec::new())
        } else {
            // SAFETY: the mapping is read-only and private to this value; we never create
            // mutable references into it. Soundness of reading it requires that no process
            // truncates or rewrites the file while it is mapped, which is the documented
            // contract of `open` (model files are treated as immutable).
            let map = unsafe { Mmap::map(&file) }
                .map_err(|e| Error::Io(format!("GGUF: cannot mmap '{shown}': {e}")))?;
            Storage::Mapped(map)
        };
        Self::from_storage(storage).map_err(|e| match e {
            Error::Model(m) => Error::Model(format!("{m} in '{shown}'")),
            other => other,
        })
    }

    /// Parses a GGUF file held in memory (same checks as [`GgufFile::open`]). Tensor data keeps
    /// the alignment of the `Vec`'s allocation; a mapping is page-aligned.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile> {
        Self::from_storage(Storage::Owned(bytes))
    }

    fn from_storage(storage: Storage) -> Result<GgufFile> {
        let p = parse::parse(storage.bytes())?;
        Ok(GgufFile {
            version: p.version,
            alignment: p.alignment,
            data_offset: p.data_offset,
            storage,
            metadata: p.metadata,
            meta_index: p.meta_index,
            tensors: p.tensors,
            tensor_index: p.tensor_index,
        })
    }

    /// All metadata entries in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// The value of metadata key `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn get_integer(&self, key: &str, want: &str) -> Result<Option<i128>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_integer().map(Some).ok_or_else(|| {
                model_err(format!(
                    "GGUF: key '{}' is {}, expected an integer ({want})",
                    parse::shown(key),
                    v.type_name()
                ))
            }),
        }
    }

    /// Integer metadata as `u32`: any integer variant whose value fits; otherwise an error
    /// naming the key. `Ok(None)` if the key is absent.
    pub fn get_u32(&self, key: &str) -> Result<Option<u32>> {
        self.get_integer(key, "u32")?
            .map(|v| fit(key, v, "u32"))
            .transpose()
    }

    /// Integer metadata as `u64` (see [`GgufFile::get_u32`]).
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        self.get_integer(key, "u64")?
            .map(|v| fit(key, v, "u64"))
            .transpose()
    }

    /// Integer metadata as `i64` (see [`GgufFile::get_u32`]).
    pub fn get_i64(&self, key: &str) -> Result<Option<i64>> {
        self.get_integer(key, "i64")?
            .map(|v| fit(key, v, "i64"))
            .transpose()
    }

    /// Numeric metadata as `f32`: accepts F32, F64 (rounded) and any integer variant.
    pub fn get_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(|x| Some(x as f32)).ok_or_else(|| {
                model_err(format!(
                    "GGUF: key '{}' is {}, expected a number",
                    parse::shown(key),
                    v.type_name()
                ))
            }),
        }
    }

    /// Boolean metadata (BOOL only).
    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(wrong_type(key, v, "BOOL")),
        }
    }

    /// String metadata (STRING only).
    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(wrong_type(key, v, "STRING")),
        }
    }

    /// Array metadata, any element type.
    pub fn get_array(&self, key: &str) -> Result<Option<&[Value]>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(v) => Err(wrong_type(key, v, "ARRAY")),
        }
    }

    /// An array of strings, borrowed.
    pub fn get_str_array(&self, key: &str) -> Result<Option<Vec<&str>>> {
        self.map_array(key, "STRING", |v| v.as_str())
    }

    /// An array of numbers as `f32` (F32, F64 or integer elements).
    pub fn get_f32_array(&self, key: &str) -> Result<Option<Vec<f32>>> {
        self.map_array(key, "a number", |v| v.as_f64().map(|x| x as f32))
    }

    /// An array of integers as `i32` (any integer element type, each value must fit).
    pub fn get_i32_array(&self, key: &str) -> Result<Option<Vec<i32>>> {
        self.map_array(key, "an integer in i32 range", |v| {
            v.as_integer().and_then(|x| i32::try_from(x).ok())
        })
    }

    /// An array of integers as `u32` (any integer element type, each value must fit).
    pub fn get_u32_array(&self, key: &str) -> Result<Option<Vec<u32>>> {
        self.map_array(key, "an integer in u32 range", |v| {
            v.as_integer().and_then(|x| u32::try_from(x).ok())
        })
    }

    fn map_array<'s, T>(
        &'s self,
        key: &str,
        want: &str,
        f: impl Fn(&'s Value) -> Option<T>,
    ) -> Result<Option<Vec<T>>> {
        let Some(items) = self.get_array(key)? else {
            return Ok(None);
        };
        let mut out = Vec::with_capacity(items.len());
        for (i, v) in items.iter().enumerate() {
            match f(v) {
                Some(x) => out.push(x),
                None => {
                    return Err(model_err(format!(
                        "GGUF: element {i} of array key '{}' is {}, expected {want}",
                        parse::shown(key),
                        parse::shown_value(v)
                    )))
                }
            }
        }
        Ok(Some(out))
    }

    /// The tensor table in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor named `name`, if present.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The data bytes of tensor `t` (a slice of the mapping, no copy). The range was checked at
    /// open; a `TensorInfo` that does not belong to this file yields an empty slice if its
    /// range falls outside the file.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let bytes = self.storage.bytes();
        let range = usize::try_from(t.offset)
            .ok()
            .zip(usize::try_from(t.offset.saturating_add(t.n_bytes)).ok());
        match range {
            Some((start, end)) => bytes.get(start..end).unwrap_or(&[]),
            None => &[],
        }
    }

    /// The data bytes of the tensor named `name`, if present.
    pub fn tensor_bytes(&self, name: &str) -> Option<&[u8]> {
        self.tensor(name).map(|t| self.tensor_data(t))
    }

    /// The file's header as stored: magic, version, every metadata entry and the tensor table
    /// (everything before the tensor data).
    pub fn header_bytes(&self) -> &[u8] {
        let bytes = self.storage.bytes();
        let end = usize::try_from(self.data_offset).map_or(bytes.len(), |e| e.min(bytes.len()));
        &bytes[..end]
    }

    /// Size of the whole file in bytes.
    pub fn file_size(&self) -> u64 {
        self.storage.bytes().len() as u64
    }
}

fn fit<T: TryFrom<i128>>(key: &str, v: i128, want: &str) -> Result<T> {
    T::try_from(v).map_err(|_| {
        model_err(format!(
            "GGUF: value {v} of key '{}' does not fit in {want}",
            parse::shown(key)
        ))
    })
}

fn wrong_type(key: &str, v: &Value, want: &str) -> Error {
    model_err(format!(
        "GGUF: key '{}' is {}, expected {want}",
        parse::shown(key),
        v.type_name()
    ))
}
