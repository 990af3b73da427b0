"""Training the draft LM (`dynatree distill`): a Llama-style LM sized by the config, optionally
initialised from another draft or from the target's embeddings, trained against the target's
top-k labels (lm_data.py).

Loss: cross-entropy of the draft against the target's top-k distribution, renormalised
over those k tokens. Agreement = how often the draft's argmax equals the target's.

`out/` holds, while training: `data.pt` (the labelled windows, reused on resume) and
`checkpoint.pt` (model, optimizer, step; written every `checkpoint_every` steps); at the
end lm_export.py writes the draft.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time
from pathlib import Path

import torch

from ..errors import DynaTreeError
from ..rng import seeded
from ..runtime import LoadedModel
from .common import batches, lr_at, resumed, save_atomic, warmup_of
from .lm_data import DistillConfig, _held_count, build_data
from .lm_export import write_draft


def draft_config(target: LoadedModel, cfg: DistillConfig):
    """A Llama config sized by `cfg` that shares the target's vocabulary and special tokens."""
    from transformers import LlamaConfig

    tc = target.model.config
    rope = getattr(tc, "rope_parameters", None) or {}
    return LlamaConfig(
        vocab_size=target.vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads,
        max_position_embeddings=target.context_length or 4096,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope.get("rope_theta", 10000.0))},
        tie_word_embeddings=True,
        bos_token_id=getattr(tc, "bos_token_id", None),
        eos_token_id=getattr(tc, "eos_token_id", None),
        pad_token_id=getattr(tc, "pad_token_id", None),
    )


def init_draft(target: LoadedModel, cfg: DistillConfig):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    with seeded(cfg.seed):  # (torch's global generators initialize the model: seeded, then given back)
        if cfg.init_draft:
            model = AutoModelForCausalLM.from_pretrained(Path(cfg.init_draft).expanduser(), dtype=torch.float32)
            if model.config.vocab_size != target.vocab_size:
                raise DynaTreeError(f"--init-draft {cfg.init_draft!r} has a vocabulary of {model.config.vocab_size} "
                                    f"tokens, the target {target.vocab_size}; it must be a draft for this target")
            return model
        model = LlamaForCausalLM(draft_config(target, cfg))
        if cfg.init_from_target:
            with torch.no_grad():
                emb = target.model.get_input_embeddings().weight.float().cpu()
                emb = emb - emb.mean(0, keepdim=True)
                q = min(cfg.hidden, emb.shape[1])
                _, _, v = torch.pca_lowrank(emb, q=q, center=False, niter=4)
                proj = emb @ v  # [V, q]: the target's embeddings in their q main directions
                proj = proj / proj.std() * model.config.initializer_range
                model.get_input_embeddings().weight[:, :q] = proj
        return model


def split(data: dict, eval_fraction: float) -> tuple[dict, dict]:
    """Per source: the last `eval_fraction` of windows (at least one, when there are two) are held out."""
    train, held = {}, {}
    for name, src in data["sources"].items():
        n = len(src["tokens"])
        k = _held_count(n, eval_fraction)
        train[name] = {key: v[: n - k] for key, v in src.items()}
        if k:
            held[name] = {key: v[n - k:] for key, v in src.items()}
    return train, held


