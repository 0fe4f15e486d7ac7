"""The offload keys as users write them: the Hugging Face templates, the NVMe template (nested ``aio``,
``thread_count``), the deprecated spellings, keyword arguments, and every bad value named."""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path

import pytest
import torch

import zero_kernels as zk
from tests.helpers.hf_templates import ZERO3_OPTIONS, hf_template
from zero_kernels.config import ZeroConfig, ZeroOptions
from zero_kernels.config.offload import AioConfig, OffloadOptimizerConfig, OffloadParamConfig
from zero_kernels.offload import cpu_threads

HF_FP16 = {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16, "hysteresis": 2,
           "min_loss_scale": 1}  # fmt: skip
HF_ZERO2 = hf_template(
    {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
    },
    fp16=HF_FP16,
)
HF_ZERO3 = hf_template(
    {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        **ZERO3_OPTIONS,
    },
    fp16=HF_FP16,
)


def _nvme_template(path: str) -> dict:
    config = copy.deepcopy(HF_ZERO3)
    zero = config["zero_optimization"]
    zero["offload_optimizer"] = {"device": "nvme", "nvme_path": path, "pin_memory": True, "buffer_count": 4,
                                 "fast_init": False}  # fmt: skip
    zero["offload_param"] = {"device": "nvme", "nvme_path": path, "pin_memory": True, "buffer_count": 5,
                             "buffer_size": 1e8, "max_in_cpu": 1e9}  # fmt: skip
    zero["aio"] = {"block_size": 262144, "queue_depth": 32, "thread_count": 1, "single_submit": False,
                   "overlap_events": True}  # fmt: skip
    return config


def test_hf_zero2_template_offloads_the_optimizer() -> None:
    zero = ZeroConfig.from_deepspeed(HF_ZERO2).zero
    assert zero.offload_optimizer == OffloadOptimizerConfig(device="cpu", pin_memory=True)
    assert zero.offload_param == OffloadParamConfig() and zero.aio == AioConfig()


def test_hf_zero3_template_reads_both_blocks_and_sub_group_size() -> None:
    zero = ZeroConfig.from_deepspeed(HF_ZERO3, hidden_size=64).zero
    assert zero.offload_optimizer.device == "cpu" and zero.offload_optimizer.pin_memory is True
    assert zero.offload_param == OffloadParamConfig(device="cpu", pin_memory=True)
    assert zero.sub_group_size == 1_000_000_000 and type(zero.sub_group_size) is int


def test_offload_numbers_written_as_strings_are_read_as_deepspeed_reads_them() -> None:
    # DeepSpeed's offload config models take "5" for their integers and "0.5" for ratio and cpuadam_cores_perc
    zero = ZeroConfig.from_deepspeed(
        {
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {
                    "device": "cpu",
                    "buffer_count": "5",
                    "ratio": "0.5",
                    "cpuadam_cores_perc": "0.25",
                },
                "offload_param": {"device": "cpu", "buffer_count": "6", "buffer_size": "1000.0", "max_in_cpu": " 7"},
            }
        }
    ).zero
    off = zero.offload_optimizer
    assert (off.buffer_count, off.ratio, off.cpuadam_cores_perc) == (5, 0.5, 0.25)
    param = zero.offload_param
    assert (param.buffer_count, param.buffer_size, param.max_in_cpu) == (6, 1000, 7) and type(param.buffer_size) is int


def test_axolotl_zero3_template_reads_its_zeros() -> None:
    """Axolotl's ``zero3_bf16_cpuoffload_all.json`` writes ``sub_group_size``, ``max_live_parameters`` and
    ``max_reuse_distance`` as 0, which DeepSpeed accepts (every parameter its own sub-group, nothing kept live)."""
    zero_optimization = {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "sub_group_size": 0,
        "max_live_parameters": 0,
        "max_reuse_distance": 0,
        "gather_16bit_weights_on_model_save": True,
    }
    zero = ZeroConfig.from_deepspeed({"zero_optimization": zero_optimization}).zero
    assert (zero.sub_group_size, zero.stage3_max_live_parameters, zero.stage3_max_reuse_distance) == (0, 0, 0)


