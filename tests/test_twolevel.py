"""Expert parallelism across nodes on CPU (gloo), nodes emulated with ``uniep.topology.node_size``.

The two-level dispatch and combine (``ds_uniep.twolevel``) must give the flat reference backend's
bits: received rows, row counts, outputs and the gradients of the input, the gates and the
experts' weights, for k 1, 2, 6, 8, dropped slots, a rank or a whole node without tokens, a node
that receives no rows, FP8 dispatch, rank partials and a capacity, moving the rows in one phase and
in two (this rank's own node's first; the pipelined schedule across nodes), on 2 nodes of 1, 2 or
4 ranks and 3 nodes of 2. ``auto`` on a group spanning
nodes picks the reference backend's two-level path and says so; a node that stops answering makes
every other rank raise an error naming the layer, the node and the step within the timeout.
"""
import logging
import os
import tempfile
import time

import pytest
import torch

from dist_utils import run_distributed

M = 16


def _routing(case, rank, world_size, node_size, E, g):
    """``(T, expert_idx [T, k])`` of ``rank`` for ``case``: distinct experts per token, some slots
    dropped (-1)."""
    k = case["k"]
    T = case.get("T", 3 + 2 * rank)
    if case.get("empty") == "rank" and rank == 1 or case.get("empty") == "node" and rank // node_size == 1:
        T = 0
    allowed = torch.arange(E)
    if case.get("cold_node"):  # no token goes to node 1's experts
        L = E // world_size
        allowed = allowed[(allowed // L) // node_size != 1]
    idx = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(T)]) if T else \
        torch.zeros(0, k, dtype=torch.long)
    if case.get("drop"):
        idx = torch.where(torch.rand(idx.shape, generator=g) < 0.25, -1, idx)
    return T, idx


class _ReferenceNode:
    """The NVLink dispatcher's calls that :class:`ds_uniep.twolevel.TwoLevelNVLinkDispatcher` makes,
    on the reference transport of the node's ranks (same layout, same unit-weight sums), so that its
    plan is checked on CPU."""

    def __init__(self, num_experts, ranks, group):
        from ds_uniep.reference import ReferenceDispatcher
        self.d = ReferenceDispatcher(num_experts, ranks, group)

    def checked_inputs(self, x, idx):
        assert idx.dtype == torch.int32 and idx.shape == (x.shape[0], 1)
        return x, idx

    def _dispatch_fwd(self, x, idx):
        recv, counts, handle = self.d.dispatch(x, idx.long())
        return recv, counts, None, handle, None, None

    def _combine_fwd(self, y, ones, idx, handle, _):
        return self.d.combine(y, ones, handle)

    def _dispatch_bwd(self, rows, idx, handle, _):
        return self._combine_fwd(rows, torch.ones(idx.shape, device=rows.device), idx, handle, None)

    def _combine_bwd(self, grad_out, y, gates, idx, _, handle, __):
        """(grad of y, grad of the gates): the rows of grad_out and their gates to the experts, the
        products there, the dot products back (as the megakernel does, in torch's sums)."""
        got, _, back = self.d.dispatch(grad_out, idx.long())
        got_gates, _, _ = self.d.dispatch(gates, idx.long())
        dots = (got.float() * y.float()).sum(-1, keepdim=True)
        return (got_gates * got.float()).to(y.dtype), self.d.combine(dots, torch.ones_like(gates), back)


def _node_on_reference():
    from ds_uniep.twolevel import TwoLevelNVLinkDispatcher

    class NodeOnReference(TwoLevelNVLinkDispatcher):
        def _node_dispatcher(self, config, hidden_size, dtype):
            return _ReferenceNode(self.ranks_per_node * self.num_local_experts, self.ranks_per_node, self.intra_group)

    return NodeOnReference


