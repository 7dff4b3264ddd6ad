"""The package's own kernels and their choice per shape: a linear layer with its activation in
the GEMM's epilogue (``fused_linear``), packed attention over segments (``packed_attention``,
through cuDNN, flash varlen or the Triton kernels of ``segment_attention`` and
``short_attention``) and which of them each budget's graph runs (``attention_choice``), and the
Inductor-fused elementwise ops of the packed towers' blocks (``fused_ops``). Triton and cuDNN's
frontend are imported only where a kernel of theirs runs.
"""

__all__: list[str] = []
