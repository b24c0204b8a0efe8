"""A rank-0 progress bar over optimizer steps, showing loss, learning rate and tokens per second.

A thin layer over tqdm (imported lazily) so the loop does not care whether the bar is shown:
on other ranks, or with `enabled=False`, every method is a no-op.
"""
from __future__ import annotations


class ProgressBar:
    def __init__(self, total: int, initial: int = 0, *, enabled: bool = True, desc: str = "train"):
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm
            self._bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, unit="step",
                             mininterval=0.5, smoothing=0.1)

    def update(self, steps: int = 1, **postfix) -> None:
        if self._bar is None:
            return
        if postfix:
            self._bar.set_postfix({k: _fmt(v) for k, v in postfix.items() if v is not None}, refresh=False)
        self._bar.update(steps)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _fmt(value) -> str:
    if isinstance(value, float):
        if value == 0 or 1e-3 <= abs(value) < 1e5:
            return f"{value:.4g}"
        return f"{value:.2e}"
    return str(value)
