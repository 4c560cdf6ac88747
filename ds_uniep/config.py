"""The ``"uniep"`` block of ds_config.json.

Every field is documented in its ``description``; docs/config.md is generated
from the same text (``python docs/gen_config.py``). A config is
validated once, when it is built: unknown keys and bad values raise
:class:`UniEPConfigError` naming the key (``uniep.overlap.schedule``) and the
allowed values. The expert-parallel knobs (``overlap``, ``compression.dispatch_dtype``,
``expert_gemm``) are checked against :mod:`ds_uniep.knobs`, and
:meth:`UniEPConfig.knobs` returns them as one :class:`~ds_uniep.knobs.Knobs`.

Example::

    "uniep": {
        "backend": "auto",
        "max_tokens_per_rank": 8192,
        "overlap": {"schedule": "pipelined", "num_chunks": 4},
        "compression": {"dispatch_dtype": "activation", "combine": "slots"},
        "autotune": {"enabled": false}
    }
"""

import json
import os
from typing import Any, Dict, Literal, Mapping, Optional, Union

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from . import knobs as _knobs
from .knobs import DISPATCH_DTYPES, EXPERT_GEMMS, GRANULARITIES, ROLES, SCHEDULES, Knobs

UNIEP_KEY = "uniep"


class UniEPConfigError(ValueError):
    """A ``"uniep"`` block that does not validate; the message names every bad key."""


class _Block(DeepSpeedConfigModel):
    """Strict types: ``"8192"`` is not an int and ``"yes"`` is not a bool here."""
    model_config = ConfigDict(strict=True)


class OverlapConfig(_Block):
    """How communication overlaps the expert GEMMs (megakernel backend).

    Every value gives bitwise identical results: the schedule only changes
    when rows move, never the order in which they are reduced. The allowed
    values and ranges are those of :mod:`ds_uniep.knobs`."""

    schedule: Literal[SCHEDULES] = Field(
        "sequential",
        description="sequential: dispatch, expert GEMMs, combine, one after another; pipelined (megakernel): the "
        "local experts in num_chunks chunks, each chunk's output rows copied back while the next computes; fused "
        "(megakernel, expert_gemm 'uniep', bf16): the dispatch runs beside the first expert GEMM, whose tiles wait "
        "for their rows, and the second GEMM's epilogue stores the output rows into their sources' combine "
        "buffers. Across nodes (megakernel, expert_gemm 'uniep'), pipelined starts the first expert GEMM on the "
        "rows of the rank's own node while the other nodes' rows cross. Set pipelined or fused to hide communication "
        "behind the GEMMs, or let autotune choose.")
    num_chunks: int = Field(2, description="Chunks of local experts the pipelined schedule splits the GEMMs "
                            "into (at most one per local expert). Read by the pipelined schedule only.")
    num_comm_sms: Optional[int] = Field(
        None, description="Blocks of the megakernel's dispatch and combine copy kernels, and under the fused "
        "schedule the SMs its dispatch takes beside the first GEMM in partitioned roles; null: one block per SM "
        f"for the copy kernels, {_knobs.FUSED_COMM_SMS} SMs for that fused dispatch. Set it to leave SMs to the "
        "GEMMs; with the pipelined schedule on expert_gemm 'uniep' it makes this many blocks copy the chunks "
        "back instead of the copy engines.")
    combine_chunks: int = Field(16, description="Chunks of source tokens the megakernel's combine kernel (and the "
                                "backward of dispatch) is pipelined over, 0: push, then reduce, as two kernels; "
                                "read where the combine kernels move the rows (the sequential schedule, the fused "
                                "one without epilogue_combine). The same bits for every value: a speed knob the "
                                "tuner walks.")
    combine_queue: bool = Field(True, description="The chunked combine's pushing warps take their rows from one "
                                "shared queue (false: each pushing block walks a fixed share of the rows); read "
                                "with combine_chunks > 0. The same bits either way: a speed knob the tuner walks.")
    fused_dispatch: bool = Field(True, description="The fused schedule's dispatch runs beside its first expert "
                                 "GEMM, whose tiles wait for their rows (false: the sequential dispatch, then the "
                                 "GEMM). Read by the fused schedule only.")
    epilogue_combine: bool = Field(True, description="The fused schedule's second expert GEMM (in the backward, the "
                                   "first GEMM's dgrad) stores its rows straight into their sources' combine buffers "
                                   "(false: the combine kernels move them). Read by the fused schedule only.")
    roles: Literal[ROLES] = Field(
        "interleaved",
        description="Where the fused dispatch runs: interleaved, on every SM before the first expert GEMM, the "
        "arrivals taken in by a spare warp of each of the GEMM's CTAs; partitioned, on num_comm_sms whole SMs "
        "beside the GEMM. Read with the fused schedule's fused_dispatch; the same bits either way.")
    tile_m: Optional[int] = Field(None, description="Tile rows (64, 128 or 256) of every expert GEMM run by "
                                  "ds_uniep's GEMM (expert_gemm 'uniep'); null: the GEMM picks its tile, or 128 "
                                  "when tile_n is set. Set it to pin one of the tiles the GEMM is built with "
                                  "(128x256, 256x128, 128x128); the bits are the same.")
    tile_n: Optional[int] = Field(None, description="Tile columns (64, 128 or 256) of ds_uniep's GEMM; see tile_m.")
    signal_granularity: Literal[GRANULARITIES] = Field(
        "tile", description="What one wait of the fused schedule's first expert GEMM covers: a run of whole tiles "
        "(tile), an expert's rows (expert) or all of this rank's rows (rank). Read with fused_dispatch; the same "
        "bits under each, and the tuner keeps the configured value.")
    timeout_s: float = Field(100.0, gt=0, description="Seconds a kernel waits on a peer's signal before it "
                             "raises an error naming the layer, rank and signal. Raise it where ranks may reach "
                             "a layer far apart (a debugger, very uneven work). The reference backend's "
                             "collectives on CPU tensors (gloo) wait as long; over NCCL the process group's own "
                             "timeout applies (docs/reliability.md).")

    @field_validator("num_chunks", "num_comm_sms", "combine_chunks", "tile_m", "tile_n")
    @classmethod
    def _knob(cls, v, info):
        return _knobs.check(info.field_name, v)


