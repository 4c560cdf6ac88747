"""argparse value types shared by ds_uniep's command lines (``ds_uniep.tune``, ``ds_uniep.hybrid``)."""

import argparse


def positive_float(text: str) -> float:
    v = float(text)
    if not v > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return v


def positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return v
