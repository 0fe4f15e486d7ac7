"""ZeRO++'s convergence check: the loss of a small causal language model after ``STEPS`` steps with qwZ + hpZ +
qgZ against the spread of plain stage 3 over ``SEEDS`` seeds.

Four gloo ranks as two emulated nodes of two (``GROUP_RANK``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` set in each
rank, as a launcher would: hpZ's groups are the nodes, qgZ's two hops go inside then across them). The model
(``TinyLM``) is a few pre-norm transformer blocks in plain PyTorch; the corpus is a fixed token stream of a
sparse Markov chain (``corpus``: every token has ``BRANCHES`` successors, with odds ``ODDS``, so the loss can
fall from ln(VOCAB) = 4.16 towards the chain's entropy, 1.28), the same for every run. A run's seed sets
the model's initial weights and the order of its batches; each rank draws its own rows. Every run trains at
stage 3 with every unit gathered (``stage3_param_persistence_threshold`` 0), AdamW and gradient clipping, fp32.

``final_loss`` is the mean over the last ``LAST`` steps of the loss averaged over the ranks. The summary row
gives the plain runs' spread (min-max) and, per ZeRO++ run, whether its final loss falls inside it, or by
how much it is outside (``outside``: its distance to the nearest end of the spread, 0 inside), and its final
loss minus plain stage 3's of the same seed (``vs_same_seed``: the same initial weights and batches). Not in the
default run (a few minutes on 2 cores): ``python -m benchmarks zeropp_loss``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from .common import end_rank, expect, free_port, progress

DESCRIPTION = "ZeRO++ (qwZ + hpZ + qgZ) loss after 200 steps of a small LM vs the spread of 3 seeds of plain stage 3"
IN_DEFAULT_RUN = False

WORLD, PER_NODE = 4, 2
VOCAB, BRANCHES, CORPUS_TOKENS = 64, 4, 1 << 16
WIDTH, LAYERS, HEADS, CONTEXT = 64, 2, 4, 32
ODDS = (0.4, 0.3, 0.2, 0.1)  # of a token's successors
ROWS = 8  # per rank and step
STEPS, LAST, SEEDS, ZEROPP_SEEDS = 200, 10, (0, 1, 2), (0, 1, 2)
LR, CLIP = 3e-3, 1.0
ZEROPP = {"zero_quantized_weights": True, "zero_hpz_partition_size": PER_NODE, "zero_quantized_gradients": True}


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, layers: int = LAYERS, heads: int = HEADS,
                 context: int = CONTEXT):  # fmt: skip
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def corpus(tokens: int = CORPUS_TOKENS, vocab: int = VOCAB, branches: int = BRANCHES) -> torch.Tensor:
    """A fixed stream of a Markov chain: each token's ``branches`` successors (with uneven odds) are drawn once."""
    gen = torch.Generator().manual_seed(1234)
    successors = torch.stack([torch.randperm(vocab, generator=gen)[:branches] for _ in range(vocab)])
    odds = torch.tensor(ODDS[:branches])
    picks = torch.multinomial(odds / odds.sum(), tokens, replacement=True, generator=gen)
    out = torch.empty(tokens, dtype=torch.long)
    out[0] = 0
    for i in range(1, tokens):
        out[i] = successors[out[i - 1], picks[i]]
    return out


def batch(stream: torch.Tensor, seed: int, step: int, rank: int, rows: int, context: int) -> torch.Tensor:
    """``rows`` windows of ``context + 1`` tokens of ``stream``, drawn by (seed, step, rank)."""
    gen = torch.Generator().manual_seed(((seed * 100_003) + step) * 17 + rank)
    starts = torch.randint(0, stream.numel() - context - 1, (rows,), generator=gen)
    return torch.stack([stream[s : s + context + 1] for s in starts.tolist()])


def train(rank: int, stream: torch.Tensor, seed: int, zeropp: bool, steps: int, shape: dict) -> list[float]:
    """One run on this rank; returns the loss of every step averaged over the ranks."""
    import zero_kernels as zk

    torch.manual_seed(seed)
    model = TinyLM(**shape["model"])
    options = ZEROPP if zeropp else {}
    opt = zk.ShardedFusedAdam(model, lr=LR, weight_decay=0.01, stage=3, max_grad_norm=CLIP,
                              stage3_param_persistence_threshold=0, **options)  # fmt: skip
    losses = []
    for step in range(steps):
        tokens = batch(stream, seed, step, rank, shape["rows"], shape["model"]["context"])
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


