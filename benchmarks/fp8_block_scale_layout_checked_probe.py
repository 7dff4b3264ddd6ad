"""The block-scaled e4m3 GEMM through ``torch._scaled_mm`` and through the public
``torch.nn.functional.scaled_mm`` (which checks the scales' layouts), scale layouts tried in turn.

All-ones operands at two shapes: K of 4 blocks of 128 and N of 4 (512 x 512), then K of 2 and N
of 3 (256 x 384). A correct GEMM gives K everywhere with every scale 1; one activation scale
[5, 1] set to 2 changes row 5 only, one weight scale [n-block 1, k-block 0] set to 2 changes
column block 1 only. Refusals print their first line: they say which layout PyTorch expects.

    python benchmarks/fp8_block_scale_layout_checked_probe.py
"""

import inspect

import torch
import torch.nn.functional as F

E4 = torch.float8_e4m3fn


def changed(out: torch.Tensor, base: torch.Tensor) -> str:
    rows, cols = (out != base).nonzero(as_tuple=True)
    if not len(rows):
        return "nothing"
    return (f"{len(rows)}: rows {sorted(set(rows.tolist()))[:4]}.. ({len(set(rows.tolist()))} "
            f"rows), col blocks {sorted(set((cols // 128).tolist()))}, values "
            f"{sorted(set(out[rows, cols].tolist()))[:3]}")


def calls(a: torch.Tensor, w: torch.Tensor) -> dict:
    st = F.ScalingType
    found = {"_scaled_mm sa(1,M) sw.t()": lambda sa, sw: torch._scaled_mm(
        a, w.t(), scale_a=sa.t().contiguous().t(), scale_b=sw.t(), out_dtype=torch.bfloat16)}
    for la, lw in (("sa(1,M)", "sw.t()"), ("sa contig", "sw contig"), ("sa(1,M)", "sw contig"),
                   ("sa contig", "sw.t()")):
        def call(sa, sw, la=la, lw=lw):
            sa = sa.t().contiguous().t() if la == "sa(1,M)" else sa.contiguous()
            sw = sw.t() if lw == "sw.t()" else sw.contiguous()
            return F.scaled_mm(a, w.t(), sa, st.BlockWise1x128, sw, st.BlockWise128x128,
                               output_dtype=torch.bfloat16)
        found[f"F.scaled_mm {la} {lw}"] = call
    return found


def main() -> None:
    print("F.scaled_mm", inspect.signature(F.scaled_mm))
    print("ScalingType", list(F.ScalingType.__members__))
    for m, k, n in [(256, 512, 512), (256, 256, 384)]:
        a = torch.ones(m, k, device="cuda").to(E4)
        w = torch.ones(n, k, device="cuda").to(E4)
        for name, call in calls(a, w).items():
            ones_a = torch.ones(m, k // 128, device="cuda")
            ones_w = torch.ones(n // 128, k // 128, device="cuda")
            try:
                base = call(ones_a, ones_w).float()
                right = (base == k).all()
                msg = [f"all ones: {'correct' if right else 'WRONG ' + changed(base, k)}"]
                sa = ones_a.clone()
                sa[5, 1] = 2
                msg.append(f"sa[5,1]=2: {changed(call(sa, ones_w).float(), base)}")
                sw = ones_w.clone()
                sw[1, 0] = 2
                msg.append(f"sw[nb=1,kb=0]=2: {changed(call(ones_a, sw).float(), base)}")
                print(f"M{m} K{k} N{n} {name}: " + " | ".join(msg))
            except Exception as exc:  # noqa: BLE001 - a refusal is the finding
                print(f"M{m} K{k} N{n} {name}: refused: {str(exc).splitlines()[0][:150]}")


if __name__ == "__main__":
    main()
