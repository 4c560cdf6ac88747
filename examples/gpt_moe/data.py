"""Real text that every machine has: the installed Python standard library's sources.

Byte-level tokens (vocabulary 256). The ``.py`` files directly under the
standard library directory are read in sorted name order and joined with a
``\\n`` between files; the last ``eval_fraction`` of the bytes is held out.

Batches are a pure function of ``(seed, step, rank)``: the start offsets of
the global batch for a step come from a generator seeded with ``(seed, step)``
and each rank takes its slice. A run resumed at step N therefore sees exactly
the batches the uninterrupted run saw, and the global batch does not depend
on how it is split over ranks.
"""
import glob
import os
from typing import Optional, Tuple

import torch

VOCAB_SIZE = 256


def stdlib_dir() -> str:
    return os.path.dirname(os.__file__)


def load_corpus(max_bytes: Optional[int] = None) -> Tuple[torch.Tensor, dict]:
    """``[N]`` uint8 tokens of the stdlib sources, and a description for the log."""
    root = stdlib_dir()
    files = sorted(glob.glob(os.path.join(root, "*.py")))
    if not files:
        raise FileNotFoundError(f"no .py files under {root}: cannot build the text corpus")
    chunks, total = [], 0
    for path in files:
        with open(path, "rb") as f:
            data = f.read() + b"\n"
        chunks.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    blob = b"".join(chunks)[:max_bytes]
    tokens = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    info = {"root": root, "num_files": len(chunks), "num_bytes": len(blob)}
    return tokens, info


class TextSplits:
    """Train and held-out split of one token stream; sequences of ``seq_length + 1`` tokens."""

    def __init__(self, tokens: torch.Tensor, seq_length: int, eval_fraction: float = 0.05):
        num_eval = max(int(len(tokens) * eval_fraction), 4 * (seq_length + 1))
        if len(tokens) - num_eval < 4 * (seq_length + 1):
            raise ValueError(f"corpus of {len(tokens)} bytes is too small for seq_length={seq_length}")
        self.train = tokens[:-num_eval]
        self.valid = tokens[-num_eval:]
        self.seq_length = seq_length

    def _windows(self, split: torch.Tensor, starts: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + torch.arange(self.seq_length + 1)[None, :]
        seq = split[idx].long()
        return seq[:, :-1], seq[:, 1:]

    def train_batch(self, seed: int, step: int, rank: int, world_size: int, micro_batch: int,
                    micro_step: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(tokens [B, S], labels [B, S])`` int64 for ``rank`` at ``(step, micro_step)``."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + micro_step)
        starts = torch.randint(0, len(self.train) - self.seq_length - 1, (world_size * micro_batch,), generator=g)
        return self._windows(self.train, starts[rank * micro_batch:(rank + 1) * micro_batch])

    def eval_batch(self, idx: int, rank: int, world_size: int,
                   micro_batch: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Fixed held-out batches: evenly spaced windows, the same at every evaluation."""
        num = world_size * micro_batch
        span = len(self.valid) - self.seq_length - 1
        starts = (torch.arange(num) + idx * num) * 9_973 % span
        return self._windows(self.valid, starts[rank * micro_batch:(rank + 1) * micro_batch])
