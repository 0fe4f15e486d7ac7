"""``zk.save_pretrained`` on a data-parallel group whose rank 0 is not the world's rank 0 writes the model.

3 gloo ranks; the optimizer trains a tiny GPT-2 (tied embeddings) at stage 3 on the group of ranks 1 and 2 (rank 0
takes no part); its rank 0, global rank 1, writes. Transformers 5 writes only on global rank 0
(``PreTrainedModel.should_save_on_this_rank``), so the directory stayed empty and ``save_pretrained`` returned as
if it had written. Every member then loads the directory (``from_pretrained``) and must find the trained weights,
bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.helpers.tiny_hf import VOCAB, gpt2

pytest.importorskip("transformers")


def _save_on_a_group(rank: int, world: int, directory: str) -> None:
    from transformers import GPT2LMHeadModel

    import zero_kernels as zk

    group = dist.new_group([1, 2])
    if rank == 0:
        dist.barrier()
        return
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    model = gpt2()
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=3, process_group=group)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    zk.save_pretrained(model, opt, directory)
    with opt.gathered_params():
        trained = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert os.listdir(directory), "save_pretrained wrote nothing"
    loaded = dict(GPT2LMHeadModel.from_pretrained(directory).named_parameters())
    for name, value in trained.items():
        assert torch.equal(loaded[name], value), f"{name} differs from the trained weights"
    dist.barrier()


@pytest.mark.distributed
def test_save_pretrained_on_a_group_without_global_rank_0_writes_the_model(spawn, tmp_path) -> None:
    spawn(_save_on_a_group, 3, str(tmp_path / "saved"))


def _declining_on_world_rank_0(rank: int, world: int, directory: str) -> None:
    from transformers import GPT2LMHeadModel

    import zero_kernels as zk

    class Declining(GPT2LMHeadModel):
        def should_save_on_this_rank(self, is_main_process: bool) -> bool:
            return False

    model = gpt2()
    model.__class__ = Declining
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=1)
    zk.save_pretrained(model, opt, directory)
    assert os.listdir(directory) == [], "the class's own should_save_on_this_rank was overridden on the world's rank 0"
    assert "should_save_on_this_rank" not in vars(model)


@pytest.mark.distributed
def test_save_pretrained_on_the_worlds_rank_0_keeps_the_models_own_rule(spawn, tmp_path) -> None:
    spawn(_declining_on_world_rank_0, 1, str(tmp_path / "saved"))
