"""The skeleton of a payload (everything but its tensors' bytes) as data, never as code.

A record's skeleton used to be a pickle, and unpickling what a peer or the store hands back runs
whatever that peer wrote: anyone who could write a record ran code in every consumer. Here the
skeleton is JSON with a tag for each kind of value JSON lacks, and :func:`decode` builds only
the values below, whatever its input; anything else is refused at :func:`encode` (the ``put``
fails and says which type) and at :func:`decode` (the ``get`` finds nothing and says why).

What a skeleton holds::

    None, bool, int, float (nan and the infinities too), str       as JSON, or {"f": "nan"}
    list                                                            a JSON array
    tuple / set / frozenset                                         {"t": [...]} / {"s": ..} / {"fs": ..}
    dict (keys of any kind above that can be a key)                 {"d": [[key, value], ...]}
    bytes / bytearray / complex                                     {"b": base64} / {"ba": ..} / {"c": [re, im]}
    a tensor's place among the buffers (:class:`~.packing.Slot`)    {"slot": [index, framework, dtype, shape, device]}
    a numpy array that does not move as bytes (empty, objects)      {"nd": [dtype, shape, items]}
    a numpy scalar (``np.float32(1.5)``)                            {"ns": [dtype, base64]}
    an empty torch tensor                                           {"te": [dtype, shape, device]}
    a torch or numpy dtype                                          {"tdt": name} / {"ndt": descr}

numpy dtypes travel as their ``.npy`` description (``numpy.lib.format``), torch dtypes by name
among torch's own dtypes; a slot's dtype may not hold Python objects (its buffer is raw bytes).
Nesting is bounded (:data:`MAX_DEPTH`). Not carried (refused at ``put``): instances of other
classes (dataclasses, named tuples, enums, sparse or quantized tensors, functions): send their
fields as a dict instead.
"""

import base64
import json
import math
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = ["MAX_DEPTH", "SkeletonError", "decode", "encode"]

MAX_DEPTH = 64


class SkeletonError(ValueError):
    """A value that cannot be carried, or bytes that are not a skeleton."""


def _np() -> Optional[Any]:
    return sys.modules.get("numpy")


