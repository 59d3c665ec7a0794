//! The integration tests of `tensorwire-cli`, in one test binary: a module per concern.

mod cli;
mod common;
mod etcd;
mod etcd_feature;
mod hostile;
mod netns;
mod observe;
mod secret_stays_secret;
mod serve;