def distill_loss(logits: torch.Tensor, top_ids: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy against the target's renormalised top-k, and top-1 agreement.

    logits [B, T, V], top_ids [B, T, k], top_p [B, T, k] -> (loss, agreement) scalars.
    """
    logits = logits.float()
    logp = logits.gather(-1, top_ids.long()) - logits.logsumexp(-1, keepdim=True)  # no [B, T, V] log-softmax copy
    p = top_p.float()
    p = p / p.sum(-1, keepdim=True)
    loss = -(p * logp).sum(-1).mean()
    agree = (logits.argmax(-1) == top_ids[..., 0].long()).float().mean()
    return loss, agree


def _batch(train: dict, rows: list[tuple[str, int]], device) -> tuple[torch.Tensor, ...]:
    pick = lambda key: torch.stack([train[s][key][i] for s, i in rows]).to(device)  # noqa: E731
    return pick("tokens").long(), pick("top_ids"), pick("top_p")


@torch.no_grad()
def evaluate(model, held: dict, device, batch: int) -> dict:
    """Held-out loss and agreement per source (position-weighted)."""
    model.eval()
    out = {}
    for name, src in held.items():
        losses, agrees, n = 0.0, 0.0, 0
        for i in range(0, len(src["tokens"]), batch):
            rows = [(name, j) for j in range(i, min(i + batch, len(src["tokens"])))]
            ids, top_ids, top_p = _batch(held, rows, device)
            loss, agree = distill_loss(model(ids).logits, top_ids, top_p)
            losses += loss.item() * len(rows)
            agrees += agree.item() * len(rows)
            n += len(rows)
        out[name] = {"loss": losses / n, "agreement": agrees / n}
    model.train()
    return out


def distill(target: LoadedModel, out: Path, cfg: DistillConfig, resume: bool = False, progress: bool = True,
            command: list[str] | None = None) -> dict:
    """Train a draft for `target` into `out`; return the summary written to out/distill.json."""
    from tqdm.auto import tqdm

    cfg.validate()
    out = Path(out)
    ckpt_path, data_path = out / "checkpoint.pt", out / "data.pt"
    if not resume and ((out / "config.json").exists() or ckpt_path.exists()):
        raise DynaTreeError(f"{out} already holds a draft or a checkpoint; pass --resume to continue it, "
                            "or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    timings = {}

    data = torch.load(data_path, weights_only=True) if data_path.exists() else None
    if data is not None and data["key"] != cfg.data_key():
        raise DynaTreeError(f"{data_path} was built with other data options ({data['key']}); "
                            "use the same options or another --out")
    if data is None:
        t0 = time.perf_counter()
        data = build_data(target, cfg, progress)
        data["info"]["build_s"] = time.perf_counter() - t0
        save_atomic(data, data_path)
    train, held = split(data, cfg.eval_fraction)
    rows = [(name, i) for name, src in train.items() for i in range(len(src["tokens"]))]
    if not rows:
        raise DynaTreeError("the data gave no training windows; raise --corpus-tokens or lower --seq-len")

    device = target.device
    model = init_draft(target, cfg).to(device)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95))
    step, history, prior_s, state = 0, [], 0.0, None
    if resume and ckpt_path.exists():
        state = resumed(ckpt_path, cfg)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, history, prior_s = state["step"], state["history"], state["train_s"]
    warmup = warmup_of(cfg, state, history)

    feed = batches(rows, cfg.batch_size, step, random.Random(cfg.seed))
    bar = tqdm(total=cfg.steps, initial=step, desc="distill", unit="step", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)
    t0 = time.perf_counter()
    avg_loss = avg_agree = None
    while step < cfg.steps:
        ids, top_ids, top_p = _batch(train, next(feed), device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg, warmup)
        loss, agree = distill_loss(model(ids).logits, top_ids, top_p)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        avg_loss = loss.item() if avg_loss is None else 0.95 * avg_loss + 0.05 * loss.item()
        avg_agree = agree.item() if avg_agree is None else 0.95 * avg_agree + 0.05 * agree.item()
        bar.set_postfix_str(f"moving avg: loss {avg_loss:.3f} | agreement {avg_agree:.1%}", refresh=False)
        bar.update(1)
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            # training figures are moving averages (weight 0.05 per step); held-out ones are exact
            history.append({"step": step, "train_loss_moving_avg": avg_loss, "train_agreement_moving_avg": avg_agree,
                            "held_out": evaluate(model, held, device, cfg.batch_size)})
            save_atomic({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                          "history": history, "config": dataclasses.asdict(cfg), "warmup": warmup,
                          "train_s": prior_s + time.perf_counter() - t0}, ckpt_path)
    bar.close()
    timings["train_s"] = prior_s + time.perf_counter() - t0
    final = evaluate(model, held, device, cfg.batch_size) if held else {}
    return write_draft(model, target, out, cfg, data["info"], final, history, timings, command)
