"""FLOPs per step and model FLOPs utilisation (MFU).

The FLOPs of one step of the real run are counted once, by PyTorch's own counter
(:class:`torch.utils.flop_counter.FlopCounterMode`), on the last warm-up step: the
counter slows the step it runs in, so a measured step is never counted. Forward and
backward are both counted. Fused attention is counted as the fused kernel would
compute it (two matrix products forward, five backward), including the CPU kernel
``_scaled_dot_product_flash_attention_for_cpu`` that the counter has no formula for,
and so is the CPU's fused recurrent layer (``mkldnn_rnn_layer``: an LSTM or GRU).

The counted step runs with torch.compile told to run eagerly
(``torch.compiler.set_stance("force_eager")``): the compiler does not trace under an
active dispatch mode such as the counter, and when it meets one it marks the frame it
was entering, ``nn.Module``'s call among them, to be skipped for good, so every compiled
module of the process would run eagerly from that step on. Under the stance the
compiler is not asked, and the next step runs the compiled code again.

The run's dtype is the dtype that carried most of the counted FLOPs (bf16 under
autocast, float32 otherwise). Beside the published peak of the device for that dtype
(:mod:`torchaxe.backends.peaks`), a short matrix-product probe measures the peak this
device reaches in that dtype, so a CPU, or an accelerator missing from the table,
still gets a real figure.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable

from torchaxe.runtime.dynamo import eager_stance

#: Seconds the peak probe may spend (its first product, a warm-up, excluded).
PROBE_SECONDS = 0.5
#: Largest square matrix the probe multiplies, per device type.
PROBE_MAX_SIZE = {"cpu": 2048}
PROBE_MAX_SIZE_DEVICE = 8192


def _attention_mapping() -> dict[Any, Callable[..., int]]:
    """Formulas for the fused attention kernels the counter does not know, written
    with its own public attention counts."""
    import torch
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten

    def forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    def backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)

    mapping: dict[Any, Callable[..., int]] = {}
    for name, formula in (("_scaled_dot_product_flash_attention_for_cpu", forward),
                          ("_scaled_dot_product_flash_attention_for_cpu_backward", backward),
                          ("_scaled_dot_product_fused_attention_overrideable", forward),
                          ("_scaled_dot_product_fused_attention_overrideable_backward", backward)):
        op = getattr(aten, name, None)
        if op is not None:
            mapping[op] = formula
    return {**mapping, **_recurrent_mapping(aten)}


def _recurrent_mapping(aten: Any) -> dict[Any, Callable[..., int]]:
    """The CPU's fused recurrent layer (oneDNN's ``mkldnn_rnn_layer``, which ``nn.LSTM``
    and ``nn.GRU`` run on a CPU), which the counter has no formula for: the products of
    every time step with the input and hidden weights, two FLOPs a multiply-add; the
    backward computes the gradients of the inputs and of the weights, twice that. The
    gates' element-wise work is left out, as the counter leaves it out elsewhere."""

    def products(input_shape, w_ih_shape, w_hh_shape) -> int:
        steps = input_shape[0] * input_shape[1]  # time x batch, either layout
        return 2 * steps * (w_ih_shape[0] * w_ih_shape[1] + w_hh_shape[0] * w_hh_shape[1])

    def forward(input_shape, weight0, weight1, *args, out_shape=None, **kwargs) -> int:
        return products(input_shape, weight0, weight1)

    def backward(input_shape, weight1, weight2, *args, out_shape=None, **kwargs) -> int:
        return 2 * products(input_shape, weight1, weight2)

    mapping: dict[Any, Callable[..., int]] = {}
    for name, formula in (("mkldnn_rnn_layer", forward), ("mkldnn_rnn_layer_backward", backward)):
        op = getattr(aten, name, None)
        if op is not None:
            mapping[op] = formula
    return mapping


