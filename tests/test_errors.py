"""Bad input gets a clear error that names the problem, not a traceback from deep inside."""
import contextlib
import json
import logging

import pytest
import torch

from dist_utils import run_distributed
from ds_uniep import UniEPBackendError, UniEPConfig, UniEPConfigError, UniEPMoE
from moe_models import MLP


def test_experts_must_divide_over_ranks():
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by ep_size=4"):
        UniEPMoE(8, MLP(8, 8), num_experts=6, ep_size=4)


def test_bad_constructor_values():
    with pytest.raises(ValueError, match="k=5 is larger than num_experts=4"):
        UniEPMoE(8, MLP(8, 8), num_experts=4, k=5)
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        UniEPMoE(8, MLP(8, 8), num_experts=4, noisy_gate_policy="Gaussian")
    with pytest.raises(TypeError, match="expert must be an nn.Module"):
        UniEPMoE(8, lambda x: x, num_experts=4)
    for name, bad in (("hidden_size", 0), ("num_experts", 2.0), ("k", True), ("ep_size", "1")):
        kwargs = dict(hidden_size=8, expert=MLP(8, 8), num_experts=4, k=1, ep_size=1)
        kwargs[name] = bad
        with pytest.raises(ValueError, match=f"{name} must be a positive integer, got {bad!r}"):
            UniEPMoE(**kwargs)


def test_numpy_integer_sizes_are_taken_as_the_stock_layer_takes_them():
    import numpy as np
    layer = UniEPMoE(np.int64(8), MLP(8, 8), num_experts=np.int32(4), k=np.int64(2))
    assert (layer.hidden_size, layer.num_experts, layer.k) == (8, 4, 2)
    assert all(type(v) is int for v in (layer.hidden_size, layer.num_experts, layer.k, layer.ep_size))
    out, _, _ = layer(torch.randn(5, 8))
    assert out.shape == (5, 8)


def test_wrong_hidden_size_names_both_sizes():
    layer = UniEPMoE(8, MLP(8, 8), num_experts=2, config={"backend": "reference"})
    with pytest.raises(ValueError, match=r"input hidden size 6 does not match hidden_size=8"):
        layer(torch.randn(5, 6))


def test_uniep_gemm_where_it_cannot_run_is_explained():
    layer = UniEPMoE(8, MLP(8, 8), num_experts=2, config={"backend": "reference", "expert_gemm": "uniep"})
    with pytest.raises(RuntimeError, match=r'"expert_gemm": "uniep" cannot run on cpu: device cpu is not a CUDA'):
        layer(torch.randn(5, 8))


def test_missing_group_is_explained():
    layer = UniEPMoE(8, MLP(8, 8), num_experts=2, ep_size=2, config={"backend": "reference"})
    with pytest.raises(RuntimeError, match="deepspeed.initialize or call set_deepspeed_parallelism"):
        layer(torch.randn(8, 8))


