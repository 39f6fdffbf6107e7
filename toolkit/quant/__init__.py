"""Quantization policies (which weight gets which format) and quantizing a checkpoint while it streams in."""
from .policy import PRESETS, Policy, parse_policy
from .quantize import QuantReport, quantizing_transform

__all__ = ["PRESETS", "Policy", "QuantReport", "parse_policy", "quantizing_transform"]
