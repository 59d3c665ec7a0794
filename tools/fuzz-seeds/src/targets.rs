//! The fuzz targets: what input each one takes, whether a seed is a well-formed input for it,
//! and the magic numbers and tags its dictionary lists.

use tensorwire_core::EngineDescriptor;
use tensorwire_core::TensorMeta;
use tensorwire_diffusion::PayloadRef;
use tensorwire_diffusion::control::{self, Control};
use tensorwire_orchestrator::QueueMessage;
use tensorwire_orchestrator::queue;
use tensorwire_orchestrator::service::wire::{self as service, Msg};
use tensorwire_proto::wire::codec::Reader;
use tensorwire_proto::wire::envelope::Envelope;
use tensorwire_proto::wire::error::decode_error;
use tensorwire_proto::wire::frame::{CONTROL, Framing, RESERVED_KINDS};
use tensorwire_proto::wire::handshake::{CHALLENGE, Challenge, OPEN, Open, PROOF, Proof, REJECT};
use tensorwire_store::rpc::{self, Request, Response};

/// Every target of `fuzz/`, by name. Each has a corpus directory `fuzz/corpus/NAME`.
pub const TARGETS: &[&str] = &[
    "checkpoint_ref",
    "chunk_plan",
    "connector_control",
    "cuda_ipc_share",
    "discovery_entry",
    "engine_descriptor",
    "envelope",
    "error_body",
    "frame_header",
    "handshake",
    "nccl_control",
    "orchestrator_journal",
    "orchestrator_msg",
    "payload_ref",
    "queue_message",
    "rdma_blob",
    "rdma_control",
    "roundtrip",
    "shm_header",
    "store_rpc",
    "tcp_data_header",
    "tensor_meta",
    "ucx_msg",
];

/// The framings whose whole frames `frame_header` decodes.
pub const FRAMINGS: [Framing; 3] = [CONTROL, rpc::FRAMING, service::FRAMING];

/// Every protocol's framing in the workspace: each has a magic of its own, so that a connection
/// to the wrong listener is refused at its first header (and a handshake proof, which binds
/// the magic, is never valid for another protocol).
pub const ALL_FRAMINGS: [Framing; 11] = [
    CONTROL,
    rpc::FRAMING,
    service::FRAMING,
    queue::FRAMING,
    control::FRAMING,
    tensorwire_cuda::ipc::FRAMING,
    tensorwire_shm::wire::FRAMING,
    tensorwire_tcp::wire::FRAMING,
    tensorwire_ucx::wire::FRAMING,
    tensorwire_rdma::wire::FRAMING,
    tensorwire_nccl::wire::FRAMING,
];

/// Whether `input` is a well-formed input of `target` (its decoder accepts it): every seed is.
pub fn valid(target: &str, input: &[u8]) -> bool {
    let meta = |b: &[u8]| TensorMeta::decode(&mut Reader::new(b, "seed")).is_ok();
    match target {
        "checkpoint_ref" => tensorwire_diffusion::cache::CheckpointRef::decode(input).is_ok(),
        "chunk_plan" => input.len() >= 5 && meta(&input[5..]),
        "connector_control" => matches!(Control::decode(input), Ok(Some(_))),
        "cuda_ipc_share" => tensorwire_cuda::ipc::IpcShare::decode(input).is_ok(),
        "discovery_entry" => {
            tensorwire_proto::discovery::Entry::decode_value("store", "n1", input).is_ok()
        }
        "engine_descriptor" => EngineDescriptor::decode(input).is_ok(),
        "envelope" => Envelope::decode(input).is_ok(),
        "error_body" => decode_error(input).is_ok(),
        "frame_header" => FRAMINGS.iter().any(|f| f.decode(input).is_ok()),
        "handshake" => {
            Open::decode(input).is_ok()
                || Challenge::decode(input).is_ok()
                || Proof::decode(input).is_ok()
        }
        "orchestrator_journal" => {
            let r = tensorwire_orchestrator::journal::replay(input);
            r.stopped.is_none() && !r.facts.is_empty()
        }
        "orchestrator_msg" => input.split_first().is_some_and(|(&k, b)| Msg::decode(k, b).is_ok()),
        "payload_ref" => PayloadRef::from_bytes(input).is_ok(),
        "queue_message" => QueueMessage::decode(input).is_ok(),
        "rdma_blob" => input.split_first().is_some_and(|(&t, b)| match t {
            0 => tensorwire_rdma::blob::Endpoint::decode(b).is_ok(),
            _ => tensorwire_rdma::blob::RegionKeys::decode(b).is_ok(),
        }),
        "nccl_control" => input
            .split_first()
            .is_some_and(|(&k, b)| tensorwire_nccl::wire::Msg::decode(k, b).is_ok()),
        "rdma_control" => input
            .split_first()
            .is_some_and(|(&k, b)| tensorwire_rdma::wire::Msg::decode(k, b).is_ok()),
        "roundtrip" => !input.is_empty(),
        "shm_header" => tensorwire_shm::wire::Header::decode(input).is_ok(),
        "store_rpc" => store_frame(input),
        "tcp_data_header" => tensorwire_tcp::wire::DataHeader::decode(input).is_ok(),
        "tensor_meta" => meta(input),
        "ucx_msg" => tensorwire_ucx::wire::Msg::decode(input).is_ok(),
        _ => false,
    }
}

