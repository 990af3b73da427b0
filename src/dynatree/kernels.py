"""Linear layers through oneDNN with weights laid out once, instead of MKL's GEMM per call.

On the CPU, PyTorch computes `nn.Linear` with MKL's sgemm, which repacks the weight on every
call; a decode step multiplies 1-32 rows by every weight of the model, so the repacking and the
kernel choice for so few rows decide the step's time. oneDNN takes the weight reordered once
(`torch.ops.mkldnn._reorder_linear_weight`, the layout inductor's `freezing` also builds) and
the activations as they are (`torch.ops.mkldnn._linear_pointwise`): a step's linears take
about half the time or less at every row count, and MKL's slowness at 2-3 rows, which made
2-3 token trees cost more than 4-token ones, goes (docs/benchmarks.md, "Measurements behind
the design"). Results equal MKL's up to float rounding (2e-6 relative).

`use_packed_linears(model)` swaps each `nn.Linear` for a `PackedLinear` that keeps the
original weight and bias (tied weights stay tied; `parameters()` are unchanged) and adds the
packed copy - the model's linear weights are held twice, and a weight changed in place needs
`repack_linears(model)`. The packed path is taken in inference
only: with gradients enabled the layer computes `F.linear` on its original weight.
`stock_linears(...)` switches back for a block, so the hf-* baselines run the kernels
transformers gets by default.

Inside torch.compile (`--compile`) the opaque packed tensor cannot be traced, and products left
to inductor went to MKL's packed GEMM (measured slower than eager for 4-8 token float32 steps;
once blamed on inductor's `freezing`, which as then given froze nothing). So a compiled layer emits either
`dynatree::packed_linear` (several rows: an operator inductor calls as it is, which finds
the layer's packed copy by number) or, for one row (every `ar` step), `(x * W).sum(-1)`,
which inductor fuses into one loop that streams the weight near the memory bandwidth
(faster than oneDNN and MKL on an output layer as large as SmolLM2's). No modeling code is copied or patched: only module instances are replaced, as quantization
libraries do.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import warnings
import weakref

import torch
import torch.nn.functional as F

from . import cpu
from .errors import DynaTreeError

LINEAR_KERNELS = ("auto", "onednn", "stock")
# dtypes oneDNN can pack, where the CPU has the instructions (cpu.onednn_linear_problem)
PACKABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# auto packs only when the second copy of the weights takes at most this share of the RAM
MAX_RAM_SHARE = 0.25


# Every PackedLinear by number, so a compiled graph can name its layer with a plain int
# (oneDNN's opaque packed tensor cannot be traced); see `packed_linear`.
_LAYERS: "weakref.WeakValueDictionary[int, PackedLinear]" = weakref.WeakValueDictionary()
_SLOTS = itertools.count()
_FELL_BACK: set[int] = set()  # slots that `packed_linear` computed with F.linear (warned once each)


# `dynatree::packed_linear`, declared with the low-level torch.library API (a call costs a fraction
# of `torch.library.custom_op`'s wrapper; a step makes one per linear layer). Defined when the
# first PackedLinear is made (`_define_operator`), so importing dynatree registers nothing.
_LIBRARY: torch.library.Library | None = None


def _define_operator() -> None:
    global _LIBRARY
    if _LIBRARY is not None:
        return
    _LIBRARY = torch.library.Library("dynatree", "DEF")
    _LIBRARY.define("packed_linear(Tensor x, Tensor weight, Tensor? bias, int slot) -> Tensor")
    _LIBRARY.impl("packed_linear", packed_linear, "CPU")
    torch.library.register_fake("dynatree::packed_linear", _packed_linear_shape)


def _packed_linear_shape(x, weight, bias, slot):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, slot: int) -> torch.Tensor:
    """`F.linear(x, weight, bias)` by layer `slot`'s packed copy; opaque to torch.compile. A graph
    whose layer is gone or holds another weight than the one traced gets F.linear (same numbers,
    slower), with a warning once per layer."""
    layer = _LAYERS.get(slot)
    if layer is None or layer.weight.data_ptr() != weight.data_ptr():
        if slot not in _FELL_BACK:
            _FELL_BACK.add(slot)
            warnings.warn(f"dynatree::packed_linear: linear layer {slot} is gone or holds another weight than the "
                          "compiled graph traced; computing F.linear instead (same result, slower)", RuntimeWarning,
                          stacklevel=2)
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, layer.packed, bias, "none", [], "")


class PackedLinear(torch.nn.Module):
    """nn.Linear computed by oneDNN on a weight reordered once; see the module docstring."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter: ties and state_dict are kept
        self.bias = linear.bias
        self.repack()
        self.enabled = True  # False: F.linear, as nn.Linear (see stock_linears)
        self._register()

    def _register(self) -> None:
        _define_operator()
        self.slot = next(_SLOTS)  # this layer's number in _LAYERS, for compiled graphs
        _LAYERS[self.slot] = self

    def repack(self) -> None:
        """Lay the weight out for oneDNN again: needed after the weight changed in place."""
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)

    def __deepcopy__(self, memo):
        # oneDNN's opaque tensor cannot be copied: copy the rest, then pack the copied weight
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key != "packed":
                new.__dict__[key] = copy.deepcopy(value, memo)
        new.repack()
        new._register()
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (not self.enabled or torch.is_grad_enabled()
                or x.device.type != "cpu" or x.dtype != self.packed.dtype):
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():
            if x.numel() == x.shape[-1] and x.dtype == torch.float32:  # one row: a multiply-sum inductor fuses
                # into one streaming loop; in 16-bit dtypes its other summing order would round some outputs
                # otherwise than the oneDNN kernel of tree steps (a greedy token then differs: weights.py)
                y = (x.unsqueeze(-2) * self.weight).sum(-1)
                return y if self.bias is None else y + self.bias
            return torch.ops.dynatree.packed_linear(x, self.weight, self.bias, self.slot)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packing_available(model: torch.nn.Module) -> str | None:
    """Why `model`'s linears cannot be packed on this machine, or None when they can."""
    param = next(model.parameters())
    if param.device.type != "cpu":
        return f"on {param.device.type}, not the CPU"
    dtype = str(param.dtype).removeprefix("torch.")
    if param.dtype not in PACKABLE_DTYPES:
        return f"dtype {dtype} (oneDNN packs float32, bfloat16 and float16)"
    problem = cpu.onednn_linear_problem(param.dtype)
    if problem is not None:
        return f"this CPU ({cpu.capability()}) cannot run oneDNN's {dtype} linear: {problem}"
    return None


