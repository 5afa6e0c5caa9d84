"""The engine: config, sampling parameters, sequences, block manager, scheduler,
model runner, step-level LLMEngine and the offline LLM API."""
