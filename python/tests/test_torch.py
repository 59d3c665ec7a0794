"""torch tensors through DLPack (skipped where torch is not installed: its wheels are gigabytes)."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this venv (python/venv installs it when TW_PIP_EXTRA names it, as .ci/run does)")

from tensorwire.diffusion import DiffusionConnector, StagePayload  # noqa: E402


def test_torch_tensors_publish_and_consume_into_views():
    prod, cons = DiffusionConnector(transfer_mode="p2p"), DiffusionConnector(transfer_mode="p2p")
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        x = (torch.arange(4 * 6 * 8) % 97).to(dtype).reshape(4, 6, 8)
        h = prod.publish(StagePayload(1, "latent", x, chunk_dim=1, num_chunks=3))
        h.mark_all_ready()
        dst = torch.empty_like(x)
        chunks = list(cons.consume(h, dst))
        assert all(isinstance(c, torch.Tensor) and c.data_ptr() >= dst.data_ptr() for c in chunks)
        assert torch.equal(dst, x)
