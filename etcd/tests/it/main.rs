//! The integration tests of `tensorwire-etcd`, in one test binary: a module per concern.

mod etcd;
mod feature;
