"""A shared host is not an open door: with no secret configured, every Python face proves the
user's loopback secret to peers on loopback, so a process of another user (who can reach every
loopback port, but holds another loopback secret) gets neither the region keys nor the bytes.
Processes of one user need nothing configured; two users share a secret file explicitly."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tensorwire as tw
from tensorwire.diffusion import DiffusionConnector, StagePayload


def _run(code: str, env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60, **kw)


def _other_user_env(tmp_path) -> dict:
    """What another user's process on this host looks like to us: another loopback secret."""
    return {"TENSORWIRE_LOOPBACK_SECRET": str(tmp_path / "other" / "loopback-secret")}


def test_another_users_engine_cannot_shake_hands(tmp_path):
    e = tw.Engine()
    secret = b"payload of the first user"
    src = np.frombuffer(secret, dtype=np.uint8).copy()
    region = e.register(src)
    out = _run(f"""
        import tensorwire as tw
        other = tw.Engine()
        try:
            other.connect({e.address!r})
            print("CONNECTED")
        except Exception as x:
            print("REFUSED", type(x).__name__, x)
    """, _other_user_env(tmp_path))
    assert "REFUSED" in out.stdout, out.stdout + out.stderr
    assert "AccessDenied" in out.stdout or "wrong cluster secret" in out.stdout, out.stdout
    # The same code as this user gets in.
    same = _run(f"""
        import tensorwire as tw
        tw.Engine().connect({e.address!r})
        print("CONNECTED")
    """, {})
    assert "CONNECTED" in same.stdout, same.stdout + same.stderr
    del region
    e.shutdown()


def test_another_user_cannot_consume_a_published_payload(tmp_path):
    producer = DiffusionConnector(role="denoise", transfer_mode="p2p")
    latents = np.arange(1024, dtype=np.float32)
    handle = producer.publish(StagePayload(request_id=1, kind="latent", tensor=latents))
    code = f"""
        import numpy as np
        from tensorwire.diffusion import DiffusionConnector
        c = DiffusionConnector(role="decode", transfer_mode="p2p")
        dst = np.zeros(1024, dtype=np.float32)
        try:
            for _ in c.consume(bytes.fromhex({handle.to_bytes().hex()!r}), dst=dst, timeout=10):
                pass
            print("READ", float(dst.sum()))
        except Exception as x:
            print("REFUSED", type(x).__name__, x)
    """
    out = _run(code, _other_user_env(tmp_path))
    assert "REFUSED" in out.stdout, out.stdout + out.stderr
    # A shared secret file given explicitly lets the two users talk (here: the same user, who
    # reads what the other identity cannot).
    ok = _run(code, {})
    assert "READ" in ok.stdout and str(float(latents.sum())) in ok.stdout, ok.stdout + ok.stderr
    producer.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a child as another uid")
def test_a_process_of_another_uid_is_refused(tmp_path):
    """The real thing: a child running as uid 65534 (nobody), with its own loopback secret."""
    e = tw.Engine()
    home = tmp_path / "nobody"
    home.mkdir()
    os.chown(home, 65534, 65534)
    pkg = os.path.dirname(os.path.dirname(tw.__file__))
    try:
        out = _nobody(pkg, e.address, home)
    except PermissionError as x:
        pytest.skip(f"uid 65534 cannot start this interpreter: {x}")
    if "No module named" in out.stderr or "Permission denied" in out.stderr:
        pytest.skip(f"uid 65534 cannot load the package from this venv: {out.stderr.strip()[-200:]}")
    assert "REFUSED" in out.stdout, out.stdout + out.stderr
    e.shutdown()


def _nobody(pkg: str, address: str, home) -> subprocess.CompletedProcess:
    return _run(f"""
        import sys; sys.path.insert(0, {pkg!r})
        import tensorwire as tw
        try:
            tw.Engine().connect({address!r})
            print("CONNECTED")
        except Exception as x:
            print("REFUSED", type(x).__name__, x)
    """, {"HOME": str(home), "TENSORWIRE_LOOPBACK_SECRET": ""}, user=65534, group=65534)
