//! Without the `etcd` feature the etcd tests are not built: say so instead of passing silently.

#[test]
fn etcd_tests_need_the_etcd_feature() {
    if !tensorwire_etcd::ENABLED {
        eprintln!("SKIPPED: the etcd tests: {}", tensorwire_etcd::DISABLED);
    }
}
