//! The whole conformance suite over the cuda backend, every region in device memory of a fake
//! GPU, exported and opened through a fake IPC driver (`tensorwire_testkit::fake_ipc`): the grants, leases,
//! Forget/Released and notification order of the same-host protocol, with every byte moved by
//! the (fake) device copier and none touched by the CPU.

use tensorwire_testkit::fake_ipc as fake;

use tensorwire_conformance::DevicePair;
use tensorwire_testkit::fake_gpu::FakeGpu;

tensorwire_conformance::conformance_tests!({
    let ipc = fake::FakeIpc::new(FakeGpu::new());
    let gpu = ipc.gpu.clone();
    let backends = ipc.clone();
    DevicePair::new(move || fake::cuda(&backends).expect("a cuda backend"), move || gpu.clone())
});