@pytest.mark.parametrize("block,pattern", [
    ({"backnd": "auto"}, r"uniep\.backnd: unknown key; allowed keys here: autotune, backend"),
    ({"backend": "gpu"}, r"uniep\.backend: expected one of 'auto', 'reference', 'megakernel', got str 'gpu'"),
    ({"overlap": {"schedule": "fast"}}, r"uniep\.overlap\.schedule: expected one of 'sequential', 'pipelined'"),
    ({"overlap": {"tile_m": 100}}, r"uniep\.overlap\.tile_m: .*64, 128, 256"),
    ({"hybrid": {"migrated_fraction": 1.5}}, r"uniep\.hybrid\.migrated_fraction: .*must be a number in \[0, 1\] "
     r"or 'auto', got 1\.5"),
    ({"compression": {"dispatch_dtype": "int8"}}, r"uniep\.compression\.dispatch_dtype: .*'activation', "
     r"'fp8_e4m3'"),
    ({"max_tokens_per_rank": "4096"}, r"uniep\.max_tokens_per_rank: expected int, got str '4096'"),
    ({"overlap": {"combine_queue": "yes"}}, r"uniep\.overlap\.combine_queue: expected bool, got str 'yes'"),
    ({"overlap": {"num_comm_sms": 0}}, r"uniep\.overlap\.num_comm_sms: must be an integer in \[1, 132\], got 0"),
    ({"overlap": {"num_chunks": 65}}, r"uniep\.overlap\.num_chunks: must be an integer in \[1, 64\], got 65"),
    ({"deterministic": True}, r"uniep\.deterministic: unknown key"),
    ({"overlap": {"stages": 4}}, r"uniep\.overlap\.stages: unknown key"),
    ({"commfuse": {"enabled": True}}, r"uniep\.commfuse\.enabled: unknown key"),
    ({"autotune": {"budget": 3}}, r"uniep\.autotune\.budget: unknown key; allowed keys here: allow_numerics_change"),
    ({"commfuse": {"schedule": "arrival", "transport": "p2p"}}, r"uniep\.commfuse: .*schedule 'arrival' moves "
     r"blocks by the copy engines; transport 'p2p' does not apply"),
])
def test_bad_uniep_blocks(block, pattern, tmp_path):
    with pytest.raises(UniEPConfigError, match=pattern):
        UniEPConfig.from_dict(block)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 8, "uniep": block}))
    with pytest.raises(UniEPConfigError, match=pattern):
        UniEPMoE(8, MLP(8, 8), num_experts=2, config=str(path))


def test_config_sources_agree(tmp_path):
    block = {"backend": "reference", "overlap": {"schedule": "pipelined", "num_chunks": 4}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "uniep": block}))
    a = UniEPConfig.from_dict(block)
    assert a == UniEPConfig.from_ds_config(str(path)) == UniEPConfig.coerce({"train_batch_size": 8, "uniep": block})
    assert a.overlap.num_chunks == 4 and a.overlap.roles == "interleaved"
    assert UniEPConfig.from_ds_config({"train_batch_size": 8}) == UniEPConfig()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_megakernel_without_cuda():
    with pytest.raises(UniEPBackendError, match=r'"backend": "megakernel"\} needs CUDA GPUs'):
        UniEPMoE(8, MLP(8, 8), num_experts=2, config={"backend": "megakernel"})


@contextlib.contextmanager
def _logged():
    """The messages ds_uniep logs inside the block."""
    from ds_uniep.env import logger
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def test_auto_falls_back_to_reference_and_says_so():
    with _logged() as records:
        layer = UniEPMoE(8, MLP(8, 8), num_experts=2, min_capacity=0, config={"backend": "auto"})
        layer(torch.randn(4, 8))
        layer(torch.randn(4, 8))
    assert layer.backend_name() == "reference"
    said = [r.getMessage() for r in records if "backend auto ->" in r.getMessage()]
    assert len(said) == 1 and "reference (inputs are on cpu" in said[0], said


def _ep_larger_than_world(rank, world_size):
    with pytest.raises(ValueError, match=r"ep_size=4 is larger than the world size 2"):
        UniEPMoE(8, MLP(8, 8), num_experts=4, ep_size=4)


def test_ep_size_larger_than_world():
    run_distributed(_ep_larger_than_world, 2)


def _reference_layer_outputs(configs, backward):
    """Output (and input gradient) of a fresh reference-backend layer with the same weights per config."""
    outs = []
    for config in configs:
        torch.manual_seed(3)
        layer = UniEPMoE(8, MLP(8, 8), num_experts=2, min_capacity=0, config={"backend": "reference", **config})
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(4), requires_grad=backward)
        out = layer(x)[0]
        if backward:
            out.sum().backward()
        outs.append((out.detach(), x.grad))
    return outs


