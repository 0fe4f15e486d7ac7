"""``resize_token_embeddings`` inside ``gathered_params(modifier_rank=0)`` once the optimizer exists, stages 0-3, 2 gloo
ranks: refused on every rank with an error that names the parameter (stages 0-2 by its index in the optimizer: given
``model.parameters()``, the optimizer knows no names), says its shape changed and to resize before building the
optimizer. The embedding keeps its values from before the block, bit for bit; the model's other changes stay
(``config.vocab_size``), as the error says, and resizing back to the optimizer's size (inside ``gathered_params()``)
makes the model whole again:
a step then trains as usual, the same on both ranks.

Outside any block (stages 0-2, one process), the first backward or step after the resize raises the same
advice, naming the parameter (at stages 0-1 it was torch's "The size of tensor a (64) must match ...").
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.helpers.tiny_hf import VOCAB, gpt2

pytest.importorskip("transformers")

WORLD, STAGES = 2, (0, 1, 2, 3)
NAMES = {0: r"parameter 0 \(group 0\)", 3: "parameter 'transformer.wte.weight'"}


def _wte(model, opt) -> torch.Tensor:
    with opt.gathered_params():
        return model.transformer.wte.weight.detach().clone()


def refused(stage: int, rank: int, world: int) -> None:
    import zero_kernels as zk

    model = gpt2()
    opt = zk.ShardedFusedAdam(model if stage == 3 else model.parameters(), lr=1e-2, stage=stage, reduce_bucket_size=300,
                              stage3_param_persistence_threshold=20)  # fmt: skip
    before = _wte(model, opt)
    name = NAMES.get(stage, NAMES[0])
    expected = (
        rf"{name} is torch.float32 \({VOCAB + 16}, 16\) .* the optimizer holds torch.float32 \({VOCAB}, 16\) .*: its "
        r"shape changed, .*resize the model \(resize_token_embeddings\) before building the optimizer\. The replaced "
        r"values were not sent: .*put back.* config\.vocab_size"
    )
    with pytest.raises(ValueError, match=expected):
        with opt.gathered_params(modifier_rank=0):
            model.resize_token_embeddings(VOCAB + 16)
    assert torch.equal(_wte(model, opt), before), f"stage {stage} rank {rank}: the embedding changed"
    assert model.config.vocab_size == VOCAB + 16, "the error says the config keeps its change"

    with opt.gathered_params():
        model.resize_token_embeddings(VOCAB)
    assert model.config.vocab_size == VOCAB and model.lm_head.weight is model.transformer.wte.weight
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    after = _wte(model, opt)
    assert not torch.equal(after, before), f"stage {stage}: the step changed nothing"
    others = [torch.empty_like(after) for _ in range(world)]
    dist.all_gather(others, after)
    assert all(torch.equal(w, after) for w in others), f"stage {stage} rank {rank}: the ranks differ after the step"


def all_cases(rank: int, world: int) -> None:
    os.environ.update(TRANSFORMERS_VERBOSITY="error")
    for stage in STAGES:
        refused(stage, rank, world)


@pytest.mark.distributed
def test_resize_after_the_optimizer_is_refused_and_undone(spawn) -> None:
    spawn(all_cases, WORLD, timeout_s=180.0)


@pytest.mark.parametrize("stage", (0, 1, 2))
def test_resize_outside_a_block_is_refused_at_the_next_backward_or_step(stage: int) -> None:
    import zero_kernels as zk

    model = gpt2()
    opt = zk.ShardedFusedAdam(model.parameters(), lr=1e-2, stage=stage, reduce_bucket_size=300)
    model.resize_token_embeddings(VOCAB + 16)
    ids = torch.randint(0, VOCAB + 16, (2, 8), generator=torch.Generator().manual_seed(0))
    expected = rf"{NAMES[0]} was replaced after the optimizer was built .*: its shape changed, .*resize the model"
    with pytest.raises(ValueError, match=expected):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()


def test_resize_outside_a_block_at_stage3_is_refused_naming_the_remedy() -> None:
    """Between uses the embedding is freed (shape ``(0,)``): Hugging Face's own code failed with "not enough values to
    unpack (expected 2, got 1)" (probe CO); now a ``ValueError`` gives the full shape and says to resize before
    building the optimizer, nothing changed. The method comes off with the optimizer."""
    import zero_kernels as zk

    model = gpt2()
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=3, stage3_param_persistence_threshold=0)
    with pytest.raises(ValueError, match=rf"full shape \({VOCAB}, 16\)\) is freed .*resize the model before building"):
        model.resize_token_embeddings(VOCAB + 16)
    assert model.config.vocab_size == VOCAB
    with opt.gathered_params():
        model.resize_token_embeddings(VOCAB)  # the whole weight inside the block: Hugging Face's own method runs
    assert "resize_token_embeddings" in vars(model)
    opt._detach()  # what a failed ``initialize`` does
    assert "resize_token_embeddings" not in vars(model)
    model.resize_token_embeddings(VOCAB + 16)  # the optimizer is off: Hugging Face's own, on the whole weight
    assert model.transformer.wte.weight.shape == (VOCAB + 16, 16)


def test_resize_after_the_stage3_optimizer_was_deleted_says_the_values_went_with_it() -> None:
    """``del opt`` takes the shards (the model is left empty) but not the guarded method: it told the user to resize
    before building the optimizer, where the values are gone (probe CQ)."""
    import gc

    import zero_kernels as zk

    model = gpt2()
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=3, stage3_param_persistence_threshold=0)
    del opt
    gc.collect()
    with pytest.raises(ValueError, match="optimizer that kept its shards was deleted, and its values went with it"):
        model.resize_token_embeddings(VOCAB + 16)


def test_a_model_unpickled_from_a_guarded_one_is_guarded_again() -> None:
    """``torch.save(model)`` inside ``gathered_params()`` pickles the guarded method by name, so the loaded model comes
    back with its class's own method as an attribute of its own: a stage-3 optimizer built on it then gave it no
    guard (probe CQ); another model's guard (a copy's) is replaced too."""
    import io

    import zero_kernels as zk

    model = gpt2()
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=3, stage3_param_persistence_threshold=0)
    with opt.gathered_params():
        buffer = io.BytesIO()
        torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert "resize_token_embeddings" in vars(loaded), "the pickled guard comes back as the class's method"
    other = zk.ShardedFusedAdam(loaded, lr=1e-2, stage=3, stage3_param_persistence_threshold=0)
    with pytest.raises(ValueError, match=r"is freed .*resize the model before building"):
        loaded.resize_token_embeddings(VOCAB + 16)
    del other
