//! The C API from C: the committed header is what cbindgen generates from the source,
//! and the example program (examples/example.c) builds against it, runs under
//! valgrind without errors or leaks, and leaves an image `e2fsck -fn` finds clean and
//! the kernel reads.

use std::path::{Path, PathBuf};
use std::process::Command;

use rext4_testkit::{e2fsck_fn, skip, LoopMount, TempDir};

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// target/<profile>/, where `cargo build -p rext4-c` puts librext4.so.
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/c_api-HASH
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>")
        .to_path_buf()
}

fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool} >/dev/null")])
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn header_is_current() {
    if !have("cbindgen") {
        skip("cbindgen not installed (cargo install cbindgen --locked)");
        return;
    }
    let dir = TempDir::new("rext4-h").expect("temp dir");
    let fresh = dir.join("rext4.h");
    let out = Command::new("cbindgen")
        .arg("--config")
        .arg(crate_dir().join("cbindgen.toml"))
        .arg("--output")
        .arg(&fresh)
        .arg(crate_dir().join("src/lib.rs"))
        .output()
        .expect("run cbindgen");
    assert!(
        out.status.success(),
        "cbindgen failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let committed =
        std::fs::read_to_string(crate_dir().join("include/rext4.h")).expect("read header");
    let generated = std::fs::read_to_string(&fresh).expect("read generated header");
    assert!(
        committed == generated,
        "bindings/c/include/rext4.h is stale: regenerate it with\n  cbindgen --config \
         bindings/c/cbindgen.toml --output bindings/c/include/rext4.h bindings/c/src/lib.rs\n\
         generated:\n{generated}"
    );
}

#[test]
fn example_builds_and_runs_clean_under_valgrind() {
    for tool in ["cc", "valgrind"] {
        if !have(tool) {
            skip(&format!("{tool} not installed"));
            return;
        }
    }
    let lib = lib_dir();
    assert!(
        lib.join("librext4.so").exists(),
        "{} missing: `cargo test` does not build the cdylib; run `cargo build -p rext4-c` \
         first (scripts/test.sh does)",
        lib.join("librext4.so").display()
    );
    let dir = TempDir::new("rext4-c").expect("temp dir");
    let exe = dir.join("example");
    let out = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-g", "-I"])
        .arg(crate_dir().join("include"))
        .arg(crate_dir().join("examples/example.c"))
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(&lib)
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-lrext4")
        .output()
        .expect("run cc");
    assert!(
        out.status.success(),
        "the example does not build against the header:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let img = dir.join("c.img");
    let out = Command::new("valgrind")
        .args([
            "--error-exitcode=99",
            "--leak-check=full",
            "--errors-for-leak-kinds=definite,indirect",
            "--show-leak-kinds=definite,indirect",
            "--quiet",
        ])
        .arg(&exe)
        .arg(&img)
        .output()
        .expect("run valgrind");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.code() == Some(0),
        "the example failed under valgrind (status {:?}):\n{stdout}\n{stderr}",
        out.status.code()
    );
    assert!(stdout.ends_with("ok\n"), "{stdout}");
    assert!(
        stdout.contains("/etc/data: mode 100640 size 1048578"),
        "{stdout}"
    );
    let fsck = e2fsck_fn(&img);
    assert!(
        fsck.clean,
        "e2fsck -fn after the C example:\n{}",
        fsck.output
    );
    // The kernel reads what the C program wrote.
    match LoopMount::new(&img, true, "") {
        Ok(m) => {
            let data = std::fs::read(m.path().join("etc/data")).expect("read through the kernel");
            assert_eq!(data.len(), 16 * 65536 + 2);
            assert!(data[..65536]
                .iter()
                .enumerate()
                .all(|(i, &b)| b == (i * 7 % 251) as u8));
            assert_eq!(&data[16 * 65536..], b"ta");
            assert_eq!(
                std::fs::read(m.path().join("tmp/name")).expect("read"),
                b"rext4\n"
            );
        }
        Err(why) => skip(&why),
    }
}
