"""Every ``UNIEP_*`` environment variable is read here, and only here.

- ``UNIEP_LOG_LEVEL``: level of the ``ds_uniep`` logger (default ``INFO``).
"""
import logging
import os

LOG_LEVEL = os.environ.get("UNIEP_LOG_LEVEL", "INFO").upper()


def _make_logger() -> logging.Logger:
    log = logging.getLogger("ds_uniep")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[ds_uniep] %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(getattr(logging, LOG_LEVEL, logging.INFO))
        log.propagate = False
    return log


logger = _make_logger()
