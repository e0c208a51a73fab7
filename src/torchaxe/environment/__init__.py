"""The environment axis: settings that silently slow training (launch-blocking and
debug variables, thread counts, the allocator, slow process-wide switches), read
from the run and located in its code (``checks.py``). Nothing here imports torch."""
