"""`check_adapter`: does a packed tower's adapter keep the rules the graph runtime relies on?

A researcher who serves a tower of their own (``docs/adapters.md``) runs this in their suite. Over
Hypothesis-drawn calls of images and videos it checks, naming the broken rule when one fails:

- ``specs``: one :class:`~vit_graph_backend.specs.EncoderItemSpec` per item, its ``frames`` the
  item's ``t`` and its ``output_tokens`` the rows the item's output has;
- ``eager``: ``encoder_eager_forward`` over all items equals the tower's own forward;
- ``alone``: each item encoded alone equals its rows of the packed call (no item sees another);
- ``padding``: at the smallest budget with room to spare, the captured computation over static
  buffers gives the tower's output, and filling the rows past the real ones (in every floating
  buffer the replay buffers fill only in part) with large values changes no real row;
- ``served``: calls through the graph runtime (CUDA graphs on a GPU, captured and replayed, with
  every static buffer and the graph pool's free memory poisoned with NaN between calls; on CPU the
  same padded computation without graphs) equal the tower's own forward, and on a GPU come from
  graphs.

The reference is the tower's own forward: ``reference(inputs)``, or the adapter's
``encoder_reference_forward(inputs)`` (the built-in adapters have one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..adapters.serve import concat_items
from ..options import VitGraphOptions
from ..runtime.manager import EncoderCudaGraphManager
from ..errors import UnsupportedGraphError
from ..runtime.replay_io import (copy_padded, map_output, max_rel_error, output_rows,
                                 output_tensors, verify_tolerance)
from .poison import PoolPoisoner, poison_static_buffers
from .strategies import image_grids

__all__ = ["AdapterCheckError", "check_adapter"]

Grid = tuple[int, int, int]


class AdapterCheckError(AssertionError):
    """An adapter broke a rule of :func:`check_adapter`; ``rule`` names it."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(f"rule {rule!r} broken: {message}")
        self.rule = rule


