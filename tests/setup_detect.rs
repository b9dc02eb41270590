//! tools/find-libclang.sh: the check tools/setup.sh uses to decide whether
//! to install libclang. It must find what bindgen loads (libclang's C API)
//! and must not take LLVM's C++ library (libclang-cpp) for it: on a fresh
//! Debian with llvm-14-dev, libclang-cpp.so.14 is present and libclang is
//! not, and the build then failed in bindgen.

use std::path::Path;
use std::process::Command;

/// Runs the detection over a fake root holding `files`; returns what it printed.
fn detect(files: &[&str]) -> Option<String> {
    let root = tempfile::tempdir().unwrap();
    for f in files {
        let p = root.path().join(f.trim_start_matches('/'));
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, b"").unwrap();
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/find-libclang.sh");
    let out = Command::new("bash")
        .arg(script)
        .env("STRATA_LIBCLANG_ROOT", root.path())
        .env_remove("LIBCLANG_PATH")
        .output()
        .unwrap();
    let printed = String::from_utf8(out.stdout).unwrap();
    let printed = printed.trim();
    out.status.success().then(|| {
        printed
            .strip_prefix(root.path().to_str().unwrap())
            .unwrap()
            .to_string()
    })
}

#[test]
fn libclang_cpp_alone_is_not_libclang() {
    assert_eq!(
        detect(&[
            "/usr/lib/llvm-14/lib/libclang-cpp.so.14",
            "/usr/lib/x86_64-linux-gnu/libclang-cpp.so.14"
        ]),
        None
    );
}

#[test]
fn nothing_found_on_an_empty_machine() {
    assert_eq!(detect(&["/usr/lib/x86_64-linux-gnu/libz.so.1"]), None);
}

#[test]
fn finds_the_names_bindgen_loads() {
    for f in [
        "/usr/lib/llvm-14/lib/libclang.so",
        "/usr/lib/llvm-14/lib/libclang.so.1",
        "/usr/lib/x86_64-linux-gnu/libclang-14.so.1",
        "/usr/lib/x86_64-linux-gnu/libclang-14.so",
        "/usr/local/lib/libclang.so.18.1",
        "/usr/local/llvm18/lib/libclang.so",
    ] {
        assert_eq!(detect(&[f]).as_deref(), Some(f), "{f}");
    }
}

#[test]
fn finds_libclang_beside_libclang_cpp() {
    assert_eq!(
        detect(&[
            "/usr/lib/llvm-14/lib/libclang-cpp.so.14",
            "/usr/lib/llvm-14/lib/libclang-14.so.1"
        ])
        .as_deref(),
        Some("/usr/lib/llvm-14/lib/libclang-14.so.1")
    );
}
