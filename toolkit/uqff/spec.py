"""UQFF constants: the one module that ``toolkit/uqff/SPEC.md`` names. Every number and name of the
on-disk layout lives here; the writer, the reader and ``moqe uqff inspect`` import them.

Version rule (stated once, in SPEC.md): readers accept major == VERSION[0] and minor <= VERSION[1],
ignore patch, and reject a shard without the three version tensors.
"""
from __future__ import annotations

import re
import zlib
from pathlib import Path

import numpy as np

from ..errors import ModelError
from ..formats import FORMATS

VERSION = (1, 2, 0)  # the mistral.rs UQFF 1.2.0 layout (PR #2199), with the extension tags below
VERSION_KEYS = ("uqff.version.major", "uqff.version.minor", "uqff.version.patch")

SHARD_SUFFIX = ".uqff"
SHARD_STEM = "model"  # shards are f"{SHARD_STEM}-{n}{SHARD_SUFFIX}", n = 0, 1, ...
SHARD_RE = re.compile(r"^(?P<stem>.+)-(?P<n>\d+)\.uqff$")
RESIDUAL = "residual.safetensors"
REPORT = "uqff_report.json"  # the manifest: written last, so a bundle without it is incomplete
CONFIG = "config.json"
ASSETS = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")
REQUIRED_ASSETS = ("config.json", "tokenizer.json")
DEFAULT_SHARD_BYTES = 10 * 1024 ** 3  # 10 GiB
STAGING_PREFIX = ".uqff-staging-"  # staging folder next to OUT: f".{OUT.name}{STAGING_PREFIX}{pid}"

# Per-layer entry suffixes (appended to the layer key, e.g. "model.layers.0.self_attn.q_proj").
FORMAT_SUFFIX = ".weight.format"  # U8 scalar: one of the TAGS below

# Format tags. 0..6 are mistral.rs's (Gguf=0, Unquant=1, Hqq=2, Fp8=3, Afq=4, F8Q8=5, Mxfp4=6); this
# toolkit writes Gguf only from that range. >= 100 are this toolkit's own families: a mistral.rs reader
# rejects them as unknown instead of misreading them (see SPEC.md, "Why our own tags").
TAG_GGUF = 0
TAG_UNQUANT = 1
TAG_MOQE_AFFINE = 100  # int4/int3/int2: Afq-shaped entries, our dense LSB-first packing, f16 scales/biases
TAG_MOQE_INT8 = 101  # int8 per-output-channel, f32 scales (W8A16)
TAG_MOQE_FP8 = 102  # fp8 e4m3fn per-output-channel f32 scales, activations quantized per token (W8A8)
MISTRALRS_TAGS = {0: "Gguf", 1: "Unquant", 2: "Hqq", 3: "Fp8", 4: "Afq", 5: "F8Q8", 6: "Mxfp4"}

# Which family stores which registry format: each Format record names its family's tag (``uqff_tag``).
FAMILY_OF_FORMAT = {f.name: f.uqff_tag for f in FORMATS.values() if f.uqff_tag is not None}  # from the records

# Stacked-expert and split projections: our gate_up [.., 2I, D] (gate rows, then up rows) is written as
# two layers; roles whose tensor is split that way, and the suffixes of the two halves.
SPLIT_ROLES = ("moe.gate_up", "moe.shared_gate_up", "mlp.gate_up")
SPLIT_SUFFIXES = (".gate_proj", ".up_proj")
EXPERTS_DOWN = ".down_proj"

# Debug hook for the interruption test: SIGKILL the writer right after shard N is written.
KILL_AFTER_SHARD_ENV = "MOQE_UQFF_KILL_AFTER_SHARD"


class UQFFError(ModelError):
    """A UQFF bundle is malformed, incomplete, of another version, or holds data we cannot read.
    Messages name the file and the tensor."""


def crc32_file(path: Path) -> int:
    """CRC-32 of a whole file, read memory-mapped (catches any changed byte, burst errors up to 32 bits)."""
    if path.stat().st_size == 0:
        return 0
    return zlib.crc32(np.memmap(path, dtype=np.uint8, mode="r"))
