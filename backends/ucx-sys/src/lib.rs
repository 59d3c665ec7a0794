//! Raw FFI bindings to UCP (the high-level API of UCX), generated at build time against the headers
//! of the libucx installed on this machine. Only `tensorwire-ucx` uses them; everything here is
//! `unsafe` to call and documented by UCX itself (`ucp/api/ucp.h`).
//!
//! `ucp_init` is a `static inline` in the headers, so it has no symbol: [`ucp_init`] below does what
//! it does (`ucp_init_version` with the header's API version).

#![allow(non_upper_case_globals, non_camel_case_types, non_snake_case, missing_docs)]
#![allow(clippy::all, unreachable_pub, unsafe_op_in_unsafe_fn)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

/// `ucp_init` as the headers define it inline.
///
/// # Safety
/// As `ucp_init_version`: valid pointers for `params` and `context_p`; `config` null or from
/// `ucp_config_read`.
pub unsafe fn ucp_init(
    params: *const ucp_params_t,
    config: *const ucp_config_t,
    context_p: *mut ucp_context_h,
) -> ucs_status_t {
    // SAFETY: forwarded contract.
    unsafe { ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, params, config, context_p) }
}

/// Whether a `ucs_status_ptr_t` is an error (UCS_PTR_IS_ERR).
pub fn ucs_ptr_is_err(p: ucs_status_ptr_t) -> bool {
    (p as usize) >= (UCS_ERR_LAST as isize as usize)
}

/// Whether a `ucs_status_ptr_t` is a request or an error (UCS_PTR_IS_PTR is its negation + null).
pub fn ucs_ptr_is_ptr(p: ucs_status_ptr_t) -> bool {
    !p.is_null() && !ucs_ptr_is_err(p)
}

/// The status a `ucs_status_ptr_t` holds (UCS_PTR_STATUS): `UCS_INPROGRESS` for a request,
/// `UCS_OK` for null, the error otherwise.
pub fn ucs_ptr_status(p: ucs_status_ptr_t) -> ucs_status_t {
    if ucs_ptr_is_ptr(p) { UCS_INPROGRESS } else { p as isize as ucs_status_t }
}
