"""An embedding cache in the store: a prompt encoded once serves every later request with the
same prompt, negative prompt and encoder, on any encode worker of the cluster.

Keys follow tensorwire's cache-key format (``diffusion/src/cache/keys.rs``, version 1; the test
vectors in ``diffusion/tests/it/cache_keys.txt`` check this implementation too): an entry lives under
``tw/cache/emb/<key hex>`` (its manifest: the tensors' names, dtypes and shapes) and
``.../<name>`` (each tensor's bytes, written from and read into the tensors themselves). Entries
are ordinary store objects: the store may evict them, and an entry with a part gone is a miss.
"""

import hashlib
import json
import logging
import struct
from typing import Any, Dict, Iterable, Optional, Tuple

log = logging.getLogger("tensorwire.pipelines")


def _s(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def embedding_key(encoder: str, version: str, prompt: str, negative: bool,
                  params: Iterable[Tuple[str, str]] = ()) -> str:
    """The cache key (hex) of ``prompt``'s embedding by ``encoder`` at ``version`` with the
    encoder parameters ``params`` that change its output."""
    m = _s(b"tensorwire/embedding") + bytes([1]) + _s(encoder.encode()) + _s(version.encode())
    m += _s(prompt.encode()) + bytes([int(negative)])
    pairs = sorted(params)
    m += struct.pack("<I", len(pairs))
    for k, v in pairs:
        m += _s(k.encode()) + _s(v.encode())
    return hashlib.sha256(m).hexdigest()


class EmbeddingCache:
    """Condition embeddings (a stage's named tensors) by prompt, in ``store``
    (``tensorwire.Store``). ``encoder`` names the text encoders and their weights (a different
    model must not share entries): ``"tiny-sd3-seed0"``, or a weights directory's identity."""

    def __init__(self, store: Any, encoder: str, version: str = "1"):
        self.store = store
        self.encoder = encoder
        self.version = version
        self.hits = 0
        self.misses = 0

    def key(self, prompt: str, negative_prompt: str, params: Dict[str, Any]) -> str:
        knobs = [("negative_prompt", negative_prompt)] + [(k, str(v)) for k, v in params.items()]
        return "tw/cache/emb/" + embedding_key(self.encoder, self.version, prompt, False, knobs)

    def get(self, key: str) -> Optional[Dict[str, Any]]:
        """The entry's tensors (read into tensors allocated here), or None on a miss. A store that
        fails (unreachable, a malformed entry) is a miss too, logged: the encoder runs instead."""
        import torch

        from ..errors import NotFoundError, TensorwireError

        try:
            manifest = json.loads(self.store.get(key))
            out = {}
            for name, (dtype, shape) in manifest.items():
                dst = torch.empty(shape, dtype=getattr(torch, dtype))
                self.store.get_into(f"{key}/{name}", dst)
                out[name] = dst
        except NotFoundError:  # absent, or a part evicted
            self.misses += 1
            return None
        except (TensorwireError, ValueError, TypeError, AttributeError) as e:
            log.warning("embedding cache entry %s unusable (%s: %s): a miss", key, type(e).__name__, e)
            self.misses += 1
            return None
        self.hits += 1
        return out

    def put(self, key: str, tensors: Dict[str, Any]) -> bool:
        """Keeps ``tensors`` (host memory, contiguous) under ``key``: the tensors first, the
        manifest last, so a reader never finds a manifest whose parts are not there yet. False
        (logged) when the store refused it; an entry another worker put first is kept."""
        from ..errors import KeyExistsError, TensorwireError

        try:
            for name, t in tensors.items():
                self.store.put_from(f"{key}/{name}", t.detach().contiguous())
            manifest = {name: (str(t.dtype).replace("torch.", ""), list(t.shape)) for name, t in tensors.items()}
            self.store.put(key, json.dumps(manifest).encode())
        except KeyExistsError:
            return True  # another worker cached the same prompt: its tensors are these bits
        except TensorwireError as e:
            log.warning("embedding cache: %s not kept (%s: %s)", key, type(e).__name__, e)
            return False
        return True