def _run_case(case, rank, world_size, node_size, group, device="cpu", node=None):
    """The flat reference, the two-level reference and (where it runs the case) the two-level
    dispatcher with its moves inside the node on ``node`` (a TwoLevelNVLinkDispatcher class; None:
    on the reference transport) give the same bits; with ``node`` given, or one rank per node (the
    gates' gradient then summed at the source in the kernels' order), the gates' gradient is formed
    in another fixed order than torch's: fp32 rounding."""
    from ds_uniep.reference import ReferenceDispatcher
    from ds_uniep.topology import GroupTopology
    from ds_uniep.twolevel import TwoLevelDispatcher

    E = case.get("E", 2 * world_size)
    g = torch.Generator().manual_seed(1000 * case["seed"] + rank)
    T, idx = _routing(case, rank, world_size, node_size, E, g)
    dtype = case.get("dtype", torch.float32)
    x = torch.randn(T, M, generator=g).to(dtype)
    gates = torch.rand(T, case["k"], generator=g)
    w = (torch.randn(M, M, generator=torch.Generator().manual_seed(7)) * 0.3).to(dtype)
    grad_out = torch.randn(T, M, generator=g).to(dtype)
    x, idx, gates, w, grad_out = (t.to(device) for t in (x, idx, gates, w, grad_out))
    kw = dict(dispatch_dtype=case.get("dispatch_dtype", "activation"), combine=case.get("combine", "slots"))
    topo = GroupTopology(tuple(range(world_size)), node_size, rank)
    ds = [ReferenceDispatcher(E, world_size, group, **kw),
          TwoLevelDispatcher(E, world_size, group, topo, "UniEPMoE[test]", timeout_s=60.0, **kw)]
    if kw == dict(dispatch_dtype="activation", combine="slots"):
        ds.append((node or _node_on_reference())(E, world_size, group, topo, {"max_tokens_per_rank": 64,
                                                 "overlap": {"timeout_s": 60.0}}, M, case["k"], dtype,
                                                 "UniEPMoE[test]"))
    names = ["flat", "two-level", "two-level, in node as the NVLink dispatcher"]
    runs = [(d, name, False) for d, name in zip(ds, names)]
    runs += [(d, name + ", in two phases", True) for d, name in zip(ds[1:], names[1:])]
    results = []
    for d, name, phased in runs:
        xi, gi, wi = x.clone().requires_grad_(), gates.clone().requires_grad_(), w.clone().requires_grad_()
        seen = []
        on_phase = {"on_phase": lambda recv, ph: seen.append((ph.segments(), recv.detach().clone()))} if phased else {}
        recv, counts, handle = d.dispatch(xi, idx, case.get("capacity"), **on_phase)
        if phased:
            _check_phases(seen, recv.detach(), f"rank {rank}: {name} in case {case}")
        y = torch.tanh(recv @ wi)
        out = d.combine(y, gi, handle)
        (out.float() * grad_out.float()).sum().backward()
        results.append((name, (recv.detach(), counts, out.detach(), xi.grad, gi.grad, wi.grad)))
    for name, other in results[1:]:
        for what, a, b in zip(("recv", "counts", "out", "x.grad", "gates.grad", "w.grad"), results[0][1], other):
            if what == "gates.grad" and (node is not None or node_size == 1) and "NVLink" in name:
                torch.testing.assert_close(b, a, msg=lambda m: f"rank {rank}: {name}: {what} in case {case}: {m}")
                continue
            assert a.dtype == b.dtype and torch.equal(a, b), f"rank {rank}: {name}: {what} differs in case {case}"
    return ds[1]


def _check_phases(seen, recv, what):
    """The dispatch in two phases called back twice (this rank's own node, then the others): the
    phases' segments cover every received row once, and when a phase is called back its rows, and
    those of the phase before, already hold their final values."""
    assert len(seen) == 2, f"{what}: {len(seen)} phases called back"
    covered = torch.zeros(recv.shape[0], dtype=torch.int64)
    for i, (segs, snapshot) in enumerate(seen):
        assert segs.dtype == torch.int32 and segs.shape[1] == 4 and (segs[:, 1] > 0).all(), what
        for start, rows, _, _ in segs.tolist():
            covered[start:start + rows] += 1
        ready = covered > 0
        assert torch.equal(snapshot[ready], recv[ready]), f"{what}: phase {i} called back before its rows were in"
    assert (covered == 1).all(), f"{what}: the phases' segments cover rows {covered.tolist()}"