def _torch() -> Optional[Any]:
    return sys.modules.get("torch")


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def _unb64(s: Any) -> bytes:
    if not isinstance(s, str):
        raise SkeletonError("expected base64 text")
    try:
        return base64.b64decode(s.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as e:
        raise SkeletonError(f"bad base64: {e}") from None


# -- dtypes ----------------------------------------------------------------------------------------

def _torch_dtypes(torch: Any) -> Dict[str, Any]:
    """torch's dtypes by name (only what torch itself defines as a dtype)."""
    found = {}
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            found[str(value).split(".", 1)[-1]] = value
    return found


def torch_dtype_name(dt: Any) -> str:
    return str(dt).split(".", 1)[-1]


def torch_dtype(name: Any) -> Any:
    torch = _torch()
    if torch is None:
        import torch  # a torch record needs torch here
    if not isinstance(name, str) or name not in _torch_dtypes(torch):
        raise SkeletonError(f"not a torch dtype: {name!r}")
    return _torch_dtypes(torch)[name]


def numpy_descr(dt: Any) -> Any:
    import numpy
    return numpy.lib.format.dtype_to_descr(dt)


def _as_descr(x: Any, depth: int = 0) -> Any:
    """JSON's form of an ``.npy`` description back into its own (tuples where it has them)."""
    if depth > MAX_DEPTH:
        raise SkeletonError("dtype description nested too deeply")
    if isinstance(x, str):
        return x
    if isinstance(x, list):
        fields = []
        for f in x:
            if not isinstance(f, list) or len(f) not in (2, 3):
                raise SkeletonError("bad dtype field")
            name = tuple(f[0]) if isinstance(f[0], list) else f[0]
            field = [name, _as_descr(f[1], depth + 1)]
            if len(f) == 3:
                if not isinstance(f[2], list) or not all(type(n) is int and n >= 0 for n in f[2]):
                    raise SkeletonError("bad dtype field shape")
                field.append(tuple(f[2]))
            fields.append(tuple(field))
        return fields
    raise SkeletonError("bad dtype description")


def numpy_dtype(descr: Any, *, raw: bool) -> Any:
    """The numpy dtype of ``descr``; ``raw``: it will view raw bytes, so no Python objects."""
    import numpy
    try:
        dt = numpy.lib.format.descr_to_dtype(_as_descr(descr))
    except SkeletonError:
        raise
    except Exception as e:  # numpy's own refusal of a description
        raise SkeletonError(f"not a numpy dtype: {descr!r} ({e})") from None
    if raw and dt.hasobject:
        raise SkeletonError("a dtype of Python objects cannot view raw bytes")
    return dt


def shape_of(x: Any) -> Tuple[int, ...]:
    if not isinstance(x, list) or len(x) > 64 or not all(type(n) is int and 0 <= n < (1 << 62) for n in x):
        raise SkeletonError(f"bad shape: {x!r}")
    return tuple(x)


# -- encode ----------------------------------------------------------------------------------------

def encode(value: Any, slot_type: type, slot_fields: Callable[[Any], list]) -> bytes:
    """The skeleton of ``value`` as bytes; ``slot_type`` values become slots (their fields from
    ``slot_fields``). Raises :class:`SkeletonError` naming a value it cannot carry."""
    return json.dumps(_enc(value, 0, slot_type, slot_fields), separators=(",", ":"),
                      allow_nan=False).encode("utf-8")


def _enc(x: Any, depth: int, slot_type: type, slot_fields: Callable[[Any], list]) -> Any:
    if depth > MAX_DEPTH:
        raise SkeletonError(f"data nested deeper than {MAX_DEPTH}")
    enc = lambda v: _enc(v, depth + 1, slot_type, slot_fields)  # noqa: E731
    kind = type(x)
    if x is None or kind is bool or kind is int or kind is str:
        return x
    if kind is float:
        if math.isfinite(x):
            return x
        return {"f": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}
    if kind is list:
        return [enc(v) for v in x]
    if kind is tuple:
        return {"t": [enc(v) for v in x]}
    if kind is dict:
        return {"d": [[enc(k), enc(v)] for k, v in x.items()]}
    if kind is set:
        return {"s": [enc(v) for v in x]}
    if kind is frozenset:
        return {"fs": [enc(v) for v in x]}
    if kind is bytes:
        return {"b": _b64(x)}
    if kind is bytearray:
        return {"ba": _b64(bytes(x))}
    if kind is complex:
        return {"c": [enc(x.real), enc(x.imag)]}
    if kind is slot_type:
        return {"slot": slot_fields(x)}
    np, torch = _np(), _torch()
    if np is not None:
        if isinstance(x, np.ndarray) and kind is np.ndarray:
            items = [enc(v) for v in x.reshape(-1).tolist()] if x.dtype.hasobject else []
            if not x.dtype.hasobject and x.size:
                raise SkeletonError("a numpy array with elements moves as a buffer, not in the skeleton")
            return {"nd": [numpy_descr(x.dtype), list(x.shape), items]}
        if isinstance(x, np.generic) and not isinstance(x, np.object_):
            return {"ns": [numpy_descr(x.dtype), _b64(x.tobytes())]}
        if isinstance(x, np.dtype):
            return {"ndt": numpy_descr(x)}
    if torch is not None:
        if isinstance(x, torch.dtype):
            return {"tdt": torch_dtype_name(x)}
        if isinstance(x, torch.Tensor) and x.layout == torch.strided and not x.is_quantized and x.numel() == 0:
            return {"te": [torch_dtype_name(x.dtype), list(x.shape), str(x.device)]}
    raise SkeletonError(f"a {kind.__module__}.{kind.__qualname__} cannot be carried (records hold data, "
                        "not objects: send its fields as a dict)")


# -- decode ----------------------------------------------------------------------------------------

def decode(raw: Any, make_slot: Callable[[list], Any]) -> Any:
    """The value a skeleton holds; ``make_slot`` builds a slot from its fields. Raises
    :class:`SkeletonError` on anything else, whatever ``raw`` is."""
    if not isinstance(raw, (bytes, bytearray)):
        raise SkeletonError("a skeleton is bytes")
    try:
        tree = json.loads(bytes(raw).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise SkeletonError(f"not a skeleton: {str(e)[:100]}") from None
    try:
        return _dec(tree, 0, make_slot)
    except SkeletonError:
        raise
    except (TypeError, ValueError, OverflowError, RecursionError) as e:
        raise SkeletonError(f"bad skeleton: {str(e)[:100]}") from None


def _dec(x: Any, depth: int, make_slot: Callable[[list], Any]) -> Any:
    if depth > MAX_DEPTH:
        raise SkeletonError(f"skeleton nested deeper than {MAX_DEPTH}")
    dec = lambda v: _dec(v, depth + 1, make_slot)  # noqa: E731
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, list):
        return [dec(v) for v in x]
    if not isinstance(x, dict) or len(x) != 1:
        raise SkeletonError("a tagged value has exactly one tag")
    (tag, v), = x.items()

    def items() -> List[Any]:
        if not isinstance(v, list):
            raise SkeletonError(f"tag {tag!r} needs a list")
        return [dec(i) for i in v]

    if tag == "f":
        if v not in ("nan", "inf", "-inf"):
            raise SkeletonError(f"bad float {v!r}")
        return float(v)
    if tag == "t":
        return tuple(items())
    if tag == "s":
        return set(items())
    if tag == "fs":
        return frozenset(items())
    if tag == "d":
        if not isinstance(v, list) or not all(isinstance(p, list) and len(p) == 2 for p in v):
            raise SkeletonError("a dict is a list of pairs")
        return {dec(k): dec(val) for k, val in v}
    if tag == "b":
        return _unb64(v)
    if tag == "ba":
        return bytearray(_unb64(v))
    if tag == "c":
        parts = items()
        if len(parts) != 2 or not all(type(p) in (int, float) for p in parts):
            raise SkeletonError("bad complex")
        return complex(parts[0], parts[1])
    if tag == "slot":
        if not isinstance(v, list):
            raise SkeletonError("bad slot")
        return make_slot(v)
    if tag == "nd":
        if not isinstance(v, list) or len(v) != 3 or not isinstance(v[2], list):
            raise SkeletonError("bad numpy array")
        import numpy
        dt, shape = numpy_dtype(v[0], raw=False), shape_of(v[1])
        n = math.prod(shape)
        if dt.hasobject:
            vals = [dec(i) for i in v[2]]
            if len(vals) != n:
                raise SkeletonError(f"{len(vals)} items for shape {shape}")
            a = numpy.empty(n, dtype=dt)
            for i, val in enumerate(vals):
                a[i] = val
            return a.reshape(shape)
        if n != 0:
            raise SkeletonError("a numpy array with elements moves as a buffer")
        return numpy.empty(shape, dtype=dt)
    if tag == "ns":
        if not isinstance(v, list) or len(v) != 2:
            raise SkeletonError("bad numpy scalar")
        import numpy
        dt = numpy_dtype(v[0], raw=True)
        b = _unb64(v[1])
        if len(b) != dt.itemsize:
            raise SkeletonError(f"{len(b)} bytes for a {dt} scalar")
        return numpy.frombuffer(b, dtype=dt)[0]
    if tag == "ndt":
        return numpy_dtype(v, raw=False)
    if tag == "tdt":
        return torch_dtype(v)
    if tag == "te":
        if not isinstance(v, list) or len(v) != 3 or not isinstance(v[2], str):
            raise SkeletonError("bad empty tensor")
        import torch
        dt, shape = torch_dtype(v[0]), shape_of(v[1])
        if math.prod(shape) != 0:
            raise SkeletonError("a tensor with elements moves as a buffer")
        t = torch.empty(shape, dtype=dt)
        return t.to(v[2]) if v[2] != "cpu" and device_exists(torch, v[2]) else t
    raise SkeletonError(f"unknown tag {tag!r}")


def device_exists(torch: Any, device: str) -> bool:
    try:
        d = torch.device(device)
        return d.type == "cuda" and torch.cuda.is_available() and (d.index or 0) < torch.cuda.device_count()
    except (RuntimeError, ValueError, TypeError):
        return False
