"""Host time of the code check before every packed call (``code_watch.py``), on the CPU.

The Qwen2.5-VL-3B-shaped tower's module classes and config (random weights, bf16, CPU): the
whole check when nothing changed (``CodeWatch.replaced``), and the two ways to read the name of
the config's attention implementation, through the attribute (the config's
``__getattribute__``) and from its instance dict, as the check reads it.

Usage: python benchmarks/code_watch_probe.py. Text to stdout and to $OUT/code_watch_probe.txt
when $OUT is set.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _bench_out import emit  # noqa: E402
from _per_call import timed_rows  # noqa: E402


def main() -> None:
    import transformers
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import (
        Qwen2_5_VLVisionConfig,
    )
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    from vit_graph_backend.code_watch import _ATTENTION_KEY
    from vit_graph_backend.weight_watch import WeightWatch

    cfg = Qwen2_5_VLVisionConfig(depth=32, hidden_size=1280, num_heads=16, intermediate_size=3420,
                                 out_hidden_size=2048, patch_size=14, spatial_merge_size=2,
                                 window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                                 temporal_patch_size=2, in_channels=3)
    tower = Qwen2_5_VisionTransformerPretrainedModel(cfg).to(torch.bfloat16).eval()
    code = WeightWatch(tower, code=True)._code
    config = tower.config
    own = vars(config)
    checks = {
        f"CodeWatch.replaced(), {len(code._state())} lookups": code.replaced,
        "config._attn_implementation": lambda: config._attn_implementation,
        f"the config's dict[{_ATTENTION_KEY!r}]": lambda: own.get(_ATTENTION_KEY),
    }
    lines = [f"torch {torch.__version__}, transformers {transformers.__version__}, "
             f"{platform.machine()} CPU; us per call, 3 runs of 20000"]
    lines += timed_rows(checks, 20000, 52, 3)
    emit(lines, "code_watch_probe")


if __name__ == "__main__":
    main()
