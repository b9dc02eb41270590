//! Builds the vendored ggml and llama.cpp (vendor/llama.cpp.tar.xz) with
//! cmake and puts the shared libraries and backend modules next to the
//! binaries (target/<profile>/), where strata loads them at run time.
//!
//! - core: libggml-base, libggml and libllama, with no backend inside
//!   (GGML_BACKEND_DL: every backend is a module loaded at run time);
//! - CPU: one module per ggml CPU variant chosen by STRATA_CPU_VARIANTS:
//!   `native` (default: the best variant for the CPU building it), `all`
//!   (ggml's whole x86 set, for binaries that travel), `portable` (a small
//!   set spanning old to current x86), or a comma-separated list of ggml's
//!   variant names (x64, haswell, zen4, ...);
//! - CUDA (feature `cuda`, when nvcc is present): libggml-cuda.so built by
//!   tools/build-cuda-module.sh, the script a GPU machine without Rust uses,
//!   for the architectures in STRATA_CUDA_ARCHS (default 90);
//! - the C shim (shim/) with `cc`; the bindings with bindgen only under the
//!   `bindgen` feature (src/bindings.rs is committed);
//! - llama.cpp's JSON-schema-to-grammar converter from
//!   vendor/llama-common.tar.xz (a part of the same tree's common/ library)
//!   with its C entry shim/json_schema.cpp, as a static library.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

type Result<T> = std::result::Result<T, String>;

/// `portable`: baseline x86-64, then the server generations: AVX2,
/// AVX-512, AVX-512 with VNNI, Zen 4, Sapphire Rapids (AMX).
const PORTABLE: &[&str] = &[
    "x64",
    "haswell",
    "skylakex",
    "icelake",
    "zen4",
    "sapphirerapids",
];

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        println!("cargo:warning=strata-ffi: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").map_err(|e| e.to_string())?);
    let root = manifest
        .parent()
        .ok_or("ffi/ has no parent directory")?
        .to_path_buf();
    let out = PathBuf::from(env::var("OUT_DIR").map_err(|e| e.to_string())?);
    let archive = root.join("vendor/llama.cpp.tar.xz");
    for p in [
        "build.rs",
        "wrapper.h",
        "shim/shim.c",
        "shim/shim.h",
        "shim/json_schema.cpp",
    ] {
        println!("cargo:rerun-if-changed={}", manifest.join(p).display());
    }
    let common = root.join("vendor/llama-common.tar.xz");
    for p in [&archive, &common] {
        println!("cargo:rerun-if-changed={}", p.display());
    }
    println!(
        "cargo:rerun-if-changed={}",
        root.join("vendor/llama.cpp.tar.xz.sha256").display()
    );
    for p in [
        "tools/build-cuda-module.sh",
        "vendor/source.sh",
        "vendor/patches",
    ] {
        println!("cargo:rerun-if-changed={}", root.join(p).display());
    }
    println!("cargo:rerun-if-env-changed=STRATA_CPU_VARIANTS");
    println!("cargo:rerun-if-env-changed=STRATA_CUDA_ARCHS");
    if env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux")
        || env::var("CARGO_CFG_TARGET_ARCH").as_deref() != Ok("x86_64")
    {
        return Err("strata builds for x86_64 Linux only".into());
    }

    let src = unpack(&root, &archive, &out)?;
    let variants = select_variants(&src)?;
    // the two cmake builds side by side: each has serial stretches
    // (configure, the final links) the other fills; both take their jobs
    // from cargo's jobserver, so together they use the cores cargo allows
    let (core, cpu) = std::thread::scope(|s| {
        let core = s.spawn(|| build_core(&src, &out));
        let cpu = build_cpu(&src, &out, &variants);
        let core = core
            .join()
            .unwrap_or_else(|_| Err("the core build panicked".into()));
        Ok::<_, String>((core?, cpu?))
    })?;
    let bin = profile_dir(&out)?;
    install(&core, &cpu, &bin)?;
    if cfg!(feature = "cuda") {
        build_cuda(&root, &bin)?;
    }
    println!(
        "cargo:rustc-env=STRATA_CPU_VARIANTS_BUILT={}",
        variants.join(",")
    );

    cc::Build::new()
        .file(manifest.join("shim/shim.c"))
        .include(src.join("include"))
        .include(src.join("ggml/include"))
        .warnings(true)
        .compile("strata_shim");
    build_json_schema(&manifest, &src, &common, &out)?;
    println!("cargo:rustc-link-search=native={}", core.display());
    for lib in ["llama", "ggml", "ggml-base", "dl"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
    // the directory with the libraries and modules, for dependents' build scripts
    println!("cargo:lib_dir={}", bin.display());
    #[cfg(feature = "bindgen")]
    bindings(&manifest, &src, &out)?;
    Ok(())
}

