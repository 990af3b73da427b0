"""Training of EAGLE-3's "training-time test"): pass 1 feeds every position with the
target's true feature of the position before; pass j feeds each position with pass j-1's
*predicted* feature of the position before and attends to pass-1 keys up to j-1 positions back
plus its own deeper chain, exactly what a tree node at depth j-1 sees when drafting. Loss:
cross-entropy against the target's next token, or with `label_loss` 'soft' against the target's
distribution over the sub-vocabulary (pass j weighted `decay`^(j-1)) plus
`feature_loss` x smooth-L1 of pass 1's predicted feature against the target's. The
decoder layer starts from the target's last layer when the shapes agree.

`out/` holds while training `data/` (the data in parts of `chunk` conversations, saved as each is
built: a stopped build resumes, and a larger one, e.g. more `--self-prompts` into the same `--out`
with `--resume`, reuses them; an older run's single `data.pt` is still read) and `checkpoint.pt`; at the end the head (`--draft out/` loads it), `distill.json` and a README.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..cpu import onednn_linear_problem
from ..errors import DynaTreeError
from ..featurehead import FeatureHead, HeadConfig, check_head, load_head, target_features, tokenizer_fingerprint
from ..rng import seeded
from ..runtime import LoadedModel
from .common import batches, lr_at, resumed, save_atomic, warmup_of
from .eagle_data import EagleConfig, build_data
from .eagle_export import write_head
from .output_loss import IGNORE, output_loss


def new_head(target: LoadedModel, cfg: EagleConfig, vocab_ids: torch.Tensor) -> FeatureHead:
    """A head shaped by the target (unless set), its decoder layer copied from the target's last
    layer when that is a Llama-shaped layer of the same sizes; fc starts as [0, I] (pass the feature)."""
    hidden, rows = target_features(target.model)
    tcfg = target.model.config
    config = HeadConfig(
        target=target.name, hidden_size=hidden, vocab_size=rows, tokenizer_sha1=tokenizer_fingerprint(target.tokenizer),
        draft_vocab=len(vocab_ids), heads=cfg.heads or getattr(tcfg, "num_attention_heads", 8),
        kv_heads=cfg.kv_heads or (cfg.heads if cfg.heads else getattr(tcfg, "num_key_value_heads", None)
                                  or tcfg.num_attention_heads),
        ffn=cfg.ffn or getattr(tcfg, "intermediate_size", 4 * hidden),
        context=target.context_length or 8192, rms_norm_eps=getattr(tcfg, "rms_norm_eps", 1e-5),
    )
    with seeded(cfg.seed):  # (torch's global generators initialize the layer: seeded, then given back)
        head = FeatureHead(config, vocab_ids, name="feature-head")
        with torch.no_grad():
            head.fc.weight.zero_()
            head.fc.weight[:, hidden:] = torch.eye(hidden)
            head.fc.weight[:, :hidden].normal_(0.0, 0.02)
            layers = getattr(getattr(target.model, "model", None), "layers", None)
            last = layers[-1] if layers is not None else None
            own = head.body.layers[0]
            if last is not None and type(last).__name__ == type(own).__name__:
                theirs = {k: v for k, v in last.state_dict().items()}
                mine = own.state_dict()
                if all(k in theirs and theirs[k].shape == v.shape for k, v in mine.items()):
                    own.load_state_dict({k: theirs[k].float() for k in mine})
    return head.float()


# config attributes by which transformers' causal LMs change their logits after the output layer
# (a soft-cap: Gemma 2, jev; a scale or divisor: Granite, HyperCLOVAX, Cohere, Falcon-H1, muse_*), each with
# the value that leaves them unchanged (None does too). (MPT's config has a logit_scale its model never reads.)
LOGIT_CHANGES = {"final_logit_softcapping": 0, "softcap": 0, "logits_scaling": 1, "logit_scale": 1,
                 "lm_head_multiplier": 1, "output_multiplier": 1}


def check_plain_logits(target: LoadedModel) -> None:
    """Soft labels take the target's distribution to be softmax(feature @ output rows); a target whose
    config changes its logits after that product (`LOGIT_CHANGES`) or whose output layer has a bias gets a
    one-line error naming it rather than training towards a distribution that is not its own. (Hard labels
    are the target's own argmax of its real logits, whatever these do.)"""
    config = target.model.config.get_text_config()
    changed = [(k, getattr(config, k)) for k, plain in LOGIT_CHANGES.items()
               if hasattr(config, k) and getattr(config, k) not in (None, plain)
               and not (k == "logit_scale" and config.model_type == "mpt")]
    bias = getattr(target.model.get_output_embeddings(), "bias", None)
    why = (f"logits changed after the output layer ({', '.join(f'{k} = {v}' for k, v in changed)})" if changed else
           "an output-layer bias" if bias is not None else None)
    if why:
        raise DynaTreeError(f"--label-loss soft needs logits that are the last feature times the output layer; "
                            f"{target.name} ({config.model_type}) has {why}: use --label-loss hard")


def vocab_tables(target: LoadedModel, head_vocab: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the loss and `evaluate` read of a head's sub-vocabulary `head_vocab` (target token ids): each
    target token's index in it (-1: outside) and the target's output-layer rows of those tokens (float32)."""
    sub_index = torch.full((target.vocab_size,), -1, dtype=torch.long)
    sub_index[head_vocab.cpu()] = torch.arange(len(head_vocab))
    weight = target.model.get_output_embeddings().weight.detach()
    return sub_index, weight[head_vocab.to(weight.device)].float()


def segment_masks(segment: torch.Tensor, local: torch.Tensor, unroll: int, window: int = 0) -> list[torch.Tensor]:
    """The attention mask of every pass for rows packed several sequences to a batch row (`make_batch`), as
    boolean masks [batch, 1, rows, depth * rows] (True: attend), where `segment` [batch, rows] names each
    row's sequence (-1: padding) and `local` is its index in that sequence. In pass `depth` a row sees
    pass-1 keys of its own sequence at local index <= its own - (depth - 1), and pass-i key r - (depth - i)
    when that row is in its sequence (its own key of pass `depth` always: no row is left without a key).
    With a `window` W > 0 a row at local index r sees pass-1 keys from r - W on only, as a drafter under
    KVWindow(0, W) does; the later passes' keys (at most unroll - 1 back) stay visible whatever W."""
    B, L = segment.shape
    same = segment[:, :, None] == segment[:, None, :]
    if window > 0:
        same = same & (local[:, None, :] >= local[:, :, None] - window)
    r = torch.arange(L, device=segment.device)
    diagonals = []  # diagonals[back]: key r - back, when in the row's sequence
    for back in range(unroll):
        diagonal = torch.zeros(B, L, L, dtype=torch.bool, device=segment.device)
        diagonal[:, r[back:], r[back:] - back] = local[:, back:] >= back
        diagonals.append(diagonal)
    return [torch.cat([same & (local[:, None, :] <= local[:, :, None] - (depth - 1))]
                      + [diagonals[depth - i] for i in range(2, depth + 1)], dim=2)[:, None]
            for depth in range(1, unroll + 1)]


def unrolled_loss(head: FeatureHead, embed, out_rows, batch: dict, cfg: EagleConfig,
                  window: int = 0) -> tuple[torch.Tensor, list]:
    """Loss and per-pass top-1 agreement (hits, rows, hits on answer rows, answer rows) for a batch
    of sequences (see module doc); with `loss_rows` 'answers' the loss is taken on answer rows only. A
    `window` > 0 lets each row attend only that far back (`segment_masks`: a probe of ../eagle-window;
    training and the drafter use none)."""
    from transformers import DynamicCache

    device = out_rows.device  # the target's: batches are built on the CPU, trained where the target is
    batch = {k: v.to(device) for k, v in batch.items()}
    tokens, feats, labels, valid, positions, segment, local = (
        batch[k] for k in ("tokens", "features", "labels", "valid", "positions", "segment", "local"))
    with torch.no_grad():  # the target's embeddings stay frozen
        embeds = embed(tokens).float()
    cache = DynamicCache()
    total, stats = 0.0, []
    prev = None
    masks = segment_masks(segment, local, cfg.unroll, window)
    for depth in range(1, cfg.unroll + 1):
        # pass 1 reads the target's true feature of the position before each row; pass j the
        # previous pass's prediction at row r - 1 (zeros at a sequence's first row, as at a batch row's
        # first: they reach only rows not counted at their depth, but keep packed sequences apart)
        feature_in = feats if depth == 1 else torch.where(
            (local == 0)[..., None], 0.0, torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1))
        out = head(embeds, feature_in, positions, masks[depth - 1], cache)
        rows = valid & (local >= depth - 1)  # rows that exist at this depth
        # the output layer, its loss and argmax on those rows only (not on a batch's padding), a block of
        # rows at a time (output_loss.py): they are most of a step's time
        mine, answer = out[rows], batch["answer"][rows]
        learn = batch["covered"][rows]  # rows whose label the sub-vocabulary holds
        if cfg.loss_rows == "answers":
            learn = learn & answer
        teacher = batch["next_features"][rows] if cfg.label_loss == "soft" else None  # (the target's own f_{r+1})
        ce, best = output_loss(mine, out_rows.detach(),  # (the target's output layer stays frozen)
                               torch.where(learn, batch["sub_labels"][rows], IGNORE), teacher=teacher)
        if bool(learn.any()):
            total = total + (cfg.decay ** (depth - 1)) * ce
            if depth == 1 and cfg.feature_loss:
                total = total + cfg.feature_loss * F.smooth_l1_loss(mine[learn], batch["next_features"][rows][learn])
        hit = batch["head_vocab"][best] == labels[rows]
        stats.append((int(hit.sum()), int(rows.sum()), int((hit & answer).sum()), int(answer.sum())))
        prev = out
    return total, stats


def noisy_features(feats: torch.Tensor, share: float, seed: int) -> torch.Tensor:
    """`feats` ([..., hidden]) with uniform noise of `share` times each feature's RMS added
    (`--feature-noise`): f + share * rms(f) * U(-1, 1), drawn from a generator seeded by `seed` (the
    training loop gives each step its own, so a resumed run replays the same noise). Padding rows (all
    zeros) stay zeros. A copy; `share` 0 gives `feats` back."""
    if not share:
        return feats
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(feats.shape, generator=gen, dtype=feats.dtype) * 2 - 1
    return feats + share * feats.pow(2).mean(-1, keepdim=True).sqrt() * u


def noise_seed(cfg: EagleConfig, step: int) -> int:
    """The seed of step `step`'s feature noise (apart from the data's sampling seeds, eagle_data's)."""
    return cfg.seed * 1_000_003 + 900_007 + step


ROW_MULTIPLE = 64  # batch rows' length is rounded up to this (make_batch): few distinct shapes, bounded kernel caches


def make_batch(data: dict, picked: list[int], seq_len: int, sub_index: torch.Tensor, head_vocab: torch.Tensor,
               pack: bool = True, multiple: int = ROW_MULTIPLE) -> dict:
    """Rows r of a sequence of n tokens (the last seq_len of 0..n-2): input token x_{r+1} at position
    r+1 with feature f_r; label the target's argmax at r+1 and feature f_{r+1}. A row is an answer
    row when its label is the target's choice of an answer token (position r+2 at or after the
    answer's start; every row when the start is unknown): what drafting meets.

    With `pack` the sequences are packed into as few batch rows as first-fit (longest first) allows,
    each no longer than the longest sequence (so attention, quadratic in a batch row's length, costs
    no more per batch row than unpacked), `segment` naming each row's sequence (-1: padding) and `local`
    its index in it, which the masks and the unrolled passes follow (`segment_masks`): the same loss as
    one sequence per batch row, without the head's work on most of the padding (half of a batch of chat
    turns). Without it, one sequence per batch row, right-padded.

    The batch rows' length is rounded up to a `multiple` (padding rows: segment -1, never counted, so the
    rows may exceed seq_len when it is not a multiple): the CPU's attention kernels keep state per input
    shape that nothing bounds, so few distinct lengths keep a long run's memory bounded, for up to
    multiple - 1 padding rows more per batch row (measured: docs/results/eagle-train-speed, "Memory")."""
    if multiple < 1:
        raise ValueError(f"make_batch: multiple must be at least 1, got {multiple}")
    rows = [min(seq_len, len(data["tokens"][i]) - 1) for i in picked]
    width = max(rows)
    places, fill = [], []  # (batch row, offset) per picked sequence; rows filled per batch row
    for k in (sorted(range(len(picked)), key=lambda k: -rows[k]) if pack else range(len(picked))):
        b = next((b for b, f in enumerate(fill) if f + rows[k] <= width), None) if pack else None
        if b is None:
            b = len(fill)
            fill.append(0)
        places.append((k, b, fill[b]))
        fill[b] += rows[k]
    B, L = len(fill), -(-max(fill) // multiple) * multiple
    H = data["features"][picked[0]].shape[1]
    tokens = torch.zeros(B, L, dtype=torch.long)
    feats = torch.zeros(B, L, H)
    nxt = torch.zeros(B, L, H)
    labels = torch.full((B, L), -1, dtype=torch.long)
    positions = torch.zeros(B, L, dtype=torch.long)
    valid = torch.zeros(B, L, dtype=torch.bool)
    answer = torch.zeros(B, L, dtype=torch.bool)
    segment = torch.full((B, L), -1, dtype=torch.long)
    local = torch.zeros(B, L, dtype=torch.long)
    starts = data.get("answer_from") or [None] * len(data["tokens"])
    for k, b, o in sorted(places):
        i, m = picked[k], rows[k]
        n = len(data["tokens"][i])
        start = n - 1 - m  # first row
        r = torch.arange(start, n - 1)
        # slices, converted by copy_ (indexing with `r` gathered copies first: 3x slower)
        tokens[b, o:o + m].copy_(data["tokens"][i][start + 1: n])
        feats[b, o:o + m].copy_(data["features"][i][start: n - 1])
        nxt[b, o:o + m].copy_(data["features"][i][start + 1: n])
        labels[b, o:o + m].copy_(data["labels"][i][start + 1: n])
        positions[b, o:o + m] = r + 1
        valid[b, o:o + m] = True
        answer[b, o:o + m] = True if starts[i] is None else r + 2 >= starts[i]
        segment[b, o:o + m] = k
        local[b, o:o + m] = torch.arange(m)
    sub = sub_index[labels.clamp(min=0)]
    return {"tokens": tokens, "features": feats, "next_features": nxt, "labels": labels, "sub_labels": sub.clamp(min=0),
            "valid": valid, "answer": answer, "covered": sub >= 0,  # labels outside the sub-vocabulary: counted as misses, no loss
            "positions": positions, "segment": segment, "local": local, "head_vocab": head_vocab}


@torch.no_grad()
def evaluate(head, embed, out_rows, data, held, cfg, sub_index, head_vocab, window: int = 0) -> dict:
    """Held-out top-1 agreement with the target per depth (pass), over all rows and over answer rows
    (what drafting meets: the prompt's rows, the chat template's above all, are easier), and the
    share of labels the sub-vocabulary holds; `window` as for `unrolled_loss`."""
    head.eval()
    hits = [[0, 0, 0, 0] for _ in range(cfg.unroll)]
    covered = total = 0
    for s in range(0, len(held), cfg.batch_size):
        batch = make_batch(data, held[s: s + cfg.batch_size], cfg.seq_len, sub_index, head_vocab)
        # (the loss is not used: taken against hard labels, which cost no teacher product)
        _, stats = unrolled_loss(head, embed, out_rows, batch, dataclasses.replace(cfg, label_loss="hard"), window)
        for d, counts in enumerate(stats):
            hits[d] = [a + b for a, b in zip(hits[d], counts)]
        real = batch["labels"] >= 0
        covered += int((sub_index[batch["labels"].clamp(min=0)] >= 0)[real].sum())
        total += int(real.sum())
    head.train()
    return {"agreement_by_depth": [h / max(n, 1) for h, n, _, _ in hits],
            "answer_agreement_by_depth": [h / max(n, 1) for _, _, h, n in hits],
            "vocab_coverage": covered / max(total, 1)}


def warn_emulated_bfloat16(cfg: EagleConfig, device: torch.device) -> str | None:
    """Warn (stderr; the line is returned) when `--train-dtype bfloat16` would run emulated: on a CPU where
    oneDNN has no bfloat16 products (an AVX2-only CPU), autocast's bfloat16 is not the "about twice as fast"
    the option promises but ~80x slower than float32 (measured: docs/results/eagle-specialize).
    A warning, not an error: the result is the same, and a user may want the dtype's numerics anyway."""
    if cfg.train_dtype != "bfloat16" or torch.device(device).type != "cpu":
        return None
    problem = onednn_linear_problem(torch.bfloat16)
    if problem is None:
        return None
    line = (f"dynatree: warning: --train-dtype bfloat16 runs emulated on this CPU ({problem}), about 80x slower "
            "than --train-dtype float32")
    print(line, file=sys.stderr)
    return line


def distill_eagle(target: LoadedModel, out: Path, cfg: EagleConfig, resume: bool = False, progress: bool = True,
                  command: list[str] | None = None) -> dict:
    """Train a feature head for `target` into `out`; return the summary written to out/distill.json."""
    from tqdm.auto import tqdm

    cfg.validate()
    warn_emulated_bfloat16(cfg, target.device)
    target_features(target.model)  # a target whose last hidden state cannot be read fails here, before any work
    if cfg.label_loss == "soft":
        check_plain_logits(target)
    out = Path(out)
    ckpt_path, data_path = out / "checkpoint.pt", out / "data.pt"
    if not resume and ((out / "feature_head.json").exists() or ckpt_path.exists()):
        raise DynaTreeError(f"{out} already holds a head or a checkpoint; pass --resume to continue it, "
                            "or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    # data.pt: the whole data set of an earlier build (kept for the runs that have one); else the
    # parts in out/data/, built now where missing
    data = torch.load(data_path, weights_only=False) if data_path.exists() else None
    if data is not None and data["key"] != cfg.data_key():
        raise DynaTreeError(f"{data_path} was built with other data options ({data['key']}); "
                            "use the same options or another --out")
    if data is None:
        t0 = time.perf_counter()
        parts = Path(cfg.data_dir).expanduser() if cfg.data_dir else out / "data"
        data = build_data(target, cfg, progress, parts=parts)
        data["info"]["build_s"] = time.perf_counter() - t0  # this run's (reused parts cost nothing)
    n = len(data["tokens"])
    idx = list(range(n))
    random.Random(cfg.seed).shuffle(idx)
    n_held = max(1, round(n * cfg.eval_fraction))
    held, train = sorted(idx[:n_held]), idx[n_held:]
    if not train:
        raise DynaTreeError("the data gave too few conversations to train on")

    counts = torch.bincount(torch.cat([data["labels"][i].long() for i in train]), minlength=target.vocab_size)
    start_from = None
    if cfg.init_head:  # continue an existing head: its sub-vocabulary too
        start_from = load_head(Path(cfg.init_head).expanduser(), name=cfg.init_head, device=target.device)
        check_head(start_from, target, same_weights=False)  # (a head of another model of this shape may start it;
        # write_head signs the result for this target)
        head_vocab = start_from.vocab_ids.cpu()
    else:
        head_vocab = counts.argsort(descending=True)[: min(cfg.draft_vocab, target.vocab_size)].sort().values
    sub_index, out_rows = vocab_tables(target, head_vocab)
    train_coverage = float(counts[head_vocab].sum() / counts.sum())

    head = (new_head(target, cfg, head_vocab) if start_from is None else start_from.float().train()).to(target.device)
    embed = target.model.get_input_embeddings()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    step, history, prior_s, state = 0, [], 0.0, None
    if resume and ckpt_path.exists():
        state = resumed(ckpt_path, cfg)
        head.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, history, prior_s = state["step"], state["history"], state["train_s"]
    warmup = warmup_of(cfg, state, history)
    head.train()
    feed = batches(train, cfg.batch_size, step, random.Random(cfg.seed + 1))
    bar = tqdm(total=cfg.steps, initial=step, desc="distill eagle", unit="step", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    t0 = time.perf_counter()
    avg = None
    while step < cfg.steps:
        batch = make_batch(data, next(feed), cfg.seq_len, sub_index, head_vocab)
        # (the noise, training only, on what pass 1 reads; the feature loss's targets stay the target's own)
        batch["features"] = noisy_features(batch["features"], cfg.feature_noise, noise_seed(cfg, step))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg, warmup, floor=0.05)
        with torch.autocast(out_rows.device.type, dtype=torch.bfloat16, enabled=cfg.train_dtype == "bfloat16"):
            loss, stats = unrolled_loss(head, embed, out_rows, batch, cfg)
        opt.zero_grad(set_to_none=True)
        if torch.is_tensor(loss):  # else no row of the batch had a label to learn (e.g. no answer row): no update
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        loss = float(loss.detach() if torch.is_tensor(loss) else loss)  # (a tensor that needs grad warns)
        step += 1
        agree = [h / max(t, 1) for h, t, _, _ in stats]
        avg = agree if avg is None else [0.95 * a + 0.05 * b for a, b in zip(avg, agree)]
        bar.set_postfix_str(f"step loss {loss:.3f} | moving avg agreement by depth "
                            + " ".join(f"{a:.0%}" for a in avg),
                            refresh=False)
        bar.update(1)
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            # the step's own loss, and agreement as a moving average (weight 0.05 per step)
            history.append({"step": step, "train_step_loss": loss, "train_agreement_moving_avg": avg,
                            "held_out": evaluate(head, embed, out_rows, data, held, cfg, sub_index, head_vocab)})
            save_atomic({"model": head.state_dict(), "optimizer": opt.state_dict(), "step": step, "history": history,
                          "config": dataclasses.asdict(cfg), "warmup": warmup, "train_s": prior_s + time.perf_counter() - t0}, ckpt_path)
    bar.close()
    train_s = prior_s + time.perf_counter() - t0
    final = evaluate(head, embed, out_rows, data, held, cfg, sub_index, head_vocab)
    info = dict(data["info"], train_conversations=len(train), held_out_conversations=len(held),
                train_vocab_coverage=train_coverage)
    return write_head(head, target, out, cfg, info, final, history,
                      {"build_s": data["info"].get("build_s"), "train_s": train_s}, command)
