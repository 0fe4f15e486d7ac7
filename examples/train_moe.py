"""Train a small mixture-of-experts language model at ZeRO stage 3, each rank routing its tokens its own way.

Run on CPU (gloo) or GPU (NCCL)::

    torchrun --nproc_per_node 2 examples/train_moe.py

Each block routes every token to one of its experts (top-1), so the ranks, which see different
tokens, run different experts. Stage 3 gathers parameters with collectives that every rank must
issue in the same order, so the MoE block is marked as a *leaf module*: its router and all its
experts are gathered together when the block is entered, on every rank, whatever the routing.
The output layer reuses the input embedding's weight (``F.linear(h, self.embed.weight)`` in the
model's forward), registered as an *external parameter* of the model so that it is gathered there.

Prints the loss of every step (averaged over ranks) and how many tokens each expert of the first
block received on each rank in the last step.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from train import init_distributed, synthetic_batch  # as the dense example (examples/ is on the path)

import zero_kernels as zk


class Expert(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class MoEBlock(nn.Module):
    """Pre-norm residual mixture of experts with top-1 routing."""

    def __init__(self, dim: int, experts: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim) for _ in range(experts))
        self.load = torch.zeros(experts, dtype=torch.long)  # tokens per expert in the last forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x).reshape(-1, x.shape[-1])
        gate, choice = self.router(h).softmax(-1).max(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().flatten()
            if rows.numel():
                out = out.index_add(0, rows, expert(h[rows]) * gate[rows, None])
        self.load = torch.bincount(choice, minlength=len(self.experts))
        return x + out.view_as(x)


class TinyMoELM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 2, experts: int = 4, context: int = 32):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(MoEBlock(dim, experts) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        for table in (self.embed, self.pos):  # small: the embedding is also the output layer
            nn.init.normal_(table.weight, std=0.1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.norm(x), self.embed.weight)  # output layer tied to the input embedding


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    args = parser.parse_args()
    device = init_distributed()  # this rank's GPU made current before anything touches CUDA
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    vocab, context = 256, 32
    model = TinyMoELM(vocab=vocab, context=context).to(device)
    zk.set_leaf_modules(model, [MoEBlock])  # before the optimizer: one buffer (one gather) per block
    zk.register_external_parameter(model, model.embed.weight)  # read by the model's own forward
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000},
        "gradient_clipping": 1.0,
    }
    model, opt = zk.initialize(model, config)
    for step in range(args.steps):
        tokens = synthetic_batch(step, rank, 8, context, vocab).to(device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(total)
            total /= dist.get_world_size()
        if rank == 0:
            print(f"step {step:3d}  loss {total.item():.4f}")
    print(f"rank {rank} tokens per expert in block 0: {model.blocks[0].load.tolist()}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
