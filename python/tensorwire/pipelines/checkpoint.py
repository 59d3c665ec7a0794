"""Step checkpoints of a denoise job: the latents at step ``k`` and the real scheduler's state,
in a portable encoding, kept in a store; the orchestrator carries a small reference to them
(its checkpoint data is at most 48 KiB, a latent is not). ``steps`` is the denoising loop both
models run, which stops after a step and resumes from a state.

The scheduler state is every attribute of the diffusers scheduler object beside its config: its
tensors (sigmas, timesteps, a multistep solver's history of model outputs and last sample), lists
of them, and its scalars (step index, begin index, solver order reached, ...). Capturing them all,
not a chosen few, is what lets any scheduler resume exactly; an attribute of a kind this encoding
does not know refuses the capture (``TypeError``) rather than dropping state.

Encoding (version 1), little-endian::

    b"TWSS" | u8 version | u32 header length | header (UTF-8 JSON) | tensor bytes

The header: ``{"scheduler": class name, "config": sha256 of the config, "step": k, "fields":
{name: JSON scalar}, "lists": {name: [item, ...]}, "on_device": [names of the tensors that lived
on the accelerator], "tensors": [{"name", "dtype", "shape", "offset", "nbytes"}, ...]}``, where a list item is a JSON scalar or ``{"tensor": name}``, and a
tensor's bytes are C-order at ``offset`` after the header. The latents travel as the tensor
``"latents"``. ``decode`` checks every length, offset, dtype and shape (``ValueError``), and
``restore`` refuses a state taken from another scheduler class or config.
"""

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

MAGIC = b"TWSS"
VERSION = 1
MAX_HEADER = 1 << 20
DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
_HEAD = struct.Struct("<4sBI")


@dataclass
class StepState:
    """A denoise job at a step: the latents after ``step`` steps and the scheduler's state."""

    step: int
    latents: Any
    scheduler: Dict[str, Any]  # {"class", "config", "fields", "lists", "tensors": {name: tensor}}


def steps(pipe: Any, device: Any, resume: Optional[StepState], fresh: Callable[[], Any],
          predict: Callable[[int, Any, Any], Any], after_step: Optional[Callable[[int, Any], bool]]) -> Optional[Any]:
    """A denoising loop that can stop after a step and resume from one: starts from ``fresh()``
    (which prepares the latents and sets the scheduler's timesteps) or from ``resume``, then for
    each remaining step ``i`` steps the scheduler with ``predict(i, t, latents)`` (the model's
    guided noise prediction). ``after_step(k, latents)`` runs after step ``k`` (1-based); when it
    returns False the loop stops and returns None."""
    import torch

    with torch.no_grad():
        if resume is None:
            latents, start = fresh(), 0
        else:
            restore(pipe.scheduler, resume.scheduler, device)
            latents, start = resume.latents.to(device), resume.step
        timesteps = pipe.scheduler.timesteps
        for i in range(start, len(timesteps)):
            t = timesteps[i]
            latents = pipe.scheduler.step(predict(i, t, latents), t, latents, return_dict=False)[0]
            if after_step is not None and not after_step(i + 1, latents):
                return None
    return latents


def state(pipe: Any, step: int, latents: Any) -> StepState:
    """A pipeline's denoise job after ``step`` steps (for ``after_step``): a checkpoint to resume
    from."""
    return StepState(step, latents.detach().clone(), capture(pipe.scheduler))


def _config_digest(scheduler: Any) -> str:
    return hashlib.sha256(json.dumps(dict(scheduler.config), sort_keys=True, default=str).encode()).hexdigest()


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def capture(scheduler: Any) -> Dict[str, Any]:
    """The scheduler's state (tensors copied to the host)."""
    import torch

    fields: Dict[str, Any] = {}
    lists: Dict[str, List[Any]] = {}
    tensors: Dict[str, Any] = {}
    on_device: List[str] = []  # tensors that were not in host memory (restored to the device)

    def take(name: str, t: Any) -> Dict[str, str]:
        tensors[name] = t.detach().to("cpu").clone()
        if t.device.type != "cpu":
            on_device.append(name)
        return {"tensor": name}

    for name, v in vars(scheduler).items():
        if name == "_internal_dict":  # the config, checked by digest
            continue
        if isinstance(v, torch.Tensor):
            take(name, v)
        elif isinstance(v, (list, tuple)):
            items = []
            for i, x in enumerate(v):
                if not (isinstance(x, torch.Tensor) or _scalar(x)):
                    raise TypeError(f"scheduler attribute {name}[{i}]: a {type(x).__name__} has no portable encoding")
                items.append(take(f"{name}.{i}", x) if isinstance(x, torch.Tensor) else x)
            lists[name] = items
        elif _scalar(v):
            fields[name] = v
        else:
            raise TypeError(f"scheduler attribute {name}: a {type(v).__name__} has no portable encoding")
    return {"class": type(scheduler).__name__, "config": _config_digest(scheduler), "fields": fields,
            "lists": lists, "tensors": tensors, "on_device": on_device}


def restore(scheduler: Any, state: Dict[str, Any], device: Any = None) -> None:
    """Puts ``state`` (from ``capture`` of a scheduler of the same class and config) into
    ``scheduler``; the tensors that were on a device when captured go to ``device`` (the others,
    like the flow-matching schedulers' host-side sigmas, stay in host memory)."""
    if state["class"] != type(scheduler).__name__:
        raise ValueError(f"a {state['class']} state cannot resume a {type(scheduler).__name__}")
    if state["config"] != _config_digest(scheduler):
        raise ValueError(f"the {state['class']} state was taken with another scheduler config")
    on_device = set(state.get("on_device", []))

    def placed(name: str) -> Any:
        t = state["tensors"][name]
        return t.to(device) if device is not None and name in on_device else t.clone()

    for name, v in state["fields"].items():
        setattr(scheduler, name, v)
    for name, items in state["lists"].items():
        setattr(scheduler, name, [placed(x["tensor"]) if isinstance(x, dict) else x for x in items])
    for name in state["tensors"]:
        if "." not in name:
            setattr(scheduler, name, placed(name))


