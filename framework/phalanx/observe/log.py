"""Rank-0 logging: the main process prints INFO lines, other ranks only WARNING and above.

Lines go through `tqdm.write` when a progress bar is active (so they do not tear the bar) and
to stderr otherwise. The logger is named "phalanx" and configured once per process; it never
touches the root logger, so an application's own logging setup is left alone.
"""
from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist

_CONFIGURED: set[str] = set()


def is_main_process() -> bool:
    """Rank 0 of the process group (or of torchrun's environment before the group exists)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") in ("", "0")


class _TqdmAwareHandler(logging.StreamHandler):
    """Writes to the *current* sys.stderr (so redirection and capture made after set-up work),
    through tqdm when tqdm is loaded, so a running bar is redrawn below the line."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; the property wins
        pass

    def emit(self, record: logging.LogRecord) -> None:
        tqdm = sys.modules.get("tqdm")
        if tqdm is None:
            return super().emit(record)
        try:
            tqdm.tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:  # noqa: BLE001 - logging must never crash training
            self.handleError(record)


def get_logger(name: str = "phalanx") -> logging.Logger:
    """The phalanx logger (or a child of it), quiet on every rank but 0."""
    root_name = name.split(".")[0]
    logger = logging.getLogger(root_name)
    if root_name not in _CONFIGURED:
        handler = _TqdmAwareHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
        _CONFIGURED.add(root_name)
    # Re-evaluated on every call: the process group may have started since the first call.
    logger.setLevel(logging.INFO if is_main_process() else logging.WARNING)
    return logging.getLogger(name)