def test_nvme_template_nested_aio_and_thread_count_warn_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        zero = ZeroConfig.from_deepspeed(_nvme_template("/local_nvme"), hidden_size=64).zero
    assert zero.offload_optimizer == OffloadOptimizerConfig(
        device="nvme", nvme_path="/local_nvme", pin_memory=True, buffer_count=4
    )
    assert zero.offload_param.buffer_size == 100_000_000 and zero.offload_param.max_in_cpu == 1_000_000_000
    assert zero.aio == AioConfig(block_size=262144, queue_depth=32, intra_op_parallelism=1)
    aio_warnings = [r.getMessage() for r in caplog.records if "aio" in r.getMessage()]
    assert len(aio_warnings) == 1, aio_warnings
    text = aio_warnings[0]
    assert "DeepSpeed 0.19 reads aio only at the top level" in text and "intra_op_parallelism" in text
    # DeepSpeed 0.19.8 refuses the nested block (pydantic extra_forbidden), it does not ignore it
    assert "refuses this block" in text and "would ignore this block" not in text


def test_top_level_aio_is_deepspeeds_place_and_silent(caplog: pytest.LogCaptureFixture) -> None:
    config = {"zero_optimization": {"stage": 3}, "aio": {"intra_op_parallelism": 4, "queue_depth": 16}}
    with caplog.at_level(logging.INFO, logger="zero_kernels"):
        zero = ZeroConfig.from_deepspeed(config).zero
    assert zero.aio == AioConfig(intra_op_parallelism=4, queue_depth=16)
    assert not [r for r in caplog.records if "aio" in r.getMessage()]


def test_deprecated_spellings() -> None:
    zero = ZeroOptions.from_dict(
        {"stage": 3, "cpu_offload": True, "cpu_offload_param": True, "cpu_offload_use_pin_memory": True}
    )
    assert zero.offload_optimizer == OffloadOptimizerConfig(device="cpu", pin_memory=True)
    assert zero.offload_param == OffloadParamConfig(device="cpu", pin_memory=True)
    assert ZeroOptions.from_dict({"stage": 2, "cpu_offload": True}).offload_optimizer.device == "cpu"


def test_shorthand_keywords_and_round_trip(tmp_path) -> None:
    options = ZeroOptions(stage=2, offload_optimizer="cpu")
    assert options.offload_optimizer == OffloadOptimizerConfig(device="cpu")
    full = ZeroConfig.from_deepspeed(_nvme_template(str(tmp_path)), hidden_size=64).zero
    assert ZeroOptions.from_dict(dataclasses.asdict(full)) == full
    opt = zk.ShardedFusedAdam(
        torch.nn.Linear(4, 4), stage=2, offload_optimizer={"device": "cpu", "cpuadam_cores_perc": 0.5}
    )
    assert opt.options.offload_optimizer.cpuadam_cores_perc == 0.5 and opt._pipeline.tier is not None


def test_initialize_with_the_zero3_template_trains() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    config = copy.deepcopy(HF_ZERO3)
    config["fp16"]["enabled"] = False
    model, opt = zk.initialize(model, config, lr=1e-2, train_micro_batch_size_per_gpu=1, hidden_size=8)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert opt._pipeline.tier is not None and opt.memory_report()["optimizer"] == 0
    assert opt._pipeline.params_offloaded  # its offload_param acts: the parameter shards in host memory


# DeepSpeed's SuperOffload example (DeepSpeedExamples training/DeepSpeed-SuperOffload) writes this block.
SUPER_OFFLOAD = {"device": "cpu", "pin_memory": True, "ratio": 0.90, "super_offload": True, "cpuadam_cores_perc": 0.90}


def test_super_offload_template_is_read() -> None:
    zero = ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 3, "offload_optimizer": SUPER_OFFLOAD}}).zero
    assert zero.offload_optimizer == OffloadOptimizerConfig(**SUPER_OFFLOAD)
    assert ZeroOptions.from_dict(dataclasses.asdict(zero)) == zero


