"""The runtime layer: watch the user's real training run.

``harness`` runs an unmodified training script in-process with instrumentation and
produces a :class:`~torchaxe.runtime.profile.Profile`; ``merge`` compares the
profiles of the ranks of a distributed run. Nothing here is imported by
``import torchaxe``; torch itself is imported only when a run starts.
"""
