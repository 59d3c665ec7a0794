"""A second implementation of tensorwire's cache-key format (diffusion/src/cache/keys.rs), in
plain Python from its description, checked against the test vectors the Rust implementation
checks too (diffusion/tests/it/cache_keys.txt): the format is what the text says. The embedding key
is the package's own (tensorwire.pipelines.cache, which the embedding cache uses); cfg and
checkpoint keys are computed here."""

import hashlib
import pathlib
import struct

from tensorwire.pipelines.cache import embedding_key

VECTORS = pathlib.Path(__file__).resolve().parents[2] / "diffusion" / "tests" / "it" / "cache_keys.txt"


def _s(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def _head(domain: str) -> bytes:
    return _s(domain.encode()) + bytes([1])


def embedding(encoder, version, prompt, negative, params):
    pairs = [tuple(p.split("=", 1)) for p in params.split(",")] if params else []
    return embedding_key(encoder, version, prompt, bool(negative), pairs)


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
