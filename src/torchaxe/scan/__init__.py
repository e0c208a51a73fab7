"""The static scanner: find code with faster fused replacements, without running it."""