/// llama.cpp's JSON-schema-to-grammar converter (vendor/llama-common.tar.xz,
/// unpacked beside the main source) and its C entry, as a static library.
fn build_json_schema(manifest: &Path, src: &Path, archive: &Path, out: &Path) -> Result<()> {
    let dir = out.join("llama-common");
    let _ = fs::remove_dir_all(&dir);
    untar(archive, &dir)?;
    let common = dir.join("common");
    let mut b = cc::Build::new();
    b.cpp(true)
        .std("c++17")
        .opt_level(2)
        .debug(false)
        .warnings(false)
        .include(&common)
        .include(dir.join("vendor"))
        .include(src.join("include"))
        .include(src.join("ggml/include"))
        .file(manifest.join("shim/json_schema.cpp"));
    for f in [
        "json-schema-to-grammar",
        "json-schema",
        "json",
        "trie",
        "unicode",
    ] {
        b.file(common.join(format!("{f}.cpp")));
    }
    b.compile("strata_json_schema");
    Ok(())
}

/// Unpacks the xz tarball `archive` into `dir` (made if missing). Every
/// file gets the time of unpacking (`-m`), not the archive's: a tree
/// unpacked afresh because a patch was dropped would otherwise be older
/// than the objects built from the patched one, and make would keep them.
fn untar(archive: &Path, dir: &Path) -> Result<()> {
    fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    run_cmd(
        Command::new("tar")
            .arg("-C")
            .arg(dir)
            .arg("-m")
            .arg("-xJf")
            .arg(archive),
        "tar (is xz-utils installed?)",
    )
}

/// Extracts the archive into OUT_DIR and applies vendor/patches/ once per
/// source identity (vendor/source.sh: the archive's checksum and the
/// patches'), the way tools/build-cuda-module.sh prepares it.
fn unpack(root: &Path, archive: &Path, out: &Path) -> Result<PathBuf> {
    let source = root.join("vendor/source.sh");
    let id = Command::new("bash")
        .arg(&source)
        .arg("id")
        .output()
        .map_err(|e| format!("{}: {e}", source.display()))?;
    if !id.status.success() {
        return Err(format!("{} id failed", source.display()));
    }
    let id = String::from_utf8_lossy(&id.stdout).trim().to_string();
    let src = out.join("llama.cpp");
    let stamp = out.join("llama.cpp.id");
    if fs::read_to_string(&stamp).ok().as_deref() == Some(id.as_str()) && src.is_dir() {
        return Ok(src);
    }
    let _ = fs::remove_file(&stamp);
    let _ = fs::remove_dir_all(&src);
    untar(archive, &src)?;
    run_cmd(
        Command::new("bash").arg(&source).arg("apply").arg(&src),
        "vendor/source.sh apply (is patch installed?)",
    )?;
    fs::write(&stamp, &id).map_err(|e| format!("{}: {e}", stamp.display()))?;
    Ok(src)
}

