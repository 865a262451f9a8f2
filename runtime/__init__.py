"""The dsc runtime. Loads artifacts with torch and safetensors alone (no transformers)."""
from dsc.runtime.engine import Engine, GenerateResult, load

__all__ = ["Engine", "GenerateResult", "load"]
