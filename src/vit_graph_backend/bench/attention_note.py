"""The line ``vitgraph bench`` adds to a served packed tower's mode: which kernels run its
attention in the captured graphs, read from ``served.encoder.attention_state``."""

from __future__ import annotations

from typing import Any

__all__ = ["attention_note"]


def attention_note(fn: Any) -> str | None:
    """What runs a served packed tower's full attention in its graphs (cuDNN or flash varlen,
    and why not cuDNN; in how many captured budgets the Triton segment kernel was timed faster
    and runs instead, or why never) and, for a tower with window layers, in how many captured
    budgets the short-segment kernel runs them (or why never), from
    ``served.encoder.attention_state``; ``None`` for other modes."""
    state = getattr(getattr(fn, "encoder", None), "attention_state", None)
    if not isinstance(state, dict) or "segments" not in state:
        return None
    off = f" ({state['cudnn_off']})" if state.get("cudnn_off") else ""
    note = f"full attention in the graphs: {state['segments']}{off}"
    # budgets captured: where the Triton segment kernel was timed faster
    note += _budgets_note(state.get("full"), "triton", "triton_off",
                          ", the Triton segment kernel in")
    # a tower with window layers, budgets captured
    note += _budgets_note(state.get("windows"), "short", "short_off",
                          "; window layers: short-segment kernel in")
    return note


def _budgets_note(section: dict[str, Any] | None, kernel: str, off: str, label: str) -> str:
    """``label N of M budgets (why never)``: in how many of a section's captured budgets
    ``kernel`` was chosen; ``""`` where no budget was captured."""
    chosen = (section or {}).get("by_rows") or {}
    if not chosen:
        return ""
    count = sum(1 for name in chosen.values() if name == kernel)
    why = f" ({section[off]})" if section.get(off) else ""
    return f"{label} {count} of {len(chosen)} budgets{why}"
