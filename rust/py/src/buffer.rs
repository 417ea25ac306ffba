//! `Logits`: an owned f32 matrix exposed through the buffer protocol, so that
//! `np.frombuffer(l, dtype=np.float32)` views it without a copy.

use std::ffi::{c_int, c_void, CStr};

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

#[pyclass(frozen, module = "kvserve._core")]
pub struct Logits {
    data: Vec<f32>,
    /// [rows, cols] and byte strides, kept here because the buffer view points into them.
    shape: [ffi::Py_ssize_t; 2],
    strides: [ffi::Py_ssize_t; 2],
}

impl Logits {
    pub fn new(data: Vec<f32>, n_rows: usize, n_cols: usize) -> Logits {
        debug_assert_eq!(data.len(), n_rows * n_cols);
        let f = std::mem::size_of::<f32>() as ffi::Py_ssize_t;
        Logits {
            data,
            shape: [n_rows as ffi::Py_ssize_t, n_cols as ffi::Py_ssize_t],
            strides: [n_cols as ffi::Py_ssize_t * f, f],
        }
    }
}

static FORMAT: &CStr = c"f";

#[pymethods]
impl Logits {
    #[getter]
    fn n_rows(&self) -> usize {
        self.shape[0] as usize
    }

    #[getter]
    fn n_vocab(&self) -> usize {
        self.shape[1] as usize
    }

    /// Rows, as `len()` of the 2-D array it exports (`n_rows x n_vocab`).
    fn __len__(&self) -> usize {
        self.shape[0] as usize
    }

    /// # Safety
    /// Called by CPython with a valid `view` to fill. The view borrows `data`, `shape` and
    /// `strides`, which live as long as the object, and the object is kept alive by the
    /// reference stored in `view.obj`. The class is frozen, so the data never moves or changes.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("null buffer view"));
        }
        if (flags & ffi::PyBUF_WRITABLE) == ffi::PyBUF_WRITABLE {
            return Err(PyBufferError::new_err("Logits are read-only"));
        }
        let this = slf.get();
        // SAFETY: `view` is non-null and CPython hands us exclusive access to fill it; every
        // pointer stored refers to data owned by `slf`, which `obj` keeps alive.
        unsafe {
            (*view).obj = slf.clone().into_any().into_ptr();
            (*view).buf = this.data.as_ptr() as *mut c_void;
            (*view).len = (this.data.len() * std::mem::size_of::<f32>()) as ffi::Py_ssize_t;
            (*view).readonly = 1;
            (*view).itemsize = std::mem::size_of::<f32>() as ffi::Py_ssize_t;
            (*view).format = if (flags & ffi::PyBUF_FORMAT) == ffi::PyBUF_FORMAT {
                FORMAT.as_ptr() as *mut _
            } else {
                std::ptr::null_mut()
            };
            (*view).ndim = 2;
            (*view).shape = if (flags & ffi::PyBUF_ND) == ffi::PyBUF_ND {
                this.shape.as_ptr() as *mut _
            } else {
                std::ptr::null_mut()
            };
            (*view).strides = if (flags & ffi::PyBUF_STRIDES) == ffi::PyBUF_STRIDES {
                this.strides.as_ptr() as *mut _
            } else {
                std::ptr::null_mut()
            };
            (*view).suboffsets = std::ptr::null_mut();
            (*view).internal = std::ptr::null_mut();
        }
        Ok(())
    }

    /// # Safety
    /// Nothing was allocated for the view; CPython releases `view.obj` itself.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}
