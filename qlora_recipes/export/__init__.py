"""A finished run for the runtimes people serve models with.

`gguf` (llama.cpp's own converter, fetched by `converter`, the file read back by `readback`, an Ollama
Modelfile by `ollama`) and `vllm` (the adapter checked for what vLLM loads, its `vllm serve` line).
"""
