"""The precision axis: lower-precision arithmetic the run can be measured under
(TF32 matmuls, ``torch.autocast``), offered as candidates (``candidates.py``).

Its knobs (``torch.matmul_precision``, ``autocast``) are applied by the trial
bootstrap; nothing here imports torch.
"""
