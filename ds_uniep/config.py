"""The ``"uniep"`` block of ds_config.json.

Every field is documented in its ``description``; ``docs`` in README.md is
generated from the same text (``python -m ds_uniep.config``). A config is
validated once, when it is built: unknown keys and bad values raise
:class:`UniEPConfigError` naming the key (``uniep.overlap.schedule``) and the
allowed values.

Example::

    "uniep": {
        "backend": "auto",
        "deterministic": true,
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

UNIEP_KEY = "uniep"


class UniEPConfigError(ValueError):
    """A ``"uniep"`` block that does not validate; the message names every bad key."""


class _Block(DeepSpeedConfigModel):
    """Strict types: ``"8192"`` is not an int and ``"yes"`` is not a bool here."""
    model_config = ConfigDict(strict=True)


class OverlapConfig(_Block):
    """How communication overlaps the expert GEMMs (megakernel backend).

    Every value gives bitwise identical results: the schedule only changes
    when rows move, never the order in which they are reduced."""

    schedule: Literal["sequential", "pipelined", "fused"] = Field(
        "sequential",
        description="sequential: dispatch, then GEMMs, then combine, no overlap; pipelined (megakernel backend): "
        "the local experts in num_chunks chunks, each chunk's output rows copied back to their sources by the copy "
        "engines while the next chunk computes (and, in the backward, each chunk's input gradient while the "
        "others' backward runs); fused (megakernel backend, expert_gemm 'uniep', bf16): the dispatch stores the "
        "rows one destination rank at a time from num_comm_sms SMs (roles 'interleaved': from every SM before the "
        "first expert GEMM, whose CTAs take the arrivals in from a spare warp each) and signals each rank as soon "
        "as its rows are there, while the first expert GEMM runs on the other SMs (interleaved: on every SM) and "
        "starts each run of its tiles once the latest source rank among the tile's rows has arrived, this "
        "rank's own rows first (fused_dispatch), and the "
        "second expert GEMM's epilogue stores each (expert, source) run of output rows straight into that "
        "source's combine buffer, where the source sums its tokens' rows in slot order (epilogue_combine); in "
        "the backward the first expert GEMM's dgrad stores the input-gradient rows into the sources' combine "
        "buffers the same way, while its wgrad runs (epilogue_combine), and the gate gradients are formed at the "
        "sources; the rest of the backward runs as in sequential.")
    num_chunks: int = Field(2, ge=1, le=64, description="Chunks of local experts for the pipelined schedule (at "
                            "most one per local expert).")
    num_comm_sms: int = Field(20, ge=1, le=132, description="SMs given to dispatch/combine: the megakernel "
                              "launches its dispatch and combine copy kernels with this many blocks (the chunked "
                              "combine: this many summing blocks beside half as many pushing ones) when this is "
                              "set (in the block or by a tuning plan); left unset, the sequential schedule gives "
                              "them one block per SM. Set, with the pipelined schedule and expert_gemm 'uniep', the "
                              "chunks' rows are copied back by SM stores from this many blocks while the GEMMs run "
                              "on the other SMs (unset, or with torch's GEMM: by the copy engines).")
    combine_chunks: int = Field(16, ge=0, le=64, description="The megakernel's combine (and the backward of "
                                "dispatch) as one kernel pipelined over this many chunks of source tokens "
                                "(max_tokens_per_rank split evenly, but no chunk under 256 tokens, so fewer chunks "
                                "where the buffers are small): a source sums a chunk's rows while later chunks are "
                                "still being pushed; 0: push, then reduce, as two kernels. Read where the combine "
                                "kernels move the rows (the sequential schedule; the fused one without "
                                "epilogue_combine). The same bits for every value.")
    combine_queue: bool = Field(True, description="The chunked combine's pushing blocks first sort all rows by "
                                "chunk into one order, then every pushing warp takes its next rows from one shared "
                                "queue, so blocks that store faster push more (false: each pushing block walks a "
                                "fixed share of the rows); its reducing blocks default to the SMs the pushing ones "
                                "leave, and the pushing blocks sum the last chunk once pushed. Measured faster than "
                                "fixed shares at every size of the combine's goal (hidden 7168, top-8, 2048-8192 "
                                "tokens, ep 2 and 4); inside the layer level with them (0.94-1.04x their time). "
                                "The tuner walks both with combine_chunks. Read with combine_chunks > 0 where "
                                "combine_chunks is read. The same bits either way.")
    fused_dispatch: bool = Field(True, description="The fused schedule's dispatch beside the first expert GEMM, "
                                 "whose tiles wait for their rows (from num_comm_sms SMs, or with roles "
                                 "'interleaved' partly from inside the GEMM's CTAs); false: the sequential "
                                 "schedule's dispatch (every SM), then that GEMM. Read by the fused schedule only.")
    epilogue_combine: bool = Field(True, description="The fused schedule's second expert GEMM stores its output rows "
                                   "straight into their sources' combine buffers (a last projection without bias), "
                                   "and in the backward the first expert GEMM's dgrad stores the input-gradient "
                                   "rows there; false: the rows stay on the expert's rank and the combine kernels "
                                   "move them. Read by the fused schedule only.")
    roles: Literal["partitioned", "interleaved"] = Field(
        "interleaved",
        description="Read by the fused schedule's dispatch (fused_dispatch). interleaved: every SM stores the "
        "rows, one destination rank after another, before the first expert GEMM, and the arriving rows are taken "
        "in (source pairs, deduplicated copies) by one spare warp of each of the GEMM's CTAs (a warp of the "
        "producer warpgroup that the GEMM leaves idle, beside its warpgroups), so the GEMM has every SM and "
        "num_comm_sms is not read there; partitioned: the dispatch runs on num_comm_sms whole SMs while that "
        "GEMM runs on the others (measured slower). The same bits either way.")
    tile_m: int = Field(128, description="GEMM tile rows (64, 128 or 256). Read by ds_uniep's GEMM (expert_gemm "
                        "'uniep') when the block sets tile_m or tile_n: every expert GEMM (forward, dgrad, wgrad) "
                        "then runs the tile_m x tile_n configuration it is built with (128x256, 256x128 or 128x128; "
                        "another pair is an error naming the layer), the same bits as its own choice.")
    tile_n: int = Field(128, description="GEMM tile columns (64, 128 or 256); see tile_m.")
    stages: int = Field(4, ge=2, le=8, description="Shared-memory pipeline stages of the GEMM.")
    signal_granularity: Literal["tile", "expert", "rank"] = Field(
        "tile", description="What one wait of the fused schedule's first expert GEMM covers (read with "
        "fused_dispatch; arrival words are raised per source rank, in the order the sources send): tile, each run "
        "of whole tiles starts once the latest source among its rows has arrived; expert, each expert's rows start "
        "once the latest source among them has; rank, every row waits for all of this rank's rows. The same "
        "tiles and bits under each; the tuner keeps the configured value rather than walking it.")
    timeout_s: float = Field(100.0, gt=0, description="Seconds a kernel waits on a peer's signal before it "
                             "raises an error naming the layer, rank and signal.")

    @field_validator("tile_m", "tile_n")
    @classmethod
    def _tile(cls, v: int) -> int:
        if v not in (64, 128, 256):
            raise ValueError(f"must be one of 64, 128, 256, got {v}")
        return v


class CompressionConfig(_Block):
    """Communication compression. Any value but the default changes numerics."""

    dispatch_dtype: Literal["activation", "fp8_e4m3"] = Field(
        "activation",
        description="activation: rows travel in the activation dtype (exact); fp8_e4m3: rows travel as FP8 "
        "e4m3 with one fp32 scale per 128 elements (deterministic, but not exact).")
    combine: Literal["slots", "rank_partials"] = Field(
        "slots",
        description="slots: every (token, slot) output row travels back to its source, which sums the token's k "
        "rows in slot order in fp32 with the gate weights and casts once. rank_partials: each expert rank first "
        "sums its rows of a token (the token's slots on that rank, gate-weighted, in slot order, fp32) and sends "
        "that sum cast to the activation dtype, one row per token and rank, as the deduplicated dispatch sends "
        "it; the source adds those rows in the order of each rank's first slot, in fp32, cast once. Fewer bytes "
        "where a token has several slots on one rank, one more rounding per rank (deterministic, not the slots "
        "bits). The backward of dispatch sums the input-gradient rows the same way (unweighted). Megakernel: "
        "where its combine kernels move the rows (the sequential schedule, the fused one without "
        "epilogue_combine), with deterministic on; reference backend: the same numbers in torch.")


class AutotuneConfig(_Block):
    """Search of the tuning space (``ds_uniep.tuning``) on the live shapes."""

    enabled: bool = Field(False, description="Each UniEPMoE tunes itself on its first forward with a new (tokens "
                          "per rank, dtype, device): a cached plan is used without timing anything; otherwise all "
                          "expert-parallel ranks time the plans the backend acts on, agree on one and cache it.")
    cache_dir: str = Field("~/.cache/ds_uniep", description="Directory of the JSON plan cache.")
    budget_s: float = Field(60.0, gt=0, description="Seconds one layer shape may spend tuning (the configured "
                            "plan and the sequential baseline are always timed; the confirmation round "
                            "counts within it).")
    allow_numerics_change: bool = Field(
        False, description="Let the tuner explore options that change numbers (FP8 dispatch).")
    warmup: int = Field(3, ge=0, description="Untimed runs per candidate plan.")
    repeats: int = Field(10, ge=1, description="Timed runs per candidate plan; the median counts.")
    confirm_top: int = Field(4, ge=0, description="After the search, the fastest this many plans and the "
                             "configured one are timed again, taking turns for confirm_rounds rounds, and the "
                             "winner is the smallest median of their rounds (a plan that timed fast once by chance "
                             "among many close ones does not win on that alone); 0: the search's fastest wins.")
    confirm_rounds: int = Field(3, ge=1, description="Rounds of the confirmation (each: warmup and repeats runs of "
                                "every finalist, in an order rotated by one each round).")


class CommFuseConfig(_Block):
    """All-gather+GEMM and GEMM+reduce-scatter as peer-to-peer steps (``ds_uniep.commfuse``)."""

    enabled: bool = Field(False, description="Read by no ds_uniep code: for callers choosing between CommFuse's "
                          "parallel linears and plain ones. ColumnParallelLinear/RowParallelLinear (config=) and "
                          "UniEPMoE's TP-sharded TPGeLUExpert experts read schedule, num_chunks and transport, "
                          "whatever enabled says.")
    schedule: Literal["ring", "bidirectional_ring", "local_first", "arrival", "relay"] = Field(
        "ring", description="ring: one neighbour per step; bidirectional_ring: blocks travel the shorter way "
        "round, half the steps; local_first: every block moves in one step while this rank's block is "
        "multiplied, then the other rows in two GEMMs (fewer, larger GEMMs; equal to the ring schedules within "
        "the GEMM's rounding); arrival (CUDA, Hopper, bf16): blocks move as in local_first and the all-gather's "
        "GEMM is one launch of ds_uniep's grouped GEMM whose tiles wait on the GPU for their block, this rank's "
        "block first (the bits of that GEMM; its reduce-scatter runs bidirectional_ring); relay (reduce-scatter): "
        "each block's running sum travels round the ring in fp32, every rank adding its product in its GEMM's "
        "epilogue, in num_chunks row chunks, so no closing sum follows the last GEMM (a fixed ring order per "
        "block: equal to the rank-order schedules within the input dtype's rounding; its all-gather runs ring; "
        "measured slower than ring, see README).")
    num_chunks: int = Field(1, ge=1, le=16, description="p2p transport: chunks each peer-to-peer step is split "
                            "into. copy_engine transport (whose copies stay whole): the reduce-scatter's own partial "
                            "GEMM in that many row chunks, each chunk's rank-order sum overlapping the next chunk's "
                            "GEMM (one GEMM per chunk, so equal to 1 chunk within the GEMM's rounding). relay "
                            "schedule, either transport: each step's GEMM in that many row chunks, each passed on "
                            "when done (with 1 every step waits for a whole block's transfer).")
    transport: Literal["auto", "p2p", "copy_engine"] = Field(
        "auto", description="p2p: NCCL/gloo send/recv; copy_engine: copies into peers' symmetric buffers (CUDA, "
        "no SMs taken from the GEMMs); auto: copy_engine where usable, else p2p. The arrival schedule moves blocks "
        "by the copy engines: not with p2p.")

    @model_validator(mode="after")
    def _arrival_needs_copy_engines(self):
        if self.schedule == "arrival" and self.transport == "p2p":
            raise ValueError("schedule 'arrival' moves blocks by the copy engines; transport 'p2p' does not apply "
                             "(use 'auto' or 'copy_engine')")
        return self


class HybridCompressionConfig(_Block):
    """Parameter-efficient expert migration: a shared base once, then sparse residuals."""

    enabled: bool = Field(False, description="Migrate experts as a shared base (the domain's mean expert, "
                          "all-reduced once) plus each expert's top-ratio residual positions, which are all the "
                          "gather moves (changes numerics; domain_size auto charges these bytes).")
    ratio: float = Field(0.1, gt=0, le=1, description="Fraction of residual values kept per expert.")


class HybridConfig(_Block):
    """Expert parallelism across slow links (``ds_uniep.hybrid``).

    A *site* is a set of ranks joined by fast links (a node, a data centre); a
    *domain* is the set of ranks that gather each other's experts, chosen by the
    planner. A domain inside one site saves nothing on the slow links."""

    enabled: bool = Field(False, description="Gather experts inside a domain; send tokens only across domains.")
    site_size: Union[int, Literal["auto"]] = Field(
        "auto", description="Ranks joined by fast links (planner input), or auto: the ranks of one node.")
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
        "auto", description="Share of each rank's experts migrated inside its domain: round(f * L) of its "
        "L (which ones: migrated_experts; the others keep taking tokens from the domain's ranks; 0 is plain "
        "EP), or auto: with domain_size auto chosen by the planner with it (in whole experts), with a fixed "
        "domain_size all of them.")
    migrated_experts: Literal["first", "hottest"] = Field(
        "hottest", description="Which of a rank's experts migrate when only some do (migrated_fraction < 1): its "
        "first ones, or the hottest: at each gather (with reuse_replicas, the first after each optimizer step) "
        "those that the other ranks of the owner's domain routed the most tokens to since the last choice (their "
        "tokens then stay on those ranks instead of crossing to the owner), ties to the smaller index; the same "
        "choice on every rank, from token counts all-gathered at each dispatch; before any token is seen, the "
        "first ones.")
    compression: HybridCompressionConfig = Field(default_factory=HybridCompressionConfig,
                                                 description="Compressed expert migration.")
    reuse_replicas: bool = Field(
        False, description="Migrate once per optimizer step: the gathered replicas serve later forwards while the "
        "experts' weights are unchanged (a forward gathers again after an optimizer step in the process, seen "
        "through torch.optim step hooks, which DeepSpeed's optimizers run, or an in-place change of an expert "
        "parameter; weights changed otherwise, through .data or a buffer the parameters view, need "
        "UniEPMoE.refresh_replicas() on any rank of the domain; the domain's ranks agree at each forward, "
        "through a small gloo all-reduce, whether to gather, so they never diverge), and under a DeepSpeed "
        "engine the replica gradients are summed over the step's micro-batches and returned at its last one "
        "(the engine's accumulation boundary; without an engine, the one UniEPMoE.set_accumulation_boundary "
        "marks, else every backward). domain_size auto then plans with M = gradient_accumulation_steps.")
    replan_after_steps: int = Field(
        0, ge=0, description="With domain_size auto: at the first forward after this many optimizer steps, plan "
        "again for the routing seen until then (every rank's tokens per expert, all-gathered once over the world "
        "and summed over its EP groups, so every rank chooses alike), with the compute times replan_compute "
        "gives and the planner's other inputs unchanged, and switch the domain size and migrated experts to "
        "that plan (partial migrations assume migrated_experts' choice); 0: plan once, at start-up, for uniform "
        "routing.")
    replan_min_gain: float = Field(
        0.05, ge=0, lt=1, description="replan_after_steps switches only where the new plan's predicted time, "
        "for the routing seen, is at least this fraction below the current plan's for the same routing (a switch "
        "builds new groups, and the plan's compute times are estimated or measured once); else the current plan "
        "stays.")
    replan_compute: Literal["measure", "estimate"] = Field(
        "measure", description="The compute times replan_after_steps plans with. measure: this rank's experts' "
        "forward timed once, at the replan, over max_tokens_per_rank * k rows split evenly among them (random "
        "rows, no autograd; after one untimed run, the median of 3 timed runs, or of as many as fill 50 ms where 3 "
        "take less), the mean over the world's ranks (so every rank plans alike), and the compute before the "
        "router scaled from its estimate by the same measured over estimated ratio; estimate: FLOPs at a fixed "
        "rate, as the start-up plan (which has run no forward) does.")

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


class UniEPConfig(_Block):
    """The ``"uniep"`` block of ds_config.json."""

    enabled: bool = Field(True, description="Use ds_uniep's path in UniEPMoE; false runs DeepSpeed's own MOELayer.")
    backend: Literal["auto", "reference", "megakernel"] = Field(
        "auto",
        description="reference: torch ops and all_to_all_single (any device); megakernel: the CUDA kernels "
        "(Hopper GPUs with NVLink peers); auto: megakernel where possible, else reference, logged once.")
    deterministic: bool = Field(
        True, description="Keep the fixed token order; results are bitwise identical run to run. false: the "
        "megakernel backend places rows and sums them in arrival order with atomics (what a non-deterministic "
        "design does; kept to measure what the fixed order costs; results vary in the last bits; not with FP8 "
        "dispatch). The reference backend is deterministic either way.")
    max_tokens_per_rank: int = Field(
        8192, ge=1, description="Largest token count one rank feeds a layer; sizes the symmetric buffers.")
    expert_gemm: Literal["torch", "uniep"] = Field(
        "torch",
        description="Grouped GEMM of recognised bf16 MLP experts (SwiGLU, GeLU): torch: torch._grouped_mm; uniep: "
        "ds_uniep's own (CUTLASS wgmma kernels, Hopper; tile configuration chosen per shape on first use, values "
        "identical for every choice). torch stays the default while uniep is not faster inside the layer at every "
        "shape measured. With autotune on the megakernel backend both are timed where uniep can run (the same "
        "bits); this one is the baseline's. HybridEP and expert tensor parallelism run on torch.")
    overlap: OverlapConfig = Field(default_factory=OverlapConfig,
                                   description="Overlap schedule and kernel knobs (the tuning space; the megakernel "
                                   "backend runs the sequential, pipelined or fused schedule and reads schedule, "
                                   "num_chunks, num_comm_sms, combine_chunks, combine_queue, fused_dispatch, "
                                   "epilogue_combine, roles and signal_granularity (the fused dispatch) and "
                                   "timeout_s; no schedule reads stages yet; tile_m and tile_n reach ds_uniep's "
                                   "GEMM only).")
    compression: CompressionConfig = Field(default_factory=CompressionConfig,
                                           description="Communication compression.")
    autotune: AutotuneConfig = Field(default_factory=AutotuneConfig, description="Automatic tuning.")
    commfuse: CommFuseConfig = Field(default_factory=CommFuseConfig, description="CommFuse for TP/SP linears.")
    hybrid: HybridConfig = Field(default_factory=HybridConfig, description="HybridEP over slow links.")

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
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p in ("int", "float", "str", "bool"))
                    and not str(p).startswith(("literal[", "function-")))
        key = ".".join([UNIEP_KEY] + [str(p) for p in loc])
        if e["type"] == "extra_forbidden":
            owner = _model_at(model_cls, loc)
            allowed = ", ".join(sorted(owner.model_fields)) if owner else "?"
            lines.append(f"{key}: unknown key; allowed keys here: {allowed}")
        else:
            lines.append(f"{key}: {e['msg']} (got {e.get('input')!r})")
    # pydantic reports every member of a Union; keep one line per key.
    seen, out = set(), []
    for line in lines:
        k = line.split(":", 1)[0]
        if k not in seen:
            seen.add(k)
            out.append(line)
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