def test_accumulation_boundary_without_reuse_is_said_and_a_non_function_refused():
    hyb = {"enabled": True, "domain_size": 2}
    with _logged() as records:
        UniEPMoE(8, MLP(8, 8), num_experts=2, config={"backend": "reference", "hybrid": hyb}) \
            .set_accumulation_boundary(lambda: True)
        reuse = {"backend": "reference", "hybrid": dict(hyb, reuse_replicas=True)}
        UniEPMoE(8, MLP(8, 8), num_experts=2, config=reuse).set_accumulation_boundary(lambda: True)
    said = [r.getMessage() for r in records if "set_accumulation_boundary does nothing" in r.getMessage()]
    assert len(said) == 1 and '"reuse_replicas": true' in said[0], said
    with pytest.raises(TypeError, match="set_accumulation_boundary takes a function"):
        UniEPMoE(8, MLP(8, 8), num_experts=2).set_accumulation_boundary(True)


def test_overlap_knobs_that_wait_for_the_fused_schedule_are_named():
    """Knobs of schedules not built yet are accepted and said to do nothing; "sequential" is not."""
    overlaps = ({"schedule": "sequential"}, {"schedule": "pipelined", "num_chunks": 4}, {},
                {"schedule": "pipelined", "num_chunks": 4})  # the second such layer is not named again
    from ds_uniep import schedules as layer_module
    layer_module._SAID_WAITING.clear()  # said once per process: start from none said
    with _logged() as records:
        outs = _reference_layer_outputs([{"overlap": o} for o in overlaps], backward=False)
    said = [r.getMessage() for r in records if "accepted but not acted on" in r.getMessage()]
    assert len(said) == 1, said
    assert "schedule='pipelined', num_chunks=4" in said[0] and "reference backend" in said[0], said
    assert all(torch.equal(outs[0][0], o[0]) for o in outs[1:])


def test_fused_schedule_and_its_unread_knobs_are_named_off_the_megakernel():
    """On the reference backend the fused schedule does not run: "schedule": "fused" and the
    knobs no schedule reads yet (tile_m here) are named once, and the results are unchanged."""
    from ds_uniep import schedules as layer_module
    layer_module._SAID_WAITING.clear()
    with _logged() as records:
        outs = _reference_layer_outputs([{"overlap": {"schedule": "sequential"}},
                                         {"overlap": {"schedule": "fused", "tile_m": 64}},
                                         {"overlap": {"schedule": "sequential", "epilogue_combine": False}}],
                                        backward=False)
    said = [r.getMessage() for r in records if "accepted but not acted on" in r.getMessage()]
    assert len(said) == 2, said
    assert "schedule='fused', tile_m=64" in said[0] and "reference backend" in said[0], said
    assert "epilogue_combine=False" in said[1], said  # a knob of the fused schedule, which does not run
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][0], outs[2][0])


def test_roles_are_named_unless_the_fused_dispatch_reads_them():
    """``roles`` is read by the megakernel's fused dispatch only: set anywhere else it is named."""
    from ds_uniep import schedules as layer_module
    from ds_uniep.config import UniEPConfig
    counts = []
    for overlap, backend in (({"schedule": "fused", "roles": "interleaved"}, "megakernel"),
                             ({"schedule": "sequential", "roles": "interleaved"}, "megakernel"),
                             ({"schedule": "fused", "fused_dispatch": False, "roles": "interleaved"}, "megakernel"),
                             ({"schedule": "fused", "roles": "interleaved"}, "reference")):
        layer_module._SAID_WAITING.clear()
        with _logged() as records:
            layer_module.say_unread_knobs(UniEPConfig.from_dict({"overlap": overlap}).overlap, backend, "layer 0")
        said = [r.getMessage() for r in records if "accepted but not acted on" in r.getMessage()]
        assert all("roles='interleaved'" in m for m in said), said
        counts.append(len(said))
    assert counts == [0, 1, 1, 1], counts


