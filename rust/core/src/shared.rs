//! `SharedSlice`: a mutable slice that several threads write in disjoint parts, for the SPMD
//! forward pass (see [`crate::threads::Team`]) and the matmul task split.
//!
//! Safety rests on the caller: between two team barriers, no element is written by one thread
//! while another reads or writes it. Every `unsafe` use states which partition makes that so.

use std::marker::PhantomData;
use std::ops::Range;

pub struct SharedSlice<'a, T> {
    ptr: *mut T,
    len: usize,
    _borrow: PhantomData<&'a mut [T]>,
}

// SAFETY: the slice is only a pointer to data borrowed mutably for 'a; moving or sharing the
// pointer between threads is sound for `T: Send` as long as accesses are disjoint, which every
// unsafe accessor requires of its caller.
unsafe impl<T: Send> Send for SharedSlice<'_, T> {}
// SAFETY: as above; shared references only hand out accesses under the disjointness contract.
unsafe impl<T: Send> Sync for SharedSlice<'_, T> {}

impl<'a, T> SharedSlice<'a, T> {
    pub fn new(s: &'a mut [T]) -> SharedSlice<'a, T> {
        SharedSlice {
            ptr: s.as_mut_ptr(),
            len: s.len(),
            _borrow: PhantomData,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// # Safety
    /// No other thread accesses any element of `r` while the returned slice lives.
    /// Panics if `r` is out of bounds.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, r: Range<usize>) -> &mut [T] {
        assert!(
            r.start <= r.end && r.end <= self.len,
            "SharedSlice range {r:?} of {}",
            self.len
        );
        // SAFETY: in bounds (checked); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.end - r.start) }
    }

    /// # Safety
    /// No thread writes any element of `r` while the returned slice lives.
    /// Panics if `r` is out of bounds.
    pub unsafe fn slice(&self, r: Range<usize>) -> &[T] {
        assert!(
            r.start <= r.end && r.end <= self.len,
            "SharedSlice range {r:?} of {}",
            self.len
        );
        // SAFETY: in bounds (checked); absence of writers is the caller's contract.
        unsafe { std::slice::from_raw_parts(self.ptr.add(r.start), r.end - r.start) }
    }

    /// The whole slice, read-only.
    ///
    /// # Safety
    /// No thread writes any element while the returned slice lives.
    pub unsafe fn all(&self) -> &[T] {
        // SAFETY: forwarded contract.
        unsafe { self.slice(0..self.len) }
    }

    /// The first `len` elements (`len <= len()`, checked) as a slice of their own, under the
    /// same contract: it narrows what its users may touch and shares nothing new.
    pub fn prefix(&self, len: usize) -> SharedSlice<'_, T> {
        assert!(len <= self.len, "SharedSlice prefix {len} of {}", self.len);
        SharedSlice {
            ptr: self.ptr,
            len,
            _borrow: PhantomData,
        }
    }

    /// A raw pointer to element `i` (`i <= len()`, checked), for kernels that write a strided
    /// set of elements that no slice could cover without taking in other threads' elements.
    /// Writing through it is unsafe: only elements in bounds that the writer owns, under the
    /// same contract as [`Self::slice_mut`].
    pub fn ptr_at(&self, i: usize) -> *mut T {
        assert!(i <= self.len, "SharedSlice index {i} of {}", self.len);
        self.ptr.wrapping_add(i)
    }

    /// # Safety
    /// `i < len()` (checked only in debug builds: this is the hot path of matmul output
    /// scatter), and no other thread accesses element `i` concurrently.
    pub unsafe fn write(&self, i: usize, v: T) {
        debug_assert!(i < self.len, "SharedSlice index {i} of {}", self.len);
        // SAFETY: in bounds and exclusive by the caller's contract.
        unsafe { *self.ptr.add(i) = v };
    }
}
