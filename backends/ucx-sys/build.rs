//! Generates bindings to the UCP API of the system's libucx. The headers come from pkg-config
//! (`ucx.pc`, shipped by Debian's `libucx-dev`); bindgen needs libclang (`libclang-dev`).

use std::env;
use std::path::PathBuf;

const HELP: &str = "tensorwire-ucx-sys needs the UCX development files and libclang: on Debian or \
Ubuntu run `apt-get install libucx-dev ucx-utils libclang-dev` (or build without the `ucx` feature)";

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    let lib = match pkg_config::Config::new().atleast_version("1.10").probe("ucx") {
        Ok(lib) => lib,
        Err(e) => panic!("\n\n{HELP}\n\npkg-config could not find `ucx`: {e}\n"),
    };
    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function("ucp_.*")
        .allowlist_function("ucs_status_string")
        .allowlist_type("ucp_.*")
        .allowlist_type("ucs_status_t")
        .allowlist_var("UCP_.*")
        .allowlist_var("UCS_.*")
        .blocklist_function("ucp_.*_nb$")
        .blocklist_function("ucp_.*_nbi$")
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false);
    for dir in &lib.include_paths {
        builder = builder.clang_arg(format!("-I{}", dir.display()));
    }
    let bindings = match builder.generate() {
        Ok(b) => b,
        Err(e) => panic!("\n\n{HELP}\n\nbindgen failed on the UCX headers: {e}\n"),
    };
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
    bindings.write_to_file(out.join("bindings.rs")).expect("write bindings.rs");
}
