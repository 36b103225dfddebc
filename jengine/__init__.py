"""jengine: a JAX-native LLM inference and serving engine in the mould of vLLM V1."""
