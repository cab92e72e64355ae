"""Regenerates tests/data/sample-mlp-training.pt, a small training checkpoint written by torch.save.

Run with the test venv's python: python tests/data/make_sample.py
"""

from pathlib import Path

import torch
from torch import nn

OUTPUT = Path(__file__).resolve().with_name("sample-mlp-training.pt")


def build_checkpoint() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    # Two real steps, so Adam's state holds step, exp_avg and exp_avg_sq per parameter.
    for _ in range(2):
        inputs, targets = torch.randn(8, 16), torch.randn(8, 4)
        loss = nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": 3,
        "step": 200,
        "config": {"lr": 1e-3, "name": "demo"},
    }


def main() -> None:
    torch.save(build_checkpoint(), OUTPUT)
    print(f"wrote {OUTPUT} ({OUTPUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
