"""Stage 3 with Hugging Face embedding modules that read their position table's shape in their forward (CLIP, SigLIP,
BLIP and their kin: ``max_position_embedding = self.position_embedding.weight.shape[0]`` before the table is called).

The table, freed between uses, has shape ``(0,)`` there: every sequence was refused ("Sequence length must be less
than max_position_embeddings (got 8 and max_position_embeddings: 0)"), unless the user registered the table as an
external parameter of the embeddings module. Stage 3 now registers it itself (one INFO line), and a tiny CLIP text
tower trains as ``torch.optim.AdamW`` on the whole batch (2 gloo ranks, 2 steps, fp32 tolerances of ``test_stage3.py``
after each; parameters whose gradients are at rounding-noise level, which Adam scales up to the learning rate whatever
the order of summation, are frozen or kept out of the loss).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.stages.stage3.test_stage3_models import LR, ROWS, _train

pytest.importorskip("transformers")

WORLD, VOCAB = 2, 64


def _clip_text():
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                            num_attention_heads=2, max_position_embeddings=12, projection_dim=8,
                            bos_token_id=0, eos_token_id=1, pad_token_id=1)  # fmt: skip
    torch.manual_seed(0)
    model = CLIPTextModel(config)
    for name, p in model.named_parameters():  # near-uniform attention of random weights gives queries and keys
        p.requires_grad_("q_proj" not in name and "k_proj" not in name)  # gradients at rounding-noise level
    return model


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    """The output along a fixed direction, squared (the output's own square is nearly constant after a LayerNorm)."""
    direction = torch.randn(16, generator=torch.Generator().manual_seed(1))
    return (model(input_ids=ids).last_hidden_state @ direction).square().mean()


def clip_text_trains(rank: int, world: int) -> None:
    import zero_kernels as zk
    from zero_kernels.model_hints import external_parameters

    model = _clip_text()
    ref = copy.deepcopy(model)
    opt = zk.ShardedFusedAdam(model, lr=LR, weight_decay=0.1, stage=3, stage3_param_persistence_threshold=0,
                              reduce_bucket_size=512)  # fmt: skip
    embeddings = getattr(model, "text_model", model).embeddings  # transformers 5 has no text_model level
    assert [p is embeddings.position_embedding.weight for p in external_parameters(embeddings)] == [True]
    batches = [torch.randint(1, VOCAB, (world * ROWS, 8), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    _train(rank, world, model, ref, opt, batches, "CLIP text tower", forward=_loss)  # refused every sequence before


@pytest.mark.distributed
def test_clip_text_tower_trains_at_stage3_as_adamw(spawn) -> None:
    spawn(clip_text_trains, WORLD, timeout_s=180.0)
