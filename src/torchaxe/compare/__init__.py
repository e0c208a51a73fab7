"""``torchaxe compare``: two runs (profiles or traces) side by side."""
