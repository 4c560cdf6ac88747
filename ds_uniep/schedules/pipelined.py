"""The megakernel's pipelined schedule: the local experts in chunks, each chunk's rows copied back
to their sources while the next chunk computes (``ds_uniep.pipelined``); the same bits as the
sequential schedule."""

from typing import Dict, Optional

from torch import Tensor

from ..experts import run_grouped, stack_experts
from ..pipelined import run_pipelined
from . import common
from .common import Step


class Pipelined:
    """``num_chunks`` chunks of experts. ``copy_blocks``: copy by SM stores from this many blocks
    (ds_uniep's GEMM leaving them free: ``gemm_sm_count`` SMs for the GEMMs), else 0, the copy
    engines, the GEMMs on every SM. ``gemm``: ``"torch"`` or ``"uniep"``, with ``configs``."""

    name = "pipelined"

    def __init__(self, num_chunks: int, gemm: str, copy_blocks: int, gemm_sm_count: int,
                 configs: Optional[Dict[str, str]]) -> None:
        self.num_chunks, self.gemm, self.configs = num_chunks, gemm, configs
        self.copy_blocks, self.gemm_sm_count = copy_blocks, gemm_sm_count

    def run(self, layer, step: Step) -> Tensor:
        expert_idx, gates, _ = common.route(layer, step)
        experts, x = layer.deepspeed_moe.experts.deepspeed_experts, step.x

        def run_chunk(rows, counts, offs, a, b):
            part = experts[a:b]
            return run_grouped(part, rows, counts, self.gemm, offs=offs, sm_count=self.gemm_sm_count,
                               configs=self.configs, stacked=stack_experts(part, x.dtype, x.device,
                                                                           cache=layer._stack_cache))
        return run_pipelined(step.dispatcher, x, expert_idx, gates, self.num_chunks, run_chunk, self.copy_blocks)
