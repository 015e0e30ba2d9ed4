"""scaledmm benchmark CLI: ``python -m benchmarks <family>`` from the repo root.

One module per family (the op name is the file name: ``fp8_block.py``,
``fp8_block_linear.py``, ``fp8.py``, ``fp8_linear.py``, ``nvfp4.py``, ``nvfp4_linear.py``,
``skinny.py``, ``quant.py``; ``fp8_tensorwise.py`` is ``fp8_scaled_mm`` with
per-tensor scales, a variant with rows of its own) holds its providers,
input builders and float64 reference; the method lives in ``timing.py``
(timing, L2 rotation, CUDA graphs) and ``machine.py`` (ceilings, versions),
the problem sizes in ``shapes.py``, the orchestration in ``harness.py`` and
the output in ``report.py`` and ``plots.py``.  See ``benchmarks/README.md``.
"""

FAMILIES = ("fp8_block", "fp8_block_linear", "fp8", "fp8_tensorwise", "fp8_linear", "nvfp4", "nvfp4_linear",
            "skinny", "quant")
