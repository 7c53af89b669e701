"""LoRA and QLoRA adapters: adapted projections, a quantized frozen base, PEFT adapter files."""
