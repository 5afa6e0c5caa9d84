"""Weight quantization (FP8 W8A8): the methods the engine runs, what a
checkpoint's ``quantization_config`` says (``scheme``, torch-free), the
quantized linear layer (``fp8``) and the reading of pre-quantized tensors
(``checkpoint``). docs/engine.md, "FP8 weights"."""
