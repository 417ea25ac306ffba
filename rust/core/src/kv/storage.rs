//! Block storage of the paged KV cache: the keys and values of every layer, in fixed-size
//! blocks of `block_size` token slots, stored as F16 (default), Q8_0 or F32.
//!
//! # Layout
//!
//! One contiguous byte buffer holds `n_blocks` blocks. A block holds, for each layer, a K region
//! and then a V region; each region is `block_size` rows of one token's `kv_dim` values
//! (`[block][layer][K|V][slot][kv_dim]`):
//!
//! * a block is one contiguous byte range, so copy-on-write ([`KvStorage::copy_block`]) and any
//!   later swap/offload are plain memory copies;
//! * within a layer, a block's keys are `block_size` rows at a constant stride, and the keys of
//!   one KV head are a contiguous `head_dim` segment of each row (128 bytes for head_dim 64 in
//!   F16), so attention streams 2-4 whole cache lines per cell at a fixed stride that the
//!   hardware prefetcher follows, and a GQA group reads each segment once for all its heads;
//! * a token's row is written in one contiguous store (no scatter across heads).
//!
//! Row encodings: F32 and F16 are little-endian values; Q8_0 is ggml's Q8_0 (per 32 values an
//! f16 scale `d` and 32 int8 `q`, value = `q * d`, 34 bytes: 53% of F16), so `kv_dim` must be a
//! multiple of 32 for Q8_0.
//!
//! # Guarantees
//!
//! * The buffer is allocated once, zeroed, in [`KvStorage::new`]; blocks never move. The zeroed
//!   allocation comes from the OS untouched, so physical memory is committed on first write.
//! * Every access is bounds-checked and returns [`Error::InvalidInput`] on a bad layer, block,
//!   slot or row length; nothing panics on bad input.
//! * Round trips: F32 exact, F16 round-to-nearest-even, Q8_0 within `d/2` per value (`d` the
//!   stored scale of its 32-value block, `d = max|x| / 127` rounded to f16).
//! * [`KvStorage::rotate_k`] re-rotates stored keys by a RoPE position delta (RoPE rotations
//!   compose additively), re-encoding the row: each shift adds at most one rounding of the type.
//!
//! Complexity: `write`/`read_*`/`rotate_k` are O(kv_dim); `copy_block` is O(n_layers * n_slots *
//! row_bytes).

use std::ops::Range;

use half::f16;

use crate::error::{invalid, Error, Result};
use crate::ops::Rope;

/// Values per Q8_0 block.
pub const Q8_0_BLOCK: usize = 32;
/// Bytes per Q8_0 block: f16 scale + 32 int8.
pub const Q8_0_BYTES: usize = 34;

/// Element type of stored keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvType {
    F32,
    /// Half precision: llama.cpp's default cache type.
    #[default]
    F16,
    /// ggml Q8_0: int8 with one f16 scale per 32 values.
    Q8_0,
}

impl KvType {
    /// A stable code for the type, used in content keys that may leave the process (never an
    /// enum discriminant): ggml's type ids (F32 = 0, F16 = 1, Q8_0 = 8).
    pub fn code(self) -> u32 {
        match self {
            KvType::F32 => 0,
            KvType::F16 => 1,
            KvType::Q8_0 => 8,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
            KvType::Q8_0 => "q8_0",
        }
    }

    /// Parses `f32`, `f16`, `q8_0` (case-insensitive).
    pub fn from_name(s: &str) -> Result<KvType> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" => Ok(KvType::F32),
            "f16" => Ok(KvType::F16),
            "q8_0" => Ok(KvType::Q8_0),
            other => Err(Error::Unsupported(format!(
                "unsupported KV cache type '{other}'; supported: f16, q8_0, f32"
            ))),
        }
    }

    /// Bytes of a `dim`-value row (`dim` must be valid for the type, see [`KvType::check_dim`]).
    pub fn row_bytes(self, dim: usize) -> usize {
        match self {
            KvType::F32 => dim * 4,
            KvType::F16 => dim * 2,
            KvType::Q8_0 => dim / Q8_0_BLOCK * Q8_0_BYTES,
        }
    }

    /// Q8_0 rows (and head segments) must hold whole 32-value blocks.
    pub fn check_dim(self, dim: usize, what: &str) -> Result<()> {
        if dim == 0 {
            return Err(invalid(format!("KV {what} must be positive")));
        }
        if self == KvType::Q8_0 && !dim.is_multiple_of(Q8_0_BLOCK) {
            return Err(Error::Unsupported(format!(
                "KV cache type q8_0 needs {what} to be a multiple of 32, got {dim}; use f16"
            )));
        }
        Ok(())
    }
}

