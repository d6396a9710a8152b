"""Measuring a converted model against its source: ``perplexity`` (``eval perplexity``), ``retrieval`` (``eval
retrieval``, passkey), ``verify`` (the built-in check), ``llamacpp`` (running a GGUF in llama.cpp) and ``verdict``
(the plain verdict on an output)."""
