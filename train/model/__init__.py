"""The decoder wing: the Llama-like decoder, its rotary embeddings, where its arrays live on the
mesh, every token's loss from its last hidden states, and the LoRA layer and quantizer its
projections use (docs/architecture.md)."""