CASES = [dict(k=k, seed=k, drop=k == 2) for k in (1, 2, 6, 8)] + [
    dict(k=2, seed=11, empty="rank"),
    dict(k=6, seed=12, empty="node", drop=True),
    dict(k=2, seed=13, cold_node=True),
    dict(k=2, seed=14, dtype=torch.bfloat16, drop=True),
    dict(k=2, seed=15, dispatch_dtype="fp8_e4m3", dtype=torch.bfloat16),
    dict(k=6, seed=16, combine="rank_partials", drop=True),
    dict(k=2, seed=17, T=6, capacity=12),
]


def _parity(world_size, node_size, cases, rank):
    import torch.distributed as dist
    group = dist.new_group(list(range(world_size)))
    d = None
    for case in cases:
        d = _run_case(case, rank, world_size, node_size, group)
    b = d.cross_node_bytes  # the last case's step
    assert b["two_level"] > 0 and b["flat"] > 0 and set(b) >= {"dispatch_rows", "combine_rows", "routing"}


def _layer_auto(rank, world_size):
    """UniEPMoE with backend auto over nodes of 2 ranks: the two-level reference path, said once, with
    the bits of the flat reference backend (DeepSpeed's top-2 gate, every gradient)."""
    from deepspeed.utils import groups
    from moe_models import MLP, distinct_experts
    from ds_uniep import UniEPMoE
    from ds_uniep.env import logger
    from ds_uniep.twolevel import TwoLevelDispatcher

    said = []
    handler = logging.Handler()
    handler.emit = lambda r: said.append(r.getMessage())
    logger.addHandler(handler)
    E, T = 2 * world_size, 10 + rank
    outs = []
    for node_size, backend in ((world_size, "reference"), (2, "auto")):
        torch.manual_seed(1234)
        layer = UniEPMoE(M, MLP(M, 32), num_experts=E, ep_size=world_size, k=2, drop_tokens=False,
                         config={"backend": backend, "topology": {"node_size": node_size}})
        distinct_experts(layer, rank)
        layer.set_deepspeed_parallelism()
        assert layer.ep_group is groups._get_expert_parallel_group(f"ep_size_{world_size}")
        g = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(T, M, generator=g).requires_grad_()
        out, l_aux, _ = layer(x)
        ((out * torch.randn(T, M, generator=g)).sum() + 0.37 * l_aux).backward()
        outs.append((out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}))
        assert layer.backend_name() == "reference"
        assert isinstance(layer._dispatchers[x.device], TwoLevelDispatcher) == (node_size < world_size)
    logger.removeHandler(handler)
    (o1, gx1, gp1), (o2, gx2, gp2) = outs
    assert torch.equal(o1, o2) and torch.equal(gx1, gx2)
    assert all(torch.equal(gp1[n], gp2[n]) for n in gp1)
    chose = [m for m in said if "backend auto -> reference" in m]
    assert len(chose) == 1 and f"spans {world_size // 2} nodes of 2 ranks" in chose[0] and "two-level" in chose[0], said
    if rank == 0:
        assert any("bytes across nodes" in m and "flat all-to-all sends" in m for m in said), said


TIMEOUT_S = 2.0


