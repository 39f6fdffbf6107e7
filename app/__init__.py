"""The MoQE Gradio app: compare expert bit widths side by side, measure perplexity, save UQFF bundles, plan
mixed expert formats under a budget.

``python -m app`` starts it on the bundled model (``--model DIR`` for any checkpoint or UQFF bundle).
Layout: ``configs`` (what a configuration is, validated), ``models`` (LRU cache of quantized models and the
compute lock), ``paths`` (output-root confinement), ``handlers`` (the endpoints), ``plan`` (the Plan tab's endpoints),
``ui`` (the Blocks page), ``serving`` (its ``gr.Blocks``: the kernel warm-up starts once the server is up).
"""
import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before gradio is imported: no outside lookups

import toolkit  # noqa: E402,F401  (before gradio imports NumPy: toolkit sets OpenBLAS's idle-thread timeout)
from .ui import AppSettings, build_app  # noqa: E402

__all__ = ["AppSettings", "build_app"]
