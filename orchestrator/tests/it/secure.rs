//! Secure by default, the orchestrator service: a reachable address needs a cluster secret or an
//! explicit `insecure` opt-out, and a client without the secret is refused before it is welcomed
//! (so it is never assigned work, whose inputs carry payload references and their keys).

use tensorwire_core::ClusterSecret;
use tensorwire_orchestrator::Stage;
use tensorwire_orchestrator::service::wire::{FRAMING, Msg, Role};
use tensorwire_orchestrator::service::{OrchestratorService, ServiceConfig};
use tensorwire_testkit::intruder::{Claim, assert_refused, frames_received};

fn secret() -> Option<ClusterSecret> {
    Some(ClusterSecret::new("0123456789abcdef0123456789abcdef"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reachable_service_needs_a_secret_or_insecure() {
    let anywhere = "0.0.0.0:0".parse().unwrap();
    let e = OrchestratorService::serve(anywhere, ServiceConfig::default()).await.unwrap_err();
    assert!(e.to_string().contains("cluster secret"), "{e}");
    let insecure = ServiceConfig { insecure: true, ..ServiceConfig::default() };
    OrchestratorService::serve(anywhere, insecure).await.unwrap();
    let secured = ServiceConfig { secret: secret(), ..ServiceConfig::default() };
    OrchestratorService::serve(anywhere, secured).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_the_secret_is_never_welcomed() {
    let cfg = ServiceConfig { secret: secret(), ..ServiceConfig::default() };
    let s = OrchestratorService::serve("127.0.0.1:0".parse().unwrap(), cfg).await.unwrap();
    let role = Role::Worker {
        stage: Stage::Decode,
        slots: 4,
        host: "x".into(),
        labels: vec![],
        can: vec![],
        switched: None,
    };
    let (kind, body) = Msg::Hello { role }.encode_body();
    for claim in [Claim::WrongProof, Claim::NoProof] {
        let frames = frames_received(s.addr(), &FRAMING, claim, (kind, &body)).await;
        assert_refused("orchestrator service", &frames, None);
    }
}
