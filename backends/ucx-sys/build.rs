//! Generates bindings to the UCP API of the system's libucx. The headers come from pkg-config
//! (`ucx.pc`, shipped by Debian's `libucx-dev`); bindgen needs libclang (`libclang-dev`).

use std::env;
use std::path::PathBuf;

const HELP: &str = "tensorwire-ucx-sys needs the UCX development files and libclang: on Debian or \
Ubuntu run `apt-get install libucx-dev ucx-utils libclang-dev` (or build without the `ucx` feature)";

/// The UCP calls tensorwire-ucx makes (plus `ucp_init_version`, behind the inline `ucp_init`).
const USED: &[&str] = &[
    "ucp_am_send_nbx",
    "ucp_cleanup",
    "ucp_config_modify",
    "ucp_config_read",
    "ucp_config_release",
    "ucp_ep_close_nbx",
    "ucp_ep_create",
    "ucp_ep_flush_nbx",
    "ucp_ep_rkey_unpack",
    "ucp_get_nbx",
    "ucp_get_version_string",
    "ucp_init_version",
    "ucp_mem_map",
    "ucp_mem_query",
    "ucp_mem_unmap",
    "ucp_put_nbx",
    "ucp_request_check_status",
    "ucp_request_free",
    "ucp_rkey_buffer_release",
    "ucp_rkey_destroy",
    "ucp_rkey_pack",
    "ucp_rkey_ptr",
    "ucp_worker_arm",
    "ucp_worker_create",
    "ucp_worker_destroy",
    "ucp_worker_get_address",
    "ucp_worker_get_efd",
    "ucp_worker_progress",
    "ucp_worker_release_address",
    "ucp_worker_set_am_recv_handler",
    "ucs_status_string",
];

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    let lib = match pkg_config::Config::new().atleast_version("1.10").probe("ucx") {
        Ok(lib) => lib,
        Err(e) => panic!("\n\n{HELP}\n\npkg-config could not find `ucx`: {e}\n"),
    };
    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function(USED.join("|"))
        // The parameter structs' field masks, flags and enums that go with them.
        .allowlist_type("ucp_.*")
        .allowlist_type("ucs_status_t")
        .allowlist_var("UCP_.*")
        .allowlist_var("UCS_.*")
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
