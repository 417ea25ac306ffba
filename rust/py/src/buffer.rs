//! `Logits`: an owned f32 matrix exposed through the buffer protocol, so that
//! `np.frombuffer(l, dtype=np.float32)` views it without a copy.
//!
//! The type is built by hand with `PyType_FromSpec` instead of `#[pyclass]`: the extension is
//! built against the stable ABI from Python 3.10 (pyo3 `abi3-py310`, one wheel for every Python
//! from 3.10), and pyo3 offers `__getbuffer__` under the limited API only from 3.11, the release
//! that added `Py_buffer` to it. The interpreter side has been there longer: `PyType_FromSpec`
//! accepts the `Py_bf_getbuffer` slot since Python 3.9 (bpo-40724), and `Py_buffer`'s layout,
//! which 3.11 froze into the stable ABI, has not changed since 3.3; `PyBuffer` below is that
//! layout. So one abi3 extension exports the same zero-copy buffer on 3.10 as on 3.13.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::mem::offset_of;
use std::ptr;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// CPython's `Py_buffer` (Include/pybuffer.h; stable ABI from 3.11, the same layout since 3.3).
#[repr(C)]
struct PyBuffer {
    buf: *mut c_void,
    obj: *mut ffi::PyObject,
    len: ffi::Py_ssize_t,
    itemsize: ffi::Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut ffi::Py_ssize_t,
    strides: *mut ffi::Py_ssize_t,
    suboffsets: *mut ffi::Py_ssize_t,
    internal: *mut c_void,
}

// Include/pybuffer.h and Include/typeslots.h.
const PYBUF_WRITABLE: c_int = 0x0001;
const PYBUF_FORMAT: c_int = 0x0004;
const PYBUF_ND: c_int = 0x0008;
const PYBUF_STRIDES: c_int = 0x0010 | PYBUF_ND;
const PY_BF_GETBUFFER: c_int = 1;

/// The instance: the object header, then the Rust fields. `data` never moves or changes after
/// construction (no method mutates it), so buffer views can point into it.
#[repr(C)]
struct LogitsObject {
    ob_base: ffi::PyObject,
    data: Vec<f32>,
    /// [rows, cols] and byte strides, kept here because the buffer view points into them.
    shape: [ffi::Py_ssize_t; 2],
    strides: [ffi::Py_ssize_t; 2],
}

static FORMAT: &CStr = c"f";
static NAME: &CStr = c"kvserve._core.Logits";
static DOC: &CStr = c"Row-major float32 logits, n_rows x n_vocab, exposed through the buffer \
protocol: np.frombuffer(l, dtype=np.float32).reshape(l.n_rows, l.n_vocab) is a zero-copy view.";

static TYPE: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// The `Logits` type (created on first use, once per process).
pub fn logits_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    TYPE.get_or_try_init(py, || create_type(py))
        .map(|t| t.bind(py))
}

