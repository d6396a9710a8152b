"""A compact reference decoder for converted checkpoints that caches only the MLA latent.

    from mlaconv.runtime import LatentDecoder, generate
    model = LatentDecoder.load("out/")            # uses out/absorbed/ when present
    ids = generate(model, prompt_ids, 32)         # greedy; temperature/top_k/seed to sample

Attention runs on the cached rows [ĉ | rotated k^R] with the absorbed weights of ``mlaconv.target.absorb``.
"""

from mlaconv.runtime.generate import generate, next_token
from mlaconv.runtime.model import LatentCache, LatentDecoder

__all__ = ["LatentCache", "LatentDecoder", "generate", "next_token"]