/// Options every configuration shares: shared libraries, backends as
/// modules, no llama.cpp programs, no OpenMP (ggml's own thread pool), and
/// the optimized build types without debug information (the same code as
/// with it; debug information made the C++ compile the slowest step of a
/// first build).
fn config(src: &Path, out: &Path) -> cmake::Config {
    let mut c = cmake::Config::new(src);
    for lang in ["C", "CXX"] {
        c.define(format!("CMAKE_{lang}_FLAGS_RELWITHDEBINFO"), "-O2 -DNDEBUG");
    }
    c.out_dir(out)
        .define("BUILD_SHARED_LIBS", "ON")
        .define("GGML_BACKEND_DL", "ON")
        .define("GGML_NATIVE", "OFF")
        .define("GGML_OPENMP", "OFF")
        .define("GGML_CCACHE", "OFF")
        .define("LLAMA_BUILD_COMMON", "OFF")
        .define("LLAMA_BUILD_TESTS", "OFF")
        .define("LLAMA_BUILD_EXAMPLES", "OFF")
        .define("LLAMA_BUILD_TOOLS", "OFF")
        .define("LLAMA_BUILD_SERVER", "OFF")
        .define("LLAMA_BUILD_APP", "OFF")
        .define("LLAMA_CURL", "OFF")
        .define("LLAMA_OPENSSL", "OFF");
    c
}

/// libggml-base, libggml and libllama, and of the backends only ggml's RPC
/// module (libggml-rpc.so: remote devices, and the server offering local
/// ones); returns where they are.
fn build_core(src: &Path, out: &Path) -> Result<PathBuf> {
    let dir = out.join("core");
    config(src, &dir)
        .define("GGML_CPU", "OFF")
        .define("GGML_RPC", "ON")
        // no RDMA transport, whatever the build machine has installed
        .define("GGML_RPC_RDMA", "OFF")
        .build_target("llama")
        .build();
    Ok(dir.join("build/bin"))
}

/// ggml's x86 CPU variants and their features, as its CMakeLists lists them.
fn ggml_variants(src: &Path) -> Result<Vec<(String, Vec<String>)>> {
    let path = src.join("ggml/src/CMakeLists.txt");
    let text = fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    // the x86 branch of the `if (GGML_CPU_ALL_VARIANTS)` arch switch
    for (start, _) in text.match_indices("GGML_SYSTEM_ARCH STREQUAL \"x86\"") {
        let block = &text[start..];
        let block = &block[..block.find("elseif").unwrap_or(block.len())];
        let mut out = Vec::new();
        for line in block.lines() {
            let Some(rest) = line.trim().strip_prefix("ggml_add_cpu_backend_variant(") else {
                continue;
            };
            let mut words = rest
                .trim_end_matches(')')
                .split_whitespace()
                .map(str::to_string);
            if let Some(name) = words.next() {
                out.push((name, words.collect()));
            }
        }
        if !out.is_empty() {
            return Ok(out);
        }
    }
    Err(format!("{}: no x86 variant list", path.display()))
}

/// The /proc/cpuinfo flags a ggml feature needs (ggml's cpu-feats.cpp checks).
fn cpuinfo_flags(feature: &str) -> Option<&'static [&'static str]> {
    Some(match feature {
        "SSE42" => &["sse4_2"],
        "AVX" => &["avx"],
        "F16C" => &["f16c"],
        "FMA" => &["fma"],
        "AVX2" => &["avx2"],
        "BMI2" => &["bmi2"],
        "AVX_VNNI" => &["avx_vnni"],
        "AVX512" => &["avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"],
        "AVX512_VBMI" => &["avx512vbmi"],
        "AVX512_VNNI" => &["avx512_vnni"],
        "AVX512_BF16" => &["avx512_bf16"],
        "AMX_TILE" => &["amx_tile"],
        "AMX_INT8" => &["amx_int8"],
        _ => return None,
    })
}

