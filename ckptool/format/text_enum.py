"""``TextEnum``: a closed set of strings (a finding's severity, a key's kind, a run's status...).

Each member *is* its string: it compares equal to it, prints as it (``str``, f-strings) and
serialises as it (``json.dumps``), so scripts that read the plain strings keep working while the
code names the set and its members.
"""

from __future__ import annotations

from enum import Enum


class TextEnum(str, Enum):
    """Base of ckptool's closed string sets: ``str(member) == member.value``."""

    def __str__(self) -> str:
        return self.value
