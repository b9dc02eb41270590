//! Links the binaries with an rpath of `$ORIGIN` (and `$ORIGIN/..` for tests
//! and examples one level down), where ffi/build.rs puts libggml-base,
//! libggml, libllama and the backend modules, so nothing needs
//! LD_LIBRARY_PATH; records which ggml source the binaries were built from.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=vendor/llama.cpp.tar.xz.sha256");
    // the ggml source identity a backend module's stamp must name
    let sha = std::fs::read_to_string("vendor/llama.cpp.tar.xz.sha256").unwrap_or_default();
    println!("cargo:rustc-env=STRATA_GGML_SRC_SHA256={}", sha.trim());
    println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN");
    println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN/..");
}