/// The variant for this CPU: the one with the most features it has.
fn native_variant(all: &[(String, Vec<String>)]) -> String {
    let info = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags: Vec<&str> = info
        .lines()
        .find(|l| l.starts_with("flags"))
        .map(|l| l.split_whitespace().collect())
        .unwrap_or_default();
    let has = |f: &str| cpuinfo_flags(f).is_some_and(|need| need.iter().all(|n| flags.contains(n)));
    all.iter()
        .filter(|(_, feats)| feats.iter().all(|f| has(f)))
        .max_by_key(|(_, feats)| feats.len())
        .map(|(n, _)| n.clone())
        .unwrap_or_else(|| "x64".into())
}

fn select_variants(src: &Path) -> Result<Vec<String>> {
    let all = ggml_variants(src)?;
    let want = env::var("STRATA_CPU_VARIANTS").unwrap_or_default();
    let names: Vec<String> = match want.trim() {
        "" | "native" => vec![native_variant(&all)],
        "all" => all.iter().map(|(n, _)| n.clone()).collect(),
        "portable" => PORTABLE.iter().map(|s| s.to_string()).collect(),
        list => list
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect(),
    };
    for n in &names {
        if !all.iter().any(|(a, _)| a == n) {
            let known: Vec<&str> = all.iter().map(|(a, _)| a.as_str()).collect();
            return Err(format!(
                "STRATA_CPU_VARIANTS names `{n}`, not a ggml CPU variant (native, all, portable, or some of: {})",
                known.join(", ")
            ));
        }
    }
    Ok(names)
}

/// One module per variant, from a configuration with all of ggml's
/// variants where only the chosen targets are built.
fn build_cpu(src: &Path, out: &Path, variants: &[String]) -> Result<Vec<PathBuf>> {
    let dir = out.join("cpu");
    let targets: Vec<String> = variants.iter().map(|v| format!("ggml-cpu-{v}")).collect();
    let build = config(src, &dir)
        .define("GGML_CPU", "ON")
        .define("GGML_CPU_ALL_VARIANTS", "ON")
        .build_target(&targets[0])
        .build()
        .join("build");
    if targets.len() > 1 {
        let jobs = env::var("NUM_JOBS").unwrap_or_else(|_| "2".into());
        let mut cmd = Command::new(env::var("CMAKE").unwrap_or_else(|_| "cmake".into()));
        cmd.arg("--build")
            .arg(&build)
            .arg("--config")
            .arg(profile_name())
            .arg("-j")
            .arg(&jobs);
        cmd.arg("--target").args(&targets[1..]);
        run_cmd(&mut cmd, "cmake --build (CPU variants)")?;
    }
    Ok(targets
        .iter()
        .map(|t| build.join("bin").join(format!("lib{t}.so")))
        .collect())
}

/// The cmake crate's build type for this cargo profile (it configured with it).
fn profile_name() -> &'static str {
    let opt = env::var("OPT_LEVEL").unwrap_or_default();
    let debug = env::var("DEBUG")
        .map(|d| d != "false" && d != "0")
        .unwrap_or(false);
    match (opt.as_str(), debug) {
        ("0", _) => "Debug",
        ("s" | "z", _) => "MinSizeRel",
        (_, true) => "RelWithDebInfo",
        _ => "Release",
    }
}

/// target/<profile>/ (OUT_DIR is target/<profile>/build/strata-ffi-*/out).
fn profile_dir(out: &Path) -> Result<PathBuf> {
    out.ancestors()
        .nth(3)
        .map(Path::to_path_buf)
        .ok_or_else(|| format!("unexpected OUT_DIR {}", out.display()))
}

