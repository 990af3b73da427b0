"""A feature-level draft head (the idea of EAGLE): drafting from the target's own hidden states.

A draft LM has to rebuild, from tokens alone, what the target already knows; a feature head
starts from the target's last hidden state (its *feature*, the vector the output layer reads)
and only has to predict the next one. At position p it reads the embedding of token x_p and
the feature f_{p-1} the target computed one position earlier, and predicts f_p; the target's
own output layer turns that into next-token probabilities for x_{p+1}. Deeper tree levels feed
the head's own predicted features back in. The embeddings and the output layer are the
target's (frozen, never stored here); the head stores one Llama decoder layer, the projection
of [embedding, feature] to the hidden size, and the ids of a frequent-token sub-vocabulary
(proposals are drawn from those rows of the output layer only: cheaper, and exactness never
depends on a draft).

On a q4 target a head drafts in 4 bits too (`load_head(weights="q4")`, chosen by `draftload`):
its decoder layer's linears (from the saved float32 weights) and its sub-vocabulary's output rows are
quantized once at load (`weights.int4_linear`) and run on the target's int4 kernel, which reads a
quarter of bfloat16's bytes: a root expansion of the shipped head takes about 1.4 ms instead of 2.5 ms
next to a compiled q4 target step of about 11 ms (docs/results/head-lowbit). Its proposals change a
little; what is committed does not (the target verifies every token). A q4 head stays bfloat16 on the
CPU: moving or casting it is an error, as is saving it (it holds codes, not the trained weights).

A head directory holds `feature_head.json` (HeadConfig) and `head.safetensors`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .draftspec import HEAD_CONFIG_FILE
from .errors import DynaTreeError
from .kernels import PackedLinear, use_packed_linears
from .runtime import cache_kwarg, compile_steps
from .weights import int4_fits, int4_linear

CONFIG_FILE = HEAD_CONFIG_FILE
WEIGHTS_FILE = "head.safetensors"


@dataclass
class HeadConfig:
    target: str  # the target the head was trained for (its spec, for messages)
    hidden_size: int  # the target's hidden size: features, embeddings and the head's own width
    vocab_size: int  # rows of the target's output layer
    tokenizer_sha1: str  # fingerprint of the target tokenizer's vocabulary (`tokenizer_fingerprint`)
    draft_vocab: int  # rows of the output layer the head proposes from (its sub-vocabulary)
    heads: int  # attention heads of the head's decoder layer (distill: the target's, unless set)
    kv_heads: int  # key/value heads (grouped-query attention)
    ffn: int  # inner size of the decoder layer's MLP
    context: int = 8192  # longest position the head's rotary embedding is set up for
    rms_norm_eps: float = 1e-5
    # norms of a few rows of the target's output layer (`output_signature`): another model with the
    # same width and tokenizer has other weights; None in heads saved before it was recorded
    output_signature: list[float] | None = None


def tokenizer_fingerprint(tokenizer) -> str:
    """SHA-1 of the tokenizer's (token, id) pairs: two tokenizers that map alike match."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha1(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


SIGNATURE_ROWS = 64  # output-layer rows whose norms sign a target (spread over its vocabulary)
SIGNATURE_TOLERANCE = 0.005  # relative: bfloat16 and q4 loads of one model differ by 0.04%


def output_signature(model) -> list[float]:
    """Norms of `SIGNATURE_ROWS` rows of the model's output layer, spread evenly over its vocabulary,
    in float32 rounded to 4 significant digits: the same model in any weight format (its output
    layer is float32, bfloat16 or float16) gives the same list within `SIGNATURE_TOLERANCE`; a
    model with other weights does not."""
    weight = model.get_output_embeddings().weight.detach()
    ids = torch.linspace(0, weight.shape[0] - 1, SIGNATURE_ROWS).round().long().to(weight.device)
    return [float(f"{v:.4g}") for v in weight[ids].float().norm(dim=-1).tolist()]