def _dtype_tally_mode(registry: dict[Any, Callable[..., int]]):
    """A dispatch mode that adds up the counted ops' FLOPs per input dtype, and apart
    (``evaluation``) those run with gradients off outside a backward pass: an
    evaluation or generation pass the script runs between two optimizer steps, which
    is not the training step's work (the optimizer's update has no FLOP formula). It
    sits inside the counter's mode: it sees each op first, then hands it on."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    def in_training() -> bool:
        return torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1

    class DtypeTally(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.flops: Counter[str] = Counter()
            self.evaluation = 0
            self.operators = 0
            #: What the counter counted beyond the work of sparse matrix products.
            self.overcount = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            self.operators += 1
            formula = registry.get(getattr(func, "_overloadpacket", None))
            if formula is not None:
                dtype = next((a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
                if dtype is not None:
                    try:
                        flops = int(formula(*args, **kwargs, out_val=out))
                    except Exception:  # a formula that cannot read these arguments: counted by the counter only
                        flops = 0
                    sparse = [a for a in args if isinstance(a, torch.Tensor) and a.layout != torch.strided]
                    if sparse and flops:
                        # The counter's formula reads shapes: a sparse matrix product
                        # counted as dense (a GCN's 8000 x 8000 adjacency: 32 GFLOP a
                        # step where 2 x nnz x columns were done).
                        done = _sparse_product_flops(sparse, out)
                        self.overcount += flops - done
                        flops = done
                    if in_training():
                        self.flops[str(dtype).removeprefix("torch.")] += flops
                    else:
                        self.evaluation += flops
            return out

    return DtypeTally()


def _sparse_product_flops(sparse: list[Any], out: Any) -> int:
    """A product with a sparse operand: a multiply and an add for each stored element
    and each column of the result."""
    columns = out.shape[-1] if getattr(out, "dim", lambda: 0)() >= 2 else 1
    stored = 0
    for tensor in sparse:
        try:
            stored += int(tensor._nnz())
        except Exception:  # a layout without a count of its stored elements: count it whole
            stored += tensor.numel()
    return 2 * stored * columns


class SavedActivations:
    """The bytes of the tensors autograd saves for backward while it is entered
    (``torch.autograd.graph.saved_tensors_hooks``): an estimate of activation memory.
    Each storage counts once; parameters (and views of them) are not activations."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}
        self._hooks: Any = None

    def _pack(self, tensor: Any) -> Any:
        base = tensor._base if tensor._base is not None else tensor
        if not (base.is_leaf and base.requires_grad):
            try:
                storage = tensor.untyped_storage()
                self.storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, nested)
                pass
        return tensor

    def start(self) -> None:
        import torch

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()

    def stop(self) -> int:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
        return sum(self.storages.values())


