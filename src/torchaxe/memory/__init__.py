"""The memory axis: activation checkpointing of the model's repeated blocks and the
allocator settings, as knobs and measured candidates."""
