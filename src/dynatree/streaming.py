"""Text as it is decoded: `stream()` runs one decode on a thread of its own and hands its text over
piece by piece (`TextIterator`), the `Result` at the end."""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Callable

from .api import Prepared, blocked_here, build_request, prepare, run
from .errors import DynaTreeError
from .request import Request
from .result import Result


def stream(prompt: str | list[dict] | None = None, method: str = "dynatree", *,
           on_tokens: Callable[[list[int]], None] | None = None, **arguments) -> TextIterator:
    """`generate()` as a stream: iterating gives the text as it is decoded (the pieces `run`'s
    `on_text` gets; together they are the result's `text`), and `.result` the `Result` when the
    decode has ended. The arguments are `generate()`'s and are checked here, before any decoding:

        with dynatree.stream("Write a haiku", chat=True) as pieces:
            for piece in pieces:
                print(piece, end="", flush=True)
        print(pieces.result.stats.tokens_per_s)

    The decode runs on a thread of its own, and uses the models until that thread ends: leaving the
    `with` block (or `close()`) before the end ends the decode after the step it is in
    (`finish_reason` "cancelled") and waits for it (through a compile or the cost curve's measurement
    if it was in one), so that the next decode on these models starts alone. An iterator dropped
    without closing (or a Ctrl-C while reading) asks its decode to end the same way without waiting;
    one left unread but still referenced decodes on to its end, and another decode on the same target
    waits for it (decodes on one target run one after the other: `api.run`).
    `on_tokens` gets each committed group of token ids on the decode's thread."""
    if on_tokens is not None and not callable(on_tokens):  # (run() checks it too, but on the decode's thread)
        raise DynaTreeError(f"on_tokens must be a function of the new token ids, got {type(on_tokens).__name__}")
    fields = {f.name for f in dataclasses.fields(Request)}  # generate()'s keywords are Request's fields and options
    given = {k: v for k, v in arguments.items() if k in fields and k != "options"}
    options = {k: v for k, v in arguments.items() if k not in given}
    return TextIterator(prepare(build_request("stream", prompt, method, options, **given)), on_tokens)


class TextIterator:
    """The text of one decode as it comes (`stream()`): an iterator of text pieces, `result` at the end.

    `run(job)` runs on a daemon thread and hands its `on_text` pieces over a queue; an error in the
    decode is raised where the pieces are read (or by `result`). `close()` (also on leaving a `with`
    block, or when the iterator is dropped) asks the decode to end after its current step."""

    def __init__(self, job: Prepared, on_tokens: Callable[[list[int]], None] | None = None):
        # the thread holds the channel, not this object, so that dropping the iterator cancels the decode
        self._channel = _Channel()
        held = blocked_here(job)
        if held:  # its thread would wait for the decode whose callback is starting it, which would wait for the stream
            raise DynaTreeError(f"a stream cannot start inside a callback of a decode that holds {held} (reading it "
                                "there would wait for that decode to end): use generate() there, which runs on the "
                                "callback's own thread")
        self._ended = False  # the iteration has seen the end
        self._thread = threading.Thread(target=self._channel.decode, args=(job, on_tokens), name="dynatree-stream",
                                        daemon=True)
        self._thread.start()

    def __iter__(self) -> TextIterator:
        return self

    def __next__(self) -> str:
        if self._ended:
            raise StopIteration
        try:
            piece = self._channel.pieces.get()
        except BaseException:  # Ctrl-C while waiting: the decode ends too
            self._channel.cancel.set()
            raise
        if piece is _Channel.END:
            self._ended = True
            self.result  # noqa: B018 (raises the decode's error, if any)
            raise StopIteration
        return piece

    @property
    def result(self) -> Result:
        """The decode's `Result`, once it has ended (waits for it; raises the decode's error)."""
        try:
            self._thread.join()
        except BaseException:  # Ctrl-C while waiting: the decode ends too
            self._channel.cancel.set()
            raise
        if self._channel.error is not None:
            raise self._channel.error
        return self._channel.result

    def close(self) -> None:
        """End the decode after the step it is in (its result says "cancelled" if it had not ended)."""
        self._channel.cancel.set()
        self._thread.join()

    def __enter__(self) -> TextIterator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self._channel.cancel.set()


class _Channel:
    """What a `TextIterator`'s decoding thread shares with it: the pieces, the cancel flag, the outcome."""

    END = object()  # the last item of `pieces`

    def __init__(self):
        self.pieces: queue.SimpleQueue = queue.SimpleQueue()
        self.cancel = threading.Event()
        self.result: Result | None = None
        self.error: BaseException | None = None

    def decode(self, job: Prepared, on_tokens) -> None:
        try:
            self.result = run(job, on_tokens, self.pieces.put, self.cancel.is_set)
        except BaseException as exc:  # noqa: BLE001 (handed to the reading thread, raised there)
            self.error = exc
        finally:
            self.pieces.put(self.END)