/// Shape of a KV store: what one block holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub ty: KvType,
    pub n_layers: usize,
    /// Values per token row: n_kv_heads * head_dim.
    pub kv_dim: usize,
    /// Token slots per block.
    pub block_size: usize,
}

impl KvLayout {
    /// Checks the shape: all sizes positive, `kv_dim` valid for the type.
    pub fn validate(&self) -> Result<()> {
        if self.n_layers == 0 || self.block_size == 0 {
            return Err(invalid(format!(
                "KV layout needs n_layers and block_size > 0, got {} and {}",
                self.n_layers, self.block_size
            )));
        }
        self.ty.check_dim(self.kv_dim, "kv_dim")
    }

    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.kv_dim)
    }

    /// Bytes of one block: n_layers * 2 (K, V) * block_size rows.
    pub fn bytes_per_block(&self) -> usize {
        self.n_layers * 2 * self.block_size * self.row_bytes()
    }

    /// How many whole blocks fit in `bytes`.
    pub fn n_blocks_for_bytes(&self, bytes: usize) -> usize {
        bytes / self.bytes_per_block().max(1)
    }
}

/// The block pool's memory: see the module docs for layout and guarantees.
pub struct KvStorage {
    layout: KvLayout,
    n_blocks: usize,
    row_bytes: usize,
    block_bytes: usize,
    data: Vec<u8>,
}

impl std::fmt::Debug for KvStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvStorage")
            .field("layout", &self.layout)
            .field("n_blocks", &self.n_blocks)
            .finish()
    }
}

/// `n` zero bytes, or `OutOfMemory` instead of aborting the process when the allocator says
/// no (a mistyped `--ctx-size` must not take a server down). Zeroed pages are mapped lazily by
/// the OS, so a large cache costs memory only as it fills.
fn zeroed_bytes(n: usize) -> Result<Vec<u8>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(n)
        .map_err(|_| invalid(format!("KV cache of {n} bytes is too large")))?;
    // SAFETY: `layout` has a non-zero size (checked above).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err(crate::error::Error::OutOfMemory(format!(
            "cannot allocate a KV cache of {:.1} GiB",
            n as f64 / (1u64 << 30) as f64
        )));
    }
    // SAFETY: `ptr` was just allocated by the global allocator with the layout of `[u8; n]`
    // (align 1, size n), is non-null and holds `n` initialized (zero) bytes; the Vec takes
    // ownership and frees it with the same layout.
    Ok(unsafe { Vec::from_raw_parts(ptr, n, n) })
}

impl KvStorage {
    /// Allocates `n_blocks` zeroed blocks.
    pub fn new(layout: KvLayout, n_blocks: usize) -> Result<KvStorage> {
        layout.validate()?;
        let block_bytes = layout.bytes_per_block();
        let total = block_bytes
            .checked_mul(n_blocks)
            .filter(|&t| t <= isize::MAX as usize)
            .ok_or_else(|| invalid(format!("KV cache of {n_blocks} blocks is too large")))?;
        if n_blocks > u32::MAX as usize {
            return Err(invalid("KV cache block count exceeds u32 block ids"));
        }
        Ok(KvStorage {
            layout,
            n_blocks,
            row_bytes: layout.row_bytes(),
            block_bytes,
            data: zeroed_bytes(total)?,
        })
    }

