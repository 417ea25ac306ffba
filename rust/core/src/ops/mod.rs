//! Tensor operations on f32 activations: norms, RoPE, softmax, activations, attention.
