//! Links the binaries with an rpath of `$ORIGIN` (and `$ORIGIN/..` for tests
//! and examples one level down), where ffi/build.rs puts libggml-base,
//! libggml, libllama and the backend modules, so nothing needs
//! LD_LIBRARY_PATH; records which ggml source the binaries were built from.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=vendor/llama.cpp.tar.xz.sha256");
    println!("cargo:rerun-if-changed=vendor/patches");
    println!("cargo:rerun-if-changed=vendor/source.sh");
    // the ggml source identity a backend module's stamp must name: the
    // archive and the patches applied to it (vendor/source.sh); the CUDA
    // module's names the patches of files it is built from
    println!("cargo:rustc-env=STRATA_GGML_SOURCE={}", source_id(&[]));
    println!(
        "cargo:rustc-env=STRATA_GGML_SOURCE_CUDA={}",
        source_id(&["cuda"])
    );
    println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN");
    println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN/..");
}

/// `vendor/source.sh id ARGS...`.
fn source_id(args: &[&str]) -> String {
    std::process::Command::new("bash")
        .args(["vendor/source.sh", "id"])
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| panic!("vendor/source.sh id {} failed", args.join(" ")))
}
