//! `tokentap check`: every example in config/ passes; a broken file gets every problem named.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

fn check(path: &std::path::Path) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tokentap"))
        .args(["check", "--config"])
        .arg(path)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn every_example_config_is_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut n = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let (ok, text) = check(&path);
            assert!(ok, "{}: {text}", path.display());
            assert!(text.contains(": ok ("), "{text}");
            n += 1;
        }
    }
    assert!(n >= 2, "config/ holds the examples");
}

#[test]
fn a_broken_config_names_each_problem() {
    let path = std::env::temp_dir().join(format!("tokentap-broken-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        "[[upstream]]\nname = \"a\"\nurl = \"127.0.0.1:8000\"\n[[upstream]]\nname = \"b\"\nurl = \"http://127.0.0.1:8001\"\n\
         [[route]]\nsplit = { \"a\" = 0, \"c\" = 0 }\n",
    )
    .unwrap();
    let (ok, text) = check(&path);
    std::fs::remove_file(&path).ok();
    assert!(!ok);
    for want in [
        "3 problems",
        "upstream[0].url:",
        "route[0].split.c: unknown upstream",
        "route[0].split: total weight is 0",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
    let (ok, text) = check(std::path::Path::new("/nonexistent/tokentap.toml"));
    assert!(!ok && text.contains("cannot read"), "{text}");
}
