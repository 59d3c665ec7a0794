"""A second implementation of tensorwire's cache-key format (diffusion/src/cache/keys.rs), in
plain Python from its description, checked against the test vectors the Rust implementation
checks too (diffusion/tests/cache_keys.txt): the format is what the text says."""

import hashlib
import pathlib
import struct

VECTORS = pathlib.Path(__file__).resolve().parents[2] / "diffusion" / "tests" / "cache_keys.txt"


def _s(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def _head(domain: str) -> bytes:
    return _s(domain.encode()) + bytes([1])


def embedding(encoder, version, prompt, negative, params):
    m = _head("tensorwire/embedding") + _s(encoder.encode()) + _s(version.encode())
    m += _s(prompt.encode()) + bytes([negative])
    pairs = sorted(tuple(p.split("=", 1)) for p in params.split(",")) if params else []
    m += struct.pack("<I", len(pairs))
    for k, v in pairs:
        m += _s(k.encode()) + _s(v.encode())
    return hashlib.sha256(m).hexdigest()


def cfg(model, neg, step, w, h, frames, sampler, state):
    m = _head("tensorwire/cfg") + _s(model.encode()) + bytes.fromhex(neg)
    m += struct.pack("<IIII", step, w, h, frames) + _s(sampler.encode()) + _s(bytes.fromhex(state))
    return hashlib.sha256(m).hexdigest()


def checkpoint(model, sampler, state, step, seed, guidance, w, h, frames, prompt):
    m = _head("tensorwire/checkpoint") + _s(model.encode()) + _s(sampler.encode())
    m += _s(bytes.fromhex(state)) + struct.pack("<IQ", step, seed) + struct.pack("<f", guidance)
    m += struct.pack("<III", w, h, frames) + bytes.fromhex(prompt)
    return hashlib.sha256(m).hexdigest()


def test_every_vector_matches_an_independent_implementation():
    lines = [l for l in VECTORS.read_text(encoding="utf-8").splitlines()
             if l and not l.startswith("#")]
    assert len(lines) >= 8
    for line in lines:
        f = line.split("|")
        kind, want = f[0], f[-1]
        if kind == "embedding":
            got = embedding(f[1], f[2], f[3], int(f[4]), f[5])
        elif kind == "cfg":
            got = cfg(f[1], f[2], int(f[3]), int(f[4]), int(f[5]), int(f[6]), f[7], f[8])
        else:
            got = checkpoint(f[1], f[2], f[3], int(f[4]), int(f[5]), float(f[6]), int(f[7]),
                             int(f[8]), int(f[9]), f[10])
        assert got == want, line