    /// Allocates as many whole blocks as fit in `bytes` (at least one is required).
    pub fn with_bytes(layout: KvLayout, bytes: usize) -> Result<KvStorage> {
        layout.validate()?;
        let n = layout.n_blocks_for_bytes(bytes);
        if n == 0 {
            return Err(invalid(format!(
                "KV cache budget of {bytes} bytes is below one block ({} bytes)",
                layout.bytes_per_block()
            )));
        }
        KvStorage::new(layout, n)
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }
    pub fn kv_type(&self) -> KvType {
        self.layout.ty
    }
    pub fn n_blocks(&self) -> usize {
        self.n_blocks
    }
    pub fn block_size(&self) -> usize {
        self.layout.block_size
    }
    pub fn n_layers(&self) -> usize {
        self.layout.n_layers
    }
    pub fn kv_dim(&self) -> usize {
        self.layout.kv_dim
    }
    /// Bytes of one stored row (one token, one layer, K or V).
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }
    /// Total bytes of the buffer.
    pub fn total_bytes(&self) -> usize {
        self.data.len()
    }

    /// Bytes of one block (every layer's K and V regions).
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// The raw bytes of block `block`: a recurrent state kept in pool blocks
    /// (`kv/recurrent.rs`) stores its values there instead of K/V rows.
    pub fn block_raw(&self, block: u32) -> Result<&[u8]> {
        let b = self.check_block(block)?;
        Ok(&self.data[b * self.block_bytes..(b + 1) * self.block_bytes])
    }

    /// Mutable [`KvStorage::block_raw`].
    pub fn block_raw_mut(&mut self, block: u32) -> Result<&mut [u8]> {
        let b = self.check_block(block)?;
        Ok(&mut self.data[b * self.block_bytes..(b + 1) * self.block_bytes])
    }

    fn check_block(&self, block: u32) -> Result<usize> {
        let b = block as usize;
        if b >= self.n_blocks {
            return Err(invalid(format!(
                "KV block {block} out of range ({} blocks)",
                self.n_blocks
            )));
        }
        Ok(b)
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        if layer >= self.layout.n_layers {
            return Err(invalid(format!(
                "KV layer {layer} out of range ({} layers)",
                self.layout.n_layers
            )));
        }
        Ok(())
    }

    fn check_slots(&self, slots: &Range<usize>) -> Result<()> {
        if slots.start > slots.end || slots.end > self.layout.block_size {
            return Err(invalid(format!(
                "KV slots {slots:?} out of range (block size {})",
                self.layout.block_size
            )));
        }
        Ok(())
    }

    fn check_row(&self, len: usize, what: &str) -> Result<()> {
        if len != self.layout.kv_dim {
            return Err(invalid(format!(
                "KV {what} row has {len} values, expected kv_dim {}",
                self.layout.kv_dim
            )));
        }
        Ok(())
    }

    /// Byte offset of the K region (`v = false`) or V region of `layer` in block `b`.
    #[inline]
    fn region(&self, layer: usize, b: usize, v: bool) -> usize {
        b * self.block_bytes + (2 * layer + v as usize) * self.layout.block_size * self.row_bytes
    }

    /// Byte range of one row; the caller checked layer, block and slot.
    #[inline]
    fn row_range(&self, layer: usize, b: usize, slot: usize, v: bool) -> Range<usize> {
        let start = self.region(layer, b, v) + slot * self.row_bytes;
        start..start + self.row_bytes
    }

    /// Stores one token's key and value rows (`kv_dim` values each) of `layer` in
    /// `block`/`slot`, converting to the storage type.
    pub fn write(
        &mut self,
        layer: usize,
        block: u32,
        slot: usize,
        k_row: &[f32],
        v_row: &[f32],
    ) -> Result<()> {
        self.check_layer(layer)?;
        let b = self.check_block(block)?;
        self.check_slots(&(slot..slot + 1))?;
        self.check_row(k_row.len(), "key")?;
        self.check_row(v_row.len(), "value")?;
        let ty = self.layout.ty;
        let rk = self.row_range(layer, b, slot, false);
        encode_row(ty, k_row, &mut self.data[rk]);
        let rv = self.row_range(layer, b, slot, true);
        encode_row(ty, v_row, &mut self.data[rv]);
        Ok(())
    }

    /// Copies slots `0..n_slots` of every layer (K and V) from block `src` to block `dst`
    /// (copy-on-write of a shared, partially filled block). `src == dst` is a no-op.
    pub fn copy_block(&mut self, src: u32, dst: u32, n_slots: usize) -> Result<()> {
        let s = self.check_block(src)?;
        let d = self.check_block(dst)?;
        self.check_slots(&(0..n_slots))?;
        if s == d || n_slots == 0 {
            return Ok(());
        }
        let n = n_slots * self.row_bytes;
        if n_slots == self.layout.block_size {
            let (so, dof) = (s * self.block_bytes, d * self.block_bytes);
            self.data.copy_within(so..so + self.block_bytes, dof);
            return Ok(());
        }
        for layer in 0..self.layout.n_layers {
            for v in [false, true] {
                let so = self.region(layer, s, v);
                let dof = self.region(layer, d, v);
                self.data.copy_within(so..so + n, dof);
            }
        }
        Ok(())
    }

    fn read(&self, layer: usize, block: u32, slot: usize, v: bool, out: &mut [f32]) -> Result<()> {
        self.check_layer(layer)?;
        let b = self.check_block(block)?;
        self.check_slots(&(slot..slot + 1))?;
        self.check_row(out.len(), "output")?;
        decode_row(
            self.layout.ty,
            &self.data[self.row_range(layer, b, slot, v)],
            out,
        );
        Ok(())
    }

    /// Decodes the stored key row of `layer`/`block`/`slot` into `out` (`kv_dim` values).
    pub fn read_k(&self, layer: usize, block: u32, slot: usize, out: &mut [f32]) -> Result<()> {
        self.read(layer, block, slot, false, out)
    }

    /// Decodes the stored value row of `layer`/`block`/`slot` into `out` (`kv_dim` values).
    pub fn read_v(&self, layer: usize, block: u32, slot: usize, out: &mut [f32]) -> Result<()> {
        self.read(layer, block, slot, true, out)
    }

    /// Re-rotates the stored key of `layer`/`block`/`slot` by `delta_pos` positions: a key
    /// stored at position `p` becomes the key at `p + delta_pos` (up to one re-encoding).
    pub fn rotate_k(
        &mut self,
        layer: usize,
        block: u32,
        slot: usize,
        rope: &Rope,
        head_dim: usize,
        delta_pos: i32,
    ) -> Result<()> {
        self.rotate_k_slots(layer, block, slot..slot + 1, rope, head_dim, delta_pos)
    }

    /// [`KvStorage::rotate_k`] for a range of slots of one block (one angle computation).
    pub fn rotate_k_slots(
        &mut self,
        layer: usize,
        block: u32,
        slots: Range<usize>,
        rope: &Rope,
        head_dim: usize,
        delta_pos: i32,
    ) -> Result<()> {
        self.check_layer(layer)?;
        self.check_slots(&slots)?;
        let cells: Vec<(u32, u16)> = slots.map(|sl| (block, sl as u16)).collect();
        self.rotate_cells(layer..layer + 1, &cells, rope, head_dim, delta_pos)
    }

    /// Re-rotates the stored keys of many cells by the same `delta_pos`, in every layer, with
    /// one angle computation (a K-shift after `seq_add`/`seq_div` moves many cells by one
    /// delta).
    pub fn rotate_k_cells(
        &mut self,
        cells: &[(u32, u16)],
        rope: &Rope,
        head_dim: usize,
        delta_pos: i32,
    ) -> Result<()> {
        self.rotate_cells(0..self.layout.n_layers, cells, rope, head_dim, delta_pos)
    }

    /// The rotation uses `rope`'s angles for `delta_pos` normalized to unit length, so YaRN's
    /// magnitude factor (already applied when the key was first rotated) is not applied twice.
    fn rotate_cells(
        &mut self,
        layers: Range<usize>,
        cells: &[(u32, u16)],
        rope: &Rope,
        head_dim: usize,
        delta_pos: i32,
    ) -> Result<()> {
        let kv_dim = self.layout.kv_dim;
        if head_dim == 0
            || !kv_dim.is_multiple_of(head_dim)
            || rope.n_rot > head_dim
            || !rope.n_rot.is_multiple_of(2)
            || rope
                .freq_factors
                .as_ref()
                .is_some_and(|f| f.len() < rope.n_rot / 2)
        {
            return Err(invalid(format!(
                "rotate_k: head_dim {head_dim} / n_rot {} do not fit kv_dim {kv_dim}",
                rope.n_rot
            )));
        }
        for &(b, sl) in cells {
            self.check_block(b)?;
            self.check_slots(&(sl as usize..sl as usize + 1))?;
        }
        if delta_pos == 0 || cells.is_empty() {
            return Ok(());
        }
        let mut cs = vec![(0.0f32, 0.0f32); rope.n_rot / 2];
        rope.cos_sin(delta_pos as f32, &mut cs);
        for c in cs.iter_mut() {
            let norm = (c.0 * c.0 + c.1 * c.1).sqrt();
            if norm > 0.0 {
                *c = (c.0 / norm, c.1 / norm);
            }
        }
        let ty = self.layout.ty;
        let mut row = vec![0.0f32; kv_dim];
        for layer in layers {
            for &(b, sl) in cells {
                let r = self.row_range(layer, b as usize, sl as usize, false);
                decode_row(ty, &self.data[r.clone()], &mut row);
                rope.apply(&mut row, head_dim, &cs);
                encode_row(ty, &row, &mut self.data[r]);
            }
        }
        Ok(())
    }

    /// The stored bytes of one K (`v = false`) or V row of `layer`/`block`/`slot`, in the storage
    /// type (`row_bytes()` bytes), for saving a sequence's state.
    pub fn row_raw(&self, layer: usize, block: u32, slot: usize, v: bool) -> Result<&[u8]> {
        self.check_layer(layer)?;
        let b = self.check_block(block)?;
        self.check_slots(&(slot..slot + 1))?;
        Ok(&self.data[self.row_range(layer, b, slot, v)])
    }

    /// Stores `bytes` (one row in the storage type, as [`KvStorage::row_raw`] returns it) as the
    /// K (`v = false`) or V row of `layer`/`block`/`slot`, unchanged.
    pub fn write_row_raw(
        &mut self,
        layer: usize,
        block: u32,
        slot: usize,
        v: bool,
        bytes: &[u8],
    ) -> Result<()> {
        self.check_layer(layer)?;
        let b = self.check_block(block)?;
        self.check_slots(&(slot..slot + 1))?;
        if bytes.len() != self.row_bytes {
            return Err(invalid(format!(
                "KV row has {} bytes, expected {}",
                bytes.len(),
                self.row_bytes
            )));
        }
        let r = self.row_range(layer, b, slot, v);
        self.data[r].copy_from_slice(bytes);
        Ok(())
    }

    /// Bytes of the K (`v = false`) or V rows `0..block_size` of `layer` in `block`, for the
    /// attention kernels. The caller checked `layer` and `block`.
    #[inline]
    pub(crate) fn rows(&self, layer: usize, block: usize, v: bool) -> &[u8] {
        let start = self.region(layer, block, v);
        &self.data[start..start + self.layout.block_size * self.row_bytes]
    }
}