def encode(s: StepState) -> bytes:
    """The portable bytes of a step state."""
    import torch

    named = dict(s.scheduler["tensors"])
    named["latents"] = s.latents.detach().to("cpu")
    entries, blobs, offset = [], [], 0
    for name, t in named.items():
        t = t.contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        dtype = str(t.dtype).replace("torch.", "")
        if dtype not in DTYPES:
            raise TypeError(f"{name}: dtype {dtype} has no portable encoding")
        entries.append({"name": name, "dtype": dtype, "shape": list(t.shape), "offset": offset, "nbytes": len(raw)})
        blobs.append(raw)
        offset += len(raw)
    header = json.dumps({"scheduler": s.scheduler["class"], "config": s.scheduler["config"], "step": s.step,
                         "fields": s.scheduler["fields"], "lists": s.scheduler["lists"],
                         "on_device": s.scheduler.get("on_device", []), "tensors": entries}).encode()
    return _HEAD.pack(MAGIC, VERSION, len(header)) + header + b"".join(blobs)


def _itemsize(dtype: str) -> int:
    import torch

    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def decode(data: bytes) -> StepState:
    """The inverse of ``encode``; ``ValueError`` for anything that is not a whole, valid state."""
    import torch

    if len(data) < _HEAD.size:
        raise ValueError("step state: shorter than its header")
    magic, version, n = _HEAD.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"step state: not a version {VERSION} step state")
    if n > MAX_HEADER or _HEAD.size + n > len(data):
        raise ValueError(f"step state: a header of {n} bytes in {len(data)}")
    try:
        h = json.loads(data[_HEAD.size:_HEAD.size + n])
        body = memoryview(data)[_HEAD.size + n:]
        step, fields, lists = int(h["step"]), dict(h["fields"]), dict(h["lists"])
        cls, digest, entries = str(h["scheduler"]), str(h["config"]), list(h["tensors"])
        on_device = [str(x) for x in h.get("on_device", [])]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ValueError(f"step state: a bad header ({e})") from None
    tensors: Dict[str, Any] = {}
    end = 0
    for e in entries:
        name, dtype, shape, offset, nbytes = _entry(e)
        if dtype not in DTYPES:
            raise ValueError(f"step state: {name} has dtype {dtype}")
        if nbytes != math.prod(shape) * _itemsize(dtype) or offset < end or offset + nbytes > len(body):
            raise ValueError(f"step state: {name} ({dtype} {shape}) does not fit at {offset}+{nbytes}")
        end = offset + nbytes
        raw = bytearray(body[offset:offset + nbytes])
        t = torch.frombuffer(raw, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        tensors[name] = t.view(getattr(torch, dtype)).reshape(shape)
    if end != len(body):
        raise ValueError(f"step state: {len(body) - end} bytes after the last tensor")
    if "latents" not in tensors:
        raise ValueError("step state: no latents")
    for name, items in lists.items():
        if not isinstance(items, list):
            raise ValueError(f"step state: list {name} is not a list")
        for x in items:
            if (x.get("tensor") not in tensors) if isinstance(x, dict) else not _scalar(x):
                raise ValueError(f"step state: list {name} has an item {x!r}")
    if not all(_scalar(v) for v in fields.values()):
        raise ValueError("step state: a field that is not a scalar")
    latents = tensors.pop("latents")
    return StepState(step, latents, {"class": cls, "config": digest, "fields": fields, "lists": lists,
                                     "tensors": tensors, "on_device": on_device})


def _entry(e: Any) -> Tuple[str, str, List[int], int, int]:
    try:
        name, dtype, shape = str(e["name"]), str(e["dtype"]), [int(d) for d in e["shape"]]
        offset, nbytes = int(e["offset"]), int(e["nbytes"])
    except (KeyError, TypeError, ValueError) as x:
        raise ValueError(f"step state: a bad tensor entry ({x})") from None
    if min(shape, default=0) < 0 or offset < 0 or nbytes < 0:
        raise ValueError(f"step state: {name} has a negative size")
    return name, dtype, shape, offset, nbytes


class Checkpoints:
    """Step states in a store (``tensorwire.Store``), kept pinned until ``remove``d (or
    ``ttl`` seconds at most, for a request that never ends); ``save`` returns the small
    reference the orchestrator carries (``Worker.checkpoint`` / ``yield_job``)."""

    def __init__(self, store: Any, ttl: float = 600.0):
        self.store = store
        self.ttl = ttl

    def save(self, request: int, s: StepState) -> bytes:
        key = f"tw/checkpoint/{request}/{s.step}"
        self.store.put(key, encode(s), retention="pinned")
        self.store.set_lease(key, ttl=self.ttl)
        return json.dumps({"v": 1, "key": key, "step": s.step}).encode()

    def load(self, ref: bytes) -> StepState:
        """The step state a reference names (``ValueError`` for a bad reference or state; the
        store's error when it is gone)."""
        key = _ref_key(ref)
        return decode(self.store.get(key))

    def remove(self, ref: bytes) -> bool:
        return self.store.remove(_ref_key(ref))


def _ref_key(ref: bytes) -> str:
    try:
        r = json.loads(ref)
        if r.get("v") != 1 or not isinstance(r.get("key"), str):
            raise ValueError("not a version 1 reference")
        return r["key"]
    except (ValueError, AttributeError, UnicodeDecodeError) as e:
        raise ValueError(f"checkpoint reference: {e}") from None