def target_features(model) -> tuple[int, int]:
    """(hidden size, output rows) of a target whose last hidden state feeds its output layer,
    else a one-line error (a feature head needs to read that hidden state)."""
    out = model.get_output_embeddings()
    emb = model.get_input_embeddings()
    if out is None or emb is None or not hasattr(out, "weight"):
        raise DynaTreeError(f"{model.config.model_type} has no plain output layer whose input a feature head can read")
    rows, hidden = out.weight.shape
    if emb.weight.shape[1] != hidden:
        raise DynaTreeError(f"{model.config.model_type}: embeddings ({emb.weight.shape[1]}) and output layer "
                            f"({hidden}) differ in width; a feature head needs them equal")
    return int(hidden), int(rows)


class FeatureHead(torch.nn.Module):
    """fc([embedding(x_p), f_{p-1}]) -> one Llama decoder layer -> norm -> predicted f_p."""

    def __init__(self, config: HeadConfig, vocab_ids: torch.Tensor, name: str = "feature-head"):
        super().__init__()
        h = config.hidden_size
        if vocab_ids.dim() != 1 or len(vocab_ids) != config.draft_vocab:
            raise DynaTreeError(f"feature head {name!r}: its config says {config.draft_vocab} sub-vocabulary rows, "
                                f"its vocab_ids hold {tuple(vocab_ids.shape)}")
        if h % config.heads or config.heads % config.kv_heads:
            raise DynaTreeError(f"feature head: {config.heads} heads must divide the hidden size {h} "
                                f"and be a multiple of {config.kv_heads} key/value heads")
        self.config = config
        self.name = name  # the spec it was loaded from (alias or directory)
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        from transformers import LlamaConfig, LlamaModel  # here, so `dynatree --help` need not import them

        body = LlamaConfig(vocab_size=1, hidden_size=h, intermediate_size=config.ffn, num_hidden_layers=1,
                           num_attention_heads=config.heads, num_key_value_heads=config.kv_heads,
                           max_position_embeddings=config.context, rms_norm_eps=config.rms_norm_eps,
                           bos_token_id=None, eos_token_id=None, pad_token_id=None)
        body._attn_implementation = "sdpa"
        self.body = LlamaModel(body)  # its 1-row token embedding is never used: inputs come as embeddings
        self.cache_kwarg = cache_kwarg(self.body)  # the name the body takes its KV cache by (read once, not traced)
        self.register_buffer("vocab_ids", vocab_ids.long().clone())  # target ids of the sub-vocabulary rows
        self.weights = "dense"  # "q4": the decoder layer's linears (and the drafter's output rows) in int4 (`to_q4`)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """Predicted features [batch, n, hidden] for tokens with `embeds` [batch, n, hidden] that
        follow `features` [batch, n, hidden] (one position earlier each), at `positions` [batch, n];
        `mask` a 4-D additive mask or None (causal); `cache` the head's KV cache or None."""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        out = self.body(inputs_embeds=x, position_ids=positions, attention_mask=mask, **{self.cache_kwarg: cache},
                        use_cache=cache is not None)
        return out.last_hidden_state

    def compiled(self):
        """This head's forward through torch.compile (`head_step`, with `runtime.compile_steps`' options
        for the head's dtype and device), built on first use and kept on the head outside its modules
        (state_dict does not see it); called with the forward's arguments by keyword."""
        wrapper = self.__dict__.get("_compiled")
        if wrapper is None:
            step = compile_steps(head_step, self.fc.weight.dtype, self.fc.weight.device)

            def wrapper(**inputs):
                return step(self, inputs)
            object.__setattr__(self, "_compiled", wrapper)  # not registered as a submodule
        return wrapper

    def _apply(self, fn, recurse=True):  # .to(), .float(), ...: a wrapper built for the old dtype or device goes
        if self.weights == "q4":  # its int4 layers compute in bfloat16 on the CPU only
            probe = fn(torch.zeros((), dtype=torch.bfloat16))
            _check_q4_place(probe.device, probe.dtype)
        self.__dict__.pop("_compiled", None)
        return super()._apply(fn, recurse)

    def __getstate__(self):  # copies and pickles leave the compiled wrapper behind (a copy compiles its own)
        state = super().__getstate__()
        state.pop("_compiled", None)
        return state

    @property
    def context_length(self) -> int:
        return self.config.context

    def to_q4(self) -> None:
        """Quantize the decoder layer's linear layers to int4 in place (`weights.int4_linear`), for
        drafting on a q4 target, from the weights as the head holds them (float32 where it can: rounding to
        bfloat16 first loses a little more), then cast the rest to bfloat16, the kernel's activation
        dtype; the fc projection stays dense (its input is two features wide, and it is a seventh of the
        layer's bytes). A one-line error when a shape does not fit the kernel."""
        weight = self.fc.weight  # float32 is quantized from, then computed in bfloat16
        _check_q4_place(weight.device, weight.dtype, float32_ok=True)
        if any(isinstance(m, PackedLinear) for m in self.body.modules()):
            raise DynaTreeError(f"feature head {self.name!r}: quantize it before packing its linears (load_head(weights='q4'))")
        if not q4_fits(self.config):
            raise DynaTreeError(f"feature head {self.name!r} cannot run in 4 bits: the int4 kernel needs widths that are "
                                f"multiples of 16 and 32, got hidden {self.config.hidden_size}, FFN {self.config.ffn}, "
                                f"key/value width {_kv_width(self.config)}, sub-vocabulary {self.config.draft_vocab}")
        for parent in list(self.body.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    if child.bias is not None:
                        raise DynaTreeError(f"feature head {self.name!r}: {name} has a bias; 4-bit heads have none")
                    setattr(parent, name, int4_linear(child.weight))
        self.to(torch.bfloat16)  # (the int4 layers' buffers are bfloat16 and integers already)
        self.__dict__.pop("_compiled", None)
        self.weights = "q4"

    def save(self, directory: Path, extra: dict | None = None) -> None:
        if self.weights != "dense":
            raise ValueError(f"a {self.weights} head holds quantized codes; save the dense head it was loaded from")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().float().cpu().contiguous() for k, v in self.state_dict().items() if k != "vocab_ids"}
        state["vocab_ids"] = self.vocab_ids.int().cpu().contiguous()
        save_file(state, str(directory / WEIGHTS_FILE))
        (directory / CONFIG_FILE).write_text(json.dumps({**dataclasses.asdict(self.config), **(extra or {})}, indent=1))


