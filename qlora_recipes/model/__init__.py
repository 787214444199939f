"""The model: the checks a model dir or hub id gets before loading, the library configs built from the
stack (BitsAndBytesConfig, LoraConfig), and loading it quantized and trainable; the per-family traits
it asks live one floor down (qlora_recipes/families.py)."""
