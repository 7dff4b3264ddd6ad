"""The line ``vitgraph bench`` adds to a served packed tower's mode: which kernels run its
attention in the captured graphs, read from ``served.encoder.attention_state``."""

from __future__ import annotations

from typing import Any

__all__ = ["attention_note"]


def attention_note(fn: Any) -> str | None:
    """The attention kernels in the graphs of ``fn``, a mode's callable (a ``PackedGraphEncoder``
    for packed vitgraph modes): full attention (cuDNN or flash varlen, and in how many budgets the
    Triton segment kernel), window layers (in how many budgets the short-segment kernel), with why
    not; ``None`` for other modes."""
    state = getattr(getattr(fn, "encoder", None), "attention_state", None)
    if not isinstance(state, dict) or "segments" not in state:
        return None
    off = f" ({state['cudnn_off']})" if state.get("cudnn_off") else ""
    note = f"full attention in the graphs: {state['segments']}{off}"
    note += _budgets_note(state.get("full"), "triton", "triton_off",
                          ", the Triton segment kernel in")
    note += _budgets_note(state.get("windows"), "short", "short_off",
                          "; window layers: short-segment kernel in")
    return note


def _budgets_note(section: dict[str, Any] | None, kernel: str, off: str, label: str) -> str:
    """``label N of M budgets (why never)``; ``""`` where no budget was captured."""
    chosen = (section or {}).get("by_rows") or {}
    if not chosen:
        return ""
    count = sum(1 for name in chosen.values() if name == kernel)
    why = f" ({section[off]})" if section.get(off) else ""
    return f"{label} {count} of {len(chosen)} budgets{why}"
