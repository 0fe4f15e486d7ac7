"""``model.generate`` at stage 3 on 2 gloo ranks whose generations differ in length, with ``synced_gpus=True``
given and without it (stage 3 on several ranks makes it the default, as DeepSpeed's ZeRO-3 does).

Rank 0 stops at an end-of-text token after 2 new tokens, rank 1 runs to ``max_new_tokens=6``. A
stage-3 forward all-gathers the parameters, a collective: ``synced_gpus=True`` keeps the finished
rank running forward passes until every rank is done (Hugging Face turns it on by itself only under
DeepSpeed ZeRO-3 or FSDP). Each rank's tokens must equal those of an unsharded copy of the model
given the same arguments, and a training step after it must leave the ranks in step (the same
weights on both). Without ``synced_gpus`` the ranks' gathers fall out of step: a hang, or an abort
inside the backend. A ``Seq2SeqTrainer`` under ``ZeroTrainer`` predicting with generate (which passes
``synced_gpus=False`` itself outside DeepSpeed and FSDP) generates in step too.
"""

from __future__ import annotations

import copy
import io
import os

import pytest
import torch
import torch.distributed as dist

from tests.helpers.tiny_hf import VOCAB, gpt2

pytest.importorskip("transformers")

WORLD, NEW_TOKENS, EARLY = 2, 6, 2
PROMPT = torch.tensor([[1, 2, 3]])


def _stops_early(plain) -> dict:
    """Generation arguments: rank 0 ends at an end-of-text token after ``EARLY`` new tokens, rank 1 at the length."""
    full = plain.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    eos = int(full[0, PROMPT.shape[1] + EARLY - 1])
    assert eos not in full[0, PROMPT.shape[1] : PROMPT.shape[1] + EARLY - 1].tolist(), "pick another EARLY"
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return {**kwargs, "eos_token_id": eos} if dist.get_rank() == 0 else kwargs


def generate_in_step(rank: int, world: int) -> None:
    import zero_kernels as zk

    os.environ.update(TRANSFORMERS_VERBOSITY="error")
    model = gpt2().eval()
    plain = copy.deepcopy(model)
    kwargs = _stops_early(plain)
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=3, reduce_bucket_size=300, stage3_param_persistence_threshold=20)
    with torch.no_grad():
        expected = plain.generate(PROMPT, **kwargs)
        for given in ({"synced_gpus": True}, {}):  # without it: on by default at stage 3 on several ranks
            out = model.generate(PROMPT, **given, **kwargs)
            assert torch.equal(out, expected), f"rank {rank} {given}: {out.tolist()} vs unsharded {expected.tolist()}"
            assert out.shape[1] == PROMPT.shape[1] + (EARLY if rank == 0 else NEW_TOKENS), out.tolist()

    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    with opt.gathered_params():
        weight = model.transformer.wte.weight.detach().clone()
    others = [torch.empty_like(weight) for _ in range(world)]
    dist.all_gather(others, weight)
    assert all(torch.equal(w, weight) for w in others), f"rank {rank}: the ranks' weights differ after the step"


@pytest.mark.distributed
def test_generate_lengths_differing_by_rank(spawn) -> None:
    spawn(generate_in_step, WORLD, timeout_s=180.0)


