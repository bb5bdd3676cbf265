"""Whether a stream's writer is still writing: what the stepping thread waits for.

The stepping thread (``stepper.py``) routes the next steps' events only once every
writer the last routing gave items has come back for more, so that a lagging loop
coalesces: a writer then finds several tokens queued and writes them in one go. This
module is the stream's part of that chain, which reaches from the socket to the stepper:

    socket full (app/edge/body_hot_path.py, h2_protocol.py) ──write_blocks.write_blocked()──>
    the request's streams, found through a context variable (app/edge/write_blocks.py)
    ──TokenStream.write_blocked()──> WriteMarks ──writing()/written()──> the hub's
    OpenStreams (any_writing: the stepper's ``hold``; none left: its ``caught_up``)

From an item queued until its reader comes back for more with the queue empty (or the
stream closes), the stream is *writing*. A reader a policy counts as behind is not
waited for, nor one whose writer said its write waits for the client (``blocked``: a
full socket, a shut HTTP/2 window), until that writer comes back for more: the others'
tokens must not wait for a reader that does not read (its policy deals with it).

Every method is sync and never a checkpoint: the stream calls them from ``close()``,
which runs in cancelled scopes and ``finally`` blocks.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

S = TypeVar("S")  # the stream (``TokenStream``), as the hub knows it
S_contra = TypeVar("S_contra", contravariant=True)


class WritingControl(Protocol[S_contra]):
    """The hub's side of the marks (``open_streams.OpenStreams``); sync, no checkpoint."""

    def writing(self, stream: S_contra) -> None: ...
    def written(self, stream: S_contra) -> None: ...


class WriteMarks(Generic[S]):
    """One stream's *writing* mark and its writer's *blocked* one (module docstring)."""

    __slots__ = ("_control", "_stream", "blocked", "writing")

    def __init__(self, stream: S, control: WritingControl[S]) -> None:
        self._stream = stream
        self._control = control
        self.writing = False  # the hub waits for this stream's writer
        self.blocked = False  # its write waits for the client, until it comes back

    def queued(self, *, keeps_up: bool = True, back: bool = False) -> None:
        """Items wait for the writer (``back``: a blocked write is done, the writer is
        back for what was queued meanwhile): the hub waits for it if its reader
        ``keeps_up`` and it is not blocked; a reader behind is not waited for (its
        policy deals with it)."""
        if back:
            self.blocked = False
        if not keeps_up:
            self.written()
        elif not self.writing and not self.blocked:
            self.writing = True
            self._control.writing(self._stream)

    def written(self) -> None:
        """Nothing waits for the writer: it came back with the queue empty, or the
        stream closed, or it ended from outside (a slow reader dropped, a shutdown),
        whose writer may be blocked in a write to a reader that does not read. The hub
        no longer waits for it: the stepper must not hold every other stream's tokens."""
        if self.writing:
            self.writing = False
            self._control.written(self._stream)

    def write_blocked(self) -> None:
        """The writer's write waits for the client: not waited for until it is back."""
        self.blocked = True
        self.written()
