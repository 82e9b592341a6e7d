"""One captured output stream of a sandboxed command, held under a byte cap.

Shared by every backend that reads a command's stdout and stderr itself (`runner.py` for
the process and bwrap backends, `docker_backend.py` for containers).

Invariants: `data` never holds more than `cap` bytes, and they are the first bytes the
command wrote; `seen` counts every byte it wrote, kept or dropped, so the stream was
truncated exactly when `seen > cap`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CappedStream:
    cap: int
    data: bytearray = field(default_factory=bytearray)
    seen: int = 0

    def feed(self, chunk: bytes) -> bool:
        """Keep what fits under the cap; True once the stream has passed it."""
        self.seen += len(chunk)
        room = self.cap - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        return self.truncated

    @property
    def truncated(self) -> bool:
        return self.seen > self.cap
