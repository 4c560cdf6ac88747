"""Every ``UNIEP_*`` environment variable is read here, and only here.

- ``UNIEP_LOG_LEVEL``: level of the ``ds_uniep`` logger (default ``INFO``).
- ``UNIEP_TEST_STOP_AT``: for fault-injection tests only, unset in production: ``<step>:<rank>``
  (step ``dispatch``, ``combine`` or ``backward``) makes that global rank stop at that step of its
  first layer call that reaches it, as a hung peer would (:func:`ds_uniep.faults.stop_point`).
"""
import logging
import os
from typing import Optional, Tuple

LOG_LEVEL = os.environ.get("UNIEP_LOG_LEVEL", "INFO").upper()

STOP_STEPS = ("dispatch", "combine", "backward")


def _stop_at(value: str) -> Optional[Tuple[str, int]]:
    if not value:
        return None
    step, _, rank = value.partition(":")
    if step not in STOP_STEPS or not rank.isdigit():
        raise ValueError(f"UNIEP_TEST_STOP_AT={value!r}: expected '<step>:<rank>' with step one of "
                         f"{', '.join(STOP_STEPS)} (e.g. 'combine:1'), or unset")
    return step, int(rank)


#: ``(step, global rank)`` from ``UNIEP_TEST_STOP_AT``, or None (always, outside fault-injection tests)
TEST_STOP_AT = _stop_at(os.environ.get("UNIEP_TEST_STOP_AT", ""))


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
