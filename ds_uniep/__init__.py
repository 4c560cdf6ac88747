"""ds_uniep: a deterministic, overlapped expert-parallel MoE layer for DeepSpeed.

Public API: :class:`UniEPMoE`, :func:`convert_moe_layers`, :class:`UniEPConfig`; for Hugging Face MoE
models :func:`convert_hf_model`, :func:`save_hf_pretrained`, :func:`update_expert_biases`.
"""
from .version import __version__
from .config import UniEPConfig, UniEPConfigError
from .backend import UniEPBackendError
from .errors import UniEPCommError, UniEPTimeoutError
from .experts import GeLUExpert, SwiGLUExpert
from .layer import UniEPMoE
from .convert import convert_moe_layers
from .routers import Router, RouterOptions, update_expert_biases
from .hf import convert_hf_model, hf_state_dict, save_hf_pretrained
from .cuda_graphs import graph_moe

__all__ = ["UniEPMoE", "SwiGLUExpert", "GeLUExpert", "convert_moe_layers", "UniEPConfig", "UniEPConfigError",
           "UniEPBackendError", "UniEPCommError", "UniEPTimeoutError", "Router", "RouterOptions",
           "update_expert_biases", "convert_hf_model", "hf_state_dict", "save_hf_pretrained", "graph_moe",
           "__version__"]
