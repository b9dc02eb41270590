//! Puts the ggml backend modules next to the binaries and gives them an
//! rpath, so `strata` finds libggml-base/libggml/libllama and its backends
//! without LD_LIBRARY_PATH.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=vendor/ggml-src.tar.xz.sha256");
    // the ggml source identity a backend module's stamp must name
    let sha = std::fs::read_to_string("vendor/ggml-src.tar.xz.sha256").unwrap_or_default();
    println!("cargo:rustc-env=STRATA_GGML_SRC_SHA256={}", sha.trim());
    // $ORIGIN and $ORIGIN/..: binaries in target/<profile>/, tests and examples one level down;
    // the shared libraries and backend modules are copied into target/<profile>/.
    println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN");
    println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN/..");

    let Ok(backends) = std::env::var("DEP_LLAMA_BACKENDS_DIR") else {
        println!("cargo:warning=llama-cpp-sys-2 did not report a backends directory");
        return;
    };
    // OUT_DIR = target/<profile>/build/strata-*/out
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let Some(profile_dir) = out.ancestors().nth(3).map(PathBuf::from) else {
        return;
    };
    let backends = PathBuf::from(backends);
    let mut sources = vec![backends.clone()];
    if let Some(out) = backends.parent() {
        sources.push(out.join("lib"));
        sources.push(out.join("lib64"));
    }
    for src in sources {
        let Ok(rd) = std::fs::read_dir(&src) else {
            continue;
        };
        for e in rd.flatten() {
            let name = e.file_name();
            let n = name.to_string_lossy();
            if !(n.starts_with("lib") && n.contains(".so")) {
                continue;
            }
            {
                let dir = profile_dir.clone();
                let _ = std::fs::create_dir_all(&dir);
                let dst = dir.join(&name);
                // fs::copy follows symlinks, so SONAME links become files;
                // copy then rename, so a running program that has the old
                // file mapped keeps a valid mapping
                let tmp = dir.join(format!(".{n}.tmp"));
                if let Err(err) =
                    std::fs::copy(e.path(), &tmp).and_then(|_| std::fs::rename(&tmp, &dst))
                {
                    println!(
                        "cargo:warning=could not copy {} to {}: {err}",
                        e.path().display(),
                        dst.display()
                    );
                }
            }
        }
    }
}
