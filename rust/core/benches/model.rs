//! Model loading costs: the weights identity (`model_identity`: header, tensor table and
//! sampled stripes of every tensor's data) that prefix keys and session files carry.
//!
//! Needs a GGUF model: `KVSERVE_TEST_MODEL=path/to/model.gguf cargo bench -p kvserve-core
//! --bench model` (the benchmark fails, naming the variable, when it is unset). Moved here from
//! the `#[ignore]`d `measure_model_identity` test.

use divan::Bencher;
use kvserve_core::gguf::GgufFile;
use kvserve_core::model::model_identity;

fn main() {
    divan::main();
}

fn model() -> GgufFile {
    let path = std::env::var("KVSERVE_TEST_MODEL").unwrap_or_else(|_| {
        panic!("KVSERVE_TEST_MODEL is not set: point it at a GGUF model (the default model)")
    });
    GgufFile::open(&path).unwrap_or_else(|e| panic!("KVSERVE_TEST_MODEL={path}: {e}"))
}

/// `model_identity` of the model in `KVSERVE_TEST_MODEL` (pages already mapped in).
#[divan::bench(max_time = 2)]
fn identity(bencher: Bencher) {
    let g = model();
    divan::black_box(model_identity(&g));
    bencher.bench_local(|| model_identity(divan::black_box(&g)));
}
