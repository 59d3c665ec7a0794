//! Criterion benches of the hot codecs: data-frame headers, control frames, envelopes, tensor
//! metadata and chunk plans. `cargo bench -p tensorwire-benches --bench codecs`

use criterion::{Criterion, black_box, criterion_group, criterion_main};
use tensorwire_core::{AccessKey, ChunkPlan, DType, EngineId, RegionId, TensorMeta};
use tensorwire_proto::wire::envelope::{Envelope, Message};
use tensorwire_proto::wire::frame::{CONTROL, FrameHeader};
use tensorwire_tcp::wire::{DataHeader, Kind};

fn data_header(c: &mut Criterion) {
    let h = DataHeader::request(
        Kind::WriteReq,
        42,
        RegionId(7),
        AccessKey::from_bits(99),
        4096,
        1 << 20,
    );
    let enc = h.encode();
    c.bench_function("tcp DataHeader encode", |b| b.iter(|| black_box(black_box(&h).encode())));
    c.bench_function("tcp DataHeader decode", |b| b.iter(|| DataHeader::decode(black_box(&enc))));
}

fn control(c: &mut Criterion) {
    let f = CONTROL.header(FrameHeader { kind: 1, len: 1234 });
    c.bench_function("control FrameHeader decode", |b| {
        b.iter(|| CONTROL.decode_header(black_box(&f)))
    });
    let env =
        Envelope { from: EngineId(5), msg: Message::User(bytes::Bytes::from_static(&[1; 256])) };
    let e = env.encode().unwrap();
    c.bench_function("envelope decode (256 B user)", |b| {
        b.iter(|| Envelope::decode(black_box(&e)))
    });
}

fn tensor(c: &mut Criterion) {
    let meta = TensorMeta::contiguous(DType::BF16, &[16, 21, 60, 104]);
    let mut w = tensorwire_proto::wire::codec::Writer::new();
    meta.encode(&mut w);
    let enc = w.finish();
    c.bench_function("TensorMeta decode", |b| {
        b.iter(|| {
            let mut r = tensorwire_proto::wire::codec::Reader::new(black_box(&enc), "meta");
            TensorMeta::decode(&mut r)
        })
    });
    c.bench_function("ChunkPlan new (latent, 7 chunks on T)", |b| {
        b.iter(|| ChunkPlan::new(black_box(&meta), 1, 7))
    });
}

mod group {
    #![allow(missing_docs)]
    use super::*;
    criterion_group!(benches, data_header, control, tensor);
}
criterion_main!(group::benches);
