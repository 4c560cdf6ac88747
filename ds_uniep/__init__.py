"""ds_uniep: a deterministic, overlapped expert-parallel MoE layer for DeepSpeed.

Public API: :class:`UniEPMoE`, :func:`convert_moe_layers`, :class:`UniEPConfig`.
"""
from .version import __version__
from .config import UniEPConfig, UniEPConfigError
from .backend import UniEPBackendError
from .experts import GeLUExpert, SwiGLUExpert
from .layer import UniEPMoE
from .convert import convert_moe_layers

__all__ = ["UniEPMoE", "SwiGLUExpert", "GeLUExpert", "convert_moe_layers", "UniEPConfig", "UniEPConfigError", "UniEPBackendError", "__version__"]