def _rank(rank: int, port: int, runs: list[tuple[int, bool]], steps: int, shape: dict, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(GROUP_RANK=str(rank // PER_NODE), LOCAL_RANK=str(rank % PER_NODE), LOCAL_WORLD_SIZE=str(PER_NODE))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=600)
    )
    stream = corpus(shape["corpus"], shape["model"]["vocab"])
    results = []
    for seed, zeropp in runs:
        if rank == 0:
            progress(f"{steps} steps", _name(seed, zeropp))
        started = time.perf_counter()
        losses = train(rank, stream, seed, zeropp, steps, shape)
        results.append({"seed": seed, "zeropp": zeropp, "losses": losses, "wall_s": time.perf_counter() - started})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
    end_rank()


def _name(seed: int, zeropp: bool) -> str:
    return f"stage3{' + qwZ + hpZ + qgZ' if zeropp else ''} seed {seed}"


def measure(steps: int, seeds: tuple, zeropp_seeds: tuple, shape: dict) -> list[dict]:
    """Spawn the ranks, train every run in turn; the runs' rows and the summary row."""
    runs = [(s, False) for s in seeds] + [(s, True) for s in zeropp_seeds]
    expect(len(runs))
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "losses.json")
        mp.spawn(_rank, args=(free_port(), runs, steps, shape, out), nprocs=WORLD, join=True)
        with open(out) as f:
            results = json.load(f)
    last = min(LAST, steps)
    rows = []
    for r in results:
        final = statistics.fmean(r["losses"][-last:])
        rows.append({"run": _name(r["seed"], r["zeropp"]), "first_loss": r["losses"][0], "final_loss": final,
                     "wall_s": r["wall_s"]})  # fmt: skip
    return rows + [summary_row(rows)]


def summary_row(rows: list[dict]) -> dict:
    """The plain runs' spread, and each ZeRO++ run's final loss against it."""
    plain = {r["run"]: r["final_loss"] for r in rows if "qwZ" not in r["run"]}
    low, high = min(plain.values()), max(plain.values())
    verdicts = []
    for r in rows:
        if "qwZ" in r["run"]:
            same_seed = plain.get(r["run"].replace(" + qwZ + hpZ + qgZ", ""))
            if same_seed is not None:
                r["vs_same_seed"] = r["final_loss"] - same_seed
            outside = max(low - r["final_loss"], r["final_loss"] - high, 0.0)
            r["outside"] = outside
            verdicts.append("inside" if outside == 0 else f"outside by {outside:.4f}")
    return {"run": "plain spread", "spread_low": low, "spread_high": high, "spread": high - low,
            "zeropp": "; ".join(verdicts)}  # fmt: skip


def default_shape() -> dict[str, Any]:
    model = {"vocab": VOCAB, "width": WIDTH, "layers": LAYERS, "heads": HEADS, "context": CONTEXT}
    return {"model": model, "rows": ROWS, "corpus": CORPUS_TOKENS}


def run(quick: bool) -> list[dict]:
    """The same check either way (200 steps is what the claim is about)."""
    return measure(STEPS, SEEDS, ZEROPP_SEEDS, default_shape())


def summary(rows: list[dict]) -> list[dict]:
    spread = rows[-1]
    line = {"case": f"final loss after {STEPS} steps", "plain_low": spread["spread_low"]}
    line.update(plain_high=spread["spread_high"], zeropp=spread["zeropp"])
    return [line]


NOTES = [
    f"final_loss: the mean of the last {LAST} steps' loss (averaged over the {WORLD} ranks); outside: the ZeRO++ "
    "run's distance to the plain runs' spread (0: inside); vs_same_seed: its final loss minus plain stage 3's of "
    "the same seed",
    f"the corpus' entropy per token (the lowest loss reachable): {-sum(p * math.log(p) for p in ODDS):.3f}",
]