def check_adapter(
    tower: torch.nn.Module,
    adapter: Any = None,
    *,
    options: VitGraphOptions | None = None,
    reference: Callable[[Mapping[str, torch.Tensor]], Any] | None = None,
    make_inputs: Callable[[list[Grid], torch.Generator], Mapping[str, torch.Tensor]] | None = None,
    patch: int | None = None,
    merge: int | None = None,
    max_side: int | None = None,
    max_frames: int = 3,
    max_items: int = 3,
    hypothesis_settings: settings | None = None,
    tolerance: float | None = None,
) -> None:
    """Check ``adapter`` (default: ``adapt(tower, options)``) against ``tower`` over drawn calls.

    Args:
        tower: the packed vision tower; its weights and device are the ones served.
        adapter: a ``SupportsEncoderCudaGraph`` wrapping ``tower``; ``None`` to adapt it.
        options: the options the tower is served with (budgets are set to fit the drawn calls
            unless given).
        reference: the tower's own output for an input mapping, in the adapter's layout; ``None``
            for the adapter's ``encoder_reference_forward``.
        make_inputs: an input mapping from ``(t, h, w)`` grids; ``None`` for
            ``{"pixel_values": (rows, adapter.patch_dim) normal noise, "grid_thw": grids}``.
        patch, merge: patch side in pixels and spatial merge; ``None`` for the adapter's
            ``patch_size`` and ``merge``.
        max_side: the largest image side in pixels (``None``: 8 merged patches).
        max_frames: the most temporal patches of a video item (1: images only).
        max_items: the most items in a call.
        hypothesis_settings: how Hypothesis draws calls; ``None`` for 10 examples, no deadline.
        tolerance: the largest error relative to the reference's magnitude; ``None`` by dtype.

    Raises:
        AdapterCheckError: (an ``AssertionError``) naming the broken rule, for the smallest call
            Hypothesis finds.
        TypeError: where neither ``reference`` nor the adapter's reference forward is given, or
            ``patch``/``merge``/``make_inputs`` cannot be derived from the adapter.
    """
    from ..adapters import adapt

    # the padding rule prepares capture inputs of its own: on a second adapter where this
    # builds them, so the served one keeps the kernel choices its graphs were captured with
    padding_adapter = adapt(tower, options) if adapter is None else adapter
    adapter = adapter if adapter is not None else adapt(tower, options)
    options = options or VitGraphOptions()
    reference = reference or getattr(adapter, "encoder_reference_forward", None)
    if reference is None:
        raise TypeError("check_adapter needs reference=... (the tower's own output for an input "
                        "mapping) or an adapter with encoder_reference_forward(inputs)")
    patch = patch or getattr(adapter, "patch_size", None)
    merge = merge or getattr(adapter, "merge", None)
    if not patch or not merge:
        raise TypeError("check_adapter needs patch= and merge= (the adapter has no patch_size "
                        "and merge attributes)")
    param = next(tower.parameters())
    device, dtype = param.device, param.dtype
    make_inputs = make_inputs or _pixel_inputs(adapter, device, dtype)
    tol = tolerance if tolerance is not None else verify_tolerance(options, dtype)
    side = max_side or 8 * patch * merge
    most_tokens = max_items * max_frames * (side // patch // merge) ** 2
    if options.budgets is None and options.max_budget is None:
        # a short ladder over the drawn sizes, with room to spare for the padding rule
        options = dataclasses.replace(
            options, min_budget=max(1, most_tokens // 8), max_budget=2 * most_tokens,
            max_items_per_graph=options.max_items_per_graph or max_items,
            max_frames_per_batch=options.max_frames_per_batch or max_items * max_frames)
    manager = EncoderCudaGraphManager(adapter, options, device=device, dtype=dtype,
                                      watch=getattr(adapter, "tower", tower),
                                      pad_without_graphs=True)
    calls = st.lists(image_grids(patch, merge, max_side=side, max_frames=max_frames),
                     min_size=1, max_size=max_items)

    @(hypothesis_settings or settings(max_examples=10, deadline=None, database=None,
                                      suppress_health_check=list(HealthCheck)))
    @given(grids=calls, seed=st.integers(0, 2 ** 31 - 1))
    def run(grids: list[Grid], seed: int) -> None:
        generator = torch.Generator(device=device).manual_seed(seed)
        inputs = make_inputs(list(grids), generator)
        with torch.inference_mode():
            _check_call(adapter, padding_adapter, manager, reference, inputs, list(grids), tol)

    run()


def _pixel_inputs(adapter: Any, device: torch.device, dtype: torch.dtype
                  ) -> Callable[[list[Grid], torch.Generator], dict[str, torch.Tensor]]:
    dim = getattr(adapter, "patch_dim", None)
    if dim is None:
        raise TypeError("check_adapter needs make_inputs=... (the adapter has no patch_dim)")

    def make(grids: list[Grid], generator: torch.Generator) -> dict[str, torch.Tensor]:
        rows = sum(t * h * w for t, h, w in grids)
        pixels = torch.randn(rows, dim, generator=generator, device=device)
        return {"pixel_values": pixels.to(dtype),
                "grid_thw": torch.tensor(grids, dtype=torch.int64, device=device)}

    return make


def _check_call(adapter: Any, padding_adapter: Any, manager: EncoderCudaGraphManager,
                reference: Callable, inputs: Any, grids: list[Grid], tol: float) -> None:
    where = f"call of grids {grids}"
    expected = reference(inputs)
    packed = adapter.encoder_eager_forward(inputs, list(range(len(grids))))
    _close("eager", packed, expected, tol, f"encoder_eager_forward, {where}")

    specs = list(adapter.get_encoder_cudagraph_item_specs(inputs))
    if len(specs) != len(grids):
        raise AdapterCheckError("specs", f"{len(specs)} specs for {len(grids)} items, {where}")
    start = 0
    for i, (spec, grid) in enumerate(zip(specs, grids)):
        alone = adapter.encoder_eager_forward(inputs, [i])
        rows = output_rows(alone)
        if spec.frames != grid[0] or spec.output_tokens != rows:
            raise AdapterCheckError("specs", f"item {i} ({grid}): spec {spec}, but the item has "
                                    f"{grid[0]} frames and {rows} output rows, {where}")
        _close("alone", alone, _slice(packed, start, start + rows), tol,
               f"item {i} ({grid}) alone against its rows of the packed call, {where}")
        start += rows

    _check_padding(padding_adapter, manager, inputs, specs, expected, tol, where)

    # the same call twice: the second replays graphs that hold the first call's leftovers
    for attempt in range(2):
        if manager.device.type == "cuda":
            poison_static_buffers(manager)
            PoolPoisoner(manager)()
        replays = manager.stats.graph_replays
        served = concat_items(manager.run(inputs))
        _close("served", served, expected, tol, f"call {attempt + 1} through the runtime, {where}")
        if manager.device.type == "cuda" and not manager.uses_cuda_graphs:
            reason = manager.memory_report()["graphs_off_reason"]
            raise AdapterCheckError("served", f"CUDA graphs are off for this tower: {reason}")
        if manager.uses_cuda_graphs and manager.stats.graph_replays == replays:
            reasons = (dict(manager.stats.fallback_reasons)
                       or manager.memory_report()["graphs_off_reason"])
            raise AdapterCheckError("served", f"no graph served the call ({reasons}), {where}")


def _check_padding(adapter: Any, manager: EncoderCudaGraphManager, inputs: Any,
                   specs: Sequence[Any], expected: Any, tol: float, where: str) -> None:
    """Run the captured computation over static buffers with padding rows of zeros, then of
    large values: the real rows must not move."""
    tokens = sum(s.output_tokens for s in specs)
    config = manager.config
    # the smallest budget with padding rows, as the runtime would capture it
    budget = min((b for b in config.budgets if b > tokens), default=None)
    frames = sum(s.frames for s in specs)
    if (budget is None or len(specs) > config.max_batch_size
            or frames > (config.max_frames_per_batch or config.max_batch_size)):
        return  # the call does not fit one graph with room to spare (given budgets)
    static = adapter.prepare_encoder_cudagraph_capture_inputs(
        budget, config.max_batch_size, config.max_frames_per_batch, manager.device,
        manager.dtype)
    try:
        values = adapter.prepare_encoder_cudagraph_replay_buffers(inputs, range(len(specs)),
                                                                  budget)
    except UnsupportedGraphError:
        return  # the runtime serves such a batch eagerly (e.g. more windows than slots)
    merged = values.merged() if hasattr(values, "merged") else dict(values)
    for key, value in merged.items():
        copy_padded(static, key, value.to(static[key].device))
    zero = adapter.encoder_cudagraph_forward(static)
    _close("padding", _slice(zero, 0, tokens), expected, tol,
           f"the captured computation at budget {budget} (zero padding), {where}")
    for key, value in merged.items():
        target = static[key]
        if target.is_floating_point() and value.shape[0] < target.shape[0]:
            target[value.shape[0]:] = 1e4
    big = adapter.encoder_cudagraph_forward(static)
    _close("padding", _slice(big, 0, tokens), _slice(zero, 0, tokens), tol,
           f"padding rows set to 1e4 changed the real rows at budget {budget}, {where}")


def _close(rule: str, actual: Any, expected: Any, tol: float, what: str) -> None:
    got, want = output_tensors(actual), output_tensors(expected)
    if len(got) != len(want) or any(g.shape != w.shape for g, w in zip(got, want)):
        raise AdapterCheckError(rule, f"{what}: shapes {[tuple(g.shape) for g in got]} against "
                                f"{[tuple(w.shape) for w in want]}")
    err = max_rel_error(got, want)
    if not err <= tol:
        raise AdapterCheckError(rule, f"{what}: relative error {err:.3g} > tolerance {tol:.3g}")


def _slice(out: Any, lo: int, hi: int) -> Any:
    return map_output(out, lambda t: t[lo:hi])
