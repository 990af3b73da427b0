"""A datastore: text the target wrote itself, indexed for the n-gram drafter's look-ups.

Where the text so far offers no long match, the n-gram drafter (drafters/ngram.py) can propose
what followed the same few tokens in a datastore instead, in the manner of REST (retrieval-based
speculative decoding): here the datastore is the target's own greedy answers to many chat prompts
(`dynatree distill --kind store`), so it holds the phrasings the target repeats across answers.
A datastore is built for one target's tokenizer and checked against it on loading; it only ever
proposes tokens, so output stays exactly the target's whatever it holds.

The index: each position's next `order` tokens packed into one uint64 key (`bits` bits per token,
the separator between answers being the largest `bits`-bit value, never a token id), positions
sorted by key. Finding every earlier occurrence of n <= order tokens is two binary searches over
the keys; the tokens that followed them are the next token slot of those keys (already sorted,
counted by runs), or, for n == order, the tokens after the occurrences. Only the token array is
stored (`tokens.npy`); the keys are rebuilt on loading (one sort, ~0.1 s per million tokens).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .draftspec import STORE_CONFIG_FILE as CONFIG_FILE  # what makes a directory a datastore
from .draftspec import spec_path
from .errors import DynaTreeError
from .files import replaced_atomically, write_text_atomic

TOKENS_FILE = "tokens.npy"
MAX_ORDER = 4  # longest n-gram looked up (measured: orders 5-6 add nothing on chat, docs/results/drafting-levers)
MIN_ORDER = 2  # shortest: what follows one token anywhere in the store is no better than the text's own counts


@dataclass(frozen=True)
class StoreInfo:
    """What a datastore was built from and for (datastore.json)."""

    target: str  # the target whose text it holds (name as loaded)
    vocab_size: int  # the target's vocabulary size (token ids are below it)
    tokenizer_sha1: str  # featurehead.tokenizer_fingerprint of the target's tokenizer
    order: int  # longest n-gram looked up (MIN_ORDER..MAX_ORDER, at most 64 // bits)
    tokens: int  # tokens held (answers with `order` tokens of their prompts before them)
    segments: int  # answers held (separated so no n-gram spans two)


def bits_for(vocab_size: int) -> int:
    """Bits per packed token: every id below vocab_size and the separator (all ones) fit."""
    return max(1, int(vocab_size).bit_length())


def sep_for(vocab_size: int) -> int:
    """The separator between answers: the largest packed value, never a token id."""
    return (1 << bits_for(vocab_size)) - 1


def order_for(vocab_size: int, order: int = MAX_ORDER) -> int:
    """`order` clamped to what one 64-bit key packs for this vocabulary; a one-line error below MIN_ORDER."""
    fits = min(order, 64 // bits_for(vocab_size))
    if fits < MIN_ORDER:
        raise DynaTreeError(f"a datastore looks up {MIN_ORDER}..{MAX_ORDER} tokens; {order} (of which {fits} fit "
                            f"64-bit keys for a {vocab_size}-token vocabulary) is too few")
    return fits


class Datastore:
    """The token array of a datastore and its sorted n-gram index."""

    def __init__(self, tokens: np.ndarray, info: StoreInfo, name: str):
        self.info, self.name = info, name
        self.bits = bits_for(info.vocab_size)
        self.sep = sep_for(info.vocab_size)
        self.order = info.order
        if not MIN_ORDER <= self.order <= order_for(info.vocab_size):
            raise DynaTreeError(f"datastore {name!r}: order {self.order} is not in {MIN_ORDER}.."
                                f"{order_for(info.vocab_size)} for a {info.vocab_size}-token vocabulary")
        n = len(tokens)
        toks = np.concatenate([np.asarray(tokens), np.full(self.order, self.sep)]).astype(
            np.uint16 if self.sep < 1 << 16 else np.uint32)  # 2 bytes a token for vocabularies up to 65535
        keys = np.zeros(n, dtype=np.uint64)
        for j in range(self.order):
            keys = (keys << np.uint64(self.bits)) | toks[j: j + n].astype(np.uint64)
        self.positions = np.argsort(keys, kind="stable").astype(np.int32 if n < 1 << 31 else np.int64)
        self.keys = keys[self.positions]  # 8 bytes a token: with positions and tokens ~14 bytes a token in memory
        self.tokens = toks

    def __len__(self) -> int:
        return len(self.keys)

    def _range(self, gram: list[int]) -> tuple[int, int]:
        """[lo, hi) of the sorted keys whose first len(gram) tokens are `gram`."""
        packed = 0
        for t in gram:
            packed = (packed << self.bits) | int(t)  # Python ints: numpy's small integers would overflow
        shift = self.bits * (self.order - len(gram))
        lo = int(np.searchsorted(self.keys, np.uint64(packed << shift), side="left"))
        hi = int(np.searchsorted(self.keys, np.uint64((packed + 1) << shift), side="left"))
        return lo, hi

    def continuations(self, context: list[int], min_order: int = MIN_ORDER) -> tuple[int, list[tuple[int, int]]]:
        """(n, [(token, count), ...] most frequent first, then smaller id) for the longest suffix of
        `context` of n tokens (min_order <= n <= order) that the datastore holds followed by a token;
        (0, []) when none."""
        for n in range(min(self.order, len(context)), max(min_order, 1) - 1, -1):
            gram = context[-n:]
            if any(not 0 <= t < self.sep for t in gram):
                continue  # an id outside the vocabulary this store was built for: no occurrence
            lo, hi = self._range(gram)
            if lo == hi:
                continue
            if n < self.order:  # the next slot of the keys, sorted within the range: count runs
                shift = np.uint64(self.bits * (self.order - n - 1))
                nxt = (self.keys[lo:hi] >> shift) & np.uint64(self.sep)
                starts = np.concatenate([[0], np.flatnonzero(nxt[1:] != nxt[:-1]) + 1])
                ids, counts = nxt[starts], np.diff(np.concatenate([starts, [hi - lo]]))
            else:
                ids, counts = np.unique(self.tokens[self.positions[lo:hi] + n], return_counts=True)
            keep = ids != self.sep
            ids, counts = ids[keep], counts[keep]
            if len(ids):
                order = np.lexsort((ids, -counts))
                return n, [(int(ids[i]), int(counts[i])) for i in order]
        return 0, []


def load_datastore(spec: str) -> Datastore:
    """The datastore a spec names (a shipped alias or a directory), or a one-line error naming what is
    wrong with it."""
    directory = spec_path(spec)
    try:
        raw = json.loads((directory / CONFIG_FILE).read_text())
        info = StoreInfo(**{k: raw[k] for k in StoreInfo.__dataclass_fields__})
        tokens = np.load(directory / TOKENS_FILE, allow_pickle=False)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DynaTreeError(f"{directory} is not a readable datastore ({type(e).__name__}: {e})") from e
    sep = sep_for(info.vocab_size)
    if (tokens.ndim != 1 or tokens.dtype.kind != "u" or len(tokens) != info.tokens
            or int((tokens == sep).sum()) != info.segments
            or (len(tokens) and int(tokens[tokens != sep].max(initial=0)) >= info.vocab_size)):
        raise DynaTreeError(f"{directory}: {TOKENS_FILE} does not match {CONFIG_FILE} (length, answers or token "
                            f"ids: unsigned ids below {info.vocab_size}, {info.segments} separators)")
    return Datastore(tokens, info, spec)


def check_store(store: Datastore, target) -> None:
    """A datastore drafts only for the tokenizer it was built with: a one-line error otherwise."""
    from .featurehead import tokenizer_fingerprint

    if store.info.vocab_size != target.vocab_size:
        raise DynaTreeError(f"datastore {store.name!r} holds token ids of a {store.info.vocab_size}-token vocabulary, "
                            f"target {target.name!r} has {target.vocab_size}; it was built for {store.info.target!r}")
    if store.info.tokenizer_sha1 != tokenizer_fingerprint(target.tokenizer):
        raise DynaTreeError(f"datastore {store.name!r} was built with another tokenizer ({store.info.target!r}) "
                            f"than target {target.name!r}'s")


def from_answers(target, answers, order: int = MAX_ORDER, name: str = "datastore") -> Datastore:
    """A datastore of `answers` ((token ids, where the answer starts) pairs: prompt then the target's
    answer) for `target`: each answer with the last `order` tokens of its prompt before it (so an
    answer's first tokens are found after the chat template's generation prompt), answers kept apart
    by the separator."""
    from .featurehead import tokenizer_fingerprint

    order = order_for(target.vocab_size, order)
    pieces = [list(ids[max(0, start - order):]) + [sep_for(target.vocab_size)] for ids, start in answers]
    flat = np.array([t for p in pieces for t in p], dtype=np.int64)  # Datastore keeps them in 2 or 4 bytes
    info = StoreInfo(target=target.name, vocab_size=int(target.vocab_size),
                     tokenizer_sha1=tokenizer_fingerprint(target.tokenizer), order=order, tokens=len(flat),
                     segments=len(pieces))
    return Datastore(flat, info, name)


def save_datastore(store: Datastore, out: Path, record: dict | None = None) -> None:
    """Write `store` to the directory `out` (tokens.npy and datastore.json, each replaced atomically);
    `record` (how it was built) is saved beside its info."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with replaced_atomically(out / TOKENS_FILE, suffix=".npy") as tmp:  # np.save appends .npy to other names
        np.save(tmp, store.tokens[: store.info.tokens], allow_pickle=False)
    write_text_atomic(out / CONFIG_FILE, json.dumps({**asdict(store.info), "built": record or {}}, indent=1))