class CompressionConfig(_Block):
    """Communication compression. Any value but the default changes numerics."""

    dispatch_dtype: Literal[DISPATCH_DTYPES] = Field(
        "activation",
        description="activation: rows travel in the activation dtype (exact); fp8_e4m3: as FP8 e4m3 with one "
        "fp32 scale per 128 elements (deterministic, not exact). Set fp8_e4m3 to cut dispatch bytes where that "
        "rounding is acceptable.")
    combine: Literal["slots", "rank_partials"] = Field(
        "slots",
        description="slots: every (token, slot) output row travels back and the source sums the token's k rows in "
        "slot order in fp32; rank_partials: each expert rank first sums its slots of a token and sends one row "
        "per token and rank, added at the source in fp32 (fewer bytes, one more rounding per rank). "
        "rank_partials runs on the reference backend and in the megakernel's combine kernels (the sequential "
        "schedule, the fused one without epilogue_combine).")


class AutotuneConfig(_Block):
    """Search of the tuning space (``ds_uniep.tuning``) on the live shapes."""

    enabled: bool = Field(False, description="Each UniEPMoE tunes itself on its first forward with a new (tokens "
                          "per rank, dtype, device): a cached plan is used as is, otherwise all expert-parallel "
                          "ranks time the plans, agree on one and cache it. Set it for runs long enough to repay "
                          "budget_s per shape.")
    cache_dir: str = Field("~/.cache/ds_uniep", description="Directory of the JSON plan cache.")
    budget_s: float = Field(60.0, gt=0, description="Seconds one layer shape may spend tuning after the configured "
                            "plan and the sequential baseline are timed, the confirmation round included.")
    allow_numerics_change: bool = Field(
        False, description="Let the tuner explore options that change numbers (FP8 dispatch).")
    warmup: int = Field(3, ge=0, description="Untimed runs per candidate plan.")
    repeats: int = Field(10, ge=1, description="Timed runs per candidate plan; the median counts.")
    confirm_top: int = Field(4, ge=0, description="After the search, the fastest this many plans and the "
                             "configured one are timed again in turns and the smallest median over the rounds "
                             "wins, so a plan that timed fast once by chance does not; 0: the search's fastest "
                             "wins.")
    confirm_rounds: int = Field(3, ge=1, description="Rounds of the confirmation (each: warmup and repeats runs of "
                                "every finalist, in an order rotated by one each round).")


