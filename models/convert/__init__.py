"""GGUF -> ONNX: the graph builder, the conversion pipeline and the numpy reference forward."""
