"""Weight formats: the linear layers' weights kept in 4 or 8 bits, computed by PyTorch's own kernels.

A decode step on the CPU reads every weight of the model once, so its time is set by how
many bytes the weights take. `--weights` picks their format:

  * `dense`: the weights in the model's dtype (`--dtype`, float32 unless said), as loaded;
  * `q4`: every linear layer stored in a GGUF file's 4-bit tensors (Q4_0, Q4_1) keeps those
    4-bit codes as they are, in groups of 32 with one scale and one offset per group, and is
    computed by `torch._weight_int4pack_mm_for_cpu` (dequantizes `(q - 8) * scale + zero`):
    Q4_1's `d * q + m` is `scale = d, zero = m + 8d`; Q4_0's `d * (q - 8)` is `scale = d,
    zero = 0`. No requantization: the layer's values are the file's, except that the scales
    and offsets are rounded from float16 to bfloat16 (the kernel's dtype). Layers stored
    otherwise in the file (SmolLM2's Q8_0 output layer, tied to the embeddings) stay dense;
  * `int8`: every linear layer quantized once, weight-only, per output channel (symmetric,
    scale = max |w| / 127), computed by `torch._weight_int8pack_mm`; for checkpoints that come
    in 16 or 32 bits.

Both low-bit formats compute with bfloat16 activations (the CPU kernels are fast there; their
float32 path is ~20x slower), so the rest of the model (embeddings, norms, dense layers) is
bfloat16 too; they run on the CPU only. Greedy speculative output equals `ar` in the same format,
token for token, because a tree step computes each row bit for bit as a one-token step does:
the low-bit kernels compute each output row from its own input row only (tested), and attention
runs in float64 (`attention.use_exact_attention`: in bfloat16, the different order in which a
tree step sums over its keys flips rounding bits, enough to change greedy tokens). The output layer, when it stays dense, is not converted.

Which GGUF rows feed which layer is found by value, for any architecture: transformers
dequantizes the file (through the `gguf` package) and permutes some tensors' rows (llama's
q/k projections); each layer's rows are looked up among the file's dequantized 4-bit rows,
and a layer is converted only when every one of its rows is found bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .attention import can_use_exact_attention, use_exact_attention
from .errors import DynaTreeError, first_line
from .files import replaced_atomically, write_text_atomic

WEIGHT_FORMATS = {
    "auto": "q4 for a target from a GGUF file with 4-bit layers, on the CPU, in bfloat16 or no --dtype; else dense",
    "dense": "the weights in --dtype, as loaded",
    "q4": "a GGUF file's 4-bit tensors kept as they are (Q4_0, Q4_1), bfloat16 activations, CPU",
    "int8": "weight-only int8 per output channel, quantized at load, bfloat16 activations, CPU",
}
LOW_BIT = ("q4", "int8")
LOW_BIT_DTYPE = torch.bfloat16  # the activations' dtype of both low-bit kernels
GROUP = 32  # values per scale/offset group: GGUF's block size, one of the int4 kernel's group sizes
# GGUF 4-bit block layouts (ggml-common.h): float16 fields, then 16 bytes of nibbles, value j of the
# block in the low nibble of byte j and value j + 16 in the high nibble of byte j.
Q4_TYPES = {"Q4_0": ("d",), "Q4_1": ("d", "m")}


def file_key(path: Path, memo: Path | None = None) -> str:
    """A cache key for a file's content: the first 16 hex digits of its sha256, so that copies of one
    file (a reinstalled package, another virtual environment, a clone) share one cache entry instead
    of adding one each. Hashing reads the whole file (about 0.1 s for the embedded 98 MB GGUF); with
    `memo`, the digest is kept there per (resolved path, size, modification time), so an unchanged
    file is read once."""
    stat = path.stat()
    known = None
    if memo is not None:
        stamp = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:24]
        known = Path(memo) / f"{stamp}.key"
        try:
            key = known.read_text().strip()
            if len(key) == 16:
                return key
        except OSError:
            pass  # not hashed yet (or unreadable): hash now
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    key = digest.hexdigest()[:16]
    if known is not None:
        try:
            known.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(known, key)
        except OSError:
            pass  # a read-only cache: hashed again next time
    return key


def check_weights(weights: str) -> None:
    if not isinstance(weights, str) or weights not in WEIGHT_FORMATS:
        raise DynaTreeError(f"unknown weight format {weights!r} (--weights); choose one of {', '.join(WEIGHT_FORMATS)}")


def resolve_auto(weights: str, dtype, device: torch.device, gguf: Path | None, source: str = "the target",
                 cache_dir: Path | None = None) -> tuple[str, "Q4Rows | None"]:
    """`auto`: q4 where it applies (a GGUF file with Q4_0/Q4_1 tensors, the CPU, no other --dtype
    than bfloat16), else dense; other formats as they are. The rule (docs/results/q4-cpu): q4 is
    the fastest format whose quality against the float32 model is within llama.cpp's own on the
    same file (top-1 agreement with float32 at least llama.cpp's, perplexity no higher). Returns the format and
    the file's 4-bit rows when read (q4 uses them; kept in `cache_dir` if given: `read_q4_rows`).
    `q4` asked for without a GGUF file is refused here, before the model loads."""
    check_weights(weights)
    if weights == "q4":
        if gguf is None:  # before the (slow) load
            raise DynaTreeError(f"--weights q4 keeps a GGUF file's 4-bit weights; {source} is not a .gguf file or "
                                "an embedded GGUF model: use --weights int8 (quantizes at load) or dense")
        return "q4", read_q4_rows(gguf, cache_dir)
    if weights != "auto":
        return weights, None
    if gguf is None or unsupported("q4", device) or dtype not in (None, "bfloat16", LOW_BIT_DTYPE):
        return "dense", None
    rows = read_q4_rows(gguf, cache_dir)
    return ("q4", rows) if rows.codes else ("dense", None)


KERNELS = {"q4": ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu"), "int8": ("_weight_int8pack_mm",)}


def unsupported(weights: str, device: torch.device) -> str | None:
    """Why this torch on this device cannot run a low-bit format, or None."""
    if weights not in LOW_BIT:
        return None
    if device.type != "cpu":
        return (f"--weights {weights} runs on the CPU only (PyTorch's CPU kernels); on {device.type} use --weights "
                "dense with --dtype float16 or bfloat16")
    missing = [op for op in KERNELS[weights] if not hasattr(torch, op)]
    if missing:
        return f"--weights {weights} needs torch.{missing[0]}, which torch {torch.__version__} lacks: upgrade torch"
    return None


def check_device(weights: str, device: torch.device) -> None:
    """The low-bit kernels are PyTorch's CPU kernels: refuse another device (or a torch without
    them) before anything loads."""
    check_weights(weights)
    problem = unsupported(weights, device)
    if problem:
        raise DynaTreeError(problem)


def weights_dtype(weights: str, dtype: str | None) -> str:
    """The dtype a model in this weight format loads in: `dtype` (float32 when None) for dense
    weights; bfloat16 for the low-bit formats, where any other explicit dtype is an error."""
    check_weights(weights)
    if weights not in LOW_BIT:  # dense (auto resolves at load: resolve_auto)
        return dtype or "float32"
    if dtype not in (None, "bfloat16", LOW_BIT_DTYPE):
        name = str(dtype).removeprefix("torch.")
        raise DynaTreeError(f"--weights {weights} computes with bfloat16 activations (PyTorch's CPU {weights} kernel); "
                            f"drop --dtype {name} or pass --dtype bfloat16")
    return "bfloat16"


class Int4Linear(torch.nn.Module):
    """A linear layer on 4-bit codes in groups of 32 (see the module docstring); bfloat16 in and out."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None):
        """`codes`: (out, in) integers 0..15; `scale`, `zero`: (out, in / 32), value = (q - 8) * scale + zero."""
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1))
        # the kernel's layout: (in / 32, out, 2), scale then zero
        pairs = torch.stack([scale.t(), zero.t()], dim=-1).to(LOW_BIT_DTYPE).contiguous()
        self.register_buffer("scales_and_zeros", pairs)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().to(LOW_BIT_DTYPE), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = torch._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scales_and_zeros)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:
        """The (out, in) float32 weight this layer computes with (for tests and quality reports): the
        kernel's own dequantization, read through its float32 path (a bfloat16 product would round it)."""
        eye = torch.eye(self.in_features)
        return torch._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP, self.scales_and_zeros.float()).t()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={GROUP}"