def _check_q4_place(device: torch.device, dtype: torch.dtype, float32_ok: bool = False) -> None:
    """A q4 head computes where the int4 kernel does: bfloat16 on the CPU (or float32 there, for the
    head `to_q4` quantizes from, when `float32_ok`); else a one-line error naming what it got."""
    dtypes = (torch.bfloat16, torch.float32) if float32_ok else (torch.bfloat16,)
    if device.type != "cpu" or dtype not in dtypes:
        raise DynaTreeError(f"a q4 feature head runs in bfloat16 on the CPU (the int4 kernel's), not {dtype} on {device}")


def _kv_width(config: HeadConfig) -> int:
    return config.kv_heads * (config.hidden_size // config.heads)


def q4_fits(config: HeadConfig) -> bool:
    """Whether every layer `FeatureHead.to_q4` quantizes, and the sub-vocabulary's output rows, fit the int4 kernel."""
    h = config.hidden_size
    return all(int4_fits(out, inp) for out, inp in ((h, h), (_kv_width(config), h), (h, config.ffn), (config.ffn, h),
                                                     (config.draft_vocab, h)))


def head_step(head: FeatureHead, feature_head_step: dict) -> torch.Tensor:
    """`head(**feature_head_step)`: what `FeatureHead.compiled` compiles. The inputs travel in one dict
    under a name no other compiled function uses, so the dynamic sources that name them
    (runtime.DYNAMIC_SOURCES: the fed tokens and the cache's entries symbolic) touch nothing else."""
    return head(**feature_head_step)


def read_config(directory) -> HeadConfig:
    """The HeadConfig of a head saved by `FeatureHead.save`, or a one-line error."""
    try:
        raw = json.loads((Path(directory) / CONFIG_FILE).read_text())
        fields = {f.name for f in dataclasses.fields(HeadConfig)}
        return HeadConfig(**{k: v for k, v in raw.items() if k in fields})
    except (OSError, ValueError, TypeError) as exc:
        raise DynaTreeError(f"feature head {str(directory)!r} cannot be read: {str(exc).splitlines()[0]}") from None


def load_head(directory, name: str | None = None, device="cpu", dtype=torch.float32, linear: str = "stock",
              weights: str = "dense") -> FeatureHead:
    """A head saved by `FeatureHead.save`, in `dtype` on `device`, its linear layers on the `linear`
    kernels (kernels.py: "auto" packs them for oneDNN where the CPU can, as for targets; a head
    drafts with 1-8 rows, where MKL's per-call repacking costs most). Training needs "stock" (packed layers compute F.linear under
    autograd anyway, but the packed copies would go stale as the weights change). `weights` "q4": in 4
    bits (`FeatureHead.to_q4`; bfloat16 on the CPU only, as q4 targets are)."""
    if weights not in ("dense", "q4"):
        raise DynaTreeError(f"a feature head's weights are dense or q4, got {weights!r}")
    if weights == "q4":  # before reading the weights
        _check_q4_place(torch.device(device), dtype)
    directory = Path(directory)
    config = read_config(directory)
    try:
        state = load_file(str(directory / WEIGHTS_FILE))
    except (OSError, ValueError, TypeError) as exc:
        raise DynaTreeError(f"feature head {str(directory)!r} cannot be read: {str(exc).splitlines()[0]}") from None
    head = FeatureHead(config, state.pop("vocab_ids"), name=name or str(directory))
    missing, unexpected = head.load_state_dict(state, strict=False)
    if [m for m in missing if m != "vocab_ids"] or unexpected:
        raise DynaTreeError(f"feature head {str(directory)!r} does not match its config "
                            f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    if weights == "q4":
        head = head.to(device=device).eval()
        head.to_q4()  # from the saved float32 weights, then in `dtype` (bfloat16)
    else:
        head = head.to(device=device, dtype=dtype).eval()
    use_packed_linears(head, linear)
    return head


def check_head(head: FeatureHead, target, same_weights: bool = True) -> None:
    """A head drafts only for the target it was built for: same width, output rows and tokenizer, and
    (where the head recorded it, unless `same_weights` is False: a head continued on another model of
    its shape) the same output layer's `output_signature`."""
    hidden, rows = target_features(target.model)
    cfg = head.config
    if cfg.hidden_size != hidden:
        raise DynaTreeError(f"feature head {head.name!r} reads features of width {cfg.hidden_size}, but target "
                            f"{target.name!r} has hidden size {hidden}; it was built for {cfg.target!r}")
    if cfg.vocab_size != rows:
        raise DynaTreeError(f"feature head {head.name!r} was built for an output layer of {cfg.vocab_size} rows, "
                            f"target {target.name!r} has {rows}; it was built for {cfg.target!r}")
    if cfg.tokenizer_sha1 != tokenizer_fingerprint(target.tokenizer):
        raise DynaTreeError(f"feature head {head.name!r} was built for another tokenizer ({cfg.target!r}) "
                            f"than target {target.name!r}'s")
    if same_weights and cfg.output_signature is not None:
        have = output_signature(target.model)
        off = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(have, cfg.output_signature))
        if off > SIGNATURE_TOLERANCE:
            raise DynaTreeError(f"feature head {head.name!r} was built for {cfg.target!r}, a model with other weights "
                                f"than target {target.name!r} (same width and tokenizer; output-layer rows differ by "
                                f"up to {off:.0%}): train one for it with dynatree distill --kind eagle")
    if int(head.vocab_ids.max()) >= rows or int(head.vocab_ids.min()) < 0:
        raise DynaTreeError(f"feature head {head.name!r} proposes token ids outside the target's output layer")
    if head.vocab_ids.device != target.device:
        raise DynaTreeError(f"feature head is on {head.vocab_ids.device} but target on {target.device}; use one --device")
