"""``ZeroAccelerator.save_model`` writes every weight, at stages 0-3 on 2 gloo ranks.

A tiny GPT-2 (tied embeddings) takes one step through ``ZeroAccelerator``; ``save_model`` on every
rank, in safetensors and in torch's format; then every rank loads the directory into a GPT-2 built
from another seed (``from_pretrained``), whose every weight must equal the trained model's bit for
bit. (Accelerate's own ``get_state_dict`` returns the parameters, views into the optimizer's flat
buffer at stages 0-2, and its ``save_model`` kept one tensor per storage: one weight of 29.)
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.tiny_hf import VOCAB, gpt2

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

WORLD, STAGES = 2, (0, 1, 2, 3)


def _env(rank: int, world: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")


def _trained(stage: int):
    """(accelerator, model, its optimizer) after one step, each rank on its own batch."""
    from accelerate.state import AcceleratorState, GradientState

    import zero_kernels as zk
    from zero_kernels.integrations.accelerate import ZeroAccelerator

    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = ZeroAccelerator(cpu=True)
    model = gpt2()
    opt = zk.ShardedFusedAdam(model if stage == 3 else model.parameters(), lr=1e-2, stage=stage, reduce_bucket_size=300,
                              stage3_param_persistence_threshold=20)  # fmt: skip
    model, aopt = accelerator.prepare(model, opt)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(accelerator.process_index))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    aopt.step()
    aopt.zero_grad()
    return accelerator, model, opt


def _check_saved(stage: int, directory: str, safe: bool) -> None:
    from transformers import GPT2LMHeadModel

    accelerator, model, opt = _trained(stage)
    state = accelerator.get_state_dict(model)  # at stage 3 only the writer holds a copy, as under DeepSpeed
    assert (state is None) == (stage == 3 and not accelerator.is_main_process), f"stage {stage}"
    accelerator.save_model(model, directory, safe_serialization=safe)
    if accelerator.is_main_process:
        model.config.save_pretrained(directory)
    accelerator.wait_for_everyone()
    with opt.gathered_params():
        expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    loaded = GPT2LMHeadModel.from_pretrained(directory).state_dict()
    what = f"stage {stage} {'safetensors' if safe else 'torch format'}"
    assert loaded.keys() == expected.keys(), what
    unequal = [k for k, v in expected.items() if not torch.equal(loaded[k], v)]
    assert not unequal, f"{what}: {len(unequal)} of {len(expected)} weights differ after loading, e.g. {unequal[:3]}"
    assert not torch.equal(loaded["transformer.wte.weight"], gpt2().transformer.wte.weight), f"{what}: not trained"
    accelerator.wait_for_everyone()


def all_cases(rank: int, world: int, root: str) -> None:
    _env(rank, world)
    for stage in STAGES:
        for safe in (True, False):
            _check_saved(stage, os.path.join(root, f"stage{stage}_{safe}"), safe)


@pytest.mark.distributed
def test_save_model_writes_every_weight(spawn, tmp_path) -> None:
    spawn(all_cases, WORLD, str(tmp_path), timeout_s=300.0)
