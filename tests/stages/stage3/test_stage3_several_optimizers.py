"""Several models and optimizers in one process at stage 3 (alone and mixed with stage 2), on two ranks, against
``torch.optim.AdamW`` on the whole batch: disjoint parts of one model (an encoder and a decoder) each with an
optimizer of its own, other learning rates, stepped at other frequencies, built on the submodule or on its
parameters with ``module=model``; a GAN's generator and discriminator, the discriminator's loss through the
generator's output without ``.detach()`` (``retain_graph=True``) and frozen with ``requires_grad_(False)`` while the
generator trains; a student distilled through a teacher trained at stage 3 and then frozen; an EMA kept the README's
way (``AveragedModel`` made and updated inside ``gathered_params()``)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import zero_kernels as zk
from tests.helpers.dist import run_ranks
from tests.helpers.lockstep import compare

ROWS = 3  # per rank


def _opt(module: nn.Module, stage: int, lr: float, params: list | None = None) -> zk.ShardedFusedAdam:
    kw = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}  # shard even these tiny tensors
    if params is not None:
        return zk.ShardedFusedAdam(params, lr=lr, stage=stage, module=module, **kw)
    return zk.ShardedFusedAdam(module, lr=lr, stage=stage, **kw)


def _data(step: int, lo: int, hi: int, cols: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(2 * ROWS, cols, generator=g)[lo:hi]


def _gathered(opt) -> contextlib.AbstractContextManager:
    return opt.gathered_params() if isinstance(opt, zk.ShardedFusedAdam) else contextlib.nullcontext()


def _encdec(seed: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.ModuleDict(
        {
            "enc": nn.Sequential(nn.Linear(6, 9), nn.Tanh()),
            "dec": nn.Sequential(nn.Linear(9, 5), nn.Tanh(), nn.Linear(5, 6)),
        }
    )


def _encdec_loop(m: nn.Module, o_enc, o_dec, lo: int, hi: int, model_zero: bool) -> None:
    for step in range(5):  # the decoder steps every second step, on two backwards' gradients (or the last one)
        x = _data(step, lo, hi)
        if model_zero:
            m.zero_grad()
        F.mse_loss(m["dec"](m["enc"](x)), x).backward()
        o_enc.step()
        if not model_zero:
            o_enc.zero_grad()
        if step % 2:
            o_dec.step()
            if not model_zero:
                o_dec.zero_grad()


def _encoder_and_decoder(rank: int, world: int) -> None:
    for s_enc, s_dec in ((3, 3), (3, 2)):
        for on_params in (False, True):
            for model_zero in (False, True):
                m, ref = _encdec(), _encdec()
                if on_params:
                    o_enc = _opt(m, s_enc, 1e-2, list(m["enc"].parameters()))
                    o_dec = _opt(m, s_dec, 3e-3, list(m["dec"].parameters()))
                else:
                    o_enc, o_dec = _opt(m["enc"], s_enc, 1e-2), _opt(m["dec"], s_dec, 3e-3)
                r_enc = torch.optim.AdamW(ref["enc"].parameters(), lr=1e-2)
                r_dec = torch.optim.AdamW(ref["dec"].parameters(), lr=3e-3)
                _encdec_loop(m, o_enc, o_dec, rank * ROWS, (rank + 1) * ROWS, model_zero)
                _encdec_loop(ref, r_enc, r_dec, 0, world * ROWS, model_zero)
                what = f"rank {rank} enc {s_enc} dec {s_dec} on_params {on_params} model_zero {model_zero}"
                with o_enc.gathered_params(), o_dec.gathered_params():
                    compare(m, ref, what)


def _gan(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    return (
        nn.Sequential(nn.Linear(4, 9), nn.Tanh(), nn.Linear(9, 6)),
        nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 1)),
    )


def _bce(out: torch.Tensor, target: float) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(out, torch.full_like(out, target))


def _gan_loop(G: nn.Module, D: nn.Module, o_g, o_d, lo: int, hi: int) -> None:
    for step in range(4):
        real, z = _data(step, lo, hi) + 1.0, _data(50 + step, lo, hi, cols=4)
        o_d.zero_grad()
        fake = G(z)
        (_bce(D(real), 1.0) + _bce(D(fake), 0.0)).backward(retain_graph=True)  # also reaches G: cleared below
        o_d.step()
        o_g.zero_grad()
        D.requires_grad_(False)
        _bce(D(fake), 1.0).backward()
        D.requires_grad_(True)
        o_g.step()


def _generator_and_discriminator(rank: int, world: int) -> None:
    for s_g, s_d in ((3, 3), (3, 2), (2, 3)):
        (G, D), (Gr, Dr) = _gan(), _gan()
        o_g, o_d = _opt(G, s_g, 1e-2), _opt(D, s_d, 2e-2)
        _gan_loop(G, D, o_g, o_d, rank * ROWS, (rank + 1) * ROWS)
        _gan_loop(
            Gr,
            Dr,
            torch.optim.AdamW(Gr.parameters(), lr=1e-2),
            torch.optim.AdamW(Dr.parameters(), lr=2e-2),
            0,
            world * ROWS,
        )
        with o_g.gathered_params(), o_d.gathered_params():
            compare(G, Gr, f"rank {rank} G{s_g} D{s_d}: G")
            compare(D, Dr, f"rank {rank} G{s_g} D{s_d}: D")


def _student_and_ema(m: nn.Module, teacher: nn.Module, opt, t_opt, lo: int, hi: int) -> AveragedModel:
    for step in range(2):  # the teacher trains first, then is frozen
        t_opt.zero_grad()
        F.mse_loss(teacher(_data(step, lo, hi)), _data(9 + step, lo, hi)).backward()
        t_opt.step()
    teacher.requires_grad_(False)
    with _gathered(opt):
        ema = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    for step in range(3):  # gradients flow through the frozen teacher to the student
        x = _data(20 + step, lo, hi)
        opt.zero_grad()
        F.mse_loss(teacher(m(x)), teacher(x).detach()).backward()
        opt.step()
        with _gathered(opt):
            ema.update_parameters(m)
    return ema


def _distillation_and_ema(rank: int, world: int) -> None:
    for stage in (2, 3):
        torch.manual_seed(7)
        teacher, t_ref = (nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 6)) for _ in range(2))
        t_ref.load_state_dict(teacher.state_dict())
        m, ref = (nn.Sequential(*_encdec(5).values()) for _ in range(2))
        s_opt, t_opt = _opt(m, stage, 1e-2), _opt(teacher, 3, 1e-2)
        ema = _student_and_ema(m, teacher, s_opt, t_opt, rank * ROWS, (rank + 1) * ROWS)
        ema_ref = _student_and_ema(
            ref,
            t_ref,
            torch.optim.AdamW(ref.parameters(), lr=1e-2),
            torch.optim.AdamW(t_ref.parameters(), lr=1e-2),
            0,
            world * ROWS,
        )
        compare(ema.module, ema_ref.module, f"rank {rank} stage {stage}: EMA")
        with _gathered(s_opt), t_opt.gathered_params():
            compare(m, ref, f"rank {rank} stage {stage}: student")
            compare(teacher, t_ref, f"rank {rank} stage {stage}: teacher")


def _ranks(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    _encoder_and_decoder(rank, world)
    _generator_and_discriminator(rank, world)
    _distillation_and_ema(rank, world)


@pytest.mark.distributed
def test_several_models_and_optimizers_train_as_with_adamw_on_two_ranks() -> None:
    run_ranks(_ranks, 2, timeout_s=300.0)


def _config(stage: int, lr: float, **extra: object) -> dict:
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    params = {"lr": lr, "weight_decay": 0.01}  # torch.optim.AdamW's default
    return {"optimizer": {"type": "AdamW", "params": params}, "zero_optimization": zero, **extra}


def _initialized_parts(rank: int, world: int) -> None:
    for s_g, s_d in ((3, 3), (3, 1), (2, 3)):
        (G, D), (Gr, Dr) = _gan(), _gan()
        model = nn.ModuleDict({"G": G, "D": D})
        _, o_g = zk.initialize(model, _config(s_g, 1e-2), model_parameters=G.parameters())
        _, o_d = zk.initialize(model, _config(s_d, 2e-2), model_parameters=[{"params": D.parameters()}])
        _gan_loop(G, D, o_g, o_d, rank * ROWS, (rank + 1) * ROWS)
        r_g, r_d = torch.optim.AdamW(Gr.parameters(), lr=1e-2), torch.optim.AdamW(Dr.parameters(), lr=2e-2)
        _gan_loop(Gr, Dr, r_g, r_d, 0, world * ROWS)
        with _gathered(o_g), _gathered(o_d):
            compare(G, Gr, f"rank {rank} initialize G{s_g} D{s_d}: G")
            compare(D, Dr, f"rank {rank} initialize G{s_g} D{s_d}: D")
        with pytest.raises(ValueError, match=r"parameter '[GD].0.weight' is held \(sharded\) by another stage-3"):
            zk.initialize(model, _config(2, 1e-2))  # the whole model again
        if s_g == 3 and s_d != 3:  # the cast would change the generator, which the stage-3 optimizer shards
            with pytest.raises(ValueError, match=r"'G.0.weight', which the config's cast of the whole model would"):
                zk.initialize(model, _config(2, 1e-2, bf16={"enabled": True}), model_parameters=D.parameters())


@pytest.mark.distributed
def test_parts_of_one_model_each_initialized_with_their_model_parameters_train_as_with_adamw() -> None:
    """``zk.initialize(model, config, model_parameters=model.G.parameters())`` and the same for ``model.D``, as each
    part's own ``ShardedFusedAdam(..., module=model)``: the second was refused at stage 3 as a second optimizer on the
    generator's parameters (initialize checked every parameter of the model, not those it takes), and the stage-3
    generator's emptied parameters were then broadcast as the model's. Initializing the whole model again, and a cast
    of the whole model that would change the other optimizer's sharded parameters, are still refused."""
    run_ranks(_initialized_parts, 2, timeout_s=120.0)