class _WholeStep:
    """Stands in for the counter's per-module tracker: every FLOP is the step's.

    The counter's own tracker hooks every module's backward, and those hooks cannot
    run inside ``torch.autograd.grad`` (a physics-informed loss, a gradient penalty):
    the script would stop with "A leaf node was passed to _will_engine_execute_node".
    Only the step's total is read here, so the tracker is not needed."""

    parents = frozenset({"Global"})

    def __enter__(self) -> "_WholeStep":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class FlopWindow:
    """Counts the FLOPs of step ``step`` (1-based) of the run, and the bytes of the
    activations autograd saved in it.

    ``start`` and ``stop`` are called at that step's boundaries by the step recorder.
    A failure to count (a script running its own dispatch mode in a way the counter
    cannot nest with) leaves ``flops`` None and says why in ``error``; the run goes on.
    """

    def __init__(self, step: int) -> None:
        self.step = step
        self.flops: int | None = None
        self.by_dtype: dict[str, int] = {}
        #: FLOPs of the counted step run with gradients off outside backward (an
        #: evaluation pass), left out of ``flops``.
        self.evaluation_flops = 0
        self.activation_bytes: int | None = None
        #: The operators the counted step dispatched (below autograd), or None.
        self.operators: int | None = None
        self.error: str | None = None
        self._counter: Any = None
        self._tally: Any = None
        self._saved: SavedActivations | None = None
        self._stance: Any = None

    @property
    def active(self) -> bool:
        return self._counter is not None

    def start(self) -> None:
        if self.active or self.flops is not None or self.error is not None:
            return
        self._stance = eager_stance()
        try:
            from torch.utils.flop_counter import FlopCounterMode

            counter = FlopCounterMode(display=False, custom_mapping=_attention_mapping())
            counter.mod_tracker = _WholeStep()
            counter.__enter__()
        except Exception as exc:
            self.error = f"the FLOP counter could not start ({type(exc).__name__}: {exc})"
            self._leave_stance()
            return
        self._counter = counter
        try:
            tally = _dtype_tally_mode(counter.flop_registry)
            tally.__enter__()
            self._tally = tally
        except Exception:  # the dtype split is a nicety; the total still counts
            self._tally = None
        try:
            saved = SavedActivations()
            saved.start()
            self._saved = saved
        except Exception:  # no estimate of activations; the FLOPs still count
            self._saved = None

    def stop(self) -> None:
        counter, tally, saved = self._counter, self._tally, self._saved
        if counter is None:
            return
        self._counter = self._tally = self._saved = None
        if saved is not None:
            try:
                self.activation_bytes = saved.stop()
            except Exception:
                self.activation_bytes = None
        try:
            evaluation = overcount = 0
            if tally is not None:
                tally.__exit__(None, None, None)
                self.by_dtype = {k: v for k, v in tally.flops.items() if v}
                evaluation = tally.evaluation
                overcount = tally.overcount
                self.operators = tally.operators
            counter.__exit__(None, None, None)
            self.evaluation_flops = evaluation
            self.flops = max(int(counter.get_total_flops()) - evaluation - overcount, 0)
        except Exception as exc:
            self.flops = None
            self.error = f"the FLOP counter could not stop cleanly ({type(exc).__name__}: {exc})"
        finally:
            self._leave_stance()

    def _leave_stance(self) -> None:
        stance, self._stance = self._stance, None
        if stance is not None:
            try:
                stance.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - the stance is restored as far as torch allows
                pass

    @property
    def dtype(self) -> str | None:
        """The dtype that carried most of the counted FLOPs."""
        if not self.by_dtype:
            return None
        return max(self.by_dtype.items(), key=lambda item: item[1])[0]


def float32_uses_tf32(device_type: str) -> bool:
    """Whether float32 matrix products may run on TF32 tensor cores in this process."""
    if device_type != "cuda":
        return False
    import torch

    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def measure_peak(device_type: str, dtype_name: str, synchronize: Callable[[], None] = lambda: None,
                 seconds: float = PROBE_SECONDS, clock: Callable[[], float] = time.perf_counter,
                 max_size: int | None = None) -> float | None:
    """The highest FLOP/s square matrix products reach on this device in this dtype.

    The size doubles from 256 until one product takes a twentieth of ``seconds`` (or
    the size limit); products of that size then repeat until ``seconds`` are spent.
    The best rate is returned (None if no product could run: a dtype the device has
    no matrix product for)."""
    import torch

    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        return None
    limit = max_size or PROBE_MAX_SIZE.get(device_type, PROBE_MAX_SIZE_DEVICE)
    size = 256
    best = 0.0
    try:
        with torch.no_grad():
            a = torch.randn(size, size, device=device_type).to(dtype)
            torch.mm(a, a)  # warm-up: kernel selection, thread pool start
            synchronize()
            deadline = clock() + seconds
            while True:
                start = clock()
                torch.mm(a, a)
                synchronize()
                elapsed = clock() - start
                if elapsed > 0:
                    best = max(best, 2.0 * size ** 3 / elapsed)
                if elapsed < seconds / 20 and size < limit:
                    size = min(limit, size * 2)
                    a = torch.randn(size, size, device=device_type).to(dtype)
                    torch.mm(a, a)
                    synchronize()
                    continue
                if clock() >= deadline:
                    break
    except (RuntimeError, TypeError):
        return None
    return best or None
