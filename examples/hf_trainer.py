"""Train a small GPT-2 (built from a config, random weights, no download) with the Hugging Face Trainer.

Needs ``pip install 'zero_kernels[hf]'``. Run on CPUs (gloo) or GPUs (NCCL)::

    torchrun --nproc_per_node 2 examples/hf_trainer.py --stage 3 --output-dir /tmp/zk-hf

The only zero_kernels lines are the import and ``ZeroTrainer(..., zero_optimization=...)`` in place of
``Trainer(...)``. The script trains on synthetic tokens, saves a checkpoint halfway, writes the model
with ``save_model`` and reloads it with ``from_pretrained`` to check the weights round-trip.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from zero_kernels.integrations.hf import ZeroTrainer


class Tokens(torch.utils.data.Dataset):
    """Random token sequences; each example is its own label (causal language modelling)."""

    def __init__(self, count: int, length: int, vocab: int):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (count, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output-dir", default="hf_trainer_out")
    args = parser.parse_args()

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        weight_decay=0.1,
        max_grad_norm=1.0,
        logging_steps=5,
        save_strategy="steps",
        save_steps=args.steps // 2,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        ddp_backend=None if torch.cuda.is_available() else "gloo",
        disable_tqdm=True,
    )
    zero = {"stage": args.stage, "stage3_gather_16bit_weights_on_model_save": True}
    trainer = ZeroTrainer(model=model, args=training, train_dataset=Tokens(256, 32, 256), zero_optimization=zero)
    trainer.train()

    final = os.path.join(args.output_dir, "final")
    trainer.save_model(final)
    reloaded = GPT2LMHeadModel.from_pretrained(final)
    with trainer.zero_optimizer.gathered_params():
        mine = model.state_dict()
        same = all(torch.equal(mine[k].cpu(), v) for k, v in reloaded.state_dict().items())
    if trainer.is_world_process_zero():
        print(f"stage {args.stage}: trained {args.steps} steps; from_pretrained({final!r}) round-trips: {same}")


if __name__ == "__main__":
    main()