fn create_type(py: Python<'_>) -> PyResult<Py<PyType>> {
    let member = |name: &'static CStr, index: usize, doc: &'static CStr| ffi::PyMemberDef {
        name: name.as_ptr(),
        type_code: ffi::Py_T_PYSSIZET,
        offset: (offset_of!(LogitsObject, shape) + index * size_of::<ffi::Py_ssize_t>())
            as ffi::Py_ssize_t,
        flags: ffi::Py_READONLY,
        doc: doc.as_ptr(),
    };
    // The type keeps pointers into the member table and the spec's name: both live for the
    // process (created once).
    let members: &'static mut [ffi::PyMemberDef] = Box::leak(Box::new([
        member(
            c"n_rows",
            0,
            c"rows (one per token whose logits were asked for)",
        ),
        member(c"n_vocab", 1, c"columns (the vocabulary size)"),
        ffi::PyMemberDef::default(),
    ]));
    let methods: &'static mut [ffi::PyMethodDef] = Box::leak(Box::new([
        ffi::PyMethodDef {
            ml_name: c"argmax".as_ptr(),
            ml_meth: ffi::PyMethodDefPointer {
                PyCFunction: argmax,
            },
            ml_flags: ffi::METH_O,
            ml_doc:
                c"argmax(row) -> int: the index of row `row`'s largest value, the first one on \
ties, the first NaN if the row holds any (numpy's argmax rule); IndexError for a row out of range."
                    .as_ptr(),
        },
        ffi::PyMethodDef::zeroed(),
    ]));
    let slot = |slot: c_int, pfunc: *mut c_void| ffi::PyType_Slot { slot, pfunc };
    let mut slots = [
        slot(ffi::Py_tp_doc, DOC.as_ptr() as *mut c_void),
        slot(ffi::Py_tp_dealloc, dealloc as *mut c_void),
        slot(ffi::Py_tp_members, members.as_mut_ptr() as *mut c_void),
        slot(ffi::Py_tp_methods, methods.as_mut_ptr() as *mut c_void),
        slot(ffi::Py_sq_length, len as *mut c_void),
        slot(PY_BF_GETBUFFER, getbuffer as *mut c_void),
        slot(0, ptr::null_mut()),
    ];
    let mut spec = ffi::PyType_Spec {
        name: NAME.as_ptr(),
        basicsize: size_of::<LogitsObject>() as c_int,
        itemsize: 0,
        // Not subclassable, not instantiable from Python (only decode makes one), immutable.
        flags: (ffi::Py_TPFLAGS_DEFAULT
            | ffi::Py_TPFLAGS_IMMUTABLETYPE
            | ffi::Py_TPFLAGS_DISALLOW_INSTANTIATION) as _,
        slots: slots.as_mut_ptr(),
    };
    // SAFETY: the spec is complete and its slot functions have the signatures CPython calls
    // them with; the name, doc and member table are 'static.
    let tp = unsafe { ffi::PyType_FromSpec(&mut spec) };
    // SAFETY: PyType_FromSpec returns a new reference to a type, or NULL with an exception set.
    let tp = unsafe { Bound::from_owned_ptr_or_err(py, tp)? };
    Ok(tp.cast_into::<PyType>()?.unbind())
}

/// A new `Logits` owning `data` (`n_rows * n_cols` values, row-major).
pub fn new_logits(
    py: Python<'_>,
    data: Vec<f32>,
    n_rows: usize,
    n_cols: usize,
) -> PyResult<Py<PyAny>> {
    debug_assert_eq!(data.len(), n_rows * n_cols);
    let tp = logits_type(py)?.as_type_ptr();
    let f = size_of::<f32>() as ffi::Py_ssize_t;
    // SAFETY: `tp` is the Logits type, whose basicsize is size_of::<LogitsObject>();
    // PyType_GenericAlloc returns zeroed memory of that size with the header initialised (or
    // NULL with an exception set), and each Rust field is written once before anyone reads it.
    unsafe {
        let obj = ffi::PyType_GenericAlloc(tp, 0);
        if obj.is_null() {
            return Err(PyErr::fetch(py));
        }
        let this = obj.cast::<LogitsObject>();
        ptr::addr_of_mut!((*this).data).write(data);
        ptr::addr_of_mut!((*this).shape)
            .write([n_rows as ffi::Py_ssize_t, n_cols as ffi::Py_ssize_t]);
        ptr::addr_of_mut!((*this).strides).write([n_cols as ffi::Py_ssize_t * f, f]);
        Ok(Py::from_owned_ptr(py, obj))
    }
}

/// `tp_dealloc`: drops the Rust fields, frees the object, releases the type (heap types are
/// referenced by their instances).
unsafe extern "C" fn dealloc(obj: *mut ffi::PyObject) {
    // SAFETY: CPython calls this once, with the GIL, for a Logits whose refcount reached zero;
    // its fields were initialised by `new_logits` (the only constructor).
    unsafe {
        let tp = ffi::Py_TYPE(obj);
        ptr::drop_in_place(ptr::addr_of_mut!((*obj.cast::<LogitsObject>()).data));
        let free = ffi::PyType_GetSlot(tp, ffi::Py_tp_free);
        let free: ffi::freefunc = std::mem::transmute(free);
        free(obj.cast());
        ffi::Py_DECREF(tp.cast());
    }
}