def test_the_synced_generate_is_the_models_own_and_comes_off() -> None:
    """The default is a method bound to the module, a value given wins, a deep copy (unsharded, which may generate on
    one rank) and a model loaded from a pickle generate as Hugging Face's own until synced themselves, and
    ``restore`` takes it off."""
    from unittest import mock

    from zero_kernels.stages.stage3 import generation

    model = gpt2().eval()
    synced = generation.sync_generate(model)
    assert synced == [model] and vars(model)["generate"].__self__ is model
    copied = copy.deepcopy(model)
    pickled = io.BytesIO()
    torch.save(model, pickled)
    loaded = torch.load(io.BytesIO(pickled.getvalue()), weights_only=False)
    with mock.patch.object(type(model), "generate", autospec=True) as original:
        model.generate(PROMPT)
        model.generate(PROMPT, synced_gpus=False)
        model.generate(PROMPT, synced_gpus=None)
        copied.generate(PROMPT)
    seen = [(c.args[0], c.kwargs.get("synced_gpus")) for c in original.call_args_list]
    assert seen == [(model, True), (model, False), (model, True), (copied, None)], seen
    assert vars(loaded)["generate"].__func__ is type(loaded).generate  # what a pickle keeps: Hugging Face's own
    assert generation.sync_generate(loaded) == [loaded]  # its leftover (the class's method) is not the user's
    generation.restore(synced)
    assert "generate" not in vars(model) and model.generate.__func__ is type(model).generate


def _prompts(model, eos_after: int) -> tuple[torch.Tensor, int]:
    """Two prompts and an end-of-text token: the first's greedy generation reaches it after ``eos_after`` new
    tokens, the second's not within ``NEW_TOKENS``."""
    g = torch.Generator().manual_seed(1)
    first = torch.randint(1, VOCAB, (1, 3), generator=g)
    with torch.no_grad():
        out = model.generate(first, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    eos = int(out[0, 3 + eos_after - 1])
    assert eos not in out[0, 3 : 3 + eos_after - 1].tolist(), "pick another seed"
    for _ in range(100):
        second = torch.randint(1, VOCAB, (1, 3), generator=g)
        with torch.no_grad():
            new = model.generate(second, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[0, 3:]
        if eos not in new.tolist():
            return torch.cat([first, second]), eos
    raise AssertionError("no second prompt found")


def seq2seq_predict_in_step(rank: int, world: int, out: str) -> None:
    """A ``Seq2SeqTrainer`` with ``predict_with_generate`` passes ``synced_gpus=False`` itself outside DeepSpeed
    and FSDP; under ``ZeroTrainer`` at stage 3 it generates in step."""
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    from zero_kernels.integrations.hf import ZeroTrainer

    class Zero(ZeroTrainer, Seq2SeqTrainer):
        pass

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    model = gpt2()
    model.config.pad_token_id = 0
    prompts, eos = _prompts(model, EARLY)
    train = [{"input_ids": (ids := torch.randint(1, VOCAB, (8,))), "labels": ids} for _ in range(4)]
    args = Seq2SeqTrainingArguments(output_dir=out, max_steps=1, per_device_train_batch_size=2, report_to=[],
                                    per_device_eval_batch_size=1, predict_with_generate=True, use_cpu=True,
                                    ddp_backend="gloo", disable_tqdm=True, save_strategy="no")  # fmt: skip
    zero = {"stage": 3, "reduce_bucket_size": 300, "stage3_param_persistence_threshold": 20}
    trainer = Zero(model=model, args=args, train_dataset=train, zero_optimization=zero)
    trainer.train()
    with trainer.zero_optimizer.gathered_params():
        plain = copy.deepcopy(model).eval()
    kwargs = dict(max_new_tokens=NEW_TOKENS, eos_token_id=eos, do_sample=False)
    got = trainer.predict([{"input_ids": p} for p in prompts], **kwargs).predictions
    for row, prompt in zip(got, prompts):  # every rank's generation, gathered
        with torch.no_grad():
            expected = plain.generate(prompt[None], pad_token_id=0, **kwargs)[0].tolist()
        assert row.tolist()[: len(expected)] == expected, f"rank {rank}: {row.tolist()} vs unsharded {expected}"
    assert [len(plain.generate(p[None], pad_token_id=0, **kwargs)[0]) for p in prompts] == [3 + EARLY, 3 + NEW_TOKENS]


@pytest.mark.distributed
def test_seq2seq_trainer_predicts_with_generate_in_step(spawn, tmp_path) -> None:
    spawn(seq2seq_predict_in_step, WORLD, str(tmp_path), timeout_s=240.0)
