"""Does PyTorch's ``backed_size_oblivious`` break Inductor inner graphs at a batch of 1 on CUDA?

Each case sets the flag before any compile and runs in its own process (an illegal memory access
poisons the CUDA context); it prints one line: the sizes, the flag, the inner compiler, and
``ok <max error>`` or the error.
Usage (CUDA machine, repo root): python scripts/oblivious_inductor_check.py
"""

from __future__ import annotations

import subprocess
import sys

CASE = """
import sys, torch, timm
from torch.fx.experimental import _config as fx_config
fx_config.backed_size_oblivious = sys.argv[1] == "on"
torch.manual_seed(0)
model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, depth=2,
                          num_classes=10).cuda().eval()
compiled = torch.compile(model, backend="vitgraph",
                         options={"inner_compiler": sys.argv[2]})
worst = 0.0
with torch.no_grad():
    for b in [int(v) for v in sys.argv[3].split(",")]:
        x = torch.randn(b, 3, 64, 64, device="cuda")
        worst = max(worst, (compiled(x) - model(x)).abs().max().item())
    torch.cuda.synchronize()
print("ok", worst)
"""


def main() -> None:
    cases = [(sizes, flag, inner) for sizes in ("3,5,1,7,2", "3,5,1,7,40,2,16,33")
             for flag in ("off", "on") for inner in ("eager", "inductor")]
    for sizes, flag, inner in cases:
        run = subprocess.run([sys.executable, "-c", CASE, flag, inner, sizes],
                             capture_output=True, text=True, timeout=300)
        lines = (run.stdout + run.stderr).strip().splitlines()
        last = next((ln for ln in reversed(lines) if ln.startswith("ok") or "Error" in ln),
                    lines[-1] if lines else "no output")
        print(f"sizes {sizes:20} backed_size_oblivious={flag:3} inner={inner:8} "
              f"rc={run.returncode}: {last[:200]}")


if __name__ == "__main__":
    main()
