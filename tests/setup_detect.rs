//! tools/setup.sh --check: the detection tools/setup.sh installs by. Each
//! package must be reported exactly when what the build runs is missing
//! (a fresh Debian has no cmake, no c++, no xz, no patch, and a python3 without pip
//! or venv), and nothing when all is there. Run over a PATH of stubs.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

/// The packages `setup.sh --check` names with only `tools` on PATH; a
/// `python3` stub succeeds for the python modules in `py_modules`.
fn missing(tools: &[&str], py_modules: &[&str]) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    for t in tools {
        let body = if *t == "python3" {
            // `python3 -m pip --version` and `python3 -c 'import venv, ensurepip'`
            let ok: Vec<String> = py_modules
                .iter()
                .map(|m| match *m {
                    "pip" => "'-m pip --version') exit 0 ;;".to_string(),
                    "venv" => "'-c import venv, ensurepip') exit 0 ;;".to_string(),
                    other => panic!("no stub for {other}"),
                })
                .collect();
            format!("#!/bin/sh\ncase \"$*\" in {} esac\nexit 1\n", ok.join(" "))
        } else {
            "#!/bin/sh\nexit 0\n".to_string()
        };
        let p = dir.path().join(t);
        std::fs::write(&p, body).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/setup.sh");
    let out = Command::new("/bin/bash")
        .arg(script)
        .arg("--check")
        .env("PATH", dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

const ALL: &[&str] = &[
    "cc", "c++", "make", "cmake", "xz", "patch", "curl", "python3",
];

#[test]
fn a_complete_machine_needs_nothing() {
    assert_eq!(missing(ALL, &["pip", "venv"]), Vec::<String>::new());
}

#[test]
fn a_bare_machine_needs_everything() {
    assert_eq!(
        missing(&[], &[]),
        [
            "build-essential",
            "cmake",
            "xz-utils",
            "patch",
            "curl",
            "python3",
            "python3-pip",
            "python3-venv"
        ]
    );
}

#[test]
fn each_missing_tool_names_its_package() {
    for (gone, package) in [
        ("cc", "build-essential"),
        ("c++", "build-essential"),
        ("make", "build-essential"),
        ("cmake", "cmake"),
        ("xz", "xz-utils"),
        ("patch", "patch"),
        ("curl", "curl"),
    ] {
        let tools: Vec<&str> = ALL.iter().copied().filter(|t| *t != gone).collect();
        assert_eq!(
            missing(&tools, &["pip", "venv"]),
            [package],
            "without {gone}"
        );
    }
}

#[test]
fn python_without_pip_or_venv() {
    // Debian's python3 comes without both (python3-pip, python3-venv)
    assert_eq!(missing(ALL, &["venv"]), ["python3-pip"]);
    assert_eq!(missing(ALL, &["pip"]), ["python3-venv"]);
    assert_eq!(missing(ALL, &[]), ["python3-pip", "python3-venv"]);
}
