"""Small real models for the torch tests (shared by test processes)."""

from __future__ import annotations

import torch
from torch import nn


class Tiny(nn.Module):
    """Embedding, linears, a norm, a tied head, a persistent and a non-persistent buffer."""

    def __init__(self, vocab: int = 97, width: int = 48, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.tensor(0.5))
        self.register_buffer("positions", torch.arange(16, dtype=torch.float32) / 16, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) * self.scale
        x = x + self.positions[: ids.shape[-1], None]
        for layer in self.layers:
            x = torch.relu(layer(x)) + x
        return self.head(self.norm(x))


def tiny(seed: int = 0, dtype: torch.dtype = torch.float32) -> Tiny:
    torch.manual_seed(seed)
    return Tiny().to(dtype)


INPUT = torch.tensor([[1, 5, 9, 13, 2, 7, 11, 3]])
