//! Model forward passes, one file per architecture family.