def _stop(rank, world_size, node_size, stop_ranks, report_dir):
    """Ranks ``stop_ranks`` stop answering at their second step; every other rank records what it
    raised and how long it waited, then leaves (the stopped ranks never reach the final barrier)."""
    import torch.distributed as dist
    from ds_uniep import twolevel
    from ds_uniep.topology import GroupTopology
    group = dist.new_group(list(range(world_size)))
    topo = GroupTopology(tuple(range(world_size)), node_size, rank)
    d = twolevel.TwoLevelDispatcher(world_size, world_size, group, topo, "UniEPMoE[3]", timeout_s=TIMEOUT_S)
    x, idx = torch.randn(world_size, M), torch.arange(world_size).view(-1, 1)
    others = set(range(world_size)) - set(stop_ranks)
    if rank in stop_ranks:
        def stop(step):
            deadline = time.monotonic() + 3 * TIMEOUT_S + 20
            while step == 2 and time.monotonic() < deadline:  # silent until the others reported
                if all(os.path.exists(os.path.join(report_dir, f"rank{r}")) for r in others):
                    break
                time.sleep(0.1)
            if step == 2:
                os._exit(0)
        twolevel.STOP_FOR_TEST = stop
    recv, _, handle = d.dispatch(x, idx)  # step 1: every rank answers
    d.combine(recv, torch.ones(world_size, 1), handle)
    start = time.monotonic()
    try:
        d.dispatch(x, idx)
        msg = "no error"
    except twolevel.NodeUnreachableError as err:
        msg = str(err)
    path = os.path.join(report_dir, f"rank{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(f"{time.monotonic() - start:.2f}\n{msg}")
    os.replace(path + ".tmp", path)
    os._exit(0)


def _check_stop_reports(report_dir, world_size, node_size, stop_ranks):
    stopped_node = stop_ranks[0] // node_size
    for rank in sorted(set(range(world_size)) - set(stop_ranks)):
        with open(os.path.join(report_dir, f"rank{rank}")) as f:
            took, msg = f.read().split("\n", 1)
        assert msg.startswith("UniEPMoE[3]: step 2: no answer from "), (rank, msg)
        # a rank of the stopped node names its silent node peer; the others the node across
        same_node = rank // node_size == stopped_node
        assert (f"of this rank's node {stopped_node}" if same_node else f"node {stopped_node} (rank ") in msg, \
            (rank, msg)
        assert float(took) < 2 * TIMEOUT_S + 3, (rank, took, msg)


def _two_by_two(rank, world_size, report_dir):
    _parity(world_size, 2, CASES, rank)
    _layer_auto(rank, world_size)
    _stop(rank, world_size, 2, (3, ), report_dir)


def test_two_nodes_of_two_bitwise_flat_auto_and_a_stopped_rank():
    """4 ranks as 2 nodes of 2: every case bitwise equal to the flat reference; auto; rank 3 stops."""
    with tempfile.TemporaryDirectory() as report_dir:
        run_distributed(_two_by_two, 4, report_dir, timeout=300)
        _check_stop_reports(report_dir, 4, 2, (3, ))


def _parity_of_fitting_cases(rank, world_size, node_size):
    _parity(world_size, node_size, [c for c in CASES if c["k"] <= c.get("E", 2 * world_size)], rank)


@pytest.mark.parametrize("world_size,node_size", [(2, 1), (6, 2)])
def test_two_nodes_of_one_and_three_of_two_bitwise_flat(world_size, node_size):
    """2 ranks as 2 nodes of 1 (nothing moves inside a node) and 6 as 3 nodes of 2 (a node's other
    nodes lie on both sides of it): bitwise equal to the flat reference, in one phase and in two."""
    run_distributed(_parity_of_fitting_cases, world_size, node_size, timeout=300)


EIGHT = [dict(k=k, seed=20 + k, E=16, drop=k == 6) for k in (1, 2, 6, 8)] + [
    dict(k=2, seed=30, E=16, empty="node"), dict(k=6, seed=31, E=16, cold_node=True)]


def _two_by_four(rank, world_size, report_dir):
    _parity(world_size, 4, EIGHT, rank)
    _stop(rank, world_size, 4, (4, 5, 6, 7), report_dir)


def test_two_nodes_of_four_bitwise_flat_and_a_stopped_node():
    """8 ranks as 2 nodes of 4: bitwise equal to the flat reference; node 1 stops answering."""
    with tempfile.TemporaryDirectory() as report_dir:
        run_distributed(_two_by_four, 8, report_dir, timeout=300)
        _check_stop_reports(report_dir, 8, 4, (4, 5, 6, 7))


# ---------------------------------------------------------------- one description of the machine
def test_group_topology_nodes_locals_and_cross_groups():
    from ds_uniep.topology import GroupTopology
    t = GroupTopology(tuple(range(8)), 4, me=5)
    assert t.nodes == [[0, 1, 2, 3], [4, 5, 6, 7]] and t.spans_nodes and t.uniform
    assert (t.node_of(5), t.local_of(5), t.node_group(), t.cross_group()) == (1, 1, [4, 5, 6, 7], [1, 5])
    assert t.describe() == "2 nodes of 4 ranks"
    # An expert-parallel group strided over the world (data parallel first): ranks 1, 3, ... of 4 nodes of 2.
    s = GroupTopology((1, 3, 5, 7), 2, me=2)
    assert s.nodes == [[0], [1], [2], [3]] and s.cross_group() == [0, 1, 2, 3] and s.node_label(2) == 2
    assert not GroupTopology((0, 1, 2, 3), 4).spans_nodes
    assert not GroupTopology((0, 1, 2, 4), 2).uniform  # 2 + 1 + 1 of the group's ranks on its nodes


def test_node_size_from_config_then_launcher_then_one_node(monkeypatch):
    from ds_uniep.config import UniEPConfig
    from ds_uniep.topology import LOCAL_SIZE_VARS, node_size
    for var in LOCAL_SIZE_VARS:
        monkeypatch.delenv(var, raising=False)
    assert node_size(None, world_size=16) == 16
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    assert node_size(None, 16) == 4
    monkeypatch.setenv("LOCAL_SIZE", "2")  # the DeepSpeed launcher's, before Open MPI's
    assert node_size(UniEPConfig.from_dict({}).topology, 16) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # torchrun's first
    assert node_size(None, 16) == 8
    assert node_size(UniEPConfig.from_dict({"topology": {"node_size": 1}}).topology, 16) == 1
    with pytest.raises(ValueError, match="uniep.topology.node_size"):
        UniEPConfig.from_dict({"topology": {"node_size": 0}})


def test_backend_on_a_group_spanning_nodes(caplog):
    from ds_uniep.backend import UniEPBackendError, resolve
    from ds_uniep.topology import GroupTopology
    spans = GroupTopology((0, 1, 2, 3), 2)
    with pytest.raises(UniEPBackendError, match="spans 2 nodes of 2 ranks and inputs are on cpu"):
        resolve("megakernel", torch.device("cpu"), "UniEPMoE[0]", spans)
    caplog.set_level(logging.INFO, logger="ds_uniep")
    from ds_uniep.env import logger
    logger.propagate = True
    try:
        assert resolve("auto", torch.device("cpu"), "UniEPMoE[0]", spans) == "reference"
        assert resolve("auto", torch.device("cpu"), "UniEPMoE[1]", GroupTopology((0, 1, 2, 4), 2)) == "reference"
    finally:
        logger.propagate = False
    said = [r.getMessage() for r in caplog.records]
    assert any("UniEPMoE[0]: backend auto -> reference" in m and "two-level reference path" in m for m in said)
    assert any("UniEPMoE[1]" in m and "flat reference all-to-all" in m for m in said)


def test_megakernel_across_nodes_where_it_can_run(monkeypatch, caplog):
    """Where the megakernel can run on the node's GPUs, a group spanning nodes of equal size runs it
    inside each node (auto says so); unequal nodes, or a setting that path does not run, take the
    reference backend under auto and are an error naming them under "megakernel"."""
    from ds_uniep import backend
    from ds_uniep.topology import GroupTopology
    monkeypatch.setattr(backend, "megakernel_status", lambda device: (True, ""))
    spans, uneven = GroupTopology((0, 1, 2, 3), 2), GroupTopology((0, 1, 2, 4), 2)
    cuda = torch.device("cuda", 0)
    caplog.set_level(logging.INFO, logger="ds_uniep")
    from ds_uniep.env import logger
    logger.propagate = True
    try:
        assert backend.resolve("auto", cuda, "L0", spans) == "megakernel"
        assert backend.resolve("megakernel", cuda, "L1", spans) == "megakernel"
        assert backend.resolve("auto", cuda, "L2", uneven) == "reference"
        assert backend.resolve("auto", cuda, "L3", spans, "compression.combine 'rank_partials'") == "reference"
    finally:
        logger.propagate = False
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert "L0: backend auto -> megakernel across nodes" in said and "NCCL between nodes" in said, said
    assert "L2: backend auto -> reference" in said and "flat reference all-to-all" in said, said
    assert "L3: backend auto -> reference" in said and "'rank_partials' runs on the reference backend" in said, said
    with pytest.raises(backend.UniEPBackendError, match="L4: .*different numbers of its ranks"):
        backend.resolve("megakernel", cuda, "L4", uneven)
    with pytest.raises(backend.UniEPBackendError, match="L5: .*'fp8_e4m3' runs on the reference backend"):
        backend.resolve("megakernel", cuda, "L5", spans, "compression.dispatch_dtype 'fp8_e4m3'")


def test_hybrid_sites_come_from_the_same_topology():
    from ds_uniep.hybrid.topology import Topology
    from ds_uniep.topology import GroupTopology
    t = Topology.from_nodes(GroupTopology(tuple(range(8)), 2), domain_size=4)
    assert (t.num_domains, t.nodes_per_domain, t.gpus_per_node) == (2, 2, 2)
    assert t.level(0, 1) == "node" and t.level(0, 2) == "domain" and t.level(0, 4) == "inter"


def test_example_hostfile_parses_as_deepspeed_reads_it():
    from deepspeed.launcher.runner import _parse_hostfile
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "hostfile")
    with open(path) as f:
        assert dict(_parse_hostfile(f.readlines())) == {"node0": 8, "node1": 8}


