//! Without the `etcd` feature the etcd tests are not built, and `--etcd` is one clear line.

#[test]
fn without_the_etcd_feature_etcd_options_say_how_to_get_it() {
    if cfg!(feature = "etcd") {
        return; // tests/it/etcd.rs runs instead
    }
    eprintln!("SKIPPED: the etcd cluster tests: {}", tensorwire_etcd::DISABLED);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args(["worker", "--role", "decode", "--etcd", "http://127.0.0.1:1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("feature `etcd`") && err.contains("protoc"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}