def _linear_bytes(model: torch.nn.Module) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if type(m) is torch.nn.Linear)


def _ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_linear_kernel(kernel: str) -> None:
    if kernel not in LINEAR_KERNELS:
        raise DynaTreeError(f"unknown linear kernel {kernel!r}; choose one of {', '.join(LINEAR_KERNELS)}")


def packing_problem(model: torch.nn.Module, kernel: str = "auto") -> str | None:
    """Why the linear `kernel` choice leaves `model` on stock kernels (None: packed, or "stock" asked for)."""
    check_linear_kernel(kernel)
    if kernel == "stock":
        return None
    reason = packing_available(model)
    if reason is None and kernel == "auto":
        ram = _ram_bytes()
        if ram is not None and _linear_bytes(model) > MAX_RAM_SHARE * ram:
            reason = "the packed copy of the weights would take over a quarter of the RAM"
    return reason


def use_packed_linears(model: torch.nn.Module, kernel: str = "auto") -> str:
    """Apply the linear `kernel` choice to `model`; returns what its linears now run ("onednn" or "stock").

    "stock" leaves the model alone; "onednn" packs every nn.Linear or raises a one-line error
    saying why it cannot (the CPU lacks the dtype's oneDNN path, a dtype oneDNN does not pack,
    not on the CPU); "auto" packs when it can and the packed copy takes at most MAX_RAM_SHARE of
    the RAM, else stays stock (`packing_problem` says why, for the run's record)."""
    reason = packing_problem(model, kernel)
    if kernel == "stock":
        return "stock"
    if reason is not None:
        if kernel == "onednn":
            param = next(model.parameters())
            on_cpu_reduced = param.device.type == "cpu" and param.dtype in PACKABLE_DTYPES[1:]
            instead = "--linear stock" + (" or --dtype float32" if on_cpu_reduced else "")
            raise DynaTreeError(f"--linear onednn: cannot pack this model's linear layers: {reason}; use {instead}")
        return "stock"
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:  # subclasses (e.g. quantized linears) keep their own forward
                setattr(parent, name, PackedLinear(child))
    return "onednn"


def linear_kernel(model: torch.nn.Module) -> str:
    """What `model`'s linear layers run now: "onednn" or "stock"."""
    return "onednn" if any(isinstance(m, PackedLinear) and m.enabled for m in model.modules()) else "stock"


def repack_linears(model: torch.nn.Module) -> None:
    """Re-lay every PackedLinear's weight after the model's weights were changed in place."""
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.repack()


@contextlib.contextmanager
def stock_linears(*models):
    """Run a block with F.linear (PyTorch's default kernels) in every PackedLinear of `models`."""
    layers = [m for model in models if model is not None for m in model.modules()
              if isinstance(m, PackedLinear) and m.enabled]
    for m in layers:
        m.enabled = False
    try:
        yield
    finally:
        for m in layers:
            m.enabled = True