def test_megakernel_across_nodes_takes_a_plans_knobs_on_the_sequential_kernels():
    """A tuning plan's knobs reach the node's NVLink dispatcher (copy blocks, combine chunks), which
    runs the sequential schedule's kernels whatever schedule the plan names."""
    import types

    from ds_uniep.config import UniEPConfig
    from ds_uniep.twolevel import TwoLevelNVLinkDispatcher
    d = object.__new__(TwoLevelNVLinkDispatcher)
    got = []
    d.nvl = types.SimpleNamespace(set_knobs=got.append)
    cfg = UniEPConfig.coerce({"overlap": {"schedule": "fused", "num_comm_sms": 8, "combine_chunks": 4}})
    d.set_config(cfg)
    assert len(got) == 1 and got[0].schedule == "sequential"
    assert (got[0].num_comm_sms, got[0].combine_chunks) == (8, 4), got
    d.nvl = None  # one rank per node: nothing to tell
    d.set_config(cfg)


def test_pipelined_across_nodes_runs_on_ds_uniep_gemm_else_says_why(caplog):
    """``overlap.schedule`` "pipelined" on the megakernel across nodes runs the two-phase schedule
    where the experts run on ds_uniep's grouped GEMM in bf16; elsewhere the sequential one, saying
    why; the knobs it does not read are named."""
    from ds_uniep import SwiGLUExpert, UniEPMoE, schedules
    from ds_uniep.env import logger
    from ds_uniep.twolevel import TwoLevelNVLinkDispatcher
    layer = UniEPMoE(64, SwiGLUExpert(64, 32), num_experts=4, ep_size=1, k=2, drop_tokens=False,
                     config={"overlap": {"schedule": "pipelined", "num_chunks": 2}}).to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    d = object.__new__(TwoLevelNVLinkDispatcher)  # resolve reads only its type
    caplog.set_level(logging.INFO, logger="ds_uniep")
    logger.propagate = True
    try:
        layer._expert_gemm = lambda device: "uniep"
        assert isinstance(schedules.resolve(layer, x, d), schedules.NodePipelined)
        layer._expert_gemm = lambda device: "torch"
        assert isinstance(schedules.resolve(layer, x, d), schedules.Sequential)
        schedules.say_unread_knobs(layer.uniep_config.overlap, "megakernel across nodes", "L9")
    finally:
        logger.propagate = False
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert "the pipelined schedule cannot run here (across nodes its phases' first GEMM runs on ds_uniep's" in said, \
        said
    unread = {m for m in said.split(" | ") if m.startswith("L9: ")}
    assert len(unread) == 1 and all("num_chunks=2" in m and "schedule=" not in m for m in unread), unread
