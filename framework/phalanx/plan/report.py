"""The planner's table, recommendation and refusals as text."""
from __future__ import annotations

from phalanx.plan.planner import LayoutEstimate
from phalanx.plan.units import gib, seconds


def _why_fastest(best: LayoutEstimate, fitting: list[LayoutEstimate]) -> str:
    t = best.time
    parts = [f"{t.tokens_per_s:,.0f} tokens/s estimated", f"{gib(best.memory.device_total)} per rank"]
    if len(fitting) > 1:
        nxt = fitting[1]
        parts.append(f"{t.tokens_per_s / nxt.time.tokens_per_s:.2f}× the tokens/s of the next, {nxt.name}")
    return "; ".join(parts)


def format_plan(estimates: list[LayoutEstimate], header: str, show: int | None = 15, fix: str | None = None) -> str:
    fitting = [e for e in estimates if e.fits]
    rejected = [e for e in estimates if not e.fits]
    lines = [header, ""]
    cols = f"{'#':>3}  {'layout':<42} {'device/rank':>12} {'host/rank':>10} {'step':>9} {'tokens/s':>12}  {'bubble':>6}  peak in"
    lines.append(cols)
    for i, e in enumerate(fitting[:show] if show else fitting, 1):
        m, t = e.memory, e.time
        bubble = t.bubble / t.total if t.total else 0.0
        lines.append(f"{i:>3}  {e.name:<42} {gib(m.device_total):>12} {gib(m.host_total) if m.host_total else '-':>10} "
                     f"{seconds(t.total):>9} {t.tokens_per_s:>12,.0f}  {bubble:>6.1%}  {m.phase}")
    if show and len(fitting) > show:
        lines.append(f"     … {len(fitting) - show} more that fit (--show 0 lists all)")
    lines.append("")
    if fitting:
        best = fitting[0]
        lines.append(f"Recommended: {best.name}  ({_why_fastest(best, fitting)})")
        lines.append(f"  make_plugin options: {best.layout.plugin_options()}"
                     + (f", {'pipeline microbatches' if best.layout.pp > 1 else 'accumulation steps'} per optimizer "
                        f"step: {best.microbatches}" if best.microbatches > 1 else ""))
        parts = ", ".join(f"{k} {gib(v)}" for k, v in best.memory.device.items() if v)
        lines.append(f"  per rank: {parts}")
        if best.time.ep_comm:
            lines.append(f"  expert all-to-all: {seconds(best.time.ep_comm)} of the {seconds(best.time.total)} step "
                         f"({best.time.ep_comm / best.time.total:.1%})")
    else:
        lines.append("No layout fits. The closest ones and what they need are below.")
        if fix:
            lines.append(fix)
    if rejected:
        lines.append("")
        lines.append(f"Rejected ({len(rejected)}):")
        for e in rejected[:show] if show else rejected:
            lines.append(f"  {e.name:<42} {e.reason}")
        if show and len(rejected) > show:
            lines.append(f"  … {len(rejected) - show} more (--show 0 lists all)")
    return "\n".join(lines)