def test_signal_granularity_is_named_unless_the_fused_dispatch_reads_it():
    """``signal_granularity`` is read by the megakernel's fused dispatch only; tiles by ds_uniep's GEMM only."""
    from ds_uniep import schedules as layer_module
    from ds_uniep.config import UniEPConfig
    for overlap, backend, named in (
            ({"schedule": "fused", "signal_granularity": "expert"}, "megakernel", []),
            ({"schedule": "fused", "signal_granularity": "rank", "tile_m": 128}, "megakernel", ["tile_m=128"]),
            ({"schedule": "sequential", "signal_granularity": "expert"}, "megakernel",
             ["signal_granularity='expert'"]),
            ({"schedule": "fused", "fused_dispatch": False, "signal_granularity": "rank"}, "megakernel",
             ["signal_granularity='rank'"])):
        layer_module._SAID_WAITING.clear()
        with _logged() as records:
            layer_module.say_unread_knobs(UniEPConfig.from_dict({"overlap": overlap}).overlap, backend, "layer 0")
        said = [r.getMessage() for r in records if "accepted but not acted on" in r.getMessage()]
        assert len(said) == (1 if named else 0), (overlap, said)
        assert all(n in said[0] for n in named), (overlap, said)
        if said:
            assert ("signal_granularity" in said[0].split("accepted")[0]) == (named != ["tile_m=128"]), said


def test_combine_knobs_are_named_where_the_combine_kernels_do_not_move_the_rows():
    """``combine_chunks`` and ``combine_queue`` are read by the megakernel's combine kernels: under the
    sequential schedule and the fused one without its epilogues; the queue needs chunks."""
    from ds_uniep import schedules as layer_module
    from ds_uniep.config import UniEPConfig
    both = {"combine_chunks": 4, "combine_queue": True}
    for overlap, backend, named in (
            ({"schedule": "sequential", **both}, "megakernel", []),
            ({"schedule": "fused", "epilogue_combine": False, **both}, "megakernel", []),
            ({"schedule": "fused", **both}, "megakernel", ["combine_chunks=4", "combine_queue=True"]),
            ({"schedule": "pipelined", **both}, "megakernel", ["combine_chunks=4", "combine_queue=True"]),
            ({"schedule": "sequential", **both}, "reference", ["combine_chunks=4", "combine_queue=True"]),
            ({"combine_chunks": 0, "combine_queue": True}, "megakernel", ["combine_queue=True"]),
            ({"combine_chunks": 0}, "megakernel", [])):
        layer_module._SAID_WAITING.clear()
        with _logged() as records:
            layer_module.say_unread_knobs(UniEPConfig.from_dict({"overlap": overlap}).overlap, backend, "layer 0")
        said = [r.getMessage() for r in records if "accepted but not acted on" in r.getMessage()]
        assert len(said) == (1 if named else 0), (overlap, backend, said)
        if said:
            head = said[0].split("accepted")[0]
            assert all(n in head for n in named) and ("combine_chunks" in head) == (len(named) == 2), said


def test_the_hosts_wait_for_the_fused_dispatch_start_compares_epochs_cyclically():
    """Where the driver offers no stream memory wait the host polls the word the fused dispatch's
    blocks raise: it returns once the word reaches the epoch (across the 32-bit wrap) and raises
    a timeout naming the layer, rank and block count when it never does."""
    import types

    from ds_uniep.megakernel import NVLinkDispatcher, UniEPTimeoutError
    checked = []
    d = types.SimpleNamespace(timeout_ns=int(0.05e9), layer_name="layer 3", rank=1, fused_comm_blocks=8,
                              check=lambda: checked.append(True))
    word = torch.zeros(1, dtype=torch.int32)
    for now, epoch in ((5, 5), (6, 5), (2, 0xFFFFFFFF)):  # at it, past it, past it across the wrap
        word[0] = now
        NVLinkDispatcher._await_fused_start(d, epoch, word)
    assert not checked
    for now, epoch in ((4, 5), (-1, 2)):  # behind it; 0xFFFFFFFF is behind 2
        word[0] = now
        with pytest.raises(UniEPTimeoutError, match="layer 3: rank 1: the fused dispatch's 8 blocks did not all start"):
            NVLinkDispatcher._await_fused_start(d, epoch, word)
    assert len(checked) == 2  # the layer's error record is checked before the timeout is raised


