"""The parts a family is built from. Each part owns, for its piece of the model: the ``config.json`` keys it
reads, its Hugging Face tensor names, its GGUF tensor names and metadata (read and written, and what llama.cpp
cannot run), how ``moqe info`` describes and counts it, how the runtime builds it, and whether the compiled decode
step covers it (``compiled``; a family is covered when all its parts are: ``Family.compiled``).

- ``attention.py``: :class:`GQA` (q/k norm per head or per projection, biases, clip, sinks) and :class:`MLA`.
- ``router.py``: :class:`Softmax` (top-k of a softmax, or of the logits then softmax), :class:`SoftmaxGrouped`
  (DeepSeek-V2), :class:`SigmoidGrouped` (a selection bias, DeepSeek-V3 / GLM-4.5).
- ``experts.py``: :class:`SwiGLU` (per-expert or fused checkpoint layouts) and :class:`ClampedSwiGLU` (gpt-oss's
  layout and activation), each with an optional shared expert (:class:`Shared`, :class:`SharedCount`).
- ``layers.py``: which layers are routed and which slide (:class:`AllMoE`, :class:`SparseStep`,
  :class:`LeadingDense`), with the norms and the dense MLP.
- ``rope.py``: :class:`Rope`, which rope scalings GGUF carries for the family.

Every hook has a default that adds nothing (:class:`Part`), so a part implements only what it owns. The contexts
the hooks receive: ``k`` a ``toolkit.model.schema.Keys`` over config.json and ``c`` the ModelConfig fields read so
far; ``t`` one checkpoint layer (``ck``, ``get``, ``cfg``, ``i``, ``p`` its name prefix); ``m`` a GGUF file's
metadata (``a``/``n``/``x`` read a key as a value / whole number / real, ``key``, ``tensors``, ``where``); ``g`` one
GGUF layer (``ts``, ``cfg``, ``n`` role -> tensor name, ``keep``, ``i``).
"""
from __future__ import annotations


def limit(key: str) -> tuple[int, int]:
    """The (lo, hi) range every family shares for an integer config key (``toolkit.model.schema.LIMITS``)."""
    from ...model.schema import LIMITS

    return LIMITS[key]


class Part:
    """A part's hooks, each a no-op by default."""

    gguf_names: dict = {}  # our role -> GGUF tensor name in layer {i}
    # whether the compiled decode step (toolkit/model/decode_step.py) covers this part's piece of a layer; the step
    # still checks the weights it is given (formats, 16-bit projections, the policy) at run time
    compiled = True

    def config(self, k, c: dict) -> None:
        """Read this part's config.json keys into ``c`` (ModelConfig fields)."""

    def describe(self, cfg) -> str:
        return ""

    def gguf_config(self, m, raw: dict) -> None:
        """Turn this part's GGUF metadata into config.json keys in ``raw``."""

    def gguf_metadata(self, w, cfg) -> None:
        """Write this part's GGUF metadata with the gguf package's writer ``w``."""

    def gguf_problems(self, cfg) -> list:
        """What of this config llama.cpp's architecture for the family does not run (phrases for an error)."""
        return []