class CommFuseConfig(_Block):
    """All-gather+GEMM and GEMM+reduce-scatter as peer-to-peer steps (``ds_uniep.commfuse``), read by
    ColumnParallelLinear/RowParallelLinear (``config=``), UniEPMoE's TP-sharded experts, UlyssesAttention
    and ShardedLinear (these two take ring, bidirectional_ring or local_first)."""

    schedule: Literal["ring", "bidirectional_ring", "local_first", "arrival", "relay"] = Field(
        "ring", description="ring: one neighbour per step; bidirectional_ring: blocks travel the shorter way "
        "round; local_first: every block moves in one step while this rank's block is multiplied; arrival (CUDA, "
        "Hopper, bf16): as local_first, with the all-gather's GEMM one launch of ds_uniep's grouped GEMM whose "
        "tiles wait for their block; relay (reduce-scatter): each block's fp32 running sum travels round the "
        "ring, every rank adding its product in its GEMM's epilogue. All agree with the rank-order schedules "
        "within the GEMM's or the input dtype's rounding.")
    num_chunks: int = Field(1, ge=1, le=16, description="Chunks each peer-to-peer step is split into (p2p "
                            "transport), or the row chunks of the reduce-scatter's own GEMM (copy_engine) and of "
                            "each relay step's GEMM, each passed on when done. Raise it to overlap transfers and "
                            "GEMMs more finely.")
    transport: Literal["auto", "p2p", "copy_engine"] = Field(
        "auto", description="p2p: NCCL/gloo send/recv; copy_engine: copies into peers' symmetric buffers (CUDA, "
        "no SMs taken from the GEMMs); auto: copy_engine where usable, else p2p. The arrival schedule needs the "
        "copy engines (auto or copy_engine).")

    @model_validator(mode="after")
    def _arrival_needs_copy_engines(self):
        if self.schedule == "arrival" and self.transport == "p2p":
            raise ValueError("schedule 'arrival' moves blocks by the copy engines; transport 'p2p' does not apply "
                             "(use 'auto' or 'copy_engine')")
        return self


class HybridCompressionConfig(_Block):
    """Parameter-efficient expert migration: a shared base once, then sparse residuals."""

    enabled: bool = Field(False, description="Migrate experts as a shared base (the domain's mean expert, "
                          "all-reduced once) plus each expert's top-ratio residual positions (changes numerics). "
                          "domain_size auto charges these bytes.")
    ratio: float = Field(0.1, gt=0, le=1, description="Fraction of residual values kept per expert.")


