"""hf_plookup: batched prompt-lookup (n-gram speculative) decoding for Hugging Face transformers."""

from .api import PlookupGenerateOutput, PlookupModel, wrap
from .engine.engine import EngineOptions
from .stats import SpecStats

__all__ = ["wrap", "PlookupModel", "PlookupGenerateOutput", "EngineOptions", "SpecStats"]
__version__ = "0.1.0"