/// Copies the libraries under their SONAME (what the binaries load) and the
/// chosen CPU modules next to the binaries; CPU modules of an earlier
/// selection are removed, so the loader cannot pick one of them.
fn install(core: &Path, cpu: &[PathBuf], bin: &Path) -> Result<()> {
    fs::create_dir_all(bin).map_err(|e| format!("{}: {e}", bin.display()))?;
    let mut files: Vec<(PathBuf, String)> = [
        "libggml-base.so.0",
        "libggml.so.0",
        "libllama.so.0",
        "libggml-rpc.so",
    ]
    .iter()
    .map(|n| (core.join(n), n.to_string()))
    .collect();
    for m in cpu {
        let name = m
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        files.push((m.clone(), name));
    }
    if let Ok(rd) = fs::read_dir(bin) {
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.starts_with("libggml-cpu")
                && n.ends_with(".so")
                && !files.iter().any(|(_, f)| *f == n)
            {
                let _ = fs::remove_file(e.path());
            }
        }
    }
    for (from, name) in files {
        // copy then rename, so a running program that has the old file
        // mapped keeps a valid mapping; fs::copy follows the SONAME links
        let tmp = bin.join(format!(".{name}.tmp"));
        fs::copy(&from, &tmp)
            .and_then(|_| fs::rename(&tmp, bin.join(&name)))
            .map_err(|e| format!("copying {} to {}: {e}", from.display(), bin.display()))?;
    }
    Ok(())
}

/// The CUDA module, built the way a GPU machine without Rust builds it.
fn build_cuda(root: &Path, bin: &Path) -> Result<()> {
    let nvcc = env::var("CUDACXX").ok().map(PathBuf::from).or_else(|| {
        let p = PathBuf::from("/usr/local/cuda/bin/nvcc");
        p.exists().then_some(p)
    });
    let on_path = Command::new("nvcc").arg("--version").output().is_ok();
    if nvcc.is_none() && !on_path {
        println!("cargo:warning=strata-ffi: feature cuda, but no nvcc (PATH, CUDACXX or /usr/local/cuda): the CUDA module is not built");
        return Ok(());
    }
    let archs = env::var("STRATA_CUDA_ARCHS").unwrap_or_else(|_| "90".into());
    let out = PathBuf::from(env::var("OUT_DIR").map_err(|e| e.to_string())?);
    let mut cmd = Command::new("bash");
    cmd.arg(root.join("tools/build-cuda-module.sh"))
        .arg(bin)
        .arg(&archs);
    cmd.env("STRATA_CUDA_BUILD", out.join("cuda"));
    if let Some(n) = nvcc {
        if let Some(dir) = n.parent() {
            let path = env::var("PATH").unwrap_or_default();
            cmd.env("PATH", format!("{}:{path}", dir.display()));
        }
    }
    run_cmd(&mut cmd, "tools/build-cuda-module.sh")
}

#[cfg(feature = "bindgen")]
fn bindings(manifest: &Path, src: &Path, out: &Path) -> Result<()> {
    let b = bindgen::Builder::default()
        .header(manifest.join("wrapper.h").to_string_lossy())
        .clang_arg(format!("-I{}", src.join("include").display()))
        .clang_arg(format!("-I{}", src.join("ggml/include").display()))
        .clang_arg(format!("-I{}", manifest.display()))
        .derive_partialeq(true)
        .allowlist_item("ggml_.*")
        .allowlist_item("gguf_.*")
        .allowlist_item("llama_.*")
        .allowlist_item("strata_.*")
        .allowlist_recursively(false)
        .raw_line("type FILE = ::std::os::raw::c_void;")
        .prepend_enum_name(false)
        .generate()
        .map_err(|e| format!("bindgen: {e}"))?;
    b.write_to_file(out.join("bindings.rs"))
        .map_err(|e| format!("bindings.rs: {e}"))
}

fn run_cmd(cmd: &mut Command, what: &str) -> Result<()> {
    let st = cmd.status().map_err(|e| format!("{what}: {e}"))?;
    if !st.success() {
        return Err(format!("{what} failed ({st})"));
    }
    Ok(())
}