class Int8Linear(torch.nn.Module):
    """A linear layer on int8 weights with one scale per output channel; bfloat16 in and out."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float()
        # the kernel's scales are bfloat16: round them up there first, so max |w| still fits in 127 steps
        wanted = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(LOW_BIT_DTYPE).tiny)
        scale = wanted.to(LOW_BIT_DTYPE)
        scale = torch.where(scale.float() < wanted, torch.nextafter(scale, scale.new_tensor(float("inf"))), scale)
        self.register_buffer("int8", torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().to(LOW_BIT_DTYPE), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = torch._weight_int8pack_mm(rows, self.int8, self.scales).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:
        return self.int8.float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


INT4_OUT_MULTIPLE = 16  # the int4 kernel packs output rows in blocks of 16 (and input columns in GROUPs)


def int4_fits(out_features: int, in_features: int) -> bool:
    """Whether the int4 kernel takes a linear layer of this shape."""
    return out_features % INT4_OUT_MULTIPLE == 0 and in_features % GROUP == 0


REFINE_PASSES = 4  # least-squares passes of `int4_linear`'s per-group fit after the min-max start


def int4_linear(weight: torch.Tensor) -> Int4Linear:
    """A dense (out, in) weight quantized to 4 bits in Q4_1's layout: per group of 32 inputs, 16 levels
    `low + scale * q`. For drafts only (a feature head on a q4 target, featurehead.py), where rounding
    changes proposals, never what is committed; targets keep a GGUF's own codes (`use_q4`).

    The levels start as Q4_1 quantizers set them, from the group's minimum to its maximum, and are then
    fitted by least squares to the codes they give (`REFINE_PASSES` times: the slope and intercept
    of the group's values over its codes), a group keeping the fit only where it lowers the group's
    squared error; the scale and offset are rounded to bfloat16 (the kernel's) before the codes are
    chosen against them. Quantize from float32 where there is a float32 copy (rounding twice loses more)."""
    out, inp = weight.shape
    if not int4_fits(out, inp):
        raise ValueError(f"the int4 kernel takes (out, in) multiples of ({INT4_OUT_MULTIPLE}, {GROUP}), got {(out, inp)}")
    groups = weight.detach().float().reshape(out, inp // GROUP, GROUP)
    if not bool(torch.isfinite(groups).all()):
        raise ValueError(f"int4_linear: the weight holds {int((~torch.isfinite(groups)).sum())} non-finite values")
    low = groups.amin(-1)
    codes, scale, zero, error = _stored_q4(groups, (groups.amax(-1) - low) / 15, low)
    for _ in range(REFINE_PASSES):
        q = codes - codes.mean(-1, keepdim=True)
        slope = (q * groups).sum(-1) / (q * q).sum(-1)  # NaN for a group of one code: its error is NaN, never kept
        intercept = groups.mean(-1) - slope * codes.mean(-1)
        fit = _stored_q4(groups, slope, intercept)
        better = fit[3] < error
        codes = torch.where(better[..., None], fit[0], codes)
        scale, zero, error = (torch.where(better, new, old) for new, old in zip(fit[1:], (scale, zero, error)))
    return Int4Linear(codes.reshape(out, inp).to(torch.int32), scale, zero, None)


def _stored_q4(groups: torch.Tensor, step: torch.Tensor, low: torch.Tensor):
    """(codes, scale, zero, squared error per group) of `groups` [..., GROUP] coded on the levels
    `low + step * q`, q = 0..15, as the kernel stores them: scale and zero (the value at q = 8) rounded to
    bfloat16 first, each value's code the nearest level of the rounded ones."""
    scale = step.clamp_min(torch.finfo(LOW_BIT_DTYPE).tiny).to(LOW_BIT_DTYPE).float()
    zero = (low + 8 * scale).to(LOW_BIT_DTYPE).float()
    codes = torch.round((groups - zero[..., None]) / scale[..., None] + 8).clamp(0, 15)
    error = (((codes - 8) * scale[..., None] + zero[..., None] - groups) ** 2).sum(-1)
    return codes, scale, zero, error


@dataclass(frozen=True)
class Q4Rows:
    """A GGUF file's 4-bit tensors: codes, scales and offsets, and their dequantized rows by value."""

    codes: list[np.ndarray]  # per tensor: (rows, cols) uint8 codes 0..15
    scale: list[np.ndarray]  # per tensor: (rows, cols / 32) float32
    zero: list[np.ndarray]  # per tensor: (rows, cols / 32) float32, the kernel's offset (value at q = 8)
    index: dict[bytes, tuple[int, int]]  # digest of a dequantized float32 row -> (tensor, row)
    types: dict[str, int]  # how many tensors of each GGUF type the file holds (for messages)


def read_q4_rows(path: Path, cache_dir: Path | None = None) -> Q4Rows:
    """Read a GGUF file's Q4_0/Q4_1 tensors (raw blocks) and index their rows by dequantized value.

    The values are the `gguf` package's own dequantization, the one transformers loads with; the
    parsed blocks are checked against it (a layout mistake would be an error, not wrong weights).
    With `cache_dir`, the result is kept there per file content (`file_key`: copies share it):
    later loads skip reading the file, whose metadata alone (SmolLM2's tokenizer) takes ~3 s."""
    cached = None
    if cache_dir is not None:
        # (the digest memo beside the cache folder: the cache root's, which the converted models use too)
        cached = Path(cache_dir) / f"{Path(path).stem}-{file_key(Path(path), Path(cache_dir).parent / 'keys')}.npz"
        if cached.exists():
            try:
                return _load_rows(cached)
            except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
                pass  # a damaged entry is read again from the file and rewritten
    rows = _read_rows(path)
    if cached is not None:
        _save_rows(rows, cached)
    return rows


def _save_rows(rows: Q4Rows, target: Path) -> None:
    """Codes two per byte, scales, offsets and the row index, written atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    arrays = {"types": np.array(json.dumps(rows.types))}
    for i, (q, scale, zero) in enumerate(zip(rows.codes, rows.scale, rows.zero)):
        arrays[f"codes{i}"] = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
        arrays[f"scale{i}"], arrays[f"zero{i}"] = scale, zero
    digests = list(rows.index)
    # (a file without 4-bit tensors has no rows: the shapes must not be inferred from them)
    arrays["digests"] = np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(len(digests), DIGEST_BYTES)
    arrays["where"] = np.array([rows.index[d] for d in digests], dtype=np.int64).reshape(len(digests), 2)
    with replaced_atomically(target) as tmp, open(tmp, "wb") as f:
        np.savez(f, **arrays)


def _load_rows(path: Path) -> Q4Rows:
    with np.load(path) as z:
        count = sum(1 for name in z.files if name.startswith("codes"))
        codes = []
        for i in range(count):
            packed = z[f"codes{i}"]
            q = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.uint8)
            q[:, 0::2], q[:, 1::2] = packed & 0x0F, packed >> 4
            codes.append(q)
        index = {d.tobytes(): (int(t), int(r)) for d, (t, r) in zip(z["digests"], z["where"])}
        return Q4Rows(codes, [z[f"scale{i}"] for i in range(count)], [z[f"zero{i}"] for i in range(count)], index,
                      json.loads(str(z["types"])))


def _read_rows(path: Path) -> Q4Rows:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise DynaTreeError(f"cannot read GGUF file {path}: {first_line(exc)}") from None
    codes, scales, zeros, index, types = [], [], [], {}, {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        types[kind] = types.get(kind, 0) + 1
        if kind not in Q4_TYPES:
            continue
        raw = np.asarray(tensor.data)
        q, scale, zero = _parse_q4(raw, kind)
        values = dequantize(raw, tensor.tensor_type).astype(np.float32).reshape(q.shape)
        mine = ((q.reshape(len(q), -1, GROUP).astype(np.float32) - 8) * scale[..., None] + zero[..., None]).reshape(q.shape)
        if not np.allclose(mine, values, rtol=1e-3, atol=1e-3 * float(np.abs(values).max() + 1e-12)):
            raise DynaTreeError(f"GGUF tensor {tensor.name} ({kind}) does not parse as dynatree expects; "
                                "use --weights dense")
        number = len(codes)
        codes.append(q)
        scales.append(scale)
        zeros.append(zero)
        for row, digest in enumerate(_row_digests(values)):
            index.setdefault(digest, (number, row))
    return Q4Rows(codes, scales, zeros, index, types)


def _parse_q4(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes (rows, cols), scale and kernel offset (rows, cols / 32) of one Q4_0/Q4_1 tensor's blocks."""
    fields = Q4_TYPES[kind]
    size = 2 * len(fields) + GROUP // 2
    blocks = raw.reshape(raw.shape[0], -1, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., 2 * len(fields):]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(raw.shape[0], -1)
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        return q, d, m + 8 * d
    return q, d, np.zeros_like(d)


DIGEST_BYTES = 16  # a row's digest (blake2b) in the q4 row index


def _row_digests(values: np.ndarray) -> list[bytes]:
    return [hashlib.blake2b(row.tobytes(), digest_size=DIGEST_BYTES).digest() for row in np.ascontiguousarray(values)]


def _linears(model: torch.nn.Module):
    """(parent module, attribute name, layer) of every nn.Linear, each layer once."""
    seen = set()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and id(child) not in seen:
                seen.add(id(child))
                yield parent, name, child


def use_q4(model: torch.nn.Module, rows: Q4Rows, source: str) -> str:
    """Swap every linear layer whose float32 weight is, row by row, some of the file's 4-bit rows
    for an Int4Linear on those codes; return a one-line summary. Call before casting to bfloat16."""
    converted, dense, output = 0, [], model.get_output_embeddings()
    for parent, name, layer in _linears(model):
        if layer is output:  # kept dense: drafters read its rows, and it is often tied to the embeddings
            dense.append(name)
            continue
        weight = layer.weight.detach()
        if weight.dtype != torch.float32:
            raise DynaTreeError("q4 weights are matched on the float32 dequantized model; load it in float32 first")
        found = [rows.index.get(d) for d in _row_digests(weight.cpu().numpy())]
        if any(f is None for f in found) or layer.out_features % 16 or layer.in_features % GROUP:
            dense.append(name)
            continue
        codes = np.stack([rows.codes[t][r] for t, r in found])
        scale = np.stack([rows.scale[t][r] for t, r in found])
        zero = np.stack([rows.zero[t][r] for t, r in found])
        setattr(parent, name, Int4Linear(torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(zero),
                                         layer.bias))
        converted += 1
    if not converted:
        held = ", ".join(f"{n} {k}" for k, n in sorted(rows.types.items()))
        raise DynaTreeError(f"--weights q4 needs a GGUF file whose linear layers are stored as Q4_0 or Q4_1; "
                            f"{source} holds {held or 'no tensors'}: use --weights int8 or dense")
    kept = f"; dense (bfloat16): {', '.join(sorted(set(dense)))}" if dense else ""
    return f"q4: {converted} linear layers on the file's 4-bit codes{kept}"


def use_int8(model: torch.nn.Module) -> str:
    """Swap every linear layer but the output layer (kept dense: drafters read its rows, and it is
    often tied to the embeddings) for an Int8Linear quantized from its weight; return a summary."""
    converted, output = 0, model.get_output_embeddings()
    for parent, name, layer in _linears(model):
        if layer is not output:
            setattr(parent, name, Int8Linear(layer.weight, layer.bias))
            converted += 1
    if not converted:
        kinds = sorted({type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__ or "Conv1D" in type(m).__name__})
        raise DynaTreeError(f"--weights int8 found no nn.Linear layers to quantize (this model's are {', '.join(kinds)}): "
                            "use --weights dense")
    return f"int8: {converted} linear layers quantized per output channel; dense (bfloat16): output layer"


def apply_weights(model: torch.nn.Module, weights: str, device: torch.device, gguf: Path | None, source: str,
                  rows: Q4Rows | None = None) -> str | None:
    """Put a loaded float32 model into weight format `weights` (then cast the rest to bfloat16);
    returns the summary recorded with runs (None for dense). Errors name what is possible."""
    check_device(weights, device)
    if weights == "dense":
        return None
    if not can_use_exact_attention(model):
        raise DynaTreeError(f"--weights {weights} needs {source!r} to run SDPA attention through transformers' "
                            f"attention registry (it runs {model.config._attn_implementation!r}), which keeps tree "
                            "verification exact in bfloat16; use --weights dense")
    if weights == "q4":
        if gguf is None:
            raise DynaTreeError(f"--weights q4 keeps a GGUF file's 4-bit weights; {source} is not a .gguf file or "
                                "an embedded GGUF model: use --weights int8 (quantizes at load) or dense")
        note = use_q4(model, rows or read_q4_rows(gguf), source)
    else:
        note = use_int8(model)
    model.to(LOW_BIT_DTYPE)
    use_exact_attention(model)  # float64 attention: tree steps round as one-token steps do
    return note


@torch.no_grad()
def row_dependent_layers(model: torch.nn.Module) -> list[str]:
    """The dense 16-bit linear layers of a low-bit model whose output row depends on how many rows
    the call computes (a random batch of 8 rows against the same rows one and three at a time, bit
    for bit): such a layer can make a tree step's logits differ from one-token steps."""
    gen = torch.Generator().manual_seed(0)
    found = []
    for name, layer in model.named_modules():
        weight = getattr(layer, "weight", None)
        if isinstance(layer, (Int4Linear, Int8Linear)) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        if not (isinstance(layer, torch.nn.Linear) or type(layer).__name__ == "PackedLinear"):
            continue
        x = torch.randn(8, layer.in_features, generator=gen).to(weight.dtype)
        full = layer(x)
        if not (torch.equal(layer(x[:1]), full[:1]) and torch.equal(layer(x[2:5]), full[2:5])):
            found.append(name)
    return found


def inexact_greedy(dtype: torch.dtype, weights: str, row_dependent: list[str] | None = None) -> str | None:
    """Why greedy tree decoding of a model in this dtype and format may differ from `ar`, or None.

    Dense 16-bit weights: the dense kernels (oneDNN, MKL) sum some rows of a multi-row call in
    another order than a one-row call, and bfloat16/float16 rounding makes such differences
    change tokens, with float64 attention too (docs/benchmarks.md, "Measurements behind the
    design"). float32
    (differences ~1e-7, below the logits' gaps in practice) and the low-bit formats (row-wise
    kernels, float64 attention) keep greedy output equal to ar's."""
    if weights == "dense" and dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        return (f"dense {name} weights: tree steps round some values otherwise than one-token steps, so greedy "
                f"output may differ from ar's; float32 and --weights q4/int8 keep it exact")
    if row_dependent:
        return (f"{weights} weights: the dense layer(s) {', '.join(row_dependent[:3])} round a row differently in a "
                "multi-row call on this machine, so greedy output may differ from ar's")
    return None


def quantized_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear))]

