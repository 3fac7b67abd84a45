"""The inference engine: the llama.cpp runtime, GGUF metadata and estimates, chat rendering, tiny models."""