def test_super_offload_config_starts_through_initialize() -> None:
    """The example's JSON as a whole (bf16, AdamW, stage 3 with its offload block) starts and steps."""
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "overlap_comm": True, "reduce_bucket_size": 64,
                                    "sub_group_size": 1e9, "offload_optimizer": SUPER_OFFLOAD}}  # fmt: skip
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)).to(torch.bfloat16)
    model, opt = zk.initialize(model, config)
    model(torch.randn(2, 16, dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    placed = [(buf.tier_from, len(buf.layout.buckets)) for buf in opt._pipeline.buffers]
    assert any(k > 0 for k, _ in placed) and any(k < n for k, n in placed), placed  # 0.9 in the tier, 0.1 not


@pytest.mark.parametrize(
    "stage, device, level, fragment",
    [
        (3, "cpu", logging.INFO, "runs during backward"),
        (3, "nvme", logging.WARNING, "ignored with device nvme"),
        (2, "cpu", logging.WARNING, "ignored at stage 2"),
    ],
)
def test_super_offload_says_once_what_it_does(
    stage: int, device: str, level: int, fragment: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    block = {**SUPER_OFFLOAD, "device": device, **({"nvme_path": str(tmp_path)} if device == "nvme" else {})}
    with caplog.at_level(logging.INFO, logger="zero_kernels"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        opt = zk.ShardedFusedAdam(model, stage=stage, offload_optimizer=block)
    said = [r for r in caplog.records if "super_offload" in r.getMessage()]
    assert len(said) == 1 and fragment in said[0].getMessage() and said[0].levelno == level, said
    assert (opt._pipeline.speculation is not None) == (level == logging.INFO)


BAD = [
    ({"offload_optimizer": {"device": "gpu"}}, "offload_optimizer.device='gpu'", "'none', 'cpu', 'nvme'"),
    ({"offload_optimizer": {"device": "nvme"}}, 'offload_optimizer.device="nvme" needs', "nvme_path"),
    ({"offload_optimizer": {"device": "cpu", "ratio": -0.1}}, "offload_optimizer.ratio=-0.1", ">= 0"),
    ({"offload_optimizer": {"device": "cpu", "ratio": 2}}, "offload_optimizer.ratio=2", "<= 1"),
    ({"offload_optimizer": {"device": "cpu", "ratio": "lots"}}, "offload_optimizer.ratio='lots'", "a finite number"),
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/x", "buffer_count": 0}}, "buffer_count=0", ">= 1"),
    ({"offload_optimizer": {"device": "cpu", "buffer_count": -1}}, "offload_optimizer.buffer_count=-1", ">= 0"),
    ({"offload_optimizer": {"device": "cpu", "pin_memory": "yes"}}, "offload_optimizer.pin_memory='yes'", "true"),
    ({"offload_optimizer": {"device": "cpu", "nvme_path": ""}}, "offload_optimizer.nvme_path=''", "directory"),
    ({"offload_optimizer": {"device": "cpu", "cpuadam_cores_perc": -0.1}}, "cpuadam_cores_perc=-0.1", ">= 0"),
    ({"offload_optimizer": {"device": "cpu", "super_offload": 1}}, "super_offload=1", "true or false"),
    ({"offload_optimizer": {"device": "cpu", "pipline_read": True}}, "'pipline_read'", "did you mean 'pipeline_read'"),
    ({"offload_optimizer": 3}, "zero_optimization.offload_optimizer=3", '{"device": "cpu"}'),
    ({"offload_param": {"device": "nvme"}, "stage": 3}, 'offload_param.device="nvme" needs', "nvme_path"),
    ({"offload_param": {"device": "nvme", "nvme_path": "/x", "buffer_size": 0}, "stage": 3}, "buffer_size=0", ">= 1"),
    ({"offload_optimizer": "cpu", "stage": 0}, "offload_optimizer.device='cpu' needs stage 1, 2 or 3", "stage is 0"),
    ({"cpu_offload": True, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}, "cpu_offload=true", "nvme"),
    ({"cpu_offload": "yes"}, "zero_optimization.cpu_offload='yes'", "true or false"),
    ({"sub_group_size": -1}, "zero_optimization.sub_group_size=-1", ">= 0"),
    ({"aio": {"thread_count": 0}}, "intra_op_parallelism", ">= 1"),
    ({"aio": {"block_size": 100}}, "aio.block_size=100", ">= 4096, a multiple of 4096"),
    ({"aio": {"block_size": 5000}}, "aio.block_size=5000", ">= 4096, a multiple of 4096"),
    ({"aio": {"use_gds": True}}, "aio.use_gds=True", "not supported yet"),
    ({"aio": {"queue": 3}}, "'queue' in zero_optimization.aio", "queue_depth"),
]


def test_values_deepspeed_takes_are_taken(caplog: pytest.LogCaptureFixture) -> None:
    """DeepSpeed 0.19.8's schema: ``ratio`` 0 (nothing offloaded), ``cpuadam_cores_perc`` 0 (one thread here), no
    buffers or buffer size where the device reads none, ``fast_init`` (logged without effect), ``pin_memory``
    true by default, and ``offload_param`` below stage 3 (ignored, with a warning, whatever it holds)."""
    zero = {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "ratio": 0.0, "cpuadam_cores_perc": 0.0, "buffer_count": 0},
        "offload_param": {"device": "cpu", "buffer_size": 0, "buffer_count": 0},
    }
    with caplog.at_level("INFO", logger="zero_kernels"):
        options = ZeroConfig.from_deepspeed({"zero_optimization": zero}).zero
    assert not options.offload_optimizer.enabled and options.offload_optimizer.pin_memory is True
    assert not options.offload_param.enabled
    assert "offload_param.device='cpu' has no effect at stage 2" in caplog.text, caplog.text
    assert cpu_threads(0.0) == 1
    nvme = {"stage": 1, "offload_param": {"device": "nvme", "buffer_count": 0}}  # no path, no buffers: ignored too
    with caplog.at_level("INFO", logger="zero_kernels"):
        assert not ZeroConfig.from_deepspeed({"zero_optimization": nvme}).zero.offload_param.enabled
    assert "offload_param.device='nvme' has no effect at stage 1" in caplog.text, caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="zero_kernels"):
        options = ZeroConfig.from_deepspeed({"zero_optimization": {"offload_optimizer": {"fast_init": True}}}).zero
    assert options.offload_param.pin_memory is True
    assert "without effect in zero_kernels: zero_optimization.offload_optimizer.fast_init" in caplog.text, caplog.text


@pytest.mark.parametrize("zero, where, allowed", BAD, ids=[w for _, w, _ in BAD])
def test_bad_values_name_the_key_and_what_is_allowed(zero: dict, where: str, allowed: str) -> None:
    with pytest.raises(ValueError) as err:
        ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 1, **zero}})
    assert where in str(err.value) and allowed in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "config, fragment",
    [
        ({"aio": {"queue_depth": 0}}, "aio.queue_depth=0"),
        ({"aio": {"block_size": 4096 * 256 + 512}}, "aio.block_size=1049088 is invalid: .* a multiple of 4096"),
        ({"aio": {}, "zero_optimization": {"stage": 3, "aio": {}}}, "both at the top level and in zero_optimization"),
    ],
)
def test_bad_top_level_aio(config: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        ZeroConfig.from_deepspeed(config)


@pytest.mark.parametrize(
    "build, fragment",
    [
        (lambda: OffloadOptimizerConfig(device="disk"), "offload_optimizer.device='disk'"),
        (lambda: OffloadOptimizerConfig(device="nvme"), "needs offload_optimizer.nvme_path"),
        (lambda: AioConfig(intra_op_parallelism=0), "aio.intra_op_parallelism=0"),
        (lambda: AioConfig(block_size=6144), "aio.block_size=6144 is invalid: .* a multiple of 4096"),
        (lambda: ZeroOptions(stage=2, offload_optimizer={"device": "cpu", "bogus": 1}), "unknown key 'bogus'"),
        (lambda: ZeroOptions(stage=2, offload_optimizer=7), "ZeroOptions.offload_optimizer=7"),
    ],
)
def test_direct_construction_is_checked(build, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        build()


def test_nvme_path_may_be_a_pathlib_path(tmp_path) -> None:
    """DeepSpeed's config takes a ``Path``; so does this one, kept as a string."""
    config = ZeroConfig.from_deepspeed(
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": tmp_path}}}
    )
    assert config.zero.offload_optimizer.nvme_path == str(tmp_path)
    assert OffloadOptimizerConfig(device="nvme", nvme_path=tmp_path).nvme_path == str(tmp_path)
