"""Kernels swapped in at run time for torch operators that are slow on the machine at
hand: ``dropout.py`` (dropout drawing its mask from packed random bits, for CPUs where
torch's own Bernoulli draw is slow), the ``kernels`` knob that installs them
(``knob.py``), and the candidates advise measures (``candidates.py``)."""
