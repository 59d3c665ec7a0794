//! The integration tests of `tensorwire-tcp`, in one test binary: a module per concern.

mod checksum;
mod conformance;
mod device;
mod device_conformance;
mod faults;
mod notify_order;
mod read_notice;
mod send_now;
mod strangers;
mod striping;
mod two_process;

tensorwire_conformance::children! { "engine" => two_process::child }
