"""UniEPMoE inside deepspeed.initialize: ZeRO 0/1/2 training and checkpoints shared with stock MoE."""
import torch
from torch import nn

from dist_utils import run_distributed


class Net(nn.Module):

    def __init__(self, moe_cls, ep_size, M=16, F=32, E=4, **moe_kw):
        super().__init__()
        from moe_models import MLP
        self.inp = nn.Linear(8, M)
        self.moe = moe_cls(M, MLP(M, F), num_experts=E, ep_size=ep_size, k=2, use_rts=False,
                           top2_2nd_expert_sampling=False, **moe_kw)
        self.out = nn.Linear(M, 1)

    def forward(self, x):
        h, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
        return self.out(h).squeeze(-1), l_aux


def _engine(model, stage):
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                    "name": "params"})
    opt = torch.optim.AdamW(groups, lr=1e-2)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
           "uniep": {"backend": "reference"}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def _train(engine, rank, steps=3):
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(4, 6, 8, generator=g), torch.randn(4, 6, generator=g)
        pred, l_aux = engine(x)
        loss = ((pred - y)**2).mean() + 0.01 * l_aux
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _zero_stages(rank, world_size):
    from deepspeed.moe.layer import MoE
    from ds_uniep import UniEPConfig, UniEPMoE
    from moe_models import distinct_experts
    for stage in (0, 1, 2):
        curves, finals = {}, {}
        for cls in (MoE, UniEPMoE):
            torch.manual_seed(0)
            model = Net(cls, ep_size=world_size)
            distinct_experts(model.moe, rank)  # a row sent to the wrong expert changes the numbers
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            engine = _engine(model, stage)
            assert engine.zero_optimization_stage() == stage
            if cls is UniEPMoE:
                assert UniEPConfig.from_engine(engine).backend == "reference"
                assert engine.has_moe_layers
            curves[cls.__name__] = _train(engine, rank)
            changed = [n for n, p in engine.module.named_parameters() if not torch.equal(p.detach(), before[n])]
            assert any("deepspeed_experts" in n for n in changed) and any("gate" in n for n in changed), changed
            finals[cls.__name__] = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
        torch.testing.assert_close(torch.tensor(curves["UniEPMoE"]), torch.tensor(curves["MoE"]), rtol=1e-4,
                                   atol=1e-5, msg=f"stage {stage}: {curves}")
        # every parameter, this rank's experts included, trained to the stock layer's values
        assert finals["UniEPMoE"].keys() == finals["MoE"].keys()
        for n, p in finals["MoE"].items():
            torch.testing.assert_close(finals["UniEPMoE"][n], p, rtol=1e-4, atol=1e-5, msg=f"stage {stage}: {n}")


def _checkpoints(rank, world_size, tmp):
    import deepspeed.comm as dist
    from deepspeed.moe.layer import MoE
    from ds_uniep import UniEPMoE
    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(rank))
    for src_cls, dst_cls in ((MoE, UniEPMoE), (UniEPMoE, MoE)):
        torch.manual_seed(0)
        src = _engine(Net(src_cls, ep_size=world_size), 0)
        _train(src, rank, steps=2)
        tag = f"{src_cls.__name__}_to_{dst_cls.__name__}"
        src.save_checkpoint(tmp, tag=tag)
        dist.barrier()
        torch.manual_seed(1)  # different initial weights: the load must overwrite all of them
        dst = _engine(Net(dst_cls, ep_size=world_size), 0)
        dst.load_checkpoint(tmp, tag=tag)
        src.eval(), dst.eval()
        with torch.no_grad():
            a, b = src(x)[0], dst(x)[0]
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=tag)


def _config_from_engine(rank, world_size):
    import deepspeed
    from ds_uniep import UniEPMoE
    from moe_models import MLP
    model = torch.nn.Sequential(torch.nn.Linear(4, 8))
    model.moe = UniEPMoE(8, MLP(8, 8), num_experts=2, ep_size=world_size)  # no config=
    assert model.moe.uniep_config.backend == "auto"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    deepspeed.initialize(model=model, optimizer=opt,
                         config={"train_micro_batch_size_per_gpu": 2, "uniep": {"backend": "reference",
                                                                                 "max_tokens_per_rank": 512}})
    assert model.moe.uniep_config.backend == "reference" and model.moe.uniep_config.max_tokens_per_rank == 512


def test_layer_without_config_reads_the_uniep_block_at_initialize():
    run_distributed(_config_from_engine, 2)


def test_zero_0_1_2_train_like_stock_moe():
    run_distributed(_zero_stages, 2)


def test_checkpoints_load_both_ways(tmp_path):
    run_distributed(_checkpoints, 2, str(tmp_path))


def _zero_3(rank, world_size):
    import pytest
    from ds_uniep import UniEPMoE
    with pytest.raises(AssertionError, match="ZeRO Stage 3"):
        _engine(Net(UniEPMoE, ep_size=world_size), 3)


def test_zero_3_is_refused_by_deepspeed_as_for_its_own_moe():
    """The README says so: DeepSpeed's engine refuses MoE layers under ZeRO-3, UniEPMoE too."""
    run_distributed(_zero_3, 2)


def _other_ep_size(rank, world_size, tmp):
    import deepspeed.comm as dist
    from ds_uniep import UniEPMoE
    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(rank))
    torch.manual_seed(0)
    src = _engine(Net(UniEPMoE, ep_size=2), 0)
    _train(src, rank, steps=2)
    src.save_checkpoint(tmp, tag="ep2")
    dist.barrier()
    torch.manual_seed(1)  # other initial weights: the load must overwrite all of them
    dst = _engine(Net(UniEPMoE, ep_size=1), 0)  # every rank holds all 4 experts
    dst.load_checkpoint(tmp, tag="ep2", load_optimizer_states=False, load_lr_scheduler_states=False)
    src.eval(), dst.eval()
    with torch.no_grad():
        assert torch.equal(dst(x)[0], src(x)[0])


def test_a_checkpoint_loads_at_another_ep_size_without_optimizer_states(tmp_path):
    """DeepSpeed keeps each expert in a file of its own, so the module loads at another ep_size (the
    optimizer's states are kept per expert-parallel partition: those need the same ep_size)."""
    run_distributed(_other_ep_size, 2, str(tmp_path))
