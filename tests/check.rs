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

/// The file may be given as the argument itself, as `--config FILE` or `-c FILE`; not both.
#[test]
fn the_file_is_taken_with_or_without_config() {
    let example = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/single.toml");
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_tokentap"))
            .args(args)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    };
    let file = example.to_str().unwrap();
    for args in [
        &["check", file][..],
        &["check", "--config", file],
        &["check", "-c", file],
    ] {
        let (ok, text) = run(args);
        assert!(ok && text.contains(": ok ("), "{args:?}: {text}");
    }
    let (ok, text) = run(&["check", "--config", file, file]);
    assert!(!ok && text.contains("cannot be used with"), "{text}");
    let (ok, text) = run(&["check"]);
    assert!(!ok && text.contains("required"), "{text}");
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

#[test]
fn five_mistakes_are_five_problems_with_their_lines_and_a_suggestion() {
    let path = std::env::temp_dir().join(format!("tokentap-five-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        "[listen]\nproxy = \"127.0.0.1:8080\"\nadmin = \"127.0.0.1:8080\"\n\
         [[upstream]]\nname = \"a\"\nurl = \"http//127.0.0.1:8000\"\nread_timout_secs = 600\n\
         max_queue = \"lots\"\n\
         [[route]]\nsplit = { a = 1, missing = 1 }\n",
    )
    .unwrap();
    let (ok, text) = check(&path);
    std::fs::remove_file(&path).ok();
    assert!(!ok, "{text}");
    for want in [
        "5 problems",
        "listen.admin: 127.0.0.1:8080 is listen.proxy's address too; give each its own (line 3)",
        "upstream[0].url: `http//127.0.0.1:8000` is not a URL like http://host:port (line 6)",
        "upstream[0].read_timout_secs: unknown key; did you mean `read_timeout_secs`? (line 7)",
        "upstream[0].max_queue: must be a whole number, not the text \"lots\" (line 8)",
        "route[0].split.missing: unknown upstream (line 10)",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
}

/// A rollout's mistakes, each with its path; a mirror to its `to` is allowed (the
/// rollout's shadow).
#[test]
fn a_rollouts_mistakes_are_named_with_their_paths() {
    let path = std::env::temp_dir().join(format!("tokentap-rollout-{}.toml", std::process::id()));
    let ups = "[[upstream]]\nname = \"a\"\nurl = \"http://127.0.0.1:8001\"\n\
               [[upstream]]\nname = \"b\"\nurl = \"http://127.0.0.1:8002\"\n\
               [[upstream]]\nname = \"c\"\nurl = \"http://127.0.0.1:8003\"\n";
    let routes = [
        r#"{ from = "a", to = "b", steps = [50, 10, 100] }"#,
        r#"{ from = "a", to = "b", steps = [10, 150] }"#,
        r#"{ from = "a", to = "a" }"#,
        r#"{ from = "a", to = "c" }"#,
        r#"{ from = "a", to = "b", max_tpot_ratio = 0.9, every_secs = 0 }"#,
        r#"{ from = "a", to = "b", steps = [10, 50] }"#,
        r#"{ from = "a", to = "b", steps = [100] }"#,
    ];
    let mut text = ups.to_owned();
    for (i, r) in routes.iter().enumerate() {
        text.push_str(&format!(
            "[[route]]\nname = \"r{i}\"\npath_prefix = \"/{i}/\"\nsplit = {{ a = 1, b = 1 }}\nrollout = {r}\n"
        ));
    }
    std::fs::write(&path, &text).unwrap();
    let (ok, out) = check(&path);
    assert!(!ok, "{out}");
    for want in [
        "route[0].rollout.steps: must increase: [50.0, 10.0, 100.0]",
        "route[1].rollout.steps: each step must be above 0 and at most 100",
        "route[2].rollout.to: is `from`",
        "route[3].rollout.to: `c` is not in the route's split",
        "route[4].rollout.max_tpot_ratio: must be between 1 and 10",
        "route[4].rollout.every_secs: must be at least 1",
        "route[5].rollout.steps: must end at 100",
        "route[6].rollout.steps: needs a step below 100 first",
    ] {
        assert!(out.contains(want), "missing {want:?} in:\n{out}");
    }
    // A mirror to the rollout's `to`, on its own route: allowed (its shadow).
    std::fs::write(
        &path,
        format!(
            "{ups}[[route]]\nsplit = {{ a = 1, b = 1 }}\nrollout = {{ from = \"a\", to = \"b\" }}\n\
             mirror = {{ upstream = \"b\", max_in_flight = 8 }}\n"
        ),
    )
    .unwrap();
    let (ok, out) = check(&path);
    assert!(ok, "{out}");
    // Another route's mirror to it is not: `b` serves real clients on route[0].
    std::fs::write(
        &path,
        format!(
            "{ups}[[route]]\npath_prefix = \"/v1/\"\nsplit = {{ a = 1, b = 1 }}\nrollout = {{ from = \"a\", to = \"b\" }}\n\
             [[route]]\nsplit = {{ c = 1 }}\nmirror = {{ upstream = \"b\" }}\n"
        ),
    )
    .unwrap();
    let (ok, out) = check(&path);
    std::fs::remove_file(&path).ok();
    assert!(
        !ok && out.contains("route[1].mirror[0].upstream: `b` is in route[0]'s split"),
        "{out}"
    );
}

/// `check` says what a rollout's shadow copies cost `to` in requests a second at each step
/// under half, the cap of `to`'s that bounds them, and that `spill` keeps the share.
#[test]
fn check_says_what_a_rollouts_copies_cost() {
    let path =
        std::env::temp_dir().join(format!("tokentap-rollout-cost-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        "[[upstream]]\nname = \"a\"\nurl = \"http://127.0.0.1:8001\"\n\
         [[upstream]]\nname = \"b\"\nurl = \"http://127.0.0.1:8002\"\nmax_concurrency = 4\n\
         [[route]]\nsplit = { a = 1, b = 1 }\nspill = true\n\
         rollout = { from = \"a\", to = \"b\", steps = [10, 25, 50, 100] }\n",
    )
    .unwrap();
    let (ok, out) = check(&path);
    std::fs::remove_file(&path).ok();
    assert!(ok, "{out}");
    for want in [
        "copies to b: 80 requests a second at 10%, 50 requests a second at 25%, \
         for every 100 a second that a and b serve (none from 50%)",
        "they take slots of b's max_concurrency = 4 when free at once, or are not sent",
        "spill: nothing spills into or out of a and b while the rollout holds a share",
    ] {
        assert!(out.contains(want), "missing {want:?} in:\n{out}");
    }
}

#[test]
fn run_refuses_an_address_in_use_before_it_says_it_is_up() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let path = std::env::temp_dir().join(format!("tokentap-taken-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        format!("[listen]\nproxy = \"{addr}\"\n[[upstream]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\n"),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tokentap"))
        .args(["run", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    std::fs::remove_file(&path).ok();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        text.contains(&format!("cannot listen on listen.proxy {addr}")),
        "{text}"
    );
    assert!(!text.contains("listening"), "{text}");
}