/// A whole store RPC frame: a handshake frame, a request, or a response.
fn store_frame(input: &[u8]) -> bool {
    let Ok((kind, payload)) = rpc::FRAMING.decode(input) else { return false };
    if kind >= RESERVED_KINDS {
        return true;
    }
    let Ok((_, body)) = rpc::split(payload) else { return false };
    Request::decode(kind, body).is_ok() || Response::decode(kind, body).is_ok()
}

/// The tokens of `target`'s dictionary (empty: no dictionary).
pub fn dictionary(target: &str) -> Vec<Vec<u8>> {
    let prefix = |f: &Framing| vec![f.magic[0], f.magic[1], f.version];
    let handshake_kinds = || [OPEN, CHALLENGE, PROOF, REJECT].map(|k| vec![k]).to_vec();
    match target {
        "frame_header" => {
            let mut d: Vec<_> = FRAMINGS.iter().map(prefix).collect();
            d.extend(handshake_kinds());
            d
        }
        "store_rpc" => {
            let mut d = vec![prefix(&rpc::FRAMING), vec![rpc::OK], vec![rpc::ERR]];
            d.extend(handshake_kinds());
            d
        }
        "connector_control" => vec![prefix(&control::FRAMING)],
        "cuda_ipc_share" => {
            use tensorwire_cuda::ipc::{FRAMING, KIND_LEGACY};
            vec![[prefix(&FRAMING), vec![KIND_LEGACY]].concat()]
        }
        "queue_message" => vec![prefix(&queue::FRAMING)],
        "shm_header" => vec![prefix(&tensorwire_shm::wire::FRAMING)],
        "tcp_data_header" => vec![prefix(&tensorwire_tcp::wire::FRAMING)],
        "ucx_msg" => vec![prefix(&tensorwire_ucx::wire::FRAMING)],
        "rdma_control" => vec![prefix(&tensorwire_rdma::wire::FRAMING)],
        "nccl_control" => vec![prefix(&tensorwire_nccl::wire::FRAMING)],
        _ => Vec::new(),
    }
}

/// A libFuzzer dictionary file listing `tokens`.
pub fn dictionary_file(tokens: &[Vec<u8>]) -> String {
    let mut out = String::from("# Generated by tools/fuzz-seeds from the protocol constants.\n");
    for (i, t) in tokens.iter().enumerate() {
        let quoted: String = t.iter().map(|b| format!("\\x{b:02x}")).collect();
        out.push_str(&format!("kw{i}=\"{quoted}\"\n"));
    }
    out
}

/// One well-formed cuda IPC share (a seed).
pub fn cuda_share() -> Vec<u8> {
    tensorwire_cuda::ipc::IpcShare {
        process: 0x1234_5678_9abc_def0,
        uuid: [7; 16],
        addr: 0x7f00_0000_0000,
        len: 64 << 20,
        handle: [0x5a; 64],
    }
    .encode()
}

#[cfg(test)]
mod framing_tests {
    use super::ALL_FRAMINGS;

    #[test]
    fn every_protocol_has_a_magic_of_its_own() {
        for (i, a) in ALL_FRAMINGS.iter().enumerate() {
            for b in &ALL_FRAMINGS[i + 1..] {
                assert_ne!(a.magic, b.magic, "{} and {} share a magic", a.name, b.name);
            }
        }
    }
}
