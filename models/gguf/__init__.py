"""GGUF files: the validated reader and the quantized block layouts."""