/// Encodes `src` into `dst` (exactly `ty.row_bytes(src.len())` bytes).
pub(crate) fn encode_row(ty: KvType, src: &[f32], dst: &mut [u8]) {
    match ty {
        KvType::F32 => {
            for (o, &x) in dst.chunks_exact_mut(4).zip(src) {
                o.copy_from_slice(&x.to_le_bytes());
            }
        }
        KvType::F16 => {
            #[cfg(target_arch = "x86_64")]
            if crate::quant::simd::level() >= crate::quant::SimdLevel::Avx2 {
                // SAFETY: AVX2 (and F16C with it, see `simd::detect`) was detected.
                unsafe { x86::encode_f16(src, dst) };
                return;
            }
            encode_f16_scalar(src, dst);
        }
        KvType::Q8_0 => {
            for (o, x) in dst
                .chunks_exact_mut(Q8_0_BYTES)
                .zip(src.chunks_exact(Q8_0_BLOCK))
            {
                quantize_q8_0_block(x, o);
            }
        }
    }
}

/// The f16 rows of [`encode_row`], one value at a time (the scalar twin of `x86::encode_f16`).
fn encode_f16_scalar(src: &[f32], dst: &mut [u8]) {
    for (o, &x) in dst.chunks_exact_mut(2).zip(src) {
        o.copy_from_slice(&f16::from_f32(x).to_bits().to_le_bytes());
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// [`super::encode_f16_scalar`] 8 values at a time with F16C's `vcvtps2ph` (round to
    /// nearest even, as `f16::from_f32`; a NaN stays a NaN), the tail with the twin. A prompt
    /// step stores every token's keys and values of every layer: value by value (with
    /// `half`'s feature check per value) it was ~1% of a prompt step, and one member's while
    /// the others waited.
    ///
    /// # Safety
    /// AVX2 and F16C are available.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn encode_f16(src: &[f32], dst: &mut [u8]) {
        let n = src.len().min(dst.len() / 2);
        let body = n - n % 8;
        let mut i = 0;
        while i < body {
            // SAFETY: i + 8 <= n: 8 floats of src and 16 bytes of dst from i (2i) are in bounds.
            unsafe {
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(
                    src.as_ptr().add(i),
                ));
                _mm_storeu_si128(dst.as_mut_ptr().add(2 * i).cast(), h);
            }
            i += 8;
        }
        super::encode_f16_scalar(&src[body..n], &mut dst[2 * body..2 * n]);
    }
}

