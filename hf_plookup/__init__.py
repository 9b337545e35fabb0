"""hf_plookup: batched prompt-lookup (n-gram speculative) decoding for Hugging Face transformers."""

from .api import PlookupGenerateOutput, PlookupModel, unwrap, wrap
from .engine.engine import EngineOptions
from .stats import SpecStats

__all__ = ["wrap", "unwrap", "PlookupModel", "PlookupGenerateOutput", "EngineOptions", "SpecStats"]
__version__ = "0.1.0"
