"""Recognising hand-written math by meaning, not by name.

A function body is lowered to small expression trees (``ir``, ``lowering``,
``inline``): straight-line locals are substituted, calls the interpreter does not know
become opaque free variables. Candidate trees are evaluated with torch on random
probes (``interpreter``, ``probes``) and compared with reference functions
(``references``, ``fingerprints``); ``analysis`` turns the matches of one file into
locations and rewrites for the formula rules (AX110-AX120, AX123), and ``verify`` measures
each replacement against its hand-written form.

Nothing here imports torch until a file holds a candidate that passes the structural
tests of ``prefilter``; in a parallel scan only one process (``remote``) imports it for
all workers. Nothing runs the scanned code: the interpreter only calls the operators
on its whitelist.
"""