def test_tile_sizes_choose_the_uniep_gemm_tile_and_others_are_refused():
    """``tile_m``/``tile_n`` set in the block pick ds_uniep's GEMM tile for every operation (a pair it
    is not built with is refused at construction, naming the layer); unset, its own choice; a
    tuning plan that keeps them leaves them unset; torch's GEMM takes no configuration."""
    from ds_uniep.experts import SwiGLUExpert, run_grouped
    from ds_uniep.gemm import configs_for_tiles
    from ds_uniep.tuning import GPUInfo, Plan, Shape, Space

    def make(overlap):
        return UniEPMoE(8, MLP(8, 8), num_experts=2, config={"backend": "reference", "expert_gemm": "uniep",
                                                             "overlap": overlap})
    assert make({"tile_m": 256, "tile_n": 128})._gemm_configs() == {op: "coop256x128" for op in ("fwd", "dgrad",
                                                                                                   "wgrad")}
    assert make({"tile_n": 256})._gemm_configs() == configs_for_tiles(128, 256)
    assert make({"tile_m": 128})._gemm_configs() == {op: "pingpong128x128" for op in ("fwd", "dgrad", "wgrad")}
    assert make({"num_comm_sms": 8})._gemm_configs() is None
    with pytest.raises(ValueError, match=r"UniEPMoE\[\d+\]: uniep.overlap tile_m=64, tile_n=128: ds_uniep's grouped "
                       r"GEMM is built with tiles \(tile_m x tile_n\) 128x256, 256x128, 128x128, not 64x128"):
        make({"tile_m": 64})
    # On torch's GEMM the knobs are not read (and said so at the first forward): no error here.
    UniEPMoE(8, MLP(8, 8), num_experts=2, config={"backend": "reference", "overlap": {"tile_m": 64}})
    cfg = UniEPConfig.coerce({"expert_gemm": "uniep"})
    applied = Plan.from_config(cfg).replace(num_comm_sms=16).apply(cfg).overlap
    assert not {"tile_m", "tile_n"} & applied.model_fields_set and "num_comm_sms" in applied.model_fields_set
    # A backend space's plans carry the baseline's unset tiles, which no backend walks: applied, they
    # leave the config's tiles (unset: the GEMM's own choice; set: those) as they were.
    baseline = Space(Shape(T=64, M=64, F=64, E=4, k=2), GPUInfo.cpu(), backend="megakernel",
                     expert_gemm="uniep").baseline()
    assert (baseline.tile_m, baseline.tile_n) == (None, None)
    assert not {"tile_m", "tile_n"} & baseline.apply(cfg).overlap.model_fields_set
    cfg = UniEPConfig.coerce({"expert_gemm": "uniep", "overlap": {"tile_m": 256, "tile_n": 128}})
    assert {"tile_m", "tile_n"} <= Plan.from_config(cfg).apply(cfg).overlap.model_fields_set
    assert (baseline.apply(cfg).overlap.tile_m, baseline.apply(cfg).overlap.tile_n) == (256, 128)
    experts = [SwiGLUExpert(8, 8).to(torch.bfloat16)]
    with pytest.raises(ValueError, match=r"sm_count, waits, configs and into apply to ds_uniep's grouped GEMM"):
        run_grouped(experts, torch.zeros(2, 8, dtype=torch.bfloat16), torch.tensor([2]), "torch",
                    configs=configs_for_tiles(128, 128))