class HybridConfig(_Block):
    """Expert parallelism across slow links (``ds_uniep.hybrid``).

    A *site* is a set of ranks joined by fast links (a node, a data centre); a
    *domain* is the set of ranks that gather each other's experts, chosen by the
    planner. A domain inside one site saves nothing on the slow links."""

    enabled: bool = Field(False, description="Gather experts inside a domain; send tokens only across domains. "
                          "Set it when the expert-parallel ranks span slow links.")
    site_size: Union[int, Literal["auto"]] = Field(
        "auto", description="Ranks joined by fast links (planner input), or auto: the ranks of one node "
        "(uniep.topology).")
    domain_size: Union[int, Literal["auto"]] = Field(
        "auto", description="Ranks per domain (must divide the EP size; 1 is plain EP), or auto: chosen by the "
        "planner from the layer's sizes, the site size and the two bandwidths.")
    intra_site_bandwidth: Union[float, Literal["measure"]] = Field(
        "measure", description="Bytes/s per rank between ranks of one site (planner input), or measure: timed "
        "ring exchanges at start-up.")
    inter_site_bandwidth: Union[float, Literal["measure"]] = Field(
        "measure", description="Bytes/s per rank between sites (planner input), or measure: timed ring "
        "exchanges at start-up.")
    migrated_fraction: Union[float, Literal["auto"]] = Field(
        "auto", description="Share of each rank's experts migrated inside its domain, round(f * L) of its L (0 is "
        "plain EP; which ones: migrated_experts). auto: chosen by the planner with domain_size auto, all of them "
        "with a fixed domain_size.")
    migrated_experts: Literal["first", "hottest"] = Field(
        "hottest", description="Which of a rank's experts migrate when only some do: its first ones, or the "
        "hottest, those the other ranks of its domain routed the most tokens to since the last gather (with "
        "reuse_replicas, the last optimizer step), ties to the smaller index. Every rank makes the same choice, "
        "from token counts all-gathered at each dispatch.")
    compression: HybridCompressionConfig = Field(default_factory=HybridCompressionConfig,
                                                 description="Compressed expert migration.")
    reuse_replicas: bool = Field(
        False, description="Migrate once per optimizer step: the gathered replicas serve later forwards while the "
        "experts' weights are unchanged, and their gradients are summed over the step's micro-batches and "
        "returned at its last one (weights changed other than by an optimizer step or an in-place parameter "
        "update need UniEPMoE.refresh_replicas()). Set it with gradient accumulation; domain_size auto then "
        "plans with M = gradient_accumulation_steps.")
    replan_after_steps: int = Field(
        0, ge=0, description="With domain_size auto: at the first forward after this many optimizer steps, plan "
        "again for the routing seen so far (the same on every rank) and switch to that plan where it gains "
        "replan_min_gain. 0: plan once, at start-up, for uniform routing.")
    replan_min_gain: float = Field(
        0.05, ge=0, lt=1, description="replan_after_steps switches only where the new plan's predicted time for "
        "the routing seen is at least this fraction below the current plan's. A switch builds new groups, so "
        "keep it above the planner's error.")
    replan_compute: Literal["measure", "estimate"] = Field(
        "measure", description="The compute times replan_after_steps plans with: measure, this rank's experts' "
        "forward timed once over max_tokens_per_rank * k rows and averaged over the world's ranks; estimate, "
        "FLOPs at a fixed rate, as the start-up plan uses.")

    @model_validator(mode="after")
    def _replan_needs_auto(self):
        if self.replan_after_steps and self.domain_size != "auto":
            raise ValueError(f"replan_after_steps {self.replan_after_steps} needs domain_size 'auto' (the plan is "
                             f"what it redoes), got domain_size {self.domain_size}")
        return self

    @field_validator("site_size", "domain_size")
    @classmethod
    def _size(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError(f"must be a positive integer or 'auto', got {v}")
        return v

    @field_validator("migrated_fraction")
    @classmethod
    def _fraction(cls, v):
        if not isinstance(v, str) and not 0 <= v <= 1:
            raise ValueError(f"must be a number in [0, 1] or 'auto', got {v}")
        return v

    @field_validator("intra_site_bandwidth", "inter_site_bandwidth")
    @classmethod
    def _bw(cls, v):
        if not isinstance(v, str) and v <= 0:
            raise ValueError(f"must be a positive number of bytes/s or 'measure', got {v}")
        return v


class TopologyConfig(_Block):
    """Which ranks share a node (``ds_uniep.topology``), read by the dispatch, the backend choice and
    HybridEP's sites. Its exchanges across nodes wait at most ``overlap.timeout_s`` for a peer."""

    node_size: Union[int, Literal["auto"]] = Field(
        "auto", description="Ranks per node, nodes being runs of consecutive global ranks; auto: the launcher's "
        "local world size (LOCAL_WORLD_SIZE, LOCAL_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE), else one node. Set it "
        "smaller than the expert-parallel size to emulate several nodes on one host.")

    @field_validator("node_size")
    @classmethod
    def _node_size(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError(f"must be a positive integer or 'auto', got {v}")
        return v


class UniEPConfig(_Block):
    """The ``"uniep"`` block of ds_config.json."""

    enabled: bool = Field(True, description="Use ds_uniep's path in UniEPMoE; false runs DeepSpeed's own MOELayer.")
    backend: Literal["auto", "reference", "megakernel"] = Field(
        "auto",
        description="reference: torch ops and all_to_all_single (any device); megakernel: the CUDA kernels "
        "(Hopper GPUs with NVLink peers); auto: megakernel where possible, else reference, logged once.")
    max_tokens_per_rank: int = Field(
        8192, ge=1, description="Largest token count one rank feeds a layer; sizes the symmetric buffers.")
    sync_free: bool = Field(
        False, description="Megakernel backend: no host read of counts in forward or backward, so the layer can "
        "be captured in a CUDA graph and replayed with new tokens and routing. Expert rows are sized by "
        "max_tokens_per_rank; sequential schedule; grouped bias-free experts; DeepSpeed's dropless top-2/top-k "
        "gate or a ds_uniep router.")
    expert_gemm: Literal[EXPERT_GEMMS] = Field(
        "torch",
        description="Grouped GEMM of recognised bf16 MLP experts (SwiGLU, GeLU): torch (torch._grouped_mm) or uniep "
        "(ds_uniep's CUTLASS wgmma kernels, Hopper), the same bits either way. Set uniep for the fused schedule "
        "or tile_m/tile_n; HybridEP and expert tensor parallelism run on torch.")
    overlap: OverlapConfig = Field(default_factory=OverlapConfig,
                                   description="Overlap schedule and kernel knobs of the megakernel backend (the "
                                   "tuning space).")
    compression: CompressionConfig = Field(default_factory=CompressionConfig,
                                           description="Communication compression.")
    autotune: AutotuneConfig = Field(default_factory=AutotuneConfig, description="Automatic tuning.")
    commfuse: CommFuseConfig = Field(default_factory=CommFuseConfig, description="CommFuse for TP/SP linears.")
    hybrid: HybridConfig = Field(default_factory=HybridConfig, description="HybridEP over slow links.")
    topology: TopologyConfig = Field(default_factory=TopologyConfig,
                                     description="Which ranks share a node (expert parallelism across nodes).")

    def knobs(self, **changes) -> Knobs:
        """The expert-parallel knobs of this block (``changes`` applied before they are normalised, see
        :meth:`Knobs.from_config`)."""
        return Knobs.from_config(self, **changes)

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_dict(cls, block: Optional[Mapping[str, Any]]) -> "UniEPConfig":
        """Validate a ``"uniep"`` block (the value, not the whole ds_config)."""
        if block is None:
            block = {}
        if not isinstance(block, Mapping):
            raise UniEPConfigError(f"uniep: expected an object, got {type(block).__name__}")
        try:
            return cls(strict=True, **dict(block))
        except ValidationError as err:
            raise UniEPConfigError(_describe(err, cls)) from None

    @classmethod
    def from_ds_config(cls, ds_config: Union[str, os.PathLike, Mapping[str, Any], None]) -> "UniEPConfig":
        """Build from a ds_config path or dict; a missing ``"uniep"`` block gives the defaults."""
        if ds_config is None:
            return cls.from_dict({})
        if isinstance(ds_config, (str, os.PathLike)):
            with open(ds_config) as f:
                ds_config = json.load(f)
        if not isinstance(ds_config, Mapping):
            raise UniEPConfigError(f"ds_config: expected a path or a dict, got {type(ds_config).__name__}")
        return cls.from_dict(ds_config.get(UNIEP_KEY))

    @classmethod
    def from_engine(cls, engine) -> "UniEPConfig":
        """Build from a ``deepspeed.initialize`` engine (``engine._config._param_dict``)."""
        return cls.from_ds_config(engine._config._param_dict)

    @classmethod
    def coerce(cls, config: Union["UniEPConfig", str, os.PathLike, Mapping[str, Any], None]) -> "UniEPConfig":
        """Accept a UniEPConfig, a ds_config path or dict (with a ``"uniep"`` key), or a bare block
        (a dict, or a JSON file holding one: no ``"uniep"`` key and none of DeepSpeed's usual
        top-level keys; its keys are then checked as the block's, so a typo is an error, not the
        defaults)."""
        if isinstance(config, UniEPConfig):
            return config
        if isinstance(config, (str, os.PathLike)):
            with open(config) as f:
                config = json.load(f)
        if isinstance(config, Mapping) and UNIEP_KEY not in config and not _looks_like_ds_config(config):
            return cls.from_dict(config)
        return cls.from_ds_config(config)


_DS_TOP_LEVEL_HINTS = ("train_batch_size", "train_micro_batch_size_per_gpu", "optimizer", "zero_optimization",
                       "bf16", "fp16", "gradient_accumulation_steps", "gradient_clipping", "steps_per_print",
                       "scheduler", "wall_clock_breakdown", "zero_allow_untested_optimizer", "prescale_gradients",
                       "communication_data_type", "activation_checkpointing", "flops_profiler", "amp",
                       "data_types", "checkpoint", "tensorboard", "wandb", "csv_monitor", "comms_logger")


def _looks_like_ds_config(d: Mapping[str, Any]) -> bool:
    return any(k in d for k in _DS_TOP_LEVEL_HINTS)


def _model_at(model_cls, loc):
    """The config class that owns the field at ``loc`` (for listing allowed keys)."""
    cls = model_cls
    for part in loc[:-1]:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation,
                                                                                   DeepSpeedConfigModel):
            return None
        cls = field.annotation
    return cls


def _describe(err: ValidationError, model_cls) -> str:
    """One line per bad key: an unknown key lists the allowed ones; a value of the wrong type names the type the
    key takes and the type given (``uniep.max_tokens_per_rank: expected int, got str '8192'``); any other bad
    value says what is wrong with it."""
    type_names = {"int_type": "int", "int_from_float": "int", "float_type": "number", "bool_type": "bool",
                  "string_type": "str", "model_type": "an object", "dict_type": "an object",
                  "model_attributes_type": "an object", "none_required": "null"}

    def given(value) -> str:
        text = repr(value)
        text = text if len(text) <= 80 else text[:77] + "..."
        return "null" if value is None else f"{type(value).__name__} {text}"

    def expected(e) -> str:
        if e["type"] == "literal_error":
            values = str(e.get("ctx", {}).get("expected", "")).replace(" or ", ", ")
            return values if values.count(",") == 0 else f"one of {values}"
        return type_names.get(e["type"], e["type"])

    keys, wrong_type, other = [], {}, {}
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p in ("int", "float", "str", "bool"))
                    and not str(p).startswith(("literal[", "function-")))
        key = ".".join([UNIEP_KEY] + [str(p) for p in loc])
        if key not in keys:
            keys.append(key)
        if e["type"] == "extra_forbidden":
            owner = _model_at(model_cls, loc)
            allowed = ", ".join(sorted(owner.model_fields)) if owner else "?"
            other.setdefault(key, f"{key}: unknown key; allowed keys here: {allowed}")
        elif e["type"] in type_names or e["type"] == "literal_error":
            # pydantic reports every member of a Union: gather what each member takes.
            names, value = wrong_type.setdefault(key, ([], e.get("input")))
            if expected(e) not in names:
                names.append(expected(e))
        else:
            msg = e["msg"][len("Value error, "):] if e["msg"].startswith("Value error, ") else e["msg"]
            # the value itself, unless the message already names it (field validators' messages do)
            other.setdefault(key, f"{key}: {msg}" + ("" if "got " in msg else f" (got {given(e.get('input'))})"))
    out = []
    for key in keys:
        if key in other:
            out.append(other[key])
        else:
            names, value = wrong_type[key]
            out.append(f"{key}: expected {' or '.join(names)}, got {given(value)}")
    return "invalid \"uniep\" config:\n  " + "\n  ".join(out)


def describe_fields(model_cls=UniEPConfig, prefix: str = UNIEP_KEY) -> Dict[str, str]:
    """``{"uniep.overlap.schedule": "description (default ...)"}`` for every field, for the docs."""
    out: Dict[str, str] = {}
    for name, field in model_cls.model_fields.items():
        key = f"{prefix}.{name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, DeepSpeedConfigModel):
            out[key] = field.description or ""
            out.update(describe_fields(ann, key))
        else:
            default = field.default if field.default_factory is None else field.default_factory()
            out[key] = f"{field.description} (default {json.dumps(default)})"
    return out


if __name__ == "__main__":
    for k, v in describe_fields().items():
        print(f"- `{k}`: {v}")
