"""The vLLM-Omni connector among neighbours: a record carries data, never code (a planted record
whose old format would have run code runs nothing), the skeleton's decoder is total, and the
per-user rendezvous folder is private and survives a squatter."""

import base64
import json
import logging
import os
import pickle
import random
import uuid

import numpy as np
import pytest

from tensorwire.omni import TensorwireConnector as C
from tensorwire.omni import host_records, packing, skeleton
from tensorwire.omni.host_records import HostRecords
from tensorwire.omni.store_records import StoreRecords


class _Planted:
    """What an attacker pickles: unpickling it creates ``path``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _record(key, put_key, skeleton_bytes, version):
    return {
        "tensorwire": version, "key": key, "put_key": put_key, "from": "a", "to": "b",
        "generation": uuid.uuid4().hex, "handles": [], "size": 1, "consumers": 1, "expires": None,
        "skeleton": base64.b64encode(skeleton_bytes).decode(),
    }


@pytest.mark.parametrize("version", [1, 2])
def test_a_planted_pickle_record_runs_nothing(tmp_path, caplog, version):
    marker = tmp_path / "ran"
    put_key = f"req-{uuid.uuid4().hex[:8]}"
    key = C._make_key(put_key, "a", "b")
    evil = pickle.dumps({"x": _Planted(str(marker))})
    HostRecords(str(tmp_path)).write(_record(key, put_key, evil, version))
    with C({"registry_dir": str(tmp_path)}) as consumer, caplog.at_level(logging.WARNING, "tensorwire.omni"):
        assert consumer.get("a", "b", put_key) is None
        # Handed over as the put's metadata (the adapter's queue message) it runs nothing either.
        assert consumer.get("a", "b", put_key, _record(key, put_key, evil, version)) is None
    assert not marker.exists(), "a record's skeleton ran code in the consumer"
    assert ("format 1" in caplog.text) if version == 1 else ("not a skeleton" in caplog.text), caplog.text


def test_a_planted_record_in_the_store_runs_nothing(store_node, tmp_path):
    _, store, node = store_node
    marker = tmp_path / "ran"
    put_key = f"req-{uuid.uuid4().hex[:8]}"
    key = C._make_key(put_key, "a", "b")
    StoreRecords(store, 10.0).write(_record(key, put_key, pickle.dumps(_Planted(str(marker))), 1))
    with C({"store_address": node.address}) as consumer:
        assert consumer.get("a", "b", put_key) is None
    assert not marker.exists()


def test_every_kind_of_value_round_trips_as_itself(tmp_path):
    point = np.dtype([("x", "<f4"), ("n", ">i2", (2,))])
    data = {
        "none": None, "flags": [True, False], "int": -(1 << 100), "float": -0.0, "nan": float("nan"),
        "inf": (float("inf"), float("-inf")), "text": "ünï\x00code", "bytes": b"\x00\xff",
        "bytearray": bytearray(b"ab"), "complex": 1.5 - 2j, "set": {1, "a", (2, 3)},
        "frozen": frozenset({b"x"}), (1, "tuple key"): "value", 7: "int key", None: "none key",
        "nested": [[[{"deep": ((),)}]]], "np_scalar": np.float16(1.5), "np_int": np.uint64(1 << 63),
        "np_dtype": point, "objects": np.array([{"k": 1}, "s", None], dtype=object),
        "empty": np.zeros((0, 3), dtype=point), "array": np.arange(6, dtype=">i4").reshape(2, 3),
    }
    with C({"registry_dir": str(tmp_path)}) as p, C({"registry_dir": str(tmp_path)}) as c:
        assert p.put("a", "b", "k", data)[0]
        got, _ = c.get("a", "b", "k")
    assert set(got) == set(data)
    for k, v in data.items():
        g = got[k]
        if isinstance(v, np.ndarray):
            assert g.dtype == v.dtype and g.shape == v.shape and list(g.reshape(-1)) == list(v.reshape(-1)), k
        elif k == "nan":
            assert g != g
        else:
            assert type(g) is type(v) and g == v, k
    assert str(got["float"]) == "-0.0"


@pytest.mark.parametrize("value", [
    pytest.param(lambda: 1, id="function"),
    pytest.param(logging.getLogger("x"), id="object"),
    pytest.param(__import__("collections").OrderedDict(a=1), id="dict subclass"),
    pytest.param(__import__("enum").Enum("E", "A").A, id="enum"),
])
def test_what_is_not_data_is_refused_at_put_with_its_type(tmp_path, caplog, value):
    with C({"registry_dir": str(tmp_path)}) as p, caplog.at_level(logging.ERROR, "tensorwire.omni"):
        assert p.put("a", "b", "k", {"v": value, "x": np.ones(2)}) == (False, 0, None)
        assert p.health()["held_payloads"] == 0
    assert "cannot be carried" in caplog.text, caplog.text


def test_nesting_is_bounded_both_ways():
    deep = []
    for _ in range(skeleton.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(skeleton.SkeletonError, match="deeper"):
        packing.pack(deep)
    with pytest.raises(skeleton.SkeletonError):
        packing.load(b"[" * 100_000 + b"]" * 100_000)


def _mutations(raw: bytes, rng: random.Random):
    """Random edits of a valid skeleton, as a fuzzer would make them."""
    for _ in range(400):
        b = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            op = rng.randrange(3)
            at = rng.randrange(len(b) + 1)
            if op == 0 and b:
                b[min(at, len(b) - 1)] = rng.randrange(256)
            elif op == 1:
                b[at:at] = bytes(rng.choice([b'{"slot":', b'{"nd":', b'{"ns":', b'{"te":', b'{"d":', b'"O"',
                                             b'[', b']', b'-1', b'1e999', b'"|O"', b'{"tdt":"bad"}']))
            else:
                del b[at:at + rng.randint(1, 8)]
        yield bytes(b)


def test_the_decoder_is_total():
    data = {"s": packing.Slot(0, "numpy", np.dtype("<f4"), (2, 2), "cpu"), "t": (1, {2}), "o": np.array([1, None], dtype=object),
            "n": np.int8(3), "b": b"x", "e": np.zeros((0,), dtype="<u2")}
    raw = skeleton.encode(data, packing.Slot, packing.Slot.fields)
    rng = random.Random(61)
    tried = 0
    for m in _mutations(raw, rng):
        try:
            value = packing.load(m)
            packing.slots(value)
        except skeleton.SkeletonError:
            pass
        tried += 1
    for junk in (b"", b"\xff\xfe", b"nul", b"{}", b'{"a":1,"b":2}', b'{"slot":[0,"numpy","|O8",[1],"cpu"]}',
                 b'{"slot":[0,"numpy",[["a","|O"]],[1],"cpu"]}', b'{"nd":["|O",[2],[1]]}', b'{"ns":["<f8","AA=="]}',
                 b'{"slot":[0,"pickle","<f4",[1],"cpu"]}', b'[{"slot":[3,"numpy","<f4",[1],"cpu"]}]'):
        with pytest.raises(skeleton.SkeletonError):
            packing.slots(packing.load(junk))
    assert tried == 400


def test_a_slot_that_would_view_raw_bytes_as_objects_is_refused():
    with pytest.raises(skeleton.SkeletonError, match="Python objects"):
        packing.load(b'{"slot":[0,"numpy","|O",[1],"cpu"]}')


# -- the per-user folder ---------------------------------------------------------------------------

def test_a_folder_open_to_others_is_refused_when_named(tmp_path):
    base = tmp_path / f"tensorwire-omni-{os.getuid()}"
    base.mkdir(mode=0o700)
    os.chmod(base, 0o750)  # group may read: refused (it used to need a group *write* bit)
    with pytest.raises(PermissionError, match="only it can open"):
        HostRecords(str(tmp_path))
    with pytest.raises(Exception):
        C({"registry_dir": str(tmp_path)})


def test_a_squatted_default_folder_falls_back_to_the_users_runtime_folder(tmp_path, monkeypatch):
    shared, runtime = tmp_path / "shm", tmp_path / "run"
    shared.mkdir()
    runtime.mkdir(mode=0o700)
    squatted = shared / f"tensorwire-omni-{os.getuid()}"
    squatted.mkdir(mode=0o777)
    os.chmod(squatted, 0o777)  # made by someone else first, open to all
    if os.getuid() == 0:
        os.chown(squatted, 65534, 65534)  # and owned by another user, where we may say so
    monkeypatch.setattr(host_records, "default_root", lambda: str(shared))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    with C({}) as p, C({}) as c:
        assert p.put("a", "b", "k", {"x": np.arange(3)})[0]
        assert np.array_equal(c.get("a", "b", "k")[0]["x"], np.arange(3))
    assert (runtime / f"tensorwire-omni-{os.getuid()}").is_dir()
    assert os.listdir(squatted) == []