/// `Logits.argmax(row)`: the greedy token of one row, without a numpy view of the logits
/// (the engine's per-token path at one running sequence: numpy's argmax machinery, cold after
/// a decode step has streamed the weights through the caches, cost ~5x this scan).
unsafe extern "C" fn argmax(
    obj: *mut ffi::PyObject,
    arg: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    // SAFETY: CPython calls this with the GIL, a live Logits as `obj` and a borrowed argument;
    // `data` is never mutated after construction, so the row slice is valid while we hold
    // `obj` (borrowed for the call).
    unsafe {
        let i = ffi::PyLong_AsSsize_t(arg);
        if i == -1 && !ffi::PyErr_Occurred().is_null() {
            return ptr::null_mut();
        }
        let this = &*obj.cast::<LogitsObject>();
        let [rows, cols] = this.shape;
        if i < 0 || i >= rows {
            ffi::PyErr_SetString(ffi::PyExc_IndexError, c"row index out of range".as_ptr());
            return ptr::null_mut();
        }
        let (i, cols) = (i as usize, cols as usize);
        let row = &this.data[i * cols..(i + 1) * cols];
        match kvserve_core::ops::argmax_first(row) {
            Some(t) => ffi::PyLong_FromSsize_t(t as ffi::Py_ssize_t),
            None => {
                ffi::PyErr_SetString(ffi::PyExc_ValueError, c"argmax of an empty row".as_ptr());
                ptr::null_mut()
            }
        }
    }
}

/// `len()`: rows, as of the 2-D array it exports (`n_rows x n_vocab`).
unsafe extern "C" fn len(obj: *mut ffi::PyObject) -> ffi::Py_ssize_t {
    // SAFETY: CPython passes a live Logits.
    unsafe { (*obj.cast::<LogitsObject>()).shape[0] }
}

/// `bf_getbuffer`: a read-only 2-D float32 view of `data`. Nothing is allocated for the view, so
/// there is no `bf_releasebuffer`; CPython releases `view.obj` itself.
unsafe extern "C" fn getbuffer(
    obj: *mut ffi::PyObject,
    view: *mut PyBuffer,
    flags: c_int,
) -> c_int {
    // SAFETY: CPython calls this with the GIL, a live Logits and a `view` to fill (exclusively
    // ours). Every pointer stored refers to data owned by the object, which never moves or
    // changes, and `view.obj` holds a new reference that keeps the object alive.
    unsafe {
        if view.is_null() {
            ffi::PyErr_SetString(ffi::PyExc_BufferError, c"null buffer view".as_ptr());
            return -1;
        }
        if (flags & PYBUF_WRITABLE) == PYBUF_WRITABLE {
            (*view).obj = ptr::null_mut();
            ffi::PyErr_SetString(ffi::PyExc_BufferError, c"Logits are read-only".as_ptr());
            return -1;
        }
        let this = &*obj.cast::<LogitsObject>();
        ffi::Py_INCREF(obj);
        (*view).obj = obj;
        (*view).buf = this.data.as_ptr() as *mut c_void;
        (*view).len = (this.data.len() * size_of::<f32>()) as ffi::Py_ssize_t;
        (*view).readonly = 1;
        (*view).itemsize = size_of::<f32>() as ffi::Py_ssize_t;
        (*view).format = if (flags & PYBUF_FORMAT) == PYBUF_FORMAT {
            FORMAT.as_ptr() as *mut c_char
        } else {
            ptr::null_mut()
        };
        (*view).ndim = 2;
        (*view).shape = if (flags & PYBUF_ND) == PYBUF_ND {
            this.shape.as_ptr() as *mut _
        } else {
            ptr::null_mut()
        };
        (*view).strides = if (flags & PYBUF_STRIDES) == PYBUF_STRIDES {
            this.strides.as_ptr() as *mut _
        } else {
            ptr::null_mut()
        };
        (*view).suboffsets = ptr::null_mut();
        (*view).internal = ptr::null_mut();
    }
    0
}
