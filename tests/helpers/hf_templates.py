"""The Hugging Face Trainer's DeepSpeed templates (``ds_config_zero2.json``, ``ds_config_zero3.json``) as users
copy them: the sections every template shares, and its stage 3 options."""

from __future__ import annotations

import copy

ZERO3_OPTIONS = {
    "overlap_comm": True,
    "contiguous_gradients": True,
    "sub_group_size": 1e9,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": True,
}

_TRAINER_KEYS = {
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}

_ADAMW_AUTO = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}


def hf_template(zero_optimization: dict, **sections: dict) -> dict:
    """A fresh template: ``sections`` (``fp16``, ``bf16``, ``scheduler`` ...), AdamW with every value "auto",
    ``zero_optimization``, and the Trainer's keys ("auto" batch sizes, accumulation and clipping)."""
    return copy.deepcopy(
        {**sections, "optimizer": _ADAMW_AUTO, "zero_optimization": zero_optimization, **_TRAINER_KEYS}
    )
