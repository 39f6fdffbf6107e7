"""GGUF files (llama.cpp's format) in and out: names, tensors, tokenizer."""
