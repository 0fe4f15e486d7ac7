"""Train a small GPT-like model on synthetic tokens with ``zero_kernels.initialize``.

Run on CPU (gloo) or GPU (NCCL)::

    torchrun --nproc_per_node 2 examples/train.py --config examples/ds_config.json

Prints the loss of every optimizer step (averaged over ranks) and, at the end, the bytes each
rank holds for parameters, gradients, optimizer state and reusable buckets (``memory_report``).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

from zero_kernels import initialize


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 128, layers: int = 2, heads: int = 4, context: int = 64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf"), device=idx.device), diagonal=1)
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x, mask.to(x.dtype))
        return self.head(self.ln(x))


def synthetic_batch(step: int, rank: int, batch: int, context: int, vocab: int) -> torch.Tensor:
    """Tokens following a learnable rule (next = 3 * previous + 1 mod vocab) from a random start."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    steps = torch.arange(context + 1)
    return (start * 3**steps + (3**steps - 1) // 2) % vocab


def init_distributed() -> torch.device:
    """This rank's device, made current, and under ``torchrun`` the process group, bound to it.

    One GPU per rank: torchrun's ``LOCAL_RANK`` picks it, and it becomes the current device before
    anything touches CUDA (``ShardedFusedAdam`` refuses parameters on a device that is not the current
    one); NCCL is bound to it (``device_id``). On CPUs: gloo.
    """
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if "RANK" in os.environ:
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "ds_config.json"))
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps")
    args = parser.parse_args()
    device = init_distributed()
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    model, opt = initialize(model, args.config)
    micro, accum, vocab, context = 4, opt.gradient_accumulation_steps, 512, 64
    for step in range(args.steps):
        total = torch.zeros((), device=device)
        for m in range(accum):
            tokens = synthetic_batch(step * accum + m, rank, micro, context, vocab).to(device)
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            total += loss.detach() / accum
        if dist.is_initialized():
            dist.all_reduce(total)
            total /= dist.get_world_size()
        if rank == 0:
            print(f"step {step:3d}  loss {total.item():.4f}  grad_norm {opt.last_step.grad_norm}")
    report = opt.memory_report()
    print(f"rank {rank} memory (MiB): " + ", ".join(f"{k} {v / 2**20:.2f}" for k, v in report.items()))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