/// One Q8_0 block. The scale is rounded to f16 first and the values are quantized against the
/// rounded scale, so the error bound `|x - q*d| <= d/2` holds for the stored `d`.
fn quantize_q8_0_block(x: &[f32], out: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = f16::from_f32((amax / 127.0).min(f16::MAX.to_f32()));
    let df = d.to_f32();
    let id = if df > 0.0 { 1.0 / df } else { 0.0 };
    out[..2].copy_from_slice(&d.to_bits().to_le_bytes());
    for (o, &v) in out[2..].iter_mut().zip(x) {
        *o = ((v * id).round().clamp(-127.0, 127.0) as i8) as u8;
    }
}

/// Decodes `dst.len()` values from `src`.
pub(crate) fn decode_row(ty: KvType, src: &[u8], dst: &mut [f32]) {
    match ty {
        KvType::F32 => {
            for (o, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        KvType::F16 => {
            for (o, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        KvType::Q8_0 => {
            for (o, b) in dst
                .chunks_exact_mut(Q8_0_BLOCK)
                .zip(src.chunks_exact(Q8_0_BYTES))
            {
                let d = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                for (y, &q) in o.iter_mut().zip(&b[2..]) {
                    *y = q as i8 as f32 * d;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::RopeScaling;

    /// The F16C row encoder against its scalar twin, bit for bit: lengths with every tail,
    /// values from subnormal to beyond f16's range, ties, infinities; NaN stays NaN.
    #[test]
    fn f16_encode_matches_scalar_twin() {
        let mut vals: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0,
            -1.5,
            65504.0,
            65520.0,
            1e6,
            -1e6,
            6e-8,
            3e-8,
            1e-9,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1.0 + 1.0 / 2048.0,
            1.0 + 3.0 / 2048.0,
        ];
        let mut seed = 5u32;
        for _ in 0..500 {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            vals.push(f32::from_bits(seed & 0xBFFF_FFFF)); // |x| < 2: every exponent below
        }
        let level = crate::quant::simd::level();
        for len in [0, 1, 7, 8, 9, 15, 16, 17, vals.len()] {
            let mut want = vec![0u8; 2 * len];
            encode_f16_scalar(&vals[..len], &mut want);
            let mut got = vec![0xAAu8; 2 * len];
            encode_row(KvType::F16, &vals[..len], &mut got);
            assert_eq!(got, want, "len {len} at {}", level.name());
        }
        let mut nan = [0u8; 18];
        encode_row(KvType::F16, &[f32::NAN; 9], &mut nan);
        for b in nan.chunks_exact(2) {
            assert!(f16::from_bits(u16::from_le_bytes([b[0], b[1]])).is_nan());
        }
        eprintln!("simd coverage: kv f16 encode: scalar vs {}", level.name());
    }

    /// Deterministic pseudo-random values (splitmix64), uniform in [-1, 1).
    pub(crate) fn rand_vals(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = s;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^= z >> 31;
                ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn layout(ty: KvType) -> KvLayout {
        KvLayout {
            ty,
            n_layers: 3,
            kv_dim: 64,
            block_size: 4,
        }
    }

    #[test]
    fn sizes_by_bytes_and_blocks() {
        let l = layout(KvType::F16);
        assert_eq!(l.bytes_per_block(), 3 * 2 * 4 * 64 * 2);
        assert_eq!(layout(KvType::Q8_0).bytes_per_block(), 3 * 2 * 4 * 2 * 34);
        assert_eq!(
            layout(KvType::F32).bytes_per_block(),
            2 * l.bytes_per_block()
        );
        assert_eq!(l.n_blocks_for_bytes(10 * l.bytes_per_block() + 5), 10);
        let s = KvStorage::with_bytes(l, 10 * l.bytes_per_block() + 5).unwrap();
        assert_eq!(s.n_blocks(), 10);
        assert_eq!(s.total_bytes(), 10 * l.bytes_per_block());
        assert!(KvStorage::with_bytes(l, 100).is_err());
        let bad = KvLayout {
            kv_dim: 48,
            ..layout(KvType::Q8_0)
        };
        assert!(matches!(KvStorage::new(bad, 1), Err(Error::Unsupported(_))));
        assert!(KvStorage::new(layout(KvType::F16), usize::MAX / 2).is_err());
        assert_eq!(KvType::from_name("Q8_0").unwrap(), KvType::Q8_0);
        assert!(KvType::from_name("q4_0").is_err());
    }

    #[test]
    fn round_trips_per_type() {
        let k: Vec<f32> = rand_vals(1, 64).iter().map(|v| v * 3.0).collect();
        let v: Vec<f32> = rand_vals(2, 64).iter().map(|v| v * 0.01).collect();
        for ty in [KvType::F32, KvType::F16, KvType::Q8_0] {
            let mut s = KvStorage::new(layout(ty), 5).unwrap();
            s.write(2, 4, 3, &k, &v).unwrap();
            let (mut ko, mut vo) = (vec![0.0; 64], vec![0.0; 64]);
            s.read_k(2, 4, 3, &mut ko).unwrap();
            s.read_v(2, 4, 3, &mut vo).unwrap();
            for (src, got) in [(&k, &ko), (&v, &vo)] {
                match ty {
                    KvType::F32 => assert_eq!(got, src),
                    KvType::F16 => {
                        for (a, b) in src.iter().zip(got.iter()) {
                            assert_eq!(*b, f16::from_f32(*a).to_f32());
                        }
                    }
                    KvType::Q8_0 => {
                        for (xs, ys) in src.chunks(32).zip(got.chunks(32)) {
                            let amax = xs.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                            let d = f16::from_f32(amax / 127.0).to_f32();
                            for (x, y) in xs.iter().zip(ys) {
                                assert!((x - y).abs() <= d * 0.5 * (1.0 + 1e-5), "{x} {y} {d}");
                            }
                        }
                    }
                }
            }
            // Other slots, layers and blocks are untouched.
            s.read_k(1, 4, 3, &mut ko).unwrap();
            assert!(ko.iter().all(|&x| x == 0.0));
            s.read_k(2, 3, 3, &mut ko).unwrap();
            assert!(ko.iter().all(|&x| x == 0.0));
            s.read_v(2, 4, 2, &mut ko).unwrap();
            assert!(ko.iter().all(|&x| x == 0.0));
        }
    }

    #[test]
    fn bad_indices_are_errors() {
        let mut s = KvStorage::new(layout(KvType::F16), 2).unwrap();
        let r = vec![0.0; 64];
        let mut o = vec![0.0; 64];
        assert!(s.write(3, 0, 0, &r, &r).is_err());
        assert!(s.write(0, 2, 0, &r, &r).is_err());
        assert!(s.write(0, 0, 4, &r, &r).is_err());
        assert!(s.write(0, 0, 0, &r[..63], &r).is_err());
        assert!(s.read_k(0, 0, 0, &mut o[..10]).is_err());
        assert!(s.copy_block(0, 2, 1).is_err());
        assert!(s.copy_block(0, 1, 5).is_err());
    }

    #[test]
    fn copy_block_copies_prefix_of_every_layer() {
        for ty in [KvType::F32, KvType::Q8_0] {
            let mut s = KvStorage::new(layout(ty), 3).unwrap();
            for layer in 0..3 {
                for slot in 0..4 {
                    let k = rand_vals((layer * 10 + slot) as u64, 64);
                    let v = rand_vals((layer * 10 + slot + 100) as u64, 64);
                    s.write(layer, 0, slot, &k, &v).unwrap();
                }
            }
            s.copy_block(0, 2, 3).unwrap();
            let (mut a, mut b) = (vec![0.0; 64], vec![0.0; 64]);
            for layer in 0..3 {
                for slot in 0..4 {
                    s.read_k(layer, 0, slot, &mut a).unwrap();
                    s.read_k(layer, 2, slot, &mut b).unwrap();
                    if slot < 3 {
                        assert_eq!(a, b);
                        s.read_v(layer, 0, slot, &mut a).unwrap();
                        s.read_v(layer, 2, slot, &mut b).unwrap();
                        assert_eq!(a, b);
                    } else {
                        assert!(b.iter().all(|&x| x == 0.0));
                    }
                }
            }
            s.copy_block(0, 1, 4).unwrap();
            for layer in 0..3 {
                for slot in 0..4 {
                    s.read_v(layer, 0, slot, &mut a).unwrap();
                    s.read_v(layer, 1, slot, &mut b).unwrap();
                    assert_eq!(a, b);
                }
            }
        }
    }

    fn rope(neox: bool, scaling: RopeScaling) -> Rope {
        Rope {
            n_rot: 32,
            neox,
            freq_base: 10000.0,
            scaling,
            freq_factors: None,
        }
    }

    #[test]
    fn rotate_k_equals_rotation_at_new_position() {
        let yarn = RopeScaling::Yarn {
            factor: 4.0,
            orig_ctx: 2048,
            ext_factor: 1.0,
            attn_factor: 1.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
        };
        let head_dim = 32;
        for (neox, scaling) in [
            (false, RopeScaling::None),
            (true, RopeScaling::None),
            (true, yarn),
        ] {
            let r = rope(neox, scaling);
            for ty in [KvType::F32, KvType::F16, KvType::Q8_0] {
                let mut s = KvStorage::new(layout(ty), 2).unwrap();
                let x = rand_vals(7, 64);
                let (p, delta) = (37i32, -25i32);
                let at = |pos: i32| {
                    let mut cs = vec![(0.0, 0.0); 16];
                    r.cos_sin(pos as f32, &mut cs);
                    let mut y = x.clone();
                    r.apply(&mut y, head_dim, &cs);
                    y
                };
                s.write(1, 1, 2, &at(p), &x).unwrap();
                s.rotate_k(1, 1, 2, &r, head_dim, delta).unwrap();
                let mut got = vec![0.0; 64];
                s.read_k(1, 1, 2, &mut got).unwrap();
                let want = at(p + delta);
                // YaRN's magnitude factor is applied once, at the original rotation.
                let tol = match ty {
                    KvType::F32 => 1e-4,
                    KvType::F16 => 4e-3,
                    KvType::Q8_0 => 2.5e-2,
                };
                for (g, w) in got.iter().zip(&want) {
                    assert!((g - w).abs() < tol, "{ty:?} neox={neox}: {g} vs {w}");
                }
                // The value row is untouched.
                s.read_v(1, 1, 2, &mut got).unwrap();
                let mut vx = vec![0.0; 64];
                decode_row(ty, &encoded(ty, &x), &mut vx);
                assert_eq!(got, vx);
            }
        }
    }

    fn encoded(ty: KvType, x: &[f32]) -> Vec<u8> {
        let mut b = vec![0u8; ty.row_bytes(x.len())];
        encode_row(ty, x, &mut b);
        b
    }
}
