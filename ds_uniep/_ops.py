"""The compiled UniEP ops, loaded on first use.

``ops_package()`` is ``ds_uniep.ops`` (the builder and the loader of the CUDA
extension); from a source checkout, where ``ops/`` lies beside ``ds_uniep/`` and
is not installed as ``ds_uniep.ops``, it is loaded from there under that name.
``ext()`` is the built extension (``load_uniep_ops``: built once per process, by
local rank 0 first). This module imports nothing of ds_uniep, so every module that
launches a kernel (the dispatcher, the grouped GEMM, the backend check) can
import it without importing each other.
"""

import importlib.util
import os
import sys


def ops_package():
    """``ds_uniep.ops``; from a source checkout (``ops/`` beside ``ds_uniep/``) when not installed."""
    try:
        import ds_uniep.ops as ops
        return ops
    except ImportError:
        root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ops")
        spec = importlib.util.spec_from_file_location("ds_uniep.ops", os.path.join(root, "__init__.py"),
                                                      submodule_search_locations=[root])
        module = importlib.util.module_from_spec(spec)
        sys.modules["ds_uniep.ops"] = module
        spec.loader.exec_module(module)
        return module


def ext():
    """The compiled extension (``ds_uniep.ops.load_uniep_ops()``)."""
    return ops_package().load_uniep_ops()
