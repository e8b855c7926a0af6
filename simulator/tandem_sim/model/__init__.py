"""What is simulated, pure: the model (tokenizer, chat template, KV bytes, decoder), the batch-variant numerics and
their calibration, the GPU's timing profiles, the weights and their load, SGLang's process model of ranks."""
