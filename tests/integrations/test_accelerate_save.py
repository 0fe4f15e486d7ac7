"""``ZeroAccelerator.save_model`` writes every weight, at stages 0-3 on 2 gloo ranks.

A tiny GPT-2 (tied embeddings) takes one step through ``ZeroAccelerator``; ``save_model`` on every
rank, in safetensors and in torch's format; then every rank loads the directory into a GPT-2 built
from another seed (``from_pretrained``), whose every weight must equal the trained model's bit for
bit. (Accelerate's own ``get_state_dict`` returns the parameters, views into the optimizer's flat
buffer at stages 0-2, and its ``save_model`` kept one tensor per storage: one weight of 29.)

Accelerate's save idiom at stage 3, ``unwrap_model(model).save_pretrained(directory, is_main_process=...,
save_function=accelerator.save, state_dict=accelerator.get_state_dict(model))`` on every rank, for the full GPT-2
and for a PEFT LoRA GPT-2, with and without offload: the main process writes the trained weights bit for bit and
the other rank passes through (with None there, transformers and PEFT called ``model.state_dict()``, which stage 3
refuses between uses, and it raised).
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


def _trained(stage: int, lora: bool = False, **zero):
    """(accelerator, model, its optimizer) after one step, each rank on its own batch; ``lora``: a PEFT LoRA GPT-2;
    ``zero``: more arguments of the optimizer (offload)."""
    from accelerate.state import AcceleratorState, GradientState

    import zero_kernels as zk
    from zero_kernels.integrations.accelerate import ZeroAccelerator

    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = ZeroAccelerator(cpu=True)
    model = _lora(gpt2()) if lora else gpt2()
    opt = zk.ShardedFusedAdam(model if stage == 3 else model.parameters(), lr=1e-2, stage=stage, reduce_bucket_size=300,
                              stage3_param_persistence_threshold=20, **zero)  # fmt: skip
    model, aopt = accelerator.prepare(model, opt)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(accelerator.process_index))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    aopt.step()
    aopt.zero_grad()
    return accelerator, model, opt


def _check_saved(stage: int, directory: str, safe: bool) -> None:
    from transformers import GPT2LMHeadModel

    accelerator, model, opt = _trained(stage)
    state = accelerator.get_state_dict(model)  # at stage 3 only the writer holds a copy
    assert (state == {}) == (stage == 3 and not accelerator.is_main_process), f"stage {stage}"
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


def _lora(model):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(model, config)


def _check_idiom(directory: str, lora: bool, zero: dict) -> None:
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    accelerator, model, opt = _trained(3, lora, **zero)
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(directory, is_main_process=accelerator.is_main_process, save_function=accelerator.save,
                              state_dict=accelerator.get_state_dict(model))  # fmt: skip
    accelerator.wait_for_everyone()
    with pytest.raises(RuntimeError, match="would hold an empty tensor"):
        unwrapped.state_dict()  # still refused between uses: torch.save of it would write empty weights
    with opt.gathered_params():
        trained = {k: v.detach().clone() for k, v in unwrapped.state_dict().items()}
    what = f"{'LoRA' if lora else 'full'} {zero or 'no offload'}"
    if lora:
        expected = get_peft_model_state_dict(unwrapped, state_dict=trained)
        loaded = load_file(os.path.join(directory, "adapter_model.safetensors"))
        untrained = get_peft_model_state_dict(_lora(gpt2()))
    else:
        expected = {k: v for k, v in trained.items() if k != "lm_head.weight"}  # tied to the embeddings
        loaded = {k: v for k, v in GPT2LMHeadModel.from_pretrained(directory).state_dict().items() if k in expected}
        untrained = gpt2().state_dict()
    assert loaded.keys() == expected.keys(), what
    unequal = [k for k, v in expected.items() if not torch.equal(loaded[k], v)]
    assert not unequal, f"{what}: {len(unequal)} of {len(expected)} weights differ after loading, e.g. {unequal[:3]}"
    assert not any(torch.equal(loaded[k], untrained[k]) for k in expected if "weight" in k), f"{what}: not trained"
    accelerator.wait_for_everyone()


def idiom_cases(rank: int, world: int, root: str) -> None:
    _env(rank, world)
    offloads = ({}, {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}})
    for lora in (False, True):
        for i, zero in enumerate(offloads):
            _check_idiom(os.path.join(root, f"{'lora' if lora else 'full'}{i}"), lora, zero)


@pytest.mark.distributed
def test_save_pretrained_idiom_works_on_every_rank_at_stage_3(spawn, tmp_path) -> None:
    pytest.importorskip("peft")
    spawn(idiom_cases, WORLD, str(tmp_path), timeout_s=120.0)
