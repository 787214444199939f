"""The model: the checks a model dir or hub id gets before loading, per-family traits (families.py:
what the loader and the planner both ask), the library configs built from the stack
(BitsAndBytesConfig, LoraConfig), and loading it quantized and trainable."""
