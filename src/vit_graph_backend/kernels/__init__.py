"""The package's own kernels and their choice per shape: fused linear + activation
(``fused_linear``), packed attention (``packed_attention``, ``segment_attention``,
``short_attention``, ``cudnn_attention``) and its per-budget choice (``attention_choice``), and the
packed towers' fused elementwise ops (``fused_ops``). Triton and cuDNN's frontend are imported only
where a kernel of theirs runs.
"""

__all__: list[str] = []