def test_convert_refuses_layers_it_cannot_rebuild_and_keeps_hooks_and_packing():
    from deepspeed.moe.layer import MoE
    from ds_uniep import SwiGLUExpert, convert_moe_layers

    class Doubled(MoE):
        def forward(self, *a, **kw):
            out, l_aux, counts = super().forward(*a, **kw)
            return 2 * out, l_aux, counts

    mixed = MoE(8, MLP(8, 8), num_experts=2, k=1)
    mixed.deepspeed_moe.experts.deepspeed_experts[1] = torch.nn.Sequential(torch.nn.Linear(8, 8))
    for bad, why in ((Doubled(8, MLP(8, 8), num_experts=2, k=1), "Doubled overrides MoE.forward"),
                     (mixed, "local expert 1 .*Sequential.* differs from expert 0")):
        holder = torch.nn.ModuleDict({"ok": MoE(8, MLP(8, 8), num_experts=2, k=1), "bad": bad})
        with pytest.raises(ValueError, match=f"convert_moe_layers cannot convert bad: {why}"):
            convert_moe_layers(holder, {"backend": "reference"})
        assert type(holder["ok"]) is MoE, "nothing is replaced when one layer cannot be"
    # A convertible layer: same values, its forward hook still fires (and its handle removes it),
    # and bf16 SwiGLU experts are packed as UniEPMoE packs its own.
    stock = MoE(16, SwiGLUExpert(16, 32), num_experts=4, k=2).to(torch.bfloat16)
    calls = []
    handle = stock.register_forward_hook(lambda *a: calls.append(1))
    holder = torch.nn.ModuleDict({"moe": stock})
    want = {n: p.detach().clone() for n, p in stock.named_parameters()}
    assert convert_moe_layers(holder, {"backend": "reference"}) == 1
    new = holder["moe"]
    assert type(new) is UniEPMoE
    assert all(torch.equal(p, want[n]) and p.dtype == torch.bfloat16 for n, p in new.named_parameters())
    experts = new.deepspeed_moe.experts.deepspeed_experts
    w1 = [e.w1.weight for e in experts]
    assert len({w.untyped_storage().data_ptr() for w in w1}) == 1, "converted experts not packed"
    new.deepspeed_moe.gate.wg.float()
    new(torch.randn(5, 16, dtype=torch.bfloat16))
    assert calls == [1]
    handle.remove()
    new(torch.randn(5, 16, dtype=torch.bfloat16))
    assert calls == [1]


def test_used_token_needs_one_value_per_token_and_is_said_to_do_nothing_past_top1(caplog):
    layer = UniEPMoE(8, MLP(8, 8), num_experts=2, k=1, min_capacity=0, config={"backend": "reference"})
    with pytest.raises(ValueError, match=r"used_token has 7 values \(shape \(7,\)\) for 12 tokens"):
        layer(torch.randn(3, 4, 8), torch.ones(7))
    layer(torch.randn(3, 4, 8), torch.ones(12))
    top2 = UniEPMoE(8, MLP(8, 8), num_experts=2, k=2, min_capacity=0, config={"backend": "reference"})
    with caplog.at_level(logging.WARNING, logger="ds_uniep"):
        top2(torch.randn(5, 8), torch.ones(5))
        top2(torch.randn(5, 8), torch.ones(5))
    said = [r for r in caplog.records if "used_token is read only by DeepSpeed's top-1 gate" in r.getMessage()]
    assert len(said) == 1


def test_config_file_with_a_bare_block_is_read_as_the_block(tmp_path):
    path = tmp_path / "uniep.json"
    path.write_text(json.dumps({"backend": "reference", "max_tokens_per_rank": 64}))
    cfg = UniEPConfig.coerce(str(path))
    assert cfg.backend == "reference" and cfg.max_tokens_per_rank == 64
    path.write_text(json.dumps({"backnd": "reference"}))  # a typo is an error, not the defaults
    with pytest.raises(UniEPConfigError, match=r"uniep\.backnd: unknown key"):
        UniEPConfig.coerce(str(path))
    # a ds_config without the block gives the defaults, also when only less common keys say so
    path.write_text(json.dumps({"gradient_clipping": 1.0, "steps_per_print": 10}))
    assert UniEPConfig.coerce(str(path)) == UniEPConfig()
    assert UniEPConfig.coerce({"gradient_clipping": 1.0, "steps_per_print": 10}) == UniEPConfig()
