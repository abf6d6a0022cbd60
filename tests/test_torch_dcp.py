"""Real PyTorch DCP checkpoints (model + AdamW state) survive push, delta push and pull, and
load back into torch bit-exactly. Skipped when torch is not installed (see README)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.cli.run import main as ferry

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(256, 64), torch.nn.Linear(64, 256), torch.nn.Linear(256, 256)
    )


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(steps)
    for _ in range(steps):
        x = torch.randint(0, 256, (8, 16), generator=gen)
        loss = model(x).logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def save(model: torch.nn.Module, opt: torch.optim.Optimizer, path: Path) -> None:
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)))


def test_dcp_series_round_trips_and_loads_in_torch(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-5)
    hot = tmp_path / "hot"
    for step in (20, 40):
        train(model, opt, 20)
        save(model, opt, hot / f"step_{step:06d}")
        args = ["push", str(hot / f"step_{step:06d}"), store_url, "--job", "t", "--node", "n"]
        assert ferry([*args, "--chunk-size-mib", "1", "--json"]) == 0
        pushed = json.loads(capsys.readouterr().out)
    assert pushed["base_step"] == 20 and pushed["chunks_delta"] + pushed["chunks_deduped"] > 0

    out = tmp_path / "restored"
    assert (
        ferry(["pull", store_url, str(out), "--job", "t", "--base-dir", str(hot / "step_000020")])
        == 0
    )
    restored_model = tiny_model()
    restored_opt = torch.optim.AdamW(restored_model.parameters(), lr=3e-5)
    train(restored_model, restored_opt, 1)  # materialise optimizer state to load into
    state = {"model": restored_model.state_dict(), "optim": restored_opt.state_dict()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(out)))
    for name, tensor in model.state_dict().items():
        assert torch.equal(state["model"][name], tensor), name
    for pid, moments in opt.state_dict()["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state["optim"]["state"][pid][key], moments[key])
