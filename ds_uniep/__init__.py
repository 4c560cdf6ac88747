"""ds_uniep: a deterministic, overlapped expert-parallel MoE layer for DeepSpeed."""
from .version import __version__
from .config import UniEPConfig, UniEPConfigError
